//! Model hyper-parameters, read from a Hugging Face `config.json` or GGUF metadata.

use super::gguf::{GgufFile, Value};
use crate::kv::KvShape;
use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use std::path::Path;

/// The decoder families: one forward pass, with the switches each family turns on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1–3 and Mistral (GGUF arch `llama`; q/k rows permuted in GGUF files).
    Llama,
    /// Qwen2 / Qwen2.5: q, k and v projection biases (Qwen2-MoE: with experts and a
    /// shared expert).
    Qwen2,
    /// Qwen3: per-head RMSNorm of q and k before RoPE.
    Qwen3,
    /// Phi-3 / Phi-3.5: fused qkv and gate_up projections, longrope.
    Phi3,
    /// Gemma 2: scaled embeddings, (1 + w) norms (stored as such once loaded), post-norms,
    /// GELU-tanh, soft-capped attention and logits, sliding window on even layers.
    Gemma2,
    /// Gemma 3 (text): Gemma 2's layer without soft-caps, with (1 + w) q/k norms, five
    /// sliding-window layers to one global, and the local layers' own RoPE base.
    Gemma3,
    /// Gemma 4 (text): Gemma 3's layout with plain (w) norms, a v-norm, attention scale 1,
    /// global layers of their own head size and KV heads ([`GlobalAttn`]), a dense MLP and
    /// a mixture of experts side by side ([`MoeConfig::dense_beside`]), a per-layer output
    /// scalar and a final soft-cap.
    Gemma4,
    /// gpt-oss: a mixture of experts with biases and a clamped SwiGLU, attention sinks,
    /// q/k/v/o biases, sliding and full layers alternating, YaRN.
    GptOss,
    /// BitNet b1.58: ternary projections (computed as TQ2_0 with per-row int8
    /// activations, as trained), relu² MLP, RMSNorms before o_proj and down_proj.
    BitNet,
    /// Qwen3.5 / 3.6: gated DeltaNet layers ([`LinearAttn`]) with full-attention layers
    /// between them whose output is gated and whose RoPE is partial, (1 + w) norms, and
    /// experts with a gated shared expert.
    Qwen35,
}

impl Arch {
    /// The Hugging Face `model_type` and model class of this architecture (`moe`: with
    /// experts).
    pub fn hf_names(self, moe: bool) -> (&'static str, &'static str) {
        match (self, moe) {
            (Arch::Llama, false) => ("llama", "LlamaForCausalLM"),
            (Arch::Llama, true) => ("mixtral", "MixtralForCausalLM"),
            (Arch::Qwen2, false) => ("qwen2", "Qwen2ForCausalLM"),
            (Arch::Qwen2, true) => ("qwen2_moe", "Qwen2MoeForCausalLM"),
            (Arch::Qwen3, false) => ("qwen3", "Qwen3ForCausalLM"),
            (Arch::Qwen3, true) => ("qwen3_moe", "Qwen3MoeForCausalLM"),
            (Arch::Phi3, _) => ("phi3", "Phi3ForCausalLM"),
            (Arch::Gemma2, _) => ("gemma2", "Gemma2ForCausalLM"),
            (Arch::Gemma3, _) => ("gemma3_text", "Gemma3ForCausalLM"),
            (Arch::Gemma4, _) => ("gemma4_text", "Gemma4ForCausalLM"),
            (Arch::GptOss, _) => ("gpt_oss", "GptOssForCausalLM"),
            (Arch::BitNet, _) => ("bitnet", "BitNetForCausalLM"),
            (Arch::Qwen35, false) => ("qwen3_5_text", "Qwen3_5ForCausalLM"),
            (Arch::Qwen35, true) => ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
        }
    }

    /// From a Hugging Face `model_type` or a GGUF `general.architecture`.
    fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            // Mixtral is Llama with experts (llama.cpp converts it as `llama`).
            "llama" | "mistral" | "mixtral" => Arch::Llama,
            // Qwen2-MoE is Qwen2 with experts and a shared expert.
            "qwen2" | "qwen2_moe" | "qwen2moe" => Arch::Qwen2,
            // Qwen3-MoE is Qwen3 with experts.
            "qwen3" | "qwen3_moe" | "qwen3moe" => Arch::Qwen3,
            "phi3" => Arch::Phi3,
            "gemma2" => Arch::Gemma2,
            "gemma3" | "gemma3_text" => Arch::Gemma3,
            "gemma4" | "gemma4_text" => Arch::Gemma4,
            "gpt_oss" | "gpt-oss" => Arch::GptOss,
            // llama.cpp's name, and bitnet.cpp's for its I2_S files.
            "bitnet" | "bitnet-b1.58" => Arch::BitNet,
            // The text models (llama.cpp: `qwen35`, `qwen35moe`).
            "qwen3_5_text" | "qwen3_5_moe_text" | "qwen35" | "qwen35moe" => Arch::Qwen35,
            other => {
                bail!(
                    "unsupported architecture '{other}' (supported: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, phi3, gemma2, gemma3_text, gemma4_text, gpt_oss, bitnet, qwen3_5_text, qwen3_5_moe_text)"
                )
            }
        })
    }
}

/// The MLP's gating activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// `relu(x)²` (BitNet b1.58).
    Relu2,
    /// gpt-oss's SwiGLU: the gate clamped above at 7, the up clamped to ±7, then
    /// `(up + 1) · gate · σ(1.702 · gate)` (its published `swiglu_limit` and `swiglu_alpha`).
    SwigluOai,
}

