//! One quantized matrix product alone, as the engine runs it on the worker threads: a
//! random `[N, K]` weight quantized to FORMAT and repacked, `M` activation rows. Prints the
//! median of the rounds in G products a second and as a share of the machine's int8 peak
//! (`weft bench`'s ceiling), the weights read a second against a streaming read (for
//! matrices larger than the caches), and a checksum of the result, so that two builds
//! can be compared for speed and for bits.
//!
//! `cargo run --release --example qmatmul -- FORMAT N K M [ROUNDS]`, for example
//! `q4_k 2048 2048 32` (in cache) or `q4_k 65536 2048 1` (one row, from memory).

use std::borrow::Cow;
use std::time::Instant;
use weft::kernels::qmatmul::{qmatmul, QActs, QMatrix};

mod common;

fn main() {
    common::on_pool(measure);
}

fn measure() {
    let args = common::args();
    let dtype = args.dtype();
    let (n, k, m, rounds) = (args.number(1, 2048), args.number(2, 2048), args.number(3, 32), args.number(4, 15));

    // Weights and activations of roughly a trained model's spread.
    let mut values = common::values();
    let w = values.weights(dtype, n, k);
    let x: Vec<f32> = (0..m * k).map(|_| values.next()).collect();
    let w = QMatrix::new(k, vec![(dtype, n, Cow::Owned(w))]).expect("a whole matrix");
    let mut xq = QActs::default();
    w.quantize(&x, m, &mut xq);
    let mut y = vec![0f32; m * n];

    // Enough calls a round for about 50 G products, so a round takes some tens of ms.
    let calls = (50e9 / (n * k * m.max(1)) as f64).clamp(1.0, 10_000.0) as usize;
    let mut rates: Vec<f64> = (0..rounds)
        .map(|_| {
            let started = Instant::now();
            for _ in 0..calls {
                qmatmul(&xq, &w, &mut y, m);
            }
            (calls * n * k * m) as f64 / started.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    let median = rates[rates.len() / 2];
    let checksum = y.iter().fold(0u64, |h, v| h.rotate_left(5) ^ u64::from(v.to_bits()));
    let peak = weft::cli::machine::int8_peak();
    let share = peak.map_or(String::new(), |(gops, step)| format!(", {:.2} of the {step} peak", 2.0 * median / gops));
    // Each call reads the weights once, whatever the rows.
    let read = median / (n * k * m.max(1)) as f64 * w.bytes() as f64;
    let stream = weft::cli::machine::read_bandwidth();
    println!(
        "{dtype:?} [{n}, {k}] x {m} rows: {median:.1} G products/s (range {:.1}–{:.1}){share}; \
         weights {read:.1} GB/s, a streaming read {stream:.1}; checksum {checksum:016x}",
        rates[0],
        rates[rates.len() - 1]
    );
}
