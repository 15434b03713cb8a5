//! Whether a draft pays: how often draft tokens are accepted, and how many are worth
//! their rows in a step.

/// How often draft tokens are accepted, recent drafts weighing most: per sequence, and
/// pooled over the engine's sequences (the prior a sequence starts from).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Acceptance {
    hits: f64,
    tries: f64,
    /// Weight kept by the past at each verified draft.
    decay: f64,
}

/// The pooled estimate before any draft was verified.
pub const FIRST_PRIOR: f64 = 0.7;
/// The prior's weight, in tries.
const PRIOR_TRIES: f64 = 2.0;
/// Weight kept by the past at each step whose drafts were judged not worth it, so a
/// sequence whose drafts stopped paying drifts back to the prior and tries again.
const REST: f64 = 0.95;

impl Acceptance {
    /// One sequence's: the last few drafts count.
    pub fn sequence() -> Self {
        Acceptance { hits: 0.0, tries: 0.0, decay: 0.8 }
    }

    /// The engine's, over every sequence: the last few hundred draft tokens count.
    pub fn pooled() -> Self {
        Acceptance { hits: 0.0, tries: 0.0, decay: 0.99 }
    }

    /// The estimated chance that a draft token is accepted, given that the ones before
    /// were, starting from `prior`.
    pub fn rate(&self, prior: f64) -> f64 {
        (self.hits + PRIOR_TRIES * prior) / (self.tries + PRIOR_TRIES)
    }

    /// A draft of `drafted` tokens had its first `accepted` accepted: `accepted` trials
    /// succeeded, and one failed unless all did.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        let failed = usize::from(accepted < drafted);
        self.hits = self.hits * self.decay + accepted as f64;
        self.tries = self.tries * self.decay + (accepted + failed) as f64;
    }

    /// A step went by in which drafts were not worth proposing.
    pub fn rest(&mut self) {
        self.hits *= REST;
        self.tries *= REST;
    }
}

/// Draft tokens worth verifying, at most `max`, for drafts accepted at `rate`, when a token
/// of this step costs `token_ms` (the step's predicted time over the tokens it makes, one per
/// decoding sequence) and each extra row costs `row_ms`.
///
/// Draft token j adds a token only if it and all before it are accepted: probability
/// rate^j. A row is worth adding while it makes tokens faster than the step does. One stream
/// is bound by reading the weights, so `token_ms` is large against `row_ms` and even unlikely
/// drafts pay. Many streams make the step compute-bound: a stream's token costs little more
/// than a row, and only near-certain drafts still pay — speculation backs off by itself as
/// the batch grows.
pub fn worth(rate: f64, token_ms: f64, row_ms: f64, max: usize) -> usize {
    let mut k = 0;
    let mut p = rate;
    while k < max && p * token_ms > row_ms {
        k += 1;
        p *= rate;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acceptance_follows_recent_drafts_and_rests_back_to_the_prior() {
        let mut a = Acceptance::sequence();
        assert!((a.rate(0.6) - 0.6).abs() < 1e-9, "no drafts yet: the prior");
        for _ in 0..20 {
            a.record(4, 0);
        }
        assert!(a.rate(0.7) < 0.21, "{}", a.rate(0.7));
        for _ in 0..200 {
            a.rest();
        }
        assert!((a.rate(0.7) - 0.7).abs() < 0.01, "{}", a.rate(0.7));
        for _ in 0..20 {
            a.record(4, 4);
        }
        assert!(a.rate(0.7) > 0.95, "{}", a.rate(0.7));
        // The pooled estimate remembers longer: ten good drafts after a hundred bad ones
        // convince one sequence's estimate, not the pool's.
        let (mut pooled, mut one) = (Acceptance::pooled(), Acceptance::sequence());
        for accepted in [0; 100].into_iter().chain([4; 10]) {
            pooled.record(4, accepted);
            one.record(4, accepted);
        }
        assert!(pooled.rate(0.7) < 0.5 && one.rate(0.7) > 0.9, "{} {}", pooled.rate(0.7), one.rate(0.7));
    }

    #[test]
    fn drafts_shrink_as_the_step_turns_compute_bound() {
        // One stream: a 6 ms step, rows at 1 ms: tokens accepted 70% of the time pay up to
        // 0.7^5 · 6 = 1.01 ms.
        assert_eq!(worth(0.7, 6.0, 1.0, 8), 5);
        assert_eq!(worth(0.7, 6.0, 1.0, 3), 3, "capped");
        // 32 streams in a 64 ms step: a stream's token costs 2 ms, so only p > 0.5 pays.
        assert_eq!(worth(0.7, 64.0 / 32.0, 1.0, 8), 1);
        assert_eq!(worth(0.4, 64.0 / 32.0, 1.0, 8), 0);
        assert_eq!(worth(0.99, 6.0, 0.0, 4), 4, "free rows: the cap");
    }
}
