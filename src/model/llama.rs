//! The Llama forward pass over a ragged batch: all rows of a step (prefill chunks and
//! decode tokens of many sequences, no padding) go through every projection as one matrix
//! multiply, so each weight is read once per step; attention runs per sequence over its
//! own paged K/V.

use super::config::ModelConfig;
use super::loader::WeightSource;
use super::tensor::Tensor;
use super::weight::{Weight, WeightDtype};
use crate::kernels::attention::{attend, KvSpan, Scratch};
use crate::kernels::qmatmul::{QActs, QMatrix};
use crate::kernels::rope::Rope;
use crate::kernels::{rmsnorm, silu_mul};
use crate::kv::KvCache;
use anyhow::Result;
use rayon::prelude::*;

struct Layer {
    attn_norm: Tensor,
    /// q, k and v projections stacked: `[q_dim + 2 kv_dim, hidden]`.
    wqkv: Weight,
    wo: Weight,
    ffn_norm: Tensor,
    /// gate and up projections stacked: `[2 intermediate, hidden]`.
    w_gate_up: Weight,
    w_down: Weight,
}

/// Untied token embeddings: a lookup table, never multiplied, so it stays as loaded
/// (memory-mapped f32 where the file allows) or in its block format.
enum Embeddings {
    Rows(Tensor),
    Blocks(QMatrix),
}

impl Embeddings {
    fn row_into(&self, tok: usize, out: &mut [f32]) {
        match self {
            Embeddings::Rows(t) => out.copy_from_slice(&t.data()[tok * out.len()..(tok + 1) * out.len()]),
            Embeddings::Blocks(q) => q.row_into(tok, out),
        }
    }
}

pub struct Llama {
    pub config: ModelConfig,
    /// Embeddings; `None` when tied, then rows come from the LM head.
    embed: Option<Embeddings>,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Weight,
    rope: Rope,
}

/// One sequence's part of a step: `num_tokens` new tokens at positions
/// `context_len..context_len + num_tokens`, whose K/V go into `block_table`.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub context_len: usize,
    pub num_tokens: usize,
    pub block_table: &'a [u32],
    /// Whether logits are wanted for this sequence's last token.
    pub sample: bool,
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
    qkv: Vec<f32>,
    attn: Vec<f32>,
    tmp: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    last: Vec<f32>,
    logits: Vec<f32>,
    /// Activations quantized for block-format weights.
    xq: QActs,
}

/// Rows per task when row-wise work (norms, RoPE, SwiGLU) is spread over the pool.
const ROWS_PER_TASK: usize = 8;

/// `[rows, width]` data in parallel chunks of [`ROWS_PER_TASK`] rows.
fn rows_par(x: &[f32], width: usize) -> rayon::slice::Chunks<'_, f32> {
    x.par_chunks(width * ROWS_PER_TASK)
}

fn rows_par_mut(x: &mut [f32], width: usize) -> rayon::slice::ChunksMut<'_, f32> {
    x.par_chunks_mut(width * ROWS_PER_TASK)
}

/// `h += delta`, then `xn = rmsnorm(h)` when a norm weight is given; rows of width `d`.
fn add_and_norm(h: &mut [f32], delta: &[f32], norm: Option<&[f32]>, eps: f32, xn: &mut [f32], d: usize) {
    rows_par_mut(h, d).zip(rows_par(delta, d)).zip(rows_par_mut(xn, d)).for_each(|((h, delta), xn)| {
        h.iter_mut().zip(delta).for_each(|(a, b)| *a += b);
        if let Some(w) = norm {
            rmsnorm(h, w, eps, xn);
        }
    });
}

