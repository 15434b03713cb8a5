//! Weights from a GGUF file under their Hugging Face names, with llama.cpp's q/k row order
//! for interleaved RoPE (arch `llama` only) mapped back to the rotate_half order.

use super::{check_shape, le_u16s, HalfRows, Tensor, WeightSource};
use crate::kernels::matmul::Half;
use crate::kernels::qmatmul::QMatrix;
use crate::kernels::quant::{mxfp4_check, GgmlType};
use crate::kernels::ternary;
use crate::model::config::{Arch, ModelConfig};
use crate::model::gguf::{GgufFile, TensorInfo};
use anyhow::{anyhow, ensure, Context, Result};
use std::borrow::Cow;

pub struct GgufWeights<'a> {
    file: &'a GgufFile,
    arch: Arch,
    num_heads: usize,
    num_kv_heads: usize,
}

impl<'a> GgufWeights<'a> {
    pub fn new(file: &'a GgufFile, config: &ModelConfig) -> Self {
        GgufWeights { file, arch: config.arch, num_heads: config.num_heads, num_kv_heads: config.num_kv_heads }
    }
}

/// Where a Hugging Face tensor lives in a GGUF file of architecture `arch`: a tensor's
/// name, and for one expert's matrix, its index in the tensor that stacks every expert's.
fn locate(arch: Arch, hf: &str) -> Option<(String, Option<usize>)> {
    match gguf_expert(hf) {
        Some((name, e)) => Some((name, Some(e))),
        None => gguf_name(arch, hf).map(|n| (n, None)),
    }
}

/// The GGUF tensor that stacks the experts of Hugging Face tensor `hf` (one expert's
/// matrix), and the expert's index in it.
pub fn gguf_expert(hf: &str) -> Option<(String, usize)> {
    let (layer, expert, stem, kind) = expert_parts(hf)?;
    Some((format!("blk.{layer}.{stem}.{kind}"), expert))
}

/// (layer, expert, GGUF stem, kind) of one expert's matrix under Qwen3-MoE's
/// (`mlp.experts.E.gate_proj`), Mixtral's (`block_sparse_moe.experts.E.w1`) or Gemma 4's
/// (`experts.E.gate_up_proj`, fused as its GGUF keeps them) names.
fn expert_parts(hf: &str) -> Option<(usize, usize, &'static str, &str)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let part = part
        .strip_prefix("mlp.experts.")
        .or_else(|| part.strip_prefix("block_sparse_moe.experts."))
        .or_else(|| part.strip_prefix("experts."))?;
    let (expert, part) = part.split_once('.')?;
    let (proj, kind) = part.split_once('.')?;
    let stem = match proj {
        "gate_proj" | "w1" => "ffn_gate_exps",
        "gate_up_proj" => "ffn_gate_up_exps",
        "up_proj" | "w3" => "ffn_up_exps",
        "down_proj" | "w2" => "ffn_down_exps",
        _ => return None,
    };
    Some((layer.parse().ok()?, expert.parse().ok()?, stem, kind))
}

