//! The decoder forward pass over a ragged batch: all rows of a step (prefill chunks and
//! decode tokens of many sequences, no padding) go through every projection as one matrix
//! multiply, so each weight is read once per step; attention runs per sequence over its
//! own paged K/V. One pass serves every family (see [`Arch`]); what differs is a handful
//! of optional pieces of a layer, present only where the family has them.

use super::config::{Activation, Arch, ModelConfig, RopeScaling};
use super::delta_net::{self, DeltaNet};
use super::loader::WeightSource;
use super::moe::{self, Experts};
use super::resize;
use super::tensor::{HalfRows, Tensor};
use super::weight::{Weight, WeightDtype};
use crate::kernels::attention::{attend, softcap, KvSpan, Scoring, Scratch};
use crate::kernels::norm::{gelu_tanh_mul, relu2_mul, rmsnorm_in_place, swiglu_oai_mul};
use crate::kernels::qmatmul::{QActs, QMatrix};
use crate::kernels::quant::GgmlType;
use crate::kernels::rope::Rope;
use crate::kernels::{rmsnorm, silu_mul};
use crate::kv::{KvCache, KvCacheDtype, KvDtype, KvShape};
use anyhow::{ensure, Result};
use rayon::prelude::*;

struct Layer {
    attn_norm: Tensor,
    mixer: Mixer,
    /// Normalizes the attention output before the residual add (Gemma 2).
    post_attn_norm: Option<Tensor>,
    ffn_norm: Tensor,
    mlp: Mlp,
    /// Normalizes the MLP output before the residual add (Gemma 2).
    post_ffn_norm: Option<Tensor>,
    /// Multiplies the hidden state at the end of the layer (Gemma 4's `layer_scalar`).
    out_scale: Option<f32>,
}

/// What mixes a layer's positions: attention over the paged KV cache, or a gated DeltaNet
/// over a recurrent state (Qwen3.5's linear layers).
enum Mixer {
    Attention(Box<Attention>),
    Delta(Box<DeltaNet>),
}

struct Attention {
    /// Its KV heads and head size (Gemma 4's global layers have their own).
    kv: KvShape,
    /// q, k and v projections stacked: `[q_dim + 2 kv_dim, hidden]` (where V is K's
    /// projection, Gemma 4's `attention_k_eq_v`, k's rows twice). With an output gate, q's
    /// rows are twice as many, each head's query then its gate (Qwen3.5).
    wqkv: Weight,
    /// The output is multiplied by σ of a gate q_proj emits per head (Qwen3.5).
    gated: bool,
    /// Their biases, stacked the same way (Qwen2).
    qkv_bias: Option<Tensor>,
    /// Per-head RMSNorm weights of q and k, applied before RoPE (Qwen3).
    qk_norm: Option<(Tensor, Tensor)>,
    /// Per-head RMSNorm of v without a scale (ones here; Gemma 4).
    v_norm: Option<Tensor>,
    /// Normalizes the attention output before `wo` (BitNet's `attn_sub_norm`).
    attn_sub_norm: Option<Tensor>,
    wo: Weight,
    /// The output projection's bias (gpt-oss).
    o_bias: Option<Tensor>,
    /// One learned logit per query head in each softmax's denominator (gpt-oss).
    sinks: Option<Tensor>,
    /// Attention sees only the last `W` positions.
    window: Option<usize>,
}

/// A dense gated MLP.
struct Dense {
    /// gate and up projections stacked: `[2 intermediate, hidden]`.
    gate_up: Weight,
    /// Normalizes the gated activation before `down` (BitNet's `ffn_sub_norm`).
    sub_norm: Option<Tensor>,
    down: Weight,
}

/// A layer's MLP: one for every token, a mixture of experts, or both side by side.
enum Mlp {
    Dense(Dense),
    Experts(Experts),
    /// Gemma 4: the dense MLP on the pre-MLP norm's output, normalised by `post_dense`;
    /// the experts on the residual stream normalised by `pre_experts` (routed from the
    /// residual stream itself), normalised by `post_experts`; the two added.
    Beside(Box<Beside>),
}

/// [`Mlp::Beside`]'s parts.
struct Beside {
    dense: Dense,
    experts: Experts,
    post_dense: Tensor,
    pre_experts: Tensor,
    post_experts: Tensor,
}

impl Layer {
    /// Bytes of the layer's two norms.
    fn norm_bytes(&self) -> usize {
        4 * (self.attn_norm.data().len() + self.ffn_norm.data().len())
    }

    /// The matrices of its attention or DeltaNet.
    fn mixer_matrices(&self) -> Vec<&Weight> {
        match &self.mixer {
            Mixer::Attention(a) => vec![&a.wqkv, &a.wo],
            Mixer::Delta(d) => d.matrices(),
        }
    }

    /// The layer's weight matrices.
    fn matrices(&self) -> Vec<&Weight> {
        let mut all = self.mixer_matrices();
        match &self.mlp {
            Mlp::Dense(m) => all.extend([&m.gate_up, &m.down]),
            Mlp::Experts(x) => all.extend(x.matrices()),
            Mlp::Beside(b) => {
                all.extend([&b.dense.gate_up, &b.dense.down]);
                all.extend(b.experts.matrices());
            }
        }
        all
    }

