//! What the quantized-product micros share: their arguments, a fixed sequence of values,
//! and running on a worker of the pool.

use weft::kernels::quant::GgmlType;
use weft::kernels::quantize::{parse_target, quantize};

/// Runs `measure` on a worker of a thread pool, as the engine's loop runs: a caller from
/// outside would wait for each product's end on a latch and be woken, a cost the engine
/// does not pay.
pub fn on_pool(measure: impl FnOnce() + Send) {
    rayon::ThreadPoolBuilder::new().build().expect("a thread pool").install(measure)
}

/// The command line: a block format, then numbers.
pub struct Args(Vec<String>);

pub fn args() -> Args {
    Args(std::env::args().skip(1).collect())
}

impl Args {
    /// The first argument's block format (default Q4_K): one that weft quantizes to, or
    /// Q2_K, Q3_K or MXFP4 ([`Values::weights`]).
    pub fn dtype(&self) -> GgmlType {
        let name = self.0.first().map_or("q4_k", String::as_str);
        match name.parse::<GgmlType>() {
            Ok(t @ (GgmlType::Q2K | GgmlType::Q3K | GgmlType::Mxfp4)) => t,
            _ => parse_target(name).expect("a block format"),
        }
    }

    /// Argument `i` as a number, or `default`.
    pub fn number(&self, i: usize, default: usize) -> usize {
        self.0.get(i).map_or(default, |a| a.parse().expect("a number"))
    }
}

/// Values in [-0.5, 0.5) from a fixed xorshift sequence: the same weights and activations
/// in every build compared.
pub struct Values(u64);

pub fn values() -> Values {
    Values(0x9E37_79B9_7F4A_7C15)
}

impl Values {
    pub fn next(&mut self) -> f32 {
        let s = &mut self.0;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        (*s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }

    /// `n × k` weights of roughly a trained model's spread in `dtype`'s blocks: quantized
    /// from the sequence's values, or, for Q2_K, Q3_K and MXFP4 (which weft reads but does
    /// not write), records of bytes from the sequence with their scales set to 1/64.
    pub fn weights(&mut self, dtype: GgmlType, n: usize, k: usize) -> Vec<u8> {
        // Each record's scale bytes and 1/64 in their form (Q2_K: `d` and `dmin` in f16;
        // Q3_K: `d`; MXFP4: its E8M0 exponent, `2^(e − 128)` as weft halves it).
        let f16 = half::f16::from_f32(1.0 / 64.0).to_le_bytes();
        let (scales, scale): (std::ops::Range<usize>, &[u8]) = match dtype {
            GgmlType::Q2K => (80..84, &f16),
            GgmlType::Q3K => (108..110, &f16),
            GgmlType::Mxfp4 => (0..1, &[122]),
            _ => return quantize(dtype, &(0..n * k).map(|_| self.next() * 0.1).collect::<Vec<_>>()),
        };
        let (per_block, record) = dtype.block();
        let mut bytes: Vec<u8> = (0..n * k / per_block * record).map(|_| (self.next() * 256.0) as i32 as u8).collect();
        for rec in bytes.chunks_exact_mut(record) {
            rec[scales.clone()].chunks_exact_mut(scale.len()).for_each(|s| s.copy_from_slice(scale));
        }
        bytes
    }
}
