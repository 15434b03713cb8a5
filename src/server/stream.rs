//! Server-sent events in OpenAI's chunk format. Requests are checked and submitted before
//! the stream starts (so bad input still gets a plain 400/429); then one task per engine
//! stream forwards events into the response. When the client goes away the response, the
//! channel and then the engine streams are dropped, which aborts the sequences.

use crate::api::answer::{thinks, Thinking, Translate};
use crate::api::harmony::{self, HarmonyStream};
use crate::api::openai::{
    chat_logprobs, completion_logprobs, finish_reason, prompt_scores, usage, ChatRequest, CompletionRequest,
};
use crate::api::tools::{CallDelta, Delta, ToolFormat, ToolStream};
use crate::api::{unix_time, ApiError};
use crate::engine::{EngineHandle, Event, Request, RequestStream, Usage};
use crate::tokenizer::Tokenizer;
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

/// Runs `fut` within the request timeout; when it expires the future (and with it the
/// engine request) is dropped.
pub async fn within<T>(limit: Option<Duration>, fut: impl Future<Output = Result<T, ApiError>>) -> Result<T, ApiError> {
    match limit {
        Some(t) => tokio::time::timeout(t, fut)
            .await
            .unwrap_or_else(|_| Err(ApiError::timeout(format!("request timed out after {:.1} s", t.as_secs_f64())))),
        None => fut.await,
    }
}

/// What a stream sends, before it is written as server-sent events.
pub enum Out {
    Chunk(Value),
    Error(ApiError),
    Done,
}

type Tx = mpsc::Sender<Out>;

/// What every stream needs from the server: its time limit, and the signal that the
/// shutdown grace is over (open streams then get an error event before they close).
pub struct Ctx {
    pub timeout: Option<Duration>,
    pub grace_over: tokio::sync::watch::Receiver<bool>,
}

/// Comment lines sent while nothing else is (long prefills), so proxies keep the connection.
const KEEP_ALIVE: Duration = Duration::from_secs(2);

/// OpenAI's framing: each chunk as a `data:` line, then `data: [DONE]`; an error as its body.
fn sse_response(rx: mpsc::Receiver<Out>) -> Response {
    let events = ReceiverStream::new(rx).map(|out| {
        Ok::<_, Infallible>(match out {
            Out::Chunk(v) => Sse::default().data(v.to_string()),
            Out::Error(e) => Sse::default().data(e.body().to_string()),
            Out::Done => Sse::default().data("[DONE]"),
        })
    });
    typed_sse(events)
}

fn typed_sse(events: impl tokio_stream::Stream<Item = Result<Sse, Infallible>> + Send + 'static) -> Response {
    axum::response::Sse::new(events).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response()
}

async fn send(tx: &Tx, v: Value) -> bool {
    tx.send(Out::Chunk(v)).await.is_ok()
}

/// Forwards one engine stream of `n` samples through `on_event` (the chunks an event makes)
/// until it ends or the client leaves. With `continuous` (the prompt's length: vLLM's
/// `continuous_usage_stats`) every chunk carries the token counts so far. A stream that
/// closes before all `n` finished lost its engine: an error.
async fn forward(
    tx: Tx,
    mut stream: RequestStream,
    n: usize,
    continuous: Option<usize>,
    mut on_event: impl FnMut(Event) -> Vec<Value>,
) -> Result<Usage, String> {
    let (mut total, mut finished, mut generated, mut cached) = (Usage::default(), 0, 0, 0);
    loop {
        let ev = tokio::select! {
            _ = tx.closed() => return Ok(total),
            ev = stream.recv() => ev,
        };
        let Some(ev) = ev else {
            if finished < n {
                return Err("the engine stopped before this request finished".into());
            }
            return Ok(total);
        };
        match &ev {
            Event::Error { message } => return Err(message.clone()),
            Event::Finished { usage, .. } => {
                total.add_sample(usage);
                finished += 1;
            }
            Event::Token { cached_tokens, .. } => {
                generated += 1;
                cached = cached.max(*cached_tokens);
            }
            Event::PromptLogprobs { .. } | Event::Embedding { .. } => {}
        }
        for mut v in on_event(ev) {
            if let Some(prompt_tokens) = continuous {
                v["usage"] = usage(&Usage { prompt_tokens, completion_tokens: generated, cached_tokens: cached });
            }
            if !send(&tx, v).await {
                return Ok(total);
            }
        }
    }
}

