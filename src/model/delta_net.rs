//! A gated DeltaNet layer (Qwen3.5's linear attention) over a ragged batch: one matrix
//! multiply projects every row of the step to q, k, v, the output gate, β and the decay's
//! input; then each sequence runs the short convolution and the delta rule over its own rows
//! from its own state slot ([`crate::kv::StateCache`]), its value heads in parallel; a gated
//! RMSNorm and the output projection close the layer. A sequence whose step starts at
//! position 0 starts from a zero state, whatever its slot held before.

use super::config::LinearAttn;
use super::loader::WeightSource;
use super::resize;
use super::tensor::Tensor;
use super::weight::{Weight, WeightDtype};
use crate::kernels::delta::{conv_step, delta_chunk, delta_step, l2norm, silu, softplus, ChunkScratch, Run, Token};
use crate::kernels::norm::rmsnorm_in_place;
use crate::kernels::qmatmul::QActs;
use crate::kv::StatePool;
use anyhow::{ensure, Result};
use rayon::prelude::*;
use std::ops::Range;

/// A prompt's rows go through the delta rule in runs that end at multiples of this many
/// positions (and where a state is captured or the step ends): a block of the prefix cache's
/// (16 by default) is whole runs, so a prompt resumed from a block's snapshot meets the same
/// runs as one computed whole, and the scheduler cuts prompts at multiples of it.
pub const RUN: usize = 16;

pub struct DeltaNet {
    shape: LinearAttn,
    /// q, k and v (the convolution's channels), z (the output gate), b (β's input) and a
    /// (the decay's input) stacked: `[conv_dim + value channels + 2 value heads, hidden]`.
    proj: Weight,
    /// The convolution's weights, `[conv_kernel][conv_dim]` (transposed from the files' layout
    /// so a token's channels are one vector).
    conv: Vec<f32>,
    /// Per value head, `−exp(A_log)`: the decay's rate.
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    /// The gated RMSNorm's weights, `[value_dim]`, shared by the heads.
    norm: Tensor,
    out: Weight,
    /// Where this layer's state starts in a sequence's slot.
    state_at: usize,
}

/// One sequence's part of a step, as the layer sees it.
pub struct Span<'a> {
    /// Tokens before this step's (0: the state starts from zero).
    pub context_len: usize,
    pub rows: usize,
    /// (position, snapshot slot): the state after that position's token is copied there.
    pub captures: &'a [(usize, u32)],
}

/// A state captured mid-step: its snapshot slot and values.
type Taken = (u32, Vec<f32>);

/// Buffers of [`DeltaNet::forward`], reused across steps.
#[derive(Default)]
pub struct Scratch {
    proj: Vec<f32>,
    /// The delta rule's outputs, head-major: `[value heads][rows][value_dim]`.
    heads: Vec<f32>,
    /// The gated, normalised outputs, `[rows][value channels]`.
    o: Vec<f32>,
}

impl DeltaNet {
    /// Layer `layer`'s weights under Hugging Face's names (`linear_attn.*`), whose state
    /// starts at `state_at` of a slot.
    pub fn load(
        src: &dyn WeightSource,
        layer: usize,
        shape: &LinearAttn,
        hidden: usize,
        state_at: usize,
        dtype: WeightDtype,
    ) -> Result<Self> {
        let at = |s: &str| format!("model.layers.{layer}.linear_attn.{s}");
        let (conv_dim, vh) = (shape.conv_dim(), shape.value_heads);
        let values = vh * shape.value_dim;
        let parts = [
            (at("in_proj_qkv.weight"), [conv_dim, hidden]),
            (at("in_proj_z.weight"), [values, hidden]),
            (at("in_proj_b.weight"), [vh, hidden]),
            (at("in_proj_a.weight"), [vh, hidden]),
        ];
        let proj = Weight::load(src, &parts.each_ref().map(|(n, s)| (n.as_str(), *s)), dtype)?;
        let k = shape.conv_kernel;
        // `[channels, 1, K]` in Hugging Face files, `[channels, K]` in GGUF ones.
        let conv_name = at("conv1d.weight");
        let conv = src.load(&conv_name, &[conv_dim, 1, k]).or_else(|_| src.load(&conv_name, &[conv_dim, k]))?;
        // Hugging Face files keep A_log; GGUF ones −exp(A_log), under a name of its own.
        let neg_a = if src.contains(&at("A_log")) {
            src.load(&at("A_log"), &[vh])?.data().iter().map(|a| -a.exp()).collect()
        } else {
            src.load(&at("neg_exp_A"), &[vh])?.data().to_vec()
        };
        ensure!(neg_a.iter().all(|a: &f32| a.is_finite()), "layer {layer}: a decay rate is not finite");
        Ok(DeltaNet {
            shape: shape.clone(),
            proj,
            conv: (0..k).flat_map(|j| conv.data().iter().skip(j).step_by(k).copied()).collect(),
            neg_a,
            dt_bias: src.load(&at("dt_bias"), &[vh])?.data().to_vec(),
            norm: src.load(&at("norm.weight"), &[shape.value_dim])?,
            out: Weight::load(src, &[(&at("out_proj.weight"), [hidden, values])], dtype)?,
            state_at,
        })
    }