    /// Bytes of weights one token reads (of a mixture's experts, the share it is routed to).
    fn bytes_per_token(&self) -> usize {
        let attn: usize = self.mixer_matrices().iter().map(|w| w.bytes()).sum();
        attn + match &self.mlp {
            Mlp::Dense(m) => m.gate_up.bytes() + m.down.bytes(),
            Mlp::Experts(x) => x.bytes_per_token(),
            Mlp::Beside(b) => b.dense.gate_up.bytes() + b.dense.down.bytes() + b.experts.bytes_per_token(),
        }
    }

    /// Multiply-adds per token by block format (`None`: f32).
    fn products_per_token(&self) -> Vec<(Option<GgmlType>, usize)> {
        let mut all: Vec<_> = self.mixer_matrices().into_iter().flat_map(Weight::products).collect();
        let dense = |m: &Dense| m.gate_up.products().into_iter().chain(m.down.products()).collect::<Vec<_>>();
        match &self.mlp {
            Mlp::Dense(m) => all.extend(dense(m)),
            Mlp::Experts(x) => all.extend(x.products_per_token()),
            Mlp::Beside(b) => {
                all.extend(dense(&b.dense));
                all.extend(b.experts.products_per_token());
            }
        }
        all
    }
}

/// Rotary embeddings: one table, or Phi-3's longrope pair chosen by sequence length.
enum Rotary {
    One(Rope),
    /// (short, long, the length beyond which the long factors apply).
    LongRope(Rope, Rope, usize),
}

impl Rotary {
    fn for_len(&self, seq_len: usize) -> &Rope {
        match self {
            Rotary::One(r) => r,
            Rotary::LongRope(short, long, original) => {
                if seq_len > *original {
                    long
                } else {
                    short
                }
            }
        }
    }
}

/// Untied token embeddings: a lookup table, never multiplied, so it stays as loaded
/// (memory-mapped f32 where the file allows), 16-bit, or in its block format.
enum Embeddings {
    Rows(Tensor),
    Half(HalfRows),
    Blocks(QMatrix),
}

impl Embeddings {
    fn row_into(&self, tok: usize, out: &mut [f32]) {
        let d = out.len();
        match self {
            Embeddings::Rows(t) => out.copy_from_slice(&t.data()[tok * d..(tok + 1) * d]),
            Embeddings::Half(rows) => rows.row_into(tok, out),
            Embeddings::Blocks(q) => q.row_into(tok, out),
        }
    }
}

pub struct Decoder {
    pub config: ModelConfig,
    /// Embeddings; `None` when tied, then rows come from the LM head.
    embed: Option<Embeddings>,
    /// Multiplies embeddings (Gemma 2: √hidden).
    embed_scale: Option<f32>,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Weight,
    /// The rotary table (of the global layers, where the sliding ones have their own).
    rope: Rotary,
    /// The sliding layers' own rotary table (Gemma 3 and 4).
    rope_local: Option<Rope>,
}

/// One sequence's part of a step: `num_tokens` new tokens at positions
/// `context_len..context_len + num_tokens`, whose K/V go into `block_table`.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub context_len: usize,
    pub num_tokens: usize,
    /// The length that longrope picks the factors of the prompt's rows by: the whole
    /// prompt, for every chunk of a chunked prefill; a row past it (a decode's, a draft's,
    /// one computed again after a preemption) picks by its own position + 1. So each row
    /// takes what transformers gives it, prompt in one call then a token at a time, however
    /// the engine steps it.
    pub seq_len: usize,
    pub block_table: &'a [u32],
    /// Its slot in the recurrent state cache ([`crate::kv::StateCache`]; hybrid models).
    pub state_slot: usize,
    /// Snapshots of the recurrent state to take: after the token at position `p`, into
    /// snapshot slot `s` (block boundaries of a prefix the prefix cache keeps).
    pub captures: &'a [(usize, u32)],
    /// How many of this part's last rows want logits: 1 for the token to sample, 1 + k when
    /// k draft tokens are verified, 0 for a prefill chunk that does not end the prompt.
    pub logits: usize,
    /// How many of its last rows' final hidden states (after the final norm) to keep in
    /// [`Workspace::hidden`]: what an embedding is pooled from.
    pub hidden: usize,
}

impl<'a> SeqStep<'a> {
    /// `num_tokens` tokens after `context_len` that end the sequence's known tokens,
    /// sampled after the last: a plain generation loop (benchmarks, perplexity, reference
    /// checks).
    pub fn sampled(context_len: usize, num_tokens: usize, block_table: &'a [u32]) -> Self {
        SeqStep {
            context_len,
            num_tokens,
            seq_len: context_len + num_tokens,
            block_table,
            state_slot: 0,
            captures: &[],
            logits: 1,
            hidden: 0,
        }
    }
}

/// A step: the tokens of all sequences, concatenated in `seqs` order.
pub struct StepInput<'a> {
    pub tokens: &'a [u32],
    pub seqs: &'a [SeqStep<'a>],
}

