//! `/v1/completions` and `/v1/chat/completions`: request fields (OpenAI's, plus the extras
//! vLLM accepts), their conversion to engine requests, and the non-streaming response bodies.

use super::chat::{ChatMessage, ROLES};
use super::tools::{self, Tool, ToolChoice, ToolFormat, Tools};
use super::{off_runtime, parse_split, unix_time, ApiError};
use crate::engine::{EngineHandle, Event, FinishReason, Request, RequestStream, Usage};
use crate::grammar::{Constraint, Grammar};
use crate::sampling::{PromptLogprob, SamplingParams, StopCondition, TokenLogprob};
use crate::tokenizer::{ChatContext, Tokenizer};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;

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

/// The keys of [`GenerationFields`], as they appear in a request body.
pub const GENERATION_KEYS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "priority",
    "skip_special_tokens",
    "cache_salt",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "prompt_logprobs",
    "min_tokens",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
];

#[derive(Debug, Clone, Deserialize)]
struct CompletionOwn {
    prompt: PromptInput,
    logprobs: Option<usize>,
    echo: Option<bool>,
    best_of: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    pub logprobs: Option<usize>,
    pub echo: Option<bool>,
    /// Samples drawn per prompt, of which the `n` with the highest cumulative logprob return.
    pub best_of: Option<usize>,
    pub gen: GenerationFields,
}

#[derive(Debug, Clone, Deserialize)]
struct ChatOwn {
    messages: Vec<ChatMessage>,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    max_completion_tokens: Option<usize>,
    add_generation_prompt: Option<bool>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    tools: Option<Vec<Tool>>,
    tool_choice: Option<ToolChoice>,
    parallel_tool_calls: Option<bool>,
}

#[derive(Debug, Clone)]
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
    pub gen: GenerationFields,
}

impl CompletionRequest {
    pub fn parse(body: Value) -> Result<Self, ApiError> {
        let (own, gen): (CompletionOwn, GenerationFields) =
            parse_split(body, &["prompt", "logprobs", "echo", "best_of"], GENERATION_KEYS)?;
        let n = gen.n.unwrap_or(1);
        if let Some(b) = own.best_of.filter(|&b| b < n) {
            return Err(ApiError::invalid(format!("best_of ({b}) must be at least n ({n})"), Some("best_of")));
        }
        if own.best_of.is_some_and(|b| b > n) && gen.streaming() {
            return Err(ApiError::invalid("best_of is not available with stream: true", Some("best_of")));
        }
        Ok(CompletionRequest { prompt: own.prompt, logprobs: own.logprobs, echo: own.echo, best_of: own.best_of, gen })
    }

    /// Token ids of every prompt.
    pub fn prompts(&self, tok: &Tokenizer) -> Result<Vec<Vec<u32>>, ApiError> {
        let enc = |t: &str| tok.encode(t).map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")));
        let prompts = match &self.prompt {
            PromptInput::Text(t) => vec![enc(t)?],
            PromptInput::Texts(ts) => ts.iter().map(|t| enc(t)).collect::<Result<_, _>>()?,
            PromptInput::Tokens(ids) => vec![ids.clone()],
            PromptInput::TokenLists(l) => l.clone(),
        };
        if prompts.is_empty() {
            return Err(ApiError::invalid("prompt is an empty list", Some("prompt")));
        }
        Ok(prompts)
    }

    /// One engine request per prompt (tokenizing on the calling thread).
    pub fn engine_requests(&self, engine: &EngineHandle) -> Result<Vec<Request>, ApiError> {
        check_model(engine, &self.gen)?;
        let count = match &self.prompt {
            PromptInput::Text(_) | PromptInput::Tokens(_) => 1,
            PromptInput::Texts(v) => v.len(),
            PromptInput::TokenLists(v) => v.len(),
        };
        // best_of draws that many samples per prompt; ranking them needs their logprobs.
        let mut gen = self.gen.clone();
        let mut logprobs = self.logprobs;
        if let Some(b) = self.best_of.filter(|&b| b > gen.n.unwrap_or(1)) {
            let max_n = engine.config().limits.max_n;
            if b > max_n {
                return Err(ApiError::invalid(format!("best_of must be at most {max_n}, got {b}"), Some("best_of")));
            }
            gen.n = Some(b);
            logprobs = Some(logprobs.unwrap_or(0));
        }
        // Refuse what can never run before tokenizing anything.
        gen.precheck(engine, gen.max_tokens)?;
        engine.check_fan_out(count.saturating_mul(gen.n.unwrap_or(1)))?;
        let tok = &engine.model().tokenizer;
        // `echo` with `logprobs` scores the prompt too (lm-evaluation-harness's loglikelihood).
        if let Some(k) = self.logprobs.filter(|_| self.echo()) {
            gen.prompt_logprobs = Some(gen.prompt_logprobs.map_or(k, |p| p.max(k)));
        }
        self.prompts(tok)?.into_iter().map(|p| gen.request(p, 16, logprobs, engine)).collect()
    }

