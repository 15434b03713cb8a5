//! Counters the engine publishes after every step, for metrics and benchmarks.

use std::time::Duration;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    /// Sequences waiting for the batch: submitted and not yet admitted, or preempted.
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and those found (their prefill skipped).
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// KV events dropped because their queue was full (a snapshot followed them).
    pub kv_events_dropped: u64,
    /// Full blocks the prefix cache holds (in use or idle).
    pub kv_blocks_cached: usize,
    /// A hybrid model's recurrent state (zero otherwise): bytes of one sequence's, the
    /// slots running sequences hold and there are, and the prefix snapshots held and kept.
    pub state_bytes_per_seq: usize,
    pub state_slots_used: usize,
    pub state_slots_total: usize,
    pub state_snapshots: usize,
    pub state_snapshots_total: usize,
    /// Steps that panicked; each failed its requests and restarted the engine.
    pub engine_failures: u64,
    pub steps: u64,
    /// Rows (tokens) in the last step.
    pub last_step_tokens: usize,
    /// Sequences in the last step.
    pub last_step_seqs: usize,
    pub prompt_tokens_total: u64,
    /// Speculative decoding: drafts verified, their tokens, and the tokens accepted.
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub generation_tokens_total: u64,
    /// Structured output: token masks computed, and the time they took (beside the forward
    /// pass, on whichever core was free).
    pub grammar_masks: u64,
    pub grammar_mask_time: Duration,
    /// Time in the model's forward pass, summed over steps.
    pub forward_time: Duration,
    /// Time in scheduling, sampling, detokenization and sending events, summed over steps.
    pub overhead_time: Duration,
    /// How a mixture of experts' rows spread over its experts (zero for a dense model), in
    /// every step and in steps of one decode row per sequence only.
    pub moe: crate::model::moe::Stats,
    pub moe_decode: crate::model::moe::Stats,
    /// Forward time of the most recent steps, in milliseconds (at most [`RECENT_STEPS`]).
    pub recent_step_ms: std::collections::VecDeque<f32>,
}

/// Steps whose times [`EngineStats::recent_step_ms`] keeps.
pub const RECENT_STEPS: usize = 8192;
