//! A mixture layer's expert products alone, as a 32-stream decode step runs them: `E`
//! experts of `[N, K]` in FORMAT, each its own allocation, `ROWS` rows routed to each,
//! all in one `qmatmul_each` (one pass over the pool); the same products one after another,
//! as a dense model's layers take their matrices; one matrix of the same bytes (`[E·N, K]`)
//! at the same rows; and a streaming read (`weft bench`'s): how close the scattered reads
//! come to streaming. Prints medians of the rounds in GB/s of weights read.
//!
//! `cargo run --release --example experts -- FORMAT E N K ROWS [ROUNDS]`, for example
//! `q4_k 112 1536 2048 2` (Qwen3-30B-A3B's gate and up at 32 streams) or
//! `q4_k 64 2048 2048 1` (one stream through 2048-square matrices, colder than the caches).

use std::borrow::Cow;
use std::time::Instant;
use weft::kernels::qmatmul::{qmatmul, qmatmul_each, Product, QActs, QMatrix};

mod common;

fn main() {
    common::on_pool(measure);
}

fn measure() {
    let args = common::args();
    let dtype = args.dtype();
    let (experts, n, k, rows, rounds) =
        (args.number(1, 112), args.number(2, 1536), args.number(3, 2048), args.number(4, 2), args.number(5, 9));

    // Weights and activations of roughly a trained model's spread.
    let mut values = common::values();
    // One expert's bytes, copied into each: the same arithmetic, separate memory.
    let bytes = values.weights(dtype, n, k);
    let mats: Vec<QMatrix> = (0..experts)
        .map(|_| QMatrix::new(k, vec![(dtype, n, Cow::Borrowed(&bytes[..]))]).expect("a whole matrix"))
        .collect();
    let stacked = QMatrix::new(k, vec![(dtype, n * experts, Cow::Owned(bytes.repeat(experts)))]).expect("whole");
    let x: Vec<f32> = (0..rows * k).map(|_| values.next()).collect();
    let mut xq = QActs::default();
    mats[0].quantize(&x, rows, &mut xq);
    let mut ys = vec![vec![0f32; rows * n]; experts];
    let mut y = vec![0f32; rows * n * experts];
    let weight_bytes = (mats[0].bytes() * experts) as f64;

    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut each, mut serial, mut one, mut read) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let started = Instant::now();
        let mut products: Vec<Product<'_>> =
            mats.iter().zip(ys.iter_mut()).map(|(w, y)| Product { xq: &xq, w, y, m: rows }).collect();
        qmatmul_each(&mut products);
        each.push(weight_bytes / started.elapsed().as_secs_f64() / 1e9);

        let started = Instant::now();
        for (w, y) in mats.iter().zip(ys.iter_mut()) {
            qmatmul(&xq, w, y, rows);
        }
        serial.push(weight_bytes / started.elapsed().as_secs_f64() / 1e9);

        let started = Instant::now();
        qmatmul(&xq, &stacked, &mut y, rows);
        one.push(weight_bytes / started.elapsed().as_secs_f64() / 1e9);

        read.push(weft::cli::machine::read_bandwidth());
    }
    println!(
        "{dtype:?} {experts} x [{n}, {k}], {rows} rows each, {:.0} MB: at once {:.1} GB/s, \
         one after another {:.1}, one stacked matrix {:.1}, a streaming read {:.1}",
        weight_bytes / 1e6,
        median(each),
        median(serial),
        median(one),
        median(read)
    );
}
