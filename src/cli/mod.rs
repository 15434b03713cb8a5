//! The `weft` command line.

pub mod batch;
pub mod bench;
mod export_tokenizer;
pub mod generate;
pub mod machine;
pub mod model_cache;
mod peer;
pub mod perplexity;
mod plot;
mod quantize;
mod serve;
mod workload;

use crate::engine::{EngineConfig, EngineHandle, RequestLimits};
use crate::loaded::LoadedModel;
use crate::model::WeightDtype;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(name = "weft", version, about = "A continuous-batching LLM inference engine")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Serve the OpenAI-compatible and native HTTP API.
    Serve(serve::ServeArgs),
    /// Generate a continuation of one prompt, streamed to stdout.
    Generate(generate::GenerateArgs),
    /// Run an offline JSONL batch job (OpenAI batch format) through the engine.
    Batch(batch::BatchArgs),
    /// Measure throughput: a batched table and a serving-style run.
    Bench(Box<bench::BenchArgs>),
    /// Perplexity over a text file; with --kl-base, KL divergence and top-1 agreement
    /// against a base model.
    Perplexity(perplexity::PerplexityArgs),
    /// Rewrite a GGUF file's matrices in another block format.
    Quantize(quantize::QuantizeArgs),
    /// Write the model's tokenizer, chat template and context as a Hugging Face folder, for
    /// a frontend that tokenizes itself (Dynamo's) in front of a GGUF.
    ExportTokenizer(export_tokenizer::ExportTokenizerArgs),
}

/// Runs the command line.
pub fn run() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => serve::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Batch(args) => batch::run(args),
        Command::Bench(args) => bench::run(*args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::ExportTokenizer(args) => export_tokenizer::run(args),
    }
}

/// The model and engine options every command that runs the engine takes.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// A Hugging Face model directory or a .gguf file [default: SmolLM2-135M-Instruct, cached].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Weights computed as stored (`auto`: block formats stay quantized with int8
    /// activations and 16-bit floats stay 16-bit, at most the file's size in memory; the
    /// fastest at every batch size. A 16-bit LM head beside block-format layers is computed
    /// from a Q8_0 copy, its 16 leading logits recomputed from the stored rows; `stored`
    /// computes it as stored too) or widened to f32 at load (`f32`: the exact reference
    /// path).
    #[arg(long, default_value = "auto")]
    pub dtype: WeightDtype,
    /// Quantize float matrices (f32/f16/bf16, from a Hugging Face directory or a GGUF) to
    /// this block format at load: q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, iq4_nl,
    /// iq4_xs. Block-format weights stay as stored.
    #[arg(long, value_name = "TYPE", conflicts_with = "dtype", value_parser = crate::kernels::quantize::parse_target)]
    pub quantize: Option<crate::kernels::quant::GgmlType>,
    /// Names the API serves the model under (the first is the one reported); requests
    /// naming any other model get 404 [default: the directory or file stem].
    #[arg(long, num_args = 1.., value_name = "NAME")]
    pub served_model_name: Vec<String>,
    /// A Jinja chat template file to use instead of the model's own.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Sequences per step at most (1: strictly one request at a time).
    #[arg(long, default_value_t = EngineConfig::default().max_num_seqs)]
    pub max_num_seqs: usize,
    /// Tokens per step at most; longer prompts are prefilled in chunks.
    #[arg(long, default_value_t = EngineConfig::default().max_num_batched_tokens)]
    pub max_num_batched_tokens: usize,
    /// KV cache size, in bytes or with a unit (512M, 2G).
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    pub kv_cache_memory: usize,
    /// Element type of the KV cache (`auto`: f16 for block-format weights, halving the
    /// cache's memory and the bytes decode reads from it; f32 for float weights, which then
    /// compute exactly, and for BitNet, whose int8 activations amplify f16 rounding; `int8`:
    /// each row of a head with its own scale, about a quarter of f32's memory and close to
    /// f16's accuracy; `fp8` or `fp8_e4m3`: as small, unscaled with 3 mantissa bits, as
    /// vLLM's).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: crate::kv::KvCacheDtype,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = EngineConfig::default().block_size)]
    pub block_size: usize,
    /// Sequences (prompts × n) allowed to wait for the batch before new ones are refused.
    #[arg(long, default_value_t = EngineConfig::default().max_waiting_requests)]
    pub max_waiting_requests: usize,
    /// Longest sequence (prompt + output) served, at most the model's context (0: the model's).
    #[arg(long, default_value_t = 0)]
    pub max_model_len: usize,
    /// Recompute every prompt in full instead of reusing the cached KV blocks of prefixes
    /// seen before.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Hybrid models (Qwen3.5): recurrent-state snapshots kept at block boundaries of cached
    /// prefixes, each one sequence's state [default: as many as an eighth of
    /// --kv-cache-memory holds, at most 256].
    #[arg(long)]
    pub state_snapshots: Option<usize>,
    /// Target time of a step that carries decodes, ms: prefill beside them is limited so a
    /// joining prompt cannot stall the streams [default: 3x a decode-only step, as measured].
    #[arg(long)]
    pub max_step_ms: Option<f64>,
    /// Speculative decoding, as vLLM's JSON: `{"method":"ngram","num_speculative_tokens":4,
    /// "prompt_lookup_min":2,"prompt_lookup_max":5}` or `{"method":"draft_model",
    /// "model":PATH,"num_speculative_tokens":4}` (a draft model with the same vocabulary).
    /// Drafts shrink, down to none, as the batch grows and their rows stop paying.
    #[arg(long, value_name = "JSON")]
    pub speculative_config: Option<crate::engine::speculative::SpeculativeConfig>,
    #[command(flatten)]
    pub limits: LimitArgs,
}

