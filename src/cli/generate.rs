//! `weft generate`: one prompt through the engine, text streamed to stdout, statistics to
//! stderr.

use super::EngineArgs;
use crate::engine::{Event, Request};
use anyhow::{bail, Result};
use clap::Args;
use std::io::{IsTerminal, Write};
use std::time::Instant;

#[derive(Args)]
pub struct GenerateArgs {
    /// The prompt text.
    pub prompt: String,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Seed for sampling (random when absent).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let engine = args.engine.start()?;
    let tok = &engine.model().tokenizer;
    let prompt = tok.encode(&args.prompt)?;
    let n_prompt = prompt.len();
    let mut req = Request::new(prompt, args.max_tokens);
    req.sampling.temperature = args.temperature;
    req.sampling.seed = args.seed;
    req.stop.ignore_eos = args.ignore_eos;
    let start = Instant::now();
    let mut stream = engine.submit(req)?;
    let mut stdout = std::io::stdout().lock();
    let (mut first, mut n, mut finish) = (None, 0usize, None);
    while let Some(ev) = stream.blocking_recv() {
        match ev {
            Event::Token { text, .. } => {
                first.get_or_insert_with(Instant::now);
                n += 1;
                stdout.write_all(text.as_bytes())?;
                stdout.flush()?;
            }
            Event::Finished { reason, text, .. } => {
                stdout.write_all(text.as_bytes())?;
                finish = Some(reason);
            }
            Event::Error { message } => bail!(message),
            Event::PromptLogprobs { .. } | Event::Embedding { .. } => {}
        }
    }
    stdout.flush()?;
    let end = Instant::now();
    // stdout is exactly the generated text; on a terminal the statistics start on a line of
    // their own.
    if stdout.is_terminal() {
        eprintln!();
    }
    let ttft = first.map_or(0.0, |f| (f - start).as_secs_f64());
    let decode = first.map_or(0.0, |f| (end - f).as_secs_f64());
    eprintln!(
        "weft: prompt {n_prompt} tokens in {:.1} ms ({:.1} tokens/s); generated {n} tokens, decode {:.1} tokens/s; finish {}",
        ttft * 1e3,
        n_prompt as f64 / ttft.max(1e-9),
        n.saturating_sub(1) as f64 / decode.max(1e-9),
        finish.map_or("none", |r| r.as_str()),
    );
    Ok(())
}
