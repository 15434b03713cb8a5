//! Q6_K, and Q3_K and Q2_K, whose values decode to Q6_K's: 16-value runs under signed
//! 8-bit scales, the −32 offsets taken from the activations' sums.

use super::*;

/// Q6_K: 6-bit values from a low-nibble chunk and a 2-bit chunk, kept unsigned for
/// `maddubs`, the −32 taken off in 16 bits with the activations' pair sums
/// ([`QActs::q6_offsets`]), then the signed 8-bit scale of each 16 values applied in
/// one `madd`. One output chunk (a quarter of the 128 values that two low-nibble
/// chunks and a 2-bit chunk hold) is decoded at a time and shared by the tile's rows
/// ([`q6_out`]), so that the tile's sums and the decoded values stay in registers
/// (decoding all four outputs at once spilled them), except in one group's tiles read
/// from the records, which have the registers to decode all four at once
/// ([`q6_rows`]). `G` groups run side by side, as
/// in [`k_tiled`]. Each row's 32-value sums gather under their activation scales
/// ([`ActScales::PerBlock`], or per 256 beside Q4_K) and take the eight rows' weight
/// scales once per block; a row's operations are the same whatever its tile.
///
/// # Safety
/// AVX2, FMA and F16C must be available (with `V`, what [`vnni`] checks too); `src`
/// holds `blocks` records (and decoded values with `PRE`) and `xq` the activation rows
/// `first..first + R`.
#[inline(always)]
pub(super) unsafe fn q6_k<const V: bool, const F: u8, const PRE: bool, const G: usize, const R: usize>(
    src: [Src; G],
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[[f32; GROUP]; TILE]; G],
    ahead: Ahead,
) {
    unsafe {
        debug_assert_ne!(xq.scales, ActScales::PerHalf, "Q6_K's halves share an activation scale");
        // Q3_K's and Q2_K's records hold Q6_K's fields (Q2_K's scales after its `dmin`),
        // and their values decode to Q6_K's.
        let dtype = q6_format(F);
        let ((rec_bytes, head), sc_at) = (record(dtype), shape(dtype).bytes_at());
        // The −32 offsets: i16 pairs for AVX2's 16-bit sums, `−32 · Σx` per 16 values for VNNI's.
        let offs = if V { xq.q6_starts().as_ptr() } else { xq.q6_offsets().as_ptr() };
        clear_sums::<G, R>(out);
        let asks = asks_ahead::<PRE, G, R>();
        for b in 0..blocks {
            let (rec, vals) = block_at::<G>(&src, b, rec_bytes, asks, &ahead);
            let mut blk = [[_mm256_setzero_ps(); G]; R];
            let at = |t: usize| ((first + t) * blocks + b) * 8 * QB;
            let hb = |t: usize| 16 * ((first + t) * blocks + b);
            if V && PRE && G.is_multiple_of(2) {
                // Each pair's values, side by side ([`decode_pair`]).
                let pairs = std::array::from_fn(|g| src[g].vals.add(2 * b * DECODED));
                q6_block_vnni::<F, G, R>(rec, pairs, sc_at, xq, offs, at, hb, &mut blk);
            } else if !PRE && G == 1 && (V || R == 1) {
                let mut one = [_mm256_setzero_ps(); R];
                q6_rows::<V, F, R>(rec[0], sc_at, xq, offs, at, hb, &mut one);
                for (blk, one) in blk.iter_mut().zip(one) {
                    blk[0] = one;
                }
            } else {
                // The four outputs of each half are unrolled, so that their shifts are
                // constants and the chunks they share load once.
                for n in 0..2 {
                    q6_out::<V, F, PRE, G, R>(rec, vals, (head, sc_at), n, 0, xq, offs, at, hb, &mut blk);
                    q6_out::<V, F, PRE, G, R>(rec, vals, (head, sc_at), n, 1, xq, offs, at, hb, &mut blk);
                    q6_out::<V, F, PRE, G, R>(rec, vals, (head, sc_at), n, 2, xq, offs, at, hb, &mut blk);
                    q6_out::<V, F, PRE, G, R>(rec, vals, (head, sc_at), n, 3, xq, offs, at, hb, &mut blk);
                }
            }
            for (g, (&rec, out)) in rec.iter().zip(out.iter_mut()).enumerate() {
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(rec.cast()));
                for (out, blk) in out.iter_mut().zip(&blk) {
                    let acc = _mm256_fmadd_ps(dw, blk[g], _mm256_loadu_ps(out.as_ptr()));
                    _mm256_storeu_ps(out.as_mut_ptr(), acc);
                }
            }
        }
        if F == F_Q2K {
            for (src, out) in src.iter().zip(out) {
                let mut acc = load_sums::<R>(out);
                q2_mins::<R>(src.rec, xq, first, blocks, &mut acc);
                store(&acc, out);
            }
        }
    }
}

