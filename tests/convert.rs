//! `weft quantize` on a Hugging Face directory: the GGUF file it writes describes the same
//! model as llama.cpp's converter's file of that directory (metadata, vocabulary, tensor
//! names), reproduces the reference outputs from its own metadata alone (no tokenizer.json
//! beside it), and in a block format computes exactly what quantizing at load computes.

mod common;

use common::{assert_matches_reference, reference, shared_models, streamed_text, teacher_forced, FAMILIES, STORIES};
use std::path::{Path, PathBuf};
use weft::loaded::LoadedModel;
use weft::model::convert::hf_to_gguf;
use weft::model::file_type::parse_file_type_name;
use weft::model::gguf::{GgufFile, Value};
use weft::model::requantize::requantize;
use weft::model::WeightDtype;
use weft::tokenizer::gguf_metadata;

/// `dir` converted to `target` in the scratch directory `out`.
fn convert(dir: &Path, target: &str, out: &Path) -> PathBuf {
    let name = dir.file_name().unwrap().to_string_lossy();
    let path = out.join(format!("{name}.{target}.gguf"));
    let ft = parse_file_type_name(target).unwrap().pure();
    hf_to_gguf(dir, &path, ft, |vocab| gguf_metadata(dir, vocab)).unwrap();
    path
}

/// Keys llama.cpp's converter writes that the written file need not repeat: descriptive
/// ones, `add_sep_token` (always false for these models), and `add_space_prefix` on
/// byte-level vocabularies (only SentencePiece reads it; Gemma's converter writes it).
fn compared(key: &str, theirs: &GgufFile) -> bool {
    let byte_level = theirs.get("tokenizer.ggml.model") == Some(&Value::Str("gpt2".into()));
    !key.starts_with("general.")
        && key != "tokenizer.ggml.add_sep_token"
        && !(byte_level && key == "tokenizer.ggml.add_space_prefix")
}

/// The written file against llama.cpp's: every compared key of the latter with the same
/// value (the vocabulary's scores and types on the model's own pieces, which drive the
/// merges; llama.cpp's Phi-3 converter rewrites the special pieces' and the padding's);
/// the same tensors and shapes.
fn assert_same_file(label: &str, ours: &GgufFile, theirs: &GgufFile) {
    let their_types = theirs.get("tokenizer.ggml.token_type").and_then(Value::as_array).unwrap_or(&[]);
    let own_piece = |i: usize| matches!(their_types.get(i), Some(Value::Int(1 | 6)));
    for (key, want) in theirs.metadata.iter().filter(|(k, _)| compared(k, theirs)) {
        let got = ours.get(key).unwrap_or_else(|| panic!("{label}: {key} missing"));
        match (key.as_str(), got, want) {
            ("tokenizer.ggml.scores" | "tokenizer.ggml.token_type", Value::Array(g), Value::Array(w)) => {
                assert_eq!(g.len(), w.len(), "{label}: {key}");
                for i in (0..w.len()).filter(|&i| own_piece(i)) {
                    assert_eq!(g[i], w[i], "{label}: {key}[{i}]");
                }
            }
            (_, Value::Float(g), Value::Float(w)) => {
                assert!((g - w).abs() <= 1e-6 * w.abs(), "{label}: {key} {g} vs {w}")
            }
            _ => assert_eq!(got, want, "{label}: {key}"),
        }
    }
    let shapes = |f: &GgufFile| {
        let mut v: Vec<_> = f.tensors.iter().map(|(n, t)| (n.clone(), t.shape.clone())).collect();
        v.sort();
        v
    };
    assert_eq!(shapes(ours), shapes(theirs), "{label}: tensors");
    for name in ["rope_freqs.weight", "rope_factors_long.weight", "blk.0.attn_norm.weight", "output_norm.weight"] {
        if let (Some(a), Some(b)) = (ours.tensors.get(name), theirs.tensors.get(name)) {
            let (a, b) = (ours.dequantize(a), theirs.dequantize(b));
            assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-6 * y.abs().max(1.0)), "{label}: {name}");
        }
    }
}

#[test]
fn converted_directories_match_llama_cpp_and_the_references() {
    let Some(models) = shared_models() else { return };
    let out = tempfile::tempdir().unwrap();
    // The Hugging Face directories that have a llama.cpp-converted GGUF beside them.
    for &family in [STORIES].iter().chain(FAMILIES) {
        let dir = models.join(family);
        let path = convert(&dir, "f32", out.path());
        let theirs = GgufFile::open(&dir.join(format!("{family}.gguf"))).unwrap();
        assert_same_file(family, &GgufFile::open(&path).unwrap(), &theirs);

        let m = LoadedModel::open(&path, WeightDtype::F32).unwrap();
        for case in reference(family) {
            let ids = m.tokenizer.encode_with(&case.prompt, case.add_special_tokens).unwrap();
            assert_eq!(ids, case.prompt_ids, "{family} {}: prompt ids", case.id);
            let text = streamed_text(&m.tokenizer, &case.prompt_ids, &case.generated_ids);
            assert_eq!(text, case.generated_text_delta, "{family} {}: decoded text", case.id);
        }
        assert_matches_reference(&m, family, family);
    }
}

/// A converted Q8_0 file, computed as stored, gives bit for bit the logits of the directory
/// quantized at load: the same blocks, q/k rows permuted and restored exactly. (Llama 3's
/// RoPE scaling becomes divisors in the file, which round differently, so it is not here.)
#[test]
fn converted_blocks_equal_quantizing_at_load() {
    let Some(models) = shared_models() else { return };
    let out = tempfile::tempdir().unwrap();
    for family in ["stories260k", "tiny-qwen2", "tiny-gemma2"] {
        let dir = models.join(family);
        let file = LoadedModel::open(&convert(&dir, "q8_0", out.path()), WeightDtype::Auto).unwrap();
        let at_load = LoadedModel::open(&dir, WeightDtype::Quantize(weft::kernels::quant::GgmlType::Q8_0)).unwrap();
        assert_eq!(file.model.weight_bytes(), at_load.model.weight_bytes(), "{family}");
        let case = &reference(family)[0];
        let a = teacher_forced(&file, &case.prompt_ids, &case.generated_ids);
        let b = teacher_forced(&at_load, &case.prompt_ids, &case.generated_ids);
        assert!(a == b, "{family}: logits differ");
    }
}

/// `weft quantize --type T` chooses each tensor's type as llama-quantize did for the
/// fixture files of `tiny-llama3-q` (output matrix in Q6_K, the `_M` mixes' layers).
#[test]
fn file_types_mix_as_llama_quantize() {
    let Some(models) = shared_models() else { return };
    let dir = models.join("tiny-llama3-q");
    let out = tempfile::tempdir().unwrap();
    for name in ["Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"] {
        let theirs = GgufFile::open(&dir.join(format!("tiny-llama3-q.{name}.gguf"))).unwrap();
        let path = out.path().join(format!("{name}.gguf"));
        let ft = parse_file_type_name(name).unwrap();
        requantize(&dir.join("tiny-llama3-q.Q8_0.gguf"), &path, ft).unwrap();
        let ours = GgufFile::open(&path).unwrap();
        for (tensor, info) in &theirs.tensors {
            assert_eq!(ours.tensors[tensor].dtype, info.dtype, "{name}: {tensor}");
        }
        assert_eq!(ours.get("general.file_type"), theirs.get("general.file_type"), "{name}");
    }
}
