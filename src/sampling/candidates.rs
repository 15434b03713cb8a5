//! The tokens a draw picks among, found without sorting the vocabulary: the `k` most
//! likely by one scan against a rising threshold, the top-p nucleus by buckets of
//! log-weight, of which only the one where the mass is reached gets sorted. Sorting a
//! 150k-token row took milliseconds per draw, on the engine's one thread.

use std::cmp::Ordering;

/// Buckets per unit of log-weight: a bucket holds tokens within e^(1/16) of each other.
const PER_UNIT: f32 = 16.0;
/// Buckets in all, down to log-weight −64; anything less likely shares the last.
const BUCKETS: usize = 1024;

/// Token `a` before `b`: the higher logit first, the lower id on a tie.
fn before(x: &[f32], a: u32, b: u32) -> Ordering {
    x[b as usize].total_cmp(&x[a as usize]).then(a.cmp(&b))
}

/// The `k` tokens of highest logit in `x` (the lower id on a tie), most likely first.
pub fn top_k(x: &[f32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    let k = k.min(x.len());
    if k == 0 {
        return;
    }
    // Candidates no lower than the k-th best seen so far, cut back to k when the buffer fills.
    let cap = (2 * k).max(64);
    let mut floor: Option<f32> = None;
    for (i, &v) in x.iter().enumerate() {
        if floor.is_some_and(|f| v.total_cmp(&f) == Ordering::Less) {
            continue;
        }
        out.push(i as u32);
        if out.len() == cap {
            out.select_nth_unstable_by(k - 1, |&a, &b| before(x, a, b));
            out.truncate(k);
            floor = Some(x[out[k - 1] as usize]);
        }
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, |&a, &b| before(x, a, b));
        out.truncate(k);
    }
    out.sort_unstable_by(|&a, &b| before(x, a, b));
}

/// The top-p nucleus: the fewest tokens, taken most likely first (the lower id on a tie),
/// whose weights `w` (`e^((x − max) · scale)`) reach `p` of their total. Tokens of the
/// buckets wholly inside come in id order, then the last bucket's in order.
pub fn nucleus(x: &[f32], w: &[f32], max: f32, scale: f32, p: f32, out: &mut Vec<u32>) {
    let bucket = |v: f32| (((max - v) * scale * PER_UNIT) as usize).min(BUCKETS - 1);
    let mut mass = [0f64; BUCKETS];
    for (&v, &w) in x.iter().zip(w) {
        mass[bucket(v)] += w as f64;
    }
    let target = p as f64 * mass.iter().sum::<f64>();
    let mut cum = 0.0;
    let last = mass
        .iter()
        .position(|&m| {
            cum += m;
            cum >= target
        })
        .unwrap_or(BUCKETS - 1);
    out.clear();
    let mut edge = Vec::new();
    for (i, &v) in x.iter().enumerate() {
        match bucket(v).cmp(&last) {
            Ordering::Less => out.push(i as u32),
            Ordering::Equal => edge.push(i as u32),
            Ordering::Greater => {}
        }
    }
    edge.sort_unstable_by(|&a, &b| before(x, a, b));
    let mut cum: f64 = mass[..last].iter().sum();
    for i in edge {
        out.push(i);
        cum += w[i as usize] as f64;
        if cum >= target {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                // Few distinct values, so ties are common.
                (s % 200) as f32 / 20.0 - 5.0
            })
            .collect()
    }

    /// Every token sorted most likely first, ties to the lower id: the naive reference.
    fn sorted(x: &[f32]) -> Vec<u32> {
        let mut all: Vec<u32> = (0..x.len() as u32).collect();
        all.sort_by(|&a, &b| before(x, a, b));
        all
    }

    #[test]
    fn top_k_is_the_sorted_prefix() {
        for n in [0, 1, 5, 63, 64, 65, 1000, 5000] {
            let x = row(n, n as u64 + 3);
            for k in [0, 1, 2, 7, 40, 64, 100, n, n + 5] {
                let mut out = Vec::new();
                top_k(&x, k, &mut out);
                let want = &sorted(&x)[..k.min(n)];
                assert_eq!(out, want, "n {n} k {k}");
            }
        }
    }

    #[test]
    fn the_nucleus_is_the_shortest_sorted_prefix_that_reaches_p() {
        for (n, t) in [(1, 1.0), (50, 1.0), (1000, 0.7), (5000, 2.0), (5000, 0.05)] {
            let mut x = row(n, n as u64);
            if n > 10 {
                x[3] = f32::NEG_INFINITY;
            }
            let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let scale = 1.0 / t;
            let w: Vec<f32> = x.iter().map(|v| ((v - max) * scale).exp()).collect();
            let total: f64 = w.iter().map(|&w| w as f64).sum();
            for p in [1e-6, 0.1, 0.5, 0.9, 0.95, 0.999] {
                let mut out = Vec::new();
                nucleus(&x, &w, max, scale, p, &mut out);
                let all = sorted(&x);
                let mut cum = 0.0;
                let len = all.iter().position(|&i| {
                    cum += w[i as usize] as f64;
                    cum >= p as f64 * total
                });
                let mut want = all[..len.map_or(n, |l| l + 1)].to_vec();
                let mut got = out.clone();
                want.sort();
                got.sort();
                assert_eq!(got, want, "n {n} t {t} p {p}");
            }
        }
    }
}
