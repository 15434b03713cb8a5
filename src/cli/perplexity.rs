//! `weft perplexity`: perplexity over a text file and, with `--kl-base`, the mean KL
//! divergence and top-1 agreement of the token distributions against a base model (the
//! same file on the f32 path, say), as llama.cpp's `llama-perplexity --kl-divergence`
//! reports them. This is how quantized paths are judged.
//!
//! The text is cut into chunks of `--ctx` tokens; as in llama-perplexity, each chunk's
//! first half is context and its second half is scored. Chunks run as a batch of
//! sequences decoding in lockstep, one teacher-forced token per step.

use super::EngineArgs;
use crate::kv::{BlockAllocator, BlockTable, KvCache, KvCacheDtype};
use crate::loaded::LoadedModel;
use crate::model::{SeqStep, StepInput, WeightDtype, Workspace};
use anyhow::{ensure, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The text to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per chunk (the first half of each is context only).
    #[arg(long, default_value_t = 256)]
    pub ctx: usize,
    /// A base model to compare with (KL divergence, top-1 agreement).
    #[arg(long)]
    pub kl_base: Option<PathBuf>,
    /// How the base model's weights are computed.
    #[arg(long, default_value = "f32")]
    pub kl_base_dtype: WeightDtype,
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub scored: usize,
    pub perplexity: f64,
    /// With a base model: its perplexity, mean KL(base ‖ model) and top-1 agreement.
    pub base_perplexity: Option<f64>,
    pub mean_kld: Option<f64>,
    pub top1_agreement: Option<f64>,
}

const BLOCK: usize = 16;
/// Chunks decoded together.
const LANES: usize = 16;

/// One model's state for a batch of chunks.
struct Lane<'m> {
    model: &'m LoadedModel,
    kv: KvCache,
    tables: Vec<BlockTable>,
    ws: Workspace,
}

impl<'m> Lane<'m> {
    fn new(model: &'m LoadedModel, chunks: usize, ctx: usize, kv: KvCacheDtype) -> Self {
        let c = &model.model.config;
        let kv = KvCache::new(model.model.kv_dtype(kv), &c.kv_shapes(), chunks * ctx.div_ceil(BLOCK), BLOCK)
            .with_states(c.state_floats());
        let mut alloc = BlockAllocator::new(kv.num_blocks(), false);
        let tables = (0..chunks)
            .map(|_| {
                let mut t = BlockTable::default();
                t.reserve(&mut alloc, ctx, BLOCK).expect("sized for every chunk");
                t
            })
            .collect();
        Lane { model, kv, tables, ws: Workspace::default() }
    }

    /// Feeds token `pos` of every chunk; log-probabilities of the next token, per chunk.
    fn step(&mut self, chunks: &[&[u32]], pos: usize) -> Vec<Vec<f64>> {
        let tokens: Vec<u32> = chunks.iter().map(|c| c[pos]).collect();
        let seqs: Vec<SeqStep> = (self.tables.iter().enumerate())
            .map(|(i, t)| SeqStep { state_slot: i, ..SeqStep::sampled(pos, 1, t.blocks()) })
            .collect();
        let logits = self.model.model.forward(&StepInput { tokens: &tokens, seqs: &seqs }, &mut self.kv, &mut self.ws);
        logits.chunks_exact(self.model.model.config.vocab_size).map(log_softmax).collect()
    }
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    x.iter().map(|&v| v as f64 - lse).collect()
}

fn argmax(x: &[f64]) -> usize {
    x.iter().enumerate().fold(0, |best, (i, &v)| if v > x[best] { i } else { best })
}

/// Scores `tokens` with `model` (and compares with `base`), in chunks of `ctx`.
pub fn evaluate(
    model: &LoadedModel,
    base: Option<&LoadedModel>,
    tokens: &[u32],
    ctx: usize,
    kv: KvCacheDtype,
) -> Result<Report> {
    ensure!(ctx >= 4, "--ctx must be at least 4");
    ensure!(
        ctx <= model.model.config.max_position_embeddings,
        "--ctx {ctx} is over the model's context of {}",
        model.model.config.max_position_embeddings
    );
    if let Some(b) = base {
        ensure!(b.model.config.vocab_size == model.model.config.vocab_size, "the base model has another vocabulary");
    }
    let chunks: Vec<&[u32]> = tokens.chunks_exact(ctx).collect();
    ensure!(!chunks.is_empty(), "the text has {} tokens, less than one chunk of {ctx}", tokens.len());
    let (mut nll, mut base_nll, mut kld, mut agree, mut scored) = (0f64, 0f64, 0f64, 0usize, 0usize);
    for group in chunks.chunks(LANES) {
        let mut lane = Lane::new(model, group.len(), ctx, kv);
        // The base is the reference: its cache as its weights ask (f32 for float weights).
        let mut base_lane = base.map(|b| Lane::new(b, group.len(), ctx, KvCacheDtype::Auto));
        for pos in 0..ctx - 1 {
            let lp = lane.step(group, pos);
            let blp = base_lane.as_mut().map(|l| l.step(group, pos));
            if pos + 1 < ctx / 2 {
                continue;
            }
            for (i, chunk) in group.iter().enumerate() {
                let target = chunk[pos + 1] as usize;
                nll -= lp[i][target];
                if let Some(b) = &blp {
                    base_nll -= b[i][target];
                    kld += b[i].iter().zip(&lp[i]).map(|(p, q)| p.exp() * (p - q)).sum::<f64>();
                    agree += (argmax(&b[i]) == argmax(&lp[i])) as usize;
                }
                scored += 1;
            }
        }
    }
    let n = scored as f64;
    Ok(Report {
        scored,
        perplexity: (nll / n).exp(),
        base_perplexity: base.map(|_| (base_nll / n).exp()),
        mean_kld: base.map(|_| kld / n),
        top1_agreement: base.map(|_| agree as f64 / n),
    })
}

pub fn run(args: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let model = args.engine.load()?;
    let base = match &args.kl_base {
        Some(p) => Some(LoadedModel::open(p, args.kl_base_dtype)?),
        None => None,
    };
    let tokens = model.tokenizer.encode(&text)?;
    let pool = crate::engine::thread_pool(args.engine.threads)?;
    let t0 = Instant::now();
    let r = pool.install(|| evaluate(&model, base.as_ref(), &tokens, args.ctx, args.engine.kv_cache_dtype))?;
    println!(
        "{} tokens scored in {:.1} s (chunks of {}, second halves): perplexity {:.4}",
        r.scored,
        t0.elapsed().as_secs_f64(),
        args.ctx,
        r.perplexity
    );
    if let (Some(bp), Some(kld), Some(top1)) = (r.base_perplexity, r.mean_kld, r.top1_agreement) {
        println!(
            "base: perplexity {bp:.4} ({:+.2}% for this model), mean KL divergence {kld:.5}, top-1 agreement {:.2}%",
            (r.perplexity / bp - 1.0) * 100.0,
            top1 * 100.0
        );
    }
    Ok(())
}
