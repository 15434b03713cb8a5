//! The AVX2 kernels, and their AVX-512 VNNI twins: each body takes a const `V` and is
//! compiled once without VNNI and once with it ([`twins`]). This file holds what every
//! kernel shares (the group's pointers, asking ahead, the dispatch by format and tile);
//! each format family's body has a file of its own.

use super::*;
use std::arch::x86_64::*;

mod decode;
mod k_quants;
mod q6;
mod q8;
mod sums;
mod ternary;
mod vnni;

pub(crate) use decode::{decode, decode_pair};
use decode::{q2_chunk, q2_values, q3_chunk, q3_values};
use k_quants::*;
use q6::*;
use q8::*;
use sums::*;
use ternary::*;
use vnni::*;

/// One group's weights as a kernel reads them: its records, and its values
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

/// [`by_tile!`] of the VNNI twin `$vnni` when `$v`, else of the AVX2 one `$avx2` ([`twins`]).
macro_rules! by_isa {
    ($v:expr, $tile:expr, $avx2:ident | $vnni:ident $(, $c:expr)*) => {
        if $v {
            by_tile!($tile, $vnni $(, $c)*)
        } else {
            by_tile!($tile, $avx2 $(, $c)*)
        }
    };
}

/// [`by_tile!`] or [`by_isa!`] (`$by!($($args)*)`) of the kernel of `$dtype`, one of the
/// [`scaled_per_32`] formats that also pair (Q5_0 and Q5_1 do not: [`group`] dispatches
/// them), with its format and, for the lookup formats, `$pre` (values decoded ahead) as
/// const arguments; Q8_0 and the nibble formats always read their records.
macro_rules! by_per_32 {
    ($dtype:expr, $pre:expr, $by:ident!($($args:tt)*)) => {
        match ($dtype, $pre) {
            (GgmlType::Q8_0, _) => $by!($($args)*, F_Q8_0, false),
            (GgmlType::Q4_0, _) => $by!($($args)*, F_Q4_0, false),
            (GgmlType::Q4_1, _) => $by!($($args)*, F_Q4_1, false),
            (GgmlType::Iq4Nl, true) => $by!($($args)*, F_IQ4_NL, true),
            (GgmlType::Iq4Nl, false) => $by!($($args)*, F_IQ4_NL, false),
            (GgmlType::Iq4Xs, true) => $by!($($args)*, F_IQ4_XS, true),
            (GgmlType::Iq4Xs, false) => $by!($($args)*, F_IQ4_XS, false),
            (GgmlType::Mxfp4, true) => $by!($($args)*, F_MXFP4, true),
            (GgmlType::Mxfp4, false) => $by!($($args)*, F_MXFP4, false),
            (other, _) => unreachable!("{other:?}: not a paired format scaled per 32 values"),
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
    unsafe {
        let pre = !src.vals.is_null();
        let f = match (dtype, vnni) {
            (GgmlType::Q5_0, v) => by_isa!(v, tile, q8_0 | q8_0_vnni, F_Q5_0, false),
            (GgmlType::Q5_1, v) => by_isa!(v, tile, q8_0 | q8_0_vnni, F_Q5_1, false),
            (d, v) if scaled_per_32(d) => by_per_32!(d, pre, by_isa!(v, tile, q8_0 | q8_0_vnni)),
            (GgmlType::Tq2_0, v) => by_isa!(v, tile, tq2_0 | tq2_0_vnni, false),
            // TQ1_0's codes decoded ahead are TQ2_0's ([`decode_tq1`]).
            (GgmlType::Tq1_0, v) if pre => by_isa!(v, tile, tq2_0 | tq2_0_vnni, true),
            (GgmlType::Tq1_0, v) => by_isa!(v, tile, tq1_0 | tq1_0_vnni),
            // The K-quants' tiles of up to four rows read the records themselves. Q5_K's AVX2
            // copy ran faster there than its VNNI one; Q4_K's VNNI copy masks the nibbles in
            // place ([`k_rows_vnni`]), and its values are decoded ahead only without VNNI
            // ([`decodes`]).
            (GgmlType::Q4K, _) if pre => by_tile!(tile, k_one, false, true),
            (GgmlType::Q4K, true) => by_tile!(tile, k_one_vnni, false, false),
            (GgmlType::Q4K, _) => by_tile!(tile, k_one, false, false),
            (GgmlType::Q5K, _) if pre => by_tile!(tile, k_one, true, true),
            (GgmlType::Q5K, _) => by_tile!(tile, k_one, true, false),
            // Q3_K's and Q2_K's values decode to Q6_K's ([`q3_chunk`], [`q2_chunk`]).
            (GgmlType::Q6K, v) if pre => by_isa!(v, tile, q6_one | q6_one_vnni, F_Q6K, true),
            (GgmlType::Q6K, v) => by_isa!(v, tile, q6_one | q6_one_vnni, F_Q6K, false),
            (GgmlType::Q3K, v) if pre => by_isa!(v, tile, q6_one | q6_one_vnni, F_Q3K, true),
            (GgmlType::Q3K, v) => by_isa!(v, tile, q6_one | q6_one_vnni, F_Q3K, false),
            (GgmlType::Q2K, v) if pre => by_isa!(v, tile, q6_one | q6_one_vnni, F_Q2K, true),
            (GgmlType::Q2K, v) => by_isa!(v, tile, q6_one | q6_one_vnni, F_Q2K, false),
            other => unreachable!("{other:?}: no such interleaved kernel"),
        };
        debug_assert!((1..=TILE).contains(&tile));
        debug_assert!(!pre || decodable(dtype));
        f(src, xq, first, blocks, acc)
    }
}

/// Two neighbouring groups (`src`) against activation rows `first..first + tile`, side
/// by side ([`k_tiled`], [`q6_k`], [`q8`]), asking for `ahead` on the way.
///
/// # Safety
/// As [`group`], for each group: values decoded ahead, except for Q4_K, Q8_0 and TQ2_0
/// with VNNI, which read the records; with VNNI, the Q6_K family's and the lookup
/// formats' side by side at both groups' `vals` ([`decode_pair`]).
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
    unsafe {
        let pre = !src[0].vals.is_null();
        debug_assert!((1..=TILE).contains(&tile) && src.iter().all(|s| s.vals.is_null() != pre));
        if scaled_per_32(dtype) || ternary(dtype) {
            // Their share of records is asked for before the call: a check per block of
            // 32 values measured slower.
            debug_assert!(vnni && ahead.len == 0 && (pre == (dtype == GgmlType::Tq1_0) || lookup(dtype)));
            let f = match dtype {
                GgmlType::Tq2_0 => by_tile!(tile, tq2_two_vnni, false),
                GgmlType::Tq1_0 => by_tile!(tile, tq2_two_vnni, true),
                _ => by_per_32!(dtype, pre, by_tile!(tile, q8_two_vnni)),
            };
            return f(src, xq, first, blocks, acc);
        }
        let f = match (dtype, vnni) {
            // Q4_K's values are decoded ahead without VNNI, and read from the records with.
            (GgmlType::Q4K, _) if pre => by_tile!(tile, k_two, true),
            (GgmlType::Q4K, _) => by_tile!(tile, k_two_vnni, false),
            (GgmlType::Q5K, v) => by_isa!(v, tile, k5_two | k5_two_vnni),
            (GgmlType::Q6K, v) => by_isa!(v, tile, q6_two | q6_two_vnni, F_Q6K, true),
            (GgmlType::Q3K, v) => by_isa!(v, tile, q6_two | q6_two_vnni, F_Q3K, true),
            (GgmlType::Q2K, v) => by_isa!(v, tile, q6_two | q6_two_vnni, F_Q2K, true),
            other => unreachable!("{other:?}: no paired kernel"),
        };
        debug_assert!(pre || vnni && dtype == GgmlType::Q4K, "only VNNI pairs from records");
        f(src, xq, first, blocks, acc, ahead)
    }
}

/// Four neighbouring groups (`src`: Q4_K's and Q8_0's records, or the Q6_K family's and
/// the lookup formats' with each pair's values decoded side by side, [`decode_pair`]) against
/// activation rows `first..first + tile`, with VNNI ([`quads`]): each broadcast of
/// activations feeds both pairs' `vpdpbusd`s.
///
/// # Safety
/// What [`vnni`] checks must be available; each `src` holds `blocks` records, and for
/// the Q6_K family `src[0]` and `src[1]` share their pair's decoded values, as do
/// `src[2]` and `src[3]` (Q4_K's and Q8_0's are null).
#[allow(clippy::too_many_arguments)]
pub unsafe fn quad(
    dtype: GgmlType,
    src: [Src; 4],
    xq: &QActs,
    first: usize,
    tile: usize,
    blocks: usize,
    acc: &mut [[[f32; GROUP]; TILE]; 4],
    ahead: Ahead,
) {
    unsafe {
        let pre = !src[0].vals.is_null();
        debug_assert!((1..=TILE).contains(&tile) && src.iter().all(|s| s.vals.is_null() != pre));
        debug_assert!(pre == decodes_in_pairs(dtype) || lookup(dtype) && !pre);
        if scaled_per_32(dtype) {
            // Their share of records is asked for before the call, as for [`pair`]'s.
            debug_assert!(ahead.len == 0);
            let f = by_per_32!(dtype, pre, by_tile!(tile, q8_four_vnni));
            return f(src, xq, first, blocks, acc);
        }
        let f = match dtype {
            GgmlType::Q4K => by_tile!(tile, k_four_vnni),
            GgmlType::Q6K => by_tile!(tile, q6_four_vnni, F_Q6K),
            GgmlType::Q3K => by_tile!(tile, q6_four_vnni, F_Q3K),
            GgmlType::Q2K => by_tile!(tile, q6_four_vnni, F_Q2K),
            other => unreachable!("{other:?}: no kernel of four groups"),
        };
        f(src, xq, first, blocks, acc, ahead)
    }
}

/// Each kernel body (`#[inline(always)]`, its const argument `$v` saying whether to
/// use VNNI) compiled twice: as `$avx2`, and as `$vnni` with AVX-512 VNNI enabled. The
/// intrinsics inline only into a function that has their features, and the copy run
/// on a CPU without AVX-512 must hold none.
///
/// # Safety
/// Each twin has its body's contract, and the `_vnni` one needs what [`vnni`] checks.
macro_rules! twins {
    ($avx2:ident, $vnni:ident <$($c:ident: $t:ty),*> ($($a:ident: $at:ty),*), $v:ident => $call:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $avx2<$(const $c: $t),*>($($a: $at),*) {
            const $v: bool = false;
            // SAFETY: the body's contract is the caller's.
            unsafe { $call }
        }
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn $vnni<$(const $c: $t),*>($($a: $at),*) {
            const $v: bool = true;
            // SAFETY: the body's contract is the caller's.
            unsafe { $call }
        }
    };
}

twins!(k_one, k_one_vnni<FIVE: bool, PRE: bool, R: usize>
    (src: Src, xq: &QActs, first: usize, blocks: usize, out: &mut [[f32; GROUP]; TILE]),
    V => k_tiled::<V, FIVE, PRE, 1, R>([src], xq, first, blocks, std::array::from_mut(out), Ahead::NONE));
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
twins!(tq2_0, tq2_0_vnni<ONE: bool, R: usize>
    (src: Src, xq: &QActs, first: usize, blocks: usize, out: &mut [[f32; GROUP]; TILE]),
    V => tq2::<V, ONE, R>(src, xq, first, blocks, out));
twins!(tq1_0, tq1_0_vnni<R: usize>
    (src: Src, xq: &QActs, first: usize, blocks: usize, out: &mut [[f32; GROUP]; TILE]),
    V => tq1::<V, R>(src, xq, first, blocks, out));
twins!(q8_0, q8_0_vnni<F: u8, PRE: bool, R: usize>
    (src: Src, xq: &QActs, first: usize, blocks: usize, out: &mut [[f32; GROUP]; TILE]),
    V => q8::<V, F, PRE, R>(src, xq, first, blocks, out));
/// Two groups of a [`scaled_per_32`] format side by side, with VNNI only ([`pairs`]).
///
/// # Safety
/// As [`q8_pairs`]'s.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_two_vnni<const F: u8, const PRE: bool, const R: usize>(
    src: [Src; 2],
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[[f32; GROUP]; TILE]; 2],
) {
    unsafe { q8_pairs::<F, PRE, 2, 1, R>(src, xq, first, blocks, out) }
}

