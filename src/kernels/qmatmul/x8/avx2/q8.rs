//! The formats with a weight scale per 32 values: Q8_0's signed bytes, IQ4_NL's, IQ4_XS's
//! and MXFP4's looked up from their indices, and the legacy nibble formats' (Q4_0, Q4_1,
//! Q5_0, Q5_1) as they are.

use super::*;

/// Q8_0: signed weights, so `|w|` against `x` carrying `w`'s sign. Each chunk loads
/// once for the tile's rows; a row's half-block sums gather in i32 and go straight
/// into its results under the product of the two scales, so that a row holds two
/// registers, not three (with a per-block sum as well, four rows spilled and ran
/// slower than one). Pairs of groups side by side run in [`q8_pairs`].
///
/// IQ4_NL (`F`) and IQ4_XS run here too: each chunk of their 4-bit indices becomes its
/// signed values with one byte shuffle from their [`table`], and IQ4_XS's weight scale of
/// 32 values is `d · (ls − 32)` (`blocks` counts its 256-value blocks; the loop runs over
/// 32). So does MXFP4, its doubled E2M1 values looked up likewise and its eight E8M0 bytes
/// made the f32 scales they halve to ([`e8m0x8`]). With `PRE`, the values come decoded
/// ahead ([`decode_lookup`]), offset by 128. The legacy formats' nibbles (with Q5_0's and
/// Q5_1's fifth bits, [`with_fifth`]) go in as they are, unsigned: Q4_0's values are
/// them less 8 and Q5_0's less 16, which come off the sum ([`unsigned_offset`]); Q4_1's
/// and Q5_1's are `d·q + m`, whose `m · d_x · Σx` per block is added in a pass of its own
/// once the group's records are in L1 ([`mins`]). Their two halves' sums, each under its
/// activation scale, add before the weight scale: a multiply fewer per row and half than
/// Q8_0's chain.
///
/// # Safety
/// AVX2, FMA and F16C must be available (with `V`, what [`vnni`] checks too); `src`
/// holds `blocks` records (and decoded values with `PRE`) and `xq` the activation rows
/// `first..first + R`.
#[inline(always)]
pub(super) unsafe fn q8<const V: bool, const F: u8, const PRE: bool, const R: usize>(
    src: Src,
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[f32; GROUP]; TILE],
) {
    unsafe {
        let dtype = q8_format(F);
        let ((rec_bytes, head), subs, sc_at) = (record(dtype), dtype.block().0 / QB, shape(dtype).bytes_at());
        let blocks = blocks * subs;
        let table = _mm256_broadcastsi128_si256(lookup_values::<F>());
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            let sub = b % subs;
            let rec = src.rec.add(b / subs * rec_bytes);
            let dw = q8_scales::<F>(rec, sc_at + GROUP * sub);
            let mut blk = [_mm256_setzero_ps(); R];
            for h in 0..2 {
                let mut s = [_mm256_setzero_si256(); R];
                if nibbles(F) {
                    let mut w = [_mm256_setzero_si256(); 4];
                    for (c, w) in w.iter_mut().enumerate() {
                        *w = nibble_chunk(rec.add(head), h, c);
                        if fifth(F) {
                            *w = with_fifth::<V>(*w, fifth_mask::<F>(rec, h, c));
                        }
                    }
                    for (t, s) in s.iter_mut().enumerate() {
                        let xb = (first + t) * blocks + b;
                        let init = _mm256_set1_epi32(-unsigned_offset(F) * xq.sums.get_unchecked(2 * xb + h));
                        *s = nibble_sums::<V>(&w, xq.q.as_ptr().add(xb * QB + QH * h), init);
                    }
                } else {
                    if V {
                        // `w + 128` is unsigned, and `Σ (w + 128)·x` starts from `−128 · Σx`.
                        for (t, s) in s.iter_mut().enumerate() {
                            *s = _mm256_set1_epi32(-128 * xq.sums.get_unchecked(2 * ((first + t) * blocks + b) + h));
                        }
                    }
                    for c in 0..4 {
                        let offset = _mm256_set1_epi8(-128);
                        let (w, uw) = if PRE {
                            let uw = _mm256_loadu_si256(src.vals.add(32 * (8 * b + 4 * h + c)).cast());
                            (_mm256_xor_si256(uw, offset), uw)
                        } else {
                            let w = if F == F_Q8_0 {
                                _mm256_loadu_si256(rec.add(head + 32 * (4 * h + c)).cast())
                            } else {
                                lookup_chunk(rec.add(head + 128 * sub), h, c, table)
                            };
                            (w, _mm256_xor_si256(w, offset))
                        };
                        let aw = _mm256_abs_epi8(w);
                        for (t, s) in s.iter_mut().enumerate() {
                            let x = bcast(xq.q.as_ptr().add(((first + t) * blocks + b) * QB + QH * h + 4 * c));
                            *s = if V {
                                dot4(*s, uw, x)
                            } else {
                                let prod = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
                                _mm256_add_epi32(*s, _mm256_madd_epi16(prod, ones))
                            };
                        }
                    }
                }
                for (t, ((acc, blk), s)) in acc.iter_mut().zip(&mut blk).zip(&s).enumerate() {
                    let dx = _mm256_set1_ps(*xq.d.get_unchecked(2 * ((first + t) * blocks + b) + h));
                    if nibbles(F) {
                        *blk = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*s), dx, *blk);
                    } else {
                        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*s), _mm256_mul_ps(dw, dx), *acc);
                    }
                }
            }
            if nibbles(F) {
                for (acc, &blk) in acc.iter_mut().zip(&blk) {
                    *acc = _mm256_fmadd_ps(dw, blk, *acc);
                }
            }
        }
        if has_min(F) {
            for b in 0..blocks {
                let mw = mins(src.rec.add(b * rec_bytes));
                for (t, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(*xq.dsum.get_unchecked((first + t) * blocks + b)), *acc);
                }
            }
        }
        store(&acc, out);
    }
}