    pub fn echo(&self) -> bool {
        self.echo.unwrap_or(false)
    }

    /// [`CompletionRequest::engine_requests`] off the async runtime.
    pub async fn prepare(&self, engine: &EngineHandle) -> Result<Vec<Request>, ApiError> {
        let (req, engine) = (self.clone(), engine.clone());
        off_runtime(move || req.engine_requests(&engine)).await
    }
}

impl ChatRequest {
    pub fn parse(body: Value) -> Result<Self, ApiError> {
        let own = [
            "messages",
            "logprobs",
            "top_logprobs",
            "max_completion_tokens",
            "add_generation_prompt",
            "chat_template_kwargs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
        ];
        let (o, gen): (ChatOwn, _) = parse_split(body, &own, GENERATION_KEYS)?;
        Ok(ChatRequest {
            messages: o.messages,
            logprobs: o.logprobs,
            top_logprobs: o.top_logprobs,
            max_completion_tokens: o.max_completion_tokens,
            add_generation_prompt: o.add_generation_prompt,
            chat_template_kwargs: o.chat_template_kwargs,
            tools: o.tools,
            tool_choice: o.tool_choice,
            parallel_tool_calls: o.parallel_tool_calls,
            gen,
        })
    }

    /// The request's tools, checked against the model's chat template.
    pub fn tools(&self, engine: &EngineHandle) -> Result<Tools, ApiError> {
        let template = engine.model().tokenizer.chat_template.as_deref();
        Tools::new(self.tools.clone().unwrap_or_default(), self.tool_choice.clone(), self.parallel_tool_calls, template)
    }

    /// The rendered prompt's token ids.
    pub fn prompt(&self, engine: &EngineHandle) -> Result<Vec<u32>, ApiError> {
        self.render(engine, &self.tools(engine)?)
    }

    /// The prompt's token ids, the template given `tools`.
    fn render(&self, engine: &EngineHandle, tools: &Tools) -> Result<Vec<u32>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages must not be empty", Some("messages")));
        }
        if let Some(m) = self.messages.iter().find(|m| !ROLES.contains(&m.role.as_str())) {
            return Err(ApiError::invalid(
                format!("unknown message role {:?} (expected one of {})", m.role, ROLES.join(", ")),
                Some("messages"),
            ));
        }
        let tok = &engine.model().tokenizer;
        let template = tok.chat().map_err(|e| ApiError::invalid(e, Some("messages")))?;
        let messages: Vec<_> = self.messages.iter().map(ChatMessage::to_value).collect();
        let tools = tools.template_tools();
        let ctx = ChatContext {
            messages: &messages,
            tools: tools.as_deref(),
            add_generation_prompt: self.add_generation_prompt.unwrap_or(true),
            kwargs: self.chat_template_kwargs.as_ref(),
        };
        let text = template.render(&ctx).map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
        // The template writes every special token itself (BOS included), so none is added,
        // as transformers' apply_chat_template tokenizes.
        tok.encode_with(&text, false).map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))
    }

    pub fn engine_request(&self, engine: &EngineHandle) -> Result<Request, ApiError> {
        self.engine_request_and_tools(engine).map(|(req, _)| req)
    }

    /// The engine request, and the tool-call format its generated text is read with (when
    /// the request has tools and `tool_choice` is not `none`).
    fn engine_request_and_tools(&self, engine: &EngineHandle) -> Result<(Request, Option<ToolFormat>), ApiError> {
        check_model(engine, &self.gen)?;
        let max = engine.config().limits.max_logprobs;
        if let Some(k) = self.top_logprobs.filter(|&k| k > max) {
            return Err(ApiError::invalid(
                format!("top_logprobs must be at most {max}, got {k}"),
                Some("top_logprobs"),
            ));
        }
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (true, k) => Some(k.unwrap_or(0)),
            (false, Some(_)) => {
                return Err(ApiError::invalid("top_logprobs needs logprobs: true", Some("top_logprobs")))
            }
            (false, None) => None,
        };
        self.gen.precheck(engine, self.max_completion_tokens.or(self.gen.max_tokens))?;
        engine.check_fan_out(self.gen.n.unwrap_or(1))?;
        let tools = self.tools(engine)?;
        let prompt = self.render(engine, &tools)?;
        // Without max_tokens, the rest of what one sequence can hold: the context, or the
        // KV cache when that is smaller (a 128k-context model on a 1 GB cache).
        let room = engine.max_model_len().min(engine.capacity_tokens());
        let mut gen = self.gen.clone();
        gen.max_tokens = self.max_completion_tokens.or(gen.max_tokens);
        let mut req = gen.request(prompt.clone(), room.saturating_sub(prompt.len()).max(1), logprobs, engine)?;
        // `required` and a named function: a grammar makes the answer a call.
        if let Some(grammar) = tools.grammar() {
            if req.constraint.is_some() {
                return Err(ApiError::invalid(
                    "tool_choice required or a named function cannot be combined with another output constraint",
                    Some("tool_choice"),
                ));
            }
            req.constraint = Some(compile(engine, &grammar, "tools")?);
        }
        Ok((req, tools.parses()))
    }

    /// [`ChatRequest::engine_request`] (template rendering and tokenizing) off the async
    /// runtime, with the tool-call format to read the answer with.
    pub async fn prepare(&self, engine: &EngineHandle) -> Result<(Request, Option<ToolFormat>), ApiError> {
        let (req, engine) = (self.clone(), engine.clone());
        off_runtime(move || req.engine_request_and_tools(&engine)).await
    }
}

