//! Builds a `tokenizer.json` document from GGUF tokenizer metadata, the way Hugging Face's
//! converters do, so that GGUF-only models tokenize exactly like their HF originals.

use crate::model::gguf::{GgufFile, Value};
use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value as Json};
use std::collections::HashMap;

/// GGUF's `tokenizer.ggml.token_type` values (SentencePiece's piece types), for reading
/// and for writing ([`super::to_gguf`]).
pub(super) mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}
use token_type::{CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED};

fn strings(g: &GgufFile, key: &str) -> Result<Vec<String>> {
    let arr = g.get(key).and_then(Value::as_array).with_context(|| format!("GGUF has no {key}"))?;
    arr.iter().map(|v| v.as_str().map(str::to_owned).with_context(|| format!("{key}: not strings"))).collect()
}

fn id(g: &GgufFile, key: &str) -> Option<u32> {
    g.get(key).and_then(Value::as_u64).map(|v| v as u32)
}

/// The tokenizer.json equivalent of the GGUF's `tokenizer.ggml.*` metadata.
pub fn tokenizer_json(g: &GgufFile) -> Result<Json> {
    let model = g.get("tokenizer.ggml.model").and_then(Value::as_str).context("GGUF has no tokenizer.ggml.model")?;
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let types: Vec<i32> = match g.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        Some(a) => {
            a.iter().map(|v| if let Value::Int(i) = v { i32::try_from(*i).unwrap_or(NORMAL) } else { NORMAL }).collect()
        }
        None => vec![NORMAL; tokens.len()],
    };
    let bos = id(g, "tokenizer.ggml.bos_token_id");
    let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
    // Without the key, llama.cpp adds BOS for SentencePiece and for Llama 3's vocabulary.
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(model == "llama" || LLAMA3_PRE.contains(&pre));
    // Unused ids (`[PAD<id>]` rows past the real vocabulary) have no token: they decode to
    // nothing, as in llama.cpp and in the original tokenizer.json.
    let vocab: Map<String, Json> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|&(_, (_, &ty))| ty != UNUSED)
        .map(|(i, (t, _))| (t.clone(), json!(i)))
        .collect();

    let added = |special: &dyn Fn(i32) -> Option<bool>| -> Vec<Json> {
        tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter_map(|(i, (t, &ty))| {
                special(ty).map(|s| {
                    json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": s})
                })
            })
            .collect()
    };
    let token = |key: &str, id: u32| {
        tokens.get(id as usize).with_context(|| format!("{key} {id} is outside the vocabulary ({})", tokens.len()))
    };
    let post_processor = match (add_bos, bos) {
        (true, Some(b)) => {
            let bt = token("tokenizer.ggml.bos_token_id", b)?;
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bt, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bt, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bt, "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bt.clone(): {"id": bt, "ids": [b], "tokens": [bt]}}})
        }
        _ => Json::Null,
    };

    match model {
        "gpt2" => {
            let (normalizer, pre_tokenizer, ignore_merges) = gpt2_pre_tokenizer(pre)?;
            let merges = strings(g, "tokenizer.ggml.merges")?;
            Ok(json!({
                "version": "1.0", "truncation": null, "padding": null,
                "added_tokens": added(&|ty| match ty { CONTROL => Some(true), USER_DEFINED => Some(false), _ => None }),
                "normalizer": normalizer,
                "pre_tokenizer": pre_tokenizer,
                "post_processor": post_processor,
                "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
                "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                          "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                          "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges}
            }))
        }
        "llama" => {
            let scores: Vec<f64> = match g.get("tokenizer.ggml.scores").and_then(Value::as_array) {
                Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect(),
                None => vec![0.0; tokens.len()],
            };
            let space_prefix = g.get("tokenizer.ggml.add_space_prefix").and_then(Value::as_bool).unwrap_or(true);
            let unk = match id(g, "tokenizer.ggml.unknown_token_id") {
                Some(u) => Some(token("tokenizer.ggml.unknown_token_id", u)?.clone()),
                None => None,
            };
            let mut spm_added = added(&|ty| match ty {
                CONTROL | UNKNOWN => Some(true),
                USER_DEFINED => Some(false),
                _ => None,
            });
            if is_phi3(g) {
                // Phi-3's tokenizer eats the whitespace after its chat markers, as llama.cpp
                // also does for this model family.
                for t in &mut spm_added {
                    if !matches!(t["content"].as_str(), Some("<unk>" | "<s>" | "<|endoftext|>")) {
                        t["rstrip"] = json!(true);
                    }
                }
            }
            let mut normalizers = Vec::new();
            if space_prefix {
                normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
            }
            normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if space_prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            Ok(json!({
                "version": "1.0", "truncation": null, "padding": null,
                "added_tokens": spm_added,
                "normalizer": {"type": "Sequence", "normalizers": normalizers},
                "pre_tokenizer": null,
                "post_processor": post_processor,
                "decoder": {"type": "Sequence", "decoders": decoders},
                "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                          "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                          "ignore_merges": false, "vocab": vocab, "merges": spm_merges(&tokens, &scores)?}
            }))
        }
        "gemma4" => {
            // Gemma 4: SentencePiece-style BPE with explicit merges over raw UTF-8, spaces
            // as `▁`, no dummy prefix, byte fallback (its tokenizer.json, as llama.cpp's
            // converter reads it back).
            let merges: Vec<Json> = strings(g, "tokenizer.ggml.merges")?
                .iter()
                .map(|m| {
                    // The space after the first character (which may itself be a space).
                    let first = m.chars().next().map_or(0, char::len_utf8);
                    match m[first..].find(' ') {
                        Some(at) => Ok(json!([&m[..first + at], &m[first + at + 1..]])),
                        None => bail!("tokenizer.ggml.merges: {m:?} is not two pieces"),
                    }
                })
                .collect::<Result<_>>()?;
            let unk = match id(g, "tokenizer.ggml.unknown_token_id") {
                Some(u) => Some(token("tokenizer.ggml.unknown_token_id", u)?.clone()),
                None => None,
            };
            Ok(json!({
                "version": "1.0", "truncation": null, "padding": null,
                "added_tokens": added(&|ty| match ty {
                    CONTROL | UNKNOWN => Some(true),
                    USER_DEFINED => Some(false),
                    _ => None,
                }),
                "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
                "pre_tokenizer": null,
                "post_processor": post_processor,
                "decoder": {"type": "Sequence", "decoders": [
                    {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"}]},
                "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                          "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                          "ignore_merges": false, "vocab": vocab, "merges": merges}
            }))
        }
        other => bail!("GGUF tokenizer model '{other}' is not supported (supported: gpt2, llama, gemma4)"),
    }
}

