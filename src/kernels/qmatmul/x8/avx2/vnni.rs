//! The blocks that exist only with AVX-512 VNNI: sixteen sums held in AVX-512VL's 32
//! registers, so two groups and four rows run at once.

use super::*;

/// `acc` plus, in each 32-bit lane, the four products of the unsigned bytes of `w` and
/// the signed bytes of `x`: VNNI's `vpdpbusd`, where AVX2 takes a `maddubs`, an add
/// and a `madd`. Inlined only into the `_vnni` kernels ([`twins`]).
///
/// # Safety
/// What [`vnni`] checks must be available.
#[inline(always)]
pub(super) unsafe fn dot4(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    unsafe { _mm256_dpbusd_epi32(acc, w, x) }
}

/// One block of two groups' Q4_K records (`rec`), or Q5_K values decoded ahead
/// (`vals`, with `FIVE`), against four activation rows from sub-block index `at(0)`
/// (rows `at(1) - at(0)` apart): each row's scaled integer sums of the block, added to
/// `dots`. Q4_K's come straight from the nibbles: a chunk of nibbles feeds both of its
/// sub-blocks, the low ones masked, the high ones masked in place (16 times their
/// value), so there is no shift and no decode pass; the low sub-block's sums take 16
/// times their scale, and the block's sums, all multiples of 16, are divided back
/// exactly (at most 16 · 8 · 32 · 15 · 127 · 63 < 2³¹ per lane). The same integers as
/// [`k_sub`]'s.
///
/// # Safety
/// What [`vnni`] checks must be available; `rec` (or `vals` with `FIVE`) holds a block of
/// each group, and `xq` the sub-blocks that `at` indexes.
#[inline(always)]
pub(super) unsafe fn k_block_vnni<const FIVE: bool, const G: usize, const R: usize>(
    rec: [*const u8; G],
    vals: [*const u8; G],
    xq: &QActs,
    at: impl Fn(usize) -> usize,
    dots: &mut [[__m256i; G]; R],
) {
    unsafe {
        debug_assert!(G == 2 && R == 4);
        let head = record(GgmlType::Q4K).1;
        let x = xq.q.as_ptr().add(at(0) * QB);
        let row = (at(1) - at(0)) * QB;
        let mut sums = [[_mm256_setzero_si256(); G]; R];
        for pair in 0..4 {
            let s = if FIVE {
                // Sub-block `2·pair`'s decoded chunks, then `2·pair + 1`'s.
                let w = |g: usize| vals[g.min(G - 1)].add(512 * pair);
                decoded_4x2_vnni(w(0), w(1), x.add(2 * pair * QB), row)
            } else {
                let w = |g: usize| rec[g.min(G - 1)].add(head + 256 * pair);
                nibbles_4x2_vnni(w(0), w(1), x.add(2 * pair * QB), row)
            };
            for (g, &rec) in rec.iter().enumerate() {
                // Plain loads, not a closure (see [`k_sub`]): sub-blocks `2·pair` and `2·pair + 1`.
                let sc = rec.add(32 + 16 * pair);
                let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.cast()));
                let lo = if FIVE { lo } else { _mm256_slli_epi32(lo, 4) };
                let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.add(8).cast()));
                for (sums, s) in sums.iter_mut().zip(&s) {
                    let scaled = _mm256_add_epi32(_mm256_mullo_epi32(s[g][0], lo), _mm256_mullo_epi32(s[g][1], hi));
                    sums[g] = _mm256_add_epi32(sums[g], scaled);
                }
            }
        }
        for (dots, sums) in dots.iter_mut().zip(&sums) {
            for (dot, s) in dots.iter_mut().zip(sums) {
                *dot = _mm256_add_epi32(*dot, if FIVE { *s } else { _mm256_srai_epi32(*s, 4) });
            }
        }
    }
}

