//! The K-quants' values decoded to a byte each (TQ1_0's base-3 digits to TQ2_0's codes,
//! the lookup formats' indices to their values), once per chunk of groups, in the order
//! the kernels read them, so that tiles after the first skip the unpacking.

use super::*;

/// A group's `blocks` K-quant records at `p`, their values decoded to bytes at `out` in
/// the order [`k_sub`] and [`q6_out`] read them: per block, 32-byte chunks by sub-block
/// (Q6_K: by output) and then chunk; or TQ1_0's, their codes as TQ2_0's ([`decode_tq1`]);
/// or the lookup formats' values ([`decode_lookup`]).
///
/// # Safety
/// AVX2 must be available; `p` holds `blocks` records, `out` room for `blocks` decoded.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn decode(dtype: GgmlType, p: *const u8, blocks: usize, out: *mut u8) {
    unsafe {
        let (rec_bytes, head) = record(dtype);
        for b in 0..blocks {
            let (rec, out) = (p.add(b * rec_bytes), out.add(b * decoded_bytes(dtype)));
            match dtype {
                GgmlType::Q4K => decode_k::<false>(rec, out),
                GgmlType::Q5K => decode_k::<true>(rec, out),
                GgmlType::Q3K => decode_q3::<32>(rec.add(head), out),
                GgmlType::Q2K => decode_q2::<32>(rec.add(head), out),
                GgmlType::Tq1_0 => decode_tq1(rec.add(head), out),
                _ if lookup(dtype) => decode_lookup(dtype, rec.add(head), out),
                _ => decode_q6(rec.add(head), out),
            }
        }
    }
}

/// Two neighbouring groups' `blocks` records of the Q6_K family or a lookup format (at
/// `a`, `b`), their values decoded side by side at `out` for the VNNI paired kernels
/// ([`q6_block_vnni`], [`q8_pairs`]):
/// per block, each 32-byte chunk of `a`'s [`decode`]d values followed by `b`'s, so that
/// one 512-bit load takes a chunk of both groups.
///
/// # Safety
/// AVX2 must be available; `a` and `b` hold `blocks` records each, `out` room for twice
/// as many decoded blocks.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn decode_pair(dtype: GgmlType, a: *const u8, b: *const u8, blocks: usize, out: *mut u8) {
    unsafe {
        let ((rec_bytes, head), decoded) = (record(dtype), decoded_bytes(dtype));
        for blk in 0..blocks {
            let vals = |p: *const u8| p.add(blk * rec_bytes + head);
            if dtype == GgmlType::Q6K {
                decode_q6_pair(vals(a), vals(b), out.add(2 * blk * decoded));
                continue;
            }
            if lookup(dtype) {
                decode_lookup_pair(dtype, vals(a), vals(b), out.add(2 * blk * decoded));
                continue;
            }
            for (g, p) in [a, b].into_iter().enumerate() {
                let (vals, out) = (p.add(blk * rec_bytes + head), out.add(2 * blk * decoded + 32 * g));
                match dtype {
                    GgmlType::Q3K => decode_q3::<64>(vals, out),
                    GgmlType::Q2K => decode_q2::<64>(vals, out),
                    other => unreachable!("{other:?}: not decoded in pairs"),
                }
            }
        }
    }
}

/// One block of two groups' Q6_K values (from `a` and `b`), decoded side by side for
/// [`decode_pair`] with AVX-512: each 64-byte chunk of both in one register, so that a
/// register's worth of values costs half the instructions of [`decode_q6`]'s.
///
/// # Safety
/// What [`vnni`] checks must be available (as [`decode_pair`]'s caller does); `a` and `b`
/// hold one Q6_K record's values each and `out` room for their decoded block.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_q6_pair(a: *const u8, b: *const u8, out: *mut u8) {
    unsafe {
        let both = |at: usize| two_groups(a.add(32 * at), b.add(32 * at));
        let low = _mm512_set1_epi8(0x0F);
        let high = |v: __m512i, bits: i8| _mm512_and_si512(v, _mm512_set1_epi8(bits));
        for n in 0..2 {
            for c in 0..8 {
                let ((even, qh_at), (odd, _)) = (q6_chunks_at(n, 0, c), q6_chunks_at(n, 1, c));
                let (even, odd, qh) = (both(even), both(odd), both(qh_at));
                // Output `i`'s high bits moved to bits 4 and 5 of each byte, the rest clear.
                let hi = [
                    _mm512_slli_epi16(high(qh, 0x03), 4),
                    _mm512_slli_epi16(high(qh, 0x0C), 2),
                    high(qh, 0x30),
                    _mm512_srli_epi16(high(qh, 0xC0u8 as i8), 2),
                ];
                let lo = [even, odd, _mm512_srli_epi16(even, 4), _mm512_srli_epi16(odd, 4)];
                for (i, (lo, hi)) in lo.into_iter().zip(hi).enumerate() {
                    // `(lo & 0x0F) | hi`.
                    let v = _mm512_ternarylogic_epi32::<0xEC>(lo, hi, low);
                    _mm512_storeu_si512(out.add(64 * (8 * (4 * n + i) + c)).cast(), v);
                }
            }
        }
    }
}

