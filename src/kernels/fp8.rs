//! FP8 E4M3 (the OCP "fn" variant that vLLM's `fp8` KV cache stores): a sign, four exponent
//! bits (bias 7) and three mantissa bits, finite up to ±448, with no infinities. A KV cache
//! in it takes a quarter of f32's memory and reads half of f16's bytes a decode step.
//!
//! Widening is exact and cheap in vectors: the seven low bits shifted into an f32's
//! exponent and mantissa give the value times 2⁻¹²⁰ (subnormals included), and one
//! multiply by 2¹²⁰ restores it.

use super::buffer::Zeroable;

/// One E4M3 value, as its bits.
#[repr(transparent)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct E4M3(pub u8);

// SAFETY: one byte, valid for every bit pattern.
unsafe impl Zeroable for E4M3 {}

/// The largest finite magnitude (0x7E); 0x7F is NaN.
const MAX: f32 = 448.0;
/// The smallest normal magnitude, 2⁻⁶; below it the step is 2⁻⁹.
const MIN_NORMAL: f32 = 1.0 / 64.0;
/// 2¹²⁰: an E4M3 bit pattern placed in an f32's exponent and mantissa is its value times
/// 2⁻¹²⁰ (the exponent biases are 127 and 7).
const REBIAS: f32 = f32::from_bits((127 + 120) << 23);

impl E4M3 {
    /// `x` rounded to the nearest value, ties to even; magnitudes beyond 448 (infinities
    /// too) saturate to ±448, as vLLM's conversion does; NaN stays NaN.
    pub fn from_f32(x: f32) -> E4M3 {
        let sign = ((x.to_bits() >> 24) & 0x80) as u8;
        let a = x.abs();
        let code = if a.is_nan() {
            0x7F
        } else if a >= MAX {
            0x7E
        } else if a < MIN_NORMAL {
            // Subnormal steps of 2⁻⁹: exact scaling, then the integer nearest (at most 8,
            // which is 2⁻⁶'s code).
            super::round_small(a * 512.0) as u8
        } else {
            // Rebias the exponent, then round the mantissa's 20 dropped bits to nearest
            // even; a carry steps the exponent, and nothing below 448 rounds past 0x7E.
            let r = a.to_bits() - (120 << 23);
            ((r + 0x7FFFF + ((r >> 20) & 1)) >> 20) as u8
        };
        E4M3(sign | code)
    }

    /// The value, exactly (0x7F and 0xFF, which [`E4M3::from_f32`] writes only for NaN,
    /// read as ±480).
    pub fn to_f32(self) -> f32 {
        let b = self.0 as u32;
        f32::from_bits(((b & 0x80) << 24) | ((b & 0x7F) << 20)) * REBIAS
    }

