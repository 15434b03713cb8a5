//! Which kernel each interleaved format runs on: the flags the driver and the kernels
//! branch on, and what `weft bench` reports of them.

use super::*;
use crate::kernels::quant::{IQ4_VALUES, MXFP4_VALUES};

/// Whether the kernels run their AVX-512 VNNI copies (same results, bit for bit).
pub fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx2::vnni();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether `dtype` has an interleaved kernel: every block format does.
pub fn supports(dtype: GgmlType) -> bool {
    crate::kernels::quant::BLOCK_FORMATS.contains(&dtype)
}

/// Whether `dtype` is a K-quant whose values [`decode`] can decode (on AVX2).
pub(super) fn k_quant(dtype: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        return matches!(dtype, GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K);
    }
    false
}

/// Whether [`decode`] can decode `dtype`'s values (on AVX2): the K-quants' to a byte
/// each, TQ1_0's base-3 digits to TQ2_0's codes, the [`lookup`] formats' indices to
/// their signed values (offset by 128, as `vpdpbusd` takes them).
pub(super) fn decodable(dtype: GgmlType) -> bool {
    k_quant(dtype) || (dtype == GgmlType::Tq1_0 || lookup(dtype)) && crate::kernels::matmul::avx2::available()
}

/// Whether `dtype`'s values are 4-bit indices into a table of signed bytes ([`table`]):
/// IQ4_NL's, IQ4_XS's and MXFP4's.
pub(super) fn lookup(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Iq4Nl | GgmlType::Iq4Xs | GgmlType::Mxfp4)
}

/// The sixteen values a [`lookup`] format's indices stand for.
pub(super) fn table(dtype: GgmlType) -> &'static [i8; 16] {
    if dtype == GgmlType::Mxfp4 {
        &MXFP4_VALUES
    } else {
        &IQ4_VALUES
    }
}

/// Bytes of one block of `dtype`'s values [`decode`]d, for the group's rows: a byte a
/// value, except TQ1_0's codes (four a byte, as TQ2_0's).
pub(super) fn decoded_bytes(dtype: GgmlType) -> usize {
    if dtype == GgmlType::Tq1_0 {
        DECODED_TQ1
    } else {
        dtype.block().0 * GROUP
    }
}

/// Whether `dtype`'s values are decoded once per chunk of groups ([`decode`]) when enough
/// rows run over them ([`decode_from`]): the K-quants, whose bit unpacking would
/// otherwise be repeated for every tile (Q6_K's costs a vector operation per `maddubs`
/// at four rows), TQ1_0, whose base-3 digits cost six per 32 values (decoded, they run
/// TQ2_0's kernel), and with VNNI the [`lookup`] formats, whose shift, mask, shuffle and
/// offset per chunk cost nearly as much as the four `vpdpbusd` it feeds (without VNNI,
/// against a `sign`, a `maddubs` and a `madd` a row, decoding gained nothing). Not Q4_K
/// with VNNI, whose paired kernel masks the nibbles in place, an `and` per chunk against
/// 16 `vpdpbusd` ([`avx2::k_block_vnni`]).
pub(super) fn decodes(dtype: GgmlType) -> bool {
    decodable(dtype)
        && match dtype {
            GgmlType::Q4K => !vnni(),
            _ if lookup(dtype) => vnni(),
            _ => true,
        }
}

/// The fewest activation rows at which the driver decodes `dtype`'s values ahead
/// ([`decodes`]): more than one tile, and 32 for the [`lookup`] formats, whose decoded
/// values, twice their indices' bytes, every tile reads again. IQ4_XS on the Xeon, decoded
/// against looked up in one process, alternating: 32 rows 0.98–1.04×, 48 rows 1.13×, 64
/// rows 1.17–1.30×, 512 rows 1.19–1.37× (IQ4_NL 1.16×, MXFP4 1.20×); 5 and 16 rows
/// 0.6× and 0.8×, in separate runs.
pub(super) fn decode_from(dtype: GgmlType) -> usize {
    if lookup(dtype) {
        32
    } else {
        TILE + 1
    }
}

/// Whether a pair's values are decoded side by side ([`decode_pair`]): the Q6_K family's
/// and the [`lookup`] formats' with VNNI, so that one 512-bit load takes a chunk of both
/// groups, where two loads and an insert did (Q6_K, 32 rows in cache: 0.30–0.32 →
/// 0.34–0.35 of the `vpdpbusd` peak).
pub(super) fn decodes_in_pairs(dtype: GgmlType) -> bool {
    (matches!(dtype, GgmlType::Q6K | GgmlType::Q3K | GgmlType::Q2K) || lookup(dtype)) && vnni()
}

