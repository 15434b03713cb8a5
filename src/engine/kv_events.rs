//! The prefix cache's events on their way to a KV-aware router: each engine iteration's
//! events go out as one batch into a bounded queue, never waiting for it. When the queue is
//! full the batch is dropped and counted, and the next batch that fits starts with
//! `Cleared` and the whole cache as it then is, so a subscriber that missed events is whole
//! again.

use super::EngineStats;
use crate::kv::KvEvent;
use crate::scheduler::Scheduler;
use std::sync::Mutex;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::{Receiver, Sender};

/// One iteration's events, stamped with the wall-clock time they were sent (seconds since
/// the Unix epoch).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
}

/// The engine's end of the queue.
pub(super) struct Outbox {
    tx: Sender<KvEventBatch>,
    /// Events were dropped (or the cache restarted): send a snapshot next.
    resync: bool,
}

impl Outbox {
    /// A queue of `capacity` batches.
    pub fn new(capacity: usize) -> (Outbox, Receiver<KvEventBatch>) {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        (Outbox { tx, resync: false }, rx)
    }

    /// A snapshot is owed: events were dropped, or the cache restarted.
    pub fn pending(&self) -> bool {
        self.resync
    }

    /// The cache was replaced by an empty one: subscribers must forget everything.
    pub fn restart(&mut self) {
        self.resync = true;
    }

    /// Sends what happened since the last call. When the queue is full, the events taken
    /// now are counted as dropped (a snapshot refused again is not: it stands for events
    /// counted when they were dropped).
    pub fn send<S>(&mut self, sched: &mut Scheduler<S>, stats: &Mutex<EngineStats>) {
        let taken = sched.take_kv_events();
        if taken.is_empty() && !self.resync {
            return;
        }
        let dropped = taken.len() as u64;
        let events = if self.resync { sched.kv_snapshot() } else { taken };
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        match self.tx.try_send(KvEventBatch { ts, events }) {
            Ok(()) => self.resync = false,
            Err(TrySendError::Full(_)) => {
                self.resync = true;
                stats.lock().unwrap_or_else(|p| p.into_inner()).kv_events_dropped += dropped;
            }
            // Nobody listens any more; keep the books short.
            Err(TrySendError::Closed(_)) => self.resync = false,
        }
    }
}