/// Runs the forwarders, then the usage chunk and `[DONE]`; an error, a timeout or the end
/// of the shutdown grace becomes an error event that ends the stream.
fn drive(
    tx: Tx,
    forwarders: Vec<tokio::task::JoinHandle<Result<Usage, String>>>,
    usage_chunk: Option<UsageChunk>,
    ctx: Ctx,
) {
    let Ctx { timeout, mut grace_over } = ctx;
    tokio::spawn(async move {
        let mut forwarders = forwarders;
        // Forwarders already joined (a JoinHandle must not be awaited twice).
        let mut joined = 0;
        let outcome = {
            let all = async {
                let mut total = Usage::default();
                for f in forwarders.iter_mut() {
                    let r = f.await;
                    joined += 1;
                    total.add_request(&r.map_err(|e| ApiError::internal(e.to_string()))?.map_err(ApiError::internal)?);
                }
                Ok(total)
            };
            let cut = async {
                let _ = grace_over.wait_for(|over| *over).await;
            };
            tokio::select! {
                r = within(timeout, all) => r,
                _ = cut => Err(ApiError::unavailable("the server shut down before this request finished")),
            }
        };
        match outcome {
            Ok(total) => {
                if let Some(chunk) = usage_chunk {
                    send(&tx, chunk(&total)).await;
                }
                let _ = tx.send(Out::Done).await;
            }
            Err(e) => {
                // Stop every forwarder and wait until each has ended, so no chunk can
                // follow the error event.
                let running = forwarders.split_off(joined);
                running.iter().for_each(|f| f.abort());
                for f in running {
                    let _ = f.await;
                }
                let _ = tx.send(Out::Error(e)).await;
            }
        }
    });
}

type UsageChunk = Box<dyn FnOnce(&Usage) -> Value + Send>;

/// The final chunk of `stream_options.include_usage`: no choices, the token counts.
fn usage_chunk(id: String, object: &'static str, created: u64, model: String) -> UsageChunk {
    Box::new(
        move |u| json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage(u)}),
    )
}

