//! Each format's record: one block of eight rows, its f16 fields, unpacked scales and
//! values in 4-byte chunks, chunk-major. Repacked once at load and read back to the
//! file's layout for the portable path and the tests.

use super::*;
use crate::kernels::quant::{iq4_xs_scale, pack_iq4_xs_scales, scale_k3, scale_min_k4};
use rayon::prelude::*;

/// Where a block format keeps its fields, for repacking.
pub(super) struct Shape {
    /// Offsets of the f16 fields in a block (scale, then min).
    halves: &'static [usize],
    /// Packed 6-bit scales the record keeps unpacked, one byte each.
    unpacked: Unpacked,
    /// Offset and length of byte fields kept `[byte][8 rows]` (Q6_K's 16 scales, Q2_K's 16
    /// scales and mins).
    bytes: (usize, usize),
    /// Q5_0/Q5_1's 32 fifth bits (offset of the `u32`), kept as eight 32-bit masks, one per
    /// 4-byte chunk of nibbles (`j`: values `4j..4j + 4`, low nibbles for `j < 4`): bit
    /// `4r + b` is value `4j + b`'s of row `r`, so that the mask matches the chunk's bytes
    /// ([`fifth_masks`]).
    fifth: Option<usize>,
    /// Offsets and lengths of the value arrays, each kept in 4-byte chunks, chunk-major.
    qs: &'static [(usize, usize)],
}

/// A format's packed 6-bit scales, which its records keep unpacked to one byte per row
/// and scale, so that a lane loads its row's with one instruction.
#[derive(Clone, Copy)]
pub(super) enum Unpacked {
    None,
    /// Q4_K/Q5_K's 12 bytes of scales and mins (at 4), unpacked to bytes, `sc[8 sub][8
    /// rows]` then `m[8 sub][8 rows]`.
    K,
    /// Q3_K's 12 bytes of scales (at 96), unpacked to `sc − 32` as i8, `sc[16][8 rows]`:
    /// Q6_K's layout, whose kernels compute Q3_K ([`decode`]).
    Q3,
    /// IQ4_XS's eight scales (`scales_h` at 2, `scales_l` at 4), unpacked to `ls − 32` as
    /// i8, `sc[8][8 rows]`.
    Xs,
    /// MXFP4's E8M0 scale byte (at 0), `e[8 rows]`, then eight bytes of padding so that
    /// the values start aligned (the kernel turns the bytes into f32 scales).
    E8m0,
}

impl Unpacked {
    /// Bytes per row the unpacked scales take in a record.
    pub(super) const fn per_row(self) -> usize {
        match self {
            Unpacked::None => 0,
            Unpacked::K | Unpacked::Q3 => 16,
            Unpacked::Xs => 8,
            Unpacked::E8m0 => 2,
        }
    }
}

/// Q6_K's values (file offsets of 4-byte chunks) in the order that the kernels reading
/// records first touch them ([`q6_k`], [`q6_rows`]): per 128-value half and chunk
/// `c`, outputs 0 and 2's low nibbles, outputs 1 and 3's, then the four outputs' high bits.
/// A row's weights then stream from memory in one ascending run; loads that jump about
/// in a record read from memory at up to half the rate.
const Q6_VALUES: &[(usize, usize)] = &q6_values();

/// [`Q6_VALUES`], spelled out.
const fn q6_values() -> [(usize, usize); 48] {
    let mut v = [(0, 0); 48];
    let mut j = 0;
    while j < 48 {
        let (n, c) = (j / 24, j % 24 / 3);
        let at = match j % 3 {
            0 => 64 * n + 4 * c,
            1 => 64 * n + 32 + 4 * c,
            _ => 128 + 32 * n + 4 * c,
        };
        v[j] = (at, 4);
        j += 1;
    }
    v
}

