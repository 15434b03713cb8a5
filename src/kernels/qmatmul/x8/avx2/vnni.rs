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

/// One block of two or four groups' Q4_K records (`rec`), or two groups' Q5_K values
/// decoded ahead (`vals`, with `FIVE`), against `R` activation rows from sub-block index
/// `at(0)` (rows `at(1) - at(0)` apart): each row's scaled integer sums of the block,
/// added to `dots`. A pair of groups shares each 512-bit register, the first group's
/// eight rows in the low half ([`two_groups`]): one `vpdpbusd` does what two did on
/// 256-bit halves, and CPUs with full-width AVX-512 (Zen 5) run it as fast. Q4_K's come
/// straight from the nibbles: a chunk of nibbles feeds both of its sub-blocks, the low
/// ones masked, the high ones masked in place (16 times their value), so there is no
/// shift and no decode pass; the low sub-block's sums take 16 times their scale, and the
/// block's sums, all multiples of 16, are divided back exactly (at most 16 · 8 · 32 · 15
/// · 127 · 63 < 2³¹ per lane). The same integers as [`k_sub`]'s.
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
        debug_assert!((G == 2 || G == 4 && !FIVE) && (1..=4).contains(&R));
        if G == 4 {
            k_pairs_vnni::<FIVE, G, 2, R>(rec, vals, xq, at, dots)
        } else {
            k_pairs_vnni::<FIVE, G, 1, R>(rec, vals, xq, at, dots)
        }
    }
}

/// [`k_block_vnni`] over its `P = G / 2` pairs of groups (Q4_K's two pairs from their
/// records, [`nibbles_vnni`]).
///
/// # Safety
/// As [`k_block_vnni`]'s.
#[inline(always)]
unsafe fn k_pairs_vnni<const FIVE: bool, const G: usize, const P: usize, const R: usize>(
    rec: [*const u8; G],
    vals: [*const u8; G],
    xq: &QActs,
    at: impl Fn(usize) -> usize,
    dots: &mut [[__m256i; G]; R],
) {
    unsafe {
        debug_assert_eq!(G, 2 * P);
        let head = record(GgmlType::Q4K).1;
        let x = xq.q.as_ptr().add(at(0) * QB);
        // (Row 1's index is only arithmetic: a tile of one row reads none of it.)
        let row = (at(1) - at(0)) * QB;
        let mut sums = [[_mm512_setzero_si512(); P]; R];
        for pair in 0..4 {
            let x = x.add(2 * pair * QB);
            let s = if FIVE {
                // Sub-block `2·pair`'s decoded chunks, then `2·pair + 1`'s.
                let w = |g: usize| vals[g].add(512 * pair);
                [decoded_x2_vnni::<R>(w(0), w(1), x, row); P]
            } else {
                let w = |g: usize| rec[g].add(head + 256 * pair);
                nibbles_vnni::<P, R>(std::array::from_fn(|p| [w(2 * p), w(2 * p + 1)]), x, row)
            };
            for (p, s) in s.iter().enumerate() {
                // The pair's scales of sub-blocks `2·pair` and `2·pair + 1`, its first group's low.
                let sc = |g: usize| rec[2 * p + g].add(32 + 16 * pair);
                let lo = _mm512_cvtepu8_epi32(two_groups_8(sc(0), sc(1)));
                let lo = if FIVE { lo } else { _mm512_slli_epi32(lo, 4) };
                let hi = _mm512_cvtepu8_epi32(two_groups_8(sc(0).add(8), sc(1).add(8)));
                for (sums, s) in sums.iter_mut().zip(s) {
                    let scaled = _mm512_add_epi32(_mm512_mullo_epi32(s[0], lo), _mm512_mullo_epi32(s[1], hi));
                    sums[p] = _mm512_add_epi32(sums[p], scaled);
                }
            }
        }
        for (dots, sums) in dots.iter_mut().zip(&sums) {
            for (p, &sums) in sums.iter().enumerate() {
                let sums = if FIVE { sums } else { _mm512_srai_epi32(sums, 4) };
                dots[2 * p] = _mm256_add_epi32(dots[2 * p], _mm512_castsi512_si256(sums));
                dots[2 * p + 1] = _mm256_add_epi32(dots[2 * p + 1], _mm512_extracti64x4_epi64::<1>(sums));
            }
        }
    }
}

