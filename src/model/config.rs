//! Model hyper-parameters, read from a Hugging Face `config.json` or GGUF metadata.

use super::gguf::{GgufFile, Value};
use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub tie_word_embeddings: bool,
}

/// Model families whose weights follow the Llama layout.
const LLAMA_LIKE: &[&str] = &["llama", "mistral"];

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: usize,
    rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    #[serde(default)]
    tie_word_embeddings: bool,
    hidden_act: Option<String>,
    #[serde(default)]
    attention_bias: bool,
    rope_scaling: Option<serde_json::Value>,
    sliding_window: Option<usize>,
}

fn default_theta() -> f32 {
    10000.0
}

impl ModelConfig {
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let c: HfConfig = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let arch = c.model_type.as_deref().unwrap_or("?");
        ensure!(
            LLAMA_LIKE.contains(&arch),
            "{}: unsupported architecture '{arch}' (supported: {})",
            path.display(),
            LLAMA_LIKE.join(", ")
        );
        if let Some(act) = c.hidden_act.as_deref() {
            ensure!(act == "silu", "{}: unsupported hidden_act '{act}' (need silu)", path.display());
        }
        ensure!(!c.attention_bias, "{}: attention_bias is not supported yet", path.display());
        if let Some(scaling) = c.rope_scaling.filter(|v| !v.is_null()) {
            bail!("{}: rope_scaling {scaling} is not supported yet", path.display());
        }
        if let Some(w) = c.sliding_window.filter(|&w| w < c.max_position_embeddings) {
            bail!("{}: sliding_window {w} is not supported yet", path.display());
        }
        let cfg = ModelConfig {
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim: c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads.max(1)),
            vocab_size: c.vocab_size,
            max_position_embeddings: c.max_position_embeddings,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
            tie_word_embeddings: c.tie_word_embeddings,
        };
        cfg.validate().with_context(|| path.display().to_string())?;
        Ok(cfg)
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.get("general.architecture").and_then(Value::as_str).unwrap_or("?");
        ensure!(
            LLAMA_LIKE.contains(&arch),
            "{}: unsupported architecture '{arch}' (supported: {})",
            g.path.display(),
            LLAMA_LIKE.join(", ")
        );
        let int = |key: &str| -> Result<usize> {
            let full = format!("{arch}.{key}");
            g.get(&full)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .with_context(|| format!("{}: missing metadata {full}", g.path.display()))
        };
        let float =
            |key: &str, default: f64| g.get(&format!("{arch}.{key}")).and_then(Value::as_f64).unwrap_or(default) as f32;
        let hidden = int("embedding_length")?;
        let heads = int("attention.head_count")?;
        let vocab = match int("vocab_size") {
            Ok(v) => v,
            Err(_) => g
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(|a| a.len())
                .context("GGUF has neither vocab_size nor tokenizer.ggml.tokens")?,
        };
        let cfg = ModelConfig {
            hidden_size: hidden,
            intermediate_size: int("feed_forward_length")?,
            num_layers: int("block_count")?,
            num_heads: heads,
            num_kv_heads: int("attention.head_count_kv").unwrap_or(heads),
            head_dim: int("attention.key_length").unwrap_or(hidden / heads.max(1)),
            vocab_size: vocab,
            max_position_embeddings: int("context_length")?,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta: float("rope.freq_base", 10000.0),
            tie_word_embeddings: !g.tensors.contains_key("output.weight"),
        };
        cfg.validate().with_context(|| g.path.display().to_string())?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        ensure!(self.num_heads > 0 && self.num_kv_heads > 0, "head counts must be positive");
        // Far above any real model, low enough that no product of these can overflow.
        for (name, v) in [
            ("attention heads", self.num_heads),
            ("KV heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("hidden size", self.hidden_size),
        ] {
            ensure!(v <= 1 << 16, "{name} {v} is implausibly large");
        }
        for (name, v) in [
            ("layers", self.num_layers),
            ("intermediate size", self.intermediate_size),
            ("vocabulary", self.vocab_size),
        ] {
            ensure!(v <= 1 << 24, "{name} {v} is implausibly large");
        }
        ensure!(
            self.num_heads.is_multiple_of(self.num_kv_heads),
            "{} attention heads is not a multiple of {} KV heads",
            self.num_heads,
            self.num_kv_heads
        );
        ensure!(self.head_dim.is_multiple_of(2), "head_dim {} must be even for RoPE", self.head_dim);
        ensure!(self.vocab_size > 0 && self.num_layers > 0, "empty model");
        ensure!(self.max_position_embeddings > 0, "context length is 0");
        ensure!(
            self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0,
            "RMSNorm epsilon {} is not a positive finite number",
            self.rms_norm_eps
        );
        ensure!(
            self.rope_theta.is_finite() && self.rope_theta > 0.0,
            "RoPE base {} is not a positive finite number",
            self.rope_theta
        );
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}
