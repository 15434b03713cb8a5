//! Routes, request parsing, errors as OpenAI-style JSON, auth, and the non-streaming paths.

use super::body::{json_body, new_id, respond, JsonBody};
use super::stream::{self, within};
use super::{messages, responses, AppState};
use crate::api::openai::{self, gather, ChatRequest, CompletionRequest};
use crate::api::{unix_time, ApiError};
use crate::engine::{EngineHandle, Request, Usage};
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

type St = State<Arc<AppState>>;
type Body = JsonBody;

pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions/render", post(render_completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/messages", post(messages::create))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/version", get(|| async { Json(json!({"version": env!("CARGO_PKG_VERSION")})) }))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/generate", post(generate))
        .route("/generate/batch", post(generate_batch))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(|| async { Json(super::openapi::document()) }))
        .fallback(|| async { ApiError { status: 404, ..ApiError::invalid("no such route", None) }.into_response() })
        .method_not_allowed_fallback(|| async {
            ApiError { status: 405, ..ApiError::invalid("method not allowed on this route", None) }.into_response()
        })
        .layer(middleware::from_fn(request_id))
        .with_state(state)
}

/// Longest client `x-request-id` echoed back; a longer one is replaced by weft's own.
const MAX_REQUEST_ID: usize = 256;