/// Where `dtype`'s block keeps its fields. Inlined, so that a kernel's constant format
/// folds away (called per block and per tile, it held 2 % of a 32-stream step).
#[inline(always)]
pub(super) const fn shape(dtype: GgmlType) -> Shape {
    let (none, unpacked, fifth) = ((0, 0), Unpacked::None, None);
    match dtype {
        GgmlType::Q4_0 => Shape { halves: &[0], unpacked, bytes: none, fifth, qs: &[(2, 16)] },
        GgmlType::Q4_1 => Shape { halves: &[0, 2], unpacked, bytes: none, fifth, qs: &[(4, 16)] },
        GgmlType::Q5_0 => Shape { halves: &[0], unpacked, bytes: none, fifth: Some(2), qs: &[(6, 16)] },
        GgmlType::Q5_1 => Shape { halves: &[0, 2], unpacked, bytes: none, fifth: Some(4), qs: &[(8, 16)] },
        GgmlType::Q8_0 => Shape { halves: &[0], unpacked, bytes: none, fifth, qs: &[(2, 32)] },
        GgmlType::Q4K => Shape { halves: &[0, 2], unpacked: Unpacked::K, bytes: none, fifth, qs: &[(16, 128)] },
        GgmlType::Q5K => {
            Shape { halves: &[0, 2], unpacked: Unpacked::K, bytes: none, fifth, qs: &[(16, 32), (48, 128)] }
        }
        GgmlType::Q6K => Shape { halves: &[208], unpacked, bytes: (192, 16), fifth, qs: Q6_VALUES },
        GgmlType::Q3K => Shape { halves: &[108], unpacked: Unpacked::Q3, bytes: none, fifth, qs: &[(0, 32), (32, 64)] },
        GgmlType::Q2K => Shape { halves: &[80, 82], unpacked, bytes: (0, 16), fifth, qs: &[(16, 64)] },
        GgmlType::Iq4Nl => Shape { halves: &[0], unpacked, bytes: none, fifth, qs: &[(2, 16)] },
        GgmlType::Iq4Xs => Shape { halves: &[0], unpacked: Unpacked::Xs, bytes: none, fifth, qs: &[(8, 128)] },
        GgmlType::Tq2_0 => Shape { halves: &[64], unpacked, bytes: none, fifth, qs: &[(0, 64)] },
        GgmlType::Tq1_0 => Shape { halves: &[52], unpacked, bytes: none, fifth, qs: &[(0, 52)] },
        GgmlType::Mxfp4 => Shape { halves: &[], unpacked: Unpacked::E8m0, bytes: none, fifth, qs: &[(1, 16)] },
        _ => panic!("not an interleaved format"),
    }
}

impl Shape {
    /// Where the byte fields start in a record.
    pub(super) const fn bytes_at(&self) -> usize {
        self.halves.len() * 2 * GROUP
    }

    /// Where the fifth bits' masks start in a record.
    pub(super) const fn fifth_at(&self) -> usize {
        self.bytes_at() + (self.unpacked.per_row() + self.bytes.1) * GROUP
    }

    /// Where the values start in a record.
    pub(super) const fn values_at(&self) -> usize {
        self.fifth_at() + if self.fifth.is_some() { 32 } else { 0 }
    }

    /// Block offsets of the values' 4-byte chunks, in record order.
    pub(super) fn chunks(&self) -> impl Iterator<Item = usize> + '_ {
        self.qs.iter().flat_map(|&(at, len)| (at..at + len).step_by(4))
    }
}

/// Bytes of one record and where its values start ([`shape`]'s inlining).
#[inline(always)]
pub(super) const fn record(dtype: GgmlType) -> (usize, usize) {
    let s = shape(dtype);
    let (mut values, mut i) = (0, 0);
    while i < s.qs.len() {
        values += s.qs[i].1;
        i += 1;
    }
    (s.values_at() + values * GROUP, s.values_at())
}

