//! The task driver: parallel tasks over groups of rows, chunks of groups that fit in L2,
//! activation tiles over each chunk, and the next chunk asked for on the way.

use super::*;

/// Groups per parallel task, out of `groups`.
pub(crate) fn groups_per_task(groups: usize) -> usize {
    groups.div_ceil(TASKS_PER_THREAD * rayon::current_num_threads()).max(1)
}

/// Groups `groups` of part `p` against every row of `X`, written to their columns
/// (from `col0`) of `y` (row stride `n`).
///
/// # Safety
/// `y` must hold `m × n` values and no other task may write these columns.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn groups_task(
    xq: &QActs,
    p: &Part,
    k: usize,
    groups: std::ops::Range<usize>,
    col0: usize,
    n: usize,
    m: usize,
    y: SharedOut,
) {
    // A wide part's rows come in pairs, neighbours in every tile (tiles are even), added
    // as they are written.
    const { assert!(TILE.is_multiple_of(2)) };
    let (xq, m, wide) = xq.for_part(p.dtype, m);
    let blocks = k / p.dtype.block().0;
    let group_bytes = blocks * record(p.dtype).0;
    // From `decode_from` rows on (more than one tile), the values of the formats that
    // `decodes` are decoded once per chunk, and every tile reads the bytes the kernel
    // would have decoded: results do not change.
    let decoded = decodes(p.dtype) && m >= decode_from(p.dtype);
    let decoded_bytes = if decoded { blocks * decoded_bytes(p.dtype) } else { 0 };
    // Chunks of groups that fit in L2 (with their decoded values), then activation tiles,
    // then the chunk's groups: the weights are read from memory once, and the tile stays
    // in L1.
    // Paired formats take an even number of groups, so that none runs alone, and those
    // that run four together a multiple of four wherever two fit: four groups of
    // 8192-value rows with their values, 476 KB, still sit in the 1 MB L2 of the CPUs
    // with VNNI, and ran faster than pairs there.
    let paired = m > TILE && pairs(p.dtype);
    let four = paired && quads(p.dtype);
    let fit = CHUNK_BYTES / (group_bytes + decoded_bytes);
    let chunk = match (paired, four) {
        (true, true) if fit >= 2 => (fit & !3).max(4),
        (true, _) => (fit & !1).max(2),
        _ => fit.max(1),
    };
    // Groups that each kernel call from `g` on (of a chunk ending at `last`) takes.
    let step = |g: usize, last: usize| match last - g {
        left if four && left >= 4 => 4,
        left if paired && left >= 2 => 2,
        _ => 1,
    };
    let records = |g: usize| &p.data[g * group_bytes..(g + 1) * group_bytes];
    DECODE_SCRATCH.with_borrow_mut(|scratch| {
        for first in groups.clone().step_by(chunk) {
            let last = (first + chunk).min(groups.end);
            // Grown only: truncated for a shorter chunk or a smaller matrix, it would be
            // zeroed again for the next longer one.
            let need = (last - first) * decoded_bytes;
            if scratch.len() < need {
                scratch.resize(need, 0);
            }
            // Where a pair's values go side by side, each pair decodes together, as the
            // tiles below pair the groups (a chunk's odd last group alone).
            let in_pairs = decoded && paired && decodes_in_pairs(p.dtype);
            if decoded_bytes > 0 {
                let mut g = first;
                while g < last {
                    let out = &mut scratch[(g - first) * decoded_bytes..];
                    if in_pairs && g + 1 < last {
                        decode_pair(p.dtype, [records(g), records(g + 1)], blocks, &mut out[..2 * decoded_bytes]);
                        g += 2;
                    } else {
                        decode(p.dtype, records(g), blocks, &mut out[..decoded_bytes]);
                        g += 1;
                    }
                }
            }
            let vals = |g: usize| (decoded_bytes > 0).then(|| &scratch[(g - first) * decoded_bytes..][..decoded_bytes]);
            let pair_vals = |g: usize| {
                if in_pairs {
                    let both = &scratch[(g - first) * decoded_bytes..][..2 * decoded_bytes];
                    [Some(both); 2]
                } else {
                    [vals(g), vals(g + 1)]
                }
            };
            // SAFETY: the caller owns these eight columns of rows `i..i + tile`.
            let put = |acc: &[[f32; GROUP]; TILE], g: usize, i: usize, tile: usize| unsafe {
                let at = |row: usize| y.0.add(row * n + col0 + g * GROUP);
                if wide {
                    for (t, two) in acc[..tile].chunks_exact(2).enumerate() {
                        let sum: [f32; GROUP] = std::array::from_fn(|c| two[0][c] + two[1][c]);
                        std::ptr::copy_nonoverlapping(sum.as_ptr(), at(i / 2 + t), GROUP)
                    }
                } else {
                    for (t, row) in acc[..tile].iter().enumerate() {
                        std::ptr::copy_nonoverlapping(row.as_ptr(), at(i + t), GROUP)
                    }
                }
            };
            // While the tiles run over this chunk, the next chunk's records (when it is to be
            // decoded, or read by paired kernels) are asked for a slice per kernel call, into
            // L2, so that its first pass does not wait on memory. A paired K-quant kernel
            // spreads its slice over its blocks: asked in one burst, the lines held the call
            // up until they came. After a task's last chunk that is the next task's
            // first, which this thread usually runs next (rayon splits the task range in
            // halves).
            let next: &[u8] = if paired || decoded_bytes > 0 {
                &p.data[last * group_bytes..(last + chunk).min(p.rows / GROUP) * group_bytes]
            } else {
                &[]
            };
            let calls_per_tile =
                std::iter::successors(Some(first), |&g| Some(g + step(g, last))).take_while(|&g| g < last).count();
            // At least one call, so that a task over no rows or no groups asks for nothing
            // rather than dividing by zero.
            let calls = (m.div_ceil(TILE) * calls_per_tile).max(1);
            let ahead = next.len().div_ceil(calls).next_multiple_of(64);
            let mut asked = 0;
            for i in (0..m).step_by(TILE) {
                let tile = TILE.min(m - i);
                let mut g = first;
                while g < last {
                    let ask = &next[asked.min(next.len())..(asked + ahead).min(next.len())];
                    asked += ahead;
                    let groups = step(g, last);
                    // A paired K-quant kernel spreads its share over its blocks; the
                    // others' share is asked for before the call.
                    let ask = if groups > 1 && k_quant(p.dtype) {
                        ask
                    } else {
                        crate::kernels::prefetch_lines_l2(ask.as_ptr(), ask.len());
                        &[]
                    };
                    if groups == 4 {
                        let mut acc = [[[0f32; GROUP]; TILE]; 4];
                        let data = [records(g), records(g + 1), records(g + 2), records(g + 3)];
                        let [a, b] = [pair_vals(g)[0], pair_vals(g + 2)[0]];
                        quad(p.dtype, data, [a, a, b, b], xq, i, tile, k, &mut acc, ask);
                        for (j, acc) in acc.iter().enumerate() {
                            put(acc, g + j, i, tile);
                        }
                    } else if groups == 2 {
                        let mut acc = [[[0f32; GROUP]; TILE]; 2];
                        let (data, vals) = ([records(g), records(g + 1)], pair_vals(g));
                        pair(p.dtype, data, vals, xq, i, tile, k, &mut acc, ask);
                        put(&acc[0], g, i, tile);
                        put(&acc[1], g + 1, i, tile);
                    } else {
                        let mut acc = [[0f32; GROUP]; TILE];
                        group(p.dtype, records(g), vals(g), xq, i, tile, k, &mut acc);
                        put(&acc, g, i, tile);
                    }
                    g += groups;
                }
            }
        }
    });
}