/// Activation buffers reused across steps.
#[derive(Default)]
pub struct Workspace {
    h: Vec<f32>,
    xn: Vec<f32>,
    /// The experts' normalised input and their output, beside a dense MLP (Gemma 4).
    xn2: Vec<f32>,
    tmp2: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    tmp: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    last: Vec<f32>,
    logits: Vec<f32>,
    /// The kept final hidden states, `SeqStep::hidden` rows per sequence in step order.
    hidden: Vec<f32>,
    /// Activations quantized for block-format weights.
    xq: QActs,
    moe: moe::Scratch,
    delta: delta_net::Scratch,
}

impl Workspace {
    /// The mixture layers' statistics since the last call (zero for a dense model).
    /// The last step's kept final hidden states ([`SeqStep::hidden`]), row after row.
    pub fn hidden(&self) -> &[f32] {
        &self.hidden
    }

    pub fn take_moe_stats(&mut self) -> moe::Stats {
        std::mem::take(&mut self.moe.stats)
    }
}

/// Rows per task when row-wise work (norms, RoPE, SwiGLU) is spread over the pool.
const ROWS_PER_TASK: usize = 8;

/// Whether any of the layers' matrices is computed in a block format.
fn in_block_formats(layers: &[Layer]) -> bool {
    layers.iter().any(|l| l.matrices().into_iter().any(|w| matches!(w, Weight::Quant(_))))
}

/// Logits per row that a quantized LM head recomputes in f32 ([`Weight::refine_top`]).
const EXACT_TOP_LOGITS: usize = 16;

/// Kv heads that one attention task reads for its row: all of them when the step has rows
/// enough to keep the cores busy (at least four per thread), so that each block's K and V,
/// every kv head side by side, are one contiguous read; else one, so that the few rows of a
/// decode step still spread over the cores. A head's result is the same either way.
fn attention_task_heads(rows: usize, kv_heads: usize) -> usize {
    if rows >= 4 * rayon::current_num_threads() {
        kv_heads
    } else {
        1
    }
}

/// `[rows, width]` data in parallel chunks of [`ROWS_PER_TASK`] rows.
fn rows_par(x: &[f32], width: usize) -> rayon::slice::Chunks<'_, f32> {
    x.par_chunks(width * ROWS_PER_TASK)
}

fn rows_par_mut(x: &mut [f32], width: usize) -> rayon::slice::ChunksMut<'_, f32> {
    x.par_chunks_mut(width * ROWS_PER_TASK)
}

/// `h += delta` (or `h += rmsnorm(delta)` with a `post` norm), then `h *= scale` where one
/// is given, then `xn = rmsnorm(h)` when a `next` norm is given; rows of width `d`.
/// `delta` is scratch.
#[allow(clippy::too_many_arguments)]
fn add_and_norm(
    h: &mut [f32],
    delta: &mut [f32],
    post: Option<&[f32]>,
    scale: Option<f32>,
    next: Option<&[f32]>,
    eps: f32,
    xn: &mut [f32],
    d: usize,
) {
    rows_par_mut(h, d).zip(rows_par_mut(delta, d)).zip(rows_par_mut(xn, d)).for_each(|((h, delta), xn)| {
        if let Some(w) = post {
            rmsnorm_in_place(delta, w, eps);
        }
        h.iter_mut().zip(delta.iter()).for_each(|(a, b)| *a += b);
        if let Some(s) = scale {
            h.iter_mut().for_each(|a| *a *= s);
        }
        if let Some(w) = next {
            rmsnorm(h, w, eps, xn);
        }
    });
}

impl Dense {
    /// `out = down(act(gate_up(x)))` for the `t` rows of `x`, of intermediate width `f`;
    /// `gate_up` and `act` scratch.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &[f32],
        t: usize,
        f: usize,
        activation: moe::Activation,
        eps: f32,
        xq: &mut QActs,
        gate_up: &mut [f32],
        act: &mut [f32],
        out: &mut [f32],
    ) {
        self.gate_up.matmul(x, xq, gate_up, t);
        let sub_norm = self.sub_norm.as_ref().map(Tensor::data);
        rows_par(gate_up, 2 * f).zip(rows_par_mut(act, f)).for_each(|(gu, act)| {
            activation(gu, f, act);
            if let Some(w) = sub_norm {
                rmsnorm_in_place(act, w, eps);
            }
        });
        self.down.matmul(act, xq, out, t);
    }
}

