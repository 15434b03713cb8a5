//! TQ2_0: ternary weights as 2-bit codes `t + 1`, one scale per 256 values.

use super::*;

/// TQ2_0: eight rows' codes `u = t + 1` (0, 1 or 2, unsigned for `maddubs`) against the
/// activations, the block's activation sum taken off: `Σ t·x = Σ u·x − Σ x`. A chunk's 32
/// bytes hold 16 values of each row, four 2-bit fields a byte, and each field masked out
/// is four consecutive values of every row, against four broadcast activation bytes: no
/// table, no sign trick. AVX2's `maddubs` pairs are at most 2 · 127 · 2, so a block's 64
/// of them add in i16 (64 · 508 < 2¹⁵) before one `madd` widens; VNNI adds in i32, from
/// `−Σx`, its fields masked in place ([`tq2_block_vnni`]). Both compute the same
/// integers, so the same bits.
///
/// # Safety
/// AVX2, FMA and F16C must be available (with `V`, what [`vnni`] checks too); `src`
/// holds `blocks` records and `xq` the activation rows `first..first + R`, scaled at
/// most once per 256 values.
#[inline(always)]
pub(super) unsafe fn tq2<const V: bool, const R: usize>(
    src: Src,
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[f32; GROUP]; TILE],
) {
    unsafe {
        let (rec_bytes, head) = record(GgmlType::Tq2_0);
        let sums = xq.block_sums();
        let (ones, three) = (_mm256_set1_epi16(1), _mm256_set1_epi8(3));
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            let rec = src.rec.add(b * rec_bytes);
            let at = |t: usize| (first + t) * blocks + b;
            let s: [__m256i; R] = if V {
                tq2_block_vnni::<R>(rec.add(head), xq.q.as_ptr(), at, sums)
            } else {
                let mut s = [_mm256_setzero_si256(); R];
                for ch in 0..16 {
                    let v = _mm256_loadu_si256(rec.add(head + 32 * ch).cast());
                    let u = [
                        _mm256_and_si256(v, three),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(v), three),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), three),
                        _mm256_and_si256(_mm256_srli_epi16::<6>(v), three),
                    ];
                    // Field `l` of chunk `ch` is values 128·(ch / 8) + 32·l + 4·(ch % 8)...
                    let base = 128 * (ch / 8) + 4 * (ch % 8);
                    for (t, s) in s.iter_mut().enumerate() {
                        let x = xq.q.as_ptr().add(at(t) * 256 + base);
                        for (l, u) in u.iter().enumerate() {
                            *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(*u, bcast(x.add(32 * l))));
                        }
                    }
                }
                s
            };
            let mut blk = [_mm256_setzero_ps(); R];
            for (t, (blk, s)) in blk.iter_mut().zip(s).enumerate() {
                let s =
                    if V { s } else { _mm256_sub_epi32(_mm256_madd_epi16(s, ones), _mm256_set1_epi32(sums[at(t)])) };
                *blk = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(*xq.d.get_unchecked(16 * at(t))));
            }
            weigh::<R>(rec, &blk, &mut acc);
        }
        store(&acc, out);
    }
}

/// One TQ2_0 block's integer sums `Σ t·x` (codes at `codes`, 16 chunks) for each of the
/// `R` activation rows (row `t`'s block at index `at(t)` of `x`, its sum in `sums`), with
/// VNNI: each 2-bit field is masked in place, not shifted down, so field `l` holds `4^l`
/// times its code and has a `vpdpbusd` chain of its own, divided back exactly at the end
/// (products at most 128 · 127, four to a lane, sixteen chunks). Four chains a row also
/// keep `vpdpbusd`'s latency off a one-row product. The same integers as [`tq2`]'s AVX2
/// sums.
///
/// # Safety
/// What [`vnni`] checks must be available; `codes` holds a block's 16 chunks and `x` the
/// blocks that `at` indexes.
#[inline(always)]
unsafe fn tq2_block_vnni<const R: usize>(
    codes: *const u8,
    x: *const i8,
    at: impl Fn(usize) -> usize,
    sums: &[i32],
) -> [__m256i; R] {
    unsafe {
        // Plain calls, not `map` (see [`k_sub`]).
        let mask =
            [_mm256_set1_epi8(0x03), _mm256_set1_epi8(0x0C), _mm256_set1_epi8(0x30), _mm256_set1_epi8(0xC0u8 as i8)];
        let mut s = [[_mm256_setzero_si256(); 4]; R];
        for (t, s) in s.iter_mut().enumerate() {
            s[0] = _mm256_set1_epi32(-sums.get_unchecked(at(t)));
        }
        for ch in 0..16 {
            let v = _mm256_loadu_si256(codes.add(32 * ch).cast());
            let base = 128 * (ch / 8) + 4 * (ch % 8);
            for (l, &m) in mask.iter().enumerate() {
                let u = _mm256_and_si256(v, m);
                for (t, s) in s.iter_mut().enumerate() {
                    s[l] = dot4(s[l], u, bcast(x.add(at(t) * 256 + base + 32 * l)));
                }
            }
        }
        let mut out = [_mm256_setzero_si256(); R];
        for (o, s) in out.iter_mut().zip(&s) {
            let high = _mm256_add_epi32(_mm256_srai_epi32::<2>(s[1]), _mm256_srai_epi32::<4>(s[2]));
            *o = _mm256_add_epi32(_mm256_add_epi32(s[0], high), _mm256_srai_epi32::<6>(s[3]));
        }
        out
    }
}