/// Each format's record size, checked when the crate compiles: eight of the file's blocks,
/// plus the bytes that unpacked scales take beyond their packed form.
pub(super) const RECORD_BYTES: [(GgmlType, usize); 15] = [
    // `d[8]`, nibbles (as the file).
    (GgmlType::Q4_0, 144),
    // `d[8] m[8]`, nibbles (as the file).
    (GgmlType::Q4_1, 160),
    // Q4_0's and Q4_1's with the fifth bits as eight 32-bit masks before the nibbles.
    (GgmlType::Q5_0, 176),
    (GgmlType::Q5_1, 192),
    // `d[8]`, values (as the file).
    (GgmlType::Q8_0, 272),
    // `d[8]`, indices (as the file).
    (GgmlType::Iq4Nl, 144),
    // `d[8] sc[8 sub][8]`, indices: the file's 6-bit scales unpacked to `ls − 32` (+16).
    (GgmlType::Iq4Xs, 1104),
    // `d[8] dmin[8] sc[8 sub][8] m[8 sub][8]`, nibbles: 6-bit scales unpacked (+32).
    (GgmlType::Q4K, 1184),
    // Q4_K's, with the fifth bits before the nibbles (+32).
    (GgmlType::Q5K, 1440),
    // `d[8] sc[16][8]`, low nibbles and high bits in the order a row reads them (as the file).
    (GgmlType::Q6K, 1680),
    // Q6_K's fields, scales unpacked to `sc − 32`, then high bits and low bits (+32).
    (GgmlType::Q3K, 912),
    // `d[8] dmin[8] sc[16][8]`, then the 2-bit values (as the file).
    (GgmlType::Q2K, 672),
    // `d[8]`, 2-bit codes (as the file).
    (GgmlType::Tq2_0, 528),
    // `d[8]`, base-3 digits (as the file).
    (GgmlType::Tq1_0, 432),
    // `e[8]`, padding, codes (+8).
    (GgmlType::Mxfp4, 144),
];

const _: () = {
    let mut i = 0;
    while i < RECORD_BYTES.len() {
        let (dtype, bytes) = RECORD_BYTES[i];
        assert!(record(dtype).0 == bytes, "a record's size changed");
        // The values start 16-byte aligned in the record.
        assert!(record(dtype).1.is_multiple_of(16));
        i += 1;
    }
};

/// Repacks whole groups of rows of `k` values (file layout) into records.
pub fn interleave(dtype: GgmlType, data: &[u8], k: usize) -> Buf<u8> {
    let (per, block_bytes) = dtype.block();
    let blocks = k / per;
    let row_bytes = blocks * block_bytes;
    let groups = data.len() / row_bytes / GROUP;
    let (rec_bytes, head) = record(dtype);
    let s = shape(dtype);
    let mut out = Buf::zeroed(groups * blocks * rec_bytes);
    // Groups in parallel: loading is mostly this copy and the page faults of its output.
    out.par_chunks_mut(blocks * rec_bytes).enumerate().for_each(|(g, group)| {
        let rows = &data[g * GROUP * row_bytes..(g + 1) * GROUP * row_bytes];
        for (b, rec) in group.chunks_exact_mut(rec_bytes).enumerate() {
            fill_record(&s, head, rec, |r| &rows[r * row_bytes + b * block_bytes..][..block_bytes]);
        }
    });
    out
}

/// One record from the same block of the group's eight rows (`block(r)`, file layout).
pub(super) fn fill_record<'a>(s: &Shape, head: usize, rec: &mut [u8], block: impl Fn(usize) -> &'a [u8]) {
    let blocks: [&[u8]; GROUP] = std::array::from_fn(block);
    for (r, blk) in blocks.iter().enumerate() {
        for (f, &h) in s.halves.iter().enumerate() {
            rec[f * 16 + r * 2..f * 16 + r * 2 + 2].copy_from_slice(&blk[h..h + 2]);
        }
        let base = s.bytes_at();
        match s.unpacked {
            Unpacked::None => {}
            Unpacked::K => {
                for sub in 0..8 {
                    let (sc, m) = scale_min_k4(sub, &blk[4..16]);
                    rec[base + sub * GROUP + r] = sc;
                    rec[base + 64 + sub * GROUP + r] = m;
                }
            }
            Unpacked::Q3 => {
                for i in 0..16 {
                    rec[base + i * GROUP + r] = scale_k3(i, &blk[96..108]) as u8;
                }
            }
            Unpacked::Xs => {
                for sub in 0..8 {
                    rec[base + sub * GROUP + r] = (iq4_xs_scale(blk, sub) - 32) as u8;
                }
            }
            Unpacked::E8m0 => rec[base + r] = blk[0],
        }
        for j in 0..s.bytes.1 {
            rec[base + j * GROUP + r] = blk[s.bytes.0 + j];
        }
    }
    if let Some(at) = s.fifth {
        let qh: [u32; GROUP] = std::array::from_fn(|r| u32::from_le_bytes(blocks[r][at..at + 4].try_into().unwrap()));
        for (j, mask) in fifth_masks(qh).iter().enumerate() {
            rec[s.fifth_at() + 4 * j..][..4].copy_from_slice(&mask.to_le_bytes());
        }
    }
    // The values, chunk by chunk across the rows: most of a load's own work, so every
    // chunk's 32 bytes are written together.
    for (ch, from) in s.chunks().enumerate() {
        let to: &mut [u8; 32] = (&mut rec[head + ch * 32..head + ch * 32 + 32]).try_into().unwrap();
        for (to, blk) in to.chunks_exact_mut(4).zip(blocks) {
            to.copy_from_slice(&blk[from..from + 4]);
        }
    }
}

