//! TQ2_0: ternary weights as 2-bit codes `t + 1`, one scale per 256 values.

use super::*;

/// TQ2_0: eight rows' codes `u = t + 1` (0, 1 or 2, unsigned for `maddubs`) against the
/// activations, the block's activation sum taken off: `Σ t·x = Σ u·x − Σ x`. A chunk's 32
/// bytes hold 16 values of each row, four 2-bit fields a byte, and each field masked out
/// is four consecutive values of every row, against four broadcast activation bytes: no
/// table, no sign trick. AVX2's `maddubs` pairs are at most 2 · 127 · 2, so a block's 64
/// of them add in i16 (64 · 508 < 2¹⁵) before one `madd` widens; VNNI adds in i32, from
/// `−Σx`. Both compute the same integers, so the same bits.
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
            let mut s: [__m256i; R] = std::array::from_fn(|t| {
                if V {
                    _mm256_set1_epi32(-sums.get_unchecked(at(t)))
                } else {
                    _mm256_setzero_si256()
                }
            });
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
                        *s = if V {
                            dot4(*s, *u, bcast(x.add(32 * l)))
                        } else {
                            _mm256_add_epi16(*s, _mm256_maddubs_epi16(*u, bcast(x.add(32 * l))))
                        };
                    }
                }
            }
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