/// Chunk `c` of run `i` (a sub-block, or a Q6_K output) of a decoded block at `out`,
/// whose chunks start `W` bytes apart (64 where a pair's are side by side, [`decode_pair`]).
///
/// # Safety
/// `out` must hold a decoded block (of chunks `W` bytes apart).
#[inline(always)]
pub(super) unsafe fn put<const W: usize>(out: *mut u8, i: usize, c: usize, w: __m256i) {
    unsafe {
        _mm256_storeu_si256(out.add(W * (8 * i + c)).cast(), w);
    }
}

/// One Q4_K/Q5_K (`FIVE`) record's values, decoded for [`decode`].
///
/// # Safety
/// AVX2 must be available; `rec` is one Q4_K (Q5_K with `FIVE`) record and `out` has
/// room for its decoded block.
#[inline(always)]
pub(super) unsafe fn decode_k<const FIVE: bool>(rec: *const u8, out: *mut u8) {
    unsafe {
        for pair in 0..4 {
            for c in 0..8 {
                put::<32>(out, 2 * pair, c, k_chunk::<FIVE, 0>(rec, pair, c));
                put::<32>(out, 2 * pair + 1, c, k_chunk::<FIVE, 1>(rec, pair, c));
            }
        }
    }
}

/// One block of a lookup format's values (indices at `qs`), decoded for [`decode`]: per
/// 32-value sub-block, its eight chunks (the low nibbles' four, then the high ones'), each
/// value plus 128, the unsigned byte [`q8`]'s `vpdpbusd` takes.
///
/// # Safety
/// AVX2 must be available; `qs` holds a record's indices and `out` room for its
/// decoded block.
#[inline(always)]
unsafe fn decode_lookup(dtype: GgmlType, qs: *const u8, out: *mut u8) {
    unsafe {
        let table = _mm256_broadcastsi128_si256(offset_values(dtype));
        for sub in 0..dtype.block().0 / QB {
            for h in 0..2 {
                for c in 0..4 {
                    put::<32>(out, sub, 4 * h + c, lookup_chunk(qs.add(128 * sub), h, c, table));
                }
            }
        }
    }
}

/// One block of two groups' lookup-format values (indices at `a`, `b`), decoded side by
/// side for [`decode_pair`] with AVX-512: each 64-byte chunk of both groups one shuffle,
/// where [`decode_lookup`] took two and an offset each.
///
/// # Safety
/// What [`vnni`] checks must be available (as [`decode_pair`]'s caller does); `a` and `b`
/// hold one record's indices each and `out` room for their decoded block.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn decode_lookup_pair(dtype: GgmlType, a: *const u8, b: *const u8, out: *mut u8) {
    unsafe {
        let table = _mm512_broadcast_i32x4(offset_values(dtype));
        for sub in 0..dtype.block().0 / QB {
            for c in 0..4 {
                let v = two_groups(a.add(128 * sub + 32 * c), b.add(128 * sub + 32 * c));
                for h in 0..2 {
                    _mm512_storeu_si512(out.add(64 * (8 * sub + 4 * h + c)).cast(), lookup_x2(v, h, table));
                }
            }
        }
    }
}

/// The sixteen values of a lookup format, each plus 128 (the bytes [`decode_lookup`]
/// writes).
///
/// # Safety
/// SSE2 must be available.
#[inline(always)]
unsafe fn offset_values(dtype: GgmlType) -> __m128i {
    unsafe { _mm_xor_si128(_mm_loadu_si128(table(dtype).as_ptr().cast()), _mm_set1_epi8(-128)) }
}

/// One Q3_K record's values (from `vals`), decoded for [`decode`] ([`q3_chunk`]).
///
/// # Safety
/// AVX2 must be available; `vals` holds one Q3_K record's values and `out` room for its
/// decoded block.
#[inline(always)]
pub(super) unsafe fn decode_q3<const W: usize>(vals: *const u8, out: *mut u8) {
    unsafe {
        for o in 0..8 {
            for c in 0..8 {
                put::<W>(out, o, c, q3_chunk(vals, o, c));
            }
        }
    }
}