fn resize(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

impl Llama {
    /// Loads the weights, keeping block formats when `dtype` is `Auto`.
    pub fn load(config: ModelConfig, src: &dyn WeightSource, dtype: WeightDtype) -> Result<Self> {
        let c = &config;
        let (d, f) = (c.hidden_size, c.intermediate_size);
        // Grown layer by layer: a layer count from an untrusted file allocates nothing
        // until that layer's tensors are found in it.
        let mut layers = Vec::new();
        for i in 0..c.num_layers {
            let name = |s: &str| format!("model.layers.{i}.{s}.weight");
            let (q, k, v) = (name("self_attn.q_proj"), name("self_attn.k_proj"), name("self_attn.v_proj"));
            let (gate, up) = (name("mlp.gate_proj"), name("mlp.up_proj"));
            let wqkv = [(q.as_str(), [c.q_dim(), d]), (k.as_str(), [c.kv_dim(), d]), (v.as_str(), [c.kv_dim(), d])];
            layers.push(Layer {
                attn_norm: src.load(&name("input_layernorm"), &[d])?,
                wqkv: Weight::load(src, &wqkv, dtype)?,
                wo: Weight::load(src, &[(&name("self_attn.o_proj"), [d, c.q_dim()])], dtype)?,
                ffn_norm: src.load(&name("post_attention_layernorm"), &[d])?,
                w_gate_up: Weight::load(src, &[(&gate, [f, d]), (&up, [f, d])], dtype)?,
                w_down: Weight::load(src, &[(&name("mlp.down_proj"), [d, f])], dtype)?,
            });
        }
        let norm = src.load("model.norm.weight", &[d])?;
        let emb = [("model.embed_tokens.weight", [c.vocab_size, d])];
        let (embed, lm_head) = if c.tie_word_embeddings && !src.contains("lm_head.weight") {
            (None, Weight::load(src, &emb, dtype)?)
        } else {
            let embed = match Weight::load_blocks(src, &emb, dtype)? {
                Some(q) => Embeddings::Blocks(q),
                None => Embeddings::Rows(src.load(emb[0].0, &emb[0].1)?),
            };
            (Some(embed), Weight::load(src, &[("lm_head.weight", [c.vocab_size, d])], dtype)?)
        };
        let mut inv_freq = crate::kernels::rope::inv_freq(c.head_dim, c.rope_theta);
        c.rope_scaling.apply(&mut inv_freq);
        // GGUF files of Llama 3.x carry the scaling as per-frequency divisors.
        if src.contains("rope_freqs.weight") {
            let divisors = src.load("rope_freqs.weight", &[c.head_dim / 2])?;
            for (f, &d) in inv_freq.iter_mut().zip(divisors.data()) {
                anyhow::ensure!(d.is_finite() && d > 0.0, "rope_freqs holds {d}, not a positive divisor");
                *f /= d;
            }
        }
        let rope = Rope::with_inv_freq(inv_freq, c.max_position_embeddings);
        Ok(Llama { config, embed, layers, norm, lm_head, rope })
    }

    /// Bytes of weights read by one step (the decode bandwidth bound).
    pub fn weight_bytes(&self) -> usize {
        let norms = |l: &Layer| 4 * (l.attn_norm.data().len() + l.ffn_norm.data().len());
        let layer: usize = self
            .layers
            .iter()
            .map(|l| norms(l) + l.wqkv.bytes() + l.wo.bytes() + l.w_gate_up.bytes() + l.w_down.bytes())
            .sum();
        layer + 4 * self.norm.data().len() + self.lm_head.bytes()
    }

    /// Runs one step and returns the logits `[sampling sequences, vocab]`, in `seqs` order.
    pub fn forward<'w>(&self, input: &StepInput<'_>, kv: &mut KvCache, ws: &'w mut Workspace) -> &'w [f32] {
        let c = &self.config;
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (qd, kvd, f) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
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

        let h = resize(&mut ws.h, t * d);
        for (row, &tok) in h.chunks_exact_mut(d).zip(input.tokens) {
            let tok = tok as usize;
            assert!(tok < c.vocab_size, "token id {tok} outside the vocabulary");
            match &self.embed {
                Some(e) => e.row_into(tok, row),
                None => self.lm_head.row_into(tok, row),
            }
        }
        let xn = resize(&mut ws.xn, t * d);
        let qkv = resize(&mut ws.qkv, t * (qd + 2 * kvd));
        let attn = resize(&mut ws.attn, t * qd);
        let tmp = resize(&mut ws.tmp, t * d);
        let gate_up = resize(&mut ws.gate_up, t * 2 * f);
        let act = resize(&mut ws.act, t * f);
        let scale = 1.0 / (hd as f32).sqrt();

        let width = qd + 2 * kvd;
        let eps = c.rms_norm_eps;
        rows_par(h, d)
            .zip(rows_par_mut(xn, d))
            .for_each(|(h, xn)| rmsnorm(h, self.layers[0].attn_norm.data(), eps, xn));
        for (li, layer) in self.layers.iter().enumerate() {
            layer.wqkv.matmul(xn, &mut ws.xq, qkv, t);
            rows_par_mut(qkv, width).zip(rows.par_chunks(ROWS_PER_TASK)).for_each(|(chunk, rows)| {
                for (row, &(_, pos)) in chunk.chunks_exact_mut(width).zip(rows) {
                    let (q, k) = row[..qd + kvd].split_at_mut(qd);
                    self.rope.apply(q, pos);
                    self.rope.apply(k, pos);
                }
            });
            for (row, &(si, pos)) in qkv.chunks_exact(width).zip(&rows) {
                let (k, v) = row[qd..].split_at(kvd);
                kv.write(li, input.seqs[si].block_table, pos, k, v);
            }
            let view = kv.layer(li);
            let qkv_ro: &[f32] = qkv;
            attn.par_chunks_mut(qd).enumerate().for_each_init(Scratch::default, |scratch, (r, out)| {
                let (si, pos) = rows[r];
                let span = KvSpan { block_table: input.seqs[si].block_table, last_pos: pos };
                attend(&qkv_ro[r * width..r * width + qd], view, span, scale, scratch, out);
            });
            layer.wo.matmul(attn, &mut ws.xq, tmp, t);
            add_and_norm(h, tmp, Some(layer.ffn_norm.data()), eps, xn, d);

            layer.w_gate_up.matmul(xn, &mut ws.xq, gate_up, t);
            rows_par(gate_up, 2 * f).zip(rows_par_mut(act, f)).for_each(|(gu, act)| silu_mul(gu, f, act));
            layer.w_down.matmul(act, &mut ws.xq, tmp, t);
            // The next layer's input norm, fused with the residual add.
            add_and_norm(h, tmp, self.layers.get(li + 1).map(|l| l.attn_norm.data()), eps, xn, d);
        }

        // Final norm and LM head only for the last row of each sampling sequence.
        let mut sampled = Vec::new();
        let mut start = 0;
        for s in input.seqs {
            start += s.num_tokens;
            if s.sample && s.num_tokens > 0 {
                sampled.push(start - 1);
            }
        }
        let last = resize(&mut ws.last, sampled.len() * d);
        for (dst, &r) in last.chunks_exact_mut(d).zip(&sampled) {
            rmsnorm(&h[r * d..(r + 1) * d], self.norm.data(), c.rms_norm_eps, dst);
        }
        let logits = resize(&mut ws.logits, sampled.len() * c.vocab_size);
        self.lm_head.matmul(last, &mut ws.xq, logits, sampled.len());
        logits
    }
}