/// The `tokenizer.ggml.pre` names of Llama 3's byte-level BPE.
const LLAMA3_PRE: &[&str] = &["llama-bpe", "llama3", "llama-v3"];

/// Whether the file holds a Phi-3 model (by architecture or, as llama.cpp decides, by name).
fn is_phi3(g: &GgufFile) -> bool {
    let name = g.get("general.name").and_then(Value::as_str).unwrap_or("").to_lowercase();
    g.get("general.architecture").and_then(Value::as_str) == Some("phi3")
        || name.contains("phi-3")
        || name.contains("phi3")
}

/// The `tokenizer.ggml.pre` names [`gpt2_pre_tokenizer`] knows, one per distinct split.
pub(super) const GPT2_PRE_NAMES: &[&str] = &["gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35"];

/// Byte-level BPE splitting for a GGUF `tokenizer.ggml.pre` name, as the original models'
/// tokenizer.json files define it: (normalizer, pre-tokenizer, whether whole words in the
/// vocabulary skip the merges).
pub(super) fn gpt2_pre_tokenizer(pre: &str) -> Result<(Json, Json, bool)> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |regex: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false)]})
    };
    // Llama 3's and Qwen2's patterns differ only in how many digits a number piece holds.
    let pattern = |digits: &str| {
        format!(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{digits}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
    };
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => (Json::Null, byte_level(true), false),
        "smollm" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            false,
        ),
        p if LLAMA3_PRE.contains(&p) => (Json::Null, split(&pattern("{1,3}")), true),
        "qwen2" => (json!({"type": "NFC"}), split(&pattern("")), false),
        // Qwen3.5: letters with their combining marks, one digit a piece; no normaliser, as
        // llama.cpp and the real vocabulary's test vectors (a decomposed é stays e + U+0301).
        "qwen35" => (
            Json::Null,
            split(
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ),
            false,
        ),
        other => bail!(
            "GGUF pre-tokenizer '{other}' is not supported (supported: gpt-2, smollm, llama-bpe, qwen2, qwen35); put the model's tokenizer.json next to the .gguf file"
        ),
    })
}

/// SentencePiece BPE merges from piece scores, as transformers' SentencePieceExtractor
/// derives them: every split of a piece into two pieces is a merge, ranked by the merged
/// piece's score (ties keep vocabulary order).
fn spm_merges(tokens: &[String], scores: &[f64]) -> Result<Vec<Json>> {
    // Deriving merges costs the square of a piece's length; real pieces are a few dozen
    // bytes, and a hostile file must not stall loading.
    if let Some((i, t)) = tokens.iter().enumerate().find(|(_, t)| t.len() > MAX_SPM_PIECE_BYTES) {
        bail!("token {i} has {} bytes; SentencePiece pieces are at most {MAX_SPM_PIECE_BYTES}", t.len());
    }
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(usize, usize, f64)> = Vec::new();
    for (piece, &score) in tokens.iter().zip(scores) {
        let mut local: Vec<(usize, usize, f64)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(i, _)| Some((*ids.get(&piece[..i])?, *ids.get(&piece[i..])?, score)))
            .collect();
        local.sort_by_key(|&(l, r, _)| (l, r));
        merges.extend(local);
    }
    merges.sort_by(|a, b| b.2.total_cmp(&a.2));
    Ok(merges.into_iter().map(|(l, r, _)| json!([tokens[l], tokens[r]])).collect())
}

const MAX_SPM_PIECE_BYTES: usize = 256;
