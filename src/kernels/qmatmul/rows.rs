//! The row-by-row path: each weight row in its file's layout, decoded one 32-value block at
//! a time. Every block format runs here; rows that [`super::x8`] interleaves do not.

use super::{write, Part, QActs, SharedOut, QB, QH, TILE};
use crate::kernels::quant::{
    e8m0_half, f16_at, iq4_indices_at, iq4_run_scale, scale_k3, scale_min_k4, tq1_0_code, GgmlType, BLOCK_FORMATS,
    IQ4_VALUES, MXFP4_VALUES,
};

pub(super) use portable::dot_rows as portable_dot_rows;

/// Weight rows per parallel task.
pub(super) const ROWS_PER_TASK: usize = 16;

/// Weight rows `rows` of part `p` against every row of `X`, written to column
/// `col0 + row` of `y` (row stride `n`).
///
/// # Safety
/// `y` must hold `m × n` values and no other task may write these columns.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rows_task(
    xq: &QActs,
    p: &Part,
    row_bytes: usize,
    k: usize,
    rows: std::ops::Range<usize>,
    col0: usize,
    n: usize,
    m: usize,
    y: SharedOut,
) {
    let blocks = k / QB;
    // A wide part's rows come in pairs, neighbours in every tile, added as written.
    const { assert!(TILE.is_multiple_of(2)) };
    let (xq, m, wide) = xq.for_part(p.dtype, m);
    // Activation tile outer, weight rows inner: a tile (8 rows) and the task's weight rows
    // both stay in L1 however long the step is.
    let mut i = 0;
    while i < m {
        let tile = TILE.min(m - i);
        for r in rows.clone() {
            let row = &p.data[r * row_bytes..(r + 1) * row_bytes];
            let mut acc = [0f32; TILE];
            dot_rows(p.dtype, row, xq, i, tile, blocks, &mut acc);
            if wide {
                let sums: [f32; TILE / 2] = std::array::from_fn(|t| acc[2 * t] + acc[2 * t + 1]);
                write(y, n, col0 + r, i / 2, &sums[..tile / 2]);
            } else {
                write(y, n, col0 + r, i, &acc[..tile]);
            }
        }
        i += tile;
    }
}

/// One weight row against activation rows `first..first + tile`: AVX2 where the CPU has
/// it, else the portable loop.
fn dot_rows(dtype: GgmlType, row: &[u8], xq: &QActs, first: usize, tile: usize, blocks: usize, acc: &mut [f32; TILE]) {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: AVX2, FMA and F16C were detected; the row and activations hold `blocks` blocks.
        return unsafe { avx2::dot_rows(dtype, row, xq, first, tile, blocks, acc) };
    }
    portable::dot_rows(dtype, row, xq, first, tile, blocks, acc)
}

/// A decoded 32-value weight block: `w_i · scale[i / 16] + offset[i / 16]`.
struct Block {
    q: [i8; QB],
    scale: [f32; 2],
    offset: [f32; 2],
}

/// The bytes of the block holding 32-block `b` of a row, and which 32-block of it that is.
fn locate(dtype: GgmlType, row: &[u8], b: usize) -> (&[u8], usize) {
    let (per, bytes) = dtype.block();
    let per_super = per / QB;
    let s = b / per_super;
    (&row[s * bytes..(s + 1) * bytes], b % per_super)
}

