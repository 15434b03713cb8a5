//! The serving engine: one loop per model on its own thread (inside the rayon pool that
//! runs the kernels), fed through a channel by cheap, cloneable [`EngineHandle`]s. Each
//! iteration takes new and cancelled requests, asks the scheduler for a step, runs the model
//! over the ragged batch, samples, and sends every request its events.

mod core;
mod handle;
mod kv_events;
mod limits;
mod observer;
mod request;
mod shared;
pub mod speculative;
mod stats;
mod step_cost;
mod stop;

pub use handle::{EngineHandle, RequestStream, SubmitError};
pub use kv_events::KvEventBatch;
pub use limits::RequestLimits;
pub use observer::Observer;
pub use request::{Event, FinishReason, Request, Usage};
pub use stats::EngineStats;
pub use stop::{StopScan, StopStrings};

/// Engine settings; the same flags on every command that runs the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Worker threads for the kernels (0: one per core).
    pub threads: usize,
    /// Sequences in one step at most (1: strictly one request at a time).
    pub max_num_seqs: usize,
    /// Tokens in one step at most; longer prompts are prefilled in chunks.
    pub max_num_batched_tokens: usize,
    /// Bytes for the KV cache.
    pub kv_cache_memory: usize,
    /// Element type of the KV cache.
    pub kv_cache_dtype: crate::kv::KvCacheDtype,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Sequences (prompts × `n`) allowed to wait for a place in the batch; beyond that
    /// `submit` refuses with [`SubmitError::Overloaded`].
    pub max_waiting_requests: usize,
    /// Longest sequence (prompt + output) served, below the model's own context (0: the model's).
    pub max_model_len: usize,
    /// Caps on the sizes a client controls.
    pub limits: RequestLimits,
    /// Reuse the KV blocks of prompt prefixes seen before (automatic prefix caching).
    pub prefix_caching: bool,
    /// Recurrent-state snapshots kept for the prefix cache of a hybrid model (`None`: as
    /// many as an eighth of `kv_cache_memory` holds, at most [`MAX_AUTO_SNAPSHOTS`]).
    pub state_snapshots: Option<usize>,
    /// Target time of a step that carries decodes, in milliseconds: prefill tokens beside
    /// them are limited to fit. `None`: a few times a decode-only step, as measured.
    pub max_step_ms: Option<f64>,
    /// Speculative decoding: how drafts are proposed (`None`: off).
    pub speculative: Option<speculative::SpeculativeConfig>,
    /// Publish the prefix cache's events ([`EngineHandle::kv_events`]) through a queue of
    /// this many step batches (`None`: off).
    pub kv_events: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: 0,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            kv_cache_memory: 1 << 30,
            kv_cache_dtype: crate::kv::KvCacheDtype::Auto,
            block_size: 16,
            max_waiting_requests: 1024,
            max_model_len: 0,
            limits: RequestLimits::default(),
            prefix_caching: true,
            state_snapshots: None,
            max_step_ms: None,
            speculative: None,
            kv_events: None,
        }
    }
}

/// The most state snapshots kept when `state_snapshots` is not given.
pub const MAX_AUTO_SNAPSHOTS: usize = 256;

/// A rayon pool of `threads` workers (0: one per core) that all model work runs inside.
pub fn thread_pool(threads: usize) -> anyhow::Result<rayon::ThreadPool> {
    let mut b = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("weft-worker-{i}"));
    if threads > 0 {
        b = b.num_threads(threads);
    }
    Ok(b.build()?)
}
