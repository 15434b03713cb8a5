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
    let n = crate::kernels::round_small(x * LOG2E);
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// `out[i] = e^((x[i] − shift) · scale)`, and 0 where that exponent is below the clamp (or
/// NaN): a sampler's weights from its logits, masked ones (−∞) exactly 0. Eight lanes at a
/// time where AVX2 runs, the same bits either way.
pub fn exp_scaled(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "exp_scaled: {} inputs, {} outputs", x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        // SAFETY: AVX2 and FMA were checked; the lengths match.
        return unsafe { avx2::exp_scaled(x, shift, scale, out) };
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = exp_or_zero((v - shift) * scale);
    }
}

/// [`exp`], or 0 below its clamp and for NaN.
#[inline(always)]
fn exp_or_zero(a: f32) -> f32 {
    if a >= MIN {
        exp(a)
    } else {
        0.0
    }
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

    /// [`super::exp_scaled`] for 8 lanes at a time, the tail with the scalar twin.
    ///
    /// # Safety
    /// AVX2 and FMA must be available and `out` as long as `x`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_scaled(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
        let (sh, sc, min) = (_mm256_set1_ps(shift), _mm256_set1_ps(scale), _mm256_set1_ps(MIN));
        let whole = x.len() / 8 * 8;
        for (o, v) in out[..whole].chunks_exact_mut(8).zip(x.chunks_exact(8)) {
            // SAFETY: each chunk holds 8 floats.
            unsafe {
                let a = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v.as_ptr()), sh), sc);
                let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(a, min);
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_and_ps(exp(a), keep));
            }
        }
        for (o, &v) in out[whole..].iter_mut().zip(&x[whole..]) {
            *o = exp_or_zero((v - shift) * scale);
        }
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

    #[test]
    fn scaled_weights_are_exp_or_zero_in_every_lane_and_tail() {
        let mut x = inputs();
        x.extend([f32::NEG_INFINITY, f32::NAN, 3.0]);
        for len in [0, 1, 7, 8, 9, 17, x.len()] {
            let mut out = vec![-1.0; len];
            exp_scaled(&x[..len], 3.0, 0.7, &mut out);
            for (v, o) in x[..len].iter().zip(&out) {
                let a = (v - 3.0) * 0.7;
                let want = if a >= MIN { exp(a) } else { 0.0 };
                assert_eq!(o.to_bits(), want.to_bits(), "e^({v} - 3) * 0.7");
            }
        }
        let mut out = [1.0; 3];
        exp_scaled(&[f32::NEG_INFINITY, f32::NAN, -200.0], 0.0, 1.0, &mut out);
        assert_eq!(out, [0.0; 3], "masked, NaN and negligible logits weigh nothing");
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
