//! The interleaved path: eight weight rows repacked block by block at load, so that one
//! AVX2 register holds four consecutive values of each of the eight rows and each 32-bit
//! lane accumulates a different output column (llama.cpp's `q4_0_8x8` idea). Four
//! activation bytes are broadcast against it; there are no horizontal sums, the f16 scales
//! of eight rows convert in one instruction, and the unsigned nibble formats need no sign
//! tricks. A record (one block of eight rows) holds the eight rows' f16 fields, then their
//! values in 4-byte chunks, chunk-major:
//!
//! - Q4_0 `d[8]`, nibbles (144 bytes, as the file); Q4_1 `d[8] m[8]`, nibbles (160);
//!   Q5_0 and Q5_1 the same with their fifth bits before the nibbles, rearranged into one
//!   32-bit mask per chunk of nibbles (176 and 192, as the file: [`Shape::fifth`]);
//!   Q8_0 `d[8]`, values (272); IQ4_NL `d[8]`, indices (144, as the file); IQ4_XS `d[8]
//!   sc[8 sub][8]`, indices (1104 against the file's 1088: its 6-bit scales unpacked to
//!   `ls − 32`);
//! - Q4_K `d[8] dmin[8] sc[8 sub][8] m[8 sub][8]`, nibbles (1184 bytes against the file's
//!   1152: the 6-bit scales are unpacked so a lane loads its row's with one instruction);
//!   Q5_K the same with the fifth bits before the nibbles (1440 against 1408);
//! - Q6_K `d[8] sc[16][8]`, low nibbles and high bits in the order one row reads them
//!   ([`Q6_VALUES`]; 1680 bytes, as the file); Q3_K the same fields, its scales unpacked
//!   to `sc − 32`, then its high bits and low bits (912 against 880); Q2_K `d[8] dmin[8]
//!   sc[16][8]` (each byte the file's: a scale in the low nibble, a min in the high one),
//!   then its 2-bit values (672, as the file). Q3_K and Q2_K run on Q6_K's kernels, their
//!   values decoded to Q6_K's ([`avx2::q3_chunk`], [`avx2::q2_chunk`]), Q2_K's mins in a
//!   pass of their own.
//!
//! With more than one tile of activation rows, the K-quants' values are decoded to a byte
//! each once per chunk of groups and read by every tile (Q5_K_M 1B, 32 streams: decode
//! +9 %, prefill +20 %), rather than unpacked again for each tile. The K-quants then run
//! two groups side by side ([`pair`]), so that each broadcast of activations feeds two
//! multiply-adds, and the next chunk's records are fetched while the tiles run over this
//! one, so that decoding it does not wait on memory (Q4_K_M 1B, 32 streams, per step in
//! one process: median 371 -> 338 ms). Q6_K's sums start from its −32 offsets, so that
//! applying them costs no add per row and 16 values. With VNNI, Q4_K's pairs read the
//! nibbles from the records instead: a chunk's low and high nibbles are masked in place
//! and feed two sub-blocks' sums at once (16 of them, in AVX-512VL's 32 registers), one
//! `and` per 8 `vpdpbusd`, so there is no decode pass (1B Q4_K_M, alternated: 32 streams
//! 150–161 -> 161–173 tok/s, prefill 212–221 -> 238–254).
//!
//! The kernels that read records one group at a time (Q4_0, Q4_1 and Q8_0 at every tile)
//! ask for no lines ahead: a group's records stream in one ascending run, which the
//! hardware prefetchers follow, and a `prefetcht0` per line ahead slowed them (one row,
//! one thread: Q4_K 29 -> 22 GB/s, Q6_K 21 -> 16, Q8_0 32 -> 25; 1B Q8_0, one stream:
//! 26.7–29.8 -> 36.1–41.9 tok/s; into L2, 12 KB ahead, Q8_0 still 34 -> 25). The
//! K-quants' tiles of one to four rows are the exception ([`AHEAD`]): their loads jump
//! about inside a record, and on this machine's fast-memory days the hardware left them
//! well short of the streaming rate.
//!
//! Each row of `X` is one chain of operations whatever the tile it is in, and decoded
//! values are the very bytes the kernels would unpack, so results stay batch-invariant.
//!
//! Where the CPU has AVX-512 VNNI, the kernels run a second copy of themselves in which
//! each lane's four byte products add to an i32 in one `vpdpbusd`, where AVX2 takes a
//! `maddubs`, a 16-bit add and a `madd` (and Q8_0 a sign and an absolute value too, since
//! its weights go in as `w + 128`). The AVX2 sums never saturate, so both compute the
//! same integers and the results are equal bit for bit. Same binary, alternated, 32
//! streams: 1B Q4_K_M 115–124 -> 132–144 tok/s, Q8_0 77–81 -> 126–135, SmolLM2 Q4_1
//! 572–701 -> 748–869. Q4_K's and Q5_K's tiles of one to four rows, which read the
//! records, keep AVX2 (for Q4_K a VNNI copy that masks both sub-blocks of a chunk in
//! place ran no faster at one stream); Q6_K's take VNNI.

use super::{ActScales, Buf, Part, QActs, SharedOut, QB, QH};
use crate::kernels::quant::{iq4_xs_scale, pack_iq4_xs_scales, scale_k3, scale_min_k4, GgmlType, IQ4_VALUES};
use rayon::prelude::*;

/// Rows interleaved into one group.
pub const GROUP: usize = 8;
/// Parallel tasks per thread: few, so each streams a long contiguous run of weights, but
/// enough that work stealing evens out the threads.
const TASKS_PER_THREAD: usize = 4;
/// Bytes of weights a task runs all activation tiles over before moving on (half of L2).
const CHUNK_BYTES: usize = 256 << 10;
/// Activation rows computed together against one group's (or a [`pair`]'s) weights.
const TILE: usize = 4;
/// Bytes of one K-quant block's values decoded to a byte each, for the group's rows.
const DECODED: usize = 256 * GROUP;
/// How far ahead of the record in use the K-quants' one-group kernels ask for records,
/// into L2, a record per block. `qmatmul` alone at one row over cold matrices, two
/// threads, fast-memory regime: Q6_K 2048 × 8192 25 -> 53 GB/s, Q4_K 8192 × 2048
/// 38 -> 54, 2048 × 2048 24 -> 38; Q6_K's LM head shape (128256 × 2048) 62 -> 61. 1B
/// Q4_K_M, one stream, alternated: 50.2–52.8 -> 59.0–61.1 tok/s; in the slow-memory
/// regime, where weft already reads at 85 % of the streaming rate, 40.5–41.1 -> 38.3–39.5.
/// 8 KB ahead did about as well, 16 KB and more worse; every other line only, much worse.
const AHEAD: usize = 12 << 10;

/// Where a block format keeps its fields, for repacking.
struct Shape {
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
enum Unpacked {
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
}

impl Unpacked {
    /// Bytes per row the unpacked scales take in a record.
    fn per_row(self) -> usize {
        match self {
            Unpacked::None => 0,
            Unpacked::K | Unpacked::Q3 => 16,
            Unpacked::Xs => 8,
        }
    }
}

/// Q6_K's values (file offsets of runs of 4-byte chunks) in the order that the kernel
/// reading records first touches them ([`q6_k`]): per 128-value half, outputs 0 and 2's
/// low-nibble chunks 0..4, the high bits of chunks 0..4, the same for chunks 4..8, then
/// outputs 1 and 3's low-nibble chunks. A row's weights then stream from memory in one
/// ascending run. In the file's order (low nibbles, then high bits) its loads jumped
/// back and forth in the record: one thread read ascending loads at 23 GB/s and the same
/// loads in that order at 12. Q6_K at one row, 2048 × 8192, one thread: 11 -> 18 GB/s.
const Q6_VALUES: &[(usize, usize)] =
    &[(0, 16), (128, 16), (16, 16), (144, 16), (32, 32), (64, 16), (160, 16), (80, 16), (176, 16), (96, 32)];

fn shape(dtype: GgmlType) -> Shape {
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
        other => unreachable!("{other:?} is not interleaved"),
    }
}

impl Shape {
    /// Where the byte fields start in a record.
    fn bytes_at(&self) -> usize {
        self.halves.len() * 2 * GROUP
    }

    /// Where the fifth bits' masks start in a record.
    fn fifth_at(&self) -> usize {
        self.bytes_at() + (self.unpacked.per_row() + self.bytes.1) * GROUP
    }

    /// Where the values start in a record.
    fn values_at(&self) -> usize {
        self.fifth_at() + if self.fifth.is_some() { 32 } else { 0 }
    }

    /// Block offsets of the values' 4-byte chunks, in record order.
    fn chunks(&self) -> impl Iterator<Item = usize> + '_ {
        self.qs.iter().flat_map(|&(at, len)| (at..at + len).step_by(4))
    }
}

/// Whether the kernels run their AVX-512 VNNI copies (same results, bit for bit).
pub fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx2::vnni();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether `dtype` has an interleaved kernel.
pub fn supports(dtype: GgmlType) -> bool {
    use GgmlType::*;
    matches!(dtype, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K | Iq4Nl | Iq4Xs)
}

/// Whether `dtype` is a K-quant whose values [`decode`] can decode (on AVX2).
fn k_quant(dtype: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        return matches!(dtype, GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K);
    }
    false
}

/// Whether `dtype`'s values are decoded to bytes once per chunk of groups ([`decode`])
/// when more than one tile of rows runs over them: the K-quants, whose bit unpacking
/// would otherwise be repeated for every tile (Q6_K's costs a vector operation per
/// `maddubs` at four rows). Not Q4_K with VNNI, whose paired kernel masks the nibbles in
/// place, an `and` per chunk against 16 `vpdpbusd` ([`avx2::k_block_vnni`]).
fn decodes(dtype: GgmlType) -> bool {
    k_quant(dtype) && !(dtype == GgmlType::Q4K && vnni())
}

/// Whether two groups of `dtype` run side by side ([`pair`]) when more than one tile of
/// rows runs over them: every broadcast of activations then feeds two multiply-adds. One
/// core, 32 rows, a 160 × 2048 matrix: Q4_K 79 -> 85 GMAC/s, Q6_K 61 -> 66. Q8_0 pairs
/// with VNNI, whose 32 registers hold both groups' sums (1B Q8_0, alternated: 32 streams
/// 135–142 -> 151–161 tok/s, prefill 196–206 -> 215–227).
fn pairs(dtype: GgmlType) -> bool {
    k_quant(dtype) || signed_bytes(dtype) && vnni()
}

/// Whether `dtype` runs on [`avx2::q8`]'s kernels, its values signed bytes: Q8_0's, and
/// IQ4_NL's and IQ4_XS's looked up from their indices.
fn signed_bytes(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Q8_0 | GgmlType::Iq4Nl | GgmlType::Iq4Xs)
}

/// The coarsest activation scales `dtype`'s kernel needs (every kernel reads coarser
/// ones): Q4_K's and Q5_K's per 256 values, so that a block's sums stay integer until
/// their activation scale; Q6_K's per 32, so that a 32-value output's two scaled halves add in
/// i32 (per 256 would convert once per block, not eight times, but for 4 % on the kernel
/// it cost a quarter more KL divergence: SmolLM2 in Q6_K 0.0069 -> 0.0088), and Q3_K's and
/// Q2_K's, which run on Q6_K's kernels (Q2_K's mins per 256 as well tripled the KL
/// divergence from the dequantized weights, SmolLM2 with Q2_K's ffn_down 0.0033 -> 0.0092,
/// for no measured speed); the others per 16.
pub fn act_scales(dtype: GgmlType) -> ActScales {
    match dtype {
        GgmlType::Q4K | GgmlType::Q5K => ActScales::PerSuper,
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K => ActScales::PerBlock,
        _ => ActScales::PerHalf,
    }
}

