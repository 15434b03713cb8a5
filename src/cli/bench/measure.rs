//! What every benchmark shares: a seeded generator for workloads, driving requests through
//! an engine, their timings, and percentiles.

use crate::engine::{EngineHandle, Event, Request};
use anyhow::Result;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) fn parse_range(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s.split_once(':').ok_or_else(|| format!("expected MIN:MAX, got {s:?}"))?;
    let (a, b) =
        (a.parse().map_err(|_| format!("bad MIN in {s:?}"))?, b.parse().map_err(|_| format!("bad MAX in {s:?}"))?);
    if a == 0 || a > b {
        return Err(format!("need 0 < MIN <= MAX, got {s:?}"));
    }
    Ok((a, b))
}

/// A small deterministic generator for the workload (xorshift64*).
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(super) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    pub(super) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What one request saw: when it was sent, when each token arrived, which tokens.
pub(super) struct Timing {
    pub(super) sent: Instant,
    pub(super) tokens: Vec<Instant>,
    pub(super) ids: Vec<u32>,
}

impl Timing {
    /// Seconds from sending to the first token (none if no token came).
    pub(super) fn ttft(&self) -> Option<f64> {
        self.tokens.first().map(|f| (*f - self.sent).as_secs_f64())
    }
}

async fn read_stream(sent: Instant, mut stream: crate::engine::RequestStream) -> Timing {
    let (mut tokens, mut ids) = (Vec::new(), Vec::new());
    while let Some(ev) = stream.recv().await {
        if let Event::Token { id, .. } = ev {
            tokens.push(Instant::now());
            ids.push(id);
        }
    }
    Timing { sent, tokens, ids }
}

pub(super) fn random_prompt(rng: &mut Rng, len: usize, vocab: usize) -> Vec<u32> {
    // Skip the lowest ids, where models keep their special tokens.
    (0..len).map(|_| (300 + rng.next() % (vocab as u64 - 300)) as u32).collect()
}

/// Sends `reqs` at their offsets from now and waits for every token of every request.
pub(super) fn drive(engine: &EngineHandle, reqs: Vec<(Duration, Request)>) -> Result<Vec<Timing>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    rt.block_on(async {
        let start = Instant::now();
        let mut tasks = Vec::new();
        for (at, req) in reqs {
            tokio::time::sleep_until((start + at).into()).await;
            let sent = Instant::now();
            let stream = engine.submit(req)?;
            tasks.push(tokio::spawn(read_stream(sent, stream)));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await?);
        }
        Ok(out)
    })
}

/// `clients` closed-loop clients work through `reqs` in order, each sending its next
/// request when the previous one ended; timings come back in request order.
pub(super) fn drive_clients(engine: &EngineHandle, reqs: Vec<Request>, clients: usize) -> Result<Vec<Timing>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    rt.block_on(async {
        let reqs = Arc::new(reqs);
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..clients.max(1) {
            let (engine, reqs, next) = (engine.clone(), reqs.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                let mut done = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(r) = reqs.get(i) else { break };
                    let sent = Instant::now();
                    let stream = engine.submit(r.clone())?;
                    done.push((i, read_stream(sent, stream).await));
                }
                anyhow::Ok(done)
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await??);
        }
        all.sort_by_key(|(i, _)| *i);
        Ok(all.into_iter().map(|(_, t)| t).collect())
    })
}

/// The `p` quantile of `v` (sorted in place), interpolated between the two nearest values:
/// the median of an even count is the mean of the middle two.
pub(super) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let at = (v.len() - 1) as f64 * p;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (at - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::percentile;

    /// The median of two ratios is their mean, not the larger (1.83x and 0.83x: 1.33x).
    #[test]
    fn percentiles_interpolate() {
        assert!((percentile(&mut [1.83, 0.83], 0.5) - 1.33).abs() < 1e-12);
        assert_eq!(percentile(&mut [3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(percentile(&mut [4.0, 1.0, 3.0, 2.0], 1.0), 4.0);
        assert_eq!(percentile(&mut [4.0, 1.0, 3.0, 2.0], 0.0), 1.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }
}
