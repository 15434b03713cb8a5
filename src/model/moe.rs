//! A mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss, Gemma 4): a router picks each row's top-k experts,
//! the rows routed to one expert are gathered so that its weights are read once for all of
//! them, and each row's expert outputs are summed in expert order, so that a row's routing
//! and result never depend on the other rows of the step.

use super::config::MoeConfig;
use super::loader::WeightSource;
use super::resize;
use super::weight::{Weight, WeightDtype};
use crate::kernels::qmatmul::{qmatmul, qmatmul_each, Product, QActs, QMatrix};
use crate::kernels::quant::GgmlType;
use crate::kernels::rmsnorm;
use anyhow::{bail, Context, Result};
use rayon::prelude::*;

/// The gated activation of an MLP: `[rows, 2 f]` gate and up halves to `[rows, f]`.
pub type Activation = fn(&[f32], usize, &mut [f32]);

struct Expert {
    /// gate and up projections stacked: `[2 expert_ffn, hidden]`.
    gate_up: Weight,
    down: Weight,
    /// Their biases (gpt-oss), gate's and up's stacked as the matrix.
    gate_up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
}

/// A shared expert every row goes through beside its routed ones, its output scaled by
/// σ(gate · x) (Qwen2-MoE, Qwen3.5).
struct SharedExpert {
    /// gate and up projections stacked: `[2 ffn, hidden]`.
    gate_up: Weight,
    down: Weight,
    /// The gate's weights, `[hidden]`, f32.
    gate: Vec<f32>,
    ffn: usize,
}

pub struct Experts {
    /// `[experts, hidden]`, always f32: the gap between the k-th and the next router
    /// logit falls to 1e-5 on real inputs, so rounded activations would flip choices
    /// (llama.cpp keeps routers in F32 for the same reason).
    router: Weight,
    router_bias: Option<Vec<f32>>,
    /// Gemma 4's router scales ([`MoeConfig::scaled_router`]).
    scales: Option<RouterScales>,
    shared: Option<SharedExpert>,
    experts: Vec<Expert>,
    top_k: usize,
    norm_topk_prob: bool,
    /// Whether every expert is in a block format, computed in one pass for all experts.
    blocks: bool,
    /// Whether, besides, every expert's gate_up quantizes its rows alike: then the step's
    /// rows are quantized once for all of them ([`QActs::gather`]).
    alike: bool,
    hidden: usize,
    ffn: usize,
}

/// Gemma 4's router: its input RMS-normalised and multiplied by `input` and hidden^-1/2,
/// each chosen expert's weight by its entry of `expert`.
struct RouterScales {
    input: Vec<f32>,
    expert: Vec<f32>,
    eps: f32,
}

/// How a mixture's rows spread over its experts, summed over layers and steps: what
/// `weft bench` reports as expert-load balance.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Mixture layers run (one per layer per step).
    pub layer_runs: u64,
    /// Rows routed: rows times experts per row.
    pub routed_rows: u64,
    /// Experts with at least one row.
    pub experts_used: u64,
    /// Rows of each run's busiest expert.
    pub busiest_rows: u64,
    /// Time in the mixture layers (router, experts and the weighted sum).
    pub time: std::time::Duration,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.layer_runs += o.layer_runs;
        self.routed_rows += o.routed_rows;
        self.experts_used += o.experts_used;
        self.busiest_rows += o.busiest_rows;
        self.time += o.time;
    }
}

/// Buffers of [`Experts::forward`], reused across steps, and its statistics.
#[derive(Default)]
pub struct Scratch {
    pub stats: Stats,
    logits: Vec<f32>,
    /// Per row, its top-k experts and weights in expert order.
    routes: Vec<(usize, f32)>,
    /// The router's input where it is not the experts' (Gemma 4's, scaled).
    router_x: Vec<f32>,
    /// The shared expert's gate and up projections, its activation and its output.
    shared_gu: Vec<f32>,
    shared_act: Vec<f32>,
    shared_y: Vec<f32>,
    /// Per route, where its row sits among the rows gathered by expert.
    slots: Vec<usize>,
    /// Per gathered row, the step's row it is a copy of.
    rows_of: Vec<usize>,
    x: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    y: Vec<f32>,
    /// The step's rows quantized once for every expert's gate_up, where they all take
    /// the same quantization.
    step_q: QActs,
    /// Per expert, its gathered rows quantized for gate_up and for down.
    xq: Vec<QActs>,
    aq: Vec<QActs>,
}

