//! Signed byte values: Q8_0's, and IQ4_NL's, IQ4_XS's, MXFP4's and Q4_0's looked up from
//! their indices.

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
/// ahead ([`decode_lookup`]), offset by 128. Q4_0's values are its nibbles less 8: they go
/// in as they are, unsigned, and the 8 comes off the sum ([`unsigned_offset`]).
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
            for h in 0..2 {
                let mut s = [_mm256_setzero_si256(); R];
                if F == F_Q4_0 {
                    // Q4_0's nibbles as they are, `8 · Σx` off the sum, as the nibble
                    // formats' kernel takes them.
                    let mut w = [_mm256_setzero_si256(); 4];
                    for (c, w) in w.iter_mut().enumerate() {
                        *w = nibble_chunk(rec.add(head), h, c);
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
                for (t, (acc, s)) in acc.iter_mut().zip(&s).enumerate() {
                    let dx = _mm256_set1_ps(*xq.d.get_unchecked(2 * ((first + t) * blocks + b) + h));
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*s), _mm256_mul_ps(dw, dx), *acc);
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
/// side ([`decode_pair`]), a chunk of both groups one load.
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
        debug_assert!(src.iter().all(|s| s.vals.is_null() != PRE) && (F != F_Q8_0 || !PRE));
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
                            if F == F_Q4_0 {
                                // The nibbles, `w + 8`.
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
                    for ((acc, s), &dw) in acc.iter_mut().zip(&s).zip(&dw) {
                        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(dw, dx), acc[t]);
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

/// The sixteen signed values a [`lookup`] format `F`'s indices pick ([`table`]).
///
/// # Safety
/// SSE2 must be available.
#[inline(always)]
pub(super) unsafe fn lookup_values<const F: u8>() -> __m128i {
    unsafe { _mm_loadu_si128(table(q8_format(F)).as_ptr().cast()) }
}

/// What format `f`'s unsigned bytes add to its values: 8 to Q4_0's, its nibbles as they
/// are; 128 to every other's.
const fn unsigned_offset(f: u8) -> i32 {
    if f == F_Q4_0 {
        8
    } else {
        128
    }
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
