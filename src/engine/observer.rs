//! A hook for per-request timings and per-step sizes, so a server can keep latency
//! histograms without the engine knowing about metrics libraries.

use super::FinishReason;
use std::time::Duration;

/// Called from the engine thread; implementations must be quick.
pub trait Observer: Send + Sync {
    /// A step ran with `tokens` rows from `seqs` sequences, its forward pass taking `time`.
    fn step(&self, _tokens: usize, _seqs: usize, _time: Duration) {}
    /// A request's first token, `ttft` after it was submitted.
    fn first_token(&self, _ttft: Duration) {}
    /// A later token of one sample, `gap` after that sample's previous one.
    fn token(&self, _gap: Duration) {}
    /// A sample ended, `e2e` after its request was submitted.
    fn finished(&self, _reason: FinishReason, _e2e: Duration) {}
}

/// The default: observe nothing.
pub(super) struct Nothing;
impl Observer for Nothing {}
