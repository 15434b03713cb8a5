//! `Y = X · Wᵀ` for row-major `X [m, k]` and `W [n, k]`: every linear layer of the model.
//!
//! Written by hand for two reasons:
//! - **Batch invariance.** Each output element is one dot product computed in a fixed order
//!   (8-lane FMA accumulation over `k`, a fixed horizontal sum, then the scalar tail), whatever
//!   `m` is and however rows are tiled. A sequence's logits are therefore bit-identical alone
//!   or inside any batch, which a tiling BLAS does not promise.
//! - **Speed at decode batch sizes.** `shared/research/cpu-kernels.md` measured a kernel of
//!   this shape 1.2–2× faster than the best crate for m = 4..16 and level at m = 1.
//!
//! Work is split over output columns (rows of `W`), so at m = 1 both cores stream disjoint
//! halves of the weights. Call it from inside the engine's rayon pool: dispatch from outside
//! a pool costs ~10 µs per call.

use rayon::prelude::*;

/// Rows of `X` handled together by one register tile.
const MR: usize = 2;
/// Rows of `W` handled together by one register tile.
const NR: usize = 4;
/// Rows of `X` kept hot in L2 while the weights stream past (prefill).
const M_BLOCK: usize = 64;
/// Below this many multiply-adds a call runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 16;

/// `y[i, j] = dot(x[i, :], w[j, :])` for `i < m`, `j < n`; `y` is `[m, n]` row-major.
pub fn matmul(x: &[f32], w: &[f32], y: &mut [f32], m: usize, k: usize, n: usize) {
    assert!(
        x.len() >= m * k,
        "matmul: x has {} elements, need {}",
        x.len(),
        m * k
    );
    assert!(
        w.len() >= n * k,
        "matmul: w has {} elements, need {}",
        w.len(),
        n * k
    );
    assert!(
        y.len() >= m * n,
        "matmul: y has {} elements, need {}",
        y.len(),
        m * n
    );
    if m == 0 || n == 0 {
        return;
    }
    let out = SharedOut(y.as_mut_ptr());
    let threads = rayon::current_num_threads();
    if threads == 1 || m * n * k < PARALLEL_MIN_WORK {
        // SAFETY: the single task covers all columns of a buffer checked above.
        unsafe { columns(x, w, out, m, k, n, 0, n) };
        return;
    }
    // Several tasks per thread so uneven progress (the other core busy) balances out.
    let tasks = (threads * 4).min(n.div_ceil(NR));
    let chunk = n.div_ceil(tasks).next_multiple_of(NR);
    (0..n.div_ceil(chunk)).into_par_iter().for_each(|t| {
        let n0 = t * chunk;
        let n1 = (n0 + chunk).min(n);
        // SAFETY: tasks write disjoint column ranges of a buffer checked above.
        unsafe { columns(x, w, out, m, k, n, n0, n1) };
    });
}

/// Output pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every task writes a disjoint set of elements; see `matmul`.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// Computes columns `n0..n1` of `y` for all rows.
///
/// # Safety
/// `y` must point to `m * n` writable floats, and no other thread may write these columns.
#[allow(clippy::too_many_arguments)]
unsafe fn columns(
    x: &[f32],
    w: &[f32],
    y: SharedOut,
    m: usize,
    k: usize,
    n: usize,
    n0: usize,
    n1: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        avx2::columns(x.as_ptr(), w.as_ptr(), y.0, m, k, n, n0, n1);
        return;
    }
    portable_columns(x, w, y.0, m, k, n, n0, n1);
}

/// The same dot product as the AVX2 path (8 lanes, then a tail), for other CPUs.
#[allow(clippy::too_many_arguments)]
unsafe fn portable_columns(
    x: &[f32],
    w: &[f32],
    y: *mut f32,
    m: usize,
    k: usize,
    n: usize,
    n0: usize,
    n1: usize,
) {
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in n0..n1 {
            *y.add(i * n + j) = portable_dot(xr, &w[j * k..(j + 1) * k]);
        }
    }
}

