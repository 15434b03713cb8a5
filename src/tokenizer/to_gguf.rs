//! A Hugging Face tokenizer directory written as GGUF `tokenizer.*` metadata, the way
//! llama.cpp's converter writes it, so that a converted file tokenizes like the original in
//! weft ([`super::gguf`] reads it back) and in llama.cpp.

use super::gguf::token_type::{BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED};
use super::gguf::{gpt2_pre_tokenizer, GPT2_PRE_NAMES};
use super::read_json;
use super::spm::SpmModel;
use crate::model::gguf_write::Meta;
use anyhow::{bail, ensure, Context, Result};
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::Path;

/// The score llama.cpp gives pieces that are not the SentencePiece model's own.
const ADDED_SCORE: f32 = -1000.0;

/// Added tokens that llama.cpp treats as control tokens even when not marked special.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// The `tokenizer.*` entries for the tokenizer in `dir` (`tokenizer.json`, with
/// `tokenizer.model` for SentencePiece vocabularies, `tokenizer_config.json` and
/// `config.json` for special tokens and the chat template), its vocabulary padded to
/// `vocab_size` rows as the model's embedding has.
pub fn gguf_metadata(dir: &Path, vocab_size: usize) -> Result<Vec<(String, Meta)>> {
    let doc =
        read_json(&dir.join("tokenizer.json"))?.with_context(|| format!("{}: no tokenizer.json", dir.display()))?;
    let tok_cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
    let cfg = read_json(&dir.join("config.json"))?.unwrap_or(Json::Null);
    let model = &doc["model"];
    ensure!(model["type"] == "BPE", "tokenizer model {} is not supported (only BPE)", model["type"]);
    let added: Vec<(usize, String, bool)> = doc["added_tokens"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| {
                    Some((t["id"].as_u64()? as usize, t["content"].as_str()?.to_owned(), t["special"] == true))
                })
                .collect()
        })
        .unwrap_or_default();

    let merges = || -> Result<Vec<String>> {
        model["merges"]
            .as_array()
            .context("tokenizer.json has no merges")?
            .iter()
            .map(|m| match m {
                Json::String(s) => Ok(s.clone()),
                Json::Array(p) if p.len() == 2 => {
                    Ok(format!("{} {}", p[0].as_str().unwrap_or(""), p[1].as_str().unwrap_or("")))
                }
                other => bail!("merge {other} is neither \"a b\" nor [\"a\", \"b\"]"),
            })
            .collect()
    };
    let gemma4 = cfg["model_type"].as_str().is_some_and(|t| t.starts_with("gemma4"));

    let mut meta: Vec<(String, Meta)> = Vec::new();
    let mut put = |k: &str, v: Meta| meta.push((format!("tokenizer.{k}"), v));
    let tokens = if gemma4 {
        // Gemma 4's SentencePiece-style BPE keeps its merges (llama.cpp's `gemma4`
        // tokenizer): every score −1000, byte pieces typed as bytes, and the chat markers
        // its parser reads user-defined, so that they are always rendered.
        let (tokens, mut types) = bpe_vocab(model, &added, vocab_size)?;
        for (t, ty) in tokens.iter().zip(types.iter_mut()) {
            if GEMMA4_VISIBLE.contains(&t.as_str()) {
                *ty = USER_DEFINED;
            } else if *ty == NORMAL && is_byte_piece(t) {
                *ty = BYTE;
            }
        }
        put("ggml.model", Meta::Str("gemma4".into()));
        put("ggml.tokens", Meta::Strs(tokens.clone()));
        put("ggml.scores", Meta::F32s(vec![ADDED_SCORE; tokens.len()]));
        put("ggml.token_type", Meta::I32s(types));
        put("ggml.merges", Meta::Strs(merges()?));
        put("ggml.add_space_prefix", Meta::Bool(false));
        tokens
    } else if model["byte_fallback"] == true {
        let path = dir.join("tokenizer.model");
        let bytes = std::fs::read(&path).with_context(|| {
            format!("{}: a SentencePiece vocabulary needs its tokenizer.model for the piece scores", path.display())
        })?;
        let spm = SpmModel::parse(&bytes).with_context(|| path.display().to_string())?;
        let (tokens, scores, types) = spm_vocab(spm.pieces, &added, vocab_size)?;
        put("ggml.model", Meta::Str("llama".into()));
        put("ggml.pre", Meta::Str("default".into()));
        put("ggml.tokens", Meta::Strs(tokens.clone()));
        put("ggml.scores", Meta::F32s(scores));
        put("ggml.token_type", Meta::I32s(types));
        put("ggml.add_space_prefix", Meta::Bool(spm.add_dummy_prefix));
        tokens
    } else {
        let (tokens, types) = bpe_vocab(model, &added, vocab_size)?;
        let merges = merges()?;
        put("ggml.model", Meta::Str("gpt2".into()));
        put("ggml.pre", Meta::Str(pre_name(&doc)?.into()));
        put("ggml.tokens", Meta::Strs(tokens.clone()));
        put("ggml.token_type", Meta::I32s(types));
        put("ggml.merges", Meta::Strs(merges));
        tokens
    };

    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    for (name, key) in [("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")] {
        let text = match &tok_cfg[format!("{name}_token")] {
            Json::String(s) => Some(s.as_str()),
            Json::Object(o) => o.get("content").and_then(Json::as_str),
            _ => None,
        };
        let id = text.and_then(|t| ids.get(t).copied()).or_else(|| {
            let from_cfg = &cfg[format!("{name}_token_id")];
            from_cfg.as_u64().or_else(|| from_cfg.as_array()?.first()?.as_u64()).map(|i| i as usize)
        });
        if let Some(id) = id.filter(|&i| i < tokens.len()) {
            put(&format!("ggml.{key}_token_id"), Meta::U32(id as u32));
        }
    }
    for what in ["bos", "eos"] {
        let stated = tok_cfg[format!("add_{what}_token")].as_bool();
        let add = stated.unwrap_or_else(|| what == "bos" && post_processor_adds_bos(&doc["post_processor"]));
        // llama.cpp always adds Gemma 4's BOS.
        let add = add || (gemma4 && what == "bos");
        put(&format!("ggml.add_{what}_token"), Meta::Bool(add));
    }
    let template = match &tok_cfg["chat_template"] {
        Json::String(s) => Some(s.clone()),
        Json::Array(named) => {
            named.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str().map(str::to_owned))
        }
        _ => None,
    };
    if let Some(t) = template {
        put("chat_template", Meta::Str(t));
    }
    Ok(meta)
}