/// `/v1/completions` with `stream: true`.
pub async fn completions(
    engine: &EngineHandle,
    req: CompletionRequest,
    id: String,
    ctx: Ctx,
) -> Result<Response, ApiError> {
    let reqs = req.prepare(engine).await?;
    let streams = submit_all(engine, &reqs)?;
    let (tx, rx) = mpsc::channel(64);
    let (model, created) = (engine.model().name.clone(), unix_time());
    let tok = engine.model_arc();
    let with_logprobs = req.logprobs.is_some();
    let with_ids = req.gen.return_token_ids();
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |choice: Value| json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": [choice]})
    };
    let forwarders = streams
        .into_iter()
        .zip(&reqs)
        .enumerate()
        .map(|(i, (s, r))| {
            let (chunk, tok, n) = (chunk.clone(), tok.clone(), r.n);
            let mut offsets = vec![0usize; n];
            // With `echo` each sample starts with the prompt.
            let mut echo = req.echo().then(|| Echo {
                text: tok.tokenizer.decode(&r.prompt, true).unwrap_or_default(),
                prompt: r.prompt.clone(),
                scores: Vec::new(),
            });
            let continuous = req.gen.continuous_usage().then_some(r.prompt.len());
            // With `return_token_ids`, each sample's first chunk also carries the prompt's.
            let mut prompt_ids: Vec<Option<Vec<u32>>> = vec![with_ids.then(|| r.prompt.clone()); n];
            tokio::spawn(forward(tx.clone(), s, n, continuous, move |ev| {
                // The echoed prompt goes first: before any other event, or with `logprobs` as
                // soon as its scores are all in. A sample's text offsets go on from it.
                let ready = match (&ev, &mut echo) {
                    (Event::PromptLogprobs { logprobs }, Some(e)) => {
                        e.scores.extend_from_slice(logprobs);
                        with_logprobs && e.scores.len() + 1 >= e.prompt.len()
                    }
                    (Event::PromptLogprobs { .. }, None) => false,
                    _ => true,
                };
                let mut out = Vec::new();
                if let Some(e) = echo.take_if(|_| ready) {
                    offsets.fill(e.text.len());
                    out = e.chunks(&tok.tokenizer, i, n, with_logprobs, &chunk);
                }
                let mut ids = |index: usize, mut choice: Value, token: Option<u32>| {
                    if with_ids {
                        choice["token_ids"] = json!(token.as_slice());
                        if let Some(p) = prompt_ids[index].take() {
                            choice["prompt_token_ids"] = json!(p);
                        }
                    }
                    chunk(choice)
                };
                match ev {
                    Event::Token { text, .. } if text.is_empty() && !with_logprobs && !with_ids => {}
                    Event::Token { index, id, text, logprobs, .. } => {
                        let lp = match (with_logprobs, logprobs) {
                            (true, Some((t, top))) => {
                                let entry = (id, Some((t.logprob, top.as_slice())));
                                let v = completion_logprobs(&tok.tokenizer, [entry], offsets[index]);
                                offsets[index] += text.len();
                                v
                            }
                            _ => Value::Null,
                        };
                        out.push(ids(
                            index,
                            json!({"index": i * n + index, "text": text, "logprobs": lp, "finish_reason": null}),
                            Some(id),
                        ));
                    }
                    Event::Finished { index, reason, text, stop, .. } => out.push(ids(
                        index,
                        json!({"index": i * n + index, "text": text, "logprobs": null, "finish_reason": finish_reason(Some(reason)), "stop_reason": stop}),
                        None,
                    )),
                    Event::Error { .. } | Event::PromptLogprobs { .. } | Event::Embedding { .. } => {}
                }
                out
            }))
        })
        .collect();
    let usage_chunk = req.gen.include_usage().then(|| usage_chunk(id, "text_completion", created, model));
    drive(tx, forwarders, usage_chunk, ctx);
    Ok(sse_response(rx))
}

/// The prompt a streamed `echo` request sends first, and its scores as they arrive.
struct Echo {
    text: String,
    prompt: Vec<u32>,
    scores: Vec<crate::sampling::PromptLogprob>,
}

impl Echo {
    /// One chunk per sample of request `i`: the prompt's text (and its logprobs).
    fn chunks(
        self,
        tok: &Tokenizer,
        i: usize,
        n: usize,
        with_logprobs: bool,
        chunk: &dyn Fn(Value) -> Value,
    ) -> Vec<Value> {
        let lp = if with_logprobs {
            completion_logprobs(tok, prompt_scores(&self.prompt, &self.scores), 0)
        } else {
            Value::Null
        };
        (0..n)
            .map(|index| {
                chunk(json!({"index": i * n + index, "text": self.text, "logprobs": lp, "finish_reason": null}))
            })
            .collect()
    }
}

/// `/v1/chat/completions` with `stream: true`: a role chunk per choice, then content deltas.
pub async fn chat(engine: &EngineHandle, req: ChatRequest, id: String, ctx: Ctx) -> Result<Response, ApiError> {
    let (rx, _) = chat_chunks(engine, req, id, ctx).await?;
    Ok(sse_response(rx))
}