impl Activation {
    fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_tanh" => Activation::GeluTanh,
            "relu2" | "relu_squared" => Activation::Relu2,
            other => bail!("unsupported activation '{other}' (supported: silu, gelu_pytorch_tanh, relu2)"),
        })
    }

    /// A family's activation when its files do not name one.
    fn default_for(arch: Arch) -> Self {
        match arch {
            Arch::Gemma2 | Arch::Gemma3 | Arch::Gemma4 => Activation::GeluTanh,
            Arch::BitNet => Activation::Relu2,
            Arch::GptOss => Activation::SwigluOai,
            _ => Activation::Silu,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
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
    pub activation: Activation,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    /// Attention limited to the last `W` positions (every layer, or Gemma's local ones).
    pub sliding_window: Option<usize>,
    /// Of every `n` layers the last is global, the rest sliding (Gemma 2: 2, Gemma 3: 6).
    pub sliding_pattern: Option<usize>,
    /// The sliding layers' RoPE base, unscaled (Gemma 3); else every layer uses `rope_theta`.
    pub rope_local_theta: Option<f32>,
    /// Scale of q·k: `1/sqrt(head_dim)`, or Gemma 2's `1/sqrt(query_pre_attn_scalar)`.
    pub attn_scale: f32,
    /// Attention scores become `cap · tanh(score / cap)` (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Logits become `cap · tanh(logit / cap)` (Gemma 2).
    pub final_softcap: Option<f32>,
    /// The MLPs are mixtures of experts (Mixtral, Qwen3-MoE).
    pub moe: Option<MoeConfig>,
    /// The global (full-attention) layers' own attention shape (Gemma 4).
    pub global_attn: Option<GlobalAttn>,
    /// Dimensions of each head that RoPE turns, the first ones (Qwen3.5: a quarter);
    /// `head_dim` for every other family.
    pub rope_dims: usize,
    /// q_proj also emits a gate per head; the attention output is multiplied by its
    /// sigmoid (Qwen3.5).
    pub attn_gate: bool,
    /// The gated DeltaNet layers and their shape (Qwen3.5); `None`: every layer attends.
    pub linear: Option<LinearAttn>,
    /// How an embedding model pools its hidden states (sentence-transformers'
    /// `1_Pooling/config.json`, GGUF's `pooling_type`); `None`: not an embedding model.
    pub pooling: Option<Pooling>,
    /// Trained so that a prefix of its embedding is one too (`is_matryoshka`).
    pub matryoshka: bool,
}

/// Gemma 4's global layers: a head size and KV heads of their own, V taken from K's
/// projection, and proportional RoPE (only the first `rotated_pairs` frequencies turn).
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalAttn {
    pub head_dim: usize,
    pub kv_heads: usize,
    /// No v_proj: V is K's projection before K's norm and RoPE (`attention_k_eq_v`).
    pub k_eq_v: bool,
    pub rope_theta: f32,
    /// Frequency pairs that rotate, of `head_dim / 2`; the rest stay still. GGUF files say
    /// it with a `rope_freqs` tensor instead (the still ones divided by 1e30).
    pub rotated_pairs: usize,
}

/// Qwen3.5's gated DeltaNet layers: linear attention whose per-sequence state is a
/// `key_dim × value_dim` matrix per value head plus a short convolution's last inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttn {
    /// Per layer: gated DeltaNet (true) or full attention.
    pub layers: Vec<bool>,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    /// The causal depthwise convolution's width over the q, k and v channels.
    pub conv_kernel: usize,
    /// Value heads in llama.cpp's tiled order (value head `j` reads key head
    /// `j % key_heads`) rather than Hugging Face's grouped one (`j / (value_heads /
    /// key_heads)`): GGUF files reorder every value-head axis so.
    pub tiled: bool,
}

impl LinearAttn {
    /// Channels of the q, k and v projections, which the convolution runs over.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// Floats of one layer's state for one sequence: the convolution's last
    /// `conv_kernel - 1` inputs, then each value head's matrix.
    pub fn state_floats(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim() + self.value_heads * self.key_dim * self.value_dim
    }

    /// The key head value head `v` reads.
    pub fn key_head(&self, v: usize) -> usize {
        if self.tiled {
            v % self.key_heads
        } else {
            v / (self.value_heads / self.key_heads)
        }
    }

    fn validate(&self, layers: usize) -> Result<()> {
        ensure!(
            self.layers.len() == layers,
            "layer_types (GGUF: attention.recurrent_layers) has {} entries for {layers} layers",
            self.layers.len()
        );
        // Named as Hugging Face configs and GGUF files name them.
        for (what, v) in [
            ("linear_num_key_heads (ssm.group_count)", self.key_heads),
            ("linear_num_value_heads (ssm.time_step_rank)", self.value_heads),
            ("linear_key_head_dim (ssm.state_size)", self.key_dim),
            ("linear_value_head_dim (ssm.inner_size / ssm.time_step_rank)", self.value_dim),
        ] {
            ensure!((1..=1 << 12).contains(&v), "{what} {v} is not within 1..=4096");
        }
        ensure!(
            (2..=16).contains(&self.conv_kernel),
            "linear_conv_kernel_dim (ssm.conv_kernel) {} is not within 2..=16",
            self.conv_kernel
        );
        ensure!(
            self.value_heads.is_multiple_of(self.key_heads),
            "linear_num_value_heads (ssm.time_step_rank) {} is not a multiple of linear_num_key_heads (ssm.group_count) {}",
            self.value_heads,
            self.key_heads
        );
        Ok(())
    }
}

/// Which hidden states an embedding is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the input's tokens.
    Mean,
    /// The last token's (decoder embedding models such as Qwen3-Embedding).
    Last,
}

/// sentence-transformers' pooling settings beside an HF config: which mode is on.
fn hf_pooling(config: &Path) -> Result<Option<Pooling>> {
    let path = config.with_file_name("1_Pooling").join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let on = |k: &str| v[k] == true;
    Ok(match () {
        _ if on("pooling_mode_lasttoken") => Some(Pooling::Last),
        _ if on("pooling_mode_mean_tokens") => Some(Pooling::Mean),
        _ => bail!("{}: only mean and last-token pooling are supported", path.display()),
    })
}

/// A mixture-of-experts MLP: how many experts, how tokens are routed to them, and which
/// layers keep a dense MLP instead.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub expert_ffn: usize,
    /// Whether the top-k routing weights are renormalised to sum to 1 (softmax over all
    /// experts first either way).
    pub norm_topk_prob: bool,
    /// Layers whose MLP is dense (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`).
    pub dense_layers: Vec<usize>,
    /// Every layer also has a dense MLP, run beside the experts on the same input, each
    /// with its own norms (Gemma 4).
    pub dense_beside: bool,
    /// Gemma 4's router: it reads the residual stream RMS-normalised, times a learned
    /// scale and hidden^-1/2, and each chosen expert's weight is multiplied by that
    /// expert's own scale.
    pub scaled_router: bool,
    /// The intermediate size of a shared expert every row also goes through, its output
    /// scaled by σ(gate · x) (Qwen2-MoE, Qwen3.5).
    pub shared_ffn: Option<usize>,
}

