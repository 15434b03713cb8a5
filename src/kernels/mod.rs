//! Numeric kernels over plain `f32` slices and GGML quantized blocks. Each has a test
//! against a naive version.

pub mod attention;
pub mod buffer;
pub mod delta;
mod dot;
pub(crate) mod exp;
pub mod fp8;
pub mod matmul;
pub mod norm;
pub mod qmatmul;
pub mod quant;
pub mod quantize;
pub mod rope;
pub mod ternary;

pub use matmul::{matmul, PackedMatrix};
pub use norm::{rmsnorm, silu_mul};

/// The CPU's family on an AMD processor (base plus extended family, as AMD numbers
/// them: 19h for Zen 3 and 4, 1Ah for Zen 5), for choices measured per family.
#[cfg(target_arch = "x86_64")]
pub(crate) fn amd_family() -> Option<u32> {
    use std::arch::x86_64::__cpuid;
    let (vendor, id) = (__cpuid(0), __cpuid(1));
    let name = [vendor.ebx, vendor.edx, vendor.ecx].map(u32::to_le_bytes).concat();
    let base = (id.eax >> 8) & 0xF;
    let family = if base == 0xF { base + ((id.eax >> 20) & 0xFF) } else { base };
    (name == *b"AuthenticAMD").then_some(family)
}

/// Asks for the cache lines of the `bytes` bytes at `p` ahead of their use, into L2 only:
/// in L1 they would evict the lines in use, and on Zen 4 asks into L1 held up the very
/// loads they were for. A prefetch is a hint that reads nothing and never faults, so `p`
/// may point anywhere, past a buffer's end included.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_lines_l2(p: *const u8, bytes: usize) {
    prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p, bytes)
}

/// `x` rounded to the nearest integer, ties to even, for |x| < 2²²: two adds (the integer
/// part lands in an f32 whose step is 1), which vectorize, where `round_ties_even` is a
/// call to libm's `rintf` in a build for the baseline x86-64 (no SSE4.1 `roundss`).
#[inline(always)]
pub(crate) fn round_small(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 · 2²³
    (x + SHIFT) - SHIFT
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch<const HINT: i32>(p: *const u8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        // SAFETY: a prefetch (SSE, in every x86_64 CPU) dereferences nothing.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p.wrapping_add(line).cast()) };
    }
}

#[cfg(test)]
pub(crate) mod testing {
    /// Deterministic values in [-1, 1) from a seed (xorshift), for kernel tests.
    pub fn random_vec(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}: [{i}] got {g}, want {w}");
        }
    }
}

#[cfg(test)]
mod rounding_tests {
    /// Ties, their neighbours and random values up to 2²¹ in size, either sign, as
    /// `round_ties_even` rounds them.
    #[test]
    fn round_small_rounds_to_nearest_even() {
        let mut xs: Vec<f32> = (-300..300)
            .flat_map(|i| {
                let t = i as f32 + 0.5;
                [t, f32::from_bits(t.to_bits() + 1), f32::from_bits(t.to_bits() - 1), i as f32]
            })
            .collect();
        xs.extend(super::testing::random_vec(10_000, 5).iter().map(|x| x * 2_097_152.0));
        xs.extend([0.0, -0.0, 1e-30, -1e-30, 4_194_303.5, -4_194_303.5]);
        for x in xs {
            assert_eq!(super::round_small(x), x.round_ties_even(), "{x}");
        }
    }

    #[test]
    fn rounds_to_nearest_even() {
        let got: Vec<f32> = [0.4, 0.5, 1.5, 2.5, -0.5, -1.6, 126.7, -127.0].map(super::round_small).to_vec();
        assert_eq!(got, [0.0, 0.0, 2.0, 2.0, -0.0, -2.0, 127.0, -127.0]);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    /// The family read from CPUID is the one Linux reports, on an AMD CPU (and none on
    /// another vendor's).
    #[test]
    fn amd_family_matches_the_kernel() {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else { return };
        let field = |key: &str| {
            info.lines().find(|l| l.starts_with(key)).and_then(|l| l.split(':').nth(1)).map(|v| v.trim().to_string())
        };
        let amd = field("vendor_id").as_deref() == Some("AuthenticAMD");
        let family = field("cpu family").and_then(|f| f.parse::<u32>().ok());
        assert_eq!(super::amd_family(), if amd { family } else { None });
    }
}
