//! The interleaved path: eight weight rows repacked block by block at load, so that one
//! AVX2 register holds four consecutive values of each of the eight rows and each 32-bit
//! lane accumulates a different output column (llama.cpp's `q4_0_8x8` idea). Four
//! activation bytes are broadcast against it; there are no horizontal sums, the f16 scales
//! of eight rows convert in one instruction, and the unsigned nibble formats need no sign
//! tricks.
//!
//! - [`layout`]: each format's record (one block of eight rows), repacking and reading back.
//! - [`paths`]: which kernel each format runs on, and the activation scales it needs.
//! - [`driver`]: the parallel tasks, chunks of groups sized to L2, activation tiles.
//! - `avx2`: the kernels, one file per format family, each body compiled for AVX2 and again
//!   for AVX-512 VNNI (`vpdpbusd`), computing the same integers, so the same bits.
//!
//! Each row of `X` is one chain of operations whatever the tile it is in, and decoded
//! values are the very bytes the kernels would unpack, so results stay batch-invariant.
//! Why each kernel is shaped as it is, with the measurements: `docs/kernels.md`.

use super::{ActScales, Buf, Part, QActs, SharedOut, QB, QH};
use crate::kernels::quant::GgmlType;

#[cfg(target_arch = "x86_64")]
mod avx2;
mod driver;
mod layout;
mod paths;
#[cfg(test)]
mod tests;

pub(super) use driver::{groups_per_task, groups_task};
pub use layout::{interleave, raw_row};
use layout::{record, shape};
pub use paths::{act_scales, avx2_step, supports, vnni, Avx2Step};
use paths::{
    decodable, decode_from, decoded_bytes, decodes, decodes_in_pairs, k_quant, lookup, pairs, quads, scaled_per_32,
    table, ternary,
};

/// Rows interleaved into one group.
pub const GROUP: usize = 8;
/// Parallel tasks per thread: few, so each streams a long contiguous run of weights, but
/// enough that work stealing evens out the threads.
const TASKS_PER_THREAD: usize = 4;
/// Bytes of weights a task runs all activation tiles over before moving on (half of L2).
const CHUNK_BYTES: usize = 256 << 10;
/// Activation rows computed together against one group's (or a pair's) weights.
const TILE: usize = 4;
/// Bytes of one K-quant block's values decoded to a byte each, for the group's rows.
const DECODED: usize = 256 * GROUP;
/// Bytes of one TQ1_0 block's codes decoded as TQ2_0's, for the group's rows.
const DECODED_TQ1: usize = 64 * GROUP;
/// How far ahead of the record in use the K-quants' one-group kernels ask for records,
/// into L2: their loads jump about inside a record, and the hardware prefetchers alone
/// left them short of the streaming rate.
const AHEAD: usize = 12 << 10;

/// Whether Q4_K's one-group tiles run in 256-bit registers ([`k_rows_256`]) rather than
/// 512-bit ones ([`k_rows_vnni`]): on AMD's Zen 4 (family 19h), which runs a 512-bit
/// operation on its two 256-bit halves, the 512-bit form's permutes and lane folds cost
/// more than its fewer instructions save. Both give the same bits.
fn half_width_512() -> bool {
    static HALF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HALF.get_or_init(|| crate::kernels::amd_family() == Some(0x19))
}

/// Whether a one-group kernel's tile of one row asks [`AHEAD`] too: not on AMD's Zen 4
/// and Zen 5 (families 19h and 1Ah), whose prefetchers alone feed one row's Q4_K and
/// Q6_K at the streaming rate, while the asks held them to 0.82–0.94 of it (tiles of two
/// to four rows still gain from them, up to 45 % at four). Zen 3 (also family 19h, with
/// no AVX-512) and other vendors keep the asks: not measured with these kernels.
fn one_row_asks() -> bool {
    static ASKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASKS.get_or_init(|| {
        let zen4_or_later =
            crate::kernels::amd_family().is_some_and(|f| f >= 0x19) && is_x86_feature_detected!("avx512f");
        !zen4_or_later
    })
}