impl MoeConfig {
    /// From a Hugging Face config: Mixtral's `num_local_experts` or Qwen's `num_experts`.
    fn from_hf(c: &HfConfig, arch: Arch) -> Result<Option<Self>> {
        let Some(num_experts) = c.num_local_experts.or(c.num_experts).filter(|&e| e > 0) else {
            return Ok(None);
        };
        let gemma4 = arch == Arch::Gemma4;
        if gemma4 && c.enable_moe_block == Some(false) {
            return Ok(None);
        }
        let top_k = c
            .num_experts_per_tok
            .or(c.experts_per_token)
            .or(c.top_k_experts)
            .context("a mixture of experts needs num_experts_per_tok")?;
        let step = c.decoder_sparse_step.unwrap_or(1);
        ensure!(step > 0, "decoder_sparse_step is 0");
        let only = c.mlp_only_layers.clone().unwrap_or_default();
        let dense_layers =
            (0..c.num_hidden_layers).filter(|i| only.contains(i) || !(i + 1).is_multiple_of(step)).collect();
        Ok(Some(MoeConfig {
            num_experts,
            top_k,
            expert_ffn: c
                .moe_intermediate_size
                .or(c.intermediate_size)
                .context("a mixture of experts needs moe_intermediate_size")?,
            // Mixtral always renormalises, and gpt-oss's softmax over the top-k logits gives
            // the same weights; Qwen3-MoE says so in its config (transformers' default: false).
            norm_topk_prob: c
                .norm_topk_prob
                .unwrap_or(matches!(arch, Arch::Llama | Arch::GptOss | Arch::Gemma4 | Arch::Qwen35)),
            dense_layers,
            dense_beside: gemma4,
            scaled_router: gemma4,
            shared_ffn: c.shared_expert_intermediate_size.filter(|&s| s > 0),
        }))
    }

    /// From GGUF metadata (`<arch>.expert_count` and its neighbours). llama.cpp's `llama`
    /// (Mixtral) and `qwen3moe` always renormalise and have experts in every layer.
    fn from_gguf(g: &GgufFile, name: &str, ffn: usize, arch: Arch) -> Result<Option<Self>> {
        let int = |k: &str| g.get(&format!("{name}.{k}")).and_then(Value::as_u64).map(|v| v as usize);
        let Some(num_experts) = int("expert_count").filter(|&e| e > 0) else { return Ok(None) };
        let top_k = int("expert_used_count").with_context(|| format!("missing metadata {name}.expert_used_count"))?;
        let norm = g.get(&format!("{name}.expert_weights_norm")).and_then(Value::as_bool);
        // llama.cpp renormalises every family's top-k but Qwen2-MoE's.
        let renorm = arch != Arch::Qwen2;
        Ok(Some(MoeConfig {
            num_experts,
            top_k,
            expert_ffn: int("expert_feed_forward_length").unwrap_or(ffn),
            norm_topk_prob: norm.unwrap_or(renorm),
            dense_layers: Vec::new(),
            dense_beside: arch == Arch::Gemma4,
            scaled_router: arch == Arch::Gemma4,
            shared_ffn: int("expert_shared_feed_forward_length").filter(|&s| s > 0),
        }))
    }

    fn validate(&self, layers: usize) -> Result<()> {
        ensure!(self.num_experts <= 1 << 12, "{} experts is implausibly many", self.num_experts);
        ensure!(
            (1..=self.num_experts).contains(&self.top_k),
            "{} experts per token is not within 1..={} experts",
            self.top_k,
            self.num_experts
        );
        ensure!(
            (1..=1 << 24).contains(&self.expert_ffn),
            "expert intermediate size {} is not within 1..=2^24",
            self.expert_ffn
        );
        ensure!(self.dense_layers.iter().all(|&l| l < layers), "a dense layer index is beyond the {layers} layers");
        if let Some(s) = self.shared_ffn {
            ensure!(s <= 1 << 24, "shared expert intermediate size {s} is not within 1..=2^24");
        }
        Ok(())
    }
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
    /// YaRN: low frequencies divided by `factor`, high ones kept, a linear ramp between
    /// over the frequencies whose rotations in the original context fall between
    /// `beta_slow` and `beta_fast` (its ends rounded outwards when `truncate`); cos and
    /// sin scaled by `attention_factor`.
    Yarn {
        factor: f32,
        original_max_position_embeddings: f32,
        beta_fast: f32,
        beta_slow: f32,
        truncate: bool,
        attention_factor: f32,
    },
    /// Phi-3's longrope: per-frequency divisors, the short set while the sequence fits in
    /// `original_max_position_embeddings` and the long set beyond, cos/sin scaled by
    /// `attention_factor` either way.
    LongRope {
        short: Vec<f32>,
        long: Vec<f32>,
        original_max_position_embeddings: usize,
        attention_factor: f32,
    },
}