/// 32 bytes of each of two groups (at `a`, `b`) in one register, `a`'s in the low half:
/// lane `r` and lane `8 + r` hold row `r` of the first and the second group.
///
/// # Safety
/// What [`vnni`] checks must be available and `a`, `b` hold 32 bytes each.
#[inline(always)]
pub(super) unsafe fn two_groups(a: *const u8, b: *const u8) -> __m512i {
    unsafe {
        let lo = _mm512_castsi256_si512(_mm256_loadu_si256(a.cast()));
        _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(b.cast()))
    }
}

/// Two groups' eight f32 lanes (`a`'s, then `b`'s) in one register, as [`two_groups`].
///
/// # Safety
/// What [`vnni`] checks must be available.
#[inline(always)]
pub(super) unsafe fn two_groups_ps(a: __m256, b: __m256) -> __m512 {
    unsafe {
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b)))
    }
}

/// Group `g`'s eight lanes (0: the low half) of a register of [`two_groups_ps`].
///
/// # Safety
/// What [`vnni`] checks must be available.
#[inline(always)]
pub(super) unsafe fn group_ps(v: __m512, g: usize) -> __m256 {
    unsafe {
        let v = _mm512_castps_pd(v);
        _mm256_castpd_ps(if g == 0 { _mm512_castpd512_pd256(v) } else { _mm512_extractf64x4_pd::<1>(v) })
    }
}

/// Stores each group's rows of `acc` (registers of [`two_groups_ps`]) to its `out`.
///
/// # Safety
/// What [`vnni`] checks must be available.
#[inline(always)]
pub(super) unsafe fn store_two<const R: usize>(acc: &[__m512; R], out: [&mut [[f32; GROUP]; TILE]; 2]) {
    unsafe {
        for (g, out) in out.into_iter().enumerate() {
            let mut col = [_mm256_setzero_ps(); R];
            for (col, &acc) in col.iter_mut().zip(acc) {
                *col = group_ps(acc, g);
            }
            store(&col, out);
        }
    }
}

/// Eight bytes of each of two groups (at `a`, `b`; a byte per row), `a`'s first.
///
/// # Safety
/// SSE2 must be available and `a`, `b` hold eight bytes each.
#[inline(always)]
pub(super) unsafe fn two_groups_8(a: *const u8, b: *const u8) -> __m128i {
    unsafe { _mm_unpacklo_epi64(_mm_loadl_epi64(a.cast()), _mm_loadl_epi64(b.cast())) }
}

