//! `weft quantize` for a Hugging Face directory: the safetensors weights and config written
//! as a GGUF file in llama.cpp's layout (its tensor names, q/k row order for interleaved
//! RoPE, Gemma's `1 + w` norms, Llama 3's `rope_freqs` and Phi-3's longrope factors as
//! tensors), matrices in the chosen type. The file is read back before returning, and must
//! describe the same model as the directory.

use super::config::{Activation, Arch, ModelConfig, RopeScaling};
use super::file_type::FileType;
use super::gguf::{GgmlType, GgufFile};
use super::gguf_write::{put_entry, write_file, Meta, OutTensor, ALIGNMENT};
use super::loader::{gguf_expert, gguf_name, permute_rows, SafetensorsWeights, WeightSource};
use crate::kernels::quantize::quantize_matrix;
use crate::kernels::ternary;
use anyhow::{bail, Context, Result};
use std::borrow::Cow;
use std::path::Path;

/// A tensor of the output: where its values come from.
enum Source {
    /// A safetensors tensor, by its Hugging Face name.
    Hf(String),
    /// Experts' matrices stacked, by their Hugging Face names in expert order.
    Experts(Vec<String>),
    /// Values computed from the config (RoPE factors).
    Values(Vec<f32>),
}

/// Writes `out` from the model in `dir` with its matrices in the types of `ft`; `tokenizer`
/// gives the `tokenizer.*` entries for the model's vocabulary size. Returns (matrices
/// written, bytes).
pub fn hf_to_gguf(
    dir: &Path,
    out: &Path,
    ft: FileType,
    tokenizer: impl FnOnce(usize) -> Result<Vec<(String, Meta)>>,
) -> Result<(usize, u64)> {
    let config = ModelConfig::from_hf_json(&dir.join("config.json"))?;
    let tokenizer = tokenizer(config.vocab_size)?;
    let src = SafetensorsWeights::open_dir(dir)?;
    let c = &config;
    anyhow::ensure!(
        c.linear.is_none(),
        "writing a model with gated DeltaNet layers (Qwen3.5) as GGUF is not supported; llama.cpp's converter writes one that weft reads"
    );
    let arch = arch_name(c);
    let name = dir.canonicalize()?.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();

    let mut meta = vec![
        ("general.architecture".to_string(), Meta::Str(arch.into())),
        ("general.name".to_string(), Meta::Str(name)),
        ("general.file_type".to_string(), Meta::U32(ft.id())),
        ("general.quantization_version".to_string(), Meta::U32(2)),
    ];
    let mut put = |k: &str, v: Meta| meta.push((format!("{arch}.{k}"), v));
    let int = |v: usize| u32::try_from(v).map(Meta::U32).context("a size does not fit in 32 bits");
    put("context_length", int(c.max_position_embeddings)?);
    put("embedding_length", int(c.hidden_size)?);
    put("block_count", int(c.num_layers)?);
    put("feed_forward_length", int(c.intermediate_size)?);
    put("attention.head_count", int(c.num_heads)?);
    match &c.global_attn {
        // Gemma 4: the keys without a suffix describe the global layers, `_swa` the
        // sliding ones; KV heads and the layer kinds per layer.
        Some(g) => {
            let kv: Vec<u32> = c.kv_shapes().iter().map(|s| s.kv_heads as u32).collect();
            put("attention.head_count_kv", Meta::U32s(kv));
            let sliding = (0..c.num_layers).map(|i| c.layer_window(i).is_some()).collect();
            put("attention.sliding_window_pattern", Meta::Bools(sliding));
            for (suffix, hd) in [("", g.head_dim), ("_swa", c.head_dim)] {
                put(&format!("attention.key_length{suffix}"), int(hd)?);
                put(&format!("attention.value_length{suffix}"), int(hd)?);
                put(&format!("rope.dimension_count{suffix}"), int(hd)?);
            }
            put("attention.shared_kv_layers", Meta::U32(0));
            put("embedding_length_per_layer_input", Meta::U32(0));
        }
        None => {
            put("attention.head_count_kv", int(c.num_kv_heads)?);
            put("attention.key_length", int(c.head_dim)?);
            put("attention.value_length", int(c.head_dim)?);
            put("rope.dimension_count", int(c.head_dim)?);
        }
    }
    put("attention.layer_norm_rms_epsilon", Meta::F32(c.rms_norm_eps));
    put("rope.freq_base", Meta::F32(c.rope_theta));
    put("vocab_size", int(c.vocab_size)?);
    match c.sliding_window {
        Some(w) => put("attention.sliding_window", int(w)?),
        // llama.cpp reads Phi-3's window unconditionally; 0 means none.
        None if c.arch == Arch::Phi3 => put("attention.sliding_window", Meta::U32(0)),
        None => {}
    }
    if let Some(theta) = c.rope_local_theta {
        put("rope.freq_base_swa", Meta::F32(theta));
    }
    if let Some(cap) = c.attn_softcap {
        put("attn_logit_softcapping", Meta::F32(cap));
    }
    if let Some(cap) = c.final_softcap {
        put("final_logit_softcapping", Meta::F32(cap));
    }

    let mut tensors: Vec<(OutTensor, Source)> = Vec::new();
    let vector = |name: &str, v: Vec<f32>| {
        (OutTensor { name: name.into(), shape: vec![v.len()], dtype: GgmlType::F32 }, Source::Values(v))
    };
    if let Some(g) = &c.global_attn {
        // Proportional RoPE as llama.cpp writes it: the still frequencies divided by 1e30.
        let divisors = (0..g.head_dim / 2).map(|i| if i < g.rotated_pairs { 1.0 } else { 1e30 }).collect();
        tensors.push(vector("rope_freqs.weight", divisors));
    }
    match &c.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear(factor) => {
            put("rope.scaling.type", Meta::Str("linear".into()));
            put("rope.scaling.factor", Meta::F32(*factor));
        }
        RopeScaling::Llama3 { .. } => tensors.push(vector("rope_freqs.weight", llama3_divisors(c))),
        RopeScaling::Yarn {
            factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor, ..
        } => {
            put("rope.scaling.type", Meta::Str("yarn".into()));
            put("rope.scaling.factor", Meta::F32(*factor));
            put("rope.scaling.original_context_length", int(*original_max_position_embeddings as usize)?);
            put("rope.scaling.yarn_beta_fast", Meta::F32(*beta_fast));
            put("rope.scaling.yarn_beta_slow", Meta::F32(*beta_slow));
            put("rope.scaling.attn_factor", Meta::F32(*attention_factor));
        }
        RopeScaling::LongRope { short, long, original_max_position_embeddings, attention_factor } => {
            put("rope.scaling.attn_factor", Meta::F32(*attention_factor));
            put("rope.scaling.original_context_length", int(*original_max_position_embeddings)?);
            tensors.push(vector("rope_factors_long.weight", long.clone()));
            tensors.push(vector("rope_factors_short.weight", short.clone()));
        }
    }

    if let Some(m) = &c.moe {
        // llama.cpp's files have experts in every layer.
        anyhow::ensure!(m.dense_layers.is_empty(), "dense layers among the experts cannot be written as GGUF");
        put("expert_count", int(m.num_experts)?);
        put("expert_used_count", int(m.top_k)?);
        put("expert_feed_forward_length", int(m.expert_ffn)?);
        put("expert_weights_norm", Meta::Bool(m.norm_topk_prob));
        if let Some(s) = m.shared_ffn {
            put("expert_shared_feed_forward_length", int(s)?);
        }
    }
    if c.activation == Activation::Relu2 {
        put("hidden_activation", Meta::Str("relu2".into()));
    }
    let mut hf: Vec<(&str, Vec<usize>)> = src.shapes();
    // Embedding first, then layer by layer, then the final norm and head, as converters do.
    hf.sort_by_key(|&(n, _)| {
        let layer = n.strip_prefix("model.layers.").and_then(|r| r.split('.').next()?.parse::<usize>().ok());
        (layer.map_or(if n.starts_with("model.embed") { 0 } else { 2 }, |_| 1), layer, n)
    });
    let mut matrices = 0;
    for (hf_name, shape) in hf {
        if hf_name.ends_with("rotary_emb.inv_freq") || (hf_name == "lm_head.weight" && c.tie_word_embeddings) {
            continue;
        }
        // One expert's matrix joins the tensor that stacks its layer's experts, written
        // where the first of them comes (Gemma 4's come stacked, and are written whole).
        let (gname, shape, source) = match gguf_expert(hf_name) {
            Some((gname, e)) => {
                let experts = c.moe.as_ref().map_or(0, |m| m.num_experts);
                anyhow::ensure!(e < experts, "tensor {hf_name}: expert {e} of {experts}");
                if let Some((_, Source::Experts(names))) = tensors.iter_mut().find(|(t, _)| t.name == gname) {
                    names[e] = hf_name.to_string();
                    continue;
                }
                let mut names = vec![String::new(); experts];
                names[e] = hf_name.to_string();
                (gname, [&[experts][..], &shape].concat(), Source::Experts(names))
            }
            None => {
                let gname = stacked_experts(hf_name).or_else(|| gguf_name(c.arch, hf_name));
                let gname = gname.with_context(|| format!("tensor {hf_name} has no GGUF name"))?;
                (gname, shape, Source::Hf(hf_name.to_string()))
            }
        };
        let dtype = ft.tensor_type(&gname, &shape, c.num_layers, c.tie_word_embeddings);
        matrices += dtype.is_some() as usize;
        // Norms, biases, routers and matrices no format fits stay f32.
        let dtype = dtype.unwrap_or(GgmlType::F32);
        tensors.push((OutTensor { name: gname, shape, dtype }, source));
    }
    for (t, source) in &tensors {
        if let Source::Experts(names) = source {
            anyhow::ensure!(names.iter().all(|n| !n.is_empty()), "{}: an expert's matrix is missing", t.name);
        }
    }

    let mut entries = Vec::new();
    let n_entries = meta.len() + tokenizer.len();
    for (k, v) in meta.iter().chain(&tokenizer) {
        put_entry(&mut entries, k, v);
    }
    let (outs, sources): (Vec<OutTensor>, Vec<Source>) = tensors.into_iter().unzip();
    let written = write_file(out, &entries, n_entries, ALIGNMENT, &outs, |i| {
        let values = match &sources[i] {
            Source::Values(v) => Cow::Borrowed(v.as_slice()),
            Source::Hf(name) => Cow::Owned(gguf_values(c, &src, name, &outs[i].shape)?),
            Source::Experts(names) => {
                let mut all = Vec::new();
                for name in names {
                    all.extend(gguf_values(c, &src, name, &outs[i].shape[1..])?);
                }
                Cow::Owned(all)
            }
        };
        let t = &outs[i];
        let k = *t.shape.last().unwrap_or(&1);
        let rows = values.len() / k.max(1);
        if matches!(t.dtype, GgmlType::Tq1_0 | GgmlType::Tq2_0) {
            if let Some(why) = ternary::not_ternary(&values, k) {
                bail!("cannot be written as {}: {why}", t.dtype);
            }
        }
        Ok(Cow::Owned(quantize_matrix(t.dtype, k, rows, |r| Cow::Borrowed(&values[r.start * k..r.end * k]))))
    })?;

    let back = GgufFile::open(out)?;
    let read = ModelConfig::from_gguf(&back)?;
    let mut want = config.clone();
    if matches!(want.rope_scaling, RopeScaling::Llama3 { .. }) {
        want.rope_scaling = RopeScaling::None; // carried by rope_freqs, applied at load
    }
    if let Some(g) = &mut want.global_attn {
        g.rotated_pairs = g.head_dim / 2; // the still ones carried by rope_freqs
    }
    if read != want {
        bail!("{}: the written file would be read as {read:?}, not as {want:?}", out.display());
    }
    Ok((matrices, written))
}