impl RopeScaling {
    /// From a Hugging Face `rope_scaling` object; unknown kinds are an error, never ignored.
    /// `contexts` is (`max_position_embeddings`, top-level `original_max_position_embeddings`).
    fn from_hf(v: &serde_json::Value, contexts: (usize, Option<usize>)) -> Result<Self> {
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
            "yarn" => {
                let opt = |k: &str| v.get(k).and_then(|x| x.as_f64());
                let factor = num("factor")?;
                let original = match opt("original_max_position_embeddings") {
                    Some(o) => o as f32,
                    None => contexts.0 as f32,
                };
                let attention_factor = match (opt("attention_factor"), opt("mscale"), opt("mscale_all_dim")) {
                    (Some(a), _, _) => a as f32,
                    (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        (yarn_mscale(factor, m) / yarn_mscale(factor, all)) as f32
                    }
                    _ => yarn_mscale(factor, 1.0) as f32,
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: opt("beta_fast").unwrap_or(32.0) as f32,
                    beta_slow: opt("beta_slow").unwrap_or(1.0) as f32,
                    truncate: v.get("truncate").and_then(|t| t.as_bool()).unwrap_or(true),
                    attention_factor,
                }
            }
            "longrope" => {
                let factors = |k: &str| -> Result<Vec<f32>> {
                    let a = v.get(k).and_then(|a| a.as_array()).with_context(|| format!("longrope needs `{k}`"))?;
                    a.iter()
                        .map(|x| match x.as_f64() {
                            Some(x) if x.is_finite() && x > 0.0 => Ok(x as f32),
                            _ => bail!("longrope `{k}` holds {x}, not a positive number"),
                        })
                        .collect()
                };
                let (max, top_original) = contexts;
                let original = match top_original {
                    Some(o) => o,
                    None => v
                        .get("original_max_position_embeddings")
                        .and_then(|x| x.as_u64())
                        .context("longrope needs original_max_position_embeddings")?
                        as usize,
                };
                ensure!(original > 1, "longrope original_max_position_embeddings {original} is too small");
                let attention_factor = match v.get("attention_factor").and_then(|x| x.as_f64()) {
                    Some(a) => a as f32,
                    None => longrope_attention_factor(max as f64 / original as f64, original),
                };
                RopeScaling::LongRope {
                    short: factors("short_factor")?,
                    long: factors("long_factor")?,
                    original_max_position_embeddings: original,
                    attention_factor,
                }
            }
            other => bail!("rope_scaling type '{other}' is not supported (supported: linear, llama3, yarn, longrope)"),
        })
    }

    /// What cos and sin are multiplied by (YaRN's attention factor; longrope carries its own).
    pub fn attention_factor(&self) -> f32 {
        match *self {
            RopeScaling::Yarn { attention_factor, .. } => attention_factor,
            _ => 1.0,
        }
    }

    /// Applies the scaling to unscaled inverse frequencies of base `theta`, with Hugging
    /// Face's f32 arithmetic (longrope builds its own frequencies; see the model's RoPE setup).
    pub fn apply(&self, inv_freq: &mut [f32], theta: f32) {
        match *self {
            RopeScaling::None | RopeScaling::LongRope { .. } => {}
            RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, .. } => {
                // As transformers: the correction range in f64, the ramp and blend in f32.
                let dim = 2 * inv_freq.len();
                let at = |rotations: f32| {
                    let (d, base, len) = (dim as f64, theta as f64, original_max_position_embeddings as f64);
                    d * (len / (rotations as f64 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
                };
                let (mut low, mut high) = (at(beta_fast), at(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
                if low == high {
                    high += 0.001;
                }
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let pos_freq = theta.powf((2 * i) as f32 / dim as f32);
                    let interpolation = 1.0 / (factor * pos_freq);
                    *f = interpolation * (1.0 - extrapolation) + *f * extrapolation;
                }
            }
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

/// transformers' YaRN attention scale for a context stretched `factor` times:
/// `0.1 · m · ln(factor) + 1` (1 when not stretched).
fn yarn_mscale(factor: f32, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * (factor as f64).ln() + 1.0
    }
}

/// Of every `n` layers the last global and the rest sliding: the family's `n`, as llama.cpp
/// fixes it (GGUF files do not carry it).
fn sliding_pattern(arch: Arch) -> Option<usize> {
    match arch {
        Arch::Gemma2 | Arch::GptOss => Some(2),
        Arch::Gemma3 => Some(6),
        _ => None,
    }
}

/// The pattern a per-layer list of sliding (true) and global layers follows: global at
/// every `n`-th layer and nowhere else; `None` if it follows none.
fn pattern_of(sliding: &[bool]) -> Option<usize> {
    let n = sliding.iter().position(|s| !s)? + 1;
    sliding.iter().enumerate().all(|(i, &s)| s != (i + 1).is_multiple_of(n)).then_some(n)
}

/// Gemma GGUF files carry no `query_pre_attn_scalar`; llama.cpp uses the head dim, except
/// for the 27B models (Gemma 2's 46 layers, Gemma 3's 62), whose scalar is hidden / heads.
fn gguf_query_pre_attn_scalar(arch: Arch, hidden: usize, heads: usize, head_dim: usize, layers: usize) -> f32 {
    if (arch == Arch::Gemma2 && layers == 46) || (arch == Arch::Gemma3 && layers == 62) {
        (hidden / heads.max(1)) as f32
    } else {
        head_dim as f32
    }
}

/// A Hugging Face `quantization_config` this engine can read: gpt-oss's MXFP4 experts
/// (as released), and BitNet's offline-packed ternary weights, multiplied by their scale
/// (`autobitlinear`, as 2B-4T is released). Anything else is refused rather than loaded
/// as if it were plain weights.
fn check_quantization(arch: Arch, q: &serde_json::Value) -> Result<()> {
    let field = |k: &str| q.get(k).and_then(|v| v.as_str());
    let method = field("quant_method").unwrap_or("?");
    if arch == Arch::GptOss && method == "mxfp4" {
        return Ok(());
    }
    ensure!(arch == Arch::BitNet && method == "bitnet", "quantization_config quant_method '{method}' is not supported");
    let class = field("linear_class").unwrap_or("bitlinear");
    ensure!(
        class == "autobitlinear",
        "BitNet linear_class '{class}' is not supported (only autobitlinear: weights times weight_scale)"
    );
    let mode = field("quantization_mode").unwrap_or("offline");
    ensure!(mode == "offline", "BitNet quantization_mode '{mode}' is not supported (only offline-packed weights)");
    Ok(())
}

/// The MLP activation a GGUF names (`<arch>.hidden_activation` or `.hidden_act`), or the
/// family's. BitNet conversions that predate the key get relu², which the model was
/// trained with (llama.cpp falls back to SiLU there, a wrong answer), with a note.
fn gguf_activation(g: &GgufFile, name: &str, arch: Arch) -> Result<Activation> {
    let key = ["hidden_activation", "hidden_act"].map(|k| format!("{name}.{k}"));
    match key.iter().find_map(|k| g.get(k).and_then(Value::as_str)) {
        Some(a) => Activation::parse(a),
        None => {
            if arch == Arch::BitNet {
                eprintln!("weft: {} names no hidden activation; BitNet b1.58 uses relu²", g.path.display());
            }
            Ok(Activation::default_for(arch))
        }
    }
}

/// Gemma 2, 3 and 4: soft-caps where the config sets them.
fn gemma(arch: Arch) -> bool {
    matches!(arch, Arch::Gemma2 | Arch::Gemma3 | Arch::Gemma4)
}

/// Gemma 4's `rope_parameters`: the sliding layers' base (default RoPE), and the global
/// layers' base and rotated share (proportional RoPE); transformers' defaults when absent.
fn gemma4_rope(p: Option<&serde_json::Value>) -> Result<(f32, (f32, f32))> {
    let get = |layer: &str, key: &str| p.and_then(|p| p.get(layer)).and_then(|l| l.get(key));
    let num = |layer: &str, key: &str, default: f64| -> Result<f32> {
        let x = get(layer, key)
            .map_or(Some(default), |v| v.as_f64())
            .with_context(|| format!("rope_parameters.{layer}.{key} is not a number"))?;
        ensure!(x.is_finite() && x > 0.0, "rope_parameters.{layer}.{key} {x} is not positive");
        Ok(x as f32)
    };
    for (layer, want) in [("sliding_attention", "default"), ("full_attention", "proportional")] {
        let kind = get(layer, "rope_type").and_then(|t| t.as_str()).unwrap_or(want);
        ensure!(kind == want, "rope_parameters.{layer}.rope_type '{kind}' is not supported (only {want})");
    }
    ensure!(num("full_attention", "factor", 1.0)? == 1.0, "a scaled proportional RoPE is not supported");
    let partial = num("full_attention", "partial_rotary_factor", 0.25)?;
    ensure!(partial <= 1.0, "partial_rotary_factor {partial} is above 1");
    Ok((num("sliding_attention", "rope_theta", 1e4)?, (num("full_attention", "rope_theta", 1e6)?, partial)))
}

/// `1/sqrt(s)` as Hugging Face computes `s ** -0.5` (in f64, then stored as f32).
fn attn_scale(s: f32) -> f32 {
    (s as f64).powf(-0.5) as f32
}

/// Hugging Face's default longrope attention factor for a context stretched `scale` times.
fn longrope_attention_factor(scale: f64, original: usize) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        (1.0 + scale.ln() / (original as f64).ln()).sqrt() as f32
    }
}

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    #[serde(default)]
    is_matryoshka: bool,
    matryoshka_dimensions: Option<Vec<usize>>,
    hidden_size: usize,
    /// Absent from configs whose every MLP is a mixture (Qwen3.5-MoE): the experts' then.
    intermediate_size: Option<usize>,
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
    /// Gemma's name for `hidden_act`.
    hidden_activation: Option<String>,
    #[serde(default)]
    attention_bias: bool,
    rope_scaling: Option<serde_json::Value>,
    original_max_position_embeddings: Option<usize>,
    sliding_window: Option<usize>,
    /// Qwen2's switch for its (unsupported) sliding window.
    #[serde(default)]
    use_sliding_window: bool,
    layer_types: Option<Vec<String>>,
    partial_rotary_factor: Option<f32>,
    query_pre_attn_scalar: Option<f32>,
    sliding_window_pattern: Option<usize>,
    rope_local_base_freq: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    final_logit_softcapping: Option<f32>,
    quantization_config: Option<serde_json::Value>,
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    /// Qwen2-MoE's and Qwen3.5's shared expert.
    shared_expert_intermediate_size: Option<usize>,
    /// gpt-oss's name for `num_experts_per_tok`.
    experts_per_token: Option<usize>,
    /// Gemma 4's names: `num_experts_per_tok`, whether the layers have experts at all, the
    /// global layers' head size and KV heads, V = K there, per-layer-type RoPE, and the
    /// pieces of the small models (shared KV, per-layer inputs) that are not supported.
    top_k_experts: Option<usize>,
    enable_moe_block: Option<bool>,
    global_head_dim: Option<usize>,
    num_global_key_value_heads: Option<usize>,
    #[serde(default)]
    attention_k_eq_v: bool,
    rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    num_kv_shared_layers: usize,
    #[serde(default)]
    hidden_size_per_layer_input: usize,
    swiglu_limit: Option<f32>,
    swiglu_alpha: Option<f32>,
    /// Qwen3.5's gated DeltaNet layers.
    linear_conv_kernel_dim: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
}

