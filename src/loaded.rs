//! Opening a model path — a Hugging Face directory or a `.gguf` file — into weights and
//! tokenizer.

use crate::grammar::GrammarCompiler;
use crate::model::gguf::GgufFile;
use crate::model::loader::{GgufWeights, SafetensorsWeights};
use crate::model::{Decoder, ModelConfig, WeightDtype};
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Result};
use std::path::Path;
use std::sync::OnceLock;

pub struct LoadedModel {
    pub model: Decoder,
    pub tokenizer: Tokenizer,
    /// The name the API reports (`--served-model-name`, else the directory or file stem).
    pub name: String,
    /// Further names requests may use for it.
    pub aliases: Vec<String>,
    /// The structured-output compiler, built on the first request that needs one.
    grammars: OnceLock<Result<GrammarCompiler, String>>,
}

impl LoadedModel {
    /// Opens a model, its weights computed in the form `dtype` asks for.
    pub fn open(path: &Path, dtype: WeightDtype) -> Result<Self> {
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let (model, tokenizer) = if path.is_dir() {
            let cfg_path = path.join("config.json");
            if !cfg_path.exists() {
                bail!("{}: no config.json (expected a Hugging Face model directory or a .gguf file)", path.display());
            }
            let config = ModelConfig::from_hf_json(&cfg_path)?;
            let weights = SafetensorsWeights::open_dir(path)?;
            let tokenizer = Tokenizer::from_dir(path)?;
            (Decoder::load(config, &weights, dtype)?, tokenizer)
        } else if path.is_file() {
            let g = GgufFile::open(path)?;
            let config = ModelConfig::from_gguf(&g)?;
            let weights = GgufWeights::new(&g, &config);
            let tokenizer = Tokenizer::from_gguf(&g)?;
            (Decoder::load(config, &weights, dtype)?, tokenizer)
        } else {
            bail!("model path {} does not exist", path.display());
        };
        let vocab = model.config.vocab_size;
        if tokenizer.vocab_size() > vocab {
            bail!("{}: tokenizer has {} tokens but the model only {vocab}", path.display(), tokenizer.vocab_size());
        }
        if let Some(bad) = tokenizer.eos_ids.iter().chain(&tokenizer.bos_id).find(|&&id| id as usize >= vocab) {
            bail!("{}: special token id {bad} is outside the vocabulary ({vocab})", path.display());
        }
        Ok(LoadedModel { model, tokenizer, name, aliases: Vec::new(), grammars: OnceLock::new() })
    }

    /// The compiler for this model's structured-output grammars (built once: its token
    /// trie over the whole vocabulary takes a moment).
    pub fn grammars(&self) -> Result<&GrammarCompiler, String> {
        self.grammars
            .get_or_init(|| GrammarCompiler::new(&self.tokenizer).map_err(|e| format!("structured output: {e:#}")))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Whether a request naming `model` means this one.
    pub fn serves(&self, model: &str) -> bool {
        self.name == model || self.aliases.iter().any(|a| a == model)
    }
}