/// [`q8`] for `P = G / 2` pairs of groups with VNNI ([`pairs`], [`quads`]), a pair in
/// each 512-bit register ([`two_groups`]), so that each broadcast of activations feeds a
/// pair's sixteen rows in one `vpdpbusd` (and, with two pairs, each row's broadcast,
/// offset and scale serve both): the same operations per lane as one group's, so the
/// same bits. With `PRE`, the [`lookup`] formats read each pair's values decoded side by
/// side ([`decode_pair`]), a chunk of both groups one load. Not Q5_0 or Q5_1 ([`pairs`]).
///
/// # Safety
/// As [`q8`]'s, for each of `G` groups (with `PRE`, `vals` each pair's decoded values,
/// at both of its groups), and what [`vnni`] checks.
#[inline(always)]
pub(super) unsafe fn q8_pairs<const F: u8, const PRE: bool, const G: usize, const P: usize, const R: usize>(
    src: [Src; G],
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[[f32; GROUP]; TILE]; G],
) {
    unsafe {
        debug_assert_eq!(G, 2 * P);
        let dtype = q8_format(F);
        let ((rec_bytes, head), subs, sc_at) = (record(dtype), dtype.block().0 / QB, shape(dtype).bytes_at());
        let blocks = blocks * subs;
        debug_assert!(src.iter().all(|s| s.vals.is_null() != PRE) && (F != F_Q8_0 || !PRE) && !fifth(F));
        let table = _mm512_broadcast_i32x4(lookup_values::<F>());
        let mut acc = [[_mm512_setzero_ps(); R]; P];
        for b in 0..blocks {
            let sub = b % subs;
            // Plain loops, not `array::from_fn`: its closure, left out of line, does not
            // take the kernel's target features, and its intrinsics turn into calls
            // (`scripts/inlined_intrinsics.py`).
            let mut rec = [std::ptr::null(); G];
            for (rec, src) in rec.iter_mut().zip(&src) {
                *rec = src.rec.add(b / subs * rec_bytes);
            }
            let at = sc_at + GROUP * sub;
            let mut dw = [_mm512_setzero_ps(); P];
            for (p, dw) in dw.iter_mut().enumerate() {
                *dw = two_groups_ps(q8_scales::<F>(rec[2 * p], at), q8_scales::<F>(rec[2 * p + 1], at));
            }
            let mut blk = [[_mm512_setzero_ps(); R]; P];
            for h in 0..2 {
                // The unsigned bytes are `w + offset`, and `Σ (w + offset)·x` starts from
                // `−offset · Σx`.
                let offset = unsigned_offset(F);
                let mut s = [[_mm512_setzero_si512(); R]; P];
                for t in 0..R {
                    let init = _mm512_set1_epi32(-offset * xq.sums.get_unchecked(2 * ((first + t) * blocks + b) + h));
                    for s in s.iter_mut() {
                        s[t] = init;
                    }
                }
                for c in 0..4 {
                    let mut uw = [_mm512_setzero_si512(); P];
                    for (p, uw) in uw.iter_mut().enumerate() {
                        if PRE {
                            *uw = _mm512_loadu_si512(src[2 * p].vals.add(64 * (8 * b + 4 * h + c)).cast());
                            continue;
                        }
                        let (a, b) = (rec[2 * p], rec[2 * p + 1]);
                        let w = if F == F_Q8_0 {
                            let at = head + 32 * (4 * h + c);
                            two_groups(a.add(at), b.add(at))
                        } else {
                            let at = head + 128 * sub + 32 * c;
                            let v = two_groups(a.add(at), b.add(at));
                            if nibbles(F) {
                                *uw = nibbles_x2(v, h);
                                continue;
                            }
                            lookup_x2(v, h, table)
                        };
                        *uw = _mm512_xor_si512(w, _mm512_set1_epi8(-128));
                    }
                    for t in 0..R {
                        let x = xq.q.as_ptr().add(((first + t) * blocks + b) * QB + QH * h + 4 * c);
                        let x = _mm512_set1_epi32(x.cast::<i32>().read_unaligned());
                        for (s, &uw) in s.iter_mut().zip(&uw) {
                            s[t] = _mm512_dpbusd_epi32(s[t], uw, x);
                        }
                    }
                }
                for t in 0..R {
                    let dx = _mm512_set1_ps(*xq.d.get_unchecked(2 * ((first + t) * blocks + b) + h));
                    for (((acc, blk), s), &dw) in acc.iter_mut().zip(&mut blk).zip(&s).zip(&dw) {
                        if nibbles(F) {
                            blk[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), dx, blk[t]);
                        } else {
                            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(dw, dx), acc[t]);
                        }
                    }
                }
            }
            if nibbles(F) {
                for ((acc, blk), &dw) in acc.iter_mut().zip(&blk).zip(&dw) {
                    for (acc, &blk) in acc.iter_mut().zip(blk) {
                        *acc = _mm512_fmadd_ps(dw, blk, *acc);
                    }
                }
            }
        }
        if has_min(F) {
            for b in 0..blocks {
                for (p, acc) in acc.iter_mut().enumerate() {
                    let at = b * rec_bytes;
                    let mw = two_groups_ps(mins(src[2 * p].rec.add(at)), mins(src[2 * p + 1].rec.add(at)));
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let dsum = _mm512_set1_ps(*xq.dsum.get_unchecked((first + t) * blocks + b));
                        *acc = _mm512_fmadd_ps(mw, dsum, *acc);
                    }
                }
            }
        }
        for (acc, out) in acc.iter().zip(out.chunks_exact_mut(2)) {
            let [a, b] = out else { unreachable!("pairs of groups") };
            store_two(acc, [a, b]);
        }
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

