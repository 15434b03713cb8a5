//! `--speculative-config`: vLLM's JSON shape, checked.

use anyhow::{bail, ensure, Result};
use serde::Deserialize;
use std::path::PathBuf;

/// Most draft tokens per sequence and step.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;
/// Longest n-gram prompt lookup matches.
const MAX_LOOKUP: usize = 64;

/// `--speculative-config`, vLLM's JSON shape.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeConfig {
    pub method: Method,
    /// Draft tokens proposed per step at most (fewer when they do not pay, see [`worth`]).
    pub num_speculative_tokens: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Method {
    /// Prompt lookup over the sequence's own tokens, matching `min..=max` trailing tokens.
    Ngram { min: usize, max: usize },
    /// A smaller model with the same vocabulary, run greedily on its own KV cache.
    DraftModel { model: PathBuf },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    method: Option<String>,
    num_speculative_tokens: usize,
    prompt_lookup_min: Option<usize>,
    prompt_lookup_max: Option<usize>,
    model: Option<PathBuf>,
}

impl std::str::FromStr for SpeculativeConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s).map_err(|e| format!("{e:#}"))
    }
}

impl SpeculativeConfig {
    /// `{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":5}`
    /// or `{"method":"draft_model","model":PATH,"num_speculative_tokens":4}` (a `model`
    /// without `method` means a draft model, as in vLLM).
    pub fn parse(s: &str) -> Result<Self> {
        let raw: Raw = serde_json::from_str(s).map_err(|e| anyhow::anyhow!("speculative config: {e}"))?;
        let k = raw.num_speculative_tokens;
        ensure!(
            (1..=MAX_SPECULATIVE_TOKENS).contains(&k),
            "num_speculative_tokens must be in 1..={MAX_SPECULATIVE_TOKENS}, got {k}"
        );
        let method = match (raw.method.as_deref(), raw.model) {
            (Some("ngram"), None) => {
                // vLLM's defaults: one bound given sets the other; neither, both 5.
                let (min, max) = match (raw.prompt_lookup_min, raw.prompt_lookup_max) {
                    (Some(a), Some(b)) => (a, b),
                    (Some(a), None) | (None, Some(a)) => (a, a),
                    (None, None) => (5, 5),
                };
                ensure!(
                    1 <= min && min <= max && max <= MAX_LOOKUP,
                    "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= {MAX_LOOKUP}, got {min} and {max}"
                );
                Method::Ngram { min, max }
            }
            (Some("ngram"), Some(_)) => bail!("method \"ngram\" takes no model"),
            (Some("draft_model") | None, Some(model)) => {
                ensure!(
                    raw.prompt_lookup_min.is_none() && raw.prompt_lookup_max.is_none(),
                    "prompt_lookup_min/max belong to method \"ngram\""
                );
                Method::DraftModel { model }
            }
            (Some("draft_model") | None, None) => bail!("a draft model needs \"model\": a path weft can load"),
            (Some(other), _) => bail!("unknown speculative method {other:?} (ngram or draft_model)"),
        };
        Ok(SpeculativeConfig { method, num_speculative_tokens: k })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_shaped_configs() {
        let c = SpeculativeConfig::parse(
            r#"{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":5}"#,
        )
        .unwrap();
        assert_eq!(c, SpeculativeConfig { method: Method::Ngram { min: 2, max: 5 }, num_speculative_tokens: 4 });
        let c = SpeculativeConfig::parse(r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}"#);
        assert_eq!(c.unwrap().method, Method::Ngram { min: 4, max: 4 });
        let c = SpeculativeConfig::parse(r#"{"model":"d.gguf","num_speculative_tokens":2}"#).unwrap();
        assert_eq!(c.method, Method::DraftModel { model: "d.gguf".into() });
        for (bad, says) in [
            (r#"{"method":"ngram","num_speculative_tokens":0}"#, "num_speculative_tokens"),
            (r#"{"method":"ngram","num_speculative_tokens":99}"#, "num_speculative_tokens"),
            (r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":3,"prompt_lookup_max":2}"#, "min"),
            (r#"{"method":"eagle","num_speculative_tokens":2}"#, "eagle"),
            (r#"{"method":"draft_model","num_speculative_tokens":2}"#, "model"),
            (r#"{"method":"ngram","num_speculative_tokens":2,"typo":1}"#, "typo"),
            (r#"{"method":"ngram"}"#, "num_speculative_tokens"),
        ] {
            let err = SpeculativeConfig::parse(bad).unwrap_err().to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