/// `grammar` compiled against the model's vocabulary; a grammar that does not compile is
/// the client's error, named by `param`.
fn compile(engine: &EngineHandle, grammar: &Grammar, param: &str) -> Result<Constraint, ApiError> {
    let compiler = engine.model().grammars().map_err(|e| ApiError::invalid(e, Some(param)))?;
    compiler.compile(grammar).map_err(|e| ApiError::invalid(format!("invalid {param}: {e:#}"), Some(param)))
}

fn check_model(engine: &EngineHandle, gen: &GenerationFields) -> Result<(), ApiError> {
    match &gen.model {
        Some(m) if !engine.model().serves(m) => Err(ApiError::model_not_found(m, &engine.model().name)),
        _ => Ok(()),
    }
}

impl GenerationFields {
    /// The checks that need no prompt, done before the costly tokenizing or rendering: a
    /// `max_tokens` no prompt can fit with, and `n` over the cap. (The engine checks all
    /// again on submit.)
    fn precheck(&self, engine: &EngineHandle, max_tokens: Option<usize>) -> Result<(), ApiError> {
        let ctx = engine.max_model_len();
        if let Some(m) = max_tokens.filter(|&m| m >= ctx) {
            return Err(ApiError::invalid(
                format!("max_tokens ({m}) leaves no room for a prompt in the context length of {ctx} (max_model_len)"),
                Some("max_tokens"),
            ));
        }
        if self.prompt_logprobs.is_some() && self.streaming() {
            return Err(ApiError::invalid(
                "prompt_logprobs are not available with stream: true",
                Some("prompt_logprobs"),
            ));
        }
        let max_n = engine.config().limits.max_n;
        if let Some(n) = self.n.filter(|&n| n == 0 || n > max_n) {
            return Err(ApiError::invalid(format!("n must be between 1 and {max_n}, got {n}"), Some("n")));
        }
        Ok(())
    }