    pub fn matrices(&self) -> Vec<&Weight> {
        vec![&self.proj, &self.out]
    }

    /// `out = layer(x)` for a step of sequences `seqs`, whose rows `x` holds in order;
    /// `slots` are their state slots, in the same order; the captures asked for are written
    /// into `snapshots`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &[f32],
        seqs: &[Span<'_>],
        slots: Vec<&mut [f32]>,
        snapshots: &mut StatePool,
        eps: f32,
        xq: &mut QActs,
        s: &mut Scratch,
        out: &mut [f32],
    ) {
        let l = &self.shape;
        let t: usize = seqs.iter().map(|s| s.rows).sum();
        let (conv_dim, vh, dk, dv) = (l.conv_dim(), l.value_heads, l.key_dim, l.value_dim);
        let (kh, values) = (l.key_heads, vh * dv);
        let width = conv_dim + values + 2 * vh;
        let proj = resize(&mut s.proj, t * width);
        self.proj.matmul(x, xq, proj, t);

        // Each sequence's state: the convolution's, and one matrix per value head.
        let conv_len = (l.conv_kernel - 1) * conv_dim;
        let mut convs = Vec::with_capacity(seqs.len());
        let mut mats: Vec<Vec<&mut [f32]>> = (0..vh).map(|_| Vec::with_capacity(seqs.len())).collect();
        for (seq, slot) in seqs.iter().zip(slots) {
            let state = &mut slot[self.state_at..self.state_at + l.state_floats()];
            if seq.context_len == 0 {
                state.fill(0.0);
            }
            let (conv, m) = state.split_at_mut(conv_len);
            convs.push(conv);
            m.chunks_exact_mut(dk * dv).zip(mats.iter_mut()).for_each(|(m, of_head)| of_head.push(m));
        }

        // Per sequence, token after token: the convolution, normalised q and k, β and the
        // decay's log, each written back into the row; the convolution's state where captured.
        let q_scale = 1.0 / (dk as f32).sqrt();
        let rows_of = split_rows(proj, seqs, width);
        let conv_taken: Vec<Vec<Taken>> = (rows_of.into_par_iter().zip(convs.par_iter_mut()).zip(seqs))
            .map(|((rows, conv), seq)| {
                let (mut taken, mut acc) = (Vec::new(), vec![0.0; conv_dim]);
                for (pos, row) in (seq.context_len..).zip(rows.chunks_exact_mut(width)) {
                    let (qkv, gates) = row.split_at_mut(conv_dim);
                    conv_step(conv, &self.conv, qkv, &mut acc);
                    let qk = &mut qkv[..2 * kh * dk];
                    qk.chunks_exact_mut(dk).for_each(l2norm);
                    qk[..kh * dk].iter_mut().for_each(|q| *q *= q_scale);
                    let (b, a) = gates[values..].split_at_mut(vh);
                    for h in 0..vh {
                        b[h] = 1.0 / (1.0 + (-b[h]).exp());
                        a[h] = self.neg_a[h] * softplus(a[h] + self.dt_bias[h]);
                    }
                    taken.extend(seq.captures.iter().filter(|c| c.0 == pos).map(|c| (c.1, conv.to_vec())));
                }
                taken
            })
            .collect();

        // The delta rule, one task per (value head, sequence), into head-major rows: each
        // run of a sequence's rows at once, or token by token where it is one row long.
        let heads = resize(&mut s.heads, vh * t * dv);
        let firsts: Vec<usize> = seqs.iter().scan(0, |at, s| Some(std::mem::replace(at, *at + s.rows))).collect();
        let runs: Vec<Vec<Range<usize>>> = seqs.iter().map(runs).collect();
        let mut tasks = Vec::with_capacity(vh * seqs.len());
        for ((h, head), of_head) in heads.chunks_exact_mut(t * dv).enumerate().zip(mats) {
            for (((out, state), &first), seq) in
                split_rows(head, seqs, dv).into_iter().zip(of_head).zip(&firsts).zip(seqs.iter().zip(&runs))
            {
                tasks.push((h, first, seq, state, out));
            }
        }
        let proj: &[f32] = proj;
        let head_taken: Vec<(usize, Vec<Taken>)> = tasks
            .into_par_iter()
            .map_init(
                || (vec![0.0; dv], ChunkScratch::default(), Gathered::default()),
                |(mem, scratch, g), (h, first, (seq, runs), state, out)| {
                    let kh_of = l.key_head(h);
                    let row = |r: usize| &proj[(first + r) * width..(first + r + 1) * width];
                    let q = |r: usize| &row(r)[kh_of * dk..(kh_of + 1) * dk];
                    let k = |r: usize| &row(r)[(kh + kh_of) * dk..(kh + kh_of + 1) * dk];
                    let v = |r: usize| &row(r)[2 * kh * dk + h * dv..2 * kh * dk + (h + 1) * dv];
                    let (beta, log_decay) =
                        (|r: usize| row(r)[conv_dim + values + h], |r: usize| row(r)[conv_dim + values + vh + h]);
                    let mut taken = Vec::new();
                    for run in runs {
                        let o = &mut out[run.start * dv..run.end * dv];
                        if run.len() == 1 {
                            let r = run.start;
                            let tok = Token { q: q(r), k: k(r), v: v(r), decay: log_decay(r).exp(), beta: beta(r) };
                            delta_step(state, &tok, mem, o);
                        } else {
                            g.clear();
                            for r in run.clone() {
                                g.q.extend_from_slice(q(r));
                                g.k.extend_from_slice(k(r));
                                g.v.extend_from_slice(v(r));
                                g.beta.push(beta(r));
                                g.g.push(log_decay(r));
                            }
                            let run = Run { q: &g.q, k: &g.k, v: &g.v, beta: &g.beta, g: &g.g };
                            delta_chunk(state, &run, scratch, o);
                        }
                        let pos = seq.context_len + run.end - 1;
                        taken.extend(seq.captures.iter().filter(|c| c.0 == pos).map(|c| (c.1, state.to_vec())));
                    }
                    (h, taken)
                },
            )
            .collect();
        // The captured states into their snapshots, in the order they were claimed.
        for (snap, conv) in conv_taken.into_iter().flatten() {
            snapshots.get_mut(snap as usize)[self.state_at..][..conv_len].copy_from_slice(&conv);
        }
        for (h, taken) in head_taken {
            for (snap, m) in taken {
                let at = self.state_at + conv_len + h * dk * dv;
                snapshots.get_mut(snap as usize)[at..at + dk * dv].copy_from_slice(&m);
            }
        }

        // Gated RMSNorm per head, gathered back into rows.
        let o = resize(&mut s.o, t * values);
        let heads: &[f32] = heads;
        o.par_chunks_mut(values).enumerate().for_each(|(r, row)| {
            let z = &proj[r * width + conv_dim..r * width + conv_dim + values];
            for (h, (dst, z)) in row.chunks_exact_mut(dv).zip(z.chunks_exact(dv)).enumerate() {
                dst.copy_from_slice(&heads[(h * t + r) * dv..(h * t + r + 1) * dv]);
                rmsnorm_in_place(dst, self.norm.data(), eps);
                dst.iter_mut().zip(z).for_each(|(x, &g)| *x *= silu(g));
            }
        });
        self.out.matmul(o, xq, out, t);
    }
}