thread_local! {
    /// Decoded values of a task's chunk of groups, kept between calls so that the step's
    /// matrices do not each allocate (and fault in) a fresh buffer.
    static DECODE_SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One group's `blocks` records `data` of a [`decodable`] format, its values decoded into
/// `out` (`blocks` times [`decoded_bytes`]) in the order its kernel reads them.
pub(super) fn decode(dtype: GgmlType, data: &[u8], blocks: usize, out: &mut [u8]) {
    let fits = data.len() == blocks * record(dtype).0 && out.len() == blocks * decoded_bytes(dtype);
    assert!(decodable(dtype) && fits);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `decodable` checked for AVX2; the lengths were checked above.
    unsafe {
        avx2::decode(dtype, data.as_ptr(), blocks, out.as_mut_ptr())
    }
}

/// Two neighbouring groups' records `data` of a [`decodes_in_pairs`] format, their values
/// decoded side by side into `out` (twice [`decode`]'s bytes).
pub(super) fn decode_pair(dtype: GgmlType, data: [&[u8]; 2], blocks: usize, out: &mut [u8]) {
    let fits =
        data.iter().all(|d| d.len() == blocks * record(dtype).0) && out.len() == 2 * blocks * decoded_bytes(dtype);
    assert!(decodes_in_pairs(dtype) && fits);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `decodes_in_pairs` checked for VNNI (and so AVX2); the lengths were checked above.
    unsafe {
        avx2::decode_pair(dtype, data[0].as_ptr(), data[1].as_ptr(), blocks, out.as_mut_ptr())
    }
}

/// Two neighbouring groups' records and decoded values against activation rows
/// `first..first + tile`, for the formats that [`pairs`] (for [`decodes_in_pairs`], both
/// `vals` are the pair's, from [`decode_pair`]); `ahead`: bytes of records to ask into L2
/// on the way ([`avx2::Ahead`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn pair(
    dtype: GgmlType,
    data: [&[u8]; 2],
    vals: [Option<&[u8]>; 2],
    xq: &QActs,
    first: usize,
    tile: usize,
    k: usize,
    acc: &mut [[[f32; GROUP]; TILE]; 2],
    ahead: &[u8],
) {
    assert!(pairs(dtype) && (1..=TILE).contains(&tile));
    #[cfg(target_arch = "x86_64")]
    {
        let src =
            |g: usize| avx2::Src { rec: data[g].as_ptr(), vals: vals[g].map_or(std::ptr::null(), |v| v.as_ptr()) };
        let blocks = k / dtype.block().0;
        let ahead = avx2::Ahead::spread(ahead, blocks);
        // SAFETY: `pairs` implies AVX2, FMA and F16C; each group's records and decoded values.
        unsafe { avx2::pair(avx2::vnni(), dtype, [src(0), src(1)], xq, first, tile, blocks, acc, ahead) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, vals, xq, first, k, acc, ahead);
}

/// Four neighbouring groups' records and, for the formats that [`decodes_in_pairs`],
/// their pairs' values decoded side by side (`vals`: the first pair's twice, then the
/// second's, [`decode_pair`]; else none) against activation rows `first..first + tile`,
/// for the formats that run in [`quads`].
#[allow(clippy::too_many_arguments)]
pub(super) fn quad(
    dtype: GgmlType,
    data: [&[u8]; 4],
    vals: [Option<&[u8]>; 4],
    xq: &QActs,
    first: usize,
    tile: usize,
    k: usize,
    acc: &mut [[[f32; GROUP]; TILE]; 4],
    ahead: &[u8],
) {
    let blocks = k / dtype.block().0;
    let fits = |g: usize| {
        // The lookup formats' values are decoded only from `decode_from` rows on.
        let vals = vals[g].map_or(lookup(dtype) || !decodes_in_pairs(dtype), |v| {
            decodes_in_pairs(dtype) && v.len() == 2 * blocks * decoded_bytes(dtype)
        });
        data[g].len() == blocks * record(dtype).0 && vals
    };
    assert!(quads(dtype) && (1..=TILE).contains(&tile) && (0..4).all(fits));
    #[cfg(target_arch = "x86_64")]
    {
        let src =
            |g: usize| avx2::Src { rec: data[g].as_ptr(), vals: vals[g].map_or(std::ptr::null(), |v| v.as_ptr()) };
        let ahead = avx2::Ahead::spread(ahead, blocks);
        // SAFETY: `quads` implies VNNI; each group's records, and its pair's values checked above.
        unsafe { avx2::quad(dtype, [src(0), src(1), src(2), src(3)], xq, first, tile, blocks, acc, ahead) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, vals, xq, first, k, acc, ahead);
}

/// One group's records `data` (and its values decoded by [`decode`], `vals`) against
/// activation rows `first..first + tile`: the AVX2 kernels where the CPU has them, else
/// the portable fallback.
#[allow(clippy::too_many_arguments)]
pub(super) fn group(
    dtype: GgmlType,
    data: &[u8],
    vals: Option<&[u8]>,
    xq: &QActs,
    first: usize,
    tile: usize,
    k: usize,
    acc: &mut [[f32; GROUP]; TILE],
) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        let src = avx2::Src { rec: data.as_ptr(), vals: vals.map_or(std::ptr::null(), |v| v.as_ptr()) };
        // SAFETY: AVX2, FMA and F16C were detected; `data` is one group's records and
        // `vals` (from `decode`) its values.
        return unsafe { avx2::group(avx2::vnni(), dtype, src, xq, first, tile, k / dtype.block().0, acc) };
    }
    debug_assert!(vals.is_none(), "values are decoded ahead only for the AVX2 kernels");
    portable_group(dtype, data, xq, first, tile, k, acc)
}

/// The portable fallback: each row of the group back in its file layout, through the
/// row-by-row kernel.
pub(super) fn portable_group(
    dtype: GgmlType,
    data: &[u8],
    xq: &QActs,
    first: usize,
    tile: usize,
    k: usize,
    acc: &mut [[f32; GROUP]; TILE],
) {
    let cols: Vec<[f32; super::super::TILE]> = (0..GROUP)
        .map(|r| {
            let mut col = [0f32; super::super::TILE];
            super::super::rows::portable_dot_rows(
                dtype,
                &raw_row(dtype, data, r, k),
                xq,
                first,
                tile,
                k / QB,
                &mut col,
            );
            col
        })
        .collect();
    for (t, row) in acc[..tile].iter_mut().enumerate() {
        row.iter_mut().zip(&cols).for_each(|(v, col)| *v = col[t]);
    }
}