/// The GGUF name of a layer's experts that the directory already holds stacked, in the
/// GGUF's layout (Gemma 4's `experts.gate_up_proj` and `experts.down_proj`).
fn stacked_experts(hf: &str) -> Option<String> {
    let (layer, stem) = [(".experts.gate_up_proj", "ffn_gate_up_exps"), (".experts.down_proj", "ffn_down_exps")]
        .into_iter()
        .find_map(|(suffix, stem)| Some((hf.strip_suffix(suffix)?.strip_prefix("model.layers.")?, stem)))?;
    Some(format!("blk.{layer}.{stem}.weight"))
}

/// llama.cpp's `general.architecture` for a model (Mixtral is `llama` with experts).
fn arch_name(c: &ModelConfig) -> &'static str {
    match c.arch {
        Arch::Llama => "llama",
        Arch::Qwen2 if c.moe.is_some() => "qwen2moe",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 if c.moe.is_some() => "qwen3moe",
        Arch::Qwen3 => "qwen3",
        Arch::Phi3 => "phi3",
        Arch::Gemma2 => "gemma2",
        Arch::Gemma3 => "gemma3",
        Arch::Gemma4 => "gemma4",
        Arch::GptOss => "gpt-oss",
        Arch::BitNet => "bitnet",
        Arch::Qwen35 if c.moe.is_some() => "qwen35moe",
        Arch::Qwen35 => "qwen35",
    }
}

