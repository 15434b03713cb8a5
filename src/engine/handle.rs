//! The async-friendly side of the engine: submit a request, get its event stream; drop the
//! stream (or call `abort`) to cancel.

use super::core::{Command, EngineLoop};
use super::observer::Nothing;
use super::{EngineConfig, EngineStats, Event, Observer, Request};
use crate::kv::KvCache;
use crate::loaded::LoadedModel;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("server overloaded: {0} requests are already waiting; retry later")]
    Overloaded(usize),
    #[error("{0}")]
    Invalid(String),
    #[error("the engine has shut down")]
    ShutDown,
}

pub(super) struct Shared {
    pub model: Arc<LoadedModel>,
    pub config: EngineConfig,
    /// Submitted, not yet admitted to the running batch.
    pub waiting: AtomicUsize,
    pub stats: Mutex<EngineStats>,
    pub capacity_tokens: usize,
    pub observer: Arc<dyn Observer>,
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    next_id: Arc<AtomicU64>,
}

/// A request's events, in order; the stream ends after its last sample finishes.
pub struct RequestStream {
    pub id: u64,
    rx: UnboundedReceiver<Event>,
}

impl RequestStream {
    pub async fn recv(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// For synchronous callers (not from inside an async runtime).
    pub fn blocking_recv(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }
}

impl EngineHandle {
    /// Starts the engine loop on its own thread.
    pub fn start(model: Arc<LoadedModel>, config: EngineConfig) -> anyhow::Result<Self> {
        Self::start_observed(model, config, Arc::new(Nothing))
    }

    /// Starts the engine loop, reporting timings to `observer`.
    pub fn start_observed(
        model: Arc<LoadedModel>,
        config: EngineConfig,
        observer: Arc<dyn Observer>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(config.max_num_seqs > 0, "--max-num-seqs must be at least 1");
        anyhow::ensure!(config.max_num_batched_tokens > 0, "--max-num-batched-tokens must be at least 1");
        anyhow::ensure!(config.block_size > 0, "--block-size must be at least 1");
        let c = model.model.config.clone();
        let per_block = KvCache::bytes_per_block(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim);
        let num_blocks = config.kv_cache_memory / per_block;
        anyhow::ensure!(
            num_blocks > 0,
            "--kv-cache-memory {} bytes is less than one KV block ({per_block} bytes)",
            config.kv_cache_memory
        );
        let shared = Arc::new(Shared {
            model,
            config,
            waiting: AtomicUsize::new(0),
            stats: Mutex::new(EngineStats::default()),
            capacity_tokens: num_blocks * config.block_size,
            observer,
        });
        // The pools are allocated (and their pages mapped) before the handle exists, so the
        // first requests do not wait for them.
        let kv = KvCache::new(c.num_layers, num_blocks, config.block_size, c.num_kv_heads, c.head_dim);
        let (tx, rx) = mpsc::channel();
        let pool = super::thread_pool(config.threads)?;
        let loop_shared = shared.clone();
        std::thread::Builder::new().name("weft-engine".into()).spawn(move || {
            pool.install(|| EngineLoop::new(loop_shared, kv, rx).run());
        })?;
        Ok(EngineHandle { tx, shared, next_id: Arc::new(AtomicU64::new(1)) })
    }

    pub fn model(&self) -> &LoadedModel {
        &self.shared.model
    }

    /// The model, shareable with another engine.
    pub fn model_arc(&self) -> Arc<LoadedModel> {
        self.shared.model.clone()
    }

    pub fn stats(&self) -> EngineStats {
        self.shared.stats.lock().unwrap().clone()
    }

    /// Checks a request and queues it; its events arrive on the returned stream.
    pub fn submit(&self, request: Request) -> Result<RequestStream, SubmitError> {
        self.validate(&request).map_err(SubmitError::Invalid)?;
        let max = self.shared.config.max_waiting_requests;
        let waiting = &self.shared.waiting;
        if waiting.fetch_add(1, Ordering::SeqCst) >= max {
            waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Overloaded(max));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = unbounded_channel();
        if self
            .tx
            .send(Command::Submit { id, request: Box::new(request), events, submitted: std::time::Instant::now() })
            .is_err()
        {
            waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShutDown);
        }
        Ok(RequestStream { id, rx })
    }

    /// Cancels a request; its blocks are freed at the next step.
    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(Command::Abort(id));
    }

    fn validate(&self, r: &Request) -> Result<(), String> {
        let c = &self.shared.model.model.config;
        if r.prompt.is_empty() {
            return Err("the prompt is empty (this model adds no BOS token, so there is nothing to continue)".into());
        }
        if let Some(&bad) = r.prompt.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(format!("prompt token id {bad} is outside the vocabulary ({})", c.vocab_size));
        }
        if r.stop.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        if r.n == 0 || r.n > self.shared.config.max_num_seqs.max(1) * 4 {
            return Err(format!("n must be between 1 and {}, got {}", self.shared.config.max_num_seqs * 4, r.n));
        }
        let total = r.prompt.len() + r.stop.max_tokens;
        if total > c.max_position_embeddings {
            return Err(format!(
                "the prompt ({} tokens) plus max_tokens ({}) is {total} tokens, over the model's context length of {}",
                r.prompt.len(),
                r.stop.max_tokens,
                c.max_position_embeddings
            ));
        }
        if total > self.shared.capacity_tokens {
            return Err(format!(
                "the request needs {total} tokens of KV cache but the cache holds {} (raise --kv-cache-memory)",
                self.shared.capacity_tokens
            ));
        }
        r.sampling.validate(c.vocab_size).map_err(|e| e.to_string())
    }
}