/// Dot product with 8 partial sums, the portable twin of the AVX2 kernel's order.
pub(crate) fn portable_dot(a: &[f32], b: &[f32]) -> f32 {
    let k8 = a.len() / 8 * 8;
    let mut acc = [0f32; 8];
    for (ca, cb) in a[..k8].chunks_exact(8).zip(b[..k8].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (p, q) in a[k8..].iter().zip(&b[k8..]) {
        s += p * q;
    }
    s
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{MR, M_BLOCK, NR};
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    pub fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE
            .get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }

    /// # Safety
    /// AVX2 and FMA must be available; pointers must cover `[m, k]`, `[n, k]` and `[m, n]`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn columns(
        x: *const f32,
        w: *const f32,
        y: *mut f32,
        m: usize,
        k: usize,
        n: usize,
        n0: usize,
        n1: usize,
    ) {
        let mut mb = 0;
        while mb < m {
            let me = (mb + M_BLOCK).min(m);
            let mut j = n0;
            while j + NR <= n1 {
                rows::<NR>(x, w, y, k, n, mb, me, j);
                j += NR;
            }
            while j < n1 {
                rows::<1>(x, w, y, k, n, mb, me, j);
                j += 1;
            }
            mb = me;
        }
    }

    /// Rows `m0..m1` of `Y` for the `C` columns starting at `j`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows<const C: usize>(
        x: *const f32,
        w: *const f32,
        y: *mut f32,
        k: usize,
        n: usize,
        m0: usize,
        m1: usize,
        j: usize,
    ) {
        let mut i = m0;
        while i + MR <= m1 {
            tile::<MR, C>(x.add(i * k), w.add(j * k), y.add(i * n + j), k, n);
            i += MR;
        }
        while i < m1 {
            tile::<1, C>(x.add(i * k), w.add(j * k), y.add(i * n + j), k, n);
            i += 1;
        }
    }

    /// An `R × C` block of dot products; every element follows the same summation order.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const f32,
        w: *const f32,
        y: *mut f32,
        k: usize,
        ldy: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let k8 = k / 8 * 8;
        let mut p = 0;
        while p < k8 {
            let mut wv = [_mm256_setzero_ps(); C];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(w.add(c * k + p));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(r * k + p));
                for (a, wc) in row.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, *wc, *a);
                }
            }
            p += 8;
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, a) in row.iter().enumerate() {
                let mut s = hsum(*a);
                for q in k8..k {
                    s = (*x.add(r * k + q)).mul_add(*w.add(c * k + q), s);
                }
                *y.add(r * ldy + c) = s;
            }
        }
    }

    /// Horizontal sum in a fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7)).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s4 = _mm_add_ps(lo, hi);
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// Dot product in the same order as one element of `tile`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let k = a.len().min(b.len());
        let mut out = 0f32;
        tile::<1, 1>(a.as_ptr(), b.as_ptr(), &mut out, k, 1);
        out
    }
}

/// Dot product of two equal-length slices, in the kernel's fixed order.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU supports AVX2 and FMA; slices bound the reads.
        return unsafe { avx2::dot(a, b) };
    }
    portable_dot(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random_vec};

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| x[i * k + p] as f64 * w[j * k + p] as f64)
                    .sum();
                y[i * n + j] = s as f32;
            }
        }
        y
    }

    #[test]
    fn matches_naive_on_odd_sizes() {
        for &(m, k, n) in &[
            (1, 1, 1),
            (1, 7, 3),
            (3, 9, 5),
            (2, 64, 4),
            (5, 172, 64),
            (7, 33, 131),
            (65, 40, 9),
            (130, 24, 17),
            (1, 576, 1536),
        ] {
            let x = random_vec(m * k, 1 + m as u64);
            let w = random_vec(n * k, 2 + n as u64);
            let mut y = vec![f32::NAN; m * n];
            matmul(&x, &w, &mut y, m, k, n);
            assert_close(
                &y,
                &naive(&x, &w, m, k, n),
                1e-4,
                &format!("m={m} k={k} n={n}"),
            );
        }
    }

    #[test]
    fn parallel_split_matches_naive() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let (m, k, n) = (9, 100, 301);
        let x = random_vec(m * k, 11);
        let w = random_vec(n * k, 12);
        let mut y = vec![f32::NAN; m * n];
        pool.install(|| matmul(&x, &w, &mut y, m, k, n));
        assert_close(&y, &naive(&x, &w, m, k, n), 1e-4, "3 threads");
    }

    /// A row's result must not depend on how many other rows share the call.
    #[test]
    fn rows_are_bit_identical_whatever_the_batch() {
        let (k, n) = (203, 37);
        let w = random_vec(n * k, 5);
        let xs = random_vec(70 * k, 6);
        let mut all = vec![0f32; 70 * n];
        matmul(&xs, &w, &mut all, 70, k, n);
        for i in [0, 1, 2, 33, 64, 69] {
            let mut one = vec![0f32; n];
            matmul(&xs[i * k..(i + 1) * k], &w, &mut one, 1, k, n);
            assert_eq!(one, all[i * n..(i + 1) * n], "row {i}");
            assert_eq!(one[3], dot(&xs[i * k..(i + 1) * k], &w[3 * k..4 * k]));
        }
    }

    #[test]
    fn portable_dot_matches_naive() {
        let a = random_vec(45, 1);
        let b = random_vec(45, 2);
        let want: f64 = a.iter().zip(&b).map(|(p, q)| *p as f64 * *q as f64).sum();
        assert!((portable_dot(&a, &b) as f64 - want).abs() < 1e-5);
    }
}