/// Every response carries `x-request-id`: the client's, when it sent a usable one (as
/// vLLM echoes it), else a fresh id, so a log line and a client's error can be matched.
async fn request_id(req: HttpRequest, next: Next) -> Response {
    const HEADER: &str = "x-request-id";
    let theirs = req.headers().get(HEADER).filter(|v| !v.is_empty() && v.len() <= MAX_REQUEST_ID).cloned();
    let mut resp = next.run(req).await;
    let id = theirs.or_else(|| HeaderValue::from_str(&new_id("req")).ok());
    if let Some(id) = id {
        resp.headers_mut().insert(HEADER, id);
    }
    resp
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, Json(self.body())).into_response();
        if matches!(self.status, 429 | 503) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        // The rest of an oversized body was never read: the connection cannot carry another
        // request, so tell the client not to reuse it.
        if self.status == 413 {
            resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// Compares digests of the two keys in constant time, so the time taken says nothing
/// about how much of a guess was right (nor about the key's length).
fn key_matches(given: &str, key_digest: &[u8; 32]) -> bool {
    use sha2::{Digest, Sha256};
    let g: [u8; 32] = Sha256::digest(given.as_bytes()).into();
    g.iter().zip(key_digest).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

async fn auth(State(st): St, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        // `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`.
        let headers = req.headers();
        let bearer = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "));
        let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        let ok = bearer.or(x_api_key).is_some_and(|v| key_matches(v, key));
        if !ok {
            let e = ApiError {
                status: 401,
                kind: "authentication_error",
                ..ApiError::invalid("invalid or missing API key", None)
            };
            return e.into_response();
        }
    }
    next.run(req).await
}

async fn completions(State(st): St, body: Body) -> Response {
    respond(
        async {
            let engine = st.engine()?;
            let req = CompletionRequest::parse(json_body(body)?)?;
            let id = new_id("cmpl");
            if req.gen.streaming() {
                return stream::completions(engine, req, id, st.stream_ctx()).await;
            }
            Ok(Json(within(st.request_timeout, openai::completions(engine, &req, &id)).await?).into_response())
        }
        .await,
    )
}

async fn chat_completions(State(st): St, body: Body) -> Response {
    respond(
        async {
            let engine = st.engine()?;
            let req = ChatRequest::parse(json_body(body)?)?;
            let id = new_id("chatcmpl");
            if req.gen.streaming() {
                return stream::chat(engine, req, id, st.stream_ctx()).await;
            }
            Ok(Json(within(st.request_timeout, openai::chat_completions(engine, &req, &id)).await?).into_response())
        }
        .await,
    )
}

async fn render_completions(State(st): St, body: Body) -> Response {
    respond(
        async {
            let engine = st.engine()?;
            let req = CompletionRequest::parse(json_body(body)?)?;
            Ok(Json(crate::api::render::completions(engine, &req, &new_id("cmpl")).await?).into_response())
        }
        .await,
    )
}

async fn render_chat(State(st): St, body: Body) -> Response {
    respond(
        async {
            let engine = st.engine()?;
            let req = ChatRequest::parse(json_body(body)?)?;
            Ok(Json(crate::api::render::chat(engine, &req, &new_id("chatcmpl")).await?).into_response())
        }
        .await,
    )
}

async fn embeddings(State(st): St, body: Body) -> Response {
    respond(
        async {
            let engine = st.engine()?;
            let req = crate::api::embeddings::EmbeddingRequest::parse(json_body(body)?)?;
            Ok(Json(within(st.request_timeout, req.run(engine)).await?).into_response())
        }
        .await,
    )
}

/// The model object for the name `id`.
fn model_card(id: &str, e: &EngineHandle) -> Value {
    json!({"id": id, "object": "model", "created": unix_time(), "owned_by": "weft", "max_model_len": e.max_model_len()})
}

async fn models(State(st): St) -> Response {
    respond(
        st.engine().map(|e| Json(json!({"object": "list", "data": [model_card(&e.model().name, e)]})).into_response()),
    )
}

/// `GET /v1/models/{id}`: the model under any name it is served as, else 404.
async fn model(State(st): St, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    respond(st.engine().and_then(|e| {
        let m = e.model();
        if m.serves(&id) {
            Ok(Json(model_card(&id, e)).into_response())
        } else {
            Err(ApiError::model_not_found(&id, &m.name))
        }
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: String,
    /// Whether the tokenizer adds its special tokens (BOS); default true.
    add_special_tokens: Option<bool>,
}

/// `/tokenize`, as vLLM's: `{"prompt": ..., "add_special_tokens"}`, or `{"messages": [...],
/// "add_generation_prompt", "chat_template_kwargs"}` for the ids the chat endpoint would use.
async fn tokenize(State(st): St, body: Body) -> Response {
    respond(
        async {
            let engine = st.engine()?.clone();
            let body = json_body(body)?;
            let max = engine.max_model_len();
            let tokens = if body.get("messages").is_some() {
                let chat = crate::api::openai::ChatRequest::parse(body)?;
                openai::check_served(&engine, chat.gen.model.as_deref())?;
                crate::api::off_runtime(move || chat.prompt(&engine)).await?
            } else {
                let req: TokenizeRequest = crate::api::parse_split::<_, Value>(body)?.0;
                openai::check_served(&engine, req.model.as_deref())?;
                crate::api::off_runtime(move || {
                    engine
                        .model()
                        .tokenizer
                        .encode_with(&req.prompt, req.add_special_tokens.unwrap_or(true))
                        .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))
                })
                .await?
            };
            Ok(Json(json!({"tokens": tokens, "count": tokens.len(), "max_model_len": max})).into_response())
        }
        .await,
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

async fn detokenize(State(st): St, body: Body) -> Response {
    respond((|| {
        let engine = st.engine()?;
        let req: DetokenizeRequest = crate::api::parse_split::<_, Value>(json_body(body)?)?.0;
        openai::check_served(engine, req.model.as_deref())?;
        let vocab = engine.model().model.config.vocab_size;
        if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("token id {bad} is outside the vocabulary ({vocab})"),
                Some("tokens"),
            ));
        }
        let text = engine
            .model()
            .tokenizer
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("tokens")))?;
        Ok(Json(json!({"prompt": text})).into_response())
    })())
}

/// The native API's sampling fields.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct NativeParams {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Vec<String>>,
    pub stream: Option<bool>,
    /// Generate `max_tokens` whatever the model says (throughput runs, as vLLM's).
    pub ignore_eos: Option<bool>,
}