/// Decodes 32-block `sub` of one GGML block (any format), scalar.
fn decode(dtype: GgmlType, blk: &[u8], sub: usize) -> Block {
    let mut q = [0i8; QB];
    let same = |s: f32, o: f32| ([s, s], [o, o]);
    let (scale, offset) = match dtype {
        GgmlType::Q8_0 => {
            q.iter_mut().zip(&blk[2..34]).for_each(|(q, &b)| *q = b as i8);
            same(f16_at(blk, 0), 0.0)
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (base, bias) = if dtype == GgmlType::Q4_0 { (2, 8) } else { (4, 0) };
            for (j, &b) in blk[base..base + 16].iter().enumerate() {
                q[j] = (b & 0xF) as i8 - bias;
                q[j + 16] = (b >> 4) as i8 - bias;
            }
            if dtype == GgmlType::Q4_0 {
                same(f16_at(blk, 0), 0.0)
            } else {
                same(f16_at(blk, 0), f16_at(blk, 2))
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (h, base, bias) = if dtype == GgmlType::Q5_0 { (2, 6, 16) } else { (4, 8, 0) };
            let qh = u32::from_le_bytes([blk[h], blk[h + 1], blk[h + 2], blk[h + 3]]);
            for (j, &b) in blk[base..base + 16].iter().enumerate() {
                q[j] = ((b & 0xF) | ((((qh >> j) & 1) as u8) << 4)) as i8 - bias;
                q[j + 16] = ((b >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4)) as i8 - bias;
            }
            if dtype == GgmlType::Q5_0 {
                same(f16_at(blk, 0), 0.0)
            } else {
                same(f16_at(blk, 0), f16_at(blk, 2))
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let (pair, half) = (sub / 2, sub % 2);
            let five = dtype == GgmlType::Q5K;
            let qs = if five { &blk[48 + pair * 32..80 + pair * 32] } else { &blk[16 + pair * 32..48 + pair * 32] };
            for (l, &b) in qs.iter().enumerate() {
                let mut v = if half == 0 { b & 0xF } else { b >> 4 };
                if five && blk[16 + l] & (1 << sub) != 0 {
                    v += 16;
                }
                q[l] = v as i8;
            }
            let (sc, m) = scale_min_k4(sub, &blk[4..16]);
            same(f16_at(blk, 0) * sc as f32, -(f16_at(blk, 2) * m as f32))
        }
        GgmlType::Q6K => {
            let (n, part) = (sub / 4, sub % 4);
            let ql = &blk[n * 64 + (part % 2) * 32..n * 64 + (part % 2) * 32 + 32];
            let qh = &blk[128 + n * 32..160 + n * 32];
            for l in 0..QB {
                let low = if part < 2 { ql[l] & 0xF } else { ql[l] >> 4 };
                q[l] = (low | (((qh[l] >> (2 * part)) & 3) << 4)) as i8 - 32;
            }
            let d = f16_at(blk, 208);
            let sc = &blk[192 + n * 8..200 + n * 8];
            ([d * (sc[2 * part] as i8) as f32, d * (sc[2 * part + 1] as i8) as f32], [0.0, 0.0])
        }
        GgmlType::Q2K => {
            let (n, shift) = (sub / 4, 2 * (sub % 4));
            for (l, q) in q.iter_mut().enumerate() {
                *q = ((blk[16 + n * 32 + l] >> shift) & 3) as i8;
            }
            let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
            let sc = [blk[2 * sub], blk[2 * sub + 1]];
            (
                [d * (sc[0] & 0xF) as f32, d * (sc[1] & 0xF) as f32],
                [-(dmin * (sc[0] >> 4) as f32), -(dmin * (sc[1] >> 4) as f32)],
            )
        }
        GgmlType::Q3K => {
            let (n, j) = (sub / 4, sub % 4);
            let m = 1u8 << (4 * n + j);
            for (l, q) in q.iter_mut().enumerate() {
                let low = ((blk[32 + n * 32 + l] >> (2 * j)) & 3) as i8;
                *q = low - if blk[l] & m != 0 { 0 } else { 4 };
            }
            ([q3_k_scale(blk, 2 * sub), q3_k_scale(blk, 2 * sub + 1)], [0.0, 0.0])
        }
        GgmlType::Iq4Nl | GgmlType::Iq4Xs => {
            let at = iq4_indices_at(dtype, sub);
            for (j, &b) in blk[at..at + 16].iter().enumerate() {
                q[j] = IQ4_VALUES[(b & 0xF) as usize];
                q[j + 16] = IQ4_VALUES[(b >> 4) as usize];
            }
            same(iq4_run_scale(dtype, blk, sub), 0.0)
        }
        GgmlType::Mxfp4 => {
            for (j, &b) in blk[1..17].iter().enumerate() {
                q[j] = MXFP4_VALUES[(b & 0xF) as usize];
                q[j + 16] = MXFP4_VALUES[(b >> 4) as usize];
            }
            same(e8m0_half(blk[0]), 0.0)
        }
        GgmlType::Tq2_0 => {
            // Values 32·sub.. are bits 2·(sub % 4) of the 32 bytes of half sub / 4.
            let (h, shift) = (sub / 4, 2 * (sub % 4));
            for (m, q) in q.iter_mut().enumerate() {
                *q = ((blk[32 * h + m] >> shift) & 3) as i8 - 1;
            }
            same(f16_at(blk, 64), 0.0)
        }
        GgmlType::Tq1_0 => {
            for (j, q) in q.iter_mut().enumerate() {
                *q = tq1_0_code(blk, QB * sub + j) as i8 - 1;
            }
            same(f16_at(blk, 52), 0.0)
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::I2s => {
            unreachable!("{dtype} is not computed in blocks")
        }
    };
    Block { q, scale, offset }
}

/// Q3_K's scale of values `16i..16i + 16`: `d` times its 6-bit scale less 32.
fn q3_k_scale(blk: &[u8], i: usize) -> f32 {
    f16_at(blk, 108) * scale_k3(i, &blk[96..108]) as f32
}

/// The offsets' share of a block's dot product: one offset for all 32 values uses the
/// precomputed `Σ d · Σq`; two use each half's scale and sum.
#[inline]
fn offset_term(xq: &QActs, xb: usize, offset: [f32; 2]) -> f32 {
    if offset[0] == offset[1] {
        offset[0] * xq.dsum[xb]
    } else {
        offset[0] * xq.d[2 * xb] * xq.sums[2 * xb] as f32 + offset[1] * xq.d[2 * xb + 1] * xq.sums[2 * xb + 1] as f32
    }
}

mod portable {
    use super::*;

    /// Rows `first..first + tile` of `X` against one weight row, every 32-block in order.
    pub fn dot_rows(
        dtype: GgmlType,
        row: &[u8],
        xq: &QActs,
        first: usize,
        tile: usize,
        blocks: usize,
        acc: &mut [f32; TILE],
    ) {
        for b in 0..blocks {
            let (blk, sub) = locate(dtype, row, b);
            let w = decode(dtype, blk, sub);
            for (t, acc) in acc[..tile].iter_mut().enumerate() {
                let xb = (first + t) * blocks + b;
                let x = &xq.q[xb * QB..(xb + 1) * QB];
                let half = |h: usize| -> i32 { (h * QH..(h + 1) * QH).map(|i| w.q[i] as i32 * x[i] as i32).sum() };
                *acc += xq.d[2 * xb] * w.scale[0] * half(0) as f32 + xq.d[2 * xb + 1] * w.scale[1] * half(1) as f32;
                *acc += offset_term(xq, xb, w.offset);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        // The f32 kernels' check includes F16C (their 16-bit panels need it too).
        crate::kernels::matmul::avx2::available()
    }

    /// The f16 at byte `i` of `b`, converted by the F16C unit.
    ///
    /// # Safety
    /// F16C must be available and `b` hold two bytes at `i`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_at(b: &[u8], i: usize) -> f32 {
        unsafe {
            let h = u16::from_le_bytes([*b.get_unchecked(i), *b.get_unchecked(i + 1)]);
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
        }
    }

    /// The 16 bytes at `at` as 32 nibbles: low nibbles first, then high ones.
    ///
    /// # Safety
    /// AVX2 must be available and `p` hold 16 bytes from `at`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles(p: *const u8, at: usize) -> __m256i {
        unsafe {
            let b = _mm_loadu_si128(p.add(at).cast());
            let lo = _mm_and_si128(b, _mm_set1_epi8(0xF));
            let hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0xF));
            _mm256_set_m128i(hi, lo)
        }
    }

    /// Bit i of the u32 at `at` as byte i: 0x10 where set.
    ///
    /// # Safety
    /// AVX2 must be available and `blk` hold four bytes at `at`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fifth_bits(blk: &[u8], at: usize) -> __m256i {
        let bits = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0),
        );
        let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, mask), _mm256_set1_epi64x(-1));
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    /// Weights of one 32-block as int8 lanes, plus its scales and offsets.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available and `blk` be one whole block of `dtype`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn decode_vec(dtype: GgmlType, blk: &[u8], sub: usize) -> (__m256i, [f32; 2], [f32; 2]) {
        unsafe {
            let p = blk.as_ptr();
            let low4 = _mm256_set1_epi8(0xF);
            let nibbles = |at: usize| nibbles(p, at);
            let fifth_bits = |at: usize| fifth_bits(blk, at);
            let same = |s: f32, o: f32| ([s, s], [o, o]);
            match dtype {
                GgmlType::Q8_0 => (_mm256_loadu_si256(p.add(2).cast()), [f16_at(blk, 0); 2], [0.0; 2]),
                GgmlType::Q4_0 => {
                    let (s, o) = same(f16_at(blk, 0), 0.0);
                    (_mm256_sub_epi8(nibbles(2), _mm256_set1_epi8(8)), s, o)
                }
                GgmlType::Q4_1 => {
                    let (s, o) = same(f16_at(blk, 0), f16_at(blk, 2));
                    (nibbles(4), s, o)
                }
                GgmlType::Q5_0 => {
                    let q = _mm256_or_si256(nibbles(6), fifth_bits(2));
                    let (s, o) = same(f16_at(blk, 0), 0.0);
                    (_mm256_sub_epi8(q, _mm256_set1_epi8(16)), s, o)
                }
                GgmlType::Q5_1 => {
                    let (s, o) = same(f16_at(blk, 0), f16_at(blk, 2));
                    (_mm256_or_si256(nibbles(8), fifth_bits(4)), s, o)
                }
                GgmlType::Q4K | GgmlType::Q5K => {
                    let (pair, half) = (sub / 2, sub % 2);
                    let five = dtype == GgmlType::Q5K;
                    let at = if five { 48 } else { 16 } + pair * 32;
                    let v = _mm256_loadu_si256(p.add(at).cast());
                    let mut q = if half == 0 { v } else { _mm256_srli_epi16(v, 4) };
                    q = _mm256_and_si256(q, low4);
                    if five {
                        let bit = _mm256_set1_epi8(1 << sub);
                        let h = _mm256_loadu_si256(p.add(16).cast());
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
                        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
                    }
                    let (sc, m) = scale_min_k4(sub, &blk[4..16]);
                    let (s, o) = same(f16_at(blk, 0) * sc as f32, -(f16_at(blk, 2) * m as f32));
                    (q, s, o)
                }
                GgmlType::Q6K => {
                    let (n, part) = (sub / 4, sub % 4);
                    let ql = _mm256_loadu_si256(p.add(n * 64 + (part % 2) * 32).cast());
                    let low = if part < 2 { ql } else { _mm256_srli_epi16(ql, 4) };
                    let qh = _mm256_loadu_si256(p.add(128 + n * 32).cast());
                    let high =
                        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * part as i32)), _mm256_set1_epi8(3));
                    let q = _mm256_or_si256(_mm256_and_si256(low, low4), _mm256_slli_epi16(high, 4));
                    let d = f16_at(blk, 208);
                    let sc = &blk[192 + n * 8..200 + n * 8];
                    let s = [d * (sc[2 * part] as i8) as f32, d * (sc[2 * part + 1] as i8) as f32];
                    (_mm256_sub_epi8(q, _mm256_set1_epi8(32)), s, [0.0; 2])
                }
                GgmlType::Q2K => {
                    let (n, shift) = (sub / 4, _mm_cvtsi32_si128(2 * (sub % 4) as i32));
                    let v = _mm256_loadu_si256(p.add(16 + n * 32).cast());
                    let q = _mm256_and_si256(_mm256_srl_epi16(v, shift), _mm256_set1_epi8(3));
                    let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
                    let sc = [blk[2 * sub], blk[2 * sub + 1]];
                    let scale = [d * (sc[0] & 0xF) as f32, d * (sc[1] & 0xF) as f32];
                    (q, scale, [-(dmin * (sc[0] >> 4) as f32), -(dmin * (sc[1] >> 4) as f32)])
                }
                GgmlType::Q3K => {
                    let (n, shift) = (sub / 4, _mm_cvtsi32_si128(2 * (sub % 4) as i32));
                    let v = _mm256_loadu_si256(p.add(32 + n * 32).cast());
                    let low = _mm256_and_si256(_mm256_srl_epi16(v, shift), _mm256_set1_epi8(3));
                    // Less 4 where the value's high bit (bit `sub` of its mask byte) is clear.
                    let bit = _mm256_set1_epi8((1u8 << sub) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256(p.cast()), bit), bit);
                    let four = _mm256_set1_epi8(4);
                    let q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_and_si256(set, four)), four);
                    (q, [q3_k_scale(blk, 2 * sub), q3_k_scale(blk, 2 * sub + 1)], [0.0; 2])
                }
                GgmlType::Iq4Nl | GgmlType::Iq4Xs => {
                    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_VALUES.as_ptr().cast()));
                    let (s, o) = same(iq4_run_scale(dtype, blk, sub), 0.0);
                    (_mm256_shuffle_epi8(table, nibbles(iq4_indices_at(dtype, sub))), s, o)
                }
                GgmlType::Mxfp4 => {
                    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(MXFP4_VALUES.as_ptr().cast()));
                    let (s, o) = same(e8m0_half(blk[0]), 0.0);
                    (_mm256_shuffle_epi8(table, nibbles(1)), s, o)
                }
                GgmlType::Tq2_0 => {
                    let (h, shift) = (sub / 4, _mm_cvtsi32_si128(2 * (sub % 4) as i32));
                    let v = _mm256_loadu_si256(p.add(32 * h).cast());
                    let codes = _mm256_and_si256(_mm256_srl_epi16(v, shift), _mm256_set1_epi8(3));
                    let (s, o) = same(f16_at(blk, 64), 0.0);
                    (_mm256_sub_epi8(codes, _mm256_set1_epi8(1)), s, o)
                }
                GgmlType::Tq1_0 => {
                    // Base-3 digits unpacked one at a time: this path runs only the tails of
                    // fewer than eight rows, which a ternary model does not have.
                    let q: [i8; QB] = std::array::from_fn(|j| tq1_0_code(blk, QB * sub + j) as i8 - 1);
                    let (s, o) = same(f16_at(blk, 52), 0.0);
                    (_mm256_loadu_si256(q.as_ptr().cast()), s, o)
                }
                GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::I2s => {
                    unreachable!("{dtype} is not computed in blocks")
                }
            }
        }
    }

    /// Rows `first..first + tile` of `X` against one weight row; each weight block is
    /// decoded once and used for every row of the tile.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    pub unsafe fn dot_rows(
        dtype: GgmlType,
        row: &[u8],
        xq: &QActs,
        first: usize,
        tile: usize,
        blocks: usize,
        acc_out: &mut [f32; TILE],
    ) {
        unsafe {
            // One copy of the loop per format and tile height, so decoding compiles to
            // straight-line code and the accumulators stay in registers.
            macro_rules! by_tile {
                ($f:literal) => {
                    match tile {
                        1 => dot_rows_as::<$f, 1>,
                        2 => dot_rows_as::<$f, 2>,
                        3 => dot_rows_as::<$f, 3>,
                        4 => dot_rows_as::<$f, 4>,
                        5 => dot_rows_as::<$f, 5>,
                        6 => dot_rows_as::<$f, 6>,
                        7 => dot_rows_as::<$f, 7>,
                        _ => dot_rows_as::<$f, 8>,
                    }
                };
            }
            let f = match dtype {
                GgmlType::Q8_0 => by_tile!(0),
                GgmlType::Q4_0 => by_tile!(1),
                GgmlType::Q4_1 => by_tile!(2),
                GgmlType::Q5_0 => by_tile!(3),
                GgmlType::Q5_1 => by_tile!(4),
                GgmlType::Q2K => by_tile!(5),
                GgmlType::Q3K => by_tile!(6),
                GgmlType::Q4K => by_tile!(7),
                GgmlType::Q5K => by_tile!(8),
                GgmlType::Q6K => by_tile!(9),
                GgmlType::Iq4Nl => by_tile!(10),
                GgmlType::Iq4Xs => by_tile!(11),
                GgmlType::Tq2_0 => by_tile!(12),
                GgmlType::Mxfp4 => by_tile!(13),
                GgmlType::Tq1_0 => by_tile!(14),
                GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::I2s => {
                    unreachable!("{dtype} is not computed in blocks")
                }
            };
            debug_assert!((1..=TILE).contains(&tile));
            f(row, xq, first, blocks, acc_out)
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available; `row` holds `blocks` blocks of format `F` and
    /// `xq` the activation rows `first..first + R`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_rows_as<const F: usize, const R: usize>(
        row: &[u8],
        xq: &QActs,
        first: usize,
        blocks: usize,
        acc_out: &mut [f32; TILE],
    ) {
        unsafe {
            let dtype = BLOCK_FORMATS[F];
            let mut acc = [_mm256_setzero_ps(); R];
            let mut acc_off = [0f32; R];
            let ones = _mm256_set1_epi16(1);
            for b in 0..blocks {
                let (blk, sub) = locate(dtype, row, b);
                let (w, scale, offset) = decode_vec(dtype, blk, sub);
                let aw = _mm256_sign_epi8(w, w);
                let one_scale = scale[0] == scale[1];
                let scales = if one_scale {
                    _mm256_set1_ps(scale[0])
                } else {
                    _mm256_setr_ps(scale[0], scale[0], scale[0], scale[0], scale[1], scale[1], scale[1], scale[1])
                };
                for (t, acc) in acc.iter_mut().enumerate() {
                    let xb = (first + t) * blocks + b;
                    let x = _mm256_loadu_si256(xq.q.as_ptr().add(xb * QB).cast());
                    // |w| · (x with w's sign): products as pairs of i16, then sums of 4 as i32.
                    let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones);
                    // Lanes 0..4 hold the first 16 values' sums, 4..8 the second's.
                    let d = _mm256_set_m128(
                        _mm_set1_ps(*xq.d.get_unchecked(2 * xb + 1)),
                        _mm_set1_ps(*xq.d.get_unchecked(2 * xb)),
                    );
                    *acc = _mm256_fmadd_ps(_mm256_mul_ps(d, scales), _mm256_cvtepi32_ps(prod), *acc);
                }
                if offset != [0.0; 2] {
                    for (t, acc_off) in acc_off.iter_mut().enumerate() {
                        *acc_off += offset_term(xq, (first + t) * blocks + b, offset);
                    }
                }
            }
            for ((out, v), off) in acc_out.iter_mut().zip(acc).zip(acc_off) {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                *out = _mm_cvtss_f32(s) + off;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::random_blocks;
    use super::super::{quantize_rows, ActScales, QActs};
    use super::*;
    use crate::kernels::testing::random_vec;

    /// The AVX2 decoders give the scalar ones' lanes, scales and offsets, and both dot
    /// paths agree.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_decoding_matches_scalar() {
        if !avx2::available() {
            return;
        }
        for dtype in BLOCK_FORMATS {
            let (per, bytes) = dtype.block();
            let raw = random_blocks(dtype, 3, 12);
            for blk in raw.chunks_exact(bytes) {
                for sub in 0..per / QB {
                    let want = decode(dtype, blk, sub);
                    // SAFETY: AVX2 was detected above.
                    let (v, scale, offset) = unsafe { avx2::decode_vec(dtype, blk, sub) };
                    let mut lanes = [0i8; QB];
                    // SAFETY: 32 bytes into a 32-byte array.
                    unsafe { std::arch::x86_64::_mm256_storeu_si256(lanes.as_mut_ptr().cast(), v) };
                    assert_eq!((lanes, scale, offset), (want.q, want.scale, want.offset), "{dtype:?} {sub}");
                }
            }
            let k = raw.len() / bytes * per;
            let x = random_vec(2 * k, 13);
            let mut xq = QActs::default();
            quantize_rows(&x, 2, k, ActScales::PerHalf, &mut xq);
            let (mut a, mut b) = ([0f32; TILE], [0f32; TILE]);
            portable::dot_rows(dtype, &raw, &xq, 0, 2, k / QB, &mut a);
            // SAFETY: AVX2 was detected above.
            unsafe { avx2::dot_rows(dtype, &raw, &xq, 0, 2, k / QB, &mut b) };
            for t in 0..2 {
                assert!((a[t] - b[t]).abs() <= 1e-5 * (1.0 + a[t].abs()), "{dtype:?}: {} vs {}", a[t], b[t]);
            }
        }
    }
}
