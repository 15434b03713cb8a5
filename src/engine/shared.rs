//! What the handle and the engine loop share: the state both read, and the commands the
//! handle sends the loop.

use super::{EngineConfig, EngineStats, Event, Observer, Request};
use crate::loaded::LoadedModel;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A request's way into the loop, and its way out.
pub(super) enum Command {
    Submit { id: u64, request: Box<Request>, events: UnboundedSender<Event>, submitted: Instant },
    Abort(u64),
}

/// The engine's state that handles read without asking the loop.
pub(super) struct Shared {
    pub model: Arc<LoadedModel>,
    pub config: EngineConfig,
    /// Sequences submitted, not yet admitted to the running batch (a request counts `n`).
    pub waiting: AtomicUsize,
    /// Longest sequence served: the model's context, or less with `max_model_len`.
    pub max_model_len: usize,
    /// False once the engine thread has ended (shut down or died).
    pub alive: AtomicBool,
    pub stats: Mutex<EngineStats>,
    pub capacity_tokens: usize,
    /// Recurrent-state snapshots the prefix cache keeps (hybrid models; 0 otherwise).
    pub state_snapshots: usize,
    pub observer: Arc<dyn Observer>,
    /// The receiving end of the KV-event queue, until someone takes it.
    pub kv_events: Mutex<Option<tokio::sync::mpsc::Receiver<super::KvEventBatch>>>,
}