/// Gemma 4's chat markers that llama.cpp's converter types user-defined.
const GEMMA4_VISIBLE: &[&str] =
    &["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", "<|\"|>"];

/// A SentencePiece byte piece, `<0xAB>`.
fn is_byte_piece(t: &str) -> bool {
    t.len() == 6 && t.starts_with("<0x") && t.ends_with('>') && t[3..5].chars().all(|c| c.is_ascii_hexdigit())
}

/// Whether a `post_processor` puts a special token in front of a single sequence.
fn post_processor_adds_bos(p: &Json) -> bool {
    match p["type"].as_str() {
        Some("TemplateProcessing") => p["single"][0].get("SpecialToken").is_some(),
        Some("Sequence") => p["processors"].as_array().is_some_and(|ps| ps.iter().any(post_processor_adds_bos)),
        _ => false,
    }
}

/// The name llama.cpp gives a byte-level BPE pre-tokenizer: the one whose splitting (as
/// [`gpt2_pre_tokenizer`] builds it when reading) is this tokenizer's.
fn pre_name(doc: &Json) -> Result<&'static str> {
    // Offsets and prefix spaces do not change the split; compare everything else.
    fn split_only(v: &Json) -> Json {
        match v {
            Json::Object(o) => Json::Object(
                o.iter()
                    .filter(|(k, _)| !matches!(k.as_str(), "trim_offsets" | "add_prefix_space" | "prepend_scheme"))
                    .map(|(k, v)| (k.clone(), split_only(v)))
                    .collect(),
            ),
            Json::Array(a) => Json::Array(a.iter().map(split_only).collect()),
            other => other.clone(),
        }
    }
    let want = (split_only(&doc["normalizer"]), split_only(&doc["pre_tokenizer"]));
    for &name in GPT2_PRE_NAMES {
        let (normalizer, pre, _) = gpt2_pre_tokenizer(name)?;
        if (split_only(&normalizer), split_only(&pre)) == want {
            return Ok(name);
        }
    }
    bail!(
        "this tokenizer's pre-tokenizer is not one GGUF names here (supported: {}): {}",
        GPT2_PRE_NAMES.join(", "),
        doc["pre_tokenizer"]
    )
}

/// Byte-level BPE: (tokens, types) by id, added tokens typed as llama.cpp types them and
/// ids without a token padded as `[PAD<id>]`.
fn bpe_vocab(model: &Json, added: &[(usize, String, bool)], vocab_size: usize) -> Result<(Vec<String>, Vec<i32>)> {
    let vocab = model["vocab"].as_object().context("tokenizer.json has no vocab")?;
    let n = vocab_size.max(added.iter().map(|a| a.0 + 1).max().unwrap_or(0));
    let mut slots: Vec<Option<(String, i32)>> = vec![None; n];
    for (text, id) in vocab {
        let id = id.as_u64().context("vocab id is not a number")? as usize;
        if let Some(s) = slots.get_mut(id) {
            *s = Some((text.clone(), NORMAL));
        }
    }
    for (id, text, special) in added {
        let ty = if *special || looks_special(text) { CONTROL } else { USER_DEFINED };
        slots[*id] = Some((text.clone(), ty));
    }
    Ok(slots.into_iter().enumerate().map(|(i, s)| s.unwrap_or((format!("[PAD{i}]"), UNUSED))).unzip())
}

/// SentencePiece: the model's pieces with their scores, then the added tokens (score
/// −1000), padded with `[PAD<id>]` to `vocab_size`. An added token that is one of the
/// model's own pieces keeps the piece's score, and its type says whether it is special
/// (the unknown piece stays unknown).
type SpmVocab = (Vec<String>, Vec<f32>, Vec<i32>);
fn spm_vocab(pieces: Vec<(String, f32, i32)>, added: &[(usize, String, bool)], vocab_size: usize) -> Result<SpmVocab> {
    let own = pieces.len();
    let n = vocab_size.max(own);
    let mut tokens = Vec::with_capacity(n);
    let mut scores = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    for (t, s, ty) in pieces {
        tokens.push(t);
        scores.push(s);
        types.push(ty);
    }
    for i in own..n {
        tokens.push(format!("[PAD{i}]"));
        scores.push(ADDED_SCORE);
        types.push(UNUSED);
    }
    for (id, text, special) in added {
        ensure!(*id < n, "added token {text:?} has id {id}, past the vocabulary of {n}");
        let special = *special || looks_special(text);
        let keep = *id < own && tokens[*id] == *text;
        if !keep {
            scores[*id] = ADDED_SCORE;
            // llama.cpp expects user-defined tokens with their spaces already normalized.
            tokens[*id] = if special { text.clone() } else { text.replace('\u{2581}', " ") };
        }
        if !(keep && special && types[*id] == UNKNOWN) {
            types[*id] = if special { CONTROL } else { USER_DEFINED };
        }
    }
    Ok((tokens, scores, types))
}
