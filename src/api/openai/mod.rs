//! `/v1/completions` and `/v1/chat/completions`: the request fields (OpenAI's, plus the
//! extras vLLM accepts), each written once; their checks and conversion to engine
//! requests ([`requests`]); the non-streaming response bodies ([`responses`]).

use super::chat::{ChatMessage, ROLES};
use super::harmony;
use super::tools::{self, Tool, ToolChoice, ToolFormat, Tools};
use super::{off_runtime, parse_split, unix_time, ApiError};
use crate::engine::{EngineHandle, Event, FinishReason, Request, RequestStream, Usage};
use crate::grammar::{Constraint, Grammar};
use crate::sampling::{PromptLogprob, SamplingParams, StopCondition, TokenLogprob};
use crate::tokenizer::{ChatContext, Tokenizer};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;

mod requests;
mod responses;

pub use requests::check_served;
pub use responses::*;

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of those.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// vLLM: every chunk carries the request's token counts so far.
    pub continuous_usage_stats: Option<bool>,
}

/// Fields shared by completions and chat completions.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationFields {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<usize>,
    pub stop: Option<OneOrMany<String>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub user: Option<String>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub priority: Option<i32>,
    pub skip_special_tokens: Option<bool>,
    /// vLLM's tenant key for the prefix cache.
    pub cache_salt: Option<String>,
    pub response_format: Option<ResponseFormat>,
    /// vLLM's structured outputs, and its older `guided_*` spellings of the same.
    pub structured_outputs: Option<StructuredOutputs>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    /// vLLM's prompt scoring: each prompt token's log-probability with this many alternatives.
    pub prompt_logprobs: Option<usize>,
    pub min_tokens: Option<usize>,
    pub include_stop_str_in_output: Option<bool>,
    /// Keep only the prompt's last k tokens (-1: as many as the context allows).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: each choice carries its generated `token_ids` (each streamed chunk its own),
    /// and the response its `prompt_token_ids`, for a frontend that tokenizes itself.
    pub return_token_ids: Option<bool>,
}

/// OpenAI's `response_format`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub schema: Option<Value>,
    /// Always strict here: the grammar engine never lets output leave the schema.
    pub strict: Option<bool>,
}

/// vLLM's `structured_outputs`: one of its constraints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredOutputs {
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

/// `/v1/completions`' own fields; the rest are [`GenerationFields`].
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    pub logprobs: Option<usize>,
    pub echo: Option<bool>,
    /// Samples drawn per prompt, of which the `n` with the highest cumulative logprob return.
    pub best_of: Option<usize>,
    /// Deserialized apart, from the same body ([`parse_split`]).
    #[serde(skip)]
    pub gen: GenerationFields,
}

/// `/v1/chat/completions`' own fields; the rest are [`GenerationFields`].
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub add_generation_prompt: Option<bool>,
    /// Extra template variables (vLLM's `chat_template_kwargs`, e.g. `date_string`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    /// Deserialized apart, from the same body ([`parse_split`]).
    #[serde(skip)]
    pub gen: GenerationFields,
}
