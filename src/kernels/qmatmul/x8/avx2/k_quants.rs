//! Q4_K and Q5_K: 32-value sub-blocks under 6-bit scales, the block's sums integer until
//! its one activation scale, the mins in a pass of their own.

use super::*;

/// Q4_K and Q5_K (`FIVE`) with each decoded chunk (nibbles, and Q5_K's fifth bits)
/// shared by the tile's rows, as [`q8`]'s nibble formats do; with `PRE`, the chunks are read
/// from the values decoded ahead. `G` groups run side by side, so that each
/// broadcast of activation bytes feeds `G` multiply-adds (a broadcast load costs about
/// as much as a `maddubs`). One sub-block at a time (the low nibbles of a pair, then
/// the high ones: [`k_sub`]; Q4_K's two or four groups with VNNI, both sub-blocks at once
/// from the records, and Q5_K's from its decoded values: [`k_block_vnni`]; Q4_K's
/// one group with VNNI: [`k_rows_vnni`], or [`k_rows_256`] where [`half_width_512`]); the
/// scaled sums add in i32 over the block and take the product of the row's activation
/// scale ([`ActScales::PerSuper`]) and the eight rows' weight scales once. The mins
/// follow in [`k_mins`].
///
/// # Safety
/// AVX2, FMA and F16C must be available (with `V`, what [`vnni`] checks too); `src`
/// holds `blocks` records (and decoded values with `PRE`) and `xq` the activation rows
/// `first..first + R`.
#[inline(always)]
pub(super) unsafe fn k_tiled<const V: bool, const FIVE: bool, const PRE: bool, const G: usize, const R: usize>(
    src: [Src; G],
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[[f32; GROUP]; TILE]; G],
    ahead: Ahead,
) {
    unsafe {
        debug_assert!(xq.scales >= ActScales::PerSuper, "a K-quant block shares one activation scale");
        let rec_bytes = record(if FIVE { GgmlType::Q5K } else { GgmlType::Q4K }).0;
        clear_sums::<G, R>(out);
        let asks = asks_ahead::<PRE, G, R>();
        for b in 0..blocks {
            let (rec, vals) = block_at::<G>(&src, b, rec_bytes, asks, &ahead);
            // The block's scaled integer sums.
            let mut dots = [[_mm256_setzero_si256(); G]; R];
            let at = |t: usize| ((first + t) * blocks + b) * 8;
            // Q4_K from its records, Q5_K from its decoded values.
            if V && G.is_multiple_of(2) && FIVE == PRE {
                k_block_vnni::<FIVE, G, R>(rec, vals, xq, at, &mut dots);
            } else if V && G == 1 && !FIVE && !PRE {
                let rows = if half_width_512() {
                    k_rows_256::<R>(rec[0], xq.q.as_ptr(), at)
                } else {
                    k_rows_vnni::<R>(rec[0], xq.q.as_ptr(), at)
                };
                for (dots, r) in dots.iter_mut().zip(rows) {
                    dots[0] = r;
                }
            } else {
                for pair in 0..4 {
                    k_sub::<FIVE, PRE, G, R, 0>(rec, vals, pair, xq, at, &mut dots);
                    k_sub::<FIVE, PRE, G, R, 1>(rec, vals, pair, xq, at, &mut dots);
                }
            }
            for (g, (&rec, out)) in rec.iter().zip(out.iter_mut()).enumerate() {
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(rec.cast()));
                for (t, (out, dots)) in out.iter_mut().zip(&dots).enumerate() {
                    // One activation scale per block ([`ActScales::PerSuper`]).
                    let dx = _mm256_set1_ps(*xq.d.get_unchecked(2 * at(t)));
                    let (scale, sums) = (_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(dots[g]));
                    let acc = _mm256_fmadd_ps(scale, sums, _mm256_loadu_ps(out.as_ptr()));
                    _mm256_storeu_ps(out.as_mut_ptr(), acc);
                }
            }
        }
        if V && G.is_multiple_of(2) {
            for (src, out) in src.chunks_exact(2).zip(out.chunks_exact_mut(2)) {
                let [a, b] = out else { unreachable!() };
                let (lo, hi) = (load_sums::<R>(a), load_sums::<R>(b));
                let mut acc = [_mm512_setzero_ps(); R];
                for (t, acc) in acc.iter_mut().enumerate() {
                    *acc = two_groups_ps(lo[t], hi[t]);
                }
                k_mins_two::<R>([src[0].rec, src[1].rec], rec_bytes, xq, first, blocks, &mut acc);
                store_two(&acc, [a, b]);
            }
        } else {
            for (src, out) in src.iter().zip(out) {
                let mut acc = load_sums::<R>(out);
                k_mins::<R>(src.rec, rec_bytes, xq, first, blocks, &mut acc);
                store(&acc, out);
            }
        }
    }
}