impl Experts {
    /// Layer `layer`'s router and experts, under Qwen3-MoE's names (`mlp.gate`,
    /// `mlp.experts.E.gate_proj`), Mixtral's (`block_sparse_moe.gate`, `…experts.E.w1`),
    /// gpt-oss's (`mlp.router`, with biases) or Gemma 4's (`router.proj`, `experts`),
    /// whichever the source holds; gpt-oss's and Gemma 4's Hugging Face experts come fused
    /// ([`fused_gpt_oss`], [`fused_stacked`]).
    pub fn load(
        src: &dyn WeightSource,
        layer: usize,
        c: &MoeConfig,
        hidden: usize,
        eps: f32,
        dtype: WeightDtype,
    ) -> Result<Self> {
        let (d, f) = (hidden, c.expert_ffn);
        let at = |s: &str| format!("model.layers.{layer}.{s}");
        if c.scaled_router {
            return Self::load_gemma4(src, layer, c, d, eps, dtype);
        }
        let (block, router_stem, [gate, up, down]) = if src.contains(&at("block_sparse_moe.gate.weight")) {
            ("block_sparse_moe", "gate", ["w1", "w3", "w2"])
        } else if src.contains(&at("mlp.router.weight")) {
            ("mlp", "router", ["gate_proj", "up_proj", "down_proj"])
        } else {
            ("mlp", "gate", ["gate_proj", "up_proj", "down_proj"])
        };
        let router_name = at(&format!("{block}.{router_stem}.weight"));
        let router = Weight::load(src, &[(&router_name, [c.num_experts, d])], WeightDtype::F32)?;
        let bias_name = at(&format!("{block}.{router_stem}.bias"));
        let router_bias =
            if src.contains(&bias_name) { Some(src.load(&bias_name, &[c.num_experts])?.data().to_vec()) } else { None };
        let experts = if src.contains(&at("mlp.experts.gate_up_proj_bias")) {
            fused_gpt_oss(src, layer, c, d, dtype)?
        } else if src.contains(&at("mlp.experts.gate_up_proj")) {
            // Qwen3.5's, stacked as Gemma 4's.
            fused_stacked(src, &at("mlp.experts"), c, d, dtype)?
        } else {
            let mut experts = Vec::with_capacity(c.num_experts);
            for e in 0..c.num_experts {
                let name = |p: &str, kind: &str| at(&format!("{block}.experts.{e}.{p}.{kind}"));
                let context = || format!("layer {layer} expert {e}");
                let parts = [(name(gate, "weight"), [f, d]), (name(up, "weight"), [f, d])];
                let gate_up =
                    Weight::load(src, &parts.each_ref().map(|(n, s)| (n.as_str(), *s)), dtype).with_context(context)?;
                let down_w = Weight::load(src, &[(&name(down, "weight"), [d, f])], dtype).with_context(context)?;
                let (gate_up_bias, down_bias) = if src.contains(&name(gate, "bias")) {
                    let mut gu = src.load(&name(gate, "bias"), &[f])?.data().to_vec();
                    gu.extend_from_slice(src.load(&name(up, "bias"), &[f])?.data());
                    (Some(gu), Some(src.load(&name(down, "bias"), &[d])?.data().to_vec()))
                } else {
                    (None, None)
                };
                experts.push(Expert { gate_up, down: down_w, gate_up_bias, down_bias });
            }
            experts
        };
        let mut x = Self::new(router, router_bias, None, experts, c, d);
        if let Some(sf) = c.shared_ffn {
            // Qwen's names (a GGUF file reads any family's router as Mixtral's).
            let name = |p: &str| at(&format!("mlp.shared_expert.{p}.weight"));
            let parts = [(name("gate_proj"), [sf, d]), (name("up_proj"), [sf, d])];
            let gate_name = at("mlp.shared_expert_gate.weight");
            // A `[1, hidden]` matrix, or the `[hidden]` vector GGUF files keep.
            let gate = src.load(&gate_name, &[1, d]).or_else(|_| src.load(&gate_name, &[d]))?;
            x.shared = Some(SharedExpert {
                gate_up: Weight::load(src, &parts.each_ref().map(|(n, s)| (n.as_str(), *s)), dtype)?,
                down: Weight::load(src, &[(&name("down_proj"), [d, sf])], dtype)?,
                gate: gate.data().to_vec(),
                ffn: sf,
            });
        }
        Ok(x)
    }

    fn new(
        router: Weight,
        router_bias: Option<Vec<f32>>,
        scales: Option<RouterScales>,
        experts: Vec<Expert>,
        c: &MoeConfig,
        d: usize,
    ) -> Self {
        let blocks = experts.iter().all(|x| matches!((&x.gate_up, &x.down), (Weight::Quant(_), Weight::Quant(_))));
        let alike = blocks && experts.iter().all(|e| quant(&e.gate_up).quantizes_as(quant(&experts[0].gate_up)));
        let (top_k, norm_topk_prob, ffn) = (c.top_k, c.norm_topk_prob, c.expert_ffn);
        let shared = None;
        Experts { router, router_bias, scales, shared, experts, top_k, norm_topk_prob, blocks, alike, hidden: d, ffn }
    }