    fn request(
        &self,
        prompt: Vec<u32>,
        default_max: usize,
        logprobs: Option<usize>,
        engine: &EngineHandle,
    ) -> Result<Request, ApiError> {
        let prompt = self.truncate(prompt, engine.max_model_len())?;
        let n = self.n.unwrap_or(1);
        if n == 0 {
            return Err(ApiError::invalid("n must be at least 1", Some("n")));
        }
        let top_k = match self.top_k {
            None | Some(0) | Some(-1) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(format!("top_k must be -1, 0 or positive, got {k}"), Some("top_k")))
            }
        };
        let mut logit_bias = HashMap::new();
        for (k, &v) in self.logit_bias.iter().flatten() {
            let id = k.parse::<u32>().map_err(|_| {
                ApiError::invalid(format!("logit_bias key {k:?} is not a token id"), Some("logit_bias"))
            })?;
            logit_bias.insert(id, v);
        }
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            logit_bias,
            seed: self.seed,
            logprobs,
        };
        sampling.validate(engine.model().model.config.vocab_size).map_err(|e| {
            let msg = e.to_string();
            let param = msg.split_whitespace().next().map(str::to_owned);
            ApiError { param, ..ApiError::invalid(msg, None) }
        })?;
        let stop_strings = match &self.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(v)) => v.clone(),
        };
        Ok(Request {
            prompt,
            sampling,
            stop: StopCondition {
                max_tokens: self.max_tokens.unwrap_or(default_max),
                stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
                stop_strings,
                ignore_eos: self.ignore_eos.unwrap_or(false),
                include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
                min_tokens: self.min_tokens.unwrap_or(0),
            },
            n,
            priority: self.priority.unwrap_or(0),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            cache_salt: self.cache_salt.clone(),
            constraint: self.constraint(engine)?,
            prompt_logprobs: self.prompt_logprobs,
        })
    }

    /// `truncate_prompt_tokens`: the prompt's last k tokens (-1: the context less one).
    fn truncate(&self, mut prompt: Vec<u32>, ctx: usize) -> Result<Vec<u32>, ApiError> {
        let keep = match self.truncate_prompt_tokens {
            None => return Ok(prompt),
            Some(-1) => ctx - 1,
            Some(k) if k >= 1 && (k as u64) < ctx as u64 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    format!("truncate_prompt_tokens must be -1 or between 1 and {}, got {k}", ctx - 1),
                    Some("truncate_prompt_tokens"),
                ))
            }
        };
        prompt.drain(..prompt.len().saturating_sub(keep));
        Ok(prompt)
    }

    /// The grammar the request names, if any (at most one of the ways to name one).
    fn grammar(&self) -> Result<Option<(Grammar, &'static str)>, ApiError> {
        let schema = |v: &Value, param: &str| match v {
            // vLLM takes a schema as an object or as its JSON text.
            Value::String(text) => serde_json::from_str(text)
                .map_err(|e| ApiError::invalid(format!("{param} is not a JSON schema: {e}"), Some(param))),
            v => Ok(v.clone()),
        };
        let mut found = Vec::new();
        match &self.response_format {
            None | Some(ResponseFormat::Text) => {}
            Some(ResponseFormat::JsonObject) => found.push((Grammar::JsonObject, "response_format")),
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                let Some(s) = &json_schema.schema else {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.schema is required",
                        Some("response_format"),
                    ));
                };
                found.push((Grammar::JsonSchema(s.clone()), "response_format"));
            }
        }
        if let Some(so) = &self.structured_outputs {
            let p = "structured_outputs";
            if let Some(j) = &so.json {
                found.push((Grammar::JsonSchema(schema(j, p)?), p));
            }
            if let Some(r) = &so.regex {
                found.push((Grammar::Regex(r.clone()), p));
            }
            if let Some(c) = &so.choice {
                found.push((Grammar::Choice(c.clone()), p));
            }
            if let Some(g) = &so.grammar {
                found.push((Grammar::Lark(g.clone()), p));
            }
            if so.json_object == Some(true) {
                found.push((Grammar::JsonObject, p));
            }
        }
        if let Some(j) = &self.guided_json {
            found.push((Grammar::JsonSchema(schema(j, "guided_json")?), "guided_json"));
        }
        if let Some(r) = &self.guided_regex {
            found.push((Grammar::Regex(r.clone()), "guided_regex"));
        }
        if let Some(c) = &self.guided_choice {
            found.push((Grammar::Choice(c.clone()), "guided_choice"));
        }
        if let Some(g) = &self.guided_grammar {
            found.push((Grammar::Lark(g.clone()), "guided_grammar"));
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|(_, p)| *p).collect();
            return Err(ApiError::invalid(
                format!("only one output constraint may be given, got {}", names.join(", ")),
                Some(found[1].1),
            ));
        }
        Ok(found.pop())
    }

    /// The request's grammar compiled against the model's vocabulary; a grammar that does
    /// not compile is the client's error.
    fn constraint(&self, engine: &EngineHandle) -> Result<Option<Constraint>, ApiError> {
        let Some((grammar, param)) = self.grammar()? else {
            return Ok(None);
        };
        compile(engine, &grammar, param).map(Some)
    }

    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }

    pub fn continuous_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.continuous_usage_stats).unwrap_or(false)
    }
}

/// One finished sample.
#[derive(Debug, Clone, Default)]
pub struct Choice {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<(TokenLogprob, Vec<TokenLogprob>)>,
    pub finish: Option<FinishReason>,
}

