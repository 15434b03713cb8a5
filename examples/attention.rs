//! One decode step's attention alone, as the engine runs it: a Llama-3.2-1B-shaped cache
//! (16 layers, 8 kv heads of 64 dims, 32 query heads, blocks of 16 positions, f16 pools in
//! huge pages, or int8 with a scale per row), one task per sequence (`all`) or per sequence and kv head (`per-head`,
//! as a step of few rows splits them), on the worker threads. Prints the median time of
//! twelve steps and the bytes of K and V it read a second, beside a plain read of the same
//! pools.
//!
//! `cargo run --release --example attention -- SEQUENCES POSITIONS [consecutive|shuffled|cached] [all|per-head] [f16|int8]`
//!
//! `consecutive`: each sequence's blocks side by side, as prompts prefilled in chunks get
//! them; `shuffled`: blocks anywhere in the pool; `cached`: every position on one of four
//! blocks, so that nothing waits on memory (the arithmetic alone).

use rayon::prelude::*;
use std::time::Instant;
use weft::kernels::attention::{attend, KvSpan, PagedKv, Pools, RowScales, Scoring, Scratch};
use weft::kernels::buffer::Buf;

const LAYERS: usize = 16;
const KV_HEADS: usize = 8;
const HEADS: usize = 32;
const HEAD_DIM: usize = 64;
const BLOCK: usize = 16;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize, default: usize| args.get(i).map_or(default, |a| a.parse().expect("a number"));
    let (seqs, positions) = (number(0, 32), number(1, 900));
    let layout = args.get(2).map_or("consecutive", String::as_str);
    let per_head = args.get(3).is_some_and(|a| a == "per-head");
    let int8 = args.get(4).is_some_and(|a| a == "int8");
    assert!(seqs > 0 && positions > 0, "at least one sequence of one position");

    let per_seq = positions.div_ceil(BLOCK);
    let blocks = seqs * per_seq;
    let slab = KV_HEADS * BLOCK * HEAD_DIM;
    let fill = |seed: usize| {
        let mut pool = Buf::<u16>::zeroed(blocks * slab);
        for (i, x) in pool.iter_mut().enumerate() {
            *x = half::f16::from_f32(((i * seed) % 1000) as f32 / 1000.0 - 0.5).to_bits();
        }
        pool
    };
    let pools: Vec<(Buf<u16>, Buf<u16>)> = (0..LAYERS).map(|_| (fill(7919), fill(104_729))).collect();
    // The int8 pools: the f16 values' low bytes, each row over a scale of 1/127.
    let narrow = |pool: &Buf<u16>| {
        let mut out = Buf::<i8>::zeroed(pool.len());
        out.iter_mut().zip(pool.iter()).for_each(|(o, &x)| *o = x as i8);
        out
    };
    let int8_pools: Vec<(Buf<i8>, Buf<i8>)> =
        if int8 { pools.iter().map(|(k, v)| (narrow(k), narrow(v))).collect() } else { Vec::new() };
    let row_scales = vec![1.0f32 / 127.0; blocks * KV_HEADS * BLOCK];

    let mut ids: Vec<u32> = (0..blocks as u32).collect();
    match layout {
        "consecutive" => {}
        "shuffled" => {
            let mut s = 12_345u64;
            for i in (1..ids.len()).rev() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ids.swap(i, (s % (i as u64 + 1)) as usize);
            }
        }
        "cached" => ids.iter_mut().for_each(|b| *b %= 4),
        other => panic!("unknown layout {other:?}: consecutive, shuffled or cached"),
    }
    let tables: Vec<&[u32]> = ids.chunks(per_seq).collect();

    let started = Instant::now();
    let sum: u64 = pools.par_iter().map(|(k, _)| k.iter().step_by(32).map(|&x| u64::from(x)).sum::<u64>()).sum();
    let read = (LAYERS * blocks * slab * 2) as f64 / started.elapsed().as_secs_f64() / 1e9;

    let q: Vec<f32> = (0..seqs * HEADS * HEAD_DIM).map(|i| ((i * 31) % 100) as f32 / 100.0 - 0.5).collect();
    let mut out = vec![0f32; q.len()];
    let scoring = Scoring { scale: 1.0 / (HEAD_DIM as f32).sqrt(), softcap: None, sinks: None };
    let task_heads = if per_head { 1 } else { KV_HEADS };
    let width = HEADS / KV_HEADS * HEAD_DIM * task_heads;
    let mut times: Vec<f64> = (0..12)
        .map(|_| {
            let started = Instant::now();
            for layer in 0..LAYERS {
                let pools = match int8_pools.get(layer) {
                    Some((k, v)) => Pools::Int8 { k, v, scales: RowScales { k: &row_scales, v: &row_scales } },
                    None => Pools::F16 { k: &pools[layer].0, v: &pools[layer].1 },
                };
                let view = PagedKv::new(pools, BLOCK, KV_HEADS, HEAD_DIM);
                out.par_chunks_mut(width).enumerate().for_each_init(Scratch::default, |scratch, (i, out)| {
                    let (s, first) = (i / (KV_HEADS / task_heads), i % (KV_HEADS / task_heads) * task_heads);
                    let span = KvSpan { block_table: tables[s], first_pos: 0, last_pos: positions - 1 };
                    attend(&q[i * width..][..width], view.heads(first, task_heads), span, scoring, scratch, out);
                });
            }
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let element = if int8 { 1 } else { 2 };
    let bytes = (seqs * positions * KV_HEADS * HEAD_DIM * element * 2 * LAYERS) as f64;
    println!(
        "{seqs} sequences × {positions} positions, {layout}, {}, {} tasks: {:.2} ms a step (fastest {:.2}), \
         {:.1} GB/s of K and V; a plain read of the pools {read:.1} GB/s (checks {sum}, {:.4})",
        if int8 { "int8" } else { "f16" },
        if per_head { "per-head" } else { "whole-sequence" },
        times[6],
        times[0],
        bytes / times[6] / 1e6,
        out.iter().sum::<f32>(),
    );
}
