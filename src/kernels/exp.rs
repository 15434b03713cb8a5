//! `exp` for SiLU and softmax: a range reduction to `2ⁿ · e^r` and a degree-5 polynomial
//! (Cephes `expf`, relative error ~1e-7), in an AVX2 version for 8 lanes and a scalar twin
//! that performs the same IEEE operations in the same order. A value therefore gets the same
//! result whether it lands in a vector or in a row's tail, which keeps results independent of
//! how rows are split — and it is ~10× cheaper than calling libm per element.

/// Inputs are clamped here so `2ⁿ` stays a normal float.
const MIN: f32 = -87.336_54;
const MAX: f32 = 88.376_26;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two so `x - n·ln 2` stays exact for large `n`.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// `e^x`, bit-identical to each lane of [`avx2::exp`].
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(MIN, MAX);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// `e^x` for 8 lanes; see [`super::exp`].
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub unsafe fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(MIN)), _mm256_set1_ps(MAX));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(LOG2E),
        ));
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(P[0]);
        for c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.0443).collect();
        xs.extend([-1000.0, -87.4, -87.3, -1e-30, 0.0, 1e-30, 88.3, 88.4, 1000.0]);
        xs
    }

    #[test]
    fn close_to_f64_exp() {
        for x in inputs() {
            let want = (x.clamp(MIN, MAX) as f64).exp();
            let got = exp(x) as f64;
            assert!(((got - want) / want).abs() < 3e-7, "exp({x}) = {got}, want {want}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_lanes_equal_the_scalar() {
        use std::arch::x86_64::*;
        if !crate::kernels::matmul::avx2::available() {
            return;
        }
        for chunk in inputs().chunks_exact(8) {
            let mut out = [0f32; 8];
            // SAFETY: AVX2 and FMA were checked above; both pointers cover 8 floats.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), avx2::exp(_mm256_loadu_ps(chunk.as_ptr()))) };
            for (x, y) in chunk.iter().zip(out) {
                assert_eq!(y.to_bits(), exp(*x).to_bits(), "exp({x})");
            }
        }
    }
}