/// A streamed chat completion's chunks, and the prompt's length in tokens. The request is
/// checked and submitted before this returns.
async fn chat_chunks(
    engine: &EngineHandle,
    req: ChatRequest,
    id: String,
    ctx: Ctx,
) -> Result<(mpsc::Receiver<Out>, usize), ApiError> {
    let (r, format) = req.prepare(engine).await?;
    let streams = submit_all(engine, std::slice::from_ref(&r))?;
    let (tx, rx) = mpsc::channel(64);
    let (model, created) = (engine.model().name.clone(), unix_time());
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |choice: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]})
    };
    let tok: Arc<crate::loaded::LoadedModel> = engine.model_arc();
    let marker = format.and_then(|f| tok.tokenizer.token_id(f.marker()).map(|id| (id, f.marker())));
    let with_ids = req.gen.return_token_ids();
    // A harmony model's every answer is read for its channels (and calls), tools or not.
    let harmony = tok.tokenizer.chat_template.as_deref().and_then(ToolFormat::detect) == Some(ToolFormat::Harmony);
    let harmony_markers = harmony::MARKERS.iter().filter_map(|m| Some((tok.tokenizer.token_id(m)?, *m))).collect();
    let thinking = match thinks(tok.tokenizer.chat_template.as_deref()) && !harmony {
        true => (0..r.n).map(|_| Thinking::default()).collect(),
        false => Vec::new(),
    };
    let mut events = ChatEvents {
        tok,
        chunk: Box::new(chunk.clone()),
        with_logprobs: r.sampling.logprobs.is_some(),
        with_ids,
        tools: match (format, harmony) {
            (Some(f), false) => (0..r.n).map(|_| ToolStream::new(f)).collect(),
            _ => Vec::new(),
        },
        harmony: if harmony { (0..r.n).map(|_| HarmonyStream::default()).collect() } else { Vec::new() },
        thinking,
        harmony_markers,
        marker,
        format,
    };
    let first_chunks: Vec<Value> = (0..r.n)
        .map(|i| {
            let mut c = chunk(
                json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
            );
            if with_ids {
                c["prompt_token_ids"] = json!(r.prompt);
            }
            c
        })
        .collect();
    let n = r.n;
    let continuous = req.gen.continuous_usage().then_some(r.prompt.len());
    let forwarder = tokio::spawn({
        let tx = tx.clone();
        let stream = streams.into_iter().next().expect("one stream");
        async move {
            for c in first_chunks {
                if !send(&tx, c).await {
                    return Ok(Usage::default());
                }
            }
            forward(tx, stream, n, continuous, move |ev| events.on(ev)).await
        }
    });
    let usage_chunk = req.gen.include_usage().then(|| usage_chunk(id, "chat.completion.chunk", created, model));
    drive(tx, vec![forwarder], usage_chunk, ctx);
    Ok((rx, r.prompt.len()))
}

