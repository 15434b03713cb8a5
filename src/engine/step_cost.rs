//! How long a step takes, fitted online to the steps that ran, and the prefill budget it
//! implies (Sarathi-Serve's token budget, adapted to the load).
//!
//! A step's forward time is modelled as `fixed + per_row · rows + per_ctx · attended`,
//! where `fixed` is reading the weights once, `rows` pay the matrix multiplies and
//! `attended` (the context positions all rows attend to, in thousands) pays attention.
//! Least squares over exponentially decayed sums of the observations keeps the fit current
//! as the machine's speed drifts. The sums are kept per band of step sizes, and a band
//! forgets only as it gets new steps: hours of decode-only steps refresh the decode band
//! without erasing what the last prefill steps taught (a single decayed sum, or recursive
//! least squares, would lose or wind up exactly the terms a prefill step needs). A small
//! ridge keeps the fit defined while the steps seen cannot yet tell the terms apart. A step that carries decodes gets only as many prefill tokens as keep its
//! predicted time under the target, so a long prompt joining the batch delays each running
//! stream by a bounded amount instead of by its whole prefill.

/// Steps observed before the model is trusted to limit anything.
const WARM_STEPS: u32 = 8;
/// Weight of the past per step: about the last two hundred steps count.
const FORGET: f64 = 0.995;
/// Ridge added to the normal equations' diagonal.
const RIDGE: f64 = 1e-3;
/// Without `--max-step-ms`, a step may take this many times a decode-only step.
const DEFAULT_STRETCH: f64 = 3.0;
/// Prefill tokens a step with decodes may always carry, so new prompts keep moving.
pub const MIN_PREFILL: usize = 64;
/// Prefill tokens beside decodes while the model is still being fitted.
const WARM_PREFILL: usize = 128;

/// Upper bounds (rows) of the bands of step sizes whose observations decay separately.
const BANDS: [usize; 4] = [8, 32, 128, 512];

/// Decayed sums of x·xᵀ and x·ms over one band's steps.
#[derive(Clone, Copy, Default)]
struct Sums {
    xx: [[f64; 3]; 3],
    xy: [f64; 3],
}

pub struct StepCost {
    /// Coefficients of (1, rows, attended/1000), in milliseconds.
    w: [f64; 3],
    /// One per band of [`BANDS`], and one for larger steps.
    bands: [Sums; BANDS.len() + 1],
    seen: u32,
    /// The step-time target in milliseconds; `None`: a stretch of the decode-only time.
    target_ms: Option<f64>,
    /// The per-row term fitted to small steps alone, once their sizes vary: a row costs
    /// more there than the slope across all sizes says (small matrix multiplies use the
    /// cores less well), and small steps are where drafts are priced.
    small_row_ms: Option<f64>,
}

/// Bands (of [`BANDS`]) that hold the small steps.
const SMALL_BANDS: usize = 2;

fn features(rows: usize, attended: usize) -> [f64; 3] {
    [1.0, rows as f64, attended as f64 / 1000.0]
}

/// Context positions that `n` rows at positions `start..start + n` attend to in total.
pub fn attended(start: usize, n: usize) -> usize {
    n * start + n * (n + 1) / 2
}

impl StepCost {
    pub fn new(target_ms: Option<f64>) -> Self {
        StepCost { w: [0.0; 3], bands: Default::default(), seen: 0, target_ms, small_row_ms: None }
    }

    /// Predicted forward time in milliseconds.
    pub fn predict(&self, rows: usize, attended: usize) -> f64 {
        let x = features(rows, attended);
        (0..3).map(|i| self.w[i] * x[i]).sum()
    }

    /// What one more row, attending to `context` positions, adds to a small step, in
    /// milliseconds; `None` until the model is fitted.
    pub fn row_ms(&self, context: usize) -> Option<f64> {
        let row = self.w[1].max(self.small_row_ms.unwrap_or(0.0));
        (self.seen >= WARM_STEPS).then(|| (row + self.w[2] * context as f64 / 1000.0).max(0.0))
    }