/// One block of one group's record of format `F` (`rec`, scales from `sc_at`) against `R`
/// activation rows, straight from the record: each chunk's loads decoded into all four
/// outputs at once, where [`q6_out`] loads and decodes them for each output. Q6_K's three
/// loads (outputs 0 and 2's low nibbles, 1 and 3's, and the four outputs' high bits) take
/// a quarter fewer vector instructions a chunk; Q2_K's one load holds the four outputs'
/// 2-bit values, taken as they are (their sums start at zero, not at the −32 offsets:
/// the same `Σ q·x`); Q3_K's two (the low bits of four outputs, the high bits of all
/// eight) a third fewer. The four outputs' sums take 4·`R` registers: with VNNI
/// (`V`) one to four rows, in AVX-512VL's 32 (one row splits each chain in two, so that
/// eight run side by side); with AVX2 one row, in its 16. [`q6_out`]'s integers and float
/// steps per row and output. The halves and runs are spelled out ([`q6_rows_run`]), so
/// that every load's offset is a constant. `blk` gets the block's activation-scaled sums.
///
/// # Safety
/// AVX2, FMA and F16C must be available (with `V`, what [`vnni`] checks too); `rec` holds
/// a Q6_K block of the group and `xq` the rows that `at` and `hb` index, with their −32
/// offsets at `offs` (as [`q6_k`] takes them).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn q6_rows<const V: bool, const F: u8, const R: usize>(
    rec: *const u8,
    sc_at: usize,
    xq: &QActs,
    offs: *const i32,
    at: impl Fn(usize) -> usize,
    hb: impl Fn(usize) -> usize,
    blk: &mut [__m256; R],
) {
    unsafe {
        debug_assert!(V || R == 1, "AVX2's registers hold one row's sums");
        let src = (rec, sc_at, offs);
        for n in [0, 1] {
            // The block's integer sums of each output `i` of half `n`: `[row][i]`.
            let mut dots = [[_mm256_setzero_si256(); 4]; R];
            if n == 0 {
                q6_rows_run::<V, F, R>(src, xq, &at, 0, 0, &mut dots);
                q6_rows_run::<V, F, R>(src, xq, &at, 0, 1, &mut dots);
            } else {
                q6_rows_run::<V, F, R>(src, xq, &at, 1, 0, &mut dots);
                q6_rows_run::<V, F, R>(src, xq, &at, 1, 1, &mut dots);
            }
            for (t, (blk, dots)) in blk.iter_mut().zip(&dots).enumerate() {
                for (i, &dot) in dots.iter().enumerate() {
                    let dx = _mm256_set1_ps(*xq.d.get_unchecked(hb(t) + 2 * (4 * n + i)));
                    *blk = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, *blk);
                }
            }
        }
    }
}