impl NativeParams {
    /// Engine requests for `prompts`, through the same checks as the OpenAI routes
    /// (tokenized off the async runtime).
    pub async fn requests(&self, engine: &EngineHandle, prompts: Vec<String>) -> Result<Vec<Request>, ApiError> {
        let fields = openai::GenerationFields {
            max_tokens: Some(self.max_tokens.unwrap_or(128)),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            stop: self.stop.clone().map(openai::OneOrMany::Many),
            ignore_eos: self.ignore_eos,
            ..Default::default()
        };
        let req = CompletionRequest {
            prompt: openai::PromptInput::Texts(prompts),
            logprobs: None,
            echo: None,
            best_of: None,
            gen: fields,
        };
        req.prepare(engine).await
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateOwn {
    prompt: String,
}

async fn generate(State(st): St, body: Body) -> Response {
    respond(
        async {
            let engine = st.engine()?;
            let (own, params): (GenerateOwn, NativeParams) = crate::api::parse_split(json_body(body)?)?;
            let req = params.requests(engine, vec![own.prompt]).await?.remove(0);
            if params.stream.unwrap_or(false) {
                return stream::generate(engine, req, st.stream_ctx());
            }
            let start = Instant::now();
            let s = engine.submit(req)?;
            let g = within(st.request_timeout, gather(s, 1)).await?;
            Ok(Json(native_result(&g.choices[0], &g.usage, start.elapsed())).into_response())
        }
        .await,
    )
}

fn native_result(c: &openai::Choice, u: &Usage, took: Duration) -> Value {
    json!({"text": c.text, "finish_reason": openai::finish_reason(c.finish), "usage": openai::usage(u),
        "time_seconds": took.as_secs_f64()})
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchOwn {
    prompts: Vec<String>,
}

async fn generate_batch(State(st): St, body: Body) -> Response {
    respond(
        async {
            let engine = st.engine()?;
            let (own, params): (BatchOwn, NativeParams) = crate::api::parse_split(json_body(body)?)?;
            if params.stream.unwrap_or(false) {
                return Err(ApiError::invalid("stream is not supported on /generate/batch", Some("stream")));
            }
            if own.prompts.is_empty() || own.prompts.len() > st.max_batch_prompts {
                return Err(ApiError::invalid(
                    format!("prompts must hold 1 to {} prompts, got {}", st.max_batch_prompts, own.prompts.len()),
                    Some("prompts"),
                ));
            }
            let total = own.prompts.len();
            let reqs = params.requests(engine, own.prompts).await?;
            let start = Instant::now();
            // Everything enters the engine before anything is awaited, so all prompts batch.
            let streams = reqs.into_iter().map(|r| engine.submit(r)).collect::<Result<Vec<_>, _>>()?;
            // The set owns every stream: when this handler is dropped (the client left) or
            // times out, the set aborts its tasks, their streams drop, and the engine
            // aborts the sequences.
            let mut tasks = tokio::task::JoinSet::new();
            for (i, s) in streams.into_iter().enumerate() {
                tasks.spawn(async move { (i, gather(s, 1).await, start.elapsed()) });
            }
            let results = within(st.request_timeout, async move {
                let mut out = vec![Value::Null; total];
                while let Some(joined) = tasks.join_next().await {
                    let (i, r, took) = joined.map_err(|e| ApiError::internal(e.to_string()))?;
                    let g = r?;
                    out[i] = native_result(&g.choices[0], &g.usage, took);
                }
                Ok(out)
            })
            .await?;
            let elapsed = start.elapsed().as_secs_f64();
            Ok(Json(json!({"results": results, "total_prompts": total, "total_time_seconds": elapsed,
                "avg_time_per_prompt": elapsed / total as f64}))
            .into_response())
        }
        .await,
    )
}

async fn health(State(st): St) -> Response {
    let status = if st.shutting_down.load(Ordering::SeqCst) {
        "shutting down"
    } else {
        match st.engine.get() {
            None => "loading",
            Some(e) if !e.is_alive() => "engine down",
            Some(_) => return (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        }
    };
    (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "1")], Json(json!({"status": status}))).into_response()
}

async fn metrics(State(st): St) -> Response {
    let stats = st.engine.get().map(EngineHandle::stats).unwrap_or_default();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.metrics.render(&stats)).into_response()
}
