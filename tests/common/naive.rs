//! A naive Llama (or Qwen3) forward pass in f64, straight from a Hugging Face directory's safetensors:
//! one token at a time, every formula as transformers writes it (RMSNorm, rotate-half RoPE
//! with Llama 3 frequency scaling, grouped-query attention with an optional sliding window,
//! SwiGLU). Slow and obviously right: the reference for prompts longer than the fixtures'
//! own references reach.

use serde_json::Value;
use std::path::Path;

struct Layer {
    attn_norm: Vec<f64>,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    o: Vec<f64>,
    ffn_norm: Vec<f64>,
    gate: Vec<f64>,
    up: Vec<f64>,
    down: Vec<f64>,
    /// Qwen3's per-head RMSNorms of q and k, before RoPE.
    qk_norm: Option<(Vec<f64>, Vec<f64>)>,
}

pub struct Naive {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
    eps: f64,
    window: Option<usize>,
    inv_freq: Vec<f64>,
    embed: Vec<f64>,
    layers: Vec<Layer>,
    norm: Vec<f64>,
    lm_head: Vec<f64>,
    /// Per layer, the K and V rows of every position so far.
    cache: Vec<(Vec<f64>, Vec<f64>)>,
}

impl Naive {
    /// A Llama-architecture directory (`LlamaForCausalLM`, `MistralForCausalLM`).
    pub fn load(dir: &Path) -> Naive {
        let cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let get = |name: &str| -> Vec<f64> {
            let t = st.tensor(name).unwrap_or_else(|_| panic!("{name}"));
            match t.dtype() {
                safetensors::Dtype::F32 => {
                    t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64).collect()
                }
                safetensors::Dtype::F16 => {
                    t.data().chunks_exact(2).map(|b| half::f16::from_le_bytes(b.try_into().unwrap()).to_f64()).collect()
                }
                other => panic!("{name}: {other:?}"),
            }
        };
        let n = |k: &str| cfg[k].as_u64().unwrap() as usize;
        let (hidden, heads) = (n("hidden_size"), n("num_attention_heads"));
        let head_dim = cfg["head_dim"].as_u64().map_or(hidden / heads, |h| h as usize);
        let theta = cfg["rope_theta"].as_f64().unwrap_or(10000.0);
        let mut inv_freq: Vec<f64> =
            (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
        if cfg["rope_scaling"]["rope_type"] == "llama3" {
            let s = &cfg["rope_scaling"];
            let f = |k: &str| s[k].as_f64().unwrap();
            let (factor, low, high, old) =
                (f("factor"), f("low_freq_factor"), f("high_freq_factor"), f("original_max_position_embeddings"));
            for inv in &mut inv_freq {
                let wavelen = 2.0 * std::f64::consts::PI / *inv;
                if wavelen > old / low {
                    *inv /= factor;
                } else if wavelen >= old / high {
                    let smooth = (old / wavelen - low) / (high - low);
                    *inv = (1.0 - smooth) * *inv / factor + smooth * *inv;
                }
            }
        } else {
            assert!(cfg["rope_scaling"].is_null(), "naive reference: unsupported rope_scaling");
        }
        let layers: Vec<Layer> = (0..n("num_hidden_layers"))
            .map(|i| {
                let w = |s: &str| get(&format!("model.layers.{i}.{s}.weight"));
                Layer {
                    attn_norm: w("input_layernorm"),
                    q: w("self_attn.q_proj"),
                    k: w("self_attn.k_proj"),
                    v: w("self_attn.v_proj"),
                    o: w("self_attn.o_proj"),
                    ffn_norm: w("post_attention_layernorm"),
                    gate: w("mlp.gate_proj"),
                    up: w("mlp.up_proj"),
                    down: w("mlp.down_proj"),
                    qk_norm: st
                        .names()
                        .contains(&format!("model.layers.{i}.self_attn.q_norm.weight").as_str())
                        .then(|| (w("self_attn.q_norm"), w("self_attn.k_norm"))),
                }
            })
            .collect();
        let embed = get("model.embed_tokens.weight");
        let lm_head = if st.names().contains(&"lm_head.weight") { get("lm_head.weight") } else { embed.clone() };
        Naive {
            hidden,
            heads,
            kv_heads: n("num_key_value_heads"),
            head_dim,
            ffn: n("intermediate_size"),
            vocab: n("vocab_size"),
            eps: cfg["rms_norm_eps"].as_f64().unwrap(),
            window: cfg["sliding_window"].as_u64().map(|w| w as usize),
            inv_freq,
            embed,
            cache: vec![Default::default(); layers.len()],
            layers,
            norm: get("model.norm.weight"),
            lm_head,
        }
    }