fn default_theta() -> f32 {
    10000.0
}

impl ModelConfig {
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let c: HfConfig = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let matryoshka = c.is_matryoshka || c.matryoshka_dimensions.is_some();
        let mut cfg = Self::from_hf(c).with_context(|| path.display().to_string())?;
        (cfg.pooling, cfg.matryoshka) = (hf_pooling(path)?, matryoshka);
        Ok(cfg)
    }

    fn from_hf(c: HfConfig) -> Result<Self> {
        let arch = Arch::parse(c.model_type.as_deref().unwrap_or("?"))?;
        let activation = match c.hidden_act.as_deref().or(c.hidden_activation.as_deref()) {
            // gpt-oss's config says `silu`, for the SiLU-like part of its own SwiGLU.
            _ if arch == Arch::GptOss => Activation::SwigluOai,
            Some(a) => Activation::parse(a)?,
            None => Activation::default_for(arch),
        };
        if let Some(q) = &c.quantization_config {
            check_quantization(arch, q)?;
        }
        // gpt-oss's SwiGLU is computed with its published constants.
        for (what, got, want) in [("swiglu_limit", c.swiglu_limit, 7.0), ("swiglu_alpha", c.swiglu_alpha, 1.702)] {
            ensure!(got.is_none_or(|g| g == want), "{what} {got:?} is not supported (only gpt-oss's {want})");
        }
        let moe = MoeConfig::from_hf(&c, arch)?;
        let rope_scaling = match c.rope_scaling.filter(|v| !v.is_null()) {
            Some(v) => RopeScaling::from_hf(&v, (c.max_position_embeddings, c.original_max_position_embeddings))?,
            None => RopeScaling::None,
        };
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads.max(1));
        let qwen35 = arch == Arch::Qwen35;
        // Qwen3.5 keeps its RoPE settings in `rope_parameters`, its partial share 0.25 by
        // default; its M-RoPE sections place text positions as plain RoPE does.
        let qwen35_rope = |k: &str| c.rope_parameters.as_ref().and_then(|p| p.get(k)).and_then(|x| x.as_f64());
        let partial = if qwen35 { qwen35_rope("partial_rotary_factor").unwrap_or(0.25) as f32 } else { 1.0 };
        if let Some(p) = c.partial_rotary_factor.filter(|_| !qwen35) {
            ensure!(p == 1.0, "partial_rotary_factor {p} is not supported (only 1.0)");
        }
        ensure!(partial > 0.0 && partial <= 1.0, "partial_rotary_factor {partial} is not within (0, 1]");
        // As transformers: int(head_dim · partial), of which pairs turn.
        let rope_dims = ((head_dim as f32 * partial) as usize) & !1;
        let linear = if qwen35 {
            if let Some(kind) = c.rope_parameters.as_ref().and_then(|p| p.get("rope_type")).and_then(|t| t.as_str()) {
                ensure!(kind == "default", "Qwen3.5 rope_type '{kind}' is not supported (only default)");
            }
            let types = c.layer_types.as_ref().context("Qwen3.5 needs layer_types")?;
            let layers = types
                .iter()
                .map(|t| match t.as_str() {
                    "linear_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => bail!("layer type '{other}' is not supported (linear_attention, full_attention)"),
                })
                .collect::<Result<Vec<bool>>>()?;
            let need = |v: Option<usize>, k: &str| v.with_context(|| format!("Qwen3.5 needs {k}"));
            Some(LinearAttn {
                layers,
                key_heads: need(c.linear_num_key_heads, "linear_num_key_heads")?,
                value_heads: need(c.linear_num_value_heads, "linear_num_value_heads")?,
                key_dim: need(c.linear_key_head_dim, "linear_key_head_dim")?,
                value_dim: need(c.linear_value_head_dim, "linear_value_head_dim")?,
                conv_kernel: need(c.linear_conv_kernel_dim, "linear_conv_kernel_dim")?,
                tiled: false,
            })
        } else {
            None
        };
        ensure!(!c.use_sliding_window, "Qwen2's use_sliding_window is not supported");
        let sliding_window = match arch {
            // Qwen's `sliding_window` is inert unless `use_sliding_window` is set (refused above).
            Arch::Qwen2 | Arch::Qwen3 => None,
            _ => c.sliding_window.filter(|&w| w < c.max_position_embeddings),
        };
        let sliding_pattern = match arch {
            Arch::Gemma3 => c.sliding_window_pattern.or(sliding_pattern(arch)),
            Arch::Gemma4 => {
                let types = c.layer_types.as_ref().context("Gemma 4 needs layer_types")?;
                let sliding: Vec<bool> = types.iter().map(|t| t == "sliding_attention").collect();
                Some(pattern_of(&sliding).context("layer_types: global layers must recur at a fixed interval")?)
            }
            _ => sliding_pattern(arch),
        };
        if let (Some(p), Some(types)) = (sliding_pattern, &c.layer_types) {
            // Every `p`-th layer global and the rest sliding: the only layout supported.
            ensure!(p > 0, "sliding_window_pattern is 0");
            for (i, t) in types.iter().enumerate() {
                let want = if (i + 1).is_multiple_of(p) { "full_attention" } else { "sliding_attention" };
                ensure!(t == want, "layer {i} is '{t}'; only {} sliding layers to one full are supported", p - 1);
            }
        }
        let num_kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
        let theta = if qwen35 { qwen35_rope("rope_theta").map_or(c.rope_theta, |t| t as f32) } else { c.rope_theta };
        let (mut rope_theta, mut rope_local_theta) =
            (theta, (arch == Arch::Gemma3).then(|| c.rope_local_base_freq.unwrap_or(10000.0)));
        let global_attn = if arch == Arch::Gemma4 {
            ensure!(c.num_kv_shared_layers == 0, "Gemma 4's shared KV layers are not supported");
            ensure!(c.hidden_size_per_layer_input == 0, "Gemma 4's per-layer inputs are not supported");
            let (local, global) = gemma4_rope(c.rope_parameters.as_ref())?;
            (rope_theta, rope_local_theta) = (global.0, Some(local));
            let head_dim = c.global_head_dim.unwrap_or(512);
            Some(GlobalAttn {
                head_dim,
                kv_heads: if c.attention_k_eq_v {
                    c.num_global_key_value_heads.unwrap_or(num_kv_heads)
                } else {
                    num_kv_heads
                },
                k_eq_v: c.attention_k_eq_v,
                rope_theta,
                // As transformers: int(partial · head_dim // 2).
                rotated_pairs: ((global.1 * head_dim as f32) / 2.0).floor() as usize,
            })
        } else {
            None
        };
        let cfg = ModelConfig {
            arch,
            hidden_size: c.hidden_size,
            intermediate_size: match (c.intermediate_size, &moe) {
                (Some(f), _) => f,
                (None, Some(m)) => m.expert_ffn,
                (None, None) => bail!("missing field `intermediate_size`"),
            },
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: c.vocab_size,
            max_position_embeddings: c.max_position_embeddings,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: c.tie_word_embeddings,
            activation,
            qkv_bias: arch == Arch::Qwen2 || c.attention_bias,
            // transformers gives o_proj a bias with `attention_bias` in these families.
            o_bias: c.attention_bias && matches!(arch, Arch::Llama | Arch::GptOss),
            sliding_window,
            // Gemma 4's q and k are normalised, and it scales their product by 1.
            attn_scale: if arch == Arch::Gemma4 {
                1.0
            } else {
                attn_scale(c.query_pre_attn_scalar.unwrap_or(head_dim as f32))
            },
            attn_softcap: c.attn_logit_softcapping.filter(|_| gemma(arch)),
            final_softcap: c.final_logit_softcapping.filter(|_| gemma(arch)),
            sliding_pattern,
            // transformers' default for Gemma 3.
            rope_local_theta,
            moe,
            global_attn,
            rope_dims,
            attn_gate: qwen35,
            linear,
            pooling: None,
            matryoshka: false,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        Self::from_gguf_inner(g).with_context(|| g.path.display().to_string())
    }

    fn from_gguf_inner(g: &GgufFile) -> Result<Self> {
        let name = g.get("general.architecture").and_then(Value::as_str).unwrap_or("?");
        let arch = Arch::parse(name)?;
        let int = |key: &str| -> Result<usize> {
            let full = format!("{name}.{key}");
            g.get(&full).and_then(Value::as_u64).map(|v| v as usize).with_context(|| format!("missing metadata {full}"))
        };
        let float = |key: &str| g.get(&format!("{name}.{key}")).and_then(Value::as_f64).map(|v| v as f32);
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
        let context = int("context_length")?;
        let gemma4 = arch == Arch::Gemma4;
        // Gemma 4's keys without a suffix describe its global layers; the sliding ones'
        // carry `_swa`.
        let swa = if gemma4 { "_swa" } else { "" };
        let head_dim = int(&format!("attention.key_length{swa}")).unwrap_or(hidden / heads.max(1));
        let qwen35 = arch == Arch::Qwen35;
        let rope_dims = int(&format!("rope.dimension_count{swa}")).unwrap_or(head_dim);
        if !qwen35 {
            ensure!(
                rope_dims == head_dim,
                "partial rotary embedding ({rope_dims} of {head_dim} dimensions) is not supported"
            );
        }
        let linear = if qwen35 {
            let layers = int("block_count")?;
            let list = g.get(&format!("{name}.attention.recurrent_layers")).and_then(Value::as_array);
            let layers: Vec<bool> = match list {
                Some(l) => l.iter().map(|v| v.as_bool() == Some(true)).collect(),
                None => {
                    let every = int("full_attention_interval").unwrap_or(4).max(1);
                    (0..layers).map(|i| !(i + 1).is_multiple_of(every)).collect()
                }
            };
            // llama.cpp's names: groups are key heads, the time-step rank is the value
            // heads, the state size both head sizes, the inner size all value channels.
            let value_heads = int("ssm.time_step_rank")?;
            let value_dim = int("ssm.inner_size")? / value_heads.max(1);
            Some(LinearAttn {
                layers,
                key_heads: int("ssm.group_count")?,
                value_heads,
                key_dim: int("ssm.state_size")?,
                value_dim,
                conv_kernel: int("ssm.conv_kernel")?,
                tiled: true,
            })
        } else {
            None
        };
        let sliding_pattern = if gemma4 {
            let list = g.get(&format!("{name}.attention.sliding_window_pattern")).and_then(Value::as_array);
            let list: Vec<bool> = list
                .context("Gemma 4 needs attention.sliding_window_pattern")?
                .iter()
                .map(|v| v.as_bool() == Some(true))
                .collect();
            ensure!(
                list.len() == int("block_count")?,
                "sliding_window_pattern has {} layers, not block_count",
                list.len()
            );
            Some(pattern_of(&list).context("sliding_window_pattern: global layers must recur at a fixed interval")?)
        } else {
            sliding_pattern(arch)
        };
        // KV heads: one count, or Gemma 4's per layer (the sliding layers' and the global
        // layers' each the same).
        let kv_key = format!("{name}.attention.head_count_kv");
        let (kv_heads, global_kv) = match g.get(&kv_key).and_then(Value::as_array) {
            Some(a) => {
                let n: Vec<usize> = a.iter().map(|v| v.as_u64().unwrap_or(0) as usize).collect();
                let p = sliding_pattern.context("per-layer KV heads need a sliding window pattern")?;
                let at = |global: bool| {
                    let mut of =
                        n.iter().enumerate().filter(|(i, _)| (i + 1).is_multiple_of(p) == global).map(|(_, &k)| k);
                    let first = of.next().unwrap_or(0);
                    ensure!(of.all(|k| k == first), "{kv_key}: layers of one kind have different KV heads");
                    Ok(first)
                };
                (at(false)?, Some(at(true)?))
            }
            None => (int("attention.head_count_kv").unwrap_or(heads), None),
        };
        let global_attn = if gemma4 {
            ensure!(
                int("attention.shared_kv_layers").unwrap_or(0) == 0,
                "Gemma 4's shared KV layers are not supported"
            );
            ensure!(
                int("embedding_length_per_layer_input").unwrap_or(0) == 0,
                "Gemma 4's per-layer inputs are not supported"
            );
            let global_dim = int("attention.key_length")?;
            if let Ok(n) = int("rope.dimension_count") {
                ensure!(n == global_dim, "partial rotary embedding ({n} of {global_dim} dimensions) is not supported");
            }
            let first_global = sliding_pattern.unwrap_or(1) - 1;
            Some(GlobalAttn {
                head_dim: global_dim,
                kv_heads: global_kv.unwrap_or(kv_heads),
                k_eq_v: !g.tensors.contains_key(&format!("blk.{first_global}.attn_v.weight")),
                rope_theta: float("rope.freq_base").unwrap_or(1e6),
                // The still frequencies come as `rope_freqs` divisors.
                rotated_pairs: global_dim / 2,
            })
        } else {
            None
        };
        // Llama 3's scaling comes as a `rope_freqs` tensor (applied by the model at load),
        // Phi-3's longrope as two factor tensors; of the metadata kinds, only linear is
        // understood, and the rest are refused.
        let rope_scaling = if g.tensors.contains_key("rope_factors_long.weight") {
            let factors = |t: &str| -> Result<Vec<f32>> {
                let info = g.tensors.get(t).with_context(|| format!("longrope needs tensor {t}"))?;
                ensure!(info.shape == [head_dim / 2], "{t} has shape {:?}, expected [{}]", info.shape, head_dim / 2);
                let v = g.dequantize(info);
                ensure!(v.iter().all(|x| x.is_finite() && *x > 0.0), "{t} holds a factor that is not positive");
                Ok(v)
            };
            let original = int("rope.scaling.original_context_length")?;
            ensure!(original > 1, "rope.scaling.original_context_length {original} is too small");
            let attention_factor = float("rope.scaling.attn_factor")
                .unwrap_or_else(|| longrope_attention_factor(context as f64 / original as f64, original));
            RopeScaling::LongRope {
                short: factors("rope_factors_short.weight")?,
                long: factors("rope_factors_long.weight")?,
                original_max_position_embeddings: original,
                attention_factor,
            }
        } else {
            match g.get(&format!("{name}.rope.scaling.type")).and_then(Value::as_str) {
                None | Some("none") => RopeScaling::None,
                Some("linear") => RopeScaling::Linear(float("rope.scaling.factor").unwrap_or(1.0)),
                Some("yarn") => {
                    let factor = float("rope.scaling.factor").unwrap_or(1.0);
                    RopeScaling::Yarn {
                        factor,
                        original_max_position_embeddings: int("rope.scaling.original_context_length")? as f32,
                        beta_fast: float("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
                        beta_slow: float("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
                        // GGUF has no key for it: gpt-oss's config says false (llama.cpp
                        // always rounds, which changes gpt-oss's outputs); transformers'
                        // default otherwise.
                        truncate: arch != Arch::GptOss,
                        attention_factor: float("rope.scaling.attn_factor").unwrap_or(yarn_mscale(factor, 1.0) as f32),
                    }
                }
                Some(other) => {
                    bail!("RoPE scaling '{other}' is not supported (supported: linear, llama3, yarn, longrope)")
                }
            }
        };
        let sliding_window = int("attention.sliding_window").ok().filter(|&w| w > 0 && w < context);
        let ffn = int("feed_forward_length");
        let moe = MoeConfig::from_gguf(g, name, ffn.as_ref().copied().unwrap_or(0), arch)?;
        let cfg = ModelConfig {
            arch,
            hidden_size: hidden,
            // Qwen3-MoE files have experts only and may give no dense width.
            intermediate_size: match (ffn, &moe) {
                (Ok(f), _) => f,
                (Err(_), Some(m)) => m.expert_ffn,
                (Err(e), None) => return Err(e),
            },
            num_layers: int("block_count")?,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            vocab_size: vocab,
            max_position_embeddings: context,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta: float("rope.freq_base").unwrap_or(10000.0),
            rope_scaling,
            tie_word_embeddings: !g.tensors.contains_key("output.weight"),
            activation: gguf_activation(g, name, arch)?,
            qkv_bias: g.tensors.contains_key("blk.0.attn_q.bias"),
            o_bias: g.tensors.contains_key("blk.0.attn_output.bias"),
            sliding_window: sliding_window.filter(|_| !matches!(arch, Arch::Qwen2 | Arch::Qwen3)),
            attn_scale: if gemma4 {
                1.0
            } else {
                attn_scale(gguf_query_pre_attn_scalar(arch, hidden, heads, head_dim, int("block_count")?))
            },
            attn_softcap: float("attn_logit_softcapping").filter(|_| gemma(arch)),
            final_softcap: float("final_logit_softcapping").filter(|_| gemma(arch)),
            sliding_pattern,
            rope_local_theta: float("rope.freq_base_swa").filter(|_| matches!(arch, Arch::Gemma3 | Arch::Gemma4)),
            moe,
            global_attn,
            rope_dims,
            attn_gate: qwen35,
            linear,
            // llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank.
            pooling: match int("pooling_type") {
                Err(_) | Ok(0) => None,
                Ok(1) => Some(Pooling::Mean),
                Ok(3) => Some(Pooling::Last),
                Ok(other) => bail!("{name}.pooling_type {other} is not supported (only mean and last-token)"),
            },
            matryoshka: false,
        };
        ensure!(arch != Arch::Qwen2 || cfg.qkv_bias, "Qwen2 needs q/k/v biases, blk.0.attn_q.bias is missing");
        cfg.validate()?;
        Ok(cfg)
    }

    /// The sequence length past which a step computes differently (longrope switches to
    /// its long factors, chosen by the step's sequence length); `None` if nothing changes.
    pub fn length_edge(&self) -> Option<usize> {
        match self.rope_scaling {
            RopeScaling::LongRope { original_max_position_embeddings, .. } => Some(original_max_position_embeddings),
            _ => None,
        }
    }

    /// The sliding window of layer `i`, if it has one (Gemma 2 alternates, starting sliding).
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        match self.sliding_pattern {
            Some(p) if (i + 1).is_multiple_of(p) => None,
            _ => self.sliding_window,
        }
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
        ensure!(
            self.hidden_size > 0 && self.intermediate_size > 0 && self.head_dim > 0,
            "hidden size, intermediate size and head_dim must be positive"
        );
        ensure!(self.max_position_embeddings > 0, "context length is 0");
        ensure!(self.sliding_window != Some(0), "sliding window of 0 positions");
        ensure!(self.sliding_pattern != Some(0), "sliding window pattern of 0 layers");
        if let Some(t) = self.rope_local_theta {
            ensure!(t.is_finite() && t > 0.0, "local RoPE base {t} is not a positive finite number");
        }
        ensure!(
            self.attn_scale.is_finite() && self.attn_scale > 0.0,
            "attention scale {} is not positive",
            self.attn_scale
        );
        for (what, cap) in [("attention", self.attn_softcap), ("final", self.final_softcap)] {
            if let Some(c) = cap {
                ensure!(c.is_finite() && c > 0.0, "{what} soft-cap {c} is not a positive finite number");
            }
        }
        if let RopeScaling::LongRope { short, long, attention_factor, .. } = &self.rope_scaling {
            ensure!(
                short.len() == self.head_dim / 2 && long.len() == self.head_dim / 2,
                "longrope needs {} factors per set, got {} and {}",
                self.head_dim / 2,
                short.len(),
                long.len()
            );
            ensure!(
                attention_factor.is_finite() && *attention_factor > 0.0,
                "longrope attention factor {attention_factor}"
            );
        }
        if let Some(m) = &self.moe {
            m.validate(self.num_layers)?;
        }
        if let Some(l) = &self.linear {
            l.validate(self.num_layers)?;
        }
        ensure!(
            self.rope_dims > 0 && self.rope_dims <= self.head_dim && self.rope_dims.is_multiple_of(2),
            "{} rotated dimensions of a {}-dim head",
            self.rope_dims,
            self.head_dim
        );
        if let Some(g) = &self.global_attn {
            ensure!(g.kv_heads > 0 && g.kv_heads <= 1 << 16, "global KV heads {} out of range", g.kv_heads);
            ensure!(
                g.head_dim > 0 && g.head_dim <= 1 << 16 && g.head_dim.is_multiple_of(2),
                "global head_dim {} must be even and within 2..=2^16",
                g.head_dim
            );
            ensure!(
                self.num_heads.is_multiple_of(g.kv_heads),
                "{} attention heads is not a multiple of {} global KV heads",
                self.num_heads,
                g.kv_heads
            );
            ensure!(
                g.rotated_pairs <= g.head_dim / 2,
                "{} rotated pairs of a {}-dim head",
                g.rotated_pairs,
                g.head_dim
            );
            ensure!(
                g.rope_theta.is_finite() && g.rope_theta > 0.0,
                "global RoPE base {} is not positive",
                g.rope_theta
            );
        }
        if let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            ..
        } = self.rope_scaling
        {
            for (what, x) in [
                ("factor", factor),
                ("original context", original_max_position_embeddings),
                ("beta_fast", beta_fast),
                ("beta_slow", beta_slow),
                ("attention factor", attention_factor),
            ] {
                ensure!(x.is_finite() && x > 0.0, "YaRN {what} {x} is not a positive finite number");
            }
        }
        if let RopeScaling::Linear(f) = self.rope_scaling {
            ensure!(f.is_finite() && f > 0.0, "RoPE scaling factor {f} is not positive");
        }
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

    /// The mixture of experts of layer `i`, if its MLP is one.
    pub fn layer_moe(&self, i: usize) -> Option<&MoeConfig> {
        self.moe.as_ref().filter(|m| !m.dense_layers.contains(&i))
    }

    /// Weights multiplied per token (every linear layer, the experts a token is routed to,
    /// routers and the LM head): a token costs twice this many FLOPs in matrix multiplies.
    pub fn matmul_params(&self) -> usize {
        let (d, f) = (self.hidden_size, self.intermediate_size);
        let attn = |i| match &self.linear {
            // q, k, v, the output gate, β and the decay's input; the output projection.
            Some(l) if self.layer_linear(i) => {
                let v = l.value_heads * l.value_dim;
                d * (l.conv_dim() + v + 2 * l.value_heads) + v * d
            }
            _ => {
                let kv = self.layer_kv(i);
                let q = self.num_heads * kv.head_dim * if self.attn_gate { 2 } else { 1 };
                d * (q + 2 * kv.kv_heads * kv.head_dim) + self.num_heads * kv.head_dim * d
            }
        };
        let mlp = |i| match self.layer_moe(i) {
            Some(m) => {
                let shared = m.shared_ffn.map_or(0, |s| 3 * d * s + d);
                m.top_k * 3 * d * m.expert_ffn + m.num_experts * d + if m.dense_beside { 3 * d * f } else { 0 } + shared
            }
            None => 3 * d * f,
        };
        (0..self.num_layers).map(|i| attn(i) + mlp(i)).sum::<usize>() + self.vocab_size * d
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The global layer shape of layer `i`, if it is a global layer with one of its own.
    pub fn layer_global(&self, i: usize) -> Option<&GlobalAttn> {
        self.global_attn.as_ref().filter(|_| self.layer_window(i).is_none())
    }

    /// Layer `i`'s KV heads and head size.
    pub fn layer_kv(&self, i: usize) -> KvShape {
        if self.layer_linear(i) {
            // A DeltaNet layer keeps a fixed-size state per sequence instead.
            return KvShape { kv_heads: 0, head_dim: self.head_dim };
        }
        match self.layer_global(i) {
            Some(g) => KvShape { kv_heads: g.kv_heads, head_dim: g.head_dim },
            None => KvShape { kv_heads: self.num_kv_heads, head_dim: self.head_dim },
        }
    }

    /// Every layer's [`Self::layer_kv`]: the KV cache's geometry.
    pub fn kv_shapes(&self) -> Vec<KvShape> {
        (0..self.num_layers).map(|i| self.layer_kv(i)).collect()
    }

    /// Whether layer `i` is a gated DeltaNet layer (Qwen3.5) rather than attention.
    pub fn layer_linear(&self, i: usize) -> bool {
        self.linear.as_ref().is_some_and(|l| l.layers.get(i) == Some(&true))
    }

    /// Floats of one sequence's recurrent state over every DeltaNet layer (0 for a model
    /// that attends in every layer).
    pub fn state_floats(&self) -> usize {
        self.linear.as_ref().map_or(0, |l| l.layers.iter().filter(|&&x| x).count() * l.state_floats())
    }
}
