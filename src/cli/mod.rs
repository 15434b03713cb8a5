//! The `weft` command line.

pub mod bench;
pub mod generate;
pub mod model_cache;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "weft",
    version,
    about = "A continuous-batching LLM inference engine"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Generate a continuation of one prompt, streamed to stdout.
    Generate(generate::GenerateArgs),
    /// Measure prompt and decode throughput at several batch sizes.
    Bench(bench::BenchArgs),
}

/// Runs the command line; returns the process exit code.
pub fn run() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
    }
}

/// A rayon pool of `threads` workers (0: one per core) that all model work runs inside.
pub fn thread_pool(threads: usize) -> anyhow::Result<rayon::ThreadPool> {
    let mut b = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("weft-worker-{i}"));
    if threads > 0 {
        b = b.num_threads(threads);
    }
    Ok(b.build()?)
}