/// Run `h` (values `16·h..16·h + 16` of each output) of half `n` of [`q6_rows`]'s block
/// (`src`: the record, where its scales start, the −32 offsets): each output's scaled
/// sums of the run, added to `dots` (`[row][output]`).
///
/// # Safety
/// As [`q6_rows`]'s.
#[inline(always)]
unsafe fn q6_rows_run<const V: bool, const F: u8, const R: usize>(
    (rec, sc_at, offs): (*const u8, usize, *const i32),
    xq: &QActs,
    at: &impl Fn(usize) -> usize,
    n: usize,
    h: usize,
    dots: &mut [[__m256i; 4]; R],
) {
    unsafe {
        let vals = rec.add(record(q6_format(F)).1);
        let (low, high) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        let join = |lo: __m256i, hi: __m256i| _mm256_or_si256(_mm256_and_si256(lo, low), _mm256_and_si256(hi, high));
        let load = |j: usize| _mm256_loadu_si256(vals.add(32 * j).cast());
        let x = xq.q.as_ptr();
        let split = if V && R == 1 { 2 } else { 1 };
        // `[row][output][chain]`, the −32 offsets starting the first chain (i16 pairs
        // for AVX2's 16-bit sums; Q2_K's values, taken as they are, start at zero).
        let mut s = [[[_mm256_setzero_si256(); 2]; 4]; R];
        if F != F_Q2K {
            for (t, s) in s.iter_mut().enumerate() {
                for (i, s) in s.iter_mut().enumerate() {
                    s[0] = _mm256_set1_epi32(*offs.add((at(t) + n * 128 + 32 * i + 16 * h) / QH));
                }
            }
        }
        for c in 4 * h..4 * h + 4 {
            let w = match F {
                F_Q2K => {
                    let q = load(8 * n + c);
                    [q2_values(q, 0), q2_values(q, 1), q2_values(q, 2), q2_values(q, 3)]
                }
                F_Q3K => {
                    // The low bits of half `n`'s four outputs, the high bits of all eight.
                    let (low, high) = (load(8 + 8 * n + c), load(c));
                    let o = 4 * n;
                    [
                        q3_values(low, high, o),
                        q3_values(low, high, o + 1),
                        q3_values(low, high, o + 2),
                        q3_values(low, high, o + 3),
                    ]
                }
                _ => {
                    let ((even, qh_at), (odd, _)) = (q6_chunks_at(n, 0, c), q6_chunks_at(n, 1, c));
                    let (even, odd, qh) = (load(even), load(odd), load(qh_at));
                    // Output `i`'s high bits moved to bits 4 and 5 of each byte.
                    [
                        join(even, _mm256_slli_epi16(qh, 4)),
                        join(odd, _mm256_slli_epi16(qh, 2)),
                        join(_mm256_srli_epi16(even, 4), qh),
                        join(_mm256_srli_epi16(odd, 4), _mm256_srli_epi16(qh, 2)),
                    ]
                }
            };
            for (t, s) in s.iter_mut().enumerate() {
                for (i, (s, &w)) in s.iter_mut().zip(&w).enumerate() {
                    let (xb, s) = (bcast(x.add(at(t) + n * 128 + 32 * i + 4 * c)), &mut s[c % split]);
                    // AVX2: two products of at most 63·127 per lane, so no `maddubs`
                    // saturates, and the 16-bit adds wrap to the run's sum, which fits
                    // ([`q6_out`]).
                    *s = if V { dot4(*s, w, xb) } else { _mm256_add_epi16(*s, _mm256_maddubs_epi16(w, xb)) };
                }
            }
        }
        for (dots, s) in dots.iter_mut().zip(&s) {
            for (i, (dot, s)) in dots.iter_mut().zip(s).enumerate() {
                let sc = q6_scales::<V, F>(rec.add(sc_at + 8 * (8 * n + 2 * i + h)));
                let scaled =
                    if V { _mm256_mullo_epi32(_mm256_add_epi32(s[0], s[1]), sc) } else { _mm256_madd_epi16(s[0], sc) };
                *dot = _mm256_add_epi32(*dot, scaled);
            }
        }
    }
}

/// Q2_K's mins, `dmin·m · d_x·Σx` per 16 values, in a pass of their own after the
/// values, as [`k_mins`]: per 32 values, one `madd` of two runs' mins (the high nibbles
/// of the scale bytes) against the activations' pair of 16-value sums
/// ([`QActs::half_pairs`]) under their activation scale ([`ActScales::PerBlock`]), then
/// `dmin` once per block.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `p` holds `blocks` Q2_K records and `xq` the
/// activation rows `first..first + R`.
#[inline(always)]
pub(super) unsafe fn q2_mins<const R: usize>(
    p: *const u8,
    xq: &QActs,
    first: usize,
    blocks: usize,
    acc: &mut [__m256; R],
) {
    unsafe {
        let (rec_bytes, sc_at) = (record(GgmlType::Q2K).0, shape(GgmlType::Q2K).bytes_at());
        let pairs = xq.half_pairs().as_ptr();
        for b in 0..blocks {
            let rec = p.add(b * rec_bytes);
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(rec.add(16).cast()));
            // Lane r: the i16 pair of row r's mins of runs 2o and 2o + 1.
            let mut m = [_mm256_setzero_si256(); 8];
            for (o, m) in m.iter_mut().enumerate() {
                let even = _mm_loadl_epi64(rec.add(sc_at + 16 * o).cast());
                let odd = _mm_loadl_epi64(rec.add(sc_at + 16 * o + 8).cast());
                *m = _mm256_srli_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(even, odd)), 4);
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let xb = (first + t) * blocks + b;
                let x = pairs.add(8 * xb);
                let mut s = _mm256_setzero_ps();
                for (o, m) in m.iter().enumerate() {
                    let dx = _mm256_set1_ps(*xq.d.get_unchecked(16 * xb + 2 * o));
                    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(*m, _mm256_set1_epi32(*x.add(o)))), dx, s);
                }
                *acc = _mm256_fnmadd_ps(dmin, s, *acc);
            }
        }
    }
}

