//! `weft export-tokenizer --model M --out DIR`: the model's tokenizer, chat template and
//! context as a Hugging Face folder (`tokenizer.json`, `tokenizer_config.json`,
//! `config.json`, `generation_config.json`), for a frontend that tokenizes itself (Dynamo's,
//! a gateway's) in front of a GGUF that has no such folder beside it. Only the file's
//! metadata is read, never its weights.

use crate::model::gguf::GgufFile;
use crate::model::ModelConfig;
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct ExportTokenizerArgs {
    /// A GGUF file, or a Hugging Face directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The folder to write (created if needed).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: ExportTokenizerArgs) -> Result<()> {
    let (config, tokenizer) = read(&args.model)?;
    let files = folder(&config, &tokenizer)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    for (name, value) in &files {
        let path = args.out.join(name);
        std::fs::write(&path, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    eprintln!("weft: wrote {} ({} tokens)", args.out.display(), tokenizer.vocab_size());
    Ok(())
}

/// The model's configuration and tokenizer, without its weights.
fn read(model: &Path) -> Result<(ModelConfig, Tokenizer)> {
    if model.is_dir() {
        Ok((ModelConfig::from_hf_json(&model.join("config.json"))?, Tokenizer::from_dir(model)?))
    } else if model.is_file() {
        let g = GgufFile::open(model)?;
        Ok((ModelConfig::from_gguf(&g)?, Tokenizer::from_gguf(&g)?))
    } else {
        bail!("model path {} does not exist", model.display())
    }
}

/// The four files, by name.
fn folder(config: &ModelConfig, tok: &Tokenizer) -> Result<Vec<(&'static str, Value)>> {
    let name = |id: Option<u32>| id.and_then(|i| tok.decode(&[i], false).ok());
    let eos: Value = match tok.eos_ids.as_slice() {
        [one] => json!(one),
        many => json!(many),
    };
    let tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(tok.bos_id),
        "eos_token": name(tok.eos_ids.first().copied()),
        "add_bos_token": tok.adds_bos,
        "chat_template": tok.chat_template,
        "model_max_length": config.max_position_embeddings,
    });
    let (model_type, class) = config.arch.hf_names(config.moe.is_some());
    let model_config = json!({
        "architectures": [class],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "bos_token_id": tok.bos_id,
        "eos_token_id": eos,
    });
    let generation = json!({"bos_token_id": tok.bos_id, "eos_token_id": eos});
    Ok(vec![
        ("tokenizer.json", tok.to_json()?),
        ("tokenizer_config.json", tokenizer_config),
        ("config.json", model_config),
        ("generation_config.json", generation),
    ])
}