/// One block of one group's Q4_K records (`rec`) against `R` activation rows (row `t`'s
/// block at sub-block index `at(t)` of `x`): [`k_block_vnni`]'s sums, a chunk's nibbles
/// masked in place once for all the rows. Two neighbouring chunks share each 512-bit
/// register, so that the group's records stay one stream (two groups side by side read
/// as two, and slower from memory) while each load and `vpdpbusd` does twice the work.
/// One permute per load puts each row's lanes of the two chunks side by side, so that
/// a row's eight activation bytes for them are a 64-bit broadcast (a load), not a
/// permute per row. One row (a decode's product of a matrix and a vector) splits each
/// half's chain of `vpdpbusd`s in two, so that four run side by side; more rows have
/// chains enough. The same integers as [`k_sub`]'s.
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
        let (low, high) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0xF0u8 as i8));
        // Row `r`'s lanes of the even chunk and of the odd one side by side (`2r`, `2r + 1`),
        // so that each row's eight activation bytes for them are one 64-bit broadcast.
        let spread = _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
        // Chains per half of a row: `[row][chain][half]`.
        let split = if R == 1 { 2 } else { 1 };
        // Each activation row's block sums, a weight row's in two neighbouring lanes, folded
        // to eight lanes once at the end.
        let mut sums = [_mm512_setzero_si512(); R];
        for pair in 0..4 {
            let w = rec.add(head + 256 * pair);
            let mut s = [[[_mm512_setzero_si512(); 2]; 2]; R];
            for c in 0..4 {
                let v = _mm512_permutexvar_epi32(spread, _mm512_loadu_si512(w.add(64 * c).cast()));
                let (lo, hi) = (_mm512_and_si512(v, low), _mm512_and_si512(v, high));
                let i = c % split;
                for (t, s) in s.iter_mut().enumerate() {
                    let x = x.add((at(t) + 2 * pair) * QB + 8 * c);
                    s[i][0] = _mm512_dpbusd_epi32(s[i][0], lo, bcast8(x));
                    s[i][1] = _mm512_dpbusd_epi32(s[i][1], hi, bcast8(x.add(QB)));
                }
            }
            let sc = pair_scales_x2(rec, pair);
            // A row's chains (the second stays zero from two rows on), and both halves of
            // each, times their scales.
            for (sums, s) in sums.iter_mut().zip(&s) {
                let (lo, hi) = (_mm512_add_epi32(s[0][0], s[1][0]), _mm512_add_epi32(s[0][1], s[1][1]));
                let scaled = _mm512_add_epi32(_mm512_mullo_epi32(lo, sc[0]), _mm512_mullo_epi32(hi, sc[1]));
                *sums = _mm512_add_epi32(*sums, scaled);
            }
        }
        let mut out = [_mm256_setzero_si256(); R];
        for (out, &s) in out.iter_mut().zip(&sums) {
            *out = _mm256_srai_epi32(fold_pairs(s), 4);
        }
        out
    }
}

/// [`k_rows_vnni`] in 256-bit registers, for CPUs that split 512-bit operations in two
/// ([`half_width_512`]): one chunk a register, each row's activation bytes a 32-bit
/// broadcast, so there is no permute and no fold of neighbouring lanes. The same integers.
///
/// # Safety
/// As [`k_rows_vnni`]'s.
#[inline(always)]
pub(super) unsafe fn k_rows_256<const R: usize>(
    rec: *const u8,
    x: *const i8,
    at: impl Fn(usize) -> usize,
) -> [__m256i; R] {
    unsafe {
        let head = record(GgmlType::Q4K).1;
        let (low, high) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0xF0u8 as i8));
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
            let sc = pair_scales(rec, pair);
            for (sums, s) in sums.iter_mut().zip(&s) {
                add_scaled(sums, [_mm256_add_epi32(s[0][0], s[1][0]), _mm256_add_epi32(s[0][1], s[1][1])], sc);
            }
        }
        for s in sums.iter_mut() {
            *s = _mm256_srai_epi32(*s, 4);
        }
        sums
    }
}

/// The eight rows' 6-bit scales of sub-blocks `2·pair` and `2·pair + 1` of the Q4_K
/// record at `rec`, the first times 16 (its nibbles are masked in place, [`k_block_vnni`]).
///
/// # Safety
/// AVX2 must be available and `rec` be a whole Q4_K record.
#[inline(always)]
unsafe fn pair_scales(rec: *const u8, pair: usize) -> [__m256i; 2] {
    unsafe {
        let sc = rec.add(32 + 16 * pair);
        let lo = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.cast())), 4);
        [lo, _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.add(8).cast()))]
    }
}

/// [`pair_scales`] in 512-bit registers, each row's scale in its two neighbouring lanes
/// (`2r`, `2r + 1`), as [`k_rows_vnni`]'s sums hold a row's.
///
/// # Safety
/// What [`vnni`] checks must be available and `rec` be a whole Q4_K record.
#[inline(always)]
unsafe fn pair_scales_x2(rec: *const u8, pair: usize) -> [__m512i; 2] {
    unsafe {
        let sc = rec.add(32 + 16 * pair);
        let (lo, hi) = (_mm_loadl_epi64(sc.cast()), _mm_loadl_epi64(sc.add(8).cast()));
        let lo = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, lo)), 4);
        [lo, _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(hi, hi))]
    }
}