    /// Gemma 4's router (`router.proj`, `.scale`, `.per_expert_scale`) and experts: fused
    /// `experts.gate_up_proj` `[experts, 2 ffn, hidden]` (gate's rows, then up's) and
    /// `experts.down_proj` `[experts, hidden, ffn]` in a Hugging Face directory, or each
    /// expert's slice of the GGUF's stacked tensors, which keep the same layout.
    fn load_gemma4(
        src: &dyn WeightSource,
        layer: usize,
        c: &MoeConfig,
        d: usize,
        eps: f32,
        dtype: WeightDtype,
    ) -> Result<Self> {
        let (n, f) = (c.num_experts, c.expert_ffn);
        let at = |s: &str| format!("model.layers.{layer}.{s}");
        let router = Weight::load(src, &[(&at("router.proj.weight"), [n, d])], WeightDtype::F32)?;
        let scales = RouterScales {
            input: src.load(&at("router.scale"), &[d])?.data().to_vec(),
            expert: src.load(&at("router.per_expert_scale"), &[n])?.data().to_vec(),
            eps,
        };
        let experts = if src.contains(&at("experts.gate_up_proj")) {
            fused_stacked(src, &at("experts"), c, d, dtype)?
        } else {
            (0..n)
                .map(|e| {
                    let name = |p: &str| at(&format!("experts.{e}.{p}.weight"));
                    let context = || format!("layer {layer} expert {e}");
                    Ok(Expert {
                        gate_up: Weight::load(src, &[(&name("gate_up_proj"), [2 * f, d])], dtype)
                            .with_context(context)?,
                        down: Weight::load(src, &[(&name("down_proj"), [d, f])], dtype).with_context(context)?,
                        gate_up_bias: None,
                        down_bias: None,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Self::new(router, None, Some(scales), experts, c, d))
    }

    /// Every matrix: the router, each expert's, then the shared expert's.
    pub fn matrices(&self) -> impl Iterator<Item = &Weight> {
        let shared = self.shared.iter().flat_map(|s| [&s.gate_up, &s.down]);
        std::iter::once(&self.router).chain(self.experts.iter().flat_map(|x| [&x.gate_up, &x.down])).chain(shared)
    }

    /// Bytes of weights one token reads: the router, on average `top_k` experts, and the
    /// shared expert.
    pub fn bytes_per_token(&self) -> usize {
        let experts: usize = self.experts.iter().map(|x| x.gate_up.bytes() + x.down.bytes()).sum();
        let shared = self.shared.as_ref().map_or(0, |s| s.gate_up.bytes() + s.down.bytes() + 4 * s.gate.len());
        self.router.bytes() + experts * self.top_k / self.experts.len() + shared
    }

    /// Multiply-adds per token by block format: the router's and `top_k` experts' worth.
    pub fn products_per_token(&self) -> Vec<(Option<GgmlType>, usize)> {
        let mut by: Vec<(Option<GgmlType>, usize)> = Vec::new();
        for x in &self.experts {
            for (t, n) in x.gate_up.products().into_iter().chain(x.down.products()) {
                match by.iter_mut().find(|(u, _)| *u == t) {
                    Some((_, sum)) => *sum += n,
                    None => by.push((t, n)),
                }
            }
        }
        by.iter_mut().for_each(|(_, n)| *n = *n * self.top_k / self.experts.len());
        by.extend(self.router.products());
        if let Some(s) = &self.shared {
            by.extend(s.gate_up.products().into_iter().chain(s.down.products()));
            // Its gate: one f32 dot product per row.
            by.push((None, s.gate.len()));
        }
        by
    }

    /// `out = Σ_e w_e · down_e(act(gate_up_e(x)))` over each row's top-k experts `e`, for
    /// the `t` rows of `x`, routed by the rows of `router_in` (the same rows as `x` but
    /// for Gemma 4, whose router reads the residual stream); `xq` is scratch for the
    /// router's activations.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        router_in: &[f32],
        x: &[f32],
        t: usize,
        activation: Activation,
        s: &mut Scratch,
        xq: &mut QActs,
        out: &mut [f32],
    ) {
        let start = std::time::Instant::now();
        let (n_exp, k) = (self.experts.len(), self.top_k);
        let d = self.hidden;
        let logits = resize(&mut s.logits, t * n_exp);
        match &self.scales {
            Some(sc) => {
                // As transformers: x / rms(x) (no weight), times the scale, times hidden^-1/2.
                let root = (d as f64).powf(-0.5) as f32;
                let rx = resize(&mut s.router_x, t * d);
                rx.par_chunks_mut(d).zip(router_in.par_chunks(d)).for_each(|(o, x)| {
                    rmsnorm(x, &sc.input, sc.eps, o);
                    o.iter_mut().for_each(|o| *o *= root);
                });
                self.router.matmul(rx, xq, logits, t);
            }
            None => self.router.matmul(router_in, xq, logits, t),
        }
        if let Some(b) = &self.router_bias {
            add_bias(logits, b);
        }
        s.routes.resize(t * k, (0, 0.0));
        let norm = self.norm_topk_prob;
        let (logits, routes): (&[f32], _) = (logits, &mut s.routes[..t * k]);
        logits
            .par_chunks(n_exp)
            .zip(routes.par_chunks_mut(k))
            .for_each_init(Default::default, |scratch, (row, out)| route(row, norm, scratch, out));
        if let Some(sc) = &self.scales {
            s.routes.iter_mut().for_each(|(e, w)| *w *= sc.expert[*e]);
        }
        // Rows gathered by expert: each expert's in row order, experts in order.
        let mut starts = vec![0; n_exp + 1];
        s.routes.iter().for_each(|&(e, _)| starts[e + 1] += 1);
        (0..n_exp).for_each(|e| starts[e + 1] += starts[e]);
        let mut fill = starts.clone();
        s.slots.clear();
        s.slots.extend(s.routes.iter().map(|&(e, _)| {
            fill[e] += 1;
            fill[e] - 1
        }));
        // Each gathered row from the row its slot holds, in parallel.
        s.rows_of.resize(t * k, 0);
        for (i, &slot) in s.slots.iter().enumerate() {
            s.rows_of[slot] = i / k;
        }
        // Experts that quantize their rows alike take them from one quantization of the
        // step's rows; the others a copy of each.
        if !self.alike {
            let xs = resize(&mut s.x, t * k * d);
            xs.par_chunks_mut(d)
                .zip(&s.rows_of[..t * k])
                .for_each(|(dst, &r)| dst.copy_from_slice(&x[r * d..(r + 1) * d]));
        }
        let counts: Vec<usize> = (0..n_exp).map(|e| starts[e + 1] - starts[e]).collect();
        let st = &mut s.stats;
        st.layer_runs += 1;
        st.routed_rows += (t * k) as u64;
        st.experts_used += counts.iter().filter(|&&n| n > 0).count() as u64;
        st.busiest_rows += counts.iter().max().copied().unwrap_or(0) as u64;
        resize(&mut s.y, t * k * d);
        if self.blocks {
            self.run_blocks(&counts, self.alike.then_some(&x[..t * d]), activation, s);
        } else {
            self.run_each(&counts, activation, s, xq);
        }
        let (y, routes, slots): (&[f32], &[(usize, f32)], &[usize]) = (&s.y, &s.routes, &s.slots);
        out[..t * d].par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            o.fill(0.0);
            for (&(_, w), &slot) in routes[r * k..(r + 1) * k].iter().zip(&slots[r * k..(r + 1) * k]) {
                o.iter_mut().zip(&y[slot * d..(slot + 1) * d]).for_each(|(o, v)| *o += w * v);
            }
        });
        if let Some(sh) = &self.shared {
            // As transformers: the routed sum, plus σ(gate · x) times the shared expert's output.
            let gu = resize(&mut s.shared_gu, t * 2 * sh.ffn);
            match &sh.gate_up {
                // The step's rows as the experts' gate_up took them, where they fit.
                Weight::Quant(w) if self.alike && w.quantizes_as(quant(&self.experts[0].gate_up)) => {
                    qmatmul(&s.step_q, w, gu, t)
                }
                other => other.matmul(x, xq, gu, t),
            }
            let act = resize(&mut s.shared_act, t * sh.ffn);
            gu.par_chunks(2 * sh.ffn * 8)
                .zip(act.par_chunks_mut(sh.ffn * 8))
                .for_each(|(g, a)| activation(g, sh.ffn, a));
            let ys = resize(&mut s.shared_y, t * d);
            sh.down.matmul(act, xq, ys, t);
            let ys: &[f32] = ys;
            out[..t * d].par_chunks_mut(d).zip(x.par_chunks(d)).zip(ys.par_chunks(d)).for_each(|((o, x), y)| {
                let logit: f32 = x.iter().zip(&sh.gate).map(|(x, g)| x * g).sum();
                let gate = 1.0 / (1.0 + (-logit).exp());
                o.iter_mut().zip(y).for_each(|(o, y)| *o += gate * y);
            });
        }
        s.stats.time += start.elapsed();
    }

    /// Float experts (the exact path): one after another, each matrix multiply parallel.
    fn run_each(&self, counts: &[usize], activation: Activation, s: &mut Scratch, xq: &mut QActs) {
        let (d, f) = (self.hidden, self.ffn);
        let rows: usize = counts.iter().sum();
        let gu = resize(&mut s.gate_up, rows * 2 * f);
        let act = resize(&mut s.act, rows * f);
        let mut first = 0;
        for (x, &n) in self.experts.iter().zip(counts) {
            if n == 0 {
                continue;
            }
            let rows = first..first + n;
            let gu = &mut gu[rows.start * 2 * f..rows.end * 2 * f];
            x.gate_up.matmul(&s.x[rows.start * d..rows.end * d], xq, gu, n);
            if let Some(b) = &x.gate_up_bias {
                add_bias(gu, b);
            }
            activation(gu, f, &mut act[rows.start * f..rows.end * f]);
            let y = &mut s.y[rows.start * d..rows.end * d];
            x.down.matmul(&act[rows.start * f..rows.end * f], xq, y, n);
            if let Some(b) = &x.down_bias {
                add_bias(y, b);
            }
            first += n;
        }
    }

    /// Block-format experts: every expert's rows quantized (or, given the step's rows
    /// `shared`, gathered from their one quantization), then all experts' gate_up in one
    /// pass over the pool, the activation, and all experts' down in another.
    fn run_blocks(&self, counts: &[usize], shared: Option<&[f32]>, activation: Activation, s: &mut Scratch) {
        let (d, f) = (self.hidden, self.ffn);
        let rows: usize = counts.iter().sum();
        s.xq.resize_with(self.experts.len(), QActs::default);
        s.aq.resize_with(self.experts.len(), QActs::default);
        let gu = resize(&mut s.gate_up, rows * 2 * f);
        let act = resize(&mut s.act, rows * f);
        let ys = &mut s.y[..rows * d];

        if let Some(x) = shared {
            let steps_rows = &mut s.step_q;
            quant(&self.experts[0].gate_up).quantize(x, x.len() / d, steps_rows);
            let steps_rows: &QActs = steps_rows;
            let segments = split(&s.rows_of[..rows], counts, 1);
            s.xq.par_iter_mut().zip(&segments).for_each(|(q, of)| {
                if !of.is_empty() {
                    q.gather(steps_rows, d, of);
                }
            });
        } else {
            let segments = split(&s.x[..rows * d], counts, d);
            s.xq.par_iter_mut().zip(&segments).zip(&self.experts).zip(counts).for_each(|(((q, x), e), &n)| {
                if n > 0 {
                    quant(&e.gate_up).quantize(x, n, q);
                }
            });
        }
        run_products(&self.experts, counts, &s.xq, gu, 2 * f, |e| quant(&e.gate_up));
        add_biases(&self.experts, counts, gu, 2 * f, |e| e.gate_up_bias.as_deref());

        gu.par_chunks(2 * f * 8).zip(act.par_chunks_mut(f * 8)).for_each(|(g, a)| activation(g, f, a));

        let segments = split(act, counts, f);
        s.aq.par_iter_mut().zip(&segments).zip(&self.experts).zip(counts).for_each(|(((q, a), e), &n)| {
            if n > 0 {
                let w = quant(&e.down);
                w.quantize(a, n, q);
            }
        });
        run_products(&self.experts, counts, &s.aq, ys, d, |e| quant(&e.down));
        add_biases(&self.experts, counts, ys, d, |e| e.down_bias.as_deref());
    }
}

/// Adds `bias` to each row of `rows`.
pub(super) fn add_bias(rows: &mut [f32], bias: &[f32]) {
    rows.chunks_exact_mut(bias.len()).for_each(|r| r.iter_mut().zip(bias).for_each(|(x, b)| *x += b));
}

/// Adds each expert's `which` bias, where it has one, to its run of `y`'s rows.
fn add_biases(
    experts: &[Expert],
    counts: &[usize],
    y: &mut [f32],
    width: usize,
    which: impl Fn(&Expert) -> Option<&[f32]>,
) {
    let mut first = 0;
    for (e, &n) in experts.iter().zip(counts) {
        if let Some(b) = which(e) {
            add_bias(&mut y[first * width..(first + n) * width], b);
        }
        first += n;
    }
}

/// gpt-oss's experts as its Hugging Face checkpoints hold them: fused
/// `mlp.experts.gate_up_proj` `[experts, hidden, 2 ffn]` with gate in the even and up in
/// the odd columns (`x · W`), its bias `[experts, 2 ffn]` interleaved alike, and
/// `down_proj` `[experts, ffn, hidden]` with its bias `[experts, hidden]`; cut into each
/// expert's matrices in `[out, in]` rows. As released, the two matrices are MXFP4 blocks
/// in `[out, in]` rows (the source gives them as GGUF's blocks), kept so unless `dtype` is
/// f32; dequantized checkpoints hold them as floats.
fn fused_gpt_oss(
    src: &dyn WeightSource,
    layer: usize,
    c: &MoeConfig,
    d: usize,
    dtype: WeightDtype,
) -> Result<Vec<Expert>> {
    let (n, f) = (c.num_experts, c.expert_ffn);
    let at = |s: &str| format!("model.layers.{layer}.mlp.experts.{s}");
    let gate_up_bias = src.load(&at("gate_up_proj_bias"), &[n, 2 * f])?;
    let down_bias = src.load(&at("down_proj_bias"), &[n, d])?;
    // Row r of the stacked matrix: gate's r (column 2r), then up's (column 2(r − f) + 1).
    let column = |r: usize| if r < f { 2 * r } else { 2 * (r - f) + 1 };
    let biases = |e: usize| {
        let bias = &gate_up_bias.data()[e * 2 * f..(e + 1) * 2 * f];
        (Some((0..2 * f).map(|r| bias[column(r)]).collect()), Some(down_bias.data()[e * d..(e + 1) * d].to_vec()))
    };
    if let Some((t, gate_up)) = src.load_blocks(&at("gate_up_proj"), &[n, 2 * f, d])? {
        // As released: MXFP4 rows `[out, in]`, gate's and up's interleaved as the columns above.
        let Some((_, down)) = src.load_blocks(&at("down_proj"), &[n, d, f])? else {
            bail!("layer {layer}: experts' gate_up_proj is stored in MXFP4 blocks but down_proj is not")
        };
        let (gu_row, down_rows) = (d / t.block().0 * t.block().1, d * f / t.block().0 * t.block().1);
        let experts = (0..n)
            .map(|e| {
                let row = |r: usize| &gate_up[(e * 2 * f + r) * gu_row..][..gu_row];
                let rows: Vec<u8> = (0..2 * f).flat_map(|r| row(column(r)).iter().copied()).collect();
                let (gate_up_bias, down_bias) = biases(e);
                Ok(Expert {
                    gate_up: Weight::from_blocks(t, rows.into(), 2 * f, d, dtype)?,
                    down: Weight::from_blocks(t, down[e * down_rows..(e + 1) * down_rows].into(), d, f, dtype)?,
                    gate_up_bias,
                    down_bias,
                })
            })
            .collect();
        src.release(&at("gate_up_proj"));
        src.release(&at("down_proj"));
        return experts;
    }
    let gate_up = src.load(&at("gate_up_proj"), &[n, d, 2 * f])?;
    let down = src.load(&at("down_proj"), &[n, f, d])?;
    let mut experts = Vec::with_capacity(n);
    for e in 0..n {
        let gu = &gate_up.data()[e * d * 2 * f..(e + 1) * d * 2 * f];
        let rows: Vec<f32> = (0..2 * f).flat_map(|r| (0..d).map(move |i| gu[i * 2 * f + column(r)])).collect();
        let dn = &down.data()[e * f * d..(e + 1) * f * d];
        let down_rows: Vec<f32> = (0..d).flat_map(|o| (0..f).map(move |i| dn[i * d + o])).collect();
        let (gate_up_bias, down_bias) = biases(e);
        experts.push(Expert {
            gate_up: Weight::from_values(&rows, 2 * f, d, dtype)?,
            down: Weight::from_values(&down_rows, d, f, dtype)?,
            gate_up_bias,
            down_bias,
        });
    }
    Ok(experts)
}

/// Gemma 4's and Qwen3.5's experts as their Hugging Face checkpoints hold them, under
/// `prefix`: `gate_up_proj` `[experts, 2 ffn, hidden]` and `down_proj` `[experts, hidden,
/// ffn]`, each expert's matrices already in `[out, in]` rows.
fn fused_stacked(
    src: &dyn WeightSource,
    prefix: &str,
    c: &MoeConfig,
    d: usize,
    dtype: WeightDtype,
) -> Result<Vec<Expert>> {
    let (n, f) = (c.num_experts, c.expert_ffn);
    let at = |s: &str| format!("{prefix}.{s}");
    let gate_up = src.load(&at("gate_up_proj"), &[n, 2 * f, d])?;
    let down = src.load(&at("down_proj"), &[n, d, f])?;
    (0..n)
        .map(|e| {
            Ok(Expert {
                gate_up: Weight::from_values(&gate_up.data()[e * 2 * f * d..(e + 1) * 2 * f * d], 2 * f, d, dtype)?,
                down: Weight::from_values(&down.data()[e * d * f..(e + 1) * d * f], d, f, dtype)?,
                gate_up_bias: None,
                down_bias: None,
            })
        })
        .collect()
}

/// A block-format matrix ([`Experts::run_blocks`] runs only when every expert's is one).
fn quant(w: &Weight) -> &QMatrix {
    match w {
        Weight::Quant(q) => q,
        Weight::F32(_) | Weight::Refined { .. } => unreachable!("run_blocks with a float expert"),
    }
}

/// `v`'s rows of `width` values cut into consecutive runs of `counts` rows.
fn split<'a, T>(v: &'a [T], counts: &[usize], width: usize) -> Vec<&'a [T]> {
    let mut rest = v;
    counts
        .iter()
        .map(|&n| {
            let (a, b) = rest.split_at(n * width);
            rest = b;
            a
        })
        .collect()
}

