//! How long a step takes, fitted online to the steps that ran, and the prefill budget it
//! implies (Sarathi-Serve's token budget, adapted to the load).
//!
//! A step's forward time is modelled as `fixed + per_row · rows + per_ctx · attended`,
//! where `fixed` is reading the weights once, `rows` pay the matrix multiplies and
//! `attended` (the context positions all rows attend to, in thousands) pays attention.
//! Recursive least squares with forgetting keeps the fit current as the machine's speed
//! drifts. A step that carries decodes gets only as many prefill tokens as keep its
//! predicted time under the target, so a long prompt joining the batch delays each running
//! stream by a bounded amount instead of by its whole prefill.

/// Steps observed before the model is trusted to limit anything.
const WARM_STEPS: u32 = 8;
/// Weight of the past per step: about the last hundred steps count.
const FORGET: f64 = 0.99;
/// Without `--max-step-ms`, a step may take this many times a decode-only step.
const DEFAULT_STRETCH: f64 = 3.0;
/// Prefill tokens a step with decodes may always carry, so new prompts keep moving.
pub const MIN_PREFILL: usize = 64;
/// Prefill tokens beside decodes while the model is still being fitted.
const WARM_PREFILL: usize = 128;

pub struct StepCost {
    /// Coefficients of (1, rows, attended/1000), in milliseconds.
    w: [f64; 3],
    /// Inverse correlation matrix of the recursive least squares fit.
    p: [[f64; 3]; 3],
    seen: u32,
    /// The step-time target in milliseconds; `None`: a stretch of the decode-only time.
    target_ms: Option<f64>,
}

fn features(rows: usize, attended: usize) -> [f64; 3] {
    [1.0, rows as f64, attended as f64 / 1000.0]
}

/// Context positions that `n` rows at positions `start..start + n` attend to in total.
pub fn attended(start: usize, n: usize) -> usize {
    n * start + n * (n + 1) / 2
}

impl StepCost {
    pub fn new(target_ms: Option<f64>) -> Self {
        let mut p = [[0.0; 3]; 3];
        for (i, row) in p.iter_mut().enumerate() {
            row[i] = 1e4;
        }
        StepCost { w: [0.0; 3], p, seen: 0, target_ms }
    }

    /// Predicted forward time in milliseconds.
    pub fn predict(&self, rows: usize, attended: usize) -> f64 {
        let x = features(rows, attended);
        (0..3).map(|i| self.w[i] * x[i]).sum()
    }

    /// Records a step of `rows` rows attending to `attended` positions that took `ms`.
    pub fn observe(&mut self, rows: usize, attended: usize, ms: f64) {
        if !ms.is_finite() {
            return;
        }
        let x = features(rows, attended);
        let px: Vec<f64> = (0..3).map(|i| (0..3).map(|j| self.p[i][j] * x[j]).sum()).collect();
        let denom = FORGET + (0..3).map(|i| x[i] * px[i]).sum::<f64>();
        let gain: Vec<f64> = px.iter().map(|v| v / denom).collect();
        let err = ms - self.predict(rows, attended);
        for (w, g) in self.w.iter_mut().zip(&gain) {
            *w += g * err;
        }
        for (row, g) in self.p.iter_mut().zip(&gain) {
            for (p, v) in row.iter_mut().zip(&px) {
                *p = (*p - g * v) / FORGET;
            }
        }
        self.seen += 1;
    }

    /// Prefill tokens a step may carry beside `decodes` decode rows attending to
    /// `decode_attended` positions; `None` when nothing is decoding. At least
    /// [`MIN_PREFILL`], at most `max`; a fixed cautious amount until the model is fitted.
    pub fn prefill_budget(&self, decodes: usize, decode_attended: usize, max: usize) -> Option<usize> {
        if decodes == 0 {
            return None;
        }
        if self.seen < WARM_STEPS {
            return Some(WARM_PREFILL.min(max));
        }
        let base = self.predict(decodes, decode_attended);
        let target = self.target_ms.unwrap_or(DEFAULT_STRETCH * base.max(0.1));
        let fits = |k: usize| self.predict(decodes + k, decode_attended + attended(0, k)) <= target;
        // The predicted time grows with k: binary search for the largest k that fits.
        let (mut lo, mut hi) = (0, max);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Some(lo.max(MIN_PREFILL).min(max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attended_counts_positions() {
        assert_eq!(attended(0, 3), 1 + 2 + 3);
        assert_eq!(attended(10, 2), 11 + 12);
    }

    /// Steps from a known linear law are learned, and the budget keeps a decode step's
    /// predicted time within the target.
    #[test]
    fn learns_a_linear_step_time_and_budgets_prefill() {
        let law = |rows: usize, att: usize| 20.0 + 0.5 * rows as f64 + 2.0 * att as f64 / 1000.0;
        let mut c = StepCost::new(None);
        assert_eq!(c.prefill_budget(4, 400, 512), Some(WARM_PREFILL), "not fitted yet: cautious");
        for i in 0..200 {
            let rows = 1 + (i * 37) % 300;
            let att = attended(i % 500, rows);
            c.observe(rows, att, law(rows, att));
        }
        assert!((c.predict(100, 5000) - law(100, 5000)).abs() < 0.5, "{}", c.predict(100, 5000));
        assert_eq!(c.prefill_budget(0, 0, 512), None, "nothing decoding: no limit");
        // 32 decodes: 20 + 16 + ~0 = 36 ms; the default target is 3x that.
        let k = c.prefill_budget(32, 1000, 512).unwrap();
        let t = c.predict(32 + k, 1000 + attended(0, k));
        assert!(t <= 3.0 * c.predict(32, 1000) + 1e-6 && k > MIN_PREFILL, "k {k}, {t} ms");
        let fixed = StepCost { target_ms: Some(40.0), ..c };
        assert_eq!(fixed.prefill_budget(32, 1000, 512), Some(MIN_PREFILL), "a tight target keeps the floor");
    }
}