    /// `src` rounded into `dst` (of the same length).
    pub fn narrow(src: &[f32], dst: &mut [E4M3]) {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = E4M3::from_f32(s));
    }

    /// Eight consecutive values widened, as [`E4M3::to_f32`] does each.
    ///
    /// # Safety
    /// AVX2 must be available and `p` point at eight readable values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub unsafe fn load8(p: *const E4M3) -> std::arch::x86_64::__m256 {
        unsafe {
            use std::arch::x86_64::*;
            // Sign-extended, so that the byte's sign lands in bit 31 after the shift.
            let wide = _mm256_slli_epi32::<20>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())));
            let bits = _mm256_and_si256(wide, _mm256_set1_epi32(0x87F0_0000u32 as i32));
            _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(REBIAS))
        }
    }

    /// Sixteen consecutive values widened, as [`E4M3::to_f32`] does each.
    ///
    /// # Safety
    /// AVX-512F must be available and `p` point at sixteen readable values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub unsafe fn load16(p: *const E4M3) -> std::arch::x86_64::__m512 {
        unsafe {
            use std::arch::x86_64::*;
            let wide = _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())));
            let bits = _mm512_and_si512(wide, _mm512_set1_epi32(0x87F0_0000u32 as i32));
            _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(REBIAS))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code's value from the format's definition.
    fn defined(code: u8) -> f32 {
        let (e, m) = ((code >> 3) & 0xF, (code & 7) as f32);
        let mag = if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7) };
        if code & 0x80 != 0 {
            -mag
        } else {
            mag
        }
    }

    /// The finite codes: all but 0x7F and 0xFF.
    fn finite() -> impl Iterator<Item = u8> {
        (0..=255u8).filter(|c| c & 0x7F != 0x7F)
    }

    #[test]
    fn every_code_widens_to_its_value_and_back() {
        for c in finite() {
            let v = E4M3(c).to_f32();
            assert_eq!(v.to_bits(), defined(c).to_bits(), "code {c:#04x}");
            // -0 keeps its sign bit.
            assert_eq!(E4M3::from_f32(v), E4M3(c), "code {c:#04x} from {v}");
        }
        assert_eq!((MAX, MIN_NORMAL), (defined(0x7E), defined(0x08)));
    }

    /// Against the nearest code found by search (ties to the even code), over each code's
    /// neighbourhood: midpoints, a hair either side, and random values.
    #[test]
    fn narrowing_rounds_to_nearest_even() {
        let naive = |x: f32| -> u8 {
            let mut best = 0u8;
            for c in finite().filter(|c| (c & 0x80 != 0) == x.is_sign_negative()) {
                let (d, e) = ((defined(c) - x).abs(), (defined(best) - x).abs());
                if best & 0x80 != c & 0x80 || d < e || (d == e && c & 1 == 0) {
                    best = c;
                }
            }
            best
        };
        let mut xs: Vec<f32> = Vec::new();
        for c in finite().filter(|&c| c & 0x7F < 0x7E) {
            let (a, b) = (defined(c), defined(c + 1));
            let mid = (a + b) / 2.0;
            xs.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1), a, b]);
        }
        let mut seed = 0x2545_F491u32;
        xs.extend((0..20_000).map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            // Magnitudes from 2⁻¹² to 2⁹, either sign.
            let m = (seed >> 8) as f32 / (1u32 << 24) as f32;
            let x = 2f32.powf(m * 21.0 - 12.0);
            if seed & 1 == 1 {
                -x
            } else {
                x
            }
        }));
        for x in xs.into_iter().filter(|x| x.abs() < MAX) {
            assert_eq!(E4M3::from_f32(x).0, naive(x), "{x:e}");
        }
    }

    #[test]
    fn beyond_the_range_saturates_and_nan_stays_nan() {
        for x in [448.0f32, 463.9, 464.0, 480.0, 1e6, f32::INFINITY] {
            assert_eq!(E4M3::from_f32(x), E4M3(0x7E), "{x}");
            assert_eq!(E4M3::from_f32(-x), E4M3(0xFE), "{x}");
        }
        assert_eq!(E4M3::from_f32(f32::NAN).0 & 0x7F, 0x7F);
        assert_eq!(E4M3::from_f32(1e-9), E4M3(0));
        assert_eq!(E4M3::from_f32(-1e-9), E4M3(0x80));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vectors_widen_as_each_value() {
        let codes: Vec<E4M3> = (0..=255u8).map(E4M3).collect();
        let each: Vec<u32> = codes.iter().map(|c| c.to_f32().to_bits()).collect();
        if crate::kernels::matmul::avx2::available() {
            for at in (0..256).step_by(8) {
                let mut got = [0f32; 8];
                // SAFETY: AVX2 is available; eight codes from `at`.
                unsafe { std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), E4M3::load8(codes.as_ptr().add(at))) };
                assert_eq!(got.map(f32::to_bits), each[at..at + 8], "codes from {at:#04x}");
            }
        }
        if crate::kernels::matmul::avx2::wide() {
            for at in (0..256).step_by(16) {
                let mut got = [0f32; 16];
                // SAFETY: AVX-512F is available; sixteen codes from `at`.
                unsafe { std::arch::x86_64::_mm512_storeu_ps(got.as_mut_ptr(), E4M3::load16(codes.as_ptr().add(at))) };
                assert_eq!(got.map(f32::to_bits), each[at..at + 16], "codes from {at:#04x}");
            }
        }
    }
}