/// Turns a chat stream's events into chunks. With tools, each sample's text passes through
/// a [`ToolStream`]: content flows until a call begins; each call then opens with its name
/// and its arguments follow as `tool_calls` deltas, ending with `finish_reason: "tool_calls"`.
struct ChatEvents {
    tok: Arc<crate::loaded::LoadedModel>,
    chunk: Box<dyn Fn(Value) -> Value + Send>,
    with_logprobs: bool,
    /// `return_token_ids`: every token's chunk carries its id.
    with_ids: bool,
    /// Per sample, when tool calls are read; with the marker's token id (a special token
    /// is not in the text).
    tools: Vec<ToolStream>,
    /// Per sample, for a harmony model (gpt-oss): its channels and calls; with the ids of
    /// the markers that are special tokens.
    harmony: Vec<HarmonyStream>,
    harmony_markers: Vec<(u32, &'static str)>,
    /// Per sample, for a model that thinks in `<think>…</think>`: its reasoning split off.
    thinking: Vec<Thinking>,
    marker: Option<(u32, &'static str)>,
    format: Option<ToolFormat>,
}

impl ChatEvents {
    fn on(&mut self, ev: Event) -> Vec<Value> {
        let chunk = &self.chunk;
        match ev {
            Event::Token { index, id, text, logprobs, .. } => {
                // The delta this token brings (None: nothing yet).
                let delta = if let Some(hs) = self.harmony.get_mut(index) {
                    let piece = self.harmony_markers.iter().find(|(m, _)| *m == id).map_or(text.as_str(), |m| m.1);
                    let d = hs.push(piece);
                    (!d.is_empty()).then(|| chat_delta(&d.reasoning, &d.content, &d.calls, Some(ToolFormat::Harmony)))
                } else {
                    let piece = match self.marker {
                        Some((m, marker)) if m == id => marker.to_owned(),
                        _ => text,
                    };
                    let (reasoning, content) = think(&mut self.thinking, index, &piece, false);
                    let d = match self.tools.get_mut(index) {
                        Some(ts) => ts.push(&content),
                        None => Delta { content, calls: Vec::new() },
                    };
                    (d != Delta::default() || !reasoning.is_empty())
                        .then(|| chat_delta(&reasoning, &d.content, &d.calls, self.format))
                };
                if delta.is_none() && !self.with_logprobs && !self.with_ids {
                    return vec![];
                }
                let lp = match (self.with_logprobs, logprobs) {
                    (true, Some(l)) => chat_logprobs(&self.tok.tokenizer, &[l]),
                    _ => Value::Null,
                };
                // A token with nothing to send yet still carries its logprobs or id.
                let delta = delta.unwrap_or_else(|| chat_delta("", "", &[], None));
                let mut choice = json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": null});
                if self.with_ids {
                    choice["token_ids"] = json!([id]);
                }
                vec![chunk(choice)]
            }
            Event::Finished { index, reason, text, stop, .. } if !self.harmony.is_empty() => {
                let piece = self.harmony[index].push(&text);
                let (rest, called) = std::mem::take(&mut self.harmony[index]).finish();
                let mut out: Vec<Value> = [piece, rest]
                    .iter()
                    .filter(|d| !d.is_empty())
                    .map(|d| {
                        let delta = chat_delta(&d.reasoning, &d.content, &d.calls, Some(ToolFormat::Harmony));
                        chunk(json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null}))
                    })
                    .collect();
                let finish = match called && reason == crate::engine::FinishReason::Stop {
                    true => json!("tool_calls"),
                    false => finish_reason(Some(reason)),
                };
                out.push(chunk(json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish, "stop_reason": stop})));
                out
            }
            Event::Finished { index, reason, text, stop, .. } => {
                let mut finish = finish_reason(Some(reason));
                let mut out = Vec::new();
                let mut last = json!({});
                let (reasoning, content) = think(&mut self.thinking, index, &text, true);
                match (self.tools.get_mut(index), self.format) {
                    (Some(ts), Some(format)) => {
                        let piece = ts.push(&content);
                        let (rest, called) = std::mem::replace(ts, ToolStream::new(format)).finish();
                        if !reasoning.is_empty() {
                            out.push(chunk(json!({"index": index, "delta": {"reasoning_content": reasoning}, "logprobs": null, "finish_reason": null})));
                        }
                        for d in [piece, rest].iter().filter(|d| **d != Delta::default()) {
                            out.push(chunk(json!({"index": index, "delta": chat_delta("", &d.content, &d.calls, self.format), "logprobs": null, "finish_reason": null})));
                        }
                        if called && reason == crate::engine::FinishReason::Stop {
                            finish = json!("tool_calls");
                        }
                    }
                    _ if !content.is_empty() || !reasoning.is_empty() => {
                        last = chat_delta(&reasoning, &content, &[], None)
                    }
                    _ => {}
                }
                out.push(chunk(
                    json!({"index": index, "delta": last, "logprobs": null, "finish_reason": finish, "stop_reason": stop}),
                ));
                out
            }
            Event::Error { .. } | Event::PromptLogprobs { .. } | Event::Embedding { .. } => vec![],
        }
    }
}

