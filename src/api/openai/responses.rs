//! The non-streaming response bodies: a request's samples gathered from its stream, with
//! their logprobs, tool calls and usage.

use super::*;

/// One finished sample.
#[derive(Debug, Clone, Default)]
pub struct Choice {
    pub text: String,
    pub tokens: Vec<u32>,
    /// Where each token's piece of `text` ends (the engine holds text back until it is
    /// whole, and cuts it at a stop string, so pieces are not each token's decoding).
    pub ends: Vec<usize>,
    pub logprobs: Vec<(TokenLogprob, Vec<TokenLogprob>)>,
    pub finish: Option<FinishReason>,
    /// The stop string that ended it, if one did (vLLM's `stop_reason`).
    pub stop: Option<String>,
}

/// Everything a request's stream brought.
#[derive(Debug, Default)]
pub struct Gathered {
    pub choices: Vec<Choice>,
    pub usage: Usage,
    /// Scores of the prompt's tokens after the first, when asked for.
    pub prompt_logprobs: Vec<PromptLogprob>,
    /// An embedding request's vector.
    pub embedding: Vec<f32>,
}

/// Reads a request's stream to the end: its samples, token counts and prompt scores.
pub async fn gather(mut stream: RequestStream, n: usize) -> Result<Gathered, ApiError> {
    let mut choices = vec![Choice::default(); n];
    let mut total = Usage::default();
    let (mut prompt_logprobs, mut embedding) = (Vec::new(), Vec::new());
    while let Some(ev) = stream.recv().await {
        match ev {
            Event::Embedding { vector } => embedding = vector,
            Event::PromptLogprobs { logprobs } => prompt_logprobs.extend(logprobs),
            Event::Token { index, id, text, logprobs, .. } => {
                let c = &mut choices[index];
                c.text += &text;
                c.tokens.push(id);
                c.ends.push(c.text.len());
                c.logprobs.extend(logprobs);
            }
            Event::Finished { index, reason, text, usage, stop } => {
                choices[index].text += &text;
                choices[index].finish = Some(reason);
                choices[index].stop = stop;
                total.add_sample(&usage);
            }
            Event::Error { message } => return Err(ApiError::internal(message)),
        }
    }
    // A stream that closes before every sample finished lost its engine: never a 200.
    if choices.iter().any(|c| c.finish.is_none()) {
        return Err(ApiError::internal("the engine stopped before this request finished"));
    }
    Ok(Gathered { choices, usage: total, prompt_logprobs, embedding })
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
                "finish_reason": finish_reason(c.finish), "stop_reason": c.stop});
            if req.gen.prompt_logprobs.is_some() {
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, &g.prompt_logprobs);
            }
            if req.gen.return_token_ids() {
                choice["prompt_token_ids"] = json!(r.prompt);
                choice["token_ids"] = json!(c.tokens);
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
    tools::read_answer(format, &text_with_specials(tok, c)?)
}

/// A sample's text with its special tokens kept and its closing stop tokens left out, built
/// as a stream builds it: the text the engine sent (cut at a stop string, so a stop inside
/// a token cuts here too), each special token's own text where it came.
fn text_with_specials(tok: &Tokenizer, c: &Choice) -> Option<String> {
    let end = c.tokens.iter().rposition(|t| !tok.eos_ids.contains(t)).map_or(0, |i| i + 1);
    let mut out = String::with_capacity(c.text.len());
    let mut from = 0;
    for (&id, &to) in c.tokens[..end].iter().zip(&c.ends) {
        out += &c.text[from..to];
        if from == to && tok.decode(&[id], true).ok()?.is_empty() {
            out += &tok.decode(&[id], false).ok()?;
        }
        from = to;
    }
    out += &c.text[from..];
    Some(out)
}

/// A harmony sample's message (reasoning, content, calls), read from its text with special
/// tokens kept and its closing stop token left out; and whether it called a tool.
fn harmony_message(tok: &Tokenizer, c: &Choice) -> (Value, bool) {
    let text = text_with_specials(tok, c).unwrap_or_else(|| c.text.clone());
    let (d, called) = harmony::read(&text);
    let mut message = json!({"role": "assistant", "content": if d.content.is_empty() && called { Value::Null } else { d.content.into() }});
    if !d.reasoning.is_empty() {
        message["reasoning_content"] = d.reasoning.into();
    }
    if called {
        let calls: Vec<tools::ToolCall> = d
            .calls
            .into_iter()
            .filter_map(|c| Some(tools::ToolCall { name: c.name?, arguments: c.arguments }))
            .collect();
        message["tool_calls"] = tools::tool_calls_json(ToolFormat::Harmony, &calls);
    }
    (message, called)
}

/// A non-streaming `/v1/chat/completions` response.
pub async fn chat_completions(engine: &EngineHandle, req: &ChatRequest, id: &str) -> Result<Value, ApiError> {
    let (r, format) = req.prepare(engine).await?;
    let tok = &engine.model().tokenizer;
    let harmony = tok.chat_template.as_deref().and_then(ToolFormat::detect) == Some(ToolFormat::Harmony);
    let thinks = !harmony && crate::api::answer::thinks(tok.chat_template.as_deref());
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
            if harmony {
                let called;
                (message, called) = harmony_message(tok, &c);
                if called && c.finish == Some(FinishReason::Stop) {
                    finish = json!("tool_calls");
                }
            } else if let Some((f, (content, calls))) = format.and_then(|f| Some((f, read_calls(tok, f, &c)?))) {
                message["content"] = if content.is_empty() { Value::Null } else { content.into() };
                message["tool_calls"] = tools::tool_calls_json(f, &calls);
                if c.finish == Some(FinishReason::Stop) {
                    finish = json!("tool_calls");
                }
            }
            if let (true, Some(text)) = (thinks, message["content"].as_str()) {
                // A thinking model's reasoning split off as the stream splits it.
                let (reasoning, content) = crate::api::answer::Thinking::default().split(text, true);
                message["content"] = content.into();
                if !reasoning.is_empty() {
                    message["reasoning_content"] = reasoning.into();
                }
            }
            let mut choice = json!({"index": j, "message": message, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": c.stop});
            if req.gen.return_token_ids() {
                choice["token_ids"] = json!(c.tokens);
            }
            choice
        })
        .collect();
    let mut body = json!({"id": id, "object": "chat.completion", "created": unix_time(), "model": engine.model().name,
        "choices": choices, "usage": usage(&g.usage)});
    if req.gen.return_token_ids() {
        body["prompt_token_ids"] = json!(r.prompt);
    }
    if req.gen.prompt_logprobs.is_some() {
        body["prompt_logprobs"] = vllm_prompt_logprobs(tok, &g.prompt_logprobs);
    }
    Ok(body)
}
