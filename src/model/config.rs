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
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
}

/// How positions are stretched beyond the trained context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Every frequency divided by `factor`.
    Linear(f32),
    /// Llama 3.x: low frequencies divided by `factor`, high ones kept, a smooth blend between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
}

impl RopeScaling {
    /// From a Hugging Face `rope_scaling` object; unknown kinds are an error, never ignored.
    fn from_hf(v: &serde_json::Value) -> Result<Self> {
        let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
        let num = |k: &str| -> Result<f32> {
            let x = v.get(k).and_then(|x| x.as_f64()).with_context(|| format!("rope_scaling needs a number `{k}`"))?;
            ensure!(x.is_finite() && x > 0.0, "rope_scaling `{k}` must be positive, got {x}");
            Ok(x as f32)
        };
        Ok(match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear(num("factor")?),
            "llama3" => {
                let (low_freq_factor, high_freq_factor) = (num("low_freq_factor")?, num("high_freq_factor")?);
                ensure!(
                    high_freq_factor > low_freq_factor,
                    "rope_scaling high_freq_factor {high_freq_factor} must exceed low_freq_factor {low_freq_factor}"
                );
                RopeScaling::Llama3 {
                    factor: num("factor")?,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                }
            }
            other => bail!("rope_scaling type '{other}' is not supported (supported: linear, llama3)"),
        })
    }

    /// Applies the scaling to unscaled inverse frequencies, with Hugging Face's f32 arithmetic.
    pub fn apply(&self, inv_freq: &mut [f32]) {
        match *self {
            RopeScaling::None => {}
            RopeScaling::Linear(factor) => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let low_wavelen = original_max_position_embeddings / low_freq_factor;
                let high_wavelen = original_max_position_embeddings / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = (1.0 / *f) * two_pi;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (original_max_position_embeddings * (1.0 / wavelen) - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
    }
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
        let rope_scaling = match c.rope_scaling.filter(|v| !v.is_null()) {
            Some(v) => RopeScaling::from_hf(&v).with_context(|| path.display().to_string())?,
            None => RopeScaling::None,
        };
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
            rope_scaling,
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
        // Llama 3's scaling comes as a `rope_freqs` tensor (applied by the model at load);
        // of the metadata kinds, only linear is understood, and the rest are refused.
        let rope_scaling = match g.get(&format!("{arch}.rope.scaling.type")).and_then(Value::as_str) {
            None | Some("none") => RopeScaling::None,
            Some("linear") => {
                let f = float("rope.scaling.factor", 1.0);
                ensure!(f.is_finite() && f > 0.0, "{}: rope.scaling.factor {f} is not positive", g.path.display());
                RopeScaling::Linear(f)
            }
            Some(other) => {
                bail!("{}: RoPE scaling '{other}' is not supported (supported: linear, llama3)", g.path.display())
            }
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
            rope_scaling,
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

    /// Weights multiplied per token (every linear layer and the LM head): a token costs
    /// twice this many FLOPs in matrix multiplies.
    pub fn matmul_params(&self) -> usize {
        let (d, f) = (self.hidden_size, self.intermediate_size);
        let layer = d * (self.q_dim() + 2 * self.kv_dim()) + self.q_dim() * d + 3 * d * f;
        self.num_layers * layer + self.vocab_size * d
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}