/// Four groups of a [`scaled_per_32`] format, two pairs side by side, with VNNI only ([`quads`]).
///
/// # Safety
/// As [`q8_pairs`]'s.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_four_vnni<const F: u8, const PRE: bool, const R: usize>(
    src: [Src; 4],
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[[f32; GROUP]; TILE]; 4],
) {
    unsafe { q8_pairs::<F, PRE, 4, 2, R>(src, xq, first, blocks, out) }
}

/// Two groups of TQ2_0 (TQ1_0's decoded ahead with `ONE`) side by side, with VNNI only ([`pairs`]).
///
/// # Safety
/// As [`tq2_two`]'s, and what [`vnni`] checks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tq2_two_vnni<const ONE: bool, const R: usize>(
    src: [Src; 2],
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[[f32; GROUP]; TILE]; 2],
) {
    unsafe { tq2_two::<ONE, R>(src, xq, first, blocks, out) }
}

/// Four groups of Q4_K from their records, with VNNI only ([`quad`]).
///
/// # Safety
/// As [`quad`]'s.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k_four_vnni<const R: usize>(
    src: [Src; 4],
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[[f32; GROUP]; TILE]; 4],
    ahead: Ahead,
) {
    unsafe { k_tiled::<true, false, false, 4, R>(src, xq, first, blocks, out, ahead) }
}