/// Everything a request's stream brought.
#[derive(Debug, Default)]
pub struct Gathered {
    pub choices: Vec<Choice>,
    pub usage: Usage,
    /// Scores of the prompt's tokens after the first, when asked for.
    pub prompt_logprobs: Vec<PromptLogprob>,
}

/// Reads a request's stream to the end: its samples, token counts and prompt scores.
pub async fn gather(mut stream: RequestStream, n: usize) -> Result<Gathered, ApiError> {
    let mut choices = vec![Choice::default(); n];
    let mut total = Usage::default();
    let mut prompt_logprobs = Vec::new();
    while let Some(ev) = stream.recv().await {
        match ev {
            Event::PromptLogprobs { logprobs } => prompt_logprobs.extend(logprobs),
            Event::Token { index, id, text, logprobs } => {
                let c = &mut choices[index];
                c.text += &text;
                c.tokens.push(id);
                c.logprobs.extend(logprobs);
            }
            Event::Finished { index, reason, text, usage } => {
                choices[index].text += &text;
                choices[index].finish = Some(reason);
                total.add_sample(&usage);
            }
            Event::Error { message } => return Err(ApiError::internal(message)),
        }
    }
    // A stream that closes before every sample finished lost its engine: never a 200.
    if choices.iter().any(|c| c.finish.is_none()) {
        return Err(ApiError::internal("the engine stopped before this request finished"));
    }
    Ok(Gathered { choices, usage: total, prompt_logprobs })
}

pub fn finish_reason(f: Option<FinishReason>) -> Value {
    f.map_or(Value::Null, |r| json!(r.as_str()))
}

fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// One token of a legacy `logprobs` object: its id, and its log-probability with the top
/// alternatives (none for a prompt's first token, which nothing predicts).
pub type Scored<'a> = (u32, Option<(f32, &'a [TokenLogprob])>);

/// The generated tokens of a sample, as [`Scored`] entries.
pub fn generated_scores(c: &Choice) -> impl Iterator<Item = Scored<'_>> {
    c.logprobs.iter().map(|(t, top)| (t.id, Some((t.logprob, top.as_slice()))))
}

/// The prompt's tokens, as [`Scored`] entries: the first unscored, the rest with `scores`.
pub fn prompt_scores<'a>(prompt: &'a [u32], scores: &'a [PromptLogprob]) -> impl Iterator<Item = Scored<'a>> {
    let first = prompt.first().map(|&id| (id, None));
    first.into_iter().chain(scores.iter().map(|p| (p.token.id, Some((p.token.logprob, p.top.as_slice())))))
}

/// The legacy completions `logprobs` object; text offsets count from `offset0`.
pub fn completion_logprobs<'a>(
    tok: &Tokenizer,
    entries: impl IntoIterator<Item = Scored<'a>>,
    offset0: usize,
) -> Value {
    let mut offset = offset0;
    let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for (id, score) in entries {
        let t = token_text(tok, id);
        offsets.push(offset);
        offset += t.len();
        tokens.push(t);
        match score {
            Some((lp, top)) => {
                lps.push(json!(lp));
                let map: serde_json::Map<String, Value> =
                    top.iter().map(|x| (token_text(tok, x.id), json!(x.logprob))).collect();
                tops.push(Value::Object(map));
            }
            None => {
                lps.push(Value::Null);
                tops.push(Value::Null);
            }
        }
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// vLLM's `prompt_logprobs`: `null` for the first token, then per token an object from token
/// id to `{logprob, rank, decoded_token}` holding the prompt's token and the top alternatives.
pub fn vllm_prompt_logprobs(tok: &Tokenizer, scores: &[PromptLogprob]) -> Value {
    let mut out = vec![Value::Null];
    for p in scores {
        let mut m = serde_json::Map::new();
        let mut put = |x: &TokenLogprob, rank: usize| {
            m.entry(x.id.to_string())
                .or_insert_with(|| json!({"logprob": x.logprob, "rank": rank, "decoded_token": token_text(tok, x.id)}));
        };
        put(&p.token, p.rank);
        for (i, x) in p.top.iter().enumerate() {
            put(x, i + 1);
        }
        out.push(Value::Object(m));
    }
    Value::Array(out)
}

/// The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub fn chat_logprobs(tok: &Tokenizer, lps: &[(TokenLogprob, Vec<TokenLogprob>)]) -> Value {
    let entry = |x: &TokenLogprob| {
        let t = token_text(tok, x.id);
        json!({"token": t, "logprob": x.logprob, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|(c, top)| {
            let mut e = entry(c);
            e["top_logprobs"] = Value::Array(top.iter().map(entry).collect());
            e
        })
        .collect();
    json!({"content": content})
}

pub fn usage(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens}})
}