/// The formats that run on [`q6_k`]'s kernels, as its const argument `F`.
pub(super) const F_Q6K: u8 = 0;
pub(super) const F_Q3K: u8 = 1;
pub(super) const F_Q2K: u8 = 2;

/// The format `F` of [`q6_k`].
pub(super) const fn q6_format(f: u8) -> GgmlType {
    match f {
        F_Q3K => GgmlType::Q3K,
        F_Q2K => GgmlType::Q2K,
        _ => GgmlType::Q6K,
    }
}

/// Eight rows' scales of a 16-value run at `at`, as VNNI's i32 lanes (`V`) or the i16
/// pairs of AVX2's `madd`: Q6_K's and Q3_K's signed bytes, Q2_K's low nibbles (its
/// mins are the high ones, [`q2_mins`]).
///
/// # Safety
/// AVX2 must be available (with `V`, what [`vnni`] checks too) and `at` hold eight bytes.
#[inline(always)]
pub(super) unsafe fn q6_scales<const V: bool, const F: u8>(at: *const u8) -> __m256i {
    unsafe {
        match (V, F == F_Q2K) {
            (true, false) => _mm256_cvtepi8_epi32(_mm_loadl_epi64(at.cast())),
            (true, true) => _mm256_and_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64(at.cast())), _mm256_set1_epi32(0xF)),
            (false, false) => scale_pairs::<true>(at),
            (false, true) => _mm256_and_si256(scale_pairs::<false>(at), _mm256_set1_epi16(0xF)),
        }
    }
}

/// Where chunk `c` of output `i` of half `n` finds its low nibbles and its high bits: the
/// indices of their 32-byte chunks in a record's values ([`Q6_VALUES`]).
#[inline(always)]
pub(super) const fn q6_chunks_at(n: usize, i: usize, c: usize) -> (usize, usize) {
    (24 * n + 3 * c + (i & 1), 24 * n + 3 * c + 2)
}

/// Chunk `c` of output `i` of half `n` of the Q6_K values at `vals`: four 6-bit values
/// of each of the eight rows (unsigned), from a low-nibble chunk and a 2-bit chunk.
///
/// # Safety
/// AVX2 must be available and `vals` hold one Q6_K record's values.
#[inline(always)]
pub(super) unsafe fn q6_chunk(vals: *const u8, n: usize, i: usize, c: usize) -> __m256i {
    unsafe {
        let (ql_at, qh_at) = q6_chunks_at(n, i, c);
        let ql = _mm256_loadu_si256(vals.add(32 * ql_at).cast());
        let qh = _mm256_loadu_si256(vals.add(32 * qh_at).cast());
        let (lo, hi) = match i {
            0 => (ql, _mm256_slli_epi16(qh, 4)),
            1 => (ql, _mm256_slli_epi16(qh, 2)),
            2 => (_mm256_srli_epi16(ql, 4), qh),
            _ => (_mm256_srli_epi16(ql, 4), _mm256_srli_epi16(qh, 2)),
        };
        _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0xF)), _mm256_and_si256(hi, _mm256_set1_epi8(0x30)))
    }
}