/// How the AVX2 kernels (without VNNI) add up `dtype`'s byte products, for `weft bench`'s
/// ceiling of each format: `per_madd` `maddubs` results gather in i16 (as many as it holds
/// and the activation scales allow) before one `madd` widens, and for the K-quants scales,
/// them; signed values (Q8_0's, IQ4's) take a `sign` before each `maddubs` too ([`avx2::q8`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx2Step {
    pub per_madd: usize,
    pub signed: bool,
}

/// [`Avx2Step`] of `dtype`: Q4_K's 32-value sub-blocks are one run of eight chunks; Q5_K's
/// runs and the legacy formats' 16-value halves are four; Q6_K's 6-bit values fill an i16
/// in two (Q3_K and Q2_K run on its kernels).
pub fn avx2_step(dtype: GgmlType) -> Avx2Step {
    let (per_madd, signed) = match dtype {
        _ if signed_bytes(dtype) => (1, true),
        GgmlType::Q4K => (8, false),
        GgmlType::Q6K | GgmlType::Q3K | GgmlType::Q2K => (2, false),
        _ => (4, false),
    };
    Avx2Step { per_madd, signed }
}

/// Bytes of one record and where its values start.
fn record(dtype: GgmlType) -> (usize, usize) {
    let s = shape(dtype);
    let values: usize = s.qs.iter().map(|q| q.1).sum();
    (s.values_at() + values * GROUP, s.values_at())
}

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
fn fill_record<'a>(s: &Shape, head: usize, rec: &mut [u8], block: impl Fn(usize) -> &'a [u8]) {
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
fn fifth_masks(qh: [u32; GROUP]) -> [u32; 8] {
    std::array::from_fn(|j| qh.iter().enumerate().fold(0, |m, (r, &q)| m | ((q >> (4 * j)) & 0xF) << (4 * r)))
}

/// Q3_K's sixteen 6-bit scales (each `sc − 32`) packed back as [`scale_k3`] reads them.
fn pack_q3_k_scales(sc: [i8; 16]) -> [u8; 12] {
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

/// Groups per parallel task, out of `groups`.
pub(super) fn groups_per_task(groups: usize) -> usize {
    groups.div_ceil(TASKS_PER_THREAD * rayon::current_num_threads()).max(1)
}

/// Groups `groups` of part `p` against every row of `X`, written to their columns
/// (from `col0`) of `y` (row stride `n`).
///
/// # Safety
/// `y` must hold `m × n` values and no other task may write these columns.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn groups_task(
    xq: &QActs,
    p: &Part,
    k: usize,
    groups: std::ops::Range<usize>,
    col0: usize,
    n: usize,
    m: usize,
    y: SharedOut,
) {
    let blocks = k / p.dtype.block().0;
    let group_bytes = blocks * record(p.dtype).0;
    // With more than one tile, K-quant values are decoded once per chunk, and every tile
    // reads the bytes the kernel would have decoded: results do not change.
    let decoded = decodes(p.dtype) && m > TILE;
    let decoded_bytes = if decoded { blocks * DECODED } else { 0 };
    // Chunks of groups that fit in L2 (with their decoded values), then activation tiles,
    // then the chunk's groups: the weights are read from memory once, and the tile stays
    // in L1.
    // Paired formats take an even number of groups, so that none runs alone.
    let paired = m > TILE && pairs(p.dtype);
    let fit = CHUNK_BYTES / (group_bytes + decoded_bytes);
    let chunk = if paired { (fit & !1).max(2) } else { fit.max(1) };
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
            if decoded_bytes > 0 {
                for (g, out) in (first..last).zip(scratch.chunks_exact_mut(decoded_bytes)) {
                    decode(p.dtype, records(g), blocks, out);
                }
            }
            let vals = |g: usize| (decoded_bytes > 0).then(|| &scratch[(g - first) * decoded_bytes..][..decoded_bytes]);
            // SAFETY: the caller owns these eight columns of rows `i..i + tile`.
            let put = |acc: &[[f32; GROUP]; TILE], g: usize, i: usize, tile: usize| unsafe {
                for (t, row) in acc[..tile].iter().enumerate() {
                    std::ptr::copy_nonoverlapping(row.as_ptr(), y.0.add((i + t) * n + col0 + g * GROUP), GROUP)
                }
            };
            // While the tiles run over this chunk, the next chunk's records (when it is to be
            // decoded, or read by paired kernels) are asked for a slice per kernel call, into
            // L2, so that its first pass does not wait on memory. A paired K-quant kernel
            // spreads its slice over its blocks (`qmatmul` alone, 32 rows, cold: Q6_K
            // 2048 × 8192 192 -> 224 GMAC/s, its LM head shape 193 -> 207; 1B Q4_K_M,
            // alternated: 32 streams 161–169 -> 170–185 tok/s in six of seven pairs, 8
            // streams 104–107 -> 148–155). After a task's last chunk that is the next task's
            // first, which this thread usually runs next (rayon splits the task range in
            // halves).
            let next: &[u8] = if paired || decoded_bytes > 0 {
                &p.data[last * group_bytes..(last + chunk).min(p.rows / GROUP) * group_bytes]
            } else {
                &[]
            };
            let calls_per_tile = if paired { (last - first).div_ceil(2) } else { last - first };
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
                    let two = paired && g + 1 < last;
                    let spread = two && k_quant(p.dtype);
                    if !spread {
                        crate::kernels::prefetch_lines_l2(ask.as_ptr(), ask.len());
                    }
                    if two {
                        let mut acc = [[[0f32; GROUP]; TILE]; 2];
                        let (data, vals) = ([records(g), records(g + 1)], [vals(g), vals(g + 1)]);
                        let ask = if spread { ask } else { &[] };
                        pair(p.dtype, data, vals, xq, i, tile, k, &mut acc, ask);
                        put(&acc[0], g, i, tile);
                        put(&acc[1], g + 1, i, tile);
                        g += 2;
                    } else {
                        let mut acc = [[0f32; GROUP]; TILE];
                        group(p.dtype, records(g), vals(g), xq, i, tile, k, &mut acc);
                        put(&acc, g, i, tile);
                        g += 1;
                    }
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

/// One group's `blocks` records `data` of a K-quant, its values decoded to a byte each
/// into `out` (`blocks × DECODED` bytes) in the order its kernel reads them.
fn decode(dtype: GgmlType, data: &[u8], blocks: usize, out: &mut [u8]) {
    assert!(k_quant(dtype) && data.len() == blocks * record(dtype).0 && out.len() == blocks * DECODED);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `k_quant` checked for AVX2; the lengths were checked above.
    unsafe {
        avx2::decode(dtype, data.as_ptr(), blocks, out.as_mut_ptr())
    }
}

/// Two neighbouring groups' records and decoded values against activation rows
/// `first..first + tile`, for the formats that [`pairs`]; `ahead`: bytes of records to ask
/// into L2 on the way ([`avx2::Ahead`]).
#[allow(clippy::too_many_arguments)]
fn pair(
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

/// One group's records `data` (and its values decoded by [`decode`], `vals`) against
/// activation rows `first..first + tile`: the AVX2 kernels where the CPU has them, else
/// the portable fallback.
#[allow(clippy::too_many_arguments)]
fn group(
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
fn portable_group(
    dtype: GgmlType,
    data: &[u8],
    xq: &QActs,
    first: usize,
    tile: usize,
    k: usize,
    acc: &mut [[f32; GROUP]; TILE],
) {
    let cols: Vec<[f32; super::TILE]> = (0..GROUP)
        .map(|r| {
            let mut col = [0f32; super::TILE];
            super::rows::portable_dot_rows(dtype, &raw_row(dtype, data, r, k), xq, first, tile, k / QB, &mut col);
            col
        })
        .collect();
    for (t, row) in acc[..tile].iter_mut().enumerate() {
        row.iter_mut().zip(&cols).for_each(|(v, col)| *v = col[t]);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// One group's weights as a kernel reads them: its records, and the K-quants' values
    /// decoded ahead ([`decode`]) or null.
    #[derive(Clone, Copy)]
    pub struct Src {
        pub rec: *const u8,
        pub vals: *const u8,
    }

    /// Bytes of the next chunk's records that a paired kernel asks into L2 as it runs,
    /// `per_block` with each of its blocks ([`groups_task`]), rather than all at once
    /// before it: asked in one burst, a call's share of lines held it up until they came.
    #[derive(Clone, Copy)]
    pub struct Ahead {
        at: *const u8,
        len: usize,
        per_block: usize,
    }

    impl Ahead {
        pub const NONE: Ahead = Ahead { at: std::ptr::null(), len: 0, per_block: 0 };

        /// `bytes`, spread over a call of `blocks` blocks in whole lines.
        pub fn spread(bytes: &[u8], blocks: usize) -> Self {
            Ahead { at: bytes.as_ptr(), len: bytes.len(), per_block: bytes.len().div_ceil(blocks).next_multiple_of(64) }
        }

        /// Asks for block `b`'s share.
        #[inline(always)]
        fn block(&self, b: usize) {
            let from = b * self.per_block;
            if from < self.len {
                crate::kernels::prefetch_lines_l2(self.at.wrapping_add(from), self.per_block.min(self.len - from))
            }
        }
    }

    /// Whether the CPU runs AVX-512 VNNI on 256-bit registers (`vpdpbusd`: AVX512_VNNI
    /// and AVX512VL), and `WEFT_NO_VNNI` is unset or empty (set, it measures the AVX2
    /// kernels on the same machine).
    pub fn vnni() -> bool {
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| {
            std::env::var_os("WEFT_NO_VNNI").is_none_or(|v| v.is_empty())
                && crate::kernels::matmul::avx2::available()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
        })
    }

    /// The kernel `$f` (with leading const arguments `$c`) for a tile of `$tile` rows.
    macro_rules! by_tile {
        ($tile:expr, $f:ident $(, $c:expr)*) => {
            match $tile {
                1 => $f::<$($c,)* 1>,
                2 => $f::<$($c,)* 2>,
                3 => $f::<$($c,)* 3>,
                _ => $f::<$($c,)* 4>,
            }
        };
    }

    /// One group's records against activation rows `first..first + tile`, with the
    /// AVX-512 VNNI copies of the kernels when `vnni` (same results, bit for bit).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available, and with `vnni` what [`vnni`] checks; `src`
    /// holds `blocks` records, and `blocks` decoded blocks unless its `vals` is null
    /// (always null for the formats without [`decodes`]).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn group(
        vnni: bool,
        dtype: GgmlType,
        src: Src,
        xq: &QActs,
        first: usize,
        tile: usize,
        blocks: usize,
        acc: &mut [[f32; GROUP]; TILE],
    ) {
        let pre = !src.vals.is_null();
        let f = match (dtype, vnni) {
            (GgmlType::Q4_0, false) => by_tile!(tile, legacy_n, false, false),
            (GgmlType::Q4_0, true) => by_tile!(tile, legacy_n_vnni, false, false),
            (GgmlType::Q4_1, false) => by_tile!(tile, legacy_n, true, false),
            (GgmlType::Q4_1, true) => by_tile!(tile, legacy_n_vnni, true, false),
            (GgmlType::Q5_0, false) => by_tile!(tile, legacy_n, false, true),
            (GgmlType::Q5_0, true) => by_tile!(tile, legacy_n_vnni, false, true),
            (GgmlType::Q5_1, false) => by_tile!(tile, legacy_n, true, true),
            (GgmlType::Q5_1, true) => by_tile!(tile, legacy_n_vnni, true, true),
            (GgmlType::Q8_0, false) => by_tile!(tile, q8_0, F_Q8_0),
            (GgmlType::Q8_0, true) => by_tile!(tile, q8_0_vnni, F_Q8_0),
            (GgmlType::Iq4Nl, false) => by_tile!(tile, q8_0, F_IQ4_NL),
            (GgmlType::Iq4Nl, true) => by_tile!(tile, q8_0_vnni, F_IQ4_NL),
            (GgmlType::Iq4Xs, false) => by_tile!(tile, q8_0, F_IQ4_XS),
            (GgmlType::Iq4Xs, true) => by_tile!(tile, q8_0_vnni, F_IQ4_XS),
            // The K-quants' tiles of up to four rows read the records themselves. Q4_K's
            // AVX2 copy ran faster there (1B Q4_K_M, one stream: 5 % fewer samples); its
            // values are decoded ahead only without VNNI ([`decodes`]). Q6_K's took 15 %
            // more samples with VNNI while its records were in the file's order, and since
            // they are in the order a row reads them, VNNI takes a little less (samples in
            // Q6_K's kernel per Q4_K's, four alternated runs: 0.70–0.73 -> 0.68–0.69).
            (GgmlType::Q4K, _) => {
                if pre {
                    by_tile!(tile, k_one, false, true)
                } else {
                    by_tile!(tile, k_one, false, false)
                }
            }
            // Q5_K's keep AVX2 as well.
            (GgmlType::Q5K, _) => {
                if pre {
                    by_tile!(tile, k_one, true, true)
                } else {
                    by_tile!(tile, k_one, true, false)
                }
            }
            (GgmlType::Q6K, _) => match (pre, vnni) {
                (false, false) => by_tile!(tile, q6_one, F_Q6K, false),
                (false, true) => by_tile!(tile, q6_one_vnni, F_Q6K, false),
                (true, false) => by_tile!(tile, q6_one, F_Q6K, true),
                (true, true) => by_tile!(tile, q6_one_vnni, F_Q6K, true),
            },
            // Q3_K's and Q2_K's values decode to Q6_K's ([`q3_chunk`], [`q2_chunk`]).
            (GgmlType::Q3K, _) => match (pre, vnni) {
                (false, false) => by_tile!(tile, q6_one, F_Q3K, false),
                (false, true) => by_tile!(tile, q6_one_vnni, F_Q3K, false),
                (true, false) => by_tile!(tile, q6_one, F_Q3K, true),
                (true, true) => by_tile!(tile, q6_one_vnni, F_Q3K, true),
            },
            (GgmlType::Q2K, _) => match (pre, vnni) {
                (false, false) => by_tile!(tile, q6_one, F_Q2K, false),
                (false, true) => by_tile!(tile, q6_one_vnni, F_Q2K, false),
                (true, false) => by_tile!(tile, q6_one, F_Q2K, true),
                (true, true) => by_tile!(tile, q6_one_vnni, F_Q2K, true),
            },
            other => unreachable!("{other:?}: no such interleaved kernel"),
        };
        debug_assert!((1..=TILE).contains(&tile));
        debug_assert!(!pre || k_quant(dtype));
        f(src, xq, first, blocks, acc)
    }

    /// Two neighbouring groups (`src`) against activation rows `first..first + tile`, side
    /// by side ([`k_tiled`], [`q6_k`], [`q8`]), asking for `ahead` on the way.
    ///
    /// # Safety
    /// As [`group`], for each group: values decoded ahead, except for Q4_K and Q8_0 with
    /// VNNI, which read the records.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn pair(
        vnni: bool,
        dtype: GgmlType,
        src: [Src; 2],
        xq: &QActs,
        first: usize,
        tile: usize,
        blocks: usize,
        acc: &mut [[[f32; GROUP]; TILE]; 2],
        ahead: Ahead,
    ) {
        let pre = !src[0].vals.is_null();
        debug_assert!((1..=TILE).contains(&tile) && src.iter().all(|s| s.vals.is_null() != pre));
        if signed_bytes(dtype) {
            // Q8_0's share of records is asked for before the call: a check per block of
            // 32 values cost SmolLM2 Q4_1 (its LM head in Q8_0) 4 % at 32 streams.
            debug_assert!(vnni && !pre && ahead.len == 0);
            let f = match dtype {
                GgmlType::Q8_0 => by_tile!(tile, q8_two_vnni, F_Q8_0),
                GgmlType::Iq4Nl => by_tile!(tile, q8_two_vnni, F_IQ4_NL),
                _ => by_tile!(tile, q8_two_vnni, F_IQ4_XS),
            };
            return f(src, xq, first, blocks, acc);
        }
        let f = match (dtype, vnni) {
            // Q4_K's values are decoded ahead without VNNI, and read from the records with.
            (GgmlType::Q4K, _) if pre => by_tile!(tile, k_two, true),
            (GgmlType::Q4K, _) => by_tile!(tile, k_two_vnni, false),
            (GgmlType::Q5K, false) => by_tile!(tile, k5_two),
            (GgmlType::Q5K, true) => by_tile!(tile, k5_two_vnni),
            (GgmlType::Q6K, false) => by_tile!(tile, q6_two, F_Q6K, true),
            (GgmlType::Q6K, true) => by_tile!(tile, q6_two_vnni, F_Q6K, true),
            (GgmlType::Q3K, false) => by_tile!(tile, q6_two, F_Q3K, true),
            (GgmlType::Q3K, true) => by_tile!(tile, q6_two_vnni, F_Q3K, true),
            (GgmlType::Q2K, false) => by_tile!(tile, q6_two, F_Q2K, true),
            (GgmlType::Q2K, true) => by_tile!(tile, q6_two_vnni, F_Q2K, true),
            other => unreachable!("{other:?}: no paired kernel"),
        };
        debug_assert!(pre || vnni && dtype == GgmlType::Q4K, "only VNNI pairs from records");
        f(src, xq, first, blocks, acc, ahead)
    }

    /// Each kernel body (`#[inline(always)]`, its const argument `$v` saying whether to
    /// use VNNI) compiled twice: as `$avx2`, and as `$vnni` with AVX-512 VNNI enabled. The
    /// intrinsics inline only into a function that has their features, and the copy run
    /// on a CPU without AVX-512 must hold none.
    macro_rules! twins {
        ($avx2:ident, $vnni:ident <$($c:ident: $t:ty),*> ($($a:ident: $at:ty),*), $v:ident => $call:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $avx2<$(const $c: $t),*>($($a: $at),*) {
                const $v: bool = false;
                $call
            }
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn $vnni<$(const $c: $t),*>($($a: $at),*) {
                const $v: bool = true;
                $call
            }
        };
    }

    /// One Q4_K or Q5_K group ([`k_tiled`]), on AVX2 only (why: [`group`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k_one<const FIVE: bool, const PRE: bool, const R: usize>(
        src: Src,
        xq: &QActs,
        first: usize,
        blocks: usize,
        out: &mut [[f32; GROUP]; TILE],
    ) {
        k_tiled::<false, FIVE, PRE, 1, R>([src], xq, first, blocks, std::array::from_mut(out), Ahead::NONE)
    }
    twins!(k_two, k_two_vnni<PRE: bool, R: usize>
        (src: [Src; 2], xq: &QActs, first: usize, blocks: usize, out: &mut [[[f32; GROUP]; TILE]; 2], ahead: Ahead),
        V => k_tiled::<V, false, PRE, 2, R>(src, xq, first, blocks, out, ahead));
    twins!(k5_two, k5_two_vnni<R: usize>
        (src: [Src; 2], xq: &QActs, first: usize, blocks: usize, out: &mut [[[f32; GROUP]; TILE]; 2], ahead: Ahead),
        V => k_tiled::<V, true, true, 2, R>(src, xq, first, blocks, out, ahead));
    twins!(q6_one, q6_one_vnni<F: u8, PRE: bool, R: usize>
        (src: Src, xq: &QActs, first: usize, blocks: usize, out: &mut [[f32; GROUP]; TILE]),
        V => q6_k::<V, F, PRE, 1, R>([src], xq, first, blocks, std::array::from_mut(out), Ahead::NONE));
    twins!(q6_two, q6_two_vnni<F: u8, PRE: bool, R: usize>
        (src: [Src; 2], xq: &QActs, first: usize, blocks: usize, out: &mut [[[f32; GROUP]; TILE]; 2], ahead: Ahead),
        V => q6_k::<V, F, PRE, 2, R>(src, xq, first, blocks, out, ahead));
    twins!(legacy_n, legacy_n_vnni<MIN: bool, FIVE: bool, R: usize>
        (src: Src, xq: &QActs, first: usize, blocks: usize, out: &mut [[f32; GROUP]; TILE]),
        V => legacy::<V, MIN, FIVE, R>(src, xq, first, blocks, out));
    twins!(q8_0, q8_0_vnni<F: u8, R: usize>
        (src: Src, xq: &QActs, first: usize, blocks: usize, out: &mut [[f32; GROUP]; TILE]),
        V => q8::<V, F, 1, R>([src], xq, first, blocks, std::array::from_mut(out)));
    /// Two groups of Q8_0 (or IQ4) side by side, with VNNI only ([`pairs`]).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q8_two_vnni<const F: u8, const R: usize>(
        src: [Src; 2],
        xq: &QActs,
        first: usize,
        blocks: usize,
        out: &mut [[[f32; GROUP]; TILE]; 2],
    ) {
        q8::<true, F, 2, R>(src, xq, first, blocks, out)
    }

    /// The formats that run on [`q8`]'s kernels ([`signed_bytes`]), as its const argument `F`.
    const F_Q8_0: u8 = 0;
    const F_IQ4_NL: u8 = 1;
    const F_IQ4_XS: u8 = 2;

    /// `acc` plus, in each 32-bit lane, the four products of the unsigned bytes of `w` and
    /// the signed bytes of `x`: VNNI's `vpdpbusd`, where AVX2 takes a `maddubs`, an add
    /// and a `madd`. Inlined only into the `_vnni` kernels ([`twins`]).
    #[inline(always)]
    unsafe fn dot4(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, w, x)
    }

    /// Asks for the record [`AHEAD`] bytes on from `rec` into L2: for the K-quant kernels
    /// that run one group's records from memory (tiles of one to four rows; also a paired
    /// format's odd group, where each tile repeats the asks, cheaply since the lines are
    /// in by then). Past the end of the weights it is a hint for nothing, and reads nothing.
    #[inline(always)]
    unsafe fn ask_ahead(rec: *const u8, rec_bytes: usize) {
        crate::kernels::prefetch_lines_l2(rec.wrapping_add(AHEAD), rec_bytes)
    }

    /// Four activation bytes at `x`, in every lane.
    #[inline(always)]
    unsafe fn bcast(x: *const i8) -> __m256i {
        _mm256_set1_epi32(x.cast::<i32>().read_unaligned())
    }

    #[inline(always)]
    unsafe fn store<const R: usize>(acc: &[__m256; R], out: &mut [[f32; GROUP]; TILE]) {
        for (out, acc) in out.iter_mut().zip(acc) {
            _mm256_storeu_ps(out.as_mut_ptr(), *acc);
        }
    }

    /// Adds a block's activation-scaled sums `blk` of the tile's rows, times the eight
    /// rows' weight scales (the first f16 field of the record at `rec`), to `acc`.
    #[inline(always)]
    unsafe fn weigh<const R: usize>(rec: *const u8, blk: &[__m256; R], acc: &mut [__m256; R]) {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(rec.cast()));
        for (acc, &blk) in acc.iter_mut().zip(blk) {
            *acc = _mm256_fmadd_ps(dw, blk, *acc);
        }
    }

    /// The nibble formats: Q4_0 (values are nibbles − 8), Q4_1 (`MIN`: `d·q + m`), and with
    /// `FIVE` their fifth bits, Q5_0 (− 16) and Q5_1. The values stay unsigned for
    /// `maddubs`; Q4_0's and Q5_0's offsets are taken off the integer sum.
    #[inline(always)]
    unsafe fn legacy<const V: bool, const MIN: bool, const FIVE: bool, const R: usize>(
        src: Src,
        xq: &QActs,
        first: usize,
        blocks: usize,
        out: &mut [[f32; GROUP]; TILE],
    ) {
        let dtype = match (MIN, FIVE) {
            (false, false) => GgmlType::Q4_0,
            (true, false) => GgmlType::Q4_1,
            (false, true) => GgmlType::Q5_0,
            (true, true) => GgmlType::Q5_1,
        };
        let (rec_bytes, head) = record(dtype);
        let (masks, offset) = (shape(dtype).fifth_at(), if FIVE { -16 } else { -8 });
        let p = src.rec;
        let (ones, low4) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0xF));
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
                    let v = _mm256_loadu_si256(rec.add(head + 32 * c).cast());
                    *w = _mm256_and_si256(if h == 0 { v } else { _mm256_srli_epi16(v, 4) }, low4);
                    if FIVE {
                        *w = with_fifth::<V>(*w, rec.add(masks + 4 * (4 * h + c)).cast::<u32>().read_unaligned());
                    }
                }
                for (t, blk) in blk.iter_mut().enumerate() {
                    let xb = (first + t) * blocks + b;
                    let x = xq.q.as_ptr().add(xb * QB + QH * h);
                    // The −8 or −16 · Σx, first or last: the same i32 sum either way.
                    let offset = _mm256_set1_epi32(if MIN { 0 } else { offset * xq.sums.get_unchecked(2 * xb + h) });
                    let s = if V {
                        w.iter().enumerate().fold(offset, |s, (c, w)| dot4(s, *w, bcast(x.add(4 * c))))
                    } else {
                        let mut s16 = _mm256_maddubs_epi16(w[0], bcast(x));
                        for (c, w) in w.iter().enumerate().skip(1) {
                            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*w, bcast(x.add(4 * c))));
                        }
                        _mm256_add_epi32(_mm256_madd_epi16(s16, ones), offset)
                    };
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

    /// A chunk of nibbles `w` with 16 added where `mask` ([`Shape::fifth`]) has the byte's
    /// bit: one masked add with AVX-512 (`V`); AVX2 spreads the mask's bits over the bytes
    /// (lane `r` takes its four from the mask's byte `r / 2`) and compares.
    #[inline(always)]
    unsafe fn with_fifth<const V: bool>(w: __m256i, mask: u32) -> __m256i {
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

    /// Q8_0: signed weights, so `|w|` against `x` carrying `w`'s sign. Each chunk loads
    /// once for the tile's rows; a row's half-block sums gather in i32 and go straight
    /// into its results under the product of the two scales, so that a row holds two
    /// registers, not three (with a per-block sum as well, four rows spilled and ran
    /// slower than one). `G` groups run side by side, each broadcast of activations
    /// feeding `G` multiply-adds (with VNNI only, whose 32 registers hold two groups'
    /// sums: [`pairs`]); each group's operations are the same as alone.
    ///
    /// IQ4_NL (`F`) and IQ4_XS run here too: each chunk of their 4-bit indices (as Q4_0's
    /// nibbles) becomes its signed values with one byte shuffle from [`IQ4_VALUES`], and
    /// IQ4_XS's weight scale of 32 values is `d · (ls − 32)` (`blocks` counts its 256-value
    /// blocks; the loop runs over 32).
    #[inline(always)]
    unsafe fn q8<const V: bool, const F: u8, const G: usize, const R: usize>(
        src: [Src; G],
        xq: &QActs,
        first: usize,
        blocks: usize,
        out: &mut [[[f32; GROUP]; TILE]; G],
    ) {
        let dtype = match F {
            F_IQ4_NL => GgmlType::Iq4Nl,
            F_IQ4_XS => GgmlType::Iq4Xs,
            _ => GgmlType::Q8_0,
        };
        let ((rec_bytes, head), subs, sc_at) = (record(dtype), dtype.block().0 / QB, shape(dtype).bytes_at());
        let blocks = blocks * subs;
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_VALUES.as_ptr().cast()));
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); G]; R];
        for b in 0..blocks {
            let sub = b % subs;
            let rec: [*const u8; G] = std::array::from_fn(|g| src[g].rec.add(b / subs * rec_bytes));
            let mut dw = [_mm256_setzero_ps(); G];
            for (dw, rec) in dw.iter_mut().zip(rec) {
                *dw = _mm256_cvtph_ps(_mm_loadu_si128(rec.cast()));
                if F == F_IQ4_XS {
                    let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(rec.add(sc_at + GROUP * sub).cast()));
                    *dw = _mm256_mul_ps(*dw, _mm256_cvtepi32_ps(sc));
                }
            }
            for h in 0..2 {
                let mut s = [[_mm256_setzero_si256(); G]; R];
                if V {
                    // `w + 128` is unsigned, and `Σ (w + 128)·x` starts from `−128 · Σx`.
                    for (t, s) in s.iter_mut().enumerate() {
                        *s = [_mm256_set1_epi32(-128 * xq.sums.get_unchecked(2 * ((first + t) * blocks + b) + h)); G];
                    }
                }
                for c in 0..4 {
                    let (mut w, mut aw, mut uw) =
                        ([_mm256_setzero_si256(); G], [_mm256_setzero_si256(); G], [_mm256_setzero_si256(); G]);
                    for g in 0..G {
                        w[g] = if F == F_Q8_0 {
                            _mm256_loadu_si256(rec[g].add(head + 32 * (4 * h + c)).cast())
                        } else {
                            let v = _mm256_loadu_si256(rec[g].add(head + 128 * sub + 32 * c).cast());
                            let v = if h == 0 { v } else { _mm256_srli_epi16(v, 4) };
                            _mm256_shuffle_epi8(table, _mm256_and_si256(v, _mm256_set1_epi8(0xF)))
                        };
                        (aw[g], uw[g]) = (_mm256_abs_epi8(w[g]), _mm256_xor_si256(w[g], _mm256_set1_epi8(-128)));
                    }
                    for (t, s) in s.iter_mut().enumerate() {
                        let x = bcast(xq.q.as_ptr().add(((first + t) * blocks + b) * QB + QH * h + 4 * c));
                        for g in 0..G {
                            s[g] = if V {
                                dot4(s[g], uw[g], x)
                            } else {
                                let prod = _mm256_maddubs_epi16(aw[g], _mm256_sign_epi8(x, w[g]));
                                _mm256_add_epi32(s[g], _mm256_madd_epi16(prod, ones))
                            };
                        }
                    }
                }
                for (t, (acc, s)) in acc.iter_mut().zip(&s).enumerate() {
                    let dx = _mm256_set1_ps(*xq.d.get_unchecked(2 * ((first + t) * blocks + b) + h));
                    for g in 0..G {
                        acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[g]), _mm256_mul_ps(dw[g], dx), acc[g]);
                    }
                }
            }
        }
        for (g, out) in out.iter_mut().enumerate() {
            let mut col = [_mm256_setzero_ps(); R];
            for (col, acc) in col.iter_mut().zip(&acc) {
                *col = acc[g];
            }
            store(&col, out);
        }
    }

    /// A lane's 8-bit value at `p` (one per row) as the i16 pair `(v, v)`: `madd` with it
    /// multiplies both halves of a `maddubs` result by the row's scale. The eight bytes
    /// are broadcast by the load and placed by one byte shuffle (in the high byte of each
    /// i16, then shifted down with their sign, when `SIGNED`).
    #[inline(always)]
    unsafe fn scale_pairs<const SIGNED: bool>(p: *const u8) -> __m256i {
        let b = _mm256_set1_epi64x(p.cast::<i64>().read_unaligned());
        let place = |r: i8| if SIGNED { [-1, r, -1, r] } else { [r, -1, r, -1] };
        let m: [[i8; 4]; 8] = std::array::from_fn(|r| place(r as i8));
        let v = _mm256_shuffle_epi8(b, _mm256_loadu_si256(m.as_ptr().cast()));
        if SIGNED {
            _mm256_srai_epi16(v, 8)
        } else {
            v
        }
    }

    /// Q4_K and Q5_K (`FIVE`) with each decoded chunk (nibbles, and Q5_K's fifth bits)
    /// shared by the tile's rows, as [`legacy`] does; with `PRE`, the chunks are read
    /// from the values decoded ahead. `G` groups run side by side, so that each
    /// broadcast of activation bytes feeds `G` multiply-adds (a broadcast load costs about
    /// as much as a `maddubs`). One sub-block at a time (the low nibbles of a pair, then
    /// the high ones: [`k_sub`]; Q4_K's two groups and four rows with VNNI, both at
    /// once from the records, and Q5_K's from its decoded values: [`k_block_vnni`]); the
    /// scaled sums add in i32 over the block and take the product of the row's activation
    /// scale ([`ActScales::PerSuper`]) and the eight rows' weight scales once. The mins
    /// follow in [`k_mins`].
    #[inline(always)]
    unsafe fn k_tiled<const V: bool, const FIVE: bool, const PRE: bool, const G: usize, const R: usize>(
        src: [Src; G],
        xq: &QActs,
        first: usize,
        blocks: usize,
        out: &mut [[[f32; GROUP]; TILE]; G],
        ahead: Ahead,
    ) {
        debug_assert!(xq.scales == ActScales::PerSuper, "a K-quant block shares one activation scale");
        let rec_bytes = record(if FIVE { GgmlType::Q5K } else { GgmlType::Q4K }).0;
        // The running sums stay in `out` between blocks: in registers they crowd out the
        // sub-block's, and a block touches them only once.
        for out in out.iter_mut() {
            out[..R].iter_mut().for_each(|row| *row = [0.0; GROUP]);
        }
        for b in 0..blocks {
            let rec: [*const u8; G] = std::array::from_fn(|g| src[g].rec.add(b * rec_bytes));
            let vals: [*const u8; G] = std::array::from_fn(|g| src[g].vals.wrapping_add(b * DECODED));
            if !PRE && G == 1 {
                ask_ahead(rec[0], rec_bytes);
            }
            ahead.block(b);
            // The block's scaled integer sums.
            let mut dots = [[_mm256_setzero_si256(); G]; R];
            let at = |t: usize| ((first + t) * blocks + b) * 8;
            // Q4_K from its records, Q5_K from its decoded values.
            if V && G == 2 && R == 4 && FIVE == PRE {
                k_block_vnni::<FIVE, G, R>(rec, vals, xq, at, &mut dots);
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
        for (src, out) in src.iter().zip(out) {
            let mut acc = [_mm256_setzero_ps(); R];
            for (acc, out) in acc.iter_mut().zip(out.iter()) {
                *acc = _mm256_loadu_ps(out.as_ptr());
            }
            k_mins::<R>(src.rec, rec_bytes, xq, first, blocks, &mut acc);
            store(&acc, out);
        }
    }

    /// Chunk `c` of sub-block `2·pair + H` of the Q4_K/Q5_K (`FIVE`) record at `rec`: four
    /// values of each of the eight rows, unsigned.
    #[inline(always)]
    unsafe fn k_chunk<const FIVE: bool, const H: usize>(rec: *const u8, pair: usize, c: usize) -> __m256i {
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

    /// Sub-block `2·pair + H` of the [`k_tiled`] records at `rec` (values decoded ahead at
    /// `vals` with `PRE`) against tile row `t`'s activations from sub-block index `at(t)`.
    /// Q4_K's sixteen products of at most 15·127 per i16 gather before one `madd` applies
    /// the 6-bit scales, Q5_K's eight of at most 31·127 before each of two; they add to
    /// the block's integer sums `dots` (at most 8 · 32 · 31·127 · 63 per lane).
    #[inline(always)]
    unsafe fn k_sub<const FIVE: bool, const PRE: bool, const G: usize, const R: usize, const H: usize>(
        rec: [*const u8; G],
        vals: [*const u8; G],
        pair: usize,
        xq: &QActs,
        at: impl Fn(usize) -> usize,
        dots: &mut [[__m256i; G]; R],
    ) {
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

    /// One chunk of [`sums_4x2`]: the two groups' 32 bytes at offset `$w`, the four rows'
    /// activations at offset `$x`.
    macro_rules! chunk_4x2 {
        ($w:literal, $x:literal) => {
            concat!(
                "vmovdqu {a}, ymmword ptr [{w0} + ",
                $w,
                "]\n",
                "vmovdqu {b}, ymmword ptr [{w1} + ",
                $w,
                "]\n",
                "vpbroadcastd {x}, dword ptr [{x0} + ",
                $x,
                "]\n",
                "vpmaddubsw {t}, {a}, {x}\n",
                "vpaddw {s00}, {s00}, {t}\n",
                "vpmaddubsw {t}, {b}, {x}\n",
                "vpaddw {s01}, {s01}, {t}\n",
                "vpbroadcastd {x}, dword ptr [{x0} + {row} + ",
                $x,
                "]\n",
                "vpmaddubsw {t}, {a}, {x}\n",
                "vpaddw {s10}, {s10}, {t}\n",
                "vpmaddubsw {t}, {b}, {x}\n",
                "vpaddw {s11}, {s11}, {t}\n",
                "vpbroadcastd {x}, dword ptr [{x0} + {row} * 2 + ",
                $x,
                "]\n",
                "vpmaddubsw {t}, {a}, {x}\n",
                "vpaddw {s20}, {s20}, {t}\n",
                "vpmaddubsw {t}, {b}, {x}\n",
                "vpaddw {s21}, {s21}, {t}\n",
                "vpbroadcastd {x}, dword ptr [{x0} + {row3} + ",
                $x,
                "]\n",
                "vpmaddubsw {t}, {a}, {x}\n",
                "vpaddw {s30}, {s30}, {t}\n",
                "vpmaddubsw {t}, {b}, {x}\n",
                "vpaddw {s31}, {s31}, {t}\n",
            )
        };
    }

    /// The 16-bit sums of `N` (4 or 8) chunks of two groups' decoded values (at `w0`,
    /// `w1`, 32 bytes a chunk) against four activation rows (from `x`, `row` bytes apart,
    /// 4 bytes a chunk), from `init` (per row): `[row][group]`. Each broadcast of
    /// activations feeds both groups. Written out in assembly because LLVM hoists the
    /// weight loads of a whole run ahead of the multiply-adds and spills them; unrolled, as
    /// a run is only ever four or eight chunks, so that no loop counter or exit branch
    /// sits between the multiply-adds (`qmatmul` alone, 32 rows, the loop and the unrolled
    /// copy alternated in one process, median ratios: Q4_K 0.99–1.15, Q6_K 1.01–1.08; 1B
    /// Q4_K_M, 32 streams, seven alternated pairs: decode 78.8 -> 86.7 tok/s, prefill
    /// 102 -> 117, medians). The sums are those of the intrinsic loop, since 16-bit adds
    /// that wrap give the same result in any order.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn sums_4x2<const N: usize>(
        w0: *const u8,
        w1: *const u8,
        x: *const i8,
        row: usize,
        init: [__m256i; 4],
    ) -> [[__m256i; 2]; 4] {
        const { assert!(N == 4 || N == 8, "runs of 4 or 8 chunks") };
        let [mut s00, mut s10, mut s20, mut s30] = init;
        let [mut s01, mut s11, mut s21, mut s31] = init;
        macro_rules! run {
            ($($w:literal $x:literal),*) => {
                std::arch::asm!(
                    $(chunk_4x2!($w, $x),)*
                    w0 = in(reg) w0,
                    w1 = in(reg) w1,
                    x0 = in(reg) x,
                    row = in(reg) row,
                    row3 = in(reg) row * 3,
                    s00 = inout(ymm_reg) s00,
                    s01 = inout(ymm_reg) s01,
                    s10 = inout(ymm_reg) s10,
                    s11 = inout(ymm_reg) s11,
                    s20 = inout(ymm_reg) s20,
                    s21 = inout(ymm_reg) s21,
                    s30 = inout(ymm_reg) s30,
                    s31 = inout(ymm_reg) s31,
                    a = out(ymm_reg) _,
                    b = out(ymm_reg) _,
                    x = out(ymm_reg) _,
                    t = out(ymm_reg) _,
                    options(pure, readonly, nostack),
                )
            };
        }
        match N {
            4 => run!(0 0, 32 4, 64 8, 96 12),
            8 => run!(0 0, 32 4, 64 8, 96 12, 128 16, 160 20, 192 24, 224 28),
            _ => unreachable!(),
        }
        [[s00, s01], [s10, s11], [s20, s21], [s30, s31]]
    }

    /// One block of two groups' Q4_K records (`rec`), or Q5_K values decoded ahead
    /// (`vals`, with `FIVE`), against four activation rows from sub-block index `at(0)`
    /// (rows `at(1) - at(0)` apart): each row's scaled integer sums of the block, added to
    /// `dots`. Q4_K's come straight from the nibbles: a chunk of nibbles feeds both of its
    /// sub-blocks, the low ones masked, the high ones masked in place (16 times their
    /// value), so there is no shift and no decode pass; the low sub-block's sums take 16
    /// times their scale, and the block's sums, all multiples of 16, are divided back
    /// exactly (at most 16 · 8 · 32 · 15 · 127 · 63 < 2³¹ per lane). The same integers as
    /// [`k_sub`]'s.
    #[inline(always)]
    unsafe fn k_block_vnni<const FIVE: bool, const G: usize, const R: usize>(
        rec: [*const u8; G],
        vals: [*const u8; G],
        xq: &QActs,
        at: impl Fn(usize) -> usize,
        dots: &mut [[__m256i; G]; R],
    ) {
        debug_assert!(G == 2 && R == 4);
        let head = record(GgmlType::Q4K).1;
        let x = xq.q.as_ptr().add(at(0) * QB);
        let row = (at(1) - at(0)) * QB;
        let mut sums = [[_mm256_setzero_si256(); G]; R];
        for pair in 0..4 {
            let s = if FIVE {
                // Sub-block `2·pair`'s decoded chunks, then `2·pair + 1`'s.
                let w = |g: usize| vals[g.min(G - 1)].add(512 * pair);
                decoded_4x2_vnni(w(0), w(1), x.add(2 * pair * QB), row)
            } else {
                let w = |g: usize| rec[g.min(G - 1)].add(head + 256 * pair);
                nibbles_4x2_vnni(w(0), w(1), x.add(2 * pair * QB), row)
            };
            for (g, &rec) in rec.iter().enumerate() {
                // Plain loads, not a closure (see [`k_sub`]): sub-blocks `2·pair` and `2·pair + 1`.
                let sc = rec.add(32 + 16 * pair);
                let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.cast()));
                let lo = if FIVE { lo } else { _mm256_slli_epi32(lo, 4) };
                let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.add(8).cast()));
                for (sums, s) in sums.iter_mut().zip(&s) {
                    let scaled = _mm256_add_epi32(_mm256_mullo_epi32(s[g][0], lo), _mm256_mullo_epi32(s[g][1], hi));
                    sums[g] = _mm256_add_epi32(sums[g], scaled);
                }
            }
        }
        for (dots, sums) in dots.iter_mut().zip(&sums) {
            for (dot, s) in dots.iter_mut().zip(sums) {
                *dot = _mm256_add_epi32(*dot, if FIVE { *s } else { _mm256_srai_epi32(*s, 4) });
            }
        }
    }

    /// The i32 sums of two sub-blocks of decoded values (from `w0`, `w1`: eight 32-byte
    /// chunks each, the second sub-block's 256 bytes on) of two groups against four
    /// activation rows (from `x`, `row` bytes apart; the second sub-block's 32 bytes on):
    /// `[row][group][sub-block]`, as [`nibbles_4x2_vnni`].
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn decoded_4x2_vnni(w0: *const u8, w1: *const u8, x: *const i8, row: usize) -> [[[__m256i; 2]; 2]; 4] {
        let mut s = [[[_mm256_setzero_si256(); 2]; 2]; 4];
        for c in 0..8 {
            // Plain loads, not a closure (see [`k_sub`]).
            let mut w = [[_mm256_setzero_si256(); 2]; 2];
            for (w, p) in w.iter_mut().zip([w0, w1]) {
                *w = [_mm256_loadu_si256(p.add(32 * c).cast()), _mm256_loadu_si256(p.add(256 + 32 * c).cast())];
            }
            dots_4x2x2(&mut s, &w, x.add(4 * c), row, 32);
        }
        s
    }

    /// The i32 sums of two Q4_K sub-blocks (the low nibbles, then the high ones masked in
    /// place) of two groups' records (nibbles at `w0`, `w1`, eight 32-byte chunks) against
    /// four activation rows (from `x`, `row` bytes apart; the second sub-block's 32 bytes
    /// on): `[row][group][sub-block]`. Sixteen sums, held in the registers of AVX-512VL.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn nibbles_4x2_vnni(w0: *const u8, w1: *const u8, x: *const i8, row: usize) -> [[[__m256i; 2]; 2]; 4] {
        let (low, high) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0xF0u8 as i8));
        let mut s = [[[_mm256_setzero_si256(); 2]; 2]; 4];
        for c in 0..8 {
            let (a, b) = (_mm256_loadu_si256(w0.add(32 * c).cast()), _mm256_loadu_si256(w1.add(32 * c).cast()));
            let w = [
                [_mm256_and_si256(a, low), _mm256_and_si256(a, high)],
                [_mm256_and_si256(b, low), _mm256_and_si256(b, high)],
            ];
            dots_4x2x2(&mut s, &w, x.add(4 * c), row, 32);
        }
        s
    }

    /// Adds one chunk of two groups' weights `w` (`[group][half]`) against four activation
    /// rows (from `x`, `row` bytes apart; each row's second half `half` bytes on) to the
    /// sums `s` (`[row][group][half]`), one `vpdpbusd` each. Inlined only into the
    /// AVX-512 VNNI kernels.
    #[inline(always)]
    unsafe fn dots_4x2x2(s: &mut [[[__m256i; 2]; 2]; 4], w: &[[__m256i; 2]; 2], x: *const i8, row: usize, half: usize) {
        for (t, s) in s.iter_mut().enumerate() {
            for h in 0..2 {
                let x = bcast(x.add(t * row + half * h));
                for (s, w) in s.iter_mut().zip(w) {
                    s[h] = dot4(s[h], w[h], x);
                }
            }
        }
    }

    /// The i32 sums of one Q6_K output (32 values, decoded ahead) of two groups (at `w0`,
    /// `w1`: eight 32-byte chunks, the second 16 values' four from 128 bytes on) against
    /// four activation rows (from `x`, `row` bytes apart; the second 16 values from 16
    /// bytes on), from `init` (`[half][row]`, the −32 offsets): `[row][group][half]`.
    /// Sixteen sums in AVX-512VL's registers, so that each chain of `vpdpbusd`s is four
    /// long and 16 run side by side.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn q6_halves_vnni(
        w0: *const u8,
        w1: *const u8,
        x: *const i8,
        row: usize,
        init: [[__m256i; 4]; 2],
    ) -> [[[__m256i; 2]; 2]; 4] {
        let mut s = [[[_mm256_setzero_si256(); 2]; 2]; 4];
        for (t, s) in s.iter_mut().enumerate() {
            for s in s.iter_mut() {
                *s = [init[0][t], init[1][t]];
            }
        }
        for c in 0..4 {
            let mut w = [[_mm256_setzero_si256(); 2]; 2];
            for (w, p) in w.iter_mut().zip([w0, w1]) {
                *w = [_mm256_loadu_si256(p.add(32 * c).cast()), _mm256_loadu_si256(p.add(128 + 32 * c).cast())];
            }
            dots_4x2x2(&mut s, &w, x.add(4 * c), row, 16);
        }
        s
    }

    /// A group's `blocks` K-quant records at `p`, their values decoded to bytes at `out` in
    /// the order [`k_sub`] and [`q6_out`] read them: per block, 32-byte chunks by
    /// sub-block (Q6_K: by output) and then chunk.
    ///
    /// # Safety
    /// AVX2 must be available; `p` holds `blocks` records, `out` room for `blocks` decoded.
    #[target_feature(enable = "avx2")]
    pub unsafe fn decode(dtype: GgmlType, p: *const u8, blocks: usize, out: *mut u8) {
        let (rec_bytes, head) = record(dtype);
        for b in 0..blocks {
            let (rec, out) = (p.add(b * rec_bytes), out.add(b * DECODED));
            match dtype {
                GgmlType::Q4K => decode_k::<false>(rec, out),
                GgmlType::Q5K => decode_k::<true>(rec, out),
                GgmlType::Q3K => decode_q3(rec.add(head), out),
                GgmlType::Q2K => decode_q2(rec.add(head), out),
                _ => decode_q6(rec.add(head), out),
            }
        }
    }

    /// Chunk `c` of run `i` (a sub-block, or a Q6_K output) of a decoded block at `out`.
    #[inline(always)]
    unsafe fn put(out: *mut u8, i: usize, c: usize, w: __m256i) {
        _mm256_storeu_si256(out.add(32 * (8 * i + c)).cast(), w);
    }

    /// One Q4_K/Q5_K (`FIVE`) record's values, decoded for [`decode`].
    #[inline(always)]
    unsafe fn decode_k<const FIVE: bool>(rec: *const u8, out: *mut u8) {
        for pair in 0..4 {
            for c in 0..8 {
                put(out, 2 * pair, c, k_chunk::<FIVE, 0>(rec, pair, c));
                put(out, 2 * pair + 1, c, k_chunk::<FIVE, 1>(rec, pair, c));
            }
        }
    }

    /// One Q3_K record's values (from `vals`), decoded for [`decode`] ([`q3_chunk`]).
    #[inline(always)]
    unsafe fn decode_q3(vals: *const u8, out: *mut u8) {
        for o in 0..8 {
            for c in 0..8 {
                put(out, o, c, q3_chunk(vals, o, c));
            }
        }
    }

    /// One Q2_K record's values (from `vals`), decoded for [`decode`] ([`q2_chunk`]).
    #[inline(always)]
    unsafe fn decode_q2(vals: *const u8, out: *mut u8) {
        for o in 0..8 {
            for c in 0..8 {
                put(out, o, c, q2_chunk(vals, o, c));
            }
        }
    }

    /// Chunk `c` of output `o` (values `32o..32o + 32`) of the Q3_K values at `vals` (the
    /// high bits' 8 chunks, then the low two bits' 16) as Q6_K's are: value `q − 4` (`q` its
    /// three bits) as `q − 4 + 32`, so that Q6_K's kernels, their −32 offsets and the scales
    /// `sc − 32` in the record compute Q3_K exactly. Bits `2·(o % 4)` of the low chunks of
    /// its half and bit `o` of the high ones.
    #[inline(always)]
    unsafe fn q3_chunk(vals: *const u8, o: usize, c: usize) -> __m256i {
        let (low_shift, high_shift) = (_mm_cvtsi32_si128(2 * (o as i32 % 4)), _mm_cvtsi32_si128(o as i32));
        let low = _mm256_loadu_si256(vals.add(32 * (8 + 8 * (o / 4) + c)).cast());
        let high = _mm256_loadu_si256(vals.add(32 * c).cast());
        let low = _mm256_and_si256(_mm256_srl_epi16(low, low_shift), _mm256_set1_epi8(3));
        let high = _mm256_and_si256(_mm256_srl_epi16(high, high_shift), _mm256_set1_epi8(1));
        let q = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
        _mm256_add_epi8(q, _mm256_set1_epi8(28))
    }

    /// Chunk `c` of output `o` of the Q2_K values at `vals` (16 chunks, each byte holding
    /// four outputs' values) as Q6_K's are: value `q` as `q + 32`, so that Q6_K's kernels
    /// and their −32 offsets compute `Σ sc·q·x` exactly (the mins follow in [`q2_mins`]).
    /// Bits `2·(o % 4)` of the chunks of its half.
    #[inline(always)]
    unsafe fn q2_chunk(vals: *const u8, o: usize, c: usize) -> __m256i {
        let q = _mm256_loadu_si256(vals.add(32 * (8 * (o / 4) + c)).cast());
        let q = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (o as i32 % 4))), _mm256_set1_epi8(3));
        _mm256_or_si256(q, _mm256_set1_epi8(32))
    }

    /// One Q6_K record's values (from `vals`), decoded for [`decode`]. The four outputs are
    /// written out, so that their shifts are constants and the chunks they share load once.
    #[inline(always)]
    unsafe fn decode_q6(vals: *const u8, out: *mut u8) {
        for n in 0..2 {
            for c in 0..8 {
                put(out, 4 * n, c, q6_chunk(vals, n, 0, c));
                put(out, 4 * n + 1, c, q6_chunk(vals, n, 1, c));
                put(out, 4 * n + 2, c, q6_chunk(vals, n, 2, c));
                put(out, 4 * n + 3, c, q6_chunk(vals, n, 3, c));
            }
        }
    }

    /// Q4_K/Q5_K's mins, `dmin·m · d_x·Σx` per sub-block, in a pass of their own after
    /// the values, so that the value loop keeps its registers. The activations have one
    /// scale per block ([`ActScales::PerSuper`]), so a block's `Σ m · Σx` is integer: four
    /// `madd`s of two sub-blocks' mins against the activations' pair sums
    /// ([`QActs::pair_sums`]), then `dmin · d_x` once.
    #[inline(always)]
    unsafe fn k_mins<const R: usize>(
        p: *const u8,
        rec_bytes: usize,
        xq: &QActs,
        first: usize,
        blocks: usize,
        acc: &mut [__m256; R],
    ) {
        let pairs = xq.pair_sums().as_ptr();
        for b in 0..blocks {
            let rec = p.add(b * rec_bytes);
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(rec.add(16).cast()));
            // Lane r: the i16 pair of row r's mins of sub-blocks 2j and 2j + 1.
            let mut m = [_mm256_setzero_si256(); 4];
            for (j, m) in m.iter_mut().enumerate() {
                let even = _mm_loadl_epi64(rec.add(96 + 16 * j).cast());
                let odd = _mm_loadl_epi64(rec.add(104 + 16 * j).cast());
                *m = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(even, odd));
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

    /// Q6_K: 6-bit values from a low-nibble chunk and a 2-bit chunk, kept unsigned for
    /// `maddubs`, the −32 taken off in 16 bits with the activations' pair sums
    /// ([`QActs::q6_offsets`]), then the signed 8-bit scale of each 16 values applied in
    /// one `madd`. One output chunk (a quarter of the 128 values that two low-nibble
    /// chunks and a 2-bit chunk hold) is decoded at a time and shared by the tile's rows
    /// ([`q6_out`]), so that the tile's sums and the decoded values stay in registers
    /// (decoding all four outputs at once spilled them). `G` groups run side by side, as
    /// in [`k_tiled`]. Each row's 32-value sums gather under their activation scales
    /// ([`ActScales::PerBlock`], or per 256 beside Q4_K) and take the eight rows' weight
    /// scales once per block; a row's operations are the same whatever its tile.
    #[inline(always)]
    unsafe fn q6_k<const V: bool, const F: u8, const PRE: bool, const G: usize, const R: usize>(
        src: [Src; G],
        xq: &QActs,
        first: usize,
        blocks: usize,
        out: &mut [[[f32; GROUP]; TILE]; G],
        ahead: Ahead,
    ) {
        debug_assert_ne!(xq.scales, ActScales::PerHalf, "Q6_K's halves share an activation scale");
        // Q3_K's and Q2_K's records hold Q6_K's fields (Q2_K's scales after its `dmin`),
        // and their values decode to Q6_K's.
        let dtype = q6_format(F);
        let ((rec_bytes, head), sc_at) = (record(dtype), shape(dtype).bytes_at());
        // The −32 offsets: i16 pairs for AVX2's 16-bit sums, `−32 · Σx` per 16 values for VNNI's.
        let offs = if V { xq.q6_starts().as_ptr() } else { xq.q6_offsets().as_ptr() };
        // The running sums stay in `out` between blocks, as in [`k_tiled`].
        for out in out.iter_mut() {
            out[..R].iter_mut().for_each(|row| *row = [0.0; GROUP]);
        }
        for b in 0..blocks {
            let rec: [*const u8; G] = std::array::from_fn(|g| src[g].rec.add(b * rec_bytes));
            let vals: [*const u8; G] = std::array::from_fn(|g| src[g].vals.wrapping_add(b * DECODED));
            if !PRE && G == 1 {
                ask_ahead(rec[0], rec_bytes);
            }
            ahead.block(b);
            let mut blk = [[_mm256_setzero_ps(); G]; R];
            let at = |t: usize| ((first + t) * blocks + b) * 8 * QB;
            let hb = |t: usize| 16 * ((first + t) * blocks + b);
            if V && PRE && G == 2 && R == 4 {
                q6_block_vnni::<F, G, R>(rec, vals, sc_at, xq, offs, at, hb, &mut blk);
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
                let mut acc = [_mm256_setzero_ps(); R];
                for (acc, out) in acc.iter_mut().zip(out.iter()) {
                    *acc = _mm256_loadu_ps(out.as_ptr());
                }
                q2_mins::<R>(src.rec, xq, first, blocks, &mut acc);
                store(&acc, out);
            }
        }
    }

    /// Q2_K's mins, `dmin·m · d_x·Σx` per 16 values, in a pass of their own after the
    /// values, as [`k_mins`]: per 32 values, one `madd` of two runs' mins (the high nibbles
    /// of the scale bytes) against the activations' pair of 16-value sums
    /// ([`QActs::half_pairs`]) under their activation scale ([`ActScales::PerBlock`]), then
    /// `dmin` once per block.
    #[inline(always)]
    unsafe fn q2_mins<const R: usize>(p: *const u8, xq: &QActs, first: usize, blocks: usize, acc: &mut [__m256; R]) {
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

    /// The formats that run on [`q6_k`]'s kernels, as its const argument `F`.
    const F_Q6K: u8 = 0;
    const F_Q3K: u8 = 1;
    const F_Q2K: u8 = 2;

    /// The format `F` of [`q6_k`].
    const fn q6_format(f: u8) -> GgmlType {
        match f {
            F_Q3K => GgmlType::Q3K,
            F_Q2K => GgmlType::Q2K,
            _ => GgmlType::Q6K,
        }
    }

    /// Eight rows' scales of a 16-value run at `at`, as VNNI's i32 lanes (`V`) or the i16
    /// pairs of AVX2's `madd`: Q6_K's and Q3_K's signed bytes, Q2_K's low nibbles (its
    /// mins are the high ones, [`q2_mins`]).
    #[inline(always)]
    unsafe fn q6_scales<const V: bool, const F: u8>(at: *const u8) -> __m256i {
        match (V, F == F_Q2K) {
            (true, false) => _mm256_cvtepi8_epi32(_mm_loadl_epi64(at.cast())),
            (true, true) => _mm256_and_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64(at.cast())), _mm256_set1_epi32(0xF)),
            (false, false) => scale_pairs::<true>(at),
            (false, true) => _mm256_and_si256(scale_pairs::<false>(at), _mm256_set1_epi16(0xF)),
        }
    }

    /// [`q6_k`]'s block for two groups' values decoded ahead (`vals`) and four rows with
    /// VNNI: output by output in a loop (unrolled, the outputs' sums, scales and pointers
    /// crowded the registers and spilled), both 16-value halves of an output at once
    /// ([`q6_halves_vnni`]); the same operations per row as [`q6_out`]. 1B Q4_K_M, 32
    /// streams, perf samples in Q6_K's kernel per Q4_K's: 0.60–0.62 -> 0.57–0.59.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q6_block_vnni<const F: u8, const G: usize, const R: usize>(
        rec: [*const u8; G],
        vals: [*const u8; G],
        sc_at: usize,
        xq: &QActs,
        offs: *const i32,
        at: impl Fn(usize) -> usize,
        hb: impl Fn(usize) -> usize,
        blk: &mut [[__m256; G]; R],
    ) {
        let row = at(1) - at(0);
        for o in 0..8 {
            // Output `o` is `i = o % 4` of half `n = o / 4`: its values 32·o on, its scales
            // `8·n + 2·i = 2·o` on (from `sc_at`).
            let mut init = [[_mm256_setzero_si256(); 4]; 2];
            for (half, init) in init.iter_mut().enumerate() {
                for (t, init) in init.iter_mut().enumerate().take(R) {
                    *init = _mm256_set1_epi32(*offs.add((at(t) + 32 * o + 16 * half) / QH));
                }
            }
            let s = q6_halves_vnni(
                vals[0].add(256 * o),
                vals[G - 1].add(256 * o),
                xq.q.as_ptr().add(at(0) + 32 * o),
                row,
                init,
            );
            for (g, &rec) in rec.iter().enumerate() {
                let sc = rec.add(sc_at + 16 * o);
                let (lo, hi) = (q6_scales::<true, F>(sc), q6_scales::<true, F>(sc.add(8)));
                for (t, (blk, s)) in blk.iter_mut().zip(&s).enumerate() {
                    let dot = _mm256_add_epi32(_mm256_mullo_epi32(s[g][0], lo), _mm256_mullo_epi32(s[g][1], hi));
                    let dx = _mm256_set1_ps(*xq.d.get_unchecked(hb(t) + 2 * o));
                    blk[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, blk[g]);
                }
            }
        }
    }

    /// Chunk `c` of output `i` of half `n` of the Q6_K values at `vals`: four 6-bit values
    /// of each of the eight rows (unsigned), from a low-nibble chunk and a 2-bit chunk.
    #[inline(always)]
    unsafe fn q6_chunk(vals: *const u8, n: usize, i: usize, c: usize) -> __m256i {
        // Chunk indices in the record ([`Q6_VALUES`]).
        let ql_at = 24 * n + if i & 1 == 0 { c + 4 * (c / 4) } else { 16 + c };
        let qh_at = 24 * n + 4 + c + 4 * (c / 4);
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

    /// Output `i` of half `n` of the [`q6_k`] records at `rec` (values from `head`, or
    /// decoded ahead at `pre` with `PRE`; scales from `sc_at`): its 32 values of each row, against tile row
    /// `t`'s activations from index `at(t)` (with their Q6_K offsets `offs`, one per 16),
    /// whose activation scales start at index `hb(t)`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn q6_out<const V: bool, const F: u8, const PRE: bool, const G: usize, const R: usize>(
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
            // (VNNI's paired tiles of four take [`q6_block_vnni`].)
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

#[cfg(test)]
mod tests {
    use super::super::tests::random_blocks;
    use super::super::{quantize_rows, QActs};
    use super::*;
    use crate::kernels::testing::random_vec;

    /// Every interleaved format.
    const FORMATS: [GgmlType; 12] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Iq4Nl,
        GgmlType::Iq4Xs,
    ];

    /// One interleaved group of random `dtype` rows of `k` values (seed `seed`), and `rows`
    /// random activation rows quantized for it (seed `seed + 1`).
    fn one_group(dtype: GgmlType, k: usize, rows: usize, seed: u64) -> (Buf<u8>, QActs) {
        let data = interleave(dtype, &random_blocks(dtype, GROUP * k / dtype.block().0, seed), k);
        let mut xq = QActs::default();
        quantize_rows(&random_vec(rows * k, seed + 1), rows, k, act_scales(dtype), &mut xq);
        (data, xq)
    }

    /// When the CPU has AVX2: for every interleaved format, one group of rows of
    /// `k = width · max(block, 64)` values with [`TILE`] activation rows ([`one_group`]),
    /// handed to `check(dtype, k, blocks per row, data, activations)`.
    #[cfg(target_arch = "x86_64")]
    fn each_format_on_avx2(width: usize, seed: u64, check: impl Fn(GgmlType, usize, usize, &[u8], &QActs)) {
        if !crate::kernels::matmul::avx2::available() {
            return;
        }
        for dtype in FORMATS {
            let per = dtype.block().0;
            let k = width * per.max(64);
            let (data, xq) = one_group(dtype, k, TILE, seed);
            check(dtype, k, k / per, &data, &xq);
        }
    }

    /// A group's records, with no values decoded ahead.
    #[cfg(target_arch = "x86_64")]
    fn records(data: &[u8]) -> avx2::Src {
        avx2::Src { rec: data.as_ptr(), vals: std::ptr::null() }
    }

    /// Eight rows of one 256-value `block` against [`TILE`] rows of `x`, through the AVX2
    /// kernel: the group, its activations and the results.
    #[cfg(target_arch = "x86_64")]
    fn one_block_avx2(dtype: GgmlType, block: &[u8], x: f32) -> (Buf<u8>, QActs, [[f32; GROUP]; TILE]) {
        let k = 256;
        let data = interleave(dtype, &block.repeat(GROUP), k);
        let mut xq = QActs::default();
        quantize_rows(&vec![x; TILE * k], TILE, k, act_scales(dtype), &mut xq);
        let mut out = [[0f32; GROUP]; TILE];
        // SAFETY: the callers checked for AVX2; `data` is one group's records.
        unsafe { avx2::group(avx2::vnni(), dtype, records(&data), &xq, 0, TILE, 1, &mut out) };
        (data, xq, out)
    }

    /// Q6_K's 16-bit sums at their extremes (every value 0 or 63, every activation ±127,
    /// scales ±127): the AVX2 kernel matches the portable one, nothing wraps.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q6_k_extremes_stay_in_range() {
        if !crate::kernels::matmul::avx2::available() {
            return;
        }
        let k = 256;
        for (q, x, sc) in [(0u8, 1.0f32, 127i8), (0, -1.0, -127), (0xFF, 1.0, 127), (0xFF, -1.0, -128)] {
            let mut block = [q; 210];
            block[192..208].fill(sc as u8);
            block[208..210].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            let (data, xq, b) = one_block_avx2(GgmlType::Q6K, &block, x);
            let mut a = [[0f32; GROUP]; TILE];
            portable_group(GgmlType::Q6K, &data, &xq, 0, TILE, k, &mut a);
            assert_eq!(a, b, "values {q:#x}, activations {x}, scales {sc}");
            // The paired kernel, over decoded values (its 16 sums with VNNI).
            let mut vals = vec![0u8; DECODED];
            decode(GgmlType::Q6K, &data, 1, &mut vals);
            let src = avx2::Src { rec: data.as_ptr(), vals: vals.as_ptr() };
            let mut paired = [[[0f32; GROUP]; TILE]; 2];
            // SAFETY: AVX2 is present; `data` is one group's records and `vals` their values.
            unsafe {
                avx2::pair(avx2::vnni(), GgmlType::Q6K, [src; 2], &xq, 0, TILE, 1, &mut paired, avx2::Ahead::NONE)
            };
            assert_eq!(paired, [a; 2], "paired: values {q:#x}, activations {x}, scales {sc}");
            let want = 0.5 * sc as f32 * if q == 0 { -32.0 } else { 31.0 } * x * k as f32;
            assert!((a[0][0] - want).abs() <= 1e-3 * want.abs(), "{} vs {want}", a[0][0]);
        }
    }

    /// Q4_K's and Q5_K's 16-bit sums at their extremes (every value at its largest, every
    /// activation ±127, scales 63): the AVX2 kernels match the exact sum, nothing wraps.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn k_quant_extremes_stay_in_range() {
        if !crate::kernels::matmul::avx2::available() {
            return;
        }
        for (dtype, top) in [(GgmlType::Q4K, 15.0), (GgmlType::Q5K, 31.0)] {
            for x in [1.0f32, -1.0] {
                // All bits set: every value `top`, every 6-bit scale and min 63; then
                // d = 0.5 and dmin = 0, so the sum is exact in f32.
                let mut block = vec![0xFFu8; dtype.block().1];
                block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
                block[2..4].fill(0);
                let (data, xq, got) = one_block_avx2(dtype, &block, x);
                let want = 0.5 * 63.0 * top * x * 256.0;
                assert!(got.iter().flatten().all(|&v| v == want), "{dtype:?} {x}: {:?} vs {want}", got[0]);
                // The paired VNNI kernels: Q4_K's from the records (its sums run 16 times the
                // value), Q5_K's from decoded values.
                if avx2::vnni() {
                    let mut vals = vec![0u8; DECODED];
                    decode(dtype, &data, 1, &mut vals);
                    let src = if dtype == GgmlType::Q5K {
                        avx2::Src { rec: data.as_ptr(), vals: vals.as_ptr() }
                    } else {
                        records(&data)
                    };
                    let mut paired = [[[0f32; GROUP]; TILE]; 2];
                    // SAFETY: VNNI is present; `data` is one group's records (and `vals` their
                    // values), paired with itself.
                    unsafe { avx2::pair(true, dtype, [src; 2], &xq, 0, TILE, 1, &mut paired, avx2::Ahead::NONE) };
                    assert!(paired.iter().flatten().flatten().all(|&v| v == want), "paired {x}: {:?}", paired[0][0]);
                }
            }
        }
    }

    /// The nibble formats' 16-bit sums at their extremes (every value at its largest, with
    /// Q5's fifth bits; every activation ±127): the AVX2 kernels, and the VNNI ones where
    /// the CPU has them, match the exact sum, nothing wraps.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn nibble_extremes_stay_in_range() {
        if !crate::kernels::matmul::avx2::available() {
            return;
        }
        let k = 256;
        for (dtype, top) in
            [(GgmlType::Q4_0, 7.0), (GgmlType::Q4_1, 15.0), (GgmlType::Q5_0, 15.0), (GgmlType::Q5_1, 31.0)]
        {
            // All bits set, then d = 0.5 and (Q4_1, Q5_1) m = 0.
            let mut block = vec![0xFFu8; dtype.block().1];
            block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            if matches!(dtype, GgmlType::Q4_1 | GgmlType::Q5_1) {
                block[2..4].fill(0);
            }
            let data = interleave(dtype, &block.repeat(GROUP * k / 32), k);
            for x in [1.0f32, -1.0] {
                let mut xq = QActs::default();
                quantize_rows(&vec![x; TILE * k], TILE, k, act_scales(dtype), &mut xq);
                let want = 0.5 * top * x * k as f32;
                for vnni in [false, avx2::vnni()] {
                    let mut got = [[0f32; GROUP]; TILE];
                    // SAFETY: AVX2 is present, and VNNI when asked for; `data` is one group.
                    unsafe { avx2::group(vnni, dtype, records(&data), &xq, 0, TILE, k / 32, &mut got) };
                    let near = |v: f32| (v - want).abs() <= 1e-5 * want.abs();
                    assert!(got.iter().flatten().all(|&v| near(v)), "{dtype:?} {x} vnni {vnni}: {:?}", got[0]);
                }
            }
        }
    }

    /// The portable fallback and the AVX2 kernels agree on every format and tile height.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn portable_matches_avx2() {
        each_format_on_avx2(2, 31, |dtype, k, blocks, data, xq| {
            for tile in 1..=TILE {
                let (mut a, mut b) = ([[0f32; GROUP]; TILE], [[0f32; GROUP]; TILE]);
                portable_group(dtype, data, xq, 0, tile, k, &mut a);
                // SAFETY: AVX2 is present (checked by the helper); `data` is one group's records.
                unsafe { avx2::group(avx2::vnni(), dtype, records(data), xq, 0, tile, blocks, &mut b) };
                for (ra, rb) in a.iter().zip(&b).take(tile) {
                    for (va, vb) in ra.iter().zip(rb) {
                        assert!((va - vb).abs() <= 1e-4 * (1.0 + va.abs()), "{dtype:?} tile {tile}: {va} vs {vb}");
                    }
                }
            }
        });
    }

    /// A row's result does not depend on its tile: every format's kernel gives each row of
    /// a full tile exactly what it gives that row alone (batch invariance).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn rows_are_tile_invariant() {
        each_format_on_avx2(3, 51, |dtype, _, blocks, data, xq| {
            let mut tiled = [[0f32; GROUP]; TILE];
            // SAFETY: AVX2 is present (checked by the helper); `data` is one group's records.
            unsafe { avx2::group(avx2::vnni(), dtype, records(data), xq, 0, TILE, blocks, &mut tiled) };
            for (t, want) in tiled.iter().enumerate() {
                let mut alone = [[0f32; GROUP]; TILE];
                // SAFETY: as above.
                unsafe { avx2::group(avx2::vnni(), dtype, records(data), xq, t, 1, blocks, &mut alone) };
                assert_eq!(alone[0], *want, "{dtype:?} row {t}");
            }
        });
    }

    /// Values decoded ahead give every K-quant kernel, at every tile height, the very
    /// results it computes from the records, and the decoded bytes are the file's values.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn decoded_values_change_nothing() {
        each_format_on_avx2(3, 71, |dtype, k, blocks, data, xq| {
            if !k_quant(dtype) {
                return;
            }
            let mut vals = vec![0u8; blocks * DECODED];
            decode(dtype, data, blocks, &mut vals);
            for tile in 1..=TILE {
                let (mut want, mut got) = ([[0f32; GROUP]; TILE], [[0f32; GROUP]; TILE]);
                let src = avx2::Src { rec: data.as_ptr(), vals: vals.as_ptr() };
                // SAFETY: AVX2 is present (checked by the helper); `data` is one group's
                // records and `vals` their decoded values.
                unsafe {
                    avx2::group(avx2::vnni(), dtype, records(data), xq, 0, tile, blocks, &mut want);
                    avx2::group(avx2::vnni(), dtype, src, xq, 0, tile, blocks, &mut got);
                }
                assert_eq!(got, want, "{dtype:?} tile {tile}");
            }
            // Each decoded byte is a row's value with its format's offset left in (the
            // nibble, the 6-bit value before Q6_K's −32, and Q3_K's and Q2_K's as Q6_K's).
            let raw: Vec<Vec<u8>> = (0..GROUP).map(|r| raw_row(dtype, data, r, k)).collect();
            let value = |r: usize, j: usize| -> u8 {
                let blk = &raw[r][j / 256 * dtype.block().1..];
                let (sub, i) = (j % 256 / 32, j % 32);
                match dtype {
                    GgmlType::Q4K => (blk[16 + sub / 2 * 32 + i] >> (4 * (sub % 2))) & 0xF,
                    GgmlType::Q5K => {
                        let low = (blk[48 + sub / 2 * 32 + i] >> (4 * (sub % 2))) & 0xF;
                        low | ((blk[16 + i] >> sub) & 1) << 4
                    }
                    // Value `q − 4` as `q + 28`, `q` as `q + 32` (runs as Q6_K's outputs).
                    GgmlType::Q3K => {
                        let low = (blk[32 + sub / 4 * 32 + i] >> (2 * (sub % 4))) & 3;
                        28 + (low | ((blk[i] >> sub) & 1) << 2)
                    }
                    GgmlType::Q2K => 32 + ((blk[16 + sub / 4 * 32 + i] >> (2 * (sub % 4))) & 3),
                    _ => {
                        let (n, l) = (j % 256 / 128, j % 128);
                        let (ql, qh) = (&blk[64 * n..], &blk[128 + 32 * n..]);
                        let low = if l < 64 { ql[l] & 0xF } else { ql[l - 64] >> 4 };
                        low | ((qh[l % 32] >> (2 * (l / 32))) & 3) << 4
                    }
                }
            };
            for (at, &v) in vals.iter().enumerate() {
                // Block, then 32-value run (sub-block or output), then chunk, row, value.
                let (b, run, c, r, i) = (at / DECODED, at % DECODED / 256, at % 256 / 32, at % 32 / 4, at % 4);
                assert_eq!(v, value(r, 256 * b + 32 * run + 4 * c + i), "{dtype:?} byte {at}");
            }
        });
    }

    /// Two groups side by side give each group, at every tile height, the very results
    /// it gets alone (the paired kernels, the assembly sums among them, change nothing).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn pairs_change_nothing() {
        if !crate::kernels::matmul::avx2::available() {
            return;
        }
        for dtype in FORMATS.into_iter().filter(|&d| pairs(d)) {
            let (k, rows) = (3 * 256, 2 * GROUP);
            let blocks = k / dtype.block().0;
            let data = interleave(dtype, &random_blocks(dtype, rows * blocks, 81), k);
            let (a, b) = data.split_at(data.len() / 2);
            let mut xq = QActs::default();
            quantize_rows(&random_vec(TILE * k, 82), TILE, k, act_scales(dtype), &mut xq);
            // Alone from decoded values where the format has them (else from the records);
            // paired as the step runs them: from decoded values, or with VNNI (Q4_K, Q8_0)
            // from the records.
            let vals: Vec<Option<Vec<u8>>> = [a, b]
                .iter()
                .map(|d| {
                    k_quant(dtype).then(|| {
                        let mut v = vec![0u8; blocks * DECODED];
                        decode(dtype, d, blocks, &mut v);
                        v
                    })
                })
                .collect();
            let paired_vals = if decodes(dtype) { [vals[0].as_deref(), vals[1].as_deref()] } else { [None, None] };
            for tile in 1..=TILE {
                let mut paired = [[[0f32; GROUP]; TILE]; 2];
                pair(dtype, [a, b], paired_vals, &xq, 0, tile, k, &mut paired, &[]);
                for (g, d) in [a, b].into_iter().enumerate() {
                    let mut alone = [[0f32; GROUP]; TILE];
                    group(dtype, d, vals[g].as_deref(), &xq, 0, tile, k, &mut alone);
                    assert_eq!(paired[g][..tile], alone[..tile], "{dtype:?} tile {tile} group {g}");
                }
            }
        }
    }

    /// Where the CPU has AVX-512 VNNI, its copies of the kernels give the AVX2 ones'
    /// results bit for bit (the same integers, then the same float operations in the same
    /// order): every format and tile height, from records and from decoded values, alone
    /// and paired.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_matches_avx2_bit_for_bit() {
        if !avx2::vnni() {
            return;
        }
        each_format_on_avx2(3, 91, |dtype, _, blocks, data, xq| {
            let mut vals = vec![0u8; blocks * DECODED];
            let mut srcs = vec![records(data)];
            if k_quant(dtype) {
                decode(dtype, data, blocks, &mut vals);
                srcs.push(avx2::Src { rec: data.as_ptr(), vals: vals.as_ptr() });
            }
            for (tile, src) in (1..=TILE).flat_map(|t| srcs.iter().map(move |s| (t, *s))) {
                let (mut avx2, mut vnni) = ([[0f32; GROUP]; TILE], [[0f32; GROUP]; TILE]);
                // SAFETY: VNNI (and so AVX2) is present; `src` is one group's records and,
                // where not null, their decoded values.
                unsafe {
                    avx2::group(false, dtype, src, xq, 0, tile, blocks, &mut avx2);
                    avx2::group(true, dtype, src, xq, 0, tile, blocks, &mut vnni);
                }
                assert_eq!(avx2, vnni, "{dtype:?} tile {tile}, decoded {}", !src.vals.is_null());
            }
        });
        for dtype in FORMATS.into_iter().filter(|&d| pairs(d)) {
            let k = 3 * 256;
            let blocks = k / dtype.block().0;
            let data = interleave(dtype, &random_blocks(dtype, 2 * GROUP * blocks, 93), k);
            let mut xq = QActs::default();
            quantize_rows(&random_vec(TILE * k, 94), TILE, k, act_scales(dtype), &mut xq);
            let (a, b) = data.split_at(data.len() / 2);
            if !k_quant(dtype) {
                // Q8_0 and IQ4 pair with VNNI only: against the AVX2 kernel alone.
                for tile in 1..=TILE {
                    let mut vnni = [[[0f32; GROUP]; TILE]; 2];
                    // SAFETY: as above, for two groups' records.
                    unsafe {
                        avx2::pair(
                            true,
                            dtype,
                            [records(a), records(b)],
                            &xq,
                            0,
                            tile,
                            blocks,
                            &mut vnni,
                            avx2::Ahead::NONE,
                        )
                    };
                    for (g, d) in [a, b].into_iter().enumerate() {
                        let mut avx2 = [[0f32; GROUP]; TILE];
                        // SAFETY: as above, one group's records.
                        unsafe { avx2::group(false, dtype, records(d), &xq, 0, tile, blocks, &mut avx2) };
                        assert_eq!(avx2, vnni[g], "{dtype:?} paired, tile {tile}, group {g}");
                    }
                }
                continue;
            }
            let mut vals = vec![0u8; 2 * blocks * DECODED];
            let (va, vb) = vals.split_at_mut(blocks * DECODED);
            decode(dtype, a, blocks, va);
            decode(dtype, b, blocks, vb);
            let src =
                [avx2::Src { rec: a.as_ptr(), vals: va.as_ptr() }, avx2::Src { rec: b.as_ptr(), vals: vb.as_ptr() }];
            // VNNI reads Q4_K's records, not decoded values ([`decodes`]).
            let vnni_src = if decodes(dtype) { src } else { [records(a), records(b)] };
            for tile in 1..=TILE {
                let (mut avx2, mut vnni) = ([[[0f32; GROUP]; TILE]; 2], [[[0f32; GROUP]; TILE]; 2]);
                // SAFETY: as above, for two groups with their values decoded (or not, where
                // VNNI reads the records).
                unsafe {
                    avx2::pair(false, dtype, src, &xq, 0, tile, blocks, &mut avx2, avx2::Ahead::NONE);
                    avx2::pair(true, dtype, vnni_src, &xq, 0, tile, blocks, &mut vnni, avx2::Ahead::NONE);
                }
                assert_eq!(avx2, vnni, "{dtype:?} paired, tile {tile}");
            }
        }
    }

    /// Repacking and reading a row back give the file's bytes, for every interleaved format.
    #[test]
    fn interleave_round_trips() {
        for dtype in FORMATS {
            let (per, bytes) = dtype.block();
            let k = 2 * per.max(64);
            let rows = 16;
            let raw = random_blocks(dtype, rows * k / per, 21);
            let packed = interleave(dtype, &raw, k);
            assert_eq!(packed.len(), rows * k / per * bytes / GROUP * record(dtype).0 / bytes);
            let row_bytes = k / per * bytes;
            for r in 0..rows {
                assert_eq!(raw_row(dtype, &packed, r, k), raw[r * row_bytes..(r + 1) * row_bytes], "{dtype:?} {r}");
            }
        }
    }
}