/// Adds a sub-block pair's sums `s`, times their scales `sc` ([`pair_scales`]), to `sums`.
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
unsafe fn add_scaled(sums: &mut __m256i, s: [__m256i; 2], sc: [__m256i; 2]) {
    unsafe {
        let scaled = _mm256_add_epi32(_mm256_mullo_epi32(s[0], sc[0]), _mm256_mullo_epi32(s[1], sc[1]));
        *sums = _mm256_add_epi32(*sums, scaled);
    }
}

/// Eight activation bytes at `x` in every 64-bit lane: a broadcast from memory, which
/// takes no shuffle.
///
/// # Safety
/// What [`vnni`] checks must be available and `x` hold eight bytes.
#[inline(always)]
unsafe fn bcast8(x: *const i8) -> __m512i {
    unsafe { _mm512_set1_epi64(x.cast::<i64>().read_unaligned()) }
}

/// `z`'s neighbouring lanes added: eight i32 sums.
///
/// # Safety
/// What [`vnni`] checks must be available.
#[inline(always)]
unsafe fn fold_pairs(z: __m512i) -> __m256i {
    unsafe { _mm512_cvtepi64_epi32(_mm512_add_epi32(z, _mm512_srli_epi64::<32>(z))) }
}

/// The i32 sums of two sub-blocks of decoded values (from `w0`, `w1`: eight 32-byte
/// chunks each, the second sub-block's 256 bytes on) of two groups against `R`
/// activation rows (from `x`, `row` bytes apart; the second sub-block's 32 bytes on):
/// `[row][sub-block]`, the groups in the halves, as [`nibbles_x2_vnni`].
///
/// # Safety
/// What [`vnni`] checks must be available; `w0` and `w1` hold two decoded sub-blocks and
/// `x` `R` rows' activations, `row` bytes apart.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn decoded_x2_vnni<const R: usize>(
    w0: *const u8,
    w1: *const u8,
    x: *const i8,
    row: usize,
) -> [[__m512i; 2]; R] {
    unsafe {
        let mut s = [[_mm512_setzero_si512(); 2]; R];
        for c in 0..8 {
            let w =
                [two_groups(w0.add(32 * c), w1.add(32 * c)), two_groups(w0.add(256 + 32 * c), w1.add(256 + 32 * c))];
            dots_x2(&mut s, &w, x.add(4 * c), row, 32);
        }
        s
    }
}

/// The i32 sums of two Q4_K sub-blocks (the low nibbles, then the high ones masked in
/// place) of `P` pairs of groups' records (nibbles at `w[p]`, eight 32-byte chunks
/// each) against `R` activation rows (from `x`, `row` bytes apart; the second
/// sub-block's 32 bytes on): `[pair][row][sub-block]`, a pair's first group's rows in
/// the low halves ([`two_groups`]). Each broadcast of activations feeds the `P` pairs:
/// one per `vpdpbusd` kept the load ports busier than the multiply-adds.
///
/// # Safety
/// What [`vnni`] checks must be available; each `w[p]` holds eight chunks of nibbles of
/// two groups and `x` `R` rows' activations, `row` bytes apart.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn nibbles_vnni<const P: usize, const R: usize>(
    w: [[*const u8; 2]; P],
    x: *const i8,
    row: usize,
) -> [[[__m512i; 2]; R]; P] {
    unsafe {
        let (low, high) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0xF0u8 as i8));
        let mut s = [[[_mm512_setzero_si512(); 2]; R]; P];
        for c in 0..8 {
            let w: [[__m512i; 2]; P] = std::array::from_fn(|p| {
                let v = two_groups(w[p][0].add(32 * c), w[p][1].add(32 * c));
                [_mm512_and_si512(v, low), _mm512_and_si512(v, high)]
            });
            for t in 0..R {
                for h in 0..2 {
                    let xb = _mm512_set1_epi32(x.add(t * row + 32 * h + 4 * c).cast::<i32>().read_unaligned());
                    for (s, w) in s.iter_mut().zip(&w) {
                        s[t][h] = _mm512_dpbusd_epi32(s[t][h], w[h], xb);
                    }
                }
            }
        }
        s
    }
}