/// Output `i` of half `n` of the [`q6_k`] records at `rec` (values from `head`, or
/// decoded ahead at `pre` with `PRE`; scales from `sc_at`): its 32 values of each row, against tile row
/// `t`'s activations from index `at(t)` (with their Q6_K offsets `offs`, one per 16),
/// whose activation scales start at index `hb(t)`.
///
/// # Safety
/// As [`q6_k`]'s, for the block that `rec` and `vals` point into.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn q6_out<const V: bool, const F: u8, const PRE: bool, const G: usize, const R: usize>(
    rec: [*const u8; G],
    pre: [*const u8; G],
    (head, sc_at): (usize, usize),
    n: usize,
    i: usize,
    xq: &QActs,
    offs: *const i32,
    at: impl Fn(usize) -> usize,
    hb: impl Fn(usize) -> usize,
    blk: &mut [[__m256; G]; R],
) {
    unsafe {
        let pre: [*const u8; G] = std::array::from_fn(|g| pre[g].wrapping_add(32 * 8 * (4 * n + i)));
        // Chunks 0..4 hold the output's first 16 values (the sub-block's first scale), 4..8
        // the rest; both halves share one activation scale (not [`ActScales::PerHalf`]), so
        // their scaled sums add in i32 and convert once.
        let mut dots = [[_mm256_setzero_si256(); G]; R];
        for half in 0..2 {
            // Plain loops, as in [`k_sub`].
            let mut sc = [_mm256_setzero_si256(); G];
            for (sc, rec) in sc.iter_mut().zip(rec) {
                *sc = q6_scales::<V, F>(rec.add(sc_at + 8 * (8 * n + 2 * i + half)));
            }
            // The −32 offsets start the sums.
            let mut off = [_mm256_setzero_si256(); 4];
            for (t, off) in off.iter_mut().enumerate().take(R) {
                let o = *offs.add((at(t) + n * 128 + 32 * i + 16 * half) / QH);
                *off = _mm256_set1_epi32(o);
            }
            let mut sums = [[_mm256_setzero_si256(); G]; R];
            for (sums, &off) in sums.iter_mut().zip(&off) {
                *sums = [off; G];
            }
            // Each lane: two products of unsigned 6-bit values (at most 2·63·127) per
            // chunk; with the −32 of all four chunks, a sum of at most 8·32·127. The
            // 16-bit adds wrap, so only that final sum needs to fit.
            // (VNNI's paired tiles take [`q6_block_vnni`].)
            if !V && PRE && G == 2 && R == 4 {
                let x = xq.q.as_ptr().add(at(0) + n * 128 + 32 * i + 16 * half);
                // (`G - 1` is 1 here; it keeps the single-group copies in bounds.)
                let (w0, w1) = (pre[0].add(128 * half), pre[G - 1].add(128 * half));
                let s = sums_4x2::<4>(w0, w1, x, at(1) - at(0), off);
                for (sums, s) in sums.iter_mut().zip(s) {
                    sums.copy_from_slice(&s[..G]);
                }
            } else {
                // VNNI's second chunks of each pair in sums of their own, so that the
                // `vpdpbusd` chains (which wait for their sums) are half as long.
                let mut odd = [[_mm256_setzero_si256(); G]; R];
                for pair in 0..2 {
                    let c0 = 4 * half + 2 * pair;
                    let mut w = [[_mm256_setzero_si256(); 2]; G];
                    for (w, (&pre, &rec)) in w.iter_mut().zip(pre.iter().zip(&rec)) {
                        for (j, w) in w.iter_mut().enumerate() {
                            *w = if PRE {
                                _mm256_loadu_si256(pre.add(32 * (c0 + j)).cast())
                            } else {
                                match F {
                                    F_Q3K => q3_chunk(rec.add(head), 4 * n + i, c0 + j),
                                    F_Q2K => q2_chunk(rec.add(head), 4 * n + i, c0 + j),
                                    _ => q6_chunk(rec.add(head), n, i, c0 + j),
                                }
                            };
                        }
                    }
                    for (t, sums) in sums.iter_mut().enumerate() {
                        let x = xq.q.as_ptr().add(at(t) + n * 128 + 32 * i + 4 * c0);
                        let (x0, x1) = (bcast(x), bcast(x.add(4)));
                        for ((sum, odd), w) in sums.iter_mut().zip(&mut odd[t]).zip(&w) {
                            *sum = if V {
                                *odd = dot4(*odd, w[1], x1);
                                dot4(*sum, w[0], x0)
                            } else {
                                let s16 =
                                    _mm256_add_epi16(_mm256_maddubs_epi16(w[0], x0), _mm256_maddubs_epi16(w[1], x1));
                                _mm256_add_epi16(*sum, s16)
                            };
                        }
                    }
                }
                if V {
                    for (sums, odd) in sums.iter_mut().zip(&odd) {
                        for (sum, odd) in sums.iter_mut().zip(odd) {
                            *sum = _mm256_add_epi32(*sum, *odd);
                        }
                    }
                }
            }
            for (dots, sums) in dots.iter_mut().zip(&sums) {
                for ((dot, &sum), sc) in dots.iter_mut().zip(sums).zip(&sc) {
                    let scaled = if V { _mm256_mullo_epi32(sum, *sc) } else { _mm256_madd_epi16(sum, *sc) };
                    *dot = _mm256_add_epi32(*dot, scaled);
                }
            }
        }
        for (t, (blk, dots)) in blk.iter_mut().zip(&dots).enumerate() {
            let dx = _mm256_set1_ps(*xq.d.get_unchecked(hb(t) + 2 * (4 * n + i)));
            for (blk, &dot) in blk.iter_mut().zip(dots) {
                *blk = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, *blk);
            }
        }
    }
}