/// Eight rows' fifth bits `qh` (bit `i`: value `i`'s) as [`Shape::fifth`] keeps them: mask
/// `j` holds nibble `j` of each row, row `r`'s at bit `4r` (an 8 × 8 transpose of nibbles,
/// so that the same call turns the masks back into the rows' bits).
pub(super) fn fifth_masks(qh: [u32; GROUP]) -> [u32; 8] {
    std::array::from_fn(|j| qh.iter().enumerate().fold(0, |m, (r, &q)| m | ((q >> (4 * j)) & 0xF) << (4 * r)))
}

/// Q3_K's sixteen 6-bit scales (each `sc − 32`) packed back as [`scale_k3`] reads them.
pub(super) fn pack_q3_k_scales(sc: [i8; 16]) -> [u8; 12] {
    let mut p = [0u8; 12];
    for (i, &v) in sc.iter().enumerate() {
        let v = (v + 32) as u8;
        p[i % 8] |= (v & 0xF) << (4 * (i / 8));
        p[8 + i % 4] |= (v >> 4) << (2 * (i / 4));
    }
    p
}

/// Row `r` of interleaved `data` back in the file's layout.
pub fn raw_row(dtype: GgmlType, data: &[u8], r: usize, k: usize) -> Vec<u8> {
    let (per, block_bytes) = dtype.block();
    let blocks = k / per;
    let (rec_bytes, head) = record(dtype);
    let group = &data[r / GROUP * blocks * rec_bytes..(r / GROUP + 1) * blocks * rec_bytes];
    let (r, s) = (r % GROUP, shape(dtype));
    let mut out = vec![0u8; blocks * block_bytes];
    for (rec, blk) in group.chunks_exact(rec_bytes).zip(out.chunks_exact_mut(block_bytes)) {
        for (f, &h) in s.halves.iter().enumerate() {
            blk[h..h + 2].copy_from_slice(&rec[f * 16 + r * 2..f * 16 + r * 2 + 2]);
        }
        let base = s.bytes_at();
        let unpacked = |i: usize| rec[base + i * GROUP + r];
        match s.unpacked {
            Unpacked::None => {}
            Unpacked::K => {
                let m = |sub: usize| unpacked(8 + sub);
                for j in 0..4 {
                    blk[4 + j] = unpacked(j) | ((unpacked(j + 4) >> 4) << 6);
                    blk[8 + j] = m(j) | ((m(j + 4) >> 4) << 6);
                    blk[12 + j] = (unpacked(j + 4) & 0xF) | ((m(j + 4) & 0xF) << 4);
                }
            }
            Unpacked::Q3 => {
                let sc: [i8; 16] = std::array::from_fn(|i| unpacked(i) as i8);
                blk[96..108].copy_from_slice(&pack_q3_k_scales(sc));
            }
            Unpacked::Xs => {
                let ls = std::array::from_fn(|sub| (unpacked(sub) as i8 + 32) as u8);
                blk[2..8].copy_from_slice(&pack_iq4_xs_scales(ls));
            }
            Unpacked::E8m0 => blk[0] = unpacked(0),
        }
        for j in 0..s.bytes.1 {
            blk[s.bytes.0 + j] = rec[base + j * GROUP + r];
        }
        if let Some(at) = s.fifth {
            let masks =
                std::array::from_fn(|j| u32::from_le_bytes(rec[s.fifth_at() + 4 * j..][..4].try_into().unwrap()));
            // The masks are the rows' bits with nibbles transposed, which undoes itself.
            blk[at..at + 4].copy_from_slice(&fifth_masks(masks)[r].to_le_bytes());
        }
        for (ch, to) in s.chunks().enumerate() {
            blk[to..to + 4].copy_from_slice(&rec[head + ch * 32 + r * 4..head + ch * 32 + r * 4 + 4]);
        }
    }
    out
}