/// Sample `index`'s next text split into (reasoning, answer) for a model that thinks (its
/// splitter in `thinking`; all of it answer otherwise); `last`: the answer's end, so
/// nothing is held back.
fn think(thinking: &mut [Thinking], index: usize, text: &str, last: bool) -> (String, String) {
    match thinking.get_mut(index) {
        Some(th) => th.split(text, last),
        None => (String::new(), text.to_owned()),
    }
}

/// A chat chunk's `delta`: the reasoning, the content (also when empty, if there is
/// nothing else) and the pieces of calls, in `format`.
fn chat_delta(reasoning: &str, content: &str, calls: &[CallDelta], format: Option<ToolFormat>) -> Value {
    let mut v = json!({});
    if !reasoning.is_empty() {
        v["reasoning_content"] = reasoning.into();
    }
    if !content.is_empty() || (calls.is_empty() && reasoning.is_empty()) {
        v["content"] = content.into();
    }
    if let (false, Some(format)) = (calls.is_empty(), format) {
        v["tool_calls"] = calls.iter().map(|c| c.to_json(format)).collect();
    }
    v
}

/// `/generate` with `stream: true`: `{"text": delta}` events, then one with the finish
/// reason and usage, then `[DONE]`.
pub fn generate(engine: &EngineHandle, req: Request, ctx: Ctx) -> Result<Response, ApiError> {
    let stream = engine.submit(req)?;
    let (tx, rx) = mpsc::channel(64);
    let forwarder = tokio::spawn(forward(tx.clone(), stream, 1, None, |ev| match ev {
        Event::Token { text, .. } if text.is_empty() => vec![],
        Event::Token { text, .. } => vec![json!({"text": text})],
        Event::Finished { reason, text, usage: u, .. } => {
            vec![json!({"text": text, "finish_reason": reason.as_str(), "usage": usage(&u)})]
        }
        Event::Error { .. } | Event::PromptLogprobs { .. } | Event::Embedding { .. } => vec![],
    }));
    drive(tx, vec![forwarder], None, ctx);
    Ok(sse_response(rx))
}

/// Submits all requests, or none: a refusal drops (aborts) the ones already in.
fn submit_all(engine: &EngineHandle, reqs: &[Request]) -> Result<Vec<RequestStream>, ApiError> {
    reqs.iter().map(|r| engine.submit(r.clone()).map_err(ApiError::from)).collect()
}

/// A streamed chat completion told in another API's events (the Responses API's,
/// Anthropic's): `make` gets the prompt's length and gives what names the events. When the
/// client leaves, this task ends, the chunk channel closes and the engine request is aborted.
pub async fn translated(
    engine: &EngineHandle,
    req: ChatRequest,
    ctx: Ctx,
    make: impl FnOnce(usize) -> Box<dyn Translate>,
) -> Result<Response, ApiError> {
    let (mut chunks, prompt_len) = chat_chunks(engine, req, String::new(), ctx).await?;
    let mut t = make(prompt_len);
    let (tx, rx) = mpsc::channel::<Result<Sse, Infallible>>(64);
    tokio::spawn(async move {
        let mut events = t.start();
        loop {
            for (name, v) in events.drain(..) {
                if tx.send(Ok(Sse::default().event(name).data(v.to_string()))).await.is_err() {
                    return;
                }
            }
            let out = tokio::select! {
                _ = tx.closed() => return,
                out = chunks.recv() => out,
            };
            events = match out {
                Some(Out::Chunk(v)) => t.chunk(&v),
                Some(Out::Error(e)) => t.error(&e),
                Some(Out::Done) => t.done(),
                None => return,
            };
        }
    });
    Ok(typed_sse(ReceiverStream::new(rx)))
}