/// Whether four groups of `dtype` run together ([`quad`]) where a chunk holds them: with
/// VNNI, Q4_K, the Q6_K family, whose pairs decode side by side, and the formats that
/// [`pairs_per_32`], so that each broadcast of activations feeds two pairs'
/// `vpdpbusd`s; one broadcast per `vpdpbusd` kept the load ports busier than the
/// multiply-adds (`docs/kernels.md`).
pub(super) fn quads(dtype: GgmlType) -> bool {
    decodes_in_pairs(dtype) || dtype == GgmlType::Q4K && vnni() || pairs_per_32(dtype)
}

/// Whether two groups of `dtype` run side by side ([`pair`]) when more than one tile of
/// rows runs over them: every broadcast of activations then feeds two multiply-adds (with
/// VNNI, one 512-bit `vpdpbusd`). The ternary formats pair only with VNNI, whose 32
/// registers hold both groups' sums, as do the formats that [`pairs_per_32`].
pub(super) fn pairs(dtype: GgmlType) -> bool {
    k_quant(dtype) || ternary(dtype) && vnni() || pairs_per_32(dtype)
}

/// Whether `dtype` is [`scaled_per_32`] and pairs (with VNNI only): all but Q5_0 and
/// Q5_1, whose pairs' fifth bits, two masks joined and added per chunk, ran them at
/// 0.81–0.87× of one group at a time at 8 rows and no faster from 32.
fn pairs_per_32(dtype: GgmlType) -> bool {
    scaled_per_32(dtype) && !matches!(dtype, GgmlType::Q5_0 | GgmlType::Q5_1) && vnni()
}

/// Whether `dtype` is one of the ternary formats, which run on [`avx2::tq2`]'s kernels.
pub(super) fn ternary(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Tq2_0 | GgmlType::Tq1_0)
}

/// Whether `dtype` runs on [`avx2::q8`]'s kernels, a weight scale per 32 values: Q8_0's
/// signed bytes, the [`lookup`] formats' looked up from their indices, and the legacy
/// nibble formats' (Q5's with their fifth bits), which go in unsigned as they are, their
/// offset taken off the sum or their min added per block.
pub(super) fn scaled_per_32(dtype: GgmlType) -> bool {
    dtype == GgmlType::Q8_0 || nibbles(dtype) || lookup(dtype)
}

/// Whether `dtype` is a legacy nibble format (Q4_0, Q4_1, Q5_0, Q5_1), whose values go into
/// the kernels unsigned, as they are.
fn nibbles(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1)
}

/// The coarsest activation scales `dtype`'s kernel needs (every kernel reads coarser
/// ones): Q4_K's and Q5_K's per 256 values, so that a block's sums stay integer until
/// their activation scale; Q6_K's per 32, so that a 32-value output's two scaled halves add in
/// i32 (per 256 cost more KL divergence than it saved time), and Q3_K's and Q2_K's, which
/// run on Q6_K's kernels; the ternary formats' per row, as BitNet b1.58 was trained (their
/// kernels read any scale as coarse as per 256); the others per 16.
pub fn act_scales(dtype: GgmlType) -> ActScales {
    match dtype {
        GgmlType::Q4K | GgmlType::Q5K => ActScales::PerSuper,
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K => ActScales::PerBlock,
        GgmlType::Tq2_0 | GgmlType::Tq1_0 => ActScales::PerRow,
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

/// [`Avx2Step`] of `dtype`: the ternary formats' 256-value blocks one run of 64 chunks
/// (TQ1_0's digits decoded ahead at 32 rows); Q4_K's
/// 32-value sub-blocks are one run of eight chunks; Q5_K's
/// runs and the legacy formats' 16-value halves are four; Q6_K's 6-bit values fill an i16
/// in two (Q3_K and Q2_K run on its kernels).
pub fn avx2_step(dtype: GgmlType) -> Avx2Step {
    let (per_madd, signed) = match dtype {
        _ if nibbles(dtype) => (4, false),
        _ if scaled_per_32(dtype) => (1, true),
        GgmlType::Q4K => (8, false),
        GgmlType::Tq2_0 | GgmlType::Tq1_0 => (64, false),
        GgmlType::Q6K | GgmlType::Q3K | GgmlType::Q2K => (2, false),
        _ => (4, false),
    };
    Avx2Step { per_madd, signed }
}