/// Chunk `c` of sub-block `2·pair + H` of the Q4_K/Q5_K (`FIVE`) record at `rec`: four
/// values of each of the eight rows, unsigned.
///
/// # Safety
/// AVX2 must be available and `rec` be a whole Q4_K (Q5_K with `FIVE`) record.
#[inline(always)]
pub(super) unsafe fn k_chunk<const FIVE: bool, const H: usize>(rec: *const u8, pair: usize, c: usize) -> __m256i {
    unsafe {
        let head = record(if FIVE { GgmlType::Q5K } else { GgmlType::Q4K }).1;
        let nibbles = if FIVE { head + 256 } else { head };
        let v = _mm256_loadu_si256(rec.add(nibbles + pair * 256 + 32 * c).cast());
        let w = _mm256_and_si256(if H == 0 { v } else { _mm256_srli_epi16(v, 4) }, _mm256_set1_epi8(0xF));
        if !FIVE {
            return w;
        }
        let bit = _mm256_set1_epi8(1 << (2 * pair + H));
        let qh = _mm256_loadu_si256(rec.add(head + 32 * c).cast());
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }
}

/// Sub-block `2·pair + H` of the [`k_tiled`] records at `rec` (values decoded ahead at
/// `vals` with `PRE`) against tile row `t`'s activations from sub-block index `at(t)`.
/// Q4_K's sixteen products of at most 15·127 per i16 gather before one `madd` applies
/// the 6-bit scales, Q5_K's eight of at most 31·127 before each of two; they add to
/// the block's integer sums `dots` (at most 8 · 32 · 31·127 · 63 per lane).
///
/// # Safety
/// AVX2 must be available (VNNI is not used); `rec` (or `vals` with `PRE`) holds a
/// block of each group, and `xq` the sub-blocks that `at` indexes.
#[inline(always)]
pub(super) unsafe fn k_sub<const FIVE: bool, const PRE: bool, const G: usize, const R: usize, const H: usize>(
    rec: [*const u8; G],
    vals: [*const u8; G],
    pair: usize,
    xq: &QActs,
    at: impl Fn(usize) -> usize,
    dots: &mut [[__m256i; G]; R],
) {
    unsafe {
        let sub = 2 * pair + H;
        // Plain loops, not `array::from_fn`: a closure does not take this function's target
        // features, and the intrinsics in it were called out of line.
        let mut sc = [_mm256_setzero_si256(); G];
        for (sc, rec) in sc.iter_mut().zip(rec) {
            *sc = scale_pairs::<false>(rec.add(32 + 8 * sub));
        }
        // Q4_K: one run of eight chunks, one scale; Q5_K: two of four, one scale each.
        let runs = if FIVE { 2 } else { 1 };
        for run in 0..runs {
            let (c0, c1) = (8 / runs * run, 8 / runs * (run + 1));
            let mut s16 = [[_mm256_setzero_si256(); G]; R];
            if PRE && G == 2 && R == 4 {
                let x = xq.q.as_ptr().add((at(0) + sub) * QB + 4 * c0);
                let row = (at(1) - at(0)) * QB;
                // (`G - 1` is 1 here; it keeps the single-group copies in bounds.)
                let w = |g: usize| vals[g.min(G - 1)].add(32 * (8 * sub + c0));
                let z = [_mm256_setzero_si256(); 4];
                let sums =
                    if FIVE { sums_4x2::<4>(w(0), w(1), x, row, z) } else { sums_4x2::<8>(w(0), w(1), x, row, z) };
                for (s16, sums) in s16.iter_mut().zip(sums) {
                    s16.copy_from_slice(&sums[..G]);
                }
            } else {
                for c in c0..c1 {
                    let mut w = [_mm256_setzero_si256(); G];
                    for g in 0..G {
                        w[g] = if PRE {
                            _mm256_loadu_si256(vals[g].add(32 * (8 * sub + c)).cast())
                        } else {
                            k_chunk::<FIVE, H>(rec[g], pair, c)
                        };
                    }
                    for (t, s) in s16.iter_mut().enumerate() {
                        let x = bcast(xq.q.as_ptr().add((at(t) + sub) * QB + 4 * c));
                        for (s, &w) in s.iter_mut().zip(&w) {
                            *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(w, x));
                        }
                    }
                }
            }
            for (dots, s16) in dots.iter_mut().zip(&s16) {
                for ((dot, s16), sc) in dots.iter_mut().zip(s16).zip(&sc) {
                    *dot = _mm256_add_epi32(*dot, _mm256_madd_epi16(*s16, *sc));
                }
            }
        }
    }
}

