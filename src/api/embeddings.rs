//! `/v1/embeddings`: each input runs through the same engine steps as generation, prefill
//! only, and comes back pooled as the model says (mean or last token; the last token's for
//! a model that says nothing, as llama-server answers for a plain language model), L2
//! normalised; `dimensions` shortens a Matryoshka model's vector and normalises it again.

use super::openai::{check_served, gather, PromptInput};
use super::{off_runtime, parse_split, unix_time, ApiError};
use crate::engine::{EngineHandle, Request, Usage};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Value};

/// Most inputs one request may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

#[derive(Debug, Clone, Deserialize)]
pub struct EmbeddingRequest {
    pub input: PromptInput,
    pub model: Option<String>,
    pub encoding_format: Option<Encoding>,
    pub dimensions: Option<usize>,
    pub user: Option<String>,
    /// vLLM's: keep only each input's last k tokens.
    pub truncate_prompt_tokens: Option<usize>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    Float,
    /// Little-endian f32s, base64-encoded.
    Base64,
}

impl EmbeddingRequest {
    pub fn parse(body: Value) -> Result<Self, ApiError> {
        Ok(parse_split::<EmbeddingRequest, Value>(body)?.0)
    }

    /// One engine request per input, checked and tokenized.
    fn engine_requests(&self, engine: &EngineHandle) -> Result<Vec<Request>, ApiError> {
        check_served(engine, self.model.as_deref())?;
        let bad = |m: String| ApiError::invalid(m, Some("input"));
        let count = match &self.input {
            PromptInput::Text(_) | PromptInput::Tokens(_) => 1,
            PromptInput::Texts(v) => v.len(),
            PromptInput::TokenLists(v) => v.len(),
        };
        if count == 0 || count > MAX_INPUTS {
            return Err(bad(format!("input must hold 1 to {MAX_INPUTS} items, got {count}")));
        }
        engine.check_fan_out(count)?;
        let config = &engine.model().model.config;
        if let Some(d) = self.dimensions {
            if !config.matryoshka {
                return Err(ApiError::invalid(
                    "this model does not support `dimensions` (it was not trained for shortened embeddings)",
                    Some("dimensions"),
                ));
            }
            if d == 0 || d > config.hidden_size {
                return Err(ApiError::invalid(
                    format!("dimensions must be between 1 and {}, got {d}", config.hidden_size),
                    Some("dimensions"),
                ));
            }
        }
        let tok = &engine.model().tokenizer;
        let enc = |t: &str| tok.encode(t).map_err(|e| bad(e.to_string()));
        let inputs: Vec<Vec<u32>> = match &self.input {
            PromptInput::Text(t) => vec![enc(t)?],
            PromptInput::Texts(ts) => ts.iter().map(|t| enc(t)).collect::<Result<_, _>>()?,
            PromptInput::Tokens(ids) => vec![ids.clone()],
            PromptInput::TokenLists(l) => l.clone(),
        };
        // The context less the one position the engine keeps for a token after the prompt.
        let max = engine.max_model_len().min(engine.capacity_tokens()).saturating_sub(1);
        inputs
            .into_iter()
            .enumerate()
            .map(|(i, mut ids)| {
                if let Some(k) = self.truncate_prompt_tokens {
                    ids.drain(..ids.len().saturating_sub(k));
                }
                if ids.is_empty() {
                    return Err(bad(format!("input {i} is empty")));
                }
                if ids.len() > max {
                    return Err(bad(format!(
                        "input {i} is {} tokens, more than the {max} this model takes",
                        ids.len()
                    )));
                }
                Ok(Request { embed: true, ..Request::new(ids, 1) })
            })
            .collect()
    }

    /// The response: every input submitted before any is awaited, so they batch.
    pub async fn run(&self, engine: &EngineHandle) -> Result<Value, ApiError> {
        let (req, e) = (self.clone(), engine.clone());
        let reqs = off_runtime(move || req.engine_requests(&e)).await?;
        // The engine's checks name the prompt; here it is the input.
        let renamed = |e: crate::engine::SubmitError| {
            let mut e = ApiError::from(e);
            if e.param.as_deref() == Some("prompt") {
                e.param = Some("input".into());
            }
            e
        };
        let streams = reqs.into_iter().map(|r| engine.submit(r).map_err(renamed)).collect::<Result<Vec<_>, _>>()?;
        let (mut data, mut total) = (Vec::with_capacity(streams.len()), Usage::default());
        for (index, s) in streams.into_iter().enumerate() {
            let g = gather(s, 1).await?;
            total.add_request(&g.usage);
            let vector = self.shape(g.embedding);
            let embedding = match self.encoding_format {
                Some(Encoding::Base64) => {
                    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
                _ => json!(vector),
            };
            data.push(json!({"object": "embedding", "index": index, "embedding": embedding}));
        }
        Ok(json!({"object": "list", "data": data, "model": engine.model().name, "created": unix_time(),
            "usage": {"prompt_tokens": total.prompt_tokens, "total_tokens": total.prompt_tokens}}))
    }

    /// The vector at the asked `dimensions`, normalised again when shortened.
    fn shape(&self, mut v: Vec<f32>) -> Vec<f32> {
        if let Some(d) = self.dimensions.filter(|&d| d < v.len()) {
            v.truncate(d);
            let norm = v.iter().map(|x| (x * x) as f64).sum::<f64>().sqrt().max(1e-12) as f32;
            v.iter_mut().for_each(|x| *x /= norm);
        }
        v
    }
}
