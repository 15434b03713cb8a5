//! Quick measurements of this machine's limits, taken in the benchmark's own run so its
//! numbers can be read against them (the VM's speed drifts from day to day).

use crate::kernels::buffer::F32Buf;
use crate::kernels::qmatmul::Avx2Step;
use rayon::prelude::*;
use std::time::Instant;

/// Measurements are the best of this many: one slow pass on this VM (a neighbour's burst, a
/// worker still waking) once showed half the int8 peak and a B=1 read above 100 % of it.
const PASSES: usize = 5;

/// The highest rate of `PASSES` runs of `pass`, which returns units of work done.
fn best_rate(mut pass: impl FnMut() -> f64) -> f64 {
    (0..PASSES)
        .map(|_| {
            let t0 = Instant::now();
            let work = pass();
            work / t0.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}

/// Streaming-read bandwidth over 256 MiB, all pool threads, GB/s, from the huge-page
/// memory the weights live in.
pub fn read_bandwidth() -> f64 {
    let mut buf = F32Buf::zeroed(64 << 20);
    buf.fill(1.0);
    best_rate(|| {
        let sum: f32 = buf.par_chunks(1 << 16).map(sum_lanes).sum();
        std::hint::black_box(sum);
        (buf.len() * 4) as f64 / 1e9
    })
}

/// A sum with 32 independent lanes, so the loads, not the adds' latency, set the pace.
fn sum_lanes(c: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    for chunk in c.chunks_exact(32) {
        acc.iter_mut().zip(chunk).for_each(|(a, &b)| *a += b);
    }
    acc.iter().sum()
}

/// f32 fused multiply-add peak of all pool threads, GFLOP/s, in the registers the float
/// kernels use: 512-bit where [`crate::kernels::matmul::avx2::wide`], else 256-bit.
pub fn fma_peak() -> f64 {
    const ITERS: usize = 1 << 22;
    let threads = rayon::current_num_threads();
    best_rate(|| {
        let sink: f32 = (0..threads).into_par_iter().map(|i| fma_chains(ITERS, i as f32)).sum();
        std::hint::black_box(sink);
        // 12 independent chains of 8 (or 16) lanes, one FMA (2 FLOPs) per lane per step.
        (threads * ITERS * 12 * 8 * 2 * fma_width()) as f64 / 1e9
    })
}

/// Registers of eight f32 lanes in one of [`fma_chains`]'s.
fn fma_width() -> usize {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::wide() {
        return 2;
    }
    1
}

fn fma_chains(iters: usize, seed: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::wide() {
        // SAFETY: AVX-512F was detected.
        return unsafe { wide_chains(iters, seed) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        // SAFETY: AVX2 and FMA were detected.
        return unsafe { avx2_chains(iters, seed) };
    }
    let mut acc = [seed; 96];
    for _ in 0..iters {
        acc.iter_mut().for_each(|a| *a = a.mul_add(0.999_999, 1e-7));
    }
    acc.iter().sum()
}

/// Integer multiply-add peak of all pool threads for the quantized kernels' inner step, in
/// GOP/s counting a multiply-add as two operations like a FLOP, and that step's name: one
/// 512-bit `vpdpbusd` (64 unsigned × signed byte products, summed by four into i32, as the
/// kernels for more than four rows run it) where the kernels use VNNI, else one `maddubs`
/// (pairwise summed) and one 16-bit accumulate. No
/// kernel does less per product (they also decode weights and apply scales), so it bounds
/// them all from above. `None` without AVX2.
pub fn int8_peak() -> Option<(f64, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        const ITERS: usize = 1 << 21;
        let threads = rayon::current_num_threads();
        let vnni = crate::kernels::qmatmul::vnni();
        let peak = best_rate(|| {
            let chains = |i: usize| {
                // SAFETY: AVX2 was detected, and AVX-512 VNNI where `vnni`.
                unsafe {
                    if vnni {
                        vnni_int8_chains(ITERS, i as i8)
                    } else {
                        avx2_int8_chains(ITERS, i as i8)
                    }
                }
            };
            let sink: i64 = (0..threads).into_par_iter().map(chains).sum();
            std::hint::black_box(sink);
            // 12 chains, 32 products (64 operations) each per step, or 64 with VNNI.
            (threads * ITERS * 12 * 64 * if vnni { 2 } else { 1 }) as f64 / 1e9
        });
        return Some((peak, if vnni { "512-bit vpdpbusd" } else { "maddubs + accumulate" }));
    }
    None
}

/// Byte products per second (G) of all pool threads running one [`Avx2Step`] of the
/// quantized kernels on AVX2 without VNNI, operands in registers: the ceiling of the formats
/// that take it, since the kernels also load, decode and scale. Q6_K's step (a `madd` per
/// two `maddubs`) and Q8_0's (a `sign` and a `madd` per `maddubs`) run well below
/// [`int8_peak`]. `None` without AVX2 or for a step no kernel takes.
pub fn avx2_step_rate(step: Avx2Step) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        const ITERS: usize = 1 << 19;
        let run: unsafe fn(usize, i8) -> i64 = match (step.per_madd, step.signed) {
            (1, true) => avx2_step_chains::<1, true>,
            (2, false) => avx2_step_chains::<2, false>,
            (4, false) => avx2_step_chains::<4, false>,
            (8, false) => avx2_step_chains::<8, false>,
            (64, false) => avx2_step_chains::<64, false>,
            _ => return None,
        };
        let threads = rayon::current_num_threads();
        return Some(best_rate(|| {
            // SAFETY: AVX2 was detected.
            let sink: i64 = (0..threads).into_par_iter().map(|i| unsafe { run(ITERS, i as i8) }).sum();
            std::hint::black_box(sink);
            (threads * ITERS * STEP_CHAINS * step.per_madd * 32) as f64 / 1e9
        }));
    }
    let _ = step;
    None
}