/// Four groups of the Q6_K family side by side, with VNNI only ([`quad`]).
///
/// # Safety
/// As [`quad`]'s.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_four_vnni<const F: u8, const R: usize>(
    src: [Src; 4],
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[[f32; GROUP]; TILE]; 4],
    ahead: Ahead,
) {
    unsafe { q6_k::<true, F, true, 4, R>(src, xq, first, blocks, out, ahead) }
}

/// The formats that run on [`q8`]'s kernels ([`scaled_per_32`]), as its const argument `F`.
const F_Q8_0: u8 = 0;
const F_IQ4_NL: u8 = 1;
const F_IQ4_XS: u8 = 2;
const F_MXFP4: u8 = 3;
const F_Q4_0: u8 = 4;
const F_Q4_1: u8 = 5;
const F_Q5_0: u8 = 6;
const F_Q5_1: u8 = 7;

/// Asks for the record [`AHEAD`] bytes on from `rec` into L2: for the K-quant kernels
/// that run one group's records from memory (tiles of one to four rows; also a paired
/// format's odd group, where each tile repeats the asks, cheaply since the lines are
/// in by then). Past the end of the weights it is a hint for nothing, and reads nothing.
///
/// # Safety
/// None beyond the caller's: a prefetch reads nothing, wherever it points.
#[inline(always)]
unsafe fn ask_ahead(rec: *const u8, rec_bytes: usize) {
    crate::kernels::prefetch_lines_l2(rec.wrapping_add(AHEAD), rec_bytes)
}

