//! The type each matrix of a written GGUF gets, as llama-quantize's file types decide: a
//! base format; the output matrix (the embedding, when tied) in Q6_K, since every token's
//! logits go through it; and for the `_S`/`_M` K-quant mixes, more bits on the attention
//! value and MLP down projections of some layers, which quantization hurts most. Rows that
//! are not whole blocks of the chosen format fall back as [`fitting`] says.

use crate::kernels::quant::GgmlType;
use crate::kernels::quantize::{fitting, parse_file_type};

/// Which tensors get more bits than the base format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// Every matrix in the base format (llama-quantize's `--pure`).
    Pure,
    /// The output matrix in Q6_K, the rest in the base format.
    Plain,
    /// `Q4_K_S`: also the first layers' attn_v and ffn_down in Q5_K.
    Small,
    /// `Q4_K_M` / `Q5_K_M`: also attn_v and ffn_down in Q6_K on the layers
    /// [`use_more_bits`] picks, and a fused qkv one step up.
    Medium,
}

/// A GGUF file type: its base format and mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileType {
    pub base: GgmlType,
    pub mix: Mix,
}

/// A file type from its llama-quantize name: a writable type (`q4_0`, `q6_k`, `bf16`, ...) or
/// a K-quant mix (`q4_k_s`, `q4_k_m`, `q5_k_s`, `q5_k_m`); `q4_k` and `q5_k` are the `_s`
/// mixes, as llama-quantize has no plain one.
pub fn parse_file_type_name(s: &str) -> Result<FileType, String> {
    let (base, mix) = match s.to_ascii_lowercase().as_str() {
        "q4_k_s" | "q4_k" => (GgmlType::Q4K, Mix::Small),
        "q4_k_m" => (GgmlType::Q4K, Mix::Medium),
        "q5_k_s" | "q5_k" => (GgmlType::Q5K, Mix::Plain),
        "q5_k_m" => (GgmlType::Q5K, Mix::Medium),
        other => (parse_file_type(other).map_err(|e| format!("{e}, q4_k_s, q4_k_m, q5_k_s, q5_k_m"))?, Mix::Plain),
    };
    Ok(FileType { base, mix })
}

impl std::fmt::Display for FileType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.mix {
            Mix::Pure => write!(f, "{} (pure)", self.base),
            Mix::Small => write!(f, "{}_S", self.base),
            Mix::Medium => write!(f, "{}_M", self.base),
            Mix::Plain if matches!(self.base, GgmlType::Q5K) => write!(f, "{}_S", self.base),
            Mix::Plain => write!(f, "{}", self.base),
        }
    }
}