/// Independent accumulators in [`avx2_step_chains`]: as many as leave registers for the
/// operands.
const STEP_CHAINS: usize = 8;

/// [`STEP_CHAINS`] i32 sums, each step `PER` `maddubs` (after a `sign` where `SIGNED`)
/// added in i16, then one `madd` and an i32 add. Each `maddubs` takes another chain's last
/// sum as its activations, so none can be hoisted and the chains' steps overlap.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2_step_chains<const PER: usize, const SIGNED: bool>(iters: usize, seed: i8) -> i64 {
    unsafe {
        use std::arch::x86_64::*;
        // Weights of both signs for Q8_0's step, so its `sign` has work to do; one per place
        // in the step, so that no two chains' products are the same (and computed once).
        let w: [__m256i; PER] = std::array::from_fn(|j| match SIGNED {
            true => _mm256_set1_epi16(0x03FD + j as i16),
            false => _mm256_set1_epi8(3 + j as i8),
        });
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_set1_epi8(seed); STEP_CHAINS];
        for _ in 0..iters {
            let x = acc;
            for (c, a) in acc.iter_mut().enumerate() {
                // Plain loops, no closure: one would not take this function's target features.
                let mut s = step_mul::<SIGNED>(w[0], x[c]);
                for (j, &w) in w.iter().enumerate().skip(1) {
                    s = _mm256_add_epi16(s, step_mul::<SIGNED>(w, x[(c + j) % STEP_CHAINS]));
                }
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(s, ones));
            }
        }
        let mut out = [0i32; 8];
        let sum = acc.iter().fold(_mm256_setzero_si256(), |s, &a| _mm256_add_epi32(s, a));
        _mm256_storeu_si256(out.as_mut_ptr().cast(), sum);
        out.iter().map(|&v| v as i64).sum()
    }
}

/// One `maddubs` of a step: weights `w` against activations `x`; signed weights as the
/// kernels take them, `|w|` against `x` carrying `w`'s sign. Inlined into its AVX2 caller.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn step_mul<const SIGNED: bool>(
    w: std::arch::x86_64::__m256i,
    x: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    unsafe {
        use std::arch::x86_64::*;
        if SIGNED {
            _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
        } else {
            _mm256_maddubs_epi16(w, x)
        }
    }
}

/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2_int8_chains(iters: usize, seed: i8) -> i64 {
    unsafe {
        use std::arch::x86_64::*;
        let w = _mm256_set1_epi8(3);
        let mut acc = [_mm256_set1_epi8(seed); 12];
        for _ in 0..iters {
            // Each chain's bytes are its next activations, so no product can be hoisted; twelve
            // chains hide the latency.
            for a in acc.iter_mut() {
                *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(w, *a));
            }
        }
        let mut out = [0i16; 16];
        let sum = acc.iter().fold(_mm256_setzero_si256(), |s, &a| _mm256_add_epi16(s, a));
        _mm256_storeu_si256(out.as_mut_ptr().cast(), sum);
        out.iter().map(|&v| v as i64).sum()
    }
}

/// [`avx2_int8_chains`] with one 512-bit `vpdpbusd` a step.
///
/// # Safety
/// What [`crate::kernels::qmatmul::vnni`] checks must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn vnni_int8_chains(iters: usize, seed: i8) -> i64 {
    use std::arch::x86_64::*;
    let w = _mm512_set1_epi8(3);
    let mut acc = [_mm512_set1_epi8(seed); 12];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_dpbusd_epi32(*a, w, *a);
        }
    }
    let sum = acc.iter().fold(_mm512_setzero_si512(), |s, &a| _mm512_add_epi32(s, a));
    _mm512_reduce_add_epi32(sum) as i64
}

/// [`avx2_chains`] in 512-bit registers.
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn wide_chains(iters: usize, seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let (m, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(seed); 12];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, m, c);
        }
    }
    _mm512_reduce_add_ps(acc.iter().fold(_mm512_setzero_ps(), |s, &a| _mm512_add_ps(s, a)))
}

/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_chains(iters: usize, seed: f32) -> f32 {
    unsafe {
        use std::arch::x86_64::*;
        let (m, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(seed); 12];
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, m, c);
            }
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), acc.iter().fold(_mm256_setzero_ps(), |s, &a| _mm256_add_ps(s, a)));
        out.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::qmatmul::{avx2_step, QMatrix};
    use crate::kernels::quant::BLOCK_FORMATS;

    /// Every block format the kernels compute has a step `weft bench` can measure.
    #[test]
    fn every_block_format_has_a_step_ceiling() {
        if !crate::kernels::matmul::avx2::available() {
            return;
        }
        for t in BLOCK_FORMATS.into_iter().filter(|&t| QMatrix::supports(t)) {
            let rate = avx2_step_rate(avx2_step(t));
            assert!(rate.is_some_and(|r| r > 0.0), "{t:?}: {rate:?}");
        }
    }
}