/// One block of one group's Q4_K records (`rec`) against `R` activation rows (row `t`'s
/// block at sub-block index `at(t)` of `x`): [`k_block_vnni`]'s sums, a chunk's nibbles
/// masked in place once for all the rows. One row (a decode's product of a matrix and a
/// vector) splits each half's chain of `vpdpbusd`s in two, so that four run side by side;
/// more rows have chains enough. The same integers as [`k_sub`]'s.
///
/// # Safety
/// What [`vnni`] checks must be available; `rec` holds a block and `x` the sub-blocks
/// that `at` indexes.
#[inline(always)]
pub(super) unsafe fn k_rows_vnni<const R: usize>(
    rec: *const u8,
    x: *const i8,
    at: impl Fn(usize) -> usize,
) -> [__m256i; R] {
    unsafe {
        let head = record(GgmlType::Q4K).1;
        let (low, high) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0xF0u8 as i8));
        // Chains per half of a row: `[row][chain][half]`.
        let split = if R == 1 { 2 } else { 1 };
        let mut sums = [_mm256_setzero_si256(); R];
        for pair in 0..4 {
            let w = rec.add(head + 256 * pair);
            let mut s = [[[_mm256_setzero_si256(); 2]; 2]; R];
            for c in 0..8 {
                let v = _mm256_loadu_si256(w.add(32 * c).cast());
                let (lo, hi) = (_mm256_and_si256(v, low), _mm256_and_si256(v, high));
                let i = c % split;
                for (t, s) in s.iter_mut().enumerate() {
                    let x = x.add((at(t) + 2 * pair) * QB + 4 * c);
                    s[i][0] = dot4(s[i][0], lo, bcast(x));
                    s[i][1] = dot4(s[i][1], hi, bcast(x.add(QB)));
                }
            }
            let sc = rec.add(32 + 16 * pair);
            let lo = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.cast())), 4);
            let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.add(8).cast()));
            for (sums, s) in sums.iter_mut().zip(&s) {
                let (s_lo, s_hi) = if split == 2 {
                    (_mm256_add_epi32(s[0][0], s[1][0]), _mm256_add_epi32(s[0][1], s[1][1]))
                } else {
                    (s[0][0], s[0][1])
                };
                let scaled = _mm256_add_epi32(_mm256_mullo_epi32(s_lo, lo), _mm256_mullo_epi32(s_hi, hi));
                *sums = _mm256_add_epi32(*sums, scaled);
            }
        }
        for s in sums.iter_mut() {
            *s = _mm256_srai_epi32(*s, 4);
        }
        sums
    }
}

/// The i32 sums of two sub-blocks of decoded values (from `w0`, `w1`: eight 32-byte
/// chunks each, the second sub-block's 256 bytes on) of two groups against four
/// activation rows (from `x`, `row` bytes apart; the second sub-block's 32 bytes on):
/// `[row][group][sub-block]`, as [`nibbles_4x2_vnni`].
///
/// # Safety
/// What [`vnni`] checks must be available; `w0` and `w1` hold two decoded sub-blocks and
/// `x` four rows' activations, `row` bytes apart.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn decoded_4x2_vnni(
    w0: *const u8,
    w1: *const u8,
    x: *const i8,
    row: usize,
) -> [[[__m256i; 2]; 2]; 4] {
    unsafe {
        let mut s = [[[_mm256_setzero_si256(); 2]; 2]; 4];
        for c in 0..8 {
            // Plain loads, not a closure (see [`k_sub`]).
            let mut w = [[_mm256_setzero_si256(); 2]; 2];
            for (w, p) in w.iter_mut().zip([w0, w1]) {
                *w = [_mm256_loadu_si256(p.add(32 * c).cast()), _mm256_loadu_si256(p.add(256 + 32 * c).cast())];
            }
            dots_4x2x2(&mut s, &w, x.add(4 * c), row, 32);
        }
        s
    }
}

/// The i32 sums of two Q4_K sub-blocks (the low nibbles, then the high ones masked in
/// place) of two groups' records (nibbles at `w0`, `w1`, eight 32-byte chunks) against
/// four activation rows (from `x`, `row` bytes apart; the second sub-block's 32 bytes
/// on): `[row][group][sub-block]`. Sixteen sums, held in the registers of AVX-512VL.
///
/// # Safety
/// What [`vnni`] checks must be available; `w0` and `w1` hold eight chunks of nibbles
/// and `x` four rows' activations, `row` bytes apart.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn nibbles_4x2_vnni(
    w0: *const u8,
    w1: *const u8,
    x: *const i8,
    row: usize,
) -> [[[__m256i; 2]; 2]; 4] {
    unsafe {
        let (low, high) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0xF0u8 as i8));
        let mut s = [[[_mm256_setzero_si256(); 2]; 2]; 4];
        for c in 0..8 {
            let (a, b) = (_mm256_loadu_si256(w0.add(32 * c).cast()), _mm256_loadu_si256(w1.add(32 * c).cast()));
            let w = [
                [_mm256_and_si256(a, low), _mm256_and_si256(a, high)],
                [_mm256_and_si256(b, low), _mm256_and_si256(b, high)],
            ];
            dots_4x2x2(&mut s, &w, x.add(4 * c), row, 32);
        }
        s
    }
}