impl Decoder {
    /// Loads the weights in the form `dtype` asks for ([`Weight::load`]).
    pub fn load(config: ModelConfig, src: &dyn WeightSource, dtype: WeightDtype) -> Result<Self> {
        let c = &config;
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let gemma = matches!(c.arch, Arch::Gemma2 | Arch::Gemma3);
        // Qwen3.5's norms are (1 + w) too, but for its DeltaNet layers' gated one.
        let one_plus = gemma || c.arch == Arch::Qwen35;
        // Gemma 4 has Gemma's scaled embeddings and post-norms, but plain (w) norms.
        let gemma_layout = gemma || c.arch == Arch::Gemma4;
        let bitnet = c.arch == Arch::BitNet;
        // BitNet's projections are ternary: computed as TQ2_0 blocks unless `dtype` is f32.
        let load = |parts: &[(&str, [usize; 2])]| {
            if bitnet {
                Weight::load_ternary(src, parts, dtype)
            } else {
                Weight::load(src, parts, dtype)
            }
        };
        // Gemma's norms multiply by (1 + w); llama.cpp's converter stores the sum.
        let add_one = one_plus && !src.norms_include_one();
        let norm = |name: &str, len: usize| -> Result<Tensor> {
            let t = src.load(name, &[len])?;
            Ok(if add_one { Tensor::owned(vec![len], t.data().iter().map(|w| 1.0 + w).collect()) } else { t })
        };
        // Grown layer by layer: a layer count from an untrusted file allocates nothing
        // until that layer's tensors are found in it.
        let mut layers = Vec::new();
        // Where each DeltaNet layer's state starts in a sequence's slot.
        let mut state_at = 0;
        for i in 0..c.num_layers {
            let name = |s: &str| format!("model.layers.{i}.{s}.weight");
            let attn = |p: &str, kind: &str| format!("model.layers.{i}.self_attn.{p}.{kind}");
            let mixer = match &c.linear {
                Some(l) if c.layer_linear(i) => {
                    let delta = DeltaNet::load(src, i, l, d, state_at, dtype)?;
                    state_at += l.state_floats();
                    Mixer::Delta(Box::new(delta))
                }
                _ => {
                    let kv = c.layer_kv(i);
                    let (hd, q_dim, kv_dim) = (kv.head_dim, c.num_heads * kv.head_dim, kv.kv_heads * kv.head_dim);
                    // Where V is K's projection (Gemma 4's global layers), k's rows come twice.
                    let k_eq_v = c.layer_global(i).is_some_and(|g| g.k_eq_v);
                    let qkv_parts = [
                        (attn("q_proj", "weight"), [q_dim * if c.attn_gate { 2 } else { 1 }, d]),
                        (attn("k_proj", "weight"), [kv_dim, d]),
                        (attn(if k_eq_v { "k_proj" } else { "v_proj" }, "weight"), [kv_dim, d]),
                    ];
                    let wqkv = if c.arch == Arch::Phi3 {
                        load(&[(&attn("qkv_proj", "weight"), [q_dim + 2 * kv_dim, d])])?
                    } else {
                        load(&qkv_parts.each_ref().map(|(n, s)| (n.as_str(), *s)))?
                    };
                    let qkv_bias = if c.qkv_bias {
                        let mut all = Vec::with_capacity(q_dim + 2 * kv_dim);
                        for (p, len) in [("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)] {
                            all.extend_from_slice(src.load(&attn(p, "bias"), &[len])?.data());
                        }
                        Some(Tensor::owned(vec![all.len()], all))
                    } else {
                        None
                    };
                    let qk_norm = match c.arch {
                        Arch::Qwen3 => Some((
                            src.load(&attn("q_norm", "weight"), &[hd])?,
                            src.load(&attn("k_norm", "weight"), &[hd])?,
                        )),
                        // Gemma's (1 + w) form, as its other norms (Gemma 4's are plain).
                        Arch::Gemma3 | Arch::Gemma4 | Arch::Qwen35 => {
                            Some((norm(&attn("q_norm", "weight"), hd)?, norm(&attn("k_norm", "weight"), hd)?))
                        }
                        _ => None,
                    };
                    let v_norm = (c.arch == Arch::Gemma4).then(|| Tensor::owned(vec![hd], vec![1.0; hd]));
                    let o_bias = if c.o_bias { Some(src.load(&attn("o_proj", "bias"), &[d])?) } else { None };
                    let sinks = if c.arch == Arch::GptOss {
                        Some(src.load(&format!("model.layers.{i}.self_attn.sinks"), &[c.num_heads])?)
                    } else {
                        None
                    };
                    let attn_sub_norm =
                        if bitnet { Some(norm(&name("self_attn.attn_sub_norm"), c.q_dim())?) } else { None };
                    Mixer::Attention(Box::new(Attention {
                        kv,
                        wqkv,
                        gated: c.attn_gate,
                        qkv_bias,
                        qk_norm,
                        v_norm,
                        attn_sub_norm,
                        wo: load(&[(&attn("o_proj", "weight"), [d, q_dim])])?,
                        o_bias,
                        sinks,
                        window: c.layer_window(i),
                    }))
                }
            };
            let dense = || -> Result<Dense> {
                let gate_up = if c.arch == Arch::Phi3 {
                    load(&[(&name("mlp.gate_up_proj"), [2 * f, d])])?
                } else {
                    load(&[(&name("mlp.gate_proj"), [f, d]), (&name("mlp.up_proj"), [f, d])])?
                };
                let sub_norm = if bitnet { Some(norm(&name("mlp.ffn_sub_norm"), f)?) } else { None };
                Ok(Dense { gate_up, sub_norm, down: load(&[(&name("mlp.down_proj"), [d, f])])? })
            };
            let mlp = match c.layer_moe(i) {
                Some(m) if m.dense_beside => Mlp::Beside(Box::new(Beside {
                    dense: dense()?,
                    experts: Experts::load(src, i, m, d, c.rms_norm_eps, dtype)?,
                    post_dense: norm(&name("post_feedforward_layernorm_1"), d)?,
                    pre_experts: norm(&name("pre_feedforward_layernorm_2"), d)?,
                    post_experts: norm(&name("post_feedforward_layernorm_2"), d)?,
                })),
                Some(m) => Mlp::Experts(Experts::load(src, i, m, d, c.rms_norm_eps, dtype)?),
                None => Mlp::Dense(dense()?),
            };
            let out_scale = if c.arch == Arch::Gemma4 {
                let s = src.load(&format!("model.layers.{i}.layer_scalar"), &[1])?.data()[0];
                ensure!(s.is_finite(), "layer {i}'s layer_scalar is {s}");
                Some(s)
            } else {
                None
            };
            let (post_attn_norm, ffn_norm, post_ffn_norm) = if gemma_layout {
                (
                    Some(norm(&name("post_attention_layernorm"), d)?),
                    norm(&name("pre_feedforward_layernorm"), d)?,
                    Some(norm(&name("post_feedforward_layernorm"), d)?),
                )
            } else {
                (None, norm(&name("post_attention_layernorm"), d)?, None)
            };
            layers.push(Layer {
                attn_norm: norm(&name("input_layernorm"), d)?,
                mixer,
                post_attn_norm,
                ffn_norm,
                mlp,
                post_ffn_norm,
                out_scale,
            });
        }
        let final_norm = norm("model.norm.weight", d)?;
        let emb = [("model.embed_tokens.weight", [c.vocab_size, d])];
        let quantized = in_block_formats(&layers);
        let (embed, lm_head) = if c.tie_word_embeddings && !src.contains("lm_head.weight") {
            (None, Weight::load_head(src, emb[0].0, emb[0].1, dtype, quantized)?)
        } else {
            let embed = match (Weight::load_blocks(src, &emb, dtype)?, Weight::load_half(src, &emb, dtype)?) {
                (Some(q), _) => Embeddings::Blocks(q),
                (None, Some(rows)) => Embeddings::Half(rows),
                (None, None) => Embeddings::Rows(src.load(emb[0].0, &emb[0].1)?),
            };
            (Some(embed), Weight::load_head(src, "lm_head.weight", [c.vocab_size, d], dtype, quantized)?)
        };
        let rope = Self::rotary(c, src)?;
        let rope_local = c.rope_local_theta.map(|theta| {
            Rope::with_inv_freq(crate::kernels::rope::inv_freq(c.head_dim, theta), 1.0, c.max_position_embeddings)
        });
        let embed_scale = gemma_layout.then(|| (d as f32).sqrt());
        Ok(Decoder { config, embed, embed_scale, layers, norm: final_norm, lm_head, rope, rope_local })
    }

    /// The rotary tables the configuration (and, in GGUF files of Llama 3.x, the
    /// `rope_freqs` tensor) asks for.
    fn rotary(c: &ModelConfig, src: &dyn WeightSource) -> Result<Rotary> {
        if let RopeScaling::LongRope { short, long, original_max_position_embeddings, attention_factor } =
            &c.rope_scaling
        {
            // As transformers: 1 / (factor · θ^(2i/d)), the product rounded once.
            let table = |factors: &[f32]| -> Rope {
                let inv: Vec<f32> = (0..c.head_dim / 2)
                    .map(|i| 1.0 / (factors[i] * c.rope_theta.powf((2 * i) as f32 / c.head_dim as f32)))
                    .collect();
                Rope::with_inv_freq(inv, *attention_factor, c.max_position_embeddings)
            };
            return Ok(Rotary::LongRope(table(short), table(long), *original_max_position_embeddings));
        }
        let (head_dim, mut inv_freq) = match &c.global_attn {
            // Gemma 4's global layers: proportional RoPE, the frequencies past
            // `rotated_pairs` still.
            Some(g) => {
                let mut inv_freq = crate::kernels::rope::inv_freq(g.head_dim, g.rope_theta);
                inv_freq[g.rotated_pairs..].fill(0.0);
                (g.head_dim, inv_freq)
            }
            // Partial RoPE (Qwen3.5) turns the first `rope_dims` as a RoPE of that width.
            None => {
                let mut inv_freq = crate::kernels::rope::inv_freq(c.rope_dims, c.rope_theta);
                c.rope_scaling.apply(&mut inv_freq, c.rope_theta);
                (c.rope_dims, inv_freq)
            }
        };
        // GGUF files carry Llama 3.x's scaling, and Gemma 4's still frequencies (1e30), as
        // per-frequency divisors.
        if src.contains("rope_freqs.weight") {
            let divisors = src.load("rope_freqs.weight", &[head_dim / 2])?;
            for (f, &d) in inv_freq.iter_mut().zip(divisors.data()) {
                ensure!(d.is_finite() && d > 0.0, "rope_freqs holds {d}, not a positive divisor");
                *f /= d;
            }
        }
        Ok(Rotary::One(Rope::with_inv_freq(inv_freq, c.rope_scaling.attention_factor(), c.max_position_embeddings)))
    }

    /// Whether the matrices are computed in a block format (then approximate anyway, so an
    /// f16 KV cache is the default).
    pub fn quantized(&self) -> bool {
        in_block_formats(&self.layers)
    }

    /// The KV cache element type `choice` comes to for this model: f16 by default where
    /// the matrices are approximate anyway, except for BitNet, whose int8 activation
    /// rounding amplifies the f16 cache's (tiny-bitnet, teacher-forced top-1 agreement with
    /// transformers: f16 cache 94.6 %, f32 cache 100 %).
    pub fn kv_dtype(&self, choice: KvCacheDtype) -> KvDtype {
        choice.resolve(self.quantized() && self.config.arch != Arch::BitNet)
    }

    /// Bytes of weights read by one step (the decode bandwidth bound).
    /// Of a mixture of experts, one token's share: the experts it is routed to.
    pub fn weight_bytes(&self) -> usize {
        // Biases and q/k norms are small enough to leave out of this estimate.
        let layer: usize = self.layers.iter().map(|l| l.norm_bytes() + l.bytes_per_token()).sum();
        layer + 4 * self.norm.data().len() + self.lm_head.bytes()
    }

    /// Bytes the weights take in memory: every matrix (of a mixture, every expert), the
    /// untied embeddings and the norms.
    pub fn resident_bytes(&self) -> usize {
        let layers: usize =
            self.layers.iter().map(|l| l.norm_bytes() + l.matrices().iter().map(|w| w.bytes()).sum::<usize>()).sum();
        let embed = match &self.embed {
            Some(Embeddings::Rows(t)) => 4 * t.data().len(),
            Some(Embeddings::Half(rows)) => rows.owned_bytes(),
            Some(Embeddings::Blocks(q)) => q.bytes(),
            None => 0,
        };
        layers + embed + 4 * self.norm.data().len() + self.lm_head.resident_bytes()
    }

    /// A line for the log: the weights' memory and, where it differs (a mixture of
    /// experts), what one token reads of them.
    pub fn weights_summary(&self) -> String {
        let (all, read) = (self.resident_bytes() / 1_000_000, self.weight_bytes() / 1_000_000);
        if self.config.moe.is_some() {
            format!("{all} MB of weights, {read} MB read per token")
        } else {
            format!("{all} MB of weights")
        }
    }

    /// Multiply-adds of the matrices per token, by block format (`None`: f32), largest
    /// first: what sets the matrices' ceiling at large batches (`weft bench`).
    pub fn products_by_format(&self) -> Vec<(Option<GgmlType>, usize)> {
        let mut by: Vec<(Option<GgmlType>, usize)> = Vec::new();
        let products = self.layers.iter().flat_map(Layer::products_per_token).chain(self.lm_head.products());
        for (t, n) in products {
            match by.iter_mut().find(|(u, _)| *u == t) {
                Some((_, sum)) => *sum += n,
                None => by.push((t, n)),
            }
        }
        by.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        by
    }

    /// Runs one step and returns the logits `[rows wanting them, vocab]`, in `seqs` order.
    pub fn forward<'w>(&self, input: &StepInput<'_>, kv: &mut KvCache, ws: &'w mut Workspace) -> &'w [f32] {
        let c = &self.config;
        let (d, f) = (c.hidden_size, c.intermediate_size);
        // The widest layer's q and (q, k, v) rows size the buffers.
        let attentions = self.layers.iter().filter_map(|l| match &l.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::Delta(_) => None,
        });
        let q_width = |a: &Attention| c.num_heads * a.kv.head_dim;
        let qkv_width = |a: &Attention| q_width(a) * if a.gated { 2 } else { 1 } + 2 * a.kv.kv_heads * a.kv.head_dim;
        let (max_q, max_qkv) = attentions.fold((0, 0), |(q, w), a| (q.max(q_width(a)), w.max(qkv_width(a))));
        let t = input.tokens.len();
        let total: usize = input.seqs.iter().map(|s| s.num_tokens).sum();
        assert_eq!(total, t, "step has {t} tokens but its sequences cover {total}");

        // Per-row (sequence index, position), so row-wise work needs no search.
        let mut rows = Vec::with_capacity(t);
        for (si, s) in input.seqs.iter().enumerate() {
            let end = s.context_len + s.num_tokens;
            assert!(end <= c.max_position_embeddings, "position {end} beyond the model's context");
            assert!(s.block_table.len() * kv.block_size() >= end, "block table too short for {end} tokens");
            rows.extend((s.context_len..end).map(|p| (si, p)));
        }

        // The DeltaNet layers' view of the step: each sequence's start and rows, and slot.
        let spans: Vec<delta_net::Span> = (input.seqs.iter())
            .map(|s| delta_net::Span { context_len: s.context_len, rows: s.num_tokens, captures: s.captures })
            .collect();
        let state_slots: Vec<usize> = input.seqs.iter().map(|s| s.state_slot).collect();

        let h = resize(&mut ws.h, t * d);
        for (row, &tok) in h.chunks_exact_mut(d).zip(input.tokens) {
            let tok = tok as usize;
            assert!(tok < c.vocab_size, "token id {tok} outside the vocabulary");
            match &self.embed {
                Some(e) => e.row_into(tok, row),
                None => self.lm_head.row_into(tok, row),
            }
            if let Some(s) = self.embed_scale {
                row.iter_mut().for_each(|x| *x *= s);
            }
        }
        let xn = resize(&mut ws.xn, t * d);
        let qkv_buf = resize(&mut ws.qkv, t * max_qkv);
        let attn_buf = resize(&mut ws.attn, t * max_q);
        let tmp = resize(&mut ws.tmp, t * d);
        // Only dense MLPs use these: a model whose every layer is a mixture (whose GGUF
        // may still name a dense width) allocates none.
        let dense_f = if self.layers.iter().any(|l| !matches!(l.mlp, Mlp::Experts(_))) { f } else { 0 };
        let gate_up = resize(&mut ws.gate_up, t * 2 * dense_f);
        let act = resize(&mut ws.act, t * dense_f);
        // The experts' input and output beside a dense MLP (Gemma 4).
        let beside = if self.layers.iter().any(|l| matches!(l.mlp, Mlp::Beside(_))) { t * d } else { 0 };
        let (xn2, tmp2) = (resize(&mut ws.xn2, beside), resize(&mut ws.tmp2, beside));
        let scoring = Scoring { scale: c.attn_scale, softcap: c.attn_softcap, sinks: None };

        let eps = c.rms_norm_eps;
        rows_par(h, d)
            .zip(rows_par_mut(xn, d))
            .for_each(|(h, xn)| rmsnorm(h, self.layers[0].attn_norm.data(), eps, xn));
        for (li, layer) in self.layers.iter().enumerate() {
            match &layer.mixer {
                Mixer::Delta(delta) => {
                    let states = &mut kv.states;
                    let slots = states.slots.many_mut(&state_slots);
                    delta.forward(xn, &spans, slots, &mut states.snapshots, eps, &mut ws.xq, &mut ws.delta, tmp);
                }
                Mixer::Attention(a) => {
                    let (hd, kv_heads) = (a.kv.head_dim, a.kv.kv_heads);
                    let (qd, kvd) = (c.num_heads * hd, kv_heads * hd);
                    // With an output gate, the row is then rearranged to [q | k | v | gate].
                    let width = qd * if a.gated { 2 } else { 1 } + 2 * kvd;
                    let qkv = &mut qkv_buf[..t * width];
                    let attn = &mut attn_buf[..t * qd];
                    a.wqkv.matmul(xn, &mut ws.xq, qkv, t);
                    rows_par_mut(qkv, width).zip(rows.par_chunks(ROWS_PER_TASK)).for_each(|(chunk, rows)| {
                        let mut gated = Vec::new();
                        for (row, &(si, pos)) in chunk.chunks_exact_mut(width).zip(rows) {
                            if a.gated {
                                // Per head, q_proj gave its query then its gate.
                                gated.clear();
                                gated.extend_from_slice(&row[..2 * qd]);
                                row.copy_within(2 * qd.., qd);
                                for (h, qg) in gated.chunks_exact(2 * hd).enumerate() {
                                    row[h * hd..(h + 1) * hd].copy_from_slice(&qg[..hd]);
                                    row[qd + 2 * kvd + h * hd..][..hd].copy_from_slice(&qg[hd..]);
                                }
                            }
                            if let Some(b) = &a.qkv_bias {
                                row.iter_mut().zip(b.data()).for_each(|(x, b)| *x += b);
                            }
                            let (qk, v) = row[..qd + 2 * kvd].split_at_mut(qd + kvd);
                            let (q, k) = qk.split_at_mut(qd);
                            if let Some((qn, kn)) = &a.qk_norm {
                                q.chunks_exact_mut(hd).for_each(|head| rmsnorm_in_place(head, qn.data(), eps));
                                k.chunks_exact_mut(hd).for_each(|head| rmsnorm_in_place(head, kn.data(), eps));
                            }
                            if let Some(vn) = &a.v_norm {
                                v.chunks_exact_mut(hd).for_each(|head| rmsnorm_in_place(head, vn.data(), eps));
                            }
                            let rope = match (&self.rope_local, a.window) {
                                (Some(local), Some(_)) => local,
                                _ => self.rope.for_len(input.seqs[si].seq_len.max(pos + 1)),
                            };
                            rope.apply_partial(q, pos, hd);
                            rope.apply_partial(k, pos, hd);
                        }
                    });
                    for (row, &(si, pos)) in qkv.chunks_exact(width).zip(&rows) {
                        let (k, v) = row[qd..qd + 2 * kvd].split_at(kvd);
                        kv.write(li, input.seqs[si].block_table, pos, k, v);
                    }
                    let view = kv.layer(li);
                    let qkv_ro: &[f32] = qkv;
                    // One task per row and run of `heads` kv heads (with their query heads).
                    let heads = attention_task_heads(t, kv_heads);
                    let (group_width, tasks_per_row) = (qd / kv_heads, kv_heads / heads);
                    let group = c.num_heads / kv_heads;
                    let sinks = a.sinks.as_ref().map(Tensor::data);
                    let task_width = group_width * heads;
                    attn.par_chunks_mut(task_width).enumerate().for_each_init(Scratch::default, |scratch, (i, out)| {
                        let (r, g) = (i / tasks_per_row, i % tasks_per_row * heads);
                        let (si, pos) = rows[r];
                        let first_pos = a.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                        let span = KvSpan { block_table: input.seqs[si].block_table, first_pos, last_pos: pos };
                        let q = &qkv_ro[r * width + g * group_width..][..task_width];
                        let scoring = Scoring { sinks: sinks.map(|s| &s[g * group..(g + heads) * group]), ..scoring };
                        attend(q, view.heads(g, heads), span, scoring, scratch, out);
                    });
                    if a.gated {
                        rows_par_mut(attn, qd).zip(rows_par(qkv_ro, width)).for_each(|(out, rows)| {
                            for (o, row) in out.chunks_exact_mut(qd).zip(rows.chunks_exact(width)) {
                                o.iter_mut().zip(&row[qd + 2 * kvd..]).for_each(|(x, &g)| *x /= 1.0 + (-g).exp());
                            }
                        });
                    }
                    if let Some(w) = &a.attn_sub_norm {
                        rows_par_mut(attn, qd).for_each(|rows| rmsnorm_in_place(rows, w.data(), eps));
                    }
                    a.wo.matmul(attn, &mut ws.xq, tmp, t);
                    if let Some(b) = &a.o_bias {
                        rows_par_mut(tmp, d).for_each(|rows| moe::add_bias(rows, b.data()));
                    }
                }
            }
            let post = layer.post_attn_norm.as_ref().map(Tensor::data);
            add_and_norm(h, tmp, post, None, Some(layer.ffn_norm.data()), eps, xn, d);

            let activation: moe::Activation = match c.activation {
                Activation::Silu => silu_mul,
                Activation::GeluTanh => gelu_tanh_mul,
                Activation::Relu2 => relu2_mul,
                Activation::SwigluOai => swiglu_oai_mul,
            };
            match &layer.mlp {
                Mlp::Dense(m) => m.forward(xn, t, f, activation, eps, &mut ws.xq, gate_up, act, tmp),
                Mlp::Experts(x) => x.forward(xn, xn, t, activation, &mut ws.moe, &mut ws.xq, tmp),
                Mlp::Beside(b) => {
                    let Beside { dense, experts, post_dense, pre_experts, post_experts } = &**b;
                    dense.forward(xn, t, f, activation, eps, &mut ws.xq, gate_up, act, tmp);
                    // The experts read the residual stream: routed from it as it is, and
                    // computed on it through their own pre-norm.
                    let h_ro: &[f32] = h;
                    rows_par(h_ro, d)
                        .zip(rows_par_mut(xn2, d))
                        .for_each(|(h, x)| rmsnorm(h, pre_experts.data(), eps, x));
                    experts.forward(h_ro, xn2, t, activation, &mut ws.moe, &mut ws.xq, tmp2);
                    rows_par_mut(tmp, d).zip(rows_par_mut(tmp2, d)).for_each(|(a, b)| {
                        rmsnorm_in_place(a, post_dense.data(), eps);
                        rmsnorm_in_place(b, post_experts.data(), eps);
                        a.iter_mut().zip(b.iter()).for_each(|(a, b)| *a += b);
                    });
                }
            }
            // The next layer's input norm, fused with the residual add.
            let post = layer.post_ffn_norm.as_ref().map(Tensor::data);
            let next = self.layers.get(li + 1).map(|l| l.attn_norm.data());
            add_and_norm(h, tmp, post, layer.out_scale, next, eps, xn, d);
        }

        // Final norm alone for the rows whose hidden state is kept.
        let mut kept = Vec::new();
        let mut start = 0;
        for s in input.seqs {
            start += s.num_tokens;
            kept.extend(start - s.hidden.min(s.num_tokens)..start);
        }
        let hidden = resize(&mut ws.hidden, kept.len() * d);
        rows_par_mut(hidden, d).zip(kept.par_chunks(ROWS_PER_TASK)).for_each(|(chunk, rows)| {
            for (dst, &r) in chunk.chunks_exact_mut(d).zip(rows) {
                rmsnorm(&h[r * d..(r + 1) * d], self.norm.data(), c.rms_norm_eps, dst);
            }
        });

        // Final norm and LM head only for the rows that want logits.
        let mut sampled = Vec::new();
        let mut start = 0;
        for s in input.seqs {
            start += s.num_tokens;
            sampled.extend(start - s.logits.min(s.num_tokens)..start);
        }
        let last = resize(&mut ws.last, sampled.len() * d);
        for (dst, &r) in last.chunks_exact_mut(d).zip(&sampled) {
            rmsnorm(&h[r * d..(r + 1) * d], self.norm.data(), c.rms_norm_eps, dst);
        }
        let logits = resize(&mut ws.logits, sampled.len() * c.vocab_size);
        if sampled.is_empty() {
            // A step of prompt chunks that end no prompt: the LM head has nothing to do.
            return logits;
        }
        self.lm_head.matmul(last, &mut ws.xq, logits, sampled.len());
        self.lm_head.refine_top(last, logits, sampled.len(), EXACT_TOP_LOGITS);
        if let Some(cap) = c.final_softcap {
            softcap(logits, cap);
        }
        logits
    }
}