/// Q4_K/Q5_K's mins, `dmin·m · d_x·Σx` per sub-block, in a pass of their own after
/// the values, so that the value loop keeps its registers. The activations have one
/// scale per block ([`ActScales::PerSuper`]), so a block's `Σ m · Σx` is integer: four
/// `madd`s of two sub-blocks' mins against the activations' pair sums
/// ([`QActs::pair_sums`]), then `dmin · d_x` once.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `p` holds `blocks` records of `rec_bytes` and
/// `xq` the activation rows `first..first + R`.
#[inline(always)]
pub(super) unsafe fn k_mins<const R: usize>(
    p: *const u8,
    rec_bytes: usize,
    xq: &QActs,
    first: usize,
    blocks: usize,
    acc: &mut [__m256; R],
) {
    unsafe {
        let pairs = xq.pair_sums().as_ptr();
        for b in 0..blocks {
            let rec = p.add(b * rec_bytes);
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(rec.add(16).cast()));
            // Lane r: the i16 pair of row r's mins of sub-blocks 2j and 2j + 1.
            let mut m = [_mm256_setzero_si256(); 4];
            for (j, m) in m.iter_mut().enumerate() {
                *m = _mm256_cvtepu8_epi16(min_pairs(rec, j));
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let xb = (first + t) * blocks + b;
                let x = pairs.add(4 * xb);
                let mut s = _mm256_madd_epi16(m[0], _mm256_set1_epi32(*x));
                for (j, m) in m.iter().enumerate().skip(1) {
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(*m, _mm256_set1_epi32(*x.add(j))));
                }
                let dx = _mm256_set1_ps(*xq.d.get_unchecked(16 * xb));
                *acc = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(s), *acc);
            }
        }
    }
}

/// The eight rows' mins of sub-blocks `2j` and `2j + 1` of the Q4_K/Q5_K record at
/// `rec`, interleaved: row `r`'s two at bytes `2r` and `2r + 1`.
///
/// # Safety
/// SSE2 must be available and `rec` be a whole Q4_K or Q5_K record.
#[inline(always)]
pub(super) unsafe fn min_pairs(rec: *const u8, j: usize) -> __m128i {
    unsafe {
        _mm_unpacklo_epi8(_mm_loadl_epi64(rec.add(96 + 16 * j).cast()), _mm_loadl_epi64(rec.add(104 + 16 * j).cast()))
    }
}
