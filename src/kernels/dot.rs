//! Dot product with 8 partial sums and a fixed final order, for attention scores.

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        // SAFETY: the CPU supports AVX2 and FMA; the slices bound the reads.
        return unsafe { dot_avx2(a, b) };
    }
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let k8 = n / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut p = 0;
    while p < k8 {
        acc = _mm256_fmadd_ps(
            _mm256_loadu_ps(a.as_ptr().add(p)),
            _mm256_loadu_ps(b.as_ptr().add(p)),
            acc,
        );
        p += 8;
    }
    // ((0+4)+(2+6)) + ((1+5)+(3+7)), as in the portable path.
    let s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let mut s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)));
    for q in k8..n {
        s = a[q].mul_add(b[q], s);
    }
    s
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
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "len {len}");
        }
    }
}
