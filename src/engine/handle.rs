//! The async-friendly side of the engine: submit a request, get its event stream; drop the
//! stream (or call `abort`) to cancel.

use super::core::EngineLoop;
use super::kv_events::Outbox;
use super::observer::Nothing;
use super::shared::{Command, Shared};
use super::speculative::Speculator;
use super::{EngineConfig, EngineStats, Event, KvEventBatch, Observer, Request};
use crate::kv::KvCache;
use crate::loaded::LoadedModel;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Full now; the same request may fit later.
    #[error("server overloaded: {0} sequences are already waiting; retry later")]
    Overloaded(usize),
    /// The request is wrong (or can never fit); `param` names the offending field.
    #[error("{message}")]
    Invalid { message: String, param: Option<&'static str> },
    #[error("the engine has shut down")]
    ShutDown,
}

fn invalid(param: &'static str, message: String) -> SubmitError {
    SubmitError::Invalid { message, param: Some(param) }
}

/// Running sequences a hybrid model's state cache allows: `--max-num-seqs`, lowered (as
/// vLLM's cache bounds its concurrency) until their states (`per_seq` bytes each) take at
/// most half of what the snapshots (`snapshot_bytes`) leave, so the attention layers keep
/// the rest for KV blocks. The real Qwen3.5-35B-A3B holds 66 MB a sequence: 64 would not
/// fit in the default 1 GiB.
fn state_slots(config: &EngineConfig, per_seq: usize, snapshot_bytes: usize) -> anyhow::Result<usize> {
    let room = config.kv_cache_memory.saturating_sub(snapshot_bytes) / 2;
    let fits = room / per_seq.max(1);
    anyhow::ensure!(
        fits > 0,
        "--kv-cache-memory {} bytes does not hold one sequence's recurrent state ({per_seq} bytes) beside {snapshot_bytes} bytes of snapshots and the KV blocks; raise it or lower --state-snapshots",
        config.kv_cache_memory
    );
    Ok(config.max_num_seqs.min(fits))
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
        mut config: EngineConfig,
        observer: Arc<dyn Observer>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(config.max_num_seqs > 0, "--max-num-seqs must be at least 1");
        anyhow::ensure!(config.max_num_batched_tokens > 0, "--max-num-batched-tokens must be at least 1");
        anyhow::ensure!(config.block_size > 0, "--block-size must be at least 1");
        let c = model.model.config.clone();
        let kv_dtype = model.model.kv_dtype(config.kv_cache_dtype);
        let per_block = KvCache::bytes_per_block(kv_dtype, &c.kv_shapes(), config.block_size);
        // A hybrid model's recurrent state: one slot per running sequence, and the prefix
        // cache's snapshots, off the top.
        let per_state = 4 * c.state_floats();
        let snapshots = match (per_state, config.prefix_caching, config.state_snapshots) {
            (0, _, _) | (_, false, _) => 0,
            (_, true, Some(n)) => n,
            (_, true, None) => (config.kv_cache_memory / 8 / per_state).min(super::MAX_AUTO_SNAPSHOTS),
        };
        // With drafts, the state after each draft row of every sequence too.
        let drafts = config.speculative.as_ref().map_or(0, |s| s.num_speculative_tokens);
        let state_bytes = if per_state == 0 {
            0
        } else {
            let asked = config.max_num_seqs;
            config.max_num_seqs =
                state_slots(&config, per_state.saturating_mul(1 + drafts), snapshots.saturating_mul(per_state))?;
            let states = config.max_num_seqs.saturating_mul(1 + drafts).saturating_add(snapshots);
            let state_bytes = states.saturating_mul(per_state);
            let lowered = if config.max_num_seqs < asked {
                format!(" (not --max-num-seqs {asked}: --kv-cache-memory holds no more; the rest wait)")
            } else {
                String::new()
            };
            eprintln!(
                "weft: recurrent state {:.2} MB per sequence: {} slots{lowered} and {snapshots} prefix snapshots, {} MB",
                per_state as f64 / 1e6,
                config.max_num_seqs,
                state_bytes / 1_000_000
            );
            state_bytes
        };
        let num_blocks = (config.kv_cache_memory - state_bytes) / per_block;
        anyhow::ensure!(
            num_blocks > 0,
            "--kv-cache-memory {} bytes is less than one KV block ({per_block} bytes)",
            config.kv_cache_memory
        );
        let ctx = c.max_position_embeddings;
        let max_model_len = if config.max_model_len == 0 { ctx } else { config.max_model_len.min(ctx) };
        let shared = Arc::new(Shared {
            model,
            config: config.clone(),
            waiting: AtomicUsize::new(0),
            max_model_len,
            alive: AtomicBool::new(true),
            stats: Mutex::new(EngineStats::default()),
            capacity_tokens: num_blocks * config.block_size,
            state_snapshots: snapshots,
            observer,
            kv_events: Mutex::new(None),
        });
        // The pools are allocated (and their pages mapped) before the handle exists, so the
        // first requests do not wait for them.
        let kv = KvCache::new(kv_dtype, &c.kv_shapes(), num_blocks, config.block_size).with_states(c.state_floats());
        let spec = match &shared.config.speculative {
            Some(cfg) => Some(Speculator::new(
                cfg,
                &shared.model,
                shared.capacity_tokens,
                config.block_size,
                config.max_num_batched_tokens,
                config.kv_cache_dtype,
            )?),
            None => None,
        };
        let outbox = config.kv_events.map(|capacity| {
            let (outbox, rx) = Outbox::new(capacity);
            *shared.kv_events.lock().unwrap_or_else(|p| p.into_inner()) = Some(rx);
            outbox
        });
        let (tx, rx) = mpsc::channel();
        let pool = super::thread_pool(config.threads)?;
        let loop_shared = shared.clone();
        std::thread::Builder::new().name("weft-engine".into()).spawn(move || {
            // Whatever way the loop ends, handles must see it.
            struct Dead(Arc<Shared>);
            impl Drop for Dead {
                fn drop(&mut self) {
                    self.0.alive.store(false, Ordering::SeqCst);
                }
            }
            let _dead = Dead(loop_shared.clone());
            pool.install(|| EngineLoop::new(loop_shared, kv, spec, rx, outbox).run());
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

    /// The prefix cache's events, once (`None` when `kv_events` is off or they were taken).
    pub fn kv_events(&self) -> Option<tokio::sync::mpsc::Receiver<KvEventBatch>> {
        self.shared.kv_events.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    pub fn stats(&self) -> EngineStats {
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// False once the engine loop has ended; requests then fail with `ShutDown`.
    pub fn is_alive(&self) -> bool {
        self.shared.alive.load(Ordering::SeqCst)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// Longest sequence (prompt + output) this engine serves.
    pub fn max_model_len(&self) -> usize {
        self.shared.max_model_len
    }

    /// Tokens the whole KV cache holds: no one sequence can be longer.
    pub fn capacity_tokens(&self) -> usize {
        self.shared.capacity_tokens
    }

    /// Refuses a call that would submit `sequences` at once (prompts × `n`) if it could
    /// never be queued, so the client gets a 400 rather than a 429 that invites retrying.
    pub fn check_fan_out(&self, sequences: usize) -> Result<(), SubmitError> {
        let max = self.shared.config.max_waiting_requests;
        if sequences > max {
            return Err(invalid(
                "n",
                format!(
                    "the request asks for {sequences} sequences (prompts × n), more than the {max} this server queues at once"
                ),
            ));
        }
        Ok(())
    }

    /// What [`EngineHandle::submit`] would refuse the request for, without queueing it.
    pub fn check(&self, request: &Request) -> Result<(), SubmitError> {
        self.validate(request)?;
        self.check_fan_out(request.n)
    }

    /// Checks a request and queues it; its events arrive on the returned stream.
    pub fn submit(&self, request: Request) -> Result<RequestStream, SubmitError> {
        self.check(&request)?;
        if !self.is_alive() {
            return Err(SubmitError::ShutDown);
        }
        let max = self.shared.config.max_waiting_requests;
        let waiting = &self.shared.waiting;
        let n = request.n;
        if waiting.fetch_add(n, Ordering::SeqCst) + n > max {
            waiting.fetch_sub(n, Ordering::SeqCst);
            return Err(SubmitError::Overloaded(max));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = unbounded_channel();
        if self
            .tx
            .send(Command::Submit { id, request: Box::new(request), events, submitted: std::time::Instant::now() })
            .is_err()
        {
            waiting.fetch_sub(n, Ordering::SeqCst);
            return Err(SubmitError::ShutDown);
        }
        Ok(RequestStream { id, rx })
    }

    /// Cancels a request; its blocks are freed at the next step.
    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(Command::Abort(id));
    }

    /// Every client-controlled number is checked here, whatever the entry point (HTTP,
    /// batch, library), with checked arithmetic and the configured caps.
    fn validate(&self, r: &Request) -> Result<(), SubmitError> {
        let c = &self.shared.model.model.config;
        let lim = &self.shared.config.limits;
        let vocab = c.vocab_size;
        if r.prompt.is_empty() {
            return Err(invalid(
                "prompt",
                "the prompt is empty (this model adds no BOS token, so there is nothing to continue)".into(),
            ));
        }
        if let Some(&bad) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid("prompt", format!("prompt token id {bad} is outside the vocabulary ({vocab})")));
        }
        if r.stop.max_tokens == 0 && r.n != 1 {
            return Err(invalid("max_tokens", "max_tokens 0 (only scoring the prompt) needs n = 1".into()));
        }
        if r.stop.min_tokens > r.stop.max_tokens {
            return Err(invalid(
                "min_tokens",
                format!("min_tokens ({}) is over max_tokens ({})", r.stop.min_tokens, r.stop.max_tokens),
            ));
        }
        if r.n == 0 || r.n > lim.max_n {
            return Err(invalid("n", format!("n must be between 1 and {}, got {}", lim.max_n, r.n)));
        }
        let ctx = self.shared.max_model_len;
        if r.prompt.len() >= ctx {
            return Err(invalid(
                "prompt",
                format!(
                    "the prompt has {} tokens, more than fit in this server's context length of {ctx} (max_model_len)",
                    r.prompt.len()
                ),
            ));
        }
        let total = r.prompt.len().checked_add(r.stop.max_tokens).filter(|&t| t <= ctx).ok_or_else(|| {
            invalid(
                "max_tokens",
                format!(
                    "the prompt ({} tokens) plus max_tokens ({}) is over the context length of {ctx} (max_model_len)",
                    r.prompt.len(),
                    r.stop.max_tokens
                ),
            )
        })?;
        if total > self.shared.capacity_tokens {
            return Err(invalid(
                "max_tokens",
                format!(
                    "the request needs {total} tokens of KV cache but the cache holds {} (raise --kv-cache-memory)",
                    self.shared.capacity_tokens
                ),
            ));
        }
        let stops = &r.stop.stop_strings;
        if stops.len() > lim.max_stop_strings {
            return Err(invalid(
                "stop",
                format!("at most {} stop strings are allowed, got {}", lim.max_stop_strings, stops.len()),
            ));
        }
        if let Some(s) = stops.iter().find(|s| s.len() > lim.max_stop_string_bytes) {
            return Err(invalid(
                "stop",
                format!("a stop string may have at most {} bytes, got {}", lim.max_stop_string_bytes, s.len()),
            ));
        }
        let ids = &r.stop.stop_token_ids;
        if ids.len() > lim.max_stop_token_ids {
            return Err(invalid(
                "stop_token_ids",
                format!("at most {} stop_token_ids are allowed, got {}", lim.max_stop_token_ids, ids.len()),
            ));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid("stop_token_ids", format!("stop token id {bad} is outside the vocabulary ({vocab})")));
        }
        if r.sampling.logit_bias.len() > lim.max_logit_bias {
            return Err(invalid(
                "logit_bias",
                format!(
                    "logit_bias may have at most {} entries, got {}",
                    lim.max_logit_bias,
                    r.sampling.logit_bias.len()
                ),
            ));
        }
        if let Some(k) = r.prompt_logprobs.filter(|&k| k > lim.max_logprobs) {
            return Err(invalid(
                "prompt_logprobs",
                format!("prompt_logprobs must be at most {}, got {k}", lim.max_logprobs),
            ));
        }
        if let Some(k) = r.sampling.logprobs.filter(|&k| k > lim.max_logprobs) {
            return Err(invalid("logprobs", format!("logprobs must be at most {}, got {k}", lim.max_logprobs)));
        }
        r.sampling.validate(vocab).map_err(|e| invalid(e.param, e.message))
    }
}