/// llama.cpp's choice of layers for more bits: the first and last eighth, and every third
/// layer between.
fn use_more_bits(layer: usize, layers: usize) -> bool {
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

impl FileType {
    /// Every matrix in `base`.
    pub fn pure(self) -> Self {
        FileType { mix: Mix::Pure, ..self }
    }

    /// llama.cpp's `general.file_type` for the file.
    pub fn id(self) -> u32 {
        match (self.base, self.mix) {
            (GgmlType::F32, _) => 0,
            (GgmlType::F16, _) => 1,
            (GgmlType::Bf16, _) => 32,
            (GgmlType::Q4_0, _) => 2,
            (GgmlType::Q4_1, _) => 3,
            (GgmlType::Q8_0, _) => 7,
            (GgmlType::Q5_0, _) => 8,
            (GgmlType::Q5_1, _) => 9,
            (GgmlType::Q4K, Mix::Medium) => 15,
            (GgmlType::Q4K, _) => 14,
            (GgmlType::Q5K, Mix::Medium) => 17,
            (GgmlType::Q5K, _) => 16,
            (GgmlType::Q6K, _) => 18,
            (GgmlType::Iq4Nl, _) => 25,
            (GgmlType::Iq4Xs, _) => 30,
            (GgmlType::Tq1_0, _) => 36,
            (GgmlType::Tq2_0, _) => 37,
            (other, _) => unreachable!("{other:?} is not a file type"),
        }
    }

    /// The type of tensor `name` (a GGUF tensor name) of `shape`, in a model of `layers`
    /// layers whose output matrix is the embedding when `tied`; `None` for what is not a
    /// matrix (norms, biases, empty tensors: the caller keeps them in full precision) and
    /// when no format fits the rows.
    pub fn tensor_type(self, name: &str, shape: &[usize], layers: usize, tied: bool) -> Option<GgmlType> {
        // A mixture's experts are stacked in one tensor `[experts, rows, k]`; its router
        // stays as stored (f32), as llama-quantize keeps it.
        let stacked = shape.len() == 3 && name.contains("_exps.");
        let matrix = (shape.len() == 2 || stacked) && shape.iter().all(|&d| d > 0) && name.ends_with(".weight");
        if !matrix || name.contains(".ffn_gate_inp.") {
            return None;
        }
        match self.wanted(name, layers, tied) {
            // No fallback: a ternary target is refused where it does not fit exactly.
            t @ (GgmlType::Tq1_0 | GgmlType::Tq2_0) => Some(t),
            t => fitting(t, shape[shape.len() - 1]),
        }
    }

    fn wanted(self, name: &str, layers: usize, tied: bool) -> GgmlType {
        use GgmlType::{Q4K, Q5K, Q6K};
        if self.mix == Mix::Pure {
            return self.base;
        }
        let ternary = matches!(self.base, GgmlType::Tq1_0 | GgmlType::Tq2_0);
        if ternary && (name == "output.weight" || name == "token_embd.weight") {
            // BitNet's embedding (and LM head) is not ternary: f16, as llama-quantize is
            // asked for with `--token-embedding-type f16`.
            return GgmlType::F16;
        }
        if name == "output.weight" || (tied && name == "token_embd.weight") {
            let keep = matches!(self.base, GgmlType::Q8_0 | Q6K | GgmlType::F16 | GgmlType::Bf16 | GgmlType::F32);
            return if keep { self.base } else { Q6K };
        }
        let Some((layer, kind)) = name
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(i, rest)| Some((i.parse::<usize>().ok()?, rest.strip_suffix(".weight")?)))
        else {
            return self.base;
        };
        // Stacked experts are mixed as the dense matrices they replace.
        let kind = kind.strip_suffix("_exps").unwrap_or(kind);
        match (self.mix, kind) {
            (Mix::Medium, "attn_v" | "ffn_down") if use_more_bits(layer, layers) => Q6K,
            (Mix::Medium, "attn_qkv") => {
                if self.base == Q4K {
                    Q5K
                } else {
                    Q6K
                }
            }
            (Mix::Small, "attn_v") if layer < 4 => Q5K,
            (Mix::Small, "ffn_down") if layer < layers / 8 => Q5K,
            _ => self.base,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ft(s: &str) -> FileType {
        parse_file_type_name(s).unwrap()
    }

    /// The 16-layer Llama-3.2-1B layout llama-quantize writes for Q4_K_M (checked against
    /// its file): Q6_K on layers 0, 1, 4, 7, 10, 13, 14, 15 for attn_v and ffn_down.
    #[test]
    fn q4_k_m_picks_llama_cpp_layers() {
        let q = ft("q4_k_m");
        let six: Vec<usize> = (0..16)
            .filter(|i| q.tensor_type(&format!("blk.{i}.ffn_down.weight"), &[1, 8192], 16, true) == Some(GgmlType::Q6K))
            .collect();
        assert_eq!(six, [0, 1, 4, 7, 10, 13, 14, 15]);
        assert_eq!(q.tensor_type("blk.4.attn_v.weight", &[1, 2048], 16, true), Some(GgmlType::Q6K));
        assert_eq!(q.tensor_type("blk.4.attn_q.weight", &[1, 2048], 16, true), Some(GgmlType::Q4K));
        assert_eq!(q.tensor_type("token_embd.weight", &[1, 2048], 16, true), Some(GgmlType::Q6K));
        assert_eq!(q.tensor_type("token_embd.weight", &[1, 2048], 16, false), Some(GgmlType::Q4K));
        assert_eq!(q.tensor_type("output.weight", &[1, 576], 16, false), Some(GgmlType::Q8_0), "Q6_K's fallback");
        assert_eq!(q.tensor_type("blk.2.ffn_up.weight", &[1, 576], 16, true), Some(GgmlType::Q5_0), "Q4_K's fallback");
        assert_eq!(q.id(), 15);
        // Experts stacked in one tensor mix as the dense matrices; the router stays f32.
        let exps = |n: &str| q.tensor_type(n, &[8, 4, 2048], 16, true);
        assert_eq!(exps("blk.4.ffn_down_exps.weight"), Some(GgmlType::Q6K));
        assert_eq!(exps("blk.5.ffn_down_exps.weight"), Some(GgmlType::Q4K));
        assert_eq!(exps("blk.5.ffn_gate_exps.weight"), Some(GgmlType::Q4K));
        assert_eq!(q.tensor_type("blk.5.ffn_gate_inp.weight", &[8, 2048], 16, true), None);
        assert_eq!(q.tensor_type("blk.5.ffn_up.weight", &[8, 4, 2048], 16, true), None, "3-d, not experts");
    }

    #[test]
    fn plain_pure_and_small_types() {
        assert_eq!(ft("q4_0").tensor_type("output.weight", &[1, 64], 2, false), Some(GgmlType::Q8_0));
        assert_eq!(ft("q4_0").pure().tensor_type("output.weight", &[1, 64], 2, false), Some(GgmlType::Q4_0));
        assert_eq!(ft("q8_0").tensor_type("output.weight", &[1, 64], 2, false), Some(GgmlType::Q8_0));
        assert_eq!(ft("f16").tensor_type("token_embd.weight", &[1, 7], 2, true), Some(GgmlType::F16));
        let s = ft("q4_k_s");
        assert_eq!(s.tensor_type("blk.3.attn_v.weight", &[1, 256], 32, true), Some(GgmlType::Q5K));
        assert_eq!(s.tensor_type("blk.4.attn_v.weight", &[1, 256], 32, true), Some(GgmlType::Q4K));
        assert_eq!(s.tensor_type("blk.3.ffn_down.weight", &[1, 256], 32, true), Some(GgmlType::Q5K));
        assert_eq!(s.tensor_type("blk.4.ffn_down.weight", &[1, 256], 32, true), Some(GgmlType::Q4K));
        assert_eq!(ft("q4_0").tensor_type("blk.0.ffn_up.weight", &[1, 33], 2, true), None);
        assert!(parse_file_type_name("q3_k").is_err());
        assert_eq!((ft("q4_k").id(), ft("q5_k_m").id(), ft("q6_k").id(), ft("f32").id()), (14, 17, 18, 0));
        assert_eq!(ft("bf16").tensor_type("output.weight", &[1, 7], 2, false), Some(GgmlType::Bf16));
        assert_eq!(ft("q8_0").tensor_type("blk.0.attn_norm.weight", &[256], 2, false), None, "a norm");
        assert_eq!(ft("q8_0").tensor_type("blk.0.attn_q.bias", &[1, 256], 2, false), None, "not a weight");
        assert_eq!(ft("q8_0").tensor_type("blk.0.attn_q.weight", &[0, 256], 2, false), None, "empty");
    }
}