/// Adds one chunk of two groups' weights `w` (`[group][half]`) against four activation
/// rows (from `x`, `row` bytes apart; each row's second half `half` bytes on) to the
/// sums `s` (`[row][group][half]`), one `vpdpbusd` each. Inlined only into the
/// AVX-512 VNNI kernels.
///
/// # Safety
/// What [`vnni`] checks must be available and `x` hold four rows' activations, `row`
/// bytes apart.
#[inline(always)]
pub(super) unsafe fn dots_4x2x2(
    s: &mut [[[__m256i; 2]; 2]; 4],
    w: &[[__m256i; 2]; 2],
    x: *const i8,
    row: usize,
    half: usize,
) {
    unsafe {
        for (t, s) in s.iter_mut().enumerate() {
            for h in 0..2 {
                let x = bcast(x.add(t * row + half * h));
                for (s, w) in s.iter_mut().zip(w) {
                    s[h] = dot4(s[h], w[h], x);
                }
            }
        }
    }
}

/// The i32 sums of one Q6_K output (32 values, decoded ahead) of two groups (at `w0`,
/// `w1`: eight 32-byte chunks, the second 16 values' four from 128 bytes on) against
/// four activation rows (from `x`, `row` bytes apart; the second 16 values from 16
/// bytes on), from `init` (`[half][row]`, the −32 offsets): `[row][group][half]`.
/// Sixteen sums in AVX-512VL's registers, so that each chain of `vpdpbusd`s is four
/// long and 16 run side by side.
///
/// # Safety
/// What [`vnni`] checks must be available; `w0` and `w1` hold an output's decoded values
/// and `x` four rows' activations, `row` bytes apart.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn q6_halves_vnni(
    w0: *const u8,
    w1: *const u8,
    x: *const i8,
    row: usize,
    init: [[__m256i; 4]; 2],
) -> [[[__m256i; 2]; 2]; 4] {
    unsafe {
        let mut s = [[[_mm256_setzero_si256(); 2]; 2]; 4];
        for (t, s) in s.iter_mut().enumerate() {
            for s in s.iter_mut() {
                *s = [init[0][t], init[1][t]];
            }
        }
        for c in 0..4 {
            let mut w = [[_mm256_setzero_si256(); 2]; 2];
            for (w, p) in w.iter_mut().zip([w0, w1]) {
                *w = [_mm256_loadu_si256(p.add(32 * c).cast()), _mm256_loadu_si256(p.add(128 + 32 * c).cast())];
            }
            dots_4x2x2(&mut s, &w, x.add(4 * c), row, 16);
        }
        s
    }
}

/// [`q6_k`]'s block for two groups' values decoded ahead (`vals`) and four rows with
/// VNNI: output by output in a loop (unrolled, the outputs' sums, scales and pointers
/// crowded the registers and spilled), both 16-value halves of an output at once
/// ([`q6_halves_vnni`]); the same operations per row as [`q6_out`].
///
/// # Safety
/// As [`q6_k`]'s with `V`, for the block that `rec` and `vals` point into.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn q6_block_vnni<const F: u8, const G: usize, const R: usize>(
    rec: [*const u8; G],
    vals: [*const u8; G],
    sc_at: usize,
    xq: &QActs,
    offs: *const i32,
    at: impl Fn(usize) -> usize,
    hb: impl Fn(usize) -> usize,
    blk: &mut [[__m256; G]; R],
) {
    unsafe {
        let row = at(1) - at(0);
        for o in 0..8 {
            // Output `o` is `i = o % 4` of half `n = o / 4`: its values 32·o on, its scales
            // `8·n + 2·i = 2·o` on (from `sc_at`).
            let mut init = [[_mm256_setzero_si256(); 4]; 2];
            for (half, init) in init.iter_mut().enumerate() {
                for (t, init) in init.iter_mut().enumerate().take(R) {
                    *init = _mm256_set1_epi32(*offs.add((at(t) + 32 * o + 16 * half) / QH));
                }
            }
            let s = q6_halves_vnni(
                vals[0].add(256 * o),
                vals[G - 1].add(256 * o),
                xq.q.as_ptr().add(at(0) + 32 * o),
                row,
                init,
            );
            for (g, &rec) in rec.iter().enumerate() {
                let sc = rec.add(sc_at + 16 * o);
                let (lo, hi) = (q6_scales::<true, F>(sc), q6_scales::<true, F>(sc.add(8)));
                for (t, (blk, s)) in blk.iter_mut().zip(&s).enumerate() {
                    let dot = _mm256_add_epi32(_mm256_mullo_epi32(s[g][0], lo), _mm256_mullo_epi32(s[g][1], hi));
                    let dx = _mm256_set1_ps(*xq.d.get_unchecked(hb(t) + 2 * o));
                    blk[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, blk[g]);
                }
            }
        }
    }
}