    /// Records a step of `rows` rows attending to `attended` positions that took `ms`.
    pub fn observe(&mut self, rows: usize, attended: usize, ms: f64) {
        if !ms.is_finite() {
            return;
        }
        let x = features(rows, attended);
        let band = &mut self.bands[BANDS.iter().position(|&b| rows <= b).unwrap_or(BANDS.len())];
        for i in 0..3 {
            for j in 0..3 {
                band.xx[i][j] = band.xx[i][j] * FORGET + x[i] * x[j];
            }
            band.xy[i] = band.xy[i] * FORGET + x[i] * ms;
        }
        if let Some(w) = fit(&self.bands) {
            self.w = w;
        }
        let small = &self.bands[..SMALL_BANDS];
        let (n, sum, sq) =
            small.iter().fold((0.0, 0.0, 0.0), |(n, s, q), b| (n + b.xx[0][0], s + b.xx[0][1], q + b.xx[1][1]));
        // Rows must vary among the small steps (by about a row) before their own slope means anything.
        if n > 0.0 && sq / n - (sum / n) * (sum / n) >= 0.25 {
            self.small_row_ms = fit(small).map(|w| w[1]);
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

/// Least squares over the bands' sums, with the ridge.
fn fit(bands: &[Sums]) -> Option<[f64; 3]> {
    let (mut a, mut b) = ([[0.0; 3]; 3], [0.0; 3]);
    for band in bands {
        for (row, band_row) in a.iter_mut().zip(&band.xx) {
            row.iter_mut().zip(band_row).for_each(|(x, y)| *x += y);
        }
        b.iter_mut().zip(&band.xy).for_each(|(x, y)| *x += y);
    }
    for (i, row) in a.iter_mut().enumerate() {
        row[i] += RIDGE;
    }
    solve3(a, b)
}

/// Solves `a · w = b` by Gaussian elimination with partial pivoting; `None` if singular.
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for r in col + 1..3 {
            let f = a[r][col] / a[col][col];
            let pivot_row = a[col];
            a[r].iter_mut().zip(pivot_row).skip(col).for_each(|(x, p)| *x -= f * p);
            b[r] -= f * b[col];
        }
    }
    let mut w = [0.0; 3];
    for r in (0..3).rev() {
        let rest: f64 = (r + 1..3).map(|c| a[r][c] * w[c]).sum();
        w[r] = (b[r] - rest) / a[r][r];
    }
    Some(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solves_a_3x3_system() {
        let w = solve3([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 4.0, 1.0]], [4.0, 9.0, 12.0]).unwrap();
        let want = [1.0, 2.0, 3.0];
        assert!(w.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-9), "{w:?}");
        assert!(solve3([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 0.0, 1.0]], [1.0, 2.0, 3.0]).is_none());
    }

    /// A long run of identical decode steps does not wind the fit up: a prefill step's
    /// time is still predicted sensibly afterwards.
    #[test]
    fn identical_steps_do_not_wind_the_fit_up() {
        let law = |rows: usize, att: usize| 20.0 + 0.5 * rows as f64 + 2.0 * att as f64 / 1000.0;
        let mut c = StepCost::new(None);
        for i in 0..100 {
            let rows = 1 + (i * 37) % 300;
            c.observe(rows, attended(0, rows), law(rows, attended(0, rows)));
        }
        for _ in 0..5000 {
            c.observe(32, 4000, law(32, 4000));
        }
        let (rows, att) = (200, attended(0, 200));
        assert!((c.predict(rows, att) - law(rows, att)).abs() < 0.05 * law(rows, att), "{}", c.predict(rows, att));
    }

    /// Small steps cost more per row than the slope over all sizes: once their sizes vary,
    /// the row price comes from them, plus the attention to the row's context.
    #[test]
    fn rows_are_priced_by_the_small_steps() {
        let law = |rows: usize| if rows <= 32 { 6.0 + 1.5 * rows as f64 } else { 40.0 + 0.5 * rows as f64 };
        let mut c = StepCost::new(None);
        assert_eq!(c.row_ms(0), None, "not fitted");
        for i in 0..300 {
            let rows = [1, 300, 500][i % 3];
            c.observe(rows, 0, law(rows));
        }
        let global = c.row_ms(0).unwrap();
        assert!(global < 1.0, "one size of small step: the global slope {global}");
        for i in 0..300 {
            let rows = [1, 2, 5, 300][i % 4];
            c.observe(rows, 0, law(rows));
        }
        let small = c.row_ms(0).unwrap();
        assert!((small - 1.5).abs() < 0.1, "{small}");
        for i in 0..300 {
            let rows = [1, 2, 5, 300][i % 4];
            c.observe(rows, attended(1000, rows), law(rows) + 2.0 * attended(1000, rows) as f64 / 1000.0);
        }
        let at_2k = c.row_ms(2000).unwrap();
        assert!((at_2k - (1.5 + 4.0)).abs() < 0.3, "a row attending to 2000 positions: {at_2k}");
    }

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