/// Each expert's `which` matrix times its quantized rows, written to its run of `y`'s rows
/// (of `width` values): all experts in one pass over the pool.
fn run_products<'a>(
    experts: &'a [Expert],
    counts: &[usize],
    acts: &'a [QActs],
    y: &'a mut [f32],
    width: usize,
    which: impl Fn(&'a Expert) -> &'a QMatrix,
) {
    let mut rest = y;
    let mut products = Vec::new();
    for ((e, &m), xq) in experts.iter().zip(counts).zip(acts) {
        let (y, tail) = std::mem::take(&mut rest).split_at_mut(m * width);
        rest = tail;
        if m > 0 {
            products.push(Product { xq, w: which(e), y, m });
        }
    }
    qmatmul_each(&mut products);
}

/// Writes the row's top `out.len()` experts with their weights, in expert order: softmax
/// over all router logits in f32 (as transformers computes it), the most probable kept
/// (the lower index on a tie, NaNs last), renormalised to sum 1 when `norm` says. `exps`
/// and `order` are scratch.
fn route(logits: &[f32], norm: bool, (exps, order): &mut (Vec<f32>, Vec<usize>), out: &mut [(usize, f32)]) {
    let k = out.len();
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    exps.clear();
    exps.extend(logits.iter().map(|&l| (l - max).exp()));
    let sum: f32 = exps.iter().sum();
    order.clear();
    order.extend(0..logits.len());
    let key = |i: usize| if exps[i].is_nan() { f32::NEG_INFINITY } else { exps[i] };
    // A total order (ties by index), so the chosen set is the same however it is found.
    let cmp = |a: &usize, b: &usize| key(*b).total_cmp(&key(*a)).then(a.cmp(b));
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, cmp);
    }
    for (o, &i) in out.iter_mut().zip(&order[..k]) {
        *o = (i, exps[i] / sum);
    }
    if norm {
        let total: f32 = out.iter().map(|&(_, p)| p).sum::<f32>();
        out.iter_mut().for_each(|(_, p)| *p /= total);
    }
    out.sort_unstable_by_key(|&(i, _)| i);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::dequantize;
    use crate::kernels::quantize::quantize;
    use crate::kernels::testing::random_vec;
    use crate::kernels::{silu_mul, PackedMatrix};

    #[test]
    fn routes_to_the_top_k_in_expert_order() {
        let scratch = &mut Default::default();
        let mut out = vec![(0, 0.0); 2];
        route(&[0.0, 3.0, 1.0, 3.0, -2.0], true, scratch, &mut out);
        assert_eq!(out.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 3]);
        assert!(out.iter().all(|r| (r.1 - 0.5).abs() < 1e-6));
        // Every expert chosen: all of them, in order.
        let mut all = vec![(0, 0.0); 3];
        route(&[0.5, -1.0, 2.0], true, scratch, &mut all);
        assert_eq!(all.iter().map(|r| r.0).collect::<Vec<_>>(), [0, 1, 2]);
        // Without renormalising, the weights are the softmax over all experts.
        let mut out = vec![(0, 0.0); 1];
        route(&[1.0, 2.0, 0.0], false, scratch, &mut out);
        let want = 2f32.exp() / (1f32.exp() + 2f32.exp() + 1.0);
        assert_eq!(out[0].0, 1);
        assert!((out[0].1 - want).abs() < 1e-6);
        // A NaN logit is never preferred; the row still gets k experts.
        let mut out = vec![(0, 0.0); 2];
        route(&[f32::NAN, 0.5, 0.25], true, scratch, &mut out);
        assert_eq!(out.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2]);
    }

    /// Random experts with biases and a shared expert in Q8_0 blocks, or in f32 from the same
    /// dequantized values, with their `[gate_up, down, gate_up bias, down bias]` (the shared
    /// expert's last, with its gate in place of the first bias and no second) for a naive
    /// check.
    fn experts(n: usize, top_k: usize, d: usize, f: usize, blocks: bool) -> (Experts, Vec<[Vec<f32>; 4]>) {
        let mut all = Vec::new();
        let mut values = Vec::new();
        for e in 0..n {
            let make = |rows: usize, k: usize, seed: u64| {
                let raw = quantize(GgmlType::Q8_0, &random_vec(rows * k, seed));
                let exact = dequantize(GgmlType::Q8_0, &raw);
                let w = if blocks {
                    Weight::Quant(QMatrix::new(k, vec![(GgmlType::Q8_0, rows, raw.into())]).unwrap())
                } else {
                    Weight::F32(PackedMatrix::pack(&exact, rows, k))
                };
                (w, exact)
            };
            let ((gate_up, gu), (down, dn)) = (make(2 * f, d, 10 + e as u64), make(d, f, 100 + e as u64));
            // Biases on every expert (gpt-oss's), the same in both forms.
            let (gb, db) = (random_vec(2 * f, 200 + e as u64), random_vec(d, 300 + e as u64));
            all.push(Expert { gate_up, down, gate_up_bias: Some(gb.clone()), down_bias: Some(db.clone()) });
            values.push([gu, dn, gb, db]);
        }
        let shared =
            all.pop().map(|e| SharedExpert { gate_up: e.gate_up, down: e.down, gate: random_vec(d, 400), ffn: f });
        // Logits spread wider than the activations' rounding, so that no choice is a tie.
        let router: Vec<f32> = random_vec((n - 1) * d, 7).iter().map(|x| 4.0 * x).collect();
        let router = Weight::F32(PackedMatrix::pack(&router, n - 1, d));
        let last = values.len() - 1;
        values[last][2] = shared.as_ref().unwrap().gate.clone();
        let experts = Experts {
            router,
            router_bias: None,
            scales: None,
            shared,
            experts: all,
            top_k,
            norm_topk_prob: true,
            blocks,
            alike: blocks,
            hidden: d,
            ffn: f,
        };
        (experts, values)
    }

    fn run(x: &Experts, input: &[f32], t: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; t * x.hidden];
        x.forward(input, input, t, silu_mul, &mut Scratch::default(), &mut QActs::default(), &mut out);
        out
    }

    /// Every row count from 0, block-format and float experts: each row as computed alone
    /// (bit for bit), the float experts as a naive sum over the chosen experts and the
    /// gated shared expert, and the block-format ones within the int8 activations'
    /// rounding of it; block-format experts that take their rows from one quantization as
    /// those that quantize a copy each.
    #[test]
    fn experts_compute_each_row_alone_and_as_the_naive_sum() {
        let (n, k, d, f) = (6, 2, 64, 32);
        // One more made than routed to: the shared expert.
        let (float, values) = experts(n + 1, k, d, f, false);
        let (quant, _) = experts(n + 1, k, d, f, true);
        let (mut apart, _) = experts(n + 1, k, d, f, true);
        apart.alike = false;
        let input = random_vec(13 * d, 3);
        let mut logits = vec![0.0; n];
        for t in 0..=13 {
            assert!(run(&apart, &input[..t * d], t) == run(&quant, &input[..t * d], t), "{t} rows");
            for x in [&float, &quant] {
                let all = run(x, &input[..t * d], t);
                for r in 0..t {
                    assert!(all[r * d..(r + 1) * d] == run(x, &input[r * d..(r + 1) * d], 1), "{t} rows: row {r}");
                }
            }
            let (a, b) = (run(&float, &input[..t * d], t), run(&quant, &input[..t * d], t));
            for r in 0..t {
                let row = &input[r * d..(r + 1) * d];
                float.router.matmul(row, &mut QActs::default(), &mut logits, 1);
                let mut chosen = vec![(0, 0.0); k];
                route(&logits, true, &mut Default::default(), &mut chosen);
                let mut want = vec![0f64; d];
                let dot = |m: &[f32], i: usize, v: &[f64]| {
                    (0..v.len()).map(|c| m[i * v.len() + c] as f64 * v[c]).sum::<f64>()
                };
                let xr: Vec<f64> = row.iter().map(|&v| v as f64).collect();
                let mlp = |gu: &[f32], dn: &[f32], gb: Option<&[f32]>, db: Option<&[f32]>, o: usize| {
                    let bias = |b: Option<&[f32]>, i: usize| b.map_or(0.0, |b| b[i] as f64);
                    let act: Vec<f64> = (0..f)
                        .map(|i| {
                            let (g, u) = (dot(gu, i, &xr) + bias(gb, i), dot(gu, f + i, &xr) + bias(gb, f + i));
                            g / (1.0 + (-g).exp()) * u
                        })
                        .collect();
                    dot(dn, o, &act) + bias(db, o)
                };
                for (e, w) in chosen {
                    let [gu, dn, gb, db] = &values[e];
                    (0..d).for_each(|o| want[o] += w as f64 * mlp(gu, dn, Some(gb), Some(db), o));
                }
                let [gu, dn, gate, _] = &values[n];
                let g = 1.0 / (1.0 + (-dot(gate, 0, &xr)).exp());
                (0..d).for_each(|o| want[o] += g * mlp(gu, dn, None, None, o));
                let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
                for o in 0..d {
                    let (fa, qa) = (a[r * d + o] as f64, b[r * d + o] as f64);
                    assert!((fa - want[o]).abs() <= 1e-4 * scale, "float row {r} [{o}]: {fa} vs {}", want[o]);
                    assert!((qa - want[o]).abs() <= 0.03 * scale, "blocks row {r} [{o}]: {qa} vs {}", want[o]);
                }
            }
        }
    }
}