/// Adds one chunk of two groups' weights `w` (`[half]`, the groups in the halves) against
/// `R` activation rows (from `x`, `row` bytes apart; each row's second half `half`
/// bytes on) to the sums `s` (`[row][half]`), one `vpdpbusd` each. Inlined only into
/// the AVX-512 VNNI kernels.
///
/// # Safety
/// What [`vnni`] checks must be available and `x` hold `R` rows' activations, `row`
/// bytes apart.
#[inline(always)]
pub(super) unsafe fn dots_x2<const R: usize>(
    s: &mut [[__m512i; 2]; R],
    w: &[__m512i; 2],
    x: *const i8,
    row: usize,
    half: usize,
) {
    unsafe {
        for (t, s) in s.iter_mut().enumerate() {
            for (h, (s, &w)) in s.iter_mut().zip(w).enumerate() {
                let x = _mm512_set1_epi32(x.add(t * row + half * h).cast::<i32>().read_unaligned());
                *s = _mm512_dpbusd_epi32(*s, w, x);
            }
        }
    }
}

/// The i32 sums of one Q6_K output (32 values) of `P` pairs of groups, each pair's
/// values decoded ahead side by side (at `w[p]`: eight 64-byte chunks of both groups,
/// the second 16 values' four from 256 bytes on, [`decode_pair`]) against `R`
/// activation rows (from `x`, `row` bytes apart; the second 16 values from 16 bytes on),
/// from `init` (`[half][row]`, the −32 offsets): `[pair][row][half]`, a pair's first
/// group in the low half of each register, so that each chain of `vpdpbusd`s is four
/// long and up to sixteen run side by side. Each broadcast of four activation bytes
/// feeds the `P` pairs: one per `vpdpbusd` kept the load ports busier than the
/// multiply-adds.
///
/// # Safety
/// What [`vnni`] checks must be available; each `w[p]` holds an output's values of a
/// pair and `x` `R` rows' activations, `row` bytes apart.
#[inline(always)]
pub(super) unsafe fn q6_halves_vnni<const P: usize, const R: usize>(
    w: [*const u8; P],
    x: *const i8,
    row: usize,
    init: [[__m512i; R]; 2],
) -> [[[__m512i; 2]; R]; P] {
    unsafe {
        let mut s = [[[_mm512_setzero_si512(); 2]; R]; P];
        for s in s.iter_mut() {
            for (t, s) in s.iter_mut().enumerate() {
                *s = [init[0][t], init[1][t]];
            }
        }
        for c in 0..4 {
            let w: [[__m512i; 2]; P] =
                std::array::from_fn(|p| std::array::from_fn(|h| _mm512_loadu_si512(w[p].add(256 * h + 64 * c).cast())));
            for t in 0..R {
                for h in 0..2 {
                    let xb = _mm512_set1_epi32(x.add(t * row + 16 * h + 4 * c).cast::<i32>().read_unaligned());
                    for (s, w) in s.iter_mut().zip(&w) {
                        s[t][h] = _mm512_dpbusd_epi32(s[t][h], w[h], xb);
                    }
                }
            }
        }
        s
    }
}

/// [`q6_k`]'s block for `G` groups (two or four), each pair's values decoded ahead side
/// by side (`vals[g]`: group `g`'s pair's, [`decode_pair`]), and `R` rows with VNNI:
/// output by output in a loop (unrolled, the outputs' sums, scales and pointers crowded
/// the registers and spilled), both 16-value halves of an output at once
/// ([`q6_halves_vnni`]), a pair in each 512-bit register; per row and lane the same
/// values as [`q6_out`]'s at every step (its scaled integer sums formed in f32, where
/// they are exact), so the same bits.
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
        debug_assert!((G == 2 || G == 4) && (1..=4).contains(&R));
        if G == 4 {
            q6_pairs_vnni::<F, G, 2, R>(rec, vals, sc_at, xq, offs, at, hb, blk)
        } else {
            q6_pairs_vnni::<F, G, 1, R>(rec, vals, sc_at, xq, offs, at, hb, blk)
        }
    }
}