/// The sixteen signed values a [`lookup`] format `F`'s indices pick ([`table`]).
///
/// # Safety
/// SSE2 must be available.
#[inline(always)]
pub(super) unsafe fn lookup_values<const F: u8>() -> __m128i {
    unsafe { _mm_loadu_si128(table(q8_format(F)).as_ptr().cast()) }
}

/// What format `f`'s unsigned bytes add to its values: 8 to Q4_0's and 16 to Q5_0's,
/// their nibbles as they are; nothing to Q4_1's and Q5_1's, whose values are `d·q + m`
/// ([`has_min`]); 128 to every other's.
const fn unsigned_offset(f: u8) -> i32 {
    match f {
        F_Q4_0 => 8,
        F_Q5_0 => 16,
        F_Q4_1 | F_Q5_1 => 0,
        _ => 128,
    }
}

/// Whether format `f`'s values are the legacy formats' nibbles, as they are.
const fn nibbles(f: u8) -> bool {
    matches!(f, F_Q4_0 | F_Q4_1 | F_Q5_0 | F_Q5_1)
}

/// Whether format `f`'s nibbles have fifth bits: Q5_0's and Q5_1's.
const fn fifth(f: u8) -> bool {
    matches!(f, F_Q5_0 | F_Q5_1)
}

/// Whether format `f`'s values are `d·q + m`: Q4_1's and Q5_1's.
const fn has_min(f: u8) -> bool {
    matches!(f, F_Q4_1 | F_Q5_1)
}

/// The 32-bit mask of fifth bits ([`Shape::fifth`]) of chunk `c` of half `h` of format
/// `F`'s record at `rec`.
///
/// # Safety
/// `rec` must hold a record of `F`, Q5_0 or Q5_1.
#[inline(always)]
unsafe fn fifth_mask<const F: u8>(rec: *const u8, h: usize, c: usize) -> u32 {
    unsafe { rec.add(shape(q8_format(F)).fifth_at() + 4 * (4 * h + c)).cast::<u32>().read_unaligned() }
}

