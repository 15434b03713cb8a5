//! `weft bench`: a batched-bench table like llama.cpp's `llama-batched-bench`. For each
//! batch size B, B prompts of PP tokens are prefilled in one step, then decode TG tokens
//! each in lockstep.

use crate::generate::{blocks_needed, generate_lockstep, GenRequest};
use crate::kv::KvCache;
use crate::loaded::LoadedModel;
use crate::sampling::SamplingParams;
use anyhow::{ensure, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct BenchArgs {
    /// A Hugging Face model directory or a .gguf file [default: SmolLM2-135M-Instruct, cached].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub batch_sizes: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Generated tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

pub fn run(args: BenchArgs) -> Result<()> {
    ensure!(
        args.prompt_tokens > 0 && args.gen_tokens > 1,
        "need --prompt-tokens > 0 and --gen-tokens > 1"
    );
    let pool = super::thread_pool(args.threads)?;
    let path = match args.model {
        Some(p) => p,
        None => super::model_cache::default_model()?,
    };
    let loaded = LoadedModel::open(&path)?;
    let m = &loaded.model;
    let c = &m.config;
    println!(
        "model {} ({} MB f32 weights), {} threads; PP {} TG {}",
        loaded.name,
        m.weight_bytes() / 1_000_000,
        pool.current_num_threads(),
        args.prompt_tokens,
        args.gen_tokens
    );
    println!(
        "{:>4} {:>6} {:>6} {:>10} {:>12} {:>10} {:>12}",
        "B", "PP", "TG", "PP s", "PP tok/s", "TG s", "TG tok/s"
    );
    // Fixed pseudo-random prompts: the same in every run.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % (c.vocab_size as u64 - 300) + 300) as u32
    };
    for &b in &args.batch_sizes {
        let reqs: Vec<GenRequest> = (0..b)
            .map(|_| GenRequest {
                prompt: (0..args.prompt_tokens).map(|_| next()).collect(),
                max_tokens: args.gen_tokens,
                sampling: SamplingParams::default(),
                stop_ids: Vec::new(),
            })
            .collect();
        let mut kv = KvCache::new(
            c.num_layers,
            blocks_needed(&reqs, 16),
            16,
            c.num_kv_heads,
            c.head_dim,
        );
        let (_, t) = pool.install(|| generate_lockstep(m, &mut kv, &reqs, |_, _| {}))?;
        let pp = t.prefill.as_secs_f64();
        let tg = t.decode.as_secs_f64();
        println!(
            "{:>4} {:>6} {:>6} {:>10.3} {:>12.1} {:>10.3} {:>12.1}",
            b,
            args.prompt_tokens,
            args.gen_tokens,
            pp,
            (b * args.prompt_tokens) as f64 / pp,
            tg,
            (b * t.decode_steps) as f64 / tg
        );
    }
    Ok(())
}