/// One Q2_K record's values (from `vals`), decoded for [`decode`] ([`q2_chunk`]).
///
/// # Safety
/// AVX2 must be available; `vals` holds one Q2_K record's values and `out` room for its
/// decoded block.
#[inline(always)]
pub(super) unsafe fn decode_q2<const W: usize>(vals: *const u8, out: *mut u8) {
    unsafe {
        for o in 0..8 {
            for c in 0..8 {
                put::<W>(out, o, c, q2_chunk(vals, o, c));
            }
        }
    }
}

/// Chunk `c` of output `o` (values `32o..32o + 32`) of the Q3_K values at `vals` (the
/// high bits' 8 chunks, then the low two bits' 16) as Q6_K's are: value `q − 4` (`q` its
/// three bits) as `q − 4 + 32`, so that Q6_K's kernels, their −32 offsets and the scales
/// `sc − 32` in the record compute Q3_K exactly. Bits `2·(o % 4)` of the low chunks of
/// its half and bit `o` of the high ones.
///
/// # Safety
/// AVX2 must be available and `vals` hold one Q3_K record's values.
#[inline(always)]
pub(super) unsafe fn q3_chunk(vals: *const u8, o: usize, c: usize) -> __m256i {
    unsafe {
        let low = _mm256_loadu_si256(vals.add(32 * (8 + 8 * (o / 4) + c)).cast());
        let high = _mm256_loadu_si256(vals.add(32 * c).cast());
        q3_values(low, high, o)
    }
}

/// Output `o`'s values of [`q3_chunk`] from its chunk of low bits (`low`, which holds its
/// half's four outputs) and the chunk of high bits (`high`, all eight outputs'), loaded
/// once for the outputs that share them.
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
pub(super) unsafe fn q3_values(low: __m256i, high: __m256i, o: usize) -> __m256i {
    unsafe {
        let (low_shift, high_shift) = (_mm_cvtsi32_si128(2 * (o as i32 % 4)), _mm_cvtsi32_si128(o as i32));
        let low = _mm256_and_si256(_mm256_srl_epi16(low, low_shift), _mm256_set1_epi8(3));
        let high = _mm256_and_si256(_mm256_srl_epi16(high, high_shift), _mm256_set1_epi8(1));
        let q = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
        _mm256_add_epi8(q, _mm256_set1_epi8(28))
    }
}

/// Chunk `c` of output `o` of the Q2_K values at `vals` (16 chunks, each byte holding
/// four outputs' values) as Q6_K's are: value `q` as `q + 32`, so that Q6_K's kernels
/// and their −32 offsets compute `Σ sc·q·x` exactly (the mins follow in [`q2_mins`]).
/// Bits `2·(o % 4)` of the chunks of its half.
///
/// # Safety
/// AVX2 must be available and `vals` hold one Q2_K record's values.
#[inline(always)]
pub(super) unsafe fn q2_chunk(vals: *const u8, o: usize, c: usize) -> __m256i {
    unsafe {
        let q = _mm256_loadu_si256(vals.add(32 * (8 * (o / 4) + c)).cast());
        _mm256_or_si256(q2_values(q, o), _mm256_set1_epi8(32))
    }
}

/// Output `o`'s 2-bit values of a chunk `q` of [`q2_chunk`]'s, as they are (no +32),
/// loaded once for the four outputs that share it.
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
pub(super) unsafe fn q2_values(q: __m256i, o: usize) -> __m256i {
    unsafe { _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (o as i32 % 4))), _mm256_set1_epi8(3)) }
}

/// One Q6_K record's values (from `vals`), decoded for [`decode`]. The four outputs are
/// written out, so that their shifts are constants and the chunks they share load once.
///
/// # Safety
/// AVX2 must be available; `vals` holds one Q6_K record's values and `out` room for its
/// decoded block.
#[inline(always)]
pub(super) unsafe fn decode_q6(vals: *const u8, out: *mut u8) {
    unsafe {
        for n in 0..2 {
            for c in 0..8 {
                put::<32>(out, 4 * n, c, q6_chunk(vals, n, 0, c));
                put::<32>(out, 4 * n + 1, c, q6_chunk(vals, n, 1, c));
                put::<32>(out, 4 * n + 2, c, q6_chunk(vals, n, 2, c));
                put::<32>(out, 4 * n + 3, c, q6_chunk(vals, n, 3, c));
            }
        }
    }
}
