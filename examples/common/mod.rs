//! What the quantized-product micros share: their arguments, a fixed sequence of values,
//! and running on a worker of the pool.

use weft::kernels::quant::GgmlType;
use weft::kernels::quantize::parse_target;

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
    /// The first argument's block format (default Q4_K).
    pub fn dtype(&self) -> GgmlType {
        parse_target(self.0.first().map_or("q4_k", String::as_str)).expect("a block format")
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
}