/// A sequence's rows cut into runs for the delta rule: a run ends where a state is captured
/// and at every multiple of [`RUN`] positions.
fn runs(seq: &Span<'_>) -> Vec<Range<usize>> {
    let ends_at = |r: usize| {
        let pos = seq.context_len + r;
        r + 1 == seq.rows || (pos + 1).is_multiple_of(RUN) || seq.captures.iter().any(|c| c.0 == pos)
    };
    let mut start = 0;
    (0..seq.rows)
        .filter(|&r| ends_at(r))
        .map(|r| {
            let run = start..r + 1;
            start = r + 1;
            run
        })
        .collect()
}

/// One run's inputs gathered from the rows for [`delta_chunk`].
#[derive(Default)]
struct Gathered {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    beta: Vec<f32>,
    g: Vec<f32>,
}

impl Gathered {
    fn clear(&mut self) {
        [&mut self.q, &mut self.k, &mut self.v, &mut self.beta, &mut self.g].into_iter().for_each(Vec::clear);
    }
}

/// `buf`'s rows of `width` cut into each sequence's run.
fn split_rows<'a>(buf: &'a mut [f32], seqs: &[Span<'_>], width: usize) -> Vec<&'a mut [f32]> {
    let mut rest = buf;
    seqs.iter()
        .map(|s| {
            let (a, b) = std::mem::take(&mut rest).split_at_mut(s.rows * width);
            rest = b;
            a
        })
        .collect()
}
