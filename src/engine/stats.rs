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
    /// Forward time by the kind of step: where a batch's wall time went.
    pub step_mix: StepMix,
    /// Forward time of the most recent steps, in milliseconds (at most [`RECENT_STEPS`]).
    pub recent_step_ms: std::collections::VecDeque<f32>,
}

/// Forward time split by what the steps carried: steps with prompt rows (prefill, alone or
/// beside decodes) against steps of decodes only, and of those the ones with few
/// sequences (a batch's stragglers, each step reading every weight for a handful of
/// tokens). A decode is a sequence with one token left to compute, as the scheduler
/// counts it, plus its draft rows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepMix {
    pub prompt_steps: u64,
    pub prompt_time: Duration,
    /// Prompt rows those steps computed, and the decodes that rode in them.
    pub prompt_rows: u64,
    pub prompt_step_decodes: u64,
    pub decode_steps: u64,
    pub decode_time: Duration,
    /// Sequences the decode-only steps carried, summed over them.
    pub decode_seqs: u64,
    /// Decode-only steps of at most [`FEW_DECODES`] sequences.
    pub few_steps: u64,
    pub few_time: Duration,
}

/// The most sequences a decode-only step carries to count as a straggler's ([`StepMix`]).
pub const FEW_DECODES: usize = 8;

impl StepMix {
    /// Counts one step: `rows` (rows, drafts) per sequence, which took `time`.
    pub fn add(&mut self, rows: impl Iterator<Item = (usize, usize)>, time: Duration) {
        let (mut decodes, mut prompt_rows) = (0u64, 0u64);
        for (n, draft) in rows {
            if n == 1 + draft {
                decodes += 1;
            } else {
                prompt_rows += n as u64;
            }
        }
        if prompt_rows > 0 {
            self.prompt_steps += 1;
            self.prompt_time += time;
            self.prompt_rows += prompt_rows;
            self.prompt_step_decodes += decodes;
        } else {
            self.decode_steps += 1;
            self.decode_time += time;
            self.decode_seqs += decodes;
            if decodes as usize <= FEW_DECODES {
                self.few_steps += 1;
                self.few_time += time;
            }
        }
    }

    /// Sequences a decode-only step carried, on average (0 without any).
    pub fn decode_batch(&self) -> f64 {
        self.decode_seqs as f64 / self.decode_steps.max(1) as f64
    }

    /// One line: each kind's forward time, steps and rows.
    pub fn summary(&self) -> String {
        format!(
            "steps with prompt rows {:.1} s ({} steps, {} prompt rows, {} decodes beside them); decode-only steps {:.1} s ({} steps, {:.1} sequences each), {:.1} s of them in {} steps of at most {FEW_DECODES} sequences",
            self.prompt_time.as_secs_f64(),
            self.prompt_steps,
            self.prompt_rows,
            self.prompt_step_decodes,
            self.decode_time.as_secs_f64(),
            self.decode_steps,
            self.decode_batch(),
            self.few_time.as_secs_f64(),
            self.few_steps,
        )
    }
}

/// Steps whose times [`EngineStats::recent_step_ms`] keeps.
pub const RECENT_STEPS: usize = 8192;