/// The `n` samples with the highest cumulative logprob (all of them, in order, when there are
/// only `n`: no `best_of`).
fn best(mut choices: Vec<Choice>, n: usize) -> Vec<Choice> {
    if choices.len() > n {
        let total = |c: &Choice| c.logprobs.iter().map(|(t, _)| t.logprob as f64).sum::<f64>();
        choices.sort_by(|a, b| total(b).total_cmp(&total(a)));
        choices.truncate(n);
    }
    choices
}

/// A non-streaming `/v1/completions` response.
pub async fn completions(engine: &EngineHandle, req: &CompletionRequest, id: &str) -> Result<Value, ApiError> {
    let reqs = req.prepare(engine).await?;
    let tok = &engine.model().tokenizer;
    let mut streams = Vec::with_capacity(reqs.len());
    for r in &reqs {
        streams.push(engine.submit(r.clone())?);
    }
    let (mut choices, mut total) = (Vec::new(), Usage::default());
    let n = req.gen.n.unwrap_or(1);
    for (i, (stream, r)) in streams.into_iter().zip(&reqs).enumerate() {
        let g = gather(stream, r.n).await?;
        total.add_request(&g.usage);
        let echo = if req.echo() { tok.decode(&r.prompt, true).unwrap_or_default() } else { String::new() };
        for (j, c) in best(g.choices, n).iter().enumerate() {
            let logprobs = match req.logprobs {
                None => Value::Null,
                Some(_) if req.echo() => {
                    completion_logprobs(tok, prompt_scores(&r.prompt, &g.prompt_logprobs).chain(generated_scores(c)), 0)
                }
                Some(_) => completion_logprobs(tok, generated_scores(c), 0),
            };
            let mut choice = json!({"index": i * n + j, "text": echo.clone() + &c.text, "logprobs": logprobs,
                "finish_reason": finish_reason(c.finish)});
            if req.gen.prompt_logprobs.is_some() {
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, &g.prompt_logprobs);
            }
            choices.push(choice);
        }
    }
    Ok(json!({"id": id, "object": "text_completion", "created": unix_time(), "model": engine.model().name,
        "choices": choices, "usage": usage(&total)}))
}

/// The calls in a sample, read from its text with special tokens kept (Mistral's and Llama's
/// markers are special tokens) and its closing stop token left out.
fn read_calls(tok: &Tokenizer, format: ToolFormat, c: &Choice) -> Option<(String, Vec<tools::ToolCall>)> {
    let end = c.tokens.iter().rposition(|t| !tok.eos_ids.contains(t)).map_or(0, |i| i + 1);
    let text = tok.decode(&c.tokens[..end], false).ok()?;
    tools::parse(format, &text)
}

/// A non-streaming `/v1/chat/completions` response.
pub async fn chat_completions(engine: &EngineHandle, req: &ChatRequest, id: &str) -> Result<Value, ApiError> {
    let (r, format) = req.prepare(engine).await?;
    let tok = &engine.model().tokenizer;
    let stream = engine.submit(r.clone())?;
    let g = gather(stream, r.n).await?;
    let choices: Vec<Value> = g
        .choices
        .into_iter()
        .enumerate()
        .map(|(j, c)| {
            let logprobs = if r.sampling.logprobs.is_some() { chat_logprobs(tok, &c.logprobs) } else { Value::Null };
            let mut message = json!({"role": "assistant", "content": c.text});
            let mut finish = finish_reason(c.finish);
            if let Some((f, (content, calls))) = format.and_then(|f| Some((f, read_calls(tok, f, &c)?))) {
                message["content"] = if content.is_empty() { Value::Null } else { content.into() };
                message["tool_calls"] = tools::tool_calls_json(f, &calls);
                if c.finish == Some(FinishReason::Stop) {
                    finish = json!("tool_calls");
                }
            }
            json!({"index": j, "message": message, "logprobs": logprobs, "finish_reason": finish})
        })
        .collect();
    let mut body = json!({"id": id, "object": "chat.completion", "created": unix_time(), "model": engine.model().name,
        "choices": choices, "usage": usage(&g.usage)});
    if req.gen.prompt_logprobs.is_some() {
        body["prompt_logprobs"] = vllm_prompt_logprobs(tok, &g.prompt_logprobs);
    }
    Ok(body)
}