/// Clears rows `..R` of each group's running sums `out`, which the K-quant kernels keep in
/// memory between blocks: in registers they crowd out a block's own sums, and a block
/// adds to them once.
#[inline(always)]
fn clear_sums<const G: usize, const R: usize>(out: &mut [[[f32; GROUP]; TILE]; G]) {
    for out in out.iter_mut() {
        out[..R].iter_mut().for_each(|row| *row = [0.0; GROUP]);
    }
}

/// Rows `..R` of a group's running sums, back in registers.
///
/// # Safety
/// AVX must be available.
#[inline(always)]
unsafe fn load_sums<const R: usize>(out: &[[f32; GROUP]; TILE]) -> [__m256; R] {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        for (acc, out) in acc.iter_mut().zip(out) {
            *acc = _mm256_loadu_ps(out.as_ptr());
        }
        acc
    }
}

/// Whether a kernel of `G` groups and `R` rows asks for each record [`AHEAD`]: one group
/// running from its records (a tile of one row only where [`one_row_asks`]). Decided once
/// per call, before its blocks.
#[inline(always)]
fn asks_ahead<const PRE: bool, const G: usize, const R: usize>() -> bool {
    !PRE && G == 1 && (R > 1 || one_row_asks())
}

/// Block `b`'s record and decoded values in each group (`rec_bytes` a record), having
/// asked for what comes next: the record [`AHEAD`] on where `asks` ([`asks_ahead`]), and
/// `ahead`'s share.
///
/// # Safety
/// `src` must hold `b + 1` records of `rec_bytes` (and decoded blocks with `PRE`).
#[inline(always)]
unsafe fn block_at<const G: usize>(
    src: &[Src; G],
    b: usize,
    rec_bytes: usize,
    asks: bool,
    ahead: &Ahead,
) -> ([*const u8; G], [*const u8; G]) {
    unsafe {
        let rec: [*const u8; G] = std::array::from_fn(|g| src[g].rec.wrapping_add(b * rec_bytes));
        let vals: [*const u8; G] = std::array::from_fn(|g| src[g].vals.wrapping_add(b * DECODED));
        if asks {
            ask_ahead(rec[0], rec_bytes);
        }
        ahead.block(b);
        (rec, vals)
    }
}