/// Tensor `name`'s values as the GGUF file holds them: Gemma's norms with their 1 added,
/// and Llama's q/k rows (weights and biases) in the interleaved-RoPE order.
fn gguf_values(c: &ModelConfig, src: &SafetensorsWeights, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let t = src.load(name, shape)?;
    let mut v = t.data().to_vec();
    // (Gemma 4's norms are plain.)
    let gemma = matches!(c.arch, Arch::Gemma2 | Arch::Gemma3);
    // Gemma 3's q/k norms too.
    if gemma && name.ends_with("norm.weight") {
        v.iter_mut().for_each(|w| *w += 1.0);
    }
    if c.arch == Arch::Llama {
        let cols = shape[1..].iter().product();
        if name.contains(".q_proj.") {
            v = permute_rows(&v, c.num_heads, cols);
        } else if name.contains(".k_proj.") {
            v = permute_rows(&v, c.num_kv_heads, cols);
        }
    }
    Ok(v)
}

/// Llama 3's frequency divisors, as llama.cpp's converter computes them (in f32).
fn llama3_divisors(c: &ModelConfig) -> Vec<f32> {
    let RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } =
        c.rope_scaling
    else {
        return Vec::new();
    };
    let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
    (0..c.head_dim / 2)
        .map(|i| {
            let freq = 1.0 / c.rope_theta.powf((2 * i) as f32 / c.head_dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}