/// [`q6_block_vnni`] over its `P = G / 2` pairs.
///
/// # Safety
/// As [`q6_block_vnni`]'s.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q6_pairs_vnni<const F: u8, const G: usize, const P: usize, const R: usize>(
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
        debug_assert_eq!(G, 2 * P);
        // (Row 1's index is only arithmetic: a tile of one row reads none of it.)
        let row = at(1) - at(0);
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        for (acc, blk) in acc.iter_mut().zip(blk.iter()) {
            for (p, acc) in acc.iter_mut().enumerate() {
                *acc = two_groups_ps(blk[2 * p], blk[2 * p + 1]);
            }
        }
        for o in 0..8 {
            // Output `o` is `i = o % 4` of half `n = o / 4`: its values 32·o on, its scales
            // `8·n + 2·i = 2·o` on (from `sc_at`).
            let mut init = [[_mm512_setzero_si512(); R]; 2];
            for (half, init) in init.iter_mut().enumerate() {
                for (t, init) in init.iter_mut().enumerate() {
                    *init = _mm512_set1_epi32(*offs.add((at(t) + 32 * o + 16 * half) / QH));
                }
            }
            let w = std::array::from_fn(|p| vals[2 * p].add(2 * 256 * o));
            let s = q6_halves_vnni::<P, R>(w, xq.q.as_ptr().add(at(0) + 32 * o), row, init);
            for (p, s) in s.iter().enumerate() {
                let sc = |g: usize| rec[2 * p + g].add(sc_at + 16 * o);
                let (lo, hi) = (q6_scales_2::<F>(sc(0), sc(1)), q6_scales_2::<F>(sc(0).add(8), sc(1).add(8)));
                let (lo, hi) = (_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi));
                for (t, (acc, s)) in acc.iter_mut().zip(s).enumerate() {
                    // The two halves' scaled sums in f32, exactly the integers two `vpmulld`s
                    // gave (two micro-ops each on Intel): a half's sum is at most 16 · 32 · 127
                    // and a scale at most 128, so products and sum stay under 2²⁴.
                    let first = _mm512_mul_ps(_mm512_cvtepi32_ps(s[0]), lo);
                    let dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1]), hi, first);
                    let dx = _mm512_set1_ps(*xq.d.get_unchecked(hb(t) + 2 * o));
                    acc[p] = _mm512_fmadd_ps(dot, dx, acc[p]);
                }
            }
        }
        for (blk, acc) in blk.iter_mut().zip(&acc) {
            for (p, &acc) in acc.iter().enumerate() {
                blk[2 * p] = group_ps(acc, 0);
                blk[2 * p + 1] = group_ps(acc, 1);
            }
        }
    }
}

/// [`q6_scales`] of two groups (eight rows' scales at `a`, then at `b`) as the lanes of
/// one 512-bit register, `a`'s in the low half.
///
/// # Safety
/// What [`vnni`] checks must be available and `a`, `b` hold eight bytes each.
#[inline(always)]
unsafe fn q6_scales_2<const F: u8>(a: *const u8, b: *const u8) -> __m512i {
    unsafe {
        let bytes = two_groups_8(a, b);
        if F == F_Q2K {
            _mm512_and_si512(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(0xF))
        } else {
            _mm512_cvtepi8_epi32(bytes)
        }
    }
}