    /// The logits after `token`, the next position of the sequence fed so far.
    pub fn push(&mut self, token: u32) -> Vec<f64> {
        let x = self.push_hidden(token);
        let logits = matvec(&self.lm_head, &x);
        assert_eq!(logits.len(), self.vocab);
        logits
    }

    /// The final hidden state (after the final norm) at `token`, the next position.
    pub fn push_hidden(&mut self, token: u32) -> Vec<f64> {
        let (d, hd, kvd) = (self.hidden, self.head_dim, self.kv_heads * self.head_dim);
        let pos = self.cache[0].0.len() / kvd;
        let mut x = self.embed[token as usize * d..][..d].to_vec();
        for (layer, (kc, vc)) in self.layers.iter().zip(&mut self.cache) {
            let h = rmsnorm(&x, &layer.attn_norm, self.eps);
            let (mut q, mut k, v) = (matvec(&layer.q, &h), matvec(&layer.k, &h), matvec(&layer.v, &h));
            if let Some((qn, kn)) = &layer.qk_norm {
                q.chunks_exact_mut(hd).for_each(|head| head.copy_from_slice(&rmsnorm(head, qn, self.eps)));
                k.chunks_exact_mut(hd).for_each(|head| head.copy_from_slice(&rmsnorm(head, kn, self.eps)));
            }
            q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)).for_each(|head| rope(head, pos, &self.inv_freq));
            kc.extend(&k);
            vc.extend(&v);
            let first = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let mut attn = vec![0.0; self.heads * hd];
            for (hi, out) in attn.chunks_exact_mut(hd).enumerate() {
                let g = hi / (self.heads / self.kv_heads);
                let qh = &q[hi * hd..][..hd];
                let scores: Vec<f64> =
                    (first..=pos).map(|j| dot(qh, &kc[j * kvd + g * hd..][..hd]) / (hd as f64).sqrt()).collect();
                let max = scores.iter().fold(f64::MIN, |a, &b| a.max(b));
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, w) in (first..=pos).zip(&e) {
                    let vj = &vc[j * kvd + g * hd..][..hd];
                    out.iter_mut().zip(vj).for_each(|(o, v)| *o += w / sum * v);
                }
            }
            add(&mut x, &matvec(&layer.o, &attn));
            let h = rmsnorm(&x, &layer.ffn_norm, self.eps);
            let (gate, up) = (matvec(&layer.gate, &h), matvec(&layer.up, &h));
            let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            assert_eq!(act.len(), self.ffn);
            add(&mut x, &matvec(&layer.down, &act));
        }
        rmsnorm(&x, &self.norm, self.eps)
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `W x` for `W` stored `[rows, x.len()]` row-major.
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len()).map(|row| dot(row, x)).collect()
}

fn add(x: &mut [f64], y: &[f64]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

fn rmsnorm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

/// Rotate-half RoPE: element `i` pairs with `i + d/2`.
fn rope(head: &mut [f64], pos: usize, inv_freq: &[f64]) {
    let half = head.len() / 2;
    for (i, f) in inv_freq.iter().enumerate() {
        let (s, c) = (pos as f64 * f).sin_cos();
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * c - b * s;
        head[i + half] = b * c + a * s;
    }
}
