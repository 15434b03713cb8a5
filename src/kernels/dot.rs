//! Vector helpers for attention: a dot product (8 partial sums, fixed final order) and
//! `y += a·x`, written so they vectorize inside the AVX2 attention kernel.

/// Portable code shaped for 8-lane vectors: the compiler turns it into AVX2 wherever it is
/// inlined into a function compiled with AVX2 + FMA, with the same result either way.
#[inline(always)]
pub(crate) fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let k8 = a.len() / 8 * 8;
    let mut acc = [0f32; 8];
    for (ca, cb) in a[..k8].chunks_exact(8).zip(b[..k8].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (p, q) in a[k8..].iter().zip(&b[k8..]) {
        s = p.mul_add(*q, s);
    }
    s
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
            assert!((dot_lanes(&a, &b) as f64 - want).abs() < 1e-5, "len {len}");
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
