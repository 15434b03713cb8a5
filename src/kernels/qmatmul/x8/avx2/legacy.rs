//! The nibble formats Q4_1, Q5_0 and Q5_1: 16-value halves, each under its own
//! activation scale. (Q4_0 runs on [`q8`]'s kernels.)

use super::*;

/// The nibble formats: Q4_1 (`MIN`: `d·q + m`), and with `FIVE` the fifth bits, Q5_0
/// (values `q − 16`) and Q5_1. The values stay unsigned for `maddubs`; Q5_0's offset is
/// taken off the integer sum.
///
/// # Safety
/// AVX2, FMA and F16C must be available (with `V`, what [`vnni`] checks too); `src`
/// holds `blocks` records (and decoded values with `PRE`) and `xq` the activation rows
/// `first..first + R`.
#[inline(always)]
pub(super) unsafe fn legacy<const V: bool, const MIN: bool, const FIVE: bool, const R: usize>(
    src: Src,
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[f32; GROUP]; TILE],
) {
    unsafe {
        let dtype = match (MIN, FIVE) {
            (false, false) => unreachable!("Q4_0 runs on q8's kernels"),
            (true, false) => GgmlType::Q4_1,
            (false, true) => GgmlType::Q5_0,
            (true, true) => GgmlType::Q5_1,
        };
        let (rec_bytes, head) = record(dtype);
        let (masks, offset) = (shape(dtype).fifth_at(), -16);
        let p = src.rec;
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            let rec = p.add(b * rec_bytes);
            // Each half block (the low nibbles, then the high ones) under its own
            // activation scale; a lane's eight products of at most 31·127 sum in i16. The
            // halves are scaled and added first, then the weight scales once.
            let mut blk = [_mm256_setzero_ps(); R];
            for h in 0..2 {
                // w[c]: values 16h + 4c..16h + 4c + 4 of every row.
                let mut w = [_mm256_setzero_si256(); 4];
                for (c, w) in w.iter_mut().enumerate() {
                    *w = nibble_chunk(rec.add(head), h, c);
                    if FIVE {
                        *w = with_fifth::<V>(*w, rec.add(masks + 4 * (4 * h + c)).cast::<u32>().read_unaligned());
                    }
                }
                for (t, blk) in blk.iter_mut().enumerate() {
                    let xb = (first + t) * blocks + b;
                    let x = xq.q.as_ptr().add(xb * QB + QH * h);
                    // The −16 · Σx, first or last: the same i32 sum either way.
                    let offset = _mm256_set1_epi32(if MIN { 0 } else { offset * xq.sums.get_unchecked(2 * xb + h) });
                    let s = nibble_sums::<V>(&w, x, offset);
                    let dx = _mm256_set1_ps(*xq.d.get_unchecked(2 * xb + h));
                    *blk = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dx, *blk);
                }
            }
            weigh::<R>(rec, &blk, &mut acc);
        }
        // Q4_1's and Q5_1's offsets, `m · d_x · Σx` per block, in a pass of their own: the
        // group's records are in L1 by now, and the loop above keeps its registers for the
        // values.
        if MIN {
            for b in 0..blocks {
                let mw = _mm256_cvtph_ps(_mm_loadu_si128(p.add(b * rec_bytes + 16).cast()));
                for (t, acc) in acc.iter_mut().enumerate() {
                    let xb = (first + t) * blocks + b;
                    *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(*xq.dsum.get_unchecked(xb)), *acc);
                }
            }
        }
        store(&acc, out);
    }
}

/// Chunk `c` of half `h` of the 32-value blocks whose nibbles (or 4-bit indices) are at
/// `qs` (the low nibbles the first half, the high ones the second): four of each of the
/// eight rows.
///
/// # Safety
/// AVX2 must be available and `qs` hold a block's 128 bytes of nibbles.
#[inline(always)]
pub(super) unsafe fn nibble_chunk(qs: *const u8, h: usize, c: usize) -> __m256i {
    unsafe {
        let v = _mm256_loadu_si256(qs.add(32 * c).cast());
        let v = if h == 0 { v } else { _mm256_srli_epi16(v, 4) };
        _mm256_and_si256(v, _mm256_set1_epi8(0xF))
    }
}

/// One row's sum over a half block's four chunks of unsigned values `w` (at most 31)
/// against its activations at `x`, from `init`: with VNNI (`V`) one `vpdpbusd` a chunk;
/// with AVX2 the chunks' `maddubs` products (at most 4 · 2 · 31 · 127 a lane) gather in
/// i16 before one `madd`.
///
/// # Safety
/// AVX2 must be available (with `V`, what [`vnni`] checks too) and `x` hold 16 bytes.
#[inline(always)]
pub(super) unsafe fn nibble_sums<const V: bool>(w: &[__m256i; 4], x: *const i8, init: __m256i) -> __m256i {
    unsafe {
        if V {
            let mut s = init;
            for (c, w) in w.iter().enumerate() {
                s = dot4(s, *w, bcast(x.add(4 * c)));
            }
            return s;
        }
        let mut s16 = _mm256_maddubs_epi16(w[0], bcast(x));
        for (c, w) in w.iter().enumerate().skip(1) {
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*w, bcast(x.add(4 * c))));
        }
        _mm256_add_epi32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)), init)
    }
}

/// A chunk of nibbles `w` with 16 added where `mask` ([`Shape::fifth`]) has the byte's
/// bit: one masked add with AVX-512 (`V`); AVX2 spreads the mask's bits over the bytes
/// (lane `r` takes its four from the mask's byte `r / 2`) and compares.
///
/// # Safety
/// AVX2 must be available, and with `V` what [`vnni`] checks.
#[inline(always)]
pub(super) unsafe fn with_fifth<const V: bool>(w: __m256i, mask: u32) -> __m256i {
    unsafe {
        let sixteen = _mm256_set1_epi8(16);
        if V {
            return _mm256_mask_add_epi8(w, mask, w, sixteen);
        }
        let at: [i8; 32] = std::array::from_fn(|i| (i / 8) as i8);
        let bit: [u8; 32] = std::array::from_fn(|i| 1 << (i % 8));
        let bit = _mm256_loadu_si256(bit.as_ptr().cast());
        let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(mask as i32), _mm256_loadu_si256(at.as_ptr().cast()));
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        _mm256_or_si256(w, _mm256_and_si256(set, sixteen))
    }
}