/// Four activation bytes at `x`, in every lane.
///
/// # Safety
/// AVX must be available and `x` hold four bytes.
#[inline(always)]
unsafe fn bcast(x: *const i8) -> __m256i {
    unsafe { _mm256_set1_epi32(x.cast::<i32>().read_unaligned()) }
}

/// # Safety
/// AVX must be available.
#[inline(always)]
unsafe fn store<const R: usize>(acc: &[__m256; R], out: &mut [[f32; GROUP]; TILE]) {
    unsafe {
        for (out, acc) in out.iter_mut().zip(acc) {
            _mm256_storeu_ps(out.as_mut_ptr(), *acc);
        }
    }
}

/// Adds a block's activation-scaled sums `blk` of the tile's rows, times the eight
/// rows' weight scales (the first f16 field of the record at `rec`), to `acc`.
///
/// # Safety
/// AVX, FMA and F16C must be available and `rec` hold a record's first 16 bytes.
#[inline(always)]
unsafe fn weigh<const R: usize>(rec: *const u8, blk: &[__m256; R], acc: &mut [__m256; R]) {
    unsafe {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(rec.cast()));
        for (acc, &blk) in acc.iter_mut().zip(blk) {
            *acc = _mm256_fmadd_ps(dw, blk, *acc);
        }
    }
}

/// A lane's 8-bit value at `p` (one per row) as the i16 pair `(v, v)`: `madd` with it
/// multiplies both halves of a `maddubs` result by the row's scale. The eight bytes
/// are broadcast by the load and placed by one byte shuffle (in the high byte of each
/// i16, then shifted down with their sign, when `SIGNED`).
///
/// # Safety
/// AVX2 must be available and `p` hold eight bytes.
#[inline(always)]
unsafe fn scale_pairs<const SIGNED: bool>(p: *const u8) -> __m256i {
    unsafe {
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
}