/// The eight rows' mins of the Q4_1 or Q5_1 record at `rec`, its second f16 field.
///
/// # Safety
/// F16C must be available and `rec` hold a Q4_1 or Q5_1 record.
#[inline(always)]
unsafe fn mins(rec: *const u8) -> __m256 {
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(rec.add(2 * GROUP).cast())) }
}

/// [`nibble_chunk`]'s values looked up in `table` ([`lookup_values`] in both 128-bit lanes).
///
/// # Safety
/// AVX2 must be available and `qs` hold a sub-block's 128 bytes of indices.
#[inline(always)]
pub(super) unsafe fn lookup_chunk(qs: *const u8, h: usize, c: usize, table: __m256i) -> __m256i {
    unsafe { _mm256_shuffle_epi8(table, nibble_chunk(qs, h, c)) }
}

/// Half `h`'s indices of a pair's chunk `v` ([`two_groups`]), as [`nibble_chunk`] in 512
/// bits.
///
/// # Safety
/// What [`vnni`] checks must be available.
#[inline(always)]
pub(super) unsafe fn nibbles_x2(v: __m512i, h: usize) -> __m512i {
    unsafe {
        let v = if h == 0 { v } else { _mm512_srli_epi16(v, 4) };
        _mm512_and_si512(v, _mm512_set1_epi8(0xF))
    }
}

/// [`nibbles_x2`]'s values looked up in `table` ([`lookup_values`] in every 128-bit lane).
///
/// # Safety
/// What [`vnni`] checks must be available.
#[inline(always)]
pub(super) unsafe fn lookup_x2(v: __m512i, h: usize, table: __m512i) -> __m512i {
    unsafe { _mm512_shuffle_epi8(table, nibbles_x2(v, h)) }
}

/// The format `F` of [`q8`].
const fn q8_format(f: u8) -> GgmlType {
    match f {
        F_Q4_0 => GgmlType::Q4_0,
        F_Q4_1 => GgmlType::Q4_1,
        F_Q5_0 => GgmlType::Q5_0,
        F_Q5_1 => GgmlType::Q5_1,
        F_IQ4_NL => GgmlType::Iq4Nl,
        F_IQ4_XS => GgmlType::Iq4Xs,
        F_MXFP4 => GgmlType::Mxfp4,
        _ => GgmlType::Q8_0,
    }
}

/// The eight rows' weight scales of the [`q8`] record at `rec` (IQ4_XS's 6-bit scales of
/// the 32 values at `sc` times its f16 scale).
///
/// # Safety
/// AVX2 and F16C must be available and `rec` hold a record.
#[inline(always)]
unsafe fn q8_scales<const F: u8>(rec: *const u8, sc: usize) -> __m256 {
    unsafe {
        let dw = if F == F_MXFP4 { e8m0x8(rec) } else { _mm256_cvtph_ps(_mm_loadu_si128(rec.cast())) };
        if F == F_IQ4_XS {
            let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(rec.add(sc).cast()));
            return _mm256_mul_ps(dw, _mm256_cvtepi32_ps(sc));
        }
        dw
    }
}

/// Eight E8M0 bytes at `p` as the f32s they halve to, exactly as [`crate::kernels::quant::e8m0_half`]:
/// `2^(e − 128)`, whose bits are `(e − 1) << 23` from `e = 2` and the subnormal
/// `0x0020_0000 << e` below.
///
/// # Safety
/// AVX2 must be available and `p` hold eight bytes.
#[inline(always)]
unsafe fn e8m0x8(p: *const u8) -> __m256 {
    unsafe {
        let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
        let normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        let small = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
        let below = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, below))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::e8m0_half;

    #[target_feature(enable = "avx2")]
    unsafe fn halves(bytes: &[u8; 8]) -> [f32; 8] {
        let mut out = [0f32; 8];
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), e8m0x8(bytes.as_ptr())) };
        out
    }

    /// Every E8M0 byte but the NaN one, subnormal halves included, gives `e8m0_half`'s bits.
    #[test]
    fn e8m0_bytes_become_their_halves_exactly() {
        if !crate::kernels::matmul::avx2::available() {
            return;
        }
        for first in (0..=254usize).step_by(8) {
            let bytes: [u8; 8] = std::array::from_fn(|i| (first + i).min(254) as u8);
            // SAFETY: AVX2 was detected.
            let got = unsafe { halves(&bytes) };
            for (b, g) in bytes.iter().zip(got) {
                assert_eq!(g.to_bits(), e8m0_half(*b).to_bits(), "byte {b}");
            }
        }
    }
}
