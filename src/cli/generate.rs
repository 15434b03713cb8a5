//! `weft generate`: one prompt, generated text streamed to stdout, statistics to stderr.

use crate::generate::{blocks_needed, generate_lockstep, GenRequest};
use crate::kv::KvCache;
use crate::loaded::LoadedModel;
use crate::sampling::SamplingParams;
use crate::tokenizer::Detokenizer;
use anyhow::{bail, Result};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

const BLOCK_SIZE: usize = 16;

#[derive(Args)]
pub struct GenerateArgs {
    /// The prompt text.
    pub prompt: String,
    /// A Hugging Face model directory or a .gguf file [default: SmolLM2-135M-Instruct, cached].
    #[arg(long)]
    pub model: Option<PathBuf>,
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
    /// Worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let pool = super::thread_pool(args.threads)?;
    let path = match args.model {
        Some(p) => p,
        None => super::model_cache::default_model()?,
    };
    let t0 = Instant::now();
    let loaded = LoadedModel::open(&path)?;
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    eprintln!(
        "weft: loaded {} in {:.2} s ({} MB of f32 weights, {} threads)",
        loaded.name,
        t0.elapsed().as_secs_f64(),
        model.weight_bytes() / 1_000_000,
        pool.current_num_threads()
    );
    let prompt = tok.encode(&args.prompt)?;
    if prompt.is_empty() {
        bail!("empty prompt: this model adds no BOS token, so there is nothing to continue from");
    }
    let req = GenRequest {
        prompt: prompt.clone(),
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            seed: args.seed,
        },
        stop_ids: if args.ignore_eos {
            Vec::new()
        } else {
            tok.eos_ids.clone()
        },
    };
    let mut kv = KvCache::new(
        model.config.num_layers,
        blocks_needed(std::slice::from_ref(&req), BLOCK_SIZE),
        BLOCK_SIZE,
        model.config.num_kv_heads,
        model.config.head_dim,
    );
    let mut detok = Detokenizer::new(&prompt, true);
    let mut stdout = std::io::stdout();
    let mut io_err = None;
    let (outs, timings) = pool.install(|| {
        generate_lockstep(model, &mut kv, std::slice::from_ref(&req), |_, id| {
            if req.stop_ids.contains(&id) {
                return;
            }
            let piece = detok.push(tok, id).unwrap_or_default();
            if let Err(e) = stdout
                .write_all(piece.as_bytes())
                .and_then(|_| stdout.flush())
            {
                io_err.get_or_insert(e);
            }
        })
    })?;
    let mut stdout = stdout.lock();
    write!(stdout, "{}", detok.flush(tok)?)?;
    writeln!(stdout)?;
    if let Some(e) = io_err {
        return Err(e.into());
    }
    let n = outs[0].tokens.len();
    eprintln!(
        "weft: prompt {} tokens in {:.1} ms ({:.1} tokens/s); generated {n} tokens, decode {:.1} tokens/s; finish {:?}",
        prompt.len(),
        timings.prefill.as_secs_f64() * 1e3,
        prompt.len() as f64 / timings.prefill.as_secs_f64(),
        timings.decode_steps as f64 / timings.decode.as_secs_f64().max(1e-9),
        outs[0].finish,
    );
    Ok(())
}