/// [`k_mins`] of two groups at once (records at `a`, `b`), their running sums `acc` in
/// the halves of each register ([`two_groups_ps`]): one `vpdpwssd` per two sub-blocks'
/// mins where [`k_mins`] takes a `madd` and an add per group. The same integers and the
/// same float operations per lane.
///
/// # Safety
/// What [`vnni`] checks must be available; `a` and `b` hold `blocks` records of
/// `rec_bytes` and `xq` the activation rows `first..first + R`.
#[inline(always)]
pub(super) unsafe fn k_mins_two<const R: usize>(
    [a, b]: [*const u8; 2],
    rec_bytes: usize,
    xq: &QActs,
    first: usize,
    blocks: usize,
    acc: &mut [__m512; R],
) {
    unsafe {
        let pairs = xq.pair_sums().as_ptr();
        for blk in 0..blocks {
            let (a, b) = (a.add(blk * rec_bytes), b.add(blk * rec_bytes));
            let dmin =
                _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(b.add(16).cast()), _mm_loadu_si128(a.add(16).cast())));
            // Lane r (of each half): the i16 pair of row r's mins of sub-blocks 2j and 2j + 1.
            let mut m = [_mm512_setzero_si512(); 4];
            for (j, m) in m.iter_mut().enumerate() {
                *m = _mm512_cvtepu8_epi16(_mm256_set_m128i(min_pairs(b, j), min_pairs(a, j)));
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let xb = (first + t) * blocks + blk;
                let x = pairs.add(4 * xb);
                let mut s = _mm512_setzero_si512();
                for (j, m) in m.iter().enumerate() {
                    s = _mm512_dpwssd_epi32(s, *m, _mm512_set1_epi32(*x.add(j)));
                }
                let dx = _mm512_set1_ps(*xq.d.get_unchecked(16 * xb));
                *acc = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(s), *acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::qmatmul::{quantize_rows, tests::random_blocks};
    use crate::kernels::testing::random_vec;

    /// Both register widths of Q4_K's one-group tiles, each block's sums of `R` rows.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn both_widths<const R: usize>(data: &[u8], xq: &QActs, blocks: usize) -> Vec<[[i32; 8]; 2]> {
        let rec_bytes = record(GgmlType::Q4K).0;
        (0..blocks)
            .flat_map(|b| {
                let rec = data[b * rec_bytes..].as_ptr();
                let at = |t: usize| (t * blocks + b) * 8;
                // SAFETY: VNNI is present (the caller checked); `rec` is a whole record and
                // `xq` holds `R` rows of `blocks` blocks.
                let (wide, narrow) =
                    unsafe { (k_rows_vnni::<R>(rec, xq.q.as_ptr(), at), k_rows_256::<R>(rec, xq.q.as_ptr(), at)) };
                (0..R)
                    .map(move |t| [wide[t], narrow[t]].map(|v| unsafe { std::mem::transmute::<__m256i, [i32; 8]>(v) }))
            })
            .collect()
    }

    /// `k_rows_256` gives `k_rows_vnni`'s integers at every tile height, whichever of the
    /// two the day's CPU picks ([`half_width_512`]).
    #[test]
    fn q4_k_rows_agree_at_both_widths() {
        if !vnni() {
            return;
        }
        let (k, blocks) = (3 * 256, 3);
        let data = interleave(GgmlType::Q4K, &random_blocks(GgmlType::Q4K, GROUP * blocks, 61), k);
        let mut xq = QActs::default();
        quantize_rows(&random_vec(TILE * k, 62), TILE, k, act_scales(GgmlType::Q4K), &mut xq);
        // SAFETY: VNNI is present; `data` is one group's records of `blocks` blocks.
        let sums = unsafe {
            [
                both_widths::<1>(&data, &xq, blocks),
                both_widths::<2>(&data, &xq, blocks),
                both_widths::<3>(&data, &xq, blocks),
                both_widths::<4>(&data, &xq, blocks),
            ]
        };
        assert!(sums.iter().flatten().any(|[wide, _]| wide.iter().any(|&v| v != 0)), "all sums zero");
        for (r, sums) in sums.iter().enumerate() {
            for [wide, narrow] in sums {
                assert_eq!(wide, narrow, "{} rows", r + 1);
            }
        }
    }
}
