//! `weft bench`: throughput of the engine, measured in one run.
//! - A batched table like llama.cpp's `llama-batched-bench`: for each batch size B, B
//!   prompts of PP tokens enter at once, then each decodes TG tokens.
//! - A serving run on a mixed workload (seeded prompt and output lengths, Poisson arrivals
//!   or all at once): continuous batching against one request at a time through the same
//!   engine, with throughput, TTFT and inter-token latency percentiles and the speedup.
//! - A shared-system-prompt run (one long prefix, many short questions, a few clients at a
//!   time): prefix caching on against off, with TTFT, throughput and whether the greedy
//!   outputs are identical.
//! - With `--speculative-config`, speculative decoding on against off: one stream on an
//!   input-grounded task (rewriting a paragraph, a code edit, proofreading) and on free generation, then
//!   2 to 32 streams at once; decode speed, acceptance rate, draft tokens per output
//!   token (where speculation backs off), and whether the outputs are identical.
//! - With `--llama-cpp`, llama.cpp's own benchmarks on the same GGUF file beside each batch
//!   size of the table, alternated with weft's runs (`--pairs`), and weft's speed against
//!   them (`cli/peer.rs`).

mod batched;
mod limits;
mod measure;
mod serve;
mod serving;
mod shared_prefix;
mod speculative;

use super::EngineArgs;
use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub against: Option<BenchTarget>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Batch sizes for the batched table (0: skip it).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub batch_sizes: Vec<usize>,
    /// Prompt tokens per sequence in the batched table.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Generated tokens per sequence in the batched table.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// A llama.cpp build's `bin` folder: each batch size of the table then also runs
    /// llama.cpp's own benchmark on the same GGUF file and threads (`llama-bench`'s `tg` and
    /// `pp` at B=1, `llama-batched-bench` above), and prints weft's speed against it.
    #[arg(long, value_name = "DIR")]
    pub llama_cpp: Option<PathBuf>,
    /// Alternated runs of weft and llama.cpp per batch size, with `--llama-cpp`: a machine
    /// whose speed drifts shifts both sides of a pair alike, so each pair gives a ratio and
    /// the median is reported.
    #[arg(long, default_value_t = 1, requires = "llama_cpp")]
    pub pairs: usize,
    /// Requests in the serving run (0: skip it).
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Prompt lengths of the serving run, MIN:MAX tokens, uniform (default: the chat mix
    /// of `workloads/chat-mix.json`, short turns to documents, as the CI soak sends).
    #[arg(long, value_parser = measure::parse_range, requires = "output_len")]
    pub prompt_len: Option<(usize, usize)>,
    /// Output lengths of the serving run, MIN:MAX tokens, uniform (with `--prompt-len`).
    #[arg(long, value_parser = measure::parse_range, requires = "prompt_len")]
    pub output_len: Option<(usize, usize)>,
    /// Poisson arrival rate in requests/s (0: all at once).
    #[arg(long, default_value_t = 0.0)]
    pub request_rate: f64,
    /// Requests in the shared-system-prompt run (0: skip it).
    #[arg(long, default_value_t = 64)]
    pub shared_requests: usize,
    /// Tokens of the system prompt every request of that run shares.
    #[arg(long, default_value_t = 1000)]
    pub shared_prefix: usize,
    /// Tokens of each request's own question after it.
    #[arg(long, default_value_t = 30)]
    pub shared_question: usize,
    /// Output tokens per request of that run.
    #[arg(long, default_value_t = 64)]
    pub shared_output: usize,
    /// Concurrent clients in that run.
    #[arg(long, default_value_t = 8)]
    pub shared_concurrency: usize,
    /// Seed for the workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an SVG plot here (default: next to --json, with .svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(clap::Subcommand)]
pub enum BenchTarget {
    /// Load-test a running OpenAI-compatible server over HTTP.
    Serve(serve::BenchServeArgs),
}

pub fn run(args: BenchArgs) -> Result<()> {
    if let Some(BenchTarget::Serve(a)) = args.against {
        return serve::run(a);
    }
    let engine = args.engine.start()?;
    let model: Arc<crate::loaded::LoadedModel> = engine.model_arc();
    drop(engine);
    let base = args.engine.config();
    let threads = crate::engine::thread_pool(base.threads)?.current_num_threads();
    println!(
        "model {} ({}, {:?}; {} KV cache), {threads} threads",
        model.name,
        model.model.weights_summary(),
        args.engine.dtype,
        model.model.kv_dtype(base.kv_cache_dtype)
    );
    let mut rng = measure::Rng(args.seed ^ 0x9E37_79B9_7F4A_7C15);
    let mut report = json!({"model": model.name, "threads": threads});
    batched::run(&args, &model, &base, threads, &mut rng, &mut report)?;
    if args.requests > 0 {
        report["serving"] = serving::run(&args, &model, &base)?;
    }
    if args.shared_requests > 0 {
        report["shared_prefix"] = shared_prefix::shared_prefix_run(&args, &model, base.clone())?;
    }

    if let Some(spec) = &base.speculative {
        report["speculative"] = speculative::speculative_run(&model, &base, spec)?;
    }

    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("\nwrote {}", path.display());
    }
    let plot = args.plot.clone().or_else(|| args.json.as_ref().map(|j| j.with_extension("svg")));
    if let Some(path) = plot {
        std::fs::write(&path, super::plot::svg(&report)).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
