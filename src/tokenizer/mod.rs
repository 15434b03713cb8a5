//! Text ⇄ token ids: Hugging Face `tokenizers` plus what the engine needs around it (BOS
//! and EOS ids, the chat template, streaming detokenization).

mod chat_template;
mod detokenizer;
mod gguf;
mod spm;
mod to_gguf;

pub use chat_template::{ChatContext, ChatTemplate};
pub use detokenizer::Detokenizer;
pub use to_gguf::gguf_metadata;

use crate::model::gguf::{GgufFile, Value};
use anyhow::{anyhow, Context, Result};
use serde_json::Value as Json;
use std::path::Path;
use std::sync::OnceLock;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Token ids that end generation (unless the request ignores EOS).
    pub eos_ids: Vec<u32>,
    pub bos_id: Option<u32>,
    /// Whether `encode` puts BOS in front of the text.
    pub adds_bos: bool,
    /// Jinja chat template source, when the model has one.
    pub chat_template: Option<String>,
    /// The template, compiled on first use and then shared by every request.
    compiled: OnceLock<Result<ChatTemplate, String>>,
    /// Token ids of byte-fallback pieces (`<0x41>`), by id.
    byte_tokens: Vec<bool>,
}

fn read_json(path: &Path) -> Result<Option<Json>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Some(serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?))
}

/// Ids from a config field that holds one id or a list of ids.
fn ids_of(v: Option<&Json>) -> Vec<u32> {
    match v {
        Some(Json::Number(n)) => n.as_u64().map(|i| vec![i as u32]).unwrap_or_default(),
        Some(Json::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|i| i as u32)).collect(),
        _ => Vec::new(),
    }
}

/// A special-token field: either `"<s>"` or `{"content": "<s>", ...}`.
fn token_text(v: Option<&Json>) -> Option<&str> {
    match v? {
        Json::String(s) => Some(s),
        Json::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a model directory, with `tokenizer_config.json`,
    /// `generation_config.json` and `config.json` for special ids and the chat template.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow!("{}: cannot load tokenizer: {e}", path.display()))?;
        let tok_cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
        let gen_cfg = read_json(&dir.join("generation_config.json"))?.unwrap_or(Json::Null);
        let cfg = read_json(&dir.join("config.json"))?.unwrap_or(Json::Null);

        let mut eos_ids = ids_of(gen_cfg.get("eos_token_id"));
        eos_ids.extend(ids_of(cfg.get("eos_token_id")));
        if let Some(id) = token_text(tok_cfg.get("eos_token")).and_then(|t| inner.token_to_id(t)) {
            eos_ids.push(id);
        }
        let mut bos_id = ids_of(cfg.get("bos_token_id")).first().copied();
        if let Some(id) = token_text(tok_cfg.get("bos_token")).and_then(|t| inner.token_to_id(t)) {
            bos_id = Some(id);
        }
        let chat_template = tok_cfg.get("chat_template").and_then(Json::as_str).map(str::to_owned);
        Ok(Self::new(inner, eos_ids, bos_id, chat_template))
    }

    /// Uses `tokenizer.json` next to a GGUF file when present, else the GGUF's own metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let dir = g.path.parent().unwrap_or(Path::new("."));
        let id = |k: &str| g.get(k).and_then(Value::as_u64).map(|v| v as u32);
        let mut eos_ids: Vec<u32> =
            ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"].iter().filter_map(|k| id(k)).collect();
        let bos_id = id("tokenizer.ggml.bos_token_id");
        let template = g.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_owned);
        if dir.join("tokenizer.json").exists() {
            let mut t = Self::from_dir(dir)?;
            eos_ids.extend(t.eos_ids);
            t.eos_ids = eos_ids;
            t.eos_ids.sort_unstable();
            t.eos_ids.dedup();
            t.bos_id = t.bos_id.or(bos_id);
            t.chat_template = t.chat_template.or(template);
            return Ok(t);
        }
        Self::from_gguf_metadata(g, eos_ids, bos_id, template)
    }

    /// The tokenizer described by the GGUF's `tokenizer.ggml.*` metadata alone.
    pub fn from_gguf_metadata(
        g: &GgufFile,
        eos_ids: Vec<u32>,
        bos_id: Option<u32>,
        chat_template: Option<String>,
    ) -> Result<Self> {
        let doc = gguf::tokenizer_json(g).with_context(|| format!("{}: building tokenizer", g.path.display()))?;
        let inner: tokenizers::Tokenizer = serde_json::from_value::<tokenizers::Tokenizer>(doc)
            .map_err(|e| anyhow!("{}: tokenizer from GGUF metadata: {e}", g.path.display()))?;
        Ok(Self::new(inner, eos_ids, bos_id, chat_template))
    }

    fn new(
        inner: tokenizers::Tokenizer,
        mut eos_ids: Vec<u32>,
        bos_id: Option<u32>,
        chat_template: Option<String>,
    ) -> Self {
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let adds_bos =
            bos_id.is_some_and(|b| inner.encode("", true).map(|e| e.get_ids().first() == Some(&b)).unwrap_or(false));
        let mut byte_tokens = vec![false; inner.get_vocab_size(true)];
        for (piece, id) in inner.get_vocab(true) {
            let b = piece.as_bytes();
            let is_byte =
                b.len() == 6 && b.starts_with(b"<0x") && b[5] == b'>' && b[3..5].iter().all(u8::is_ascii_hexdigit);
            if let Some(slot) = byte_tokens.get_mut(id as usize) {
                *slot = is_byte;
            }
        }
        Tokenizer { inner, eos_ids, bos_id, adds_bos, chat_template, compiled: OnceLock::new(), byte_tokens }
    }

    /// A byte-fallback piece (`<0x41>`): its text depends on the bytes next to it.
    pub fn is_byte_token(&self, id: u32) -> bool {
        self.byte_tokens.get(id as usize).copied().unwrap_or(false)
    }

    /// Replaces the model's chat template (`--chat-template`), compiled now so that a
    /// broken one is reported at startup.
    pub fn set_chat_template(&mut self, source: String) -> Result<(), String> {
        self.chat_template = Some(source);
        self.compiled = OnceLock::new();
        self.chat().map(|_| ())
    }

    /// The compiled chat template; an error when the model has none or it does not parse.
    pub fn chat(&self) -> Result<&ChatTemplate, String> {
        let src = self.chat_template.as_deref().ok_or("this model has no chat template; use /v1/completions")?;
        self.compiled
            .get_or_init(|| {
                let name = |id: Option<u32>| id.and_then(|i| self.decode(&[i], false).ok()).unwrap_or_default();
                ChatTemplate::new(src, name(self.bos_id), name(self.eos_ids.first().copied()))
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The tokenizer in `tokenizer.json` form (the grammar compiler reads each token's bytes
    /// from it).
    pub fn to_json(&self) -> Result<Json> {
        serde_json::to_value(&self.inner).map_err(|e| anyhow!("serializing the tokenizer: {e}"))
    }

    /// The id of a token given by its text (a special token's name, for instance).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text`, with the model's special tokens (BOS) added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// Token ids of `text`, with or without the special tokens the tokenizer adds (without,
    /// for text a chat template already began with BOS).
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| anyhow!("detokenizing: {e}"))
    }
}
