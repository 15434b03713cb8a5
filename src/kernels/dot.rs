//! Vector helpers for attention's portable path, in the AVX2 path's order of operations so
//! that both give the same bits: a dot product in interleaved chains of fused
//! multiply-adds, and `y += a·x`.

/// `a · b` as the AVX2 scoring forms it: dim `d` into chain `d mod chains` (1 to 4), each
/// chain a run of fused multiply-adds in dim order, the chains then added in order.
#[inline(always)]
pub(crate) fn dot_chains(a: &[f32], b: &[f32], chains: usize) -> f32 {
    match chains {
        1 => dot_in::<1>(a, b),
        2 => dot_in::<2>(a, b),
        3 => dot_in::<3>(a, b),
        _ => dot_in::<4>(a, b),
    }
}

#[inline(always)]
fn dot_in<const C: usize>(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; C];
    let whole = a.len() / C * C;
    for (x, y) in a[..whole].chunks_exact(C).zip(b[..whole].chunks_exact(C)) {
        for c in 0..C {
            acc[c] = x[c].mul_add(y[c], acc[c]);
        }
    }
    for (c, (x, y)) in a[whole..].iter().zip(&b[whole..]).enumerate() {
        acc[c] = x.mul_add(*y, acc[c]);
    }
    acc[1..].iter().fold(acc[0], |s, c| s + c)
}

#[inline(always)]
pub(crate) fn axpy_lanes(y: &mut [f32], a: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv = a.mul_add(*xv, *yv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::random_vec;

    #[test]
    fn matches_naive() {
        for len in [1, 8, 45, 64] {
            let a = random_vec(len, 1);
            let b = random_vec(len, 2);
            let want: f64 = a.iter().zip(&b).map(|(p, q)| *p as f64 * *q as f64).sum();
            for chains in 1..=4 {
                assert!((dot_chains(&a, &b, chains) as f64 - want).abs() < 1e-5, "len {len}, {chains} chains");
            }
        }
    }

    #[test]
    fn axpy_matches_naive() {
        let x = random_vec(19, 3);
        let mut y = random_vec(19, 4);
        let want: Vec<f32> = y.iter().zip(&x).map(|(yv, xv)| yv + 0.5 * xv).collect();
        axpy_lanes(&mut y, 0.5, &x);
        for (g, w) in y.iter().zip(&want) {
            assert!((g - w).abs() < 1e-6);
        }
    }
}