/// The GGUF name of a Hugging Face tensor name in architecture `arch` (experts' matrices,
/// slices of a GGUF tensor, have none of their own).
pub fn gguf_name(arch: Arch, hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        "rope_freqs.weight" => Some("rope_freqs.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    // Tensors without a kind: gpt-oss's attention sinks (one logit per head), Gemma 4's
    // router scales and layer scalar.
    let whole = match part {
        "self_attn.sinks" => Some("attn_sinks.weight"),
        "router.scale" => Some("ffn_gate_inp.scale"),
        "router.per_expert_scale" => Some("ffn_down_exps.scale"),
        "layer_scalar" => Some("layer_output_scale.weight"),
        // Qwen3.5's DeltaNet: its time-step bias, and the decay rate, which GGUF files keep
        // as −exp(A_log) (Hugging Face ones as `A_log`; see the layer's loader).
        "linear_attn.dt_bias" => Some("ssm_dt.bias"),
        "linear_attn.neg_exp_A" => Some("ssm_a"),
        _ => None,
    };
    if let Some(w) = whole {
        return Some(format!("blk.{layer}.{w}"));
    }
    let (stem, kind) = part.rsplit_once('.')?;
    let stem = match (arch, stem) {
        (_, "input_layernorm") => "attn_norm",
        // Gemma 2's post-attention norm is applied to the attention output; its pre-MLP
        // norm is the one other families call post-attention.
        // (gpt-oss's pre-MLP norm has llama.cpp's name for Gemma's post-attention one.)
        (Arch::Gemma2 | Arch::Gemma3 | Arch::Gemma4 | Arch::GptOss | Arch::Qwen35, "post_attention_layernorm") => {
            "post_attention_norm"
        }
        (Arch::Gemma2 | Arch::Gemma3 | Arch::Gemma4, "pre_feedforward_layernorm") => "ffn_norm",
        (Arch::Gemma2 | Arch::Gemma3 | Arch::Gemma4, "post_feedforward_layernorm") => "post_ffw_norm",
        // Gemma 4's dense MLP and experts side by side, each with its own norms.
        (_, "post_feedforward_layernorm_1") => "post_ffw_norm_1",
        (_, "post_feedforward_layernorm_2") => "post_ffw_norm_2",
        (_, "pre_feedforward_layernorm_2") => "pre_ffw_norm_2",
        (_, "post_attention_layernorm") => "ffn_norm",
        (_, "self_attn.q_proj") => "attn_q",
        (_, "self_attn.k_proj") => "attn_k",
        (_, "self_attn.v_proj") => "attn_v",
        (_, "self_attn.qkv_proj") => "attn_qkv",
        (_, "self_attn.q_norm") => "attn_q_norm",
        (_, "self_attn.k_norm") => "attn_k_norm",
        (_, "self_attn.o_proj") => "attn_output",
        (_, "self_attn.attn_sub_norm") => "attn_sub_norm",
        (_, "mlp.ffn_sub_norm") => "ffn_sub_norm",
        (_, "mlp.gate_proj") => "ffn_gate",
        // Phi-3's fused gate_up is llama.cpp's ffn_up of twice the height.
        (_, "mlp.up_proj" | "mlp.gate_up_proj") => "ffn_up",
        (_, "mlp.down_proj") => "ffn_down",
        // The router of a mixture of experts (Qwen3-MoE's name, Mixtral's, gpt-oss's).
        (_, "mlp.gate" | "block_sparse_moe.gate" | "mlp.router" | "router.proj") => "ffn_gate_inp",
        // A shared expert and its gate (Qwen2-MoE, Qwen3.5).
        (_, "mlp.shared_expert.gate_proj") => "ffn_gate_shexp",
        (_, "mlp.shared_expert.up_proj") => "ffn_up_shexp",
        (_, "mlp.shared_expert.down_proj") => "ffn_down_shexp",
        (_, "mlp.shared_expert_gate") => "ffn_gate_inp_shexp",
        // Qwen3.5's gated DeltaNet.
        (_, "linear_attn.in_proj_qkv") => "attn_qkv",
        (_, "linear_attn.in_proj_z") => "attn_gate",
        (_, "linear_attn.in_proj_b") => "ssm_beta",
        (_, "linear_attn.in_proj_a") => "ssm_alpha",
        (_, "linear_attn.conv1d") => "ssm_conv1d",
        (_, "linear_attn.norm") => "ssm_norm",
        (_, "linear_attn.out_proj") => "ssm_out",
        _ => return None,
    };
    Some(format!("blk.{layer}.{stem}.{kind}"))
}

/// Row `h*hd + half*(hd/2) + i` of the HF layout is row `h*hd + 2i + half` in llama.cpp's.
/// Rows are `cols` elements (floats, or the bytes of a row of quantized blocks).
fn unpermute_rows<T: Copy + Default>(data: &[T], heads: usize, cols: usize) -> Vec<T> {
    move_rows(data, heads, cols, false)
}

/// The inverse of [`unpermute_rows`]: HF q/k rows in llama.cpp's order for interleaved RoPE.
pub fn permute_rows<T: Copy + Default>(data: &[T], heads: usize, cols: usize) -> Vec<T> {
    move_rows(data, heads, cols, true)
}

fn move_rows<T: Copy + Default>(data: &[T], heads: usize, cols: usize, to_gguf: bool) -> Vec<T> {
    let hd = data.len() / cols / heads;
    let mut out = vec![T::default(); data.len()];
    for h in 0..heads {
        for half in 0..2 {
            for i in 0..hd / 2 {
                let hf = (h * hd + half * (hd / 2) + i) * cols;
                let gguf = (h * hd + 2 * i + half) * cols;
                let (dst, src) = if to_gguf { (gguf, hf) } else { (hf, gguf) };
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    out
}

impl GgufWeights<'_> {
    /// Where `name`'s values are, and the GGUF name of the tensor holding them: a whole
    /// tensor, or one expert's slice of one (its shape less the expert count).
    fn find(&self, name: &str) -> Result<(String, TensorInfo)> {
        let (gname, expert) = locate(self.arch, name).with_context(|| format!("no GGUF name for tensor {name}"))?;
        let path = self.file.path.display();
        let info =
            self.file.tensors.get(&gname).with_context(|| format!("{path}: tensor {gname} ({name}) not found"))?;
        let Some(e) = expert else { return Ok((gname, info.clone())) };
        let experts = info.shape.first().copied().unwrap_or(0);
        ensure!(e < experts, "{path}: tensor {gname} holds {experts} experts, not expert {e}");
        let each = info.len_bytes / experts;
        let slice = TensorInfo {
            shape: info.shape[1..].to_vec(),
            dtype: info.dtype,
            offset: info.offset + e * each,
            len_bytes: each,
        };
        Ok((gname, slice))
    }

    /// [`Self::find`], checked to have `shape` and, for ternary and MXFP4 tensors, valid
    /// blocks ([`Self::check_blocks`]).
    fn info(&self, name: &str, shape: &[usize]) -> Result<TensorInfo> {
        let (gname, info) = self.find(name)?;
        check_shape(&self.file.path, &gname, shape, &info.shape)?;
        self.check_blocks(name, &gname, &info)?;
        Ok(info)
    }

    /// llama.cpp's q/k row order undone (weights and biases); `cols` elements per row.
    fn hf_rows<T: Copy + Default>(&self, name: &str, data: Vec<T>, cols: usize) -> Vec<T> {
        match self.permuted_heads(name) {
            Some(heads) => unpermute_rows(&data, heads, cols),
            None => data,
        }
    }

    /// A ternary tensor's codes and scales, or an MXFP4 tensor's scales, checked, the error
    /// naming it.
    fn check_blocks(&self, name: &str, gname: &str, info: &TensorInfo) -> Result<()> {
        let raw = self.file.raw(info);
        let checked = match info.dtype {
            GgmlType::Tq1_0 | GgmlType::Tq2_0 | GgmlType::I2s => {
                ternary::check(info.dtype, raw, info.shape.iter().product())
            }
            GgmlType::Mxfp4 => mxfp4_check(raw),
            _ => return Ok(()),
        };
        checked.map_err(|e| anyhow!("{}: tensor {gname} ({name}, {}): {e}", self.file.path.display(), info.dtype))
    }

    /// The heads whose rows llama.cpp's converter reordered in tensor `name`, if it did.
    fn permuted_heads(&self, name: &str) -> Option<usize> {
        if self.arch != Arch::Llama {
            None
        } else if name.contains(".q_proj.") {
            Some(self.num_heads)
        } else if name.contains(".k_proj.") {
            Some(self.num_kv_heads)
        } else {
            None
        }
    }
}

impl WeightSource for GgufWeights<'_> {
    fn norms_include_one(&self) -> bool {
        true
    }

    fn contains(&self, name: &str) -> bool {
        locate(self.arch, name).is_some_and(|(g, _)| self.file.tensors.contains_key(&g))
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let info = self.info(name, shape)?;
        let data = self.hf_rows(name, self.file.dequantize(&info), shape[1..].iter().product());
        self.file.release(&info);
        Ok(Tensor::owned(shape.to_vec(), data))
    }

    fn load_half(&self, name: &str, shape: &[usize]) -> Result<Option<HalfRows>> {
        let info = self.info(name, shape)?;
        let format = match info.dtype {
            GgmlType::F16 => Half::F16,
            GgmlType::Bf16 => Half::Bf16,
            _ => return Ok(None),
        };
        let cols = shape[1..].iter().product();
        let len = info.len_bytes / 2;
        if self.permuted_heads(name).is_none() {
            if let Some(rows) = HalfRows::mapped(format, cols, self.file.map().clone(), info.offset, len) {
                return Ok(Some(rows));
            }
        }
        let bits = le_u16s(self.file.raw(&info));
        self.file.release(&info);
        Ok(Some(HalfRows::owned(format, cols, self.hf_rows(name, bits, cols))))
    }

    fn load_blocks(&self, name: &str, shape: &[usize]) -> Result<Option<(GgmlType, Cow<'_, [u8]>)>> {
        let info = self.info(name, shape)?;
        if shape.len() == 2 && info.dtype == GgmlType::I2s {
            let tq2 = ternary::i2s_to_tq2_0(self.file.raw(&info), shape[1]);
            return Ok(tq2.map(|b| (GgmlType::Tq2_0, Cow::Owned(b))));
        }
        if !QMatrix::supports(info.dtype) || shape.len() != 2 {
            return Ok(None);
        }
        let raw = self.file.raw(&info);
        Ok(Some((
            info.dtype,
            match self.permuted_heads(name) {
                Some(heads) => Cow::Owned(unpermute_rows(raw, heads, raw.len() / shape[0])),
                None => Cow::Borrowed(raw),
            },
        )))
    }

    fn release(&self, name: &str) {
        if let Ok((_, info)) = self.find(name) {
            self.file.release(&info);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_names() {
        let name = |arch, hf| gguf_name(arch, hf).unwrap();
        assert_eq!(name(Arch::Llama, "model.layers.12.mlp.up_proj.weight"), "blk.12.ffn_up.weight");
        assert_eq!(name(Arch::Llama, "model.embed_tokens.weight"), "token_embd.weight");
        assert_eq!(name(Arch::Qwen2, "model.layers.0.self_attn.k_proj.bias"), "blk.0.attn_k.bias");
        assert_eq!(name(Arch::Llama, "model.layers.3.post_attention_layernorm.weight"), "blk.3.ffn_norm.weight");
        assert_eq!(
            name(Arch::Gemma2, "model.layers.3.post_attention_layernorm.weight"),
            "blk.3.post_attention_norm.weight"
        );
        assert!(gguf_name(Arch::Llama, "model.layers.1.bogus").is_none());
    }

    #[test]
    fn unpermute_inverts_the_llama_cpp_permutation() {
        // One head, hd = 4, 1 column: llama.cpp order is [x0, x2, x1, x3] for HF [x0, x1, x2, x3].
        let gguf = [0.0, 2.0, 1.0, 3.0, 10.0, 12.0, 11.0, 13.0];
        assert_eq!(unpermute_rows(&gguf, 2, 1), vec![0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]);
        let rows: Vec<u32> = (0..48).collect();
        assert_eq!(unpermute_rows(&permute_rows(&rows, 3, 2), 3, 2), rows);
        assert_eq!(permute_rows(&[0.0, 1.0, 2.0, 3.0], 1, 1), [0.0, 2.0, 1.0, 3.0]);
    }
}