/// Caps on what one request may ask for; above them it gets a 400 naming the field.
#[derive(Args, Debug, Clone)]
pub struct LimitArgs {
    /// Most samples per request (`n`).
    #[arg(long, default_value_t = RequestLimits::default().max_n)]
    pub max_n: usize,
    /// Most stop strings per request.
    #[arg(long, default_value_t = RequestLimits::default().max_stop_strings)]
    pub max_stop_strings: usize,
    /// Longest stop string, bytes.
    #[arg(long, default_value_t = RequestLimits::default().max_stop_string_bytes)]
    pub max_stop_string_bytes: usize,
    /// Most `stop_token_ids` per request.
    #[arg(long, default_value_t = RequestLimits::default().max_stop_token_ids)]
    pub max_stop_token_ids: usize,
    /// Most `logit_bias` entries per request.
    #[arg(long, default_value_t = RequestLimits::default().max_logit_bias)]
    pub max_logit_bias: usize,
    /// Most alternatives per token in `logprobs` / `top_logprobs`.
    #[arg(long, default_value_t = RequestLimits::default().max_logprobs)]
    pub max_logprobs: usize,
}

impl LimitArgs {
    pub fn limits(&self) -> RequestLimits {
        RequestLimits {
            max_n: self.max_n,
            max_stop_strings: self.max_stop_strings,
            max_stop_string_bytes: self.max_stop_string_bytes,
            max_stop_token_ids: self.max_stop_token_ids,
            max_logit_bias: self.max_logit_bias,
            max_logprobs: self.max_logprobs,
        }
    }
}

impl EngineArgs {
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            threads: self.threads,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            kv_cache_memory: self.kv_cache_memory,
            kv_cache_dtype: self.kv_cache_dtype,
            block_size: self.block_size,
            max_waiting_requests: self.max_waiting_requests,
            max_model_len: self.max_model_len,
            limits: self.limits.limits(),
            prefix_caching: !self.no_enable_prefix_caching,
            state_snapshots: self.state_snapshots,
            max_step_ms: self.max_step_ms,
            speculative: self.speculative_config.clone(),
            kv_events: None,
        }
    }

    /// Loads the model (the cached default when `--model` is absent) and starts the engine.
    pub fn start(&self) -> anyhow::Result<EngineHandle> {
        let loaded = self.load()?;
        EngineHandle::start(Arc::new(loaded), self.config())
    }

    /// Loads the model (the cached default when `--model` is absent).
    pub fn load(&self) -> anyhow::Result<LoadedModel> {
        let path = match &self.model {
            Some(p) => p.clone(),
            None => model_cache::default_model()?,
        };
        let t0 = std::time::Instant::now();
        let mut loaded = LoadedModel::open(&path, self.weight_dtype())?;
        if let Some((first, rest)) = self.served_model_name.split_first() {
            loaded.name = first.clone();
            loaded.aliases = rest.to_vec();
        }
        if let Some(file) = &self.chat_template {
            let source = std::fs::read_to_string(file)
                .map_err(|e| anyhow::anyhow!("reading chat template {}: {e}", file.display()))?;
            loaded.tokenizer.set_chat_template(source).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
        }
        eprintln!(
            "weft: loaded {} in {:.2} s ({}, {:?})",
            loaded.name,
            t0.elapsed().as_secs_f64(),
            loaded.model.weights_summary(),
            self.weight_dtype()
        );
        Ok(loaded)
    }

    /// The form weights are computed in: `--dtype`, or `--quantize`'s format.
    pub fn weight_dtype(&self) -> WeightDtype {
        self.quantize.map_or(self.dtype, WeightDtype::Quantize)
    }
}

/// `1234`, `512K`, `64M`, `2G` (binary units) to bytes.
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let v: f64 = num.parse().map_err(|_| format!("not a size: {s:?} (try 512M or 2G)"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("size must be positive: {s:?}"));
    }
    Ok((v * mult as f64) as usize)
}

/// A number of seconds (`30`, `0.5`) as a duration: finite, not negative, and small enough
/// to add to a clock (at most a year), so no timer can overflow.
pub fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    const YEAR: f64 = 365.0 * 24.0 * 3600.0;
    let v: f64 = s.trim().parse().map_err(|_| format!("not a number of seconds: {s:?}"))?;
    if !(0.0..=YEAR).contains(&v) {
        return Err(format!("seconds must be between 0 and {YEAR} (a year), got {s:?}"));
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_seconds};

    #[test]
    fn parses_seconds() {
        assert_eq!(parse_seconds("1.5"), Ok(std::time::Duration::from_millis(1500)));
        for bad in ["inf", "NaN", "-1", "1e300", "soon"] {
            assert!(parse_seconds(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5k"), Ok(1536));
        assert_eq!(parse_bytes("100"), Ok(100));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1G").is_err());
    }
}
