//! Checking a request and turning it into engine requests: prompts tokenized or rendered
//! through the chat template, sampling and stop conditions, structured-output constraints.

use super::*;

impl CompletionRequest {
    pub fn parse(body: Value) -> Result<Self, ApiError> {
        let (own, gen): (CompletionRequest, GenerationFields) = parse_split(body)?;
        let n = gen.n.unwrap_or(1);
        if let Some(b) = own.best_of.filter(|&b| b < n) {
            return Err(ApiError::invalid(format!("best_of ({b}) must be at least n ({n})"), Some("best_of")));
        }
        if own.best_of.is_some_and(|b| b > n) && gen.streaming() {
            return Err(ApiError::invalid("best_of is not available with stream: true", Some("best_of")));
        }
        Ok(CompletionRequest { gen, ..own })
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
        let (own, gen): (ChatRequest, GenerationFields) = parse_split(body)?;
        Ok(ChatRequest { gen, ..own })
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
        let messages = tools.template_messages(self.messages.iter().map(ChatMessage::to_value).collect());
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
    check_served(engine, gen.model.as_deref())
}

/// OpenAI's 404 `model_not_found` when a request names a model this server does not serve.
pub fn check_served(engine: &EngineHandle, model: Option<&str>) -> Result<(), ApiError> {
    match model {
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
        sampling
            .validate(engine.model().model.config.vocab_size)
            .map_err(|e| ApiError::invalid(e.message, Some(e.param)))?;
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
            embed: false,
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

    pub fn return_token_ids(&self) -> bool {
        self.return_token_ids.unwrap_or(false)
    }

    pub fn continuous_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.continuous_usage_stats).unwrap_or(false)
    }
}
