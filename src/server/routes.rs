//! Routes, request parsing, errors as OpenAI-style JSON, auth, and the non-streaming paths.

use super::{stream, AppState};
use crate::api::openai::{self, gather, ChatRequest, CompletionRequest};
use crate::api::{unix_time, ApiError};
use crate::engine::{EngineHandle, Request};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type St = State<Arc<AppState>>;
type Body = Result<Bytes, BytesRejection>;

pub fn router(state: Arc<AppState>, max_body: usize) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
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
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, Json(self.body())).into_response();
        if matches!(self.status, 429 | 503) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Request ids: a per-process prefix from the clock, then a counter.
pub fn new_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let start = START.get_or_init(|| unix_time() & 0xffff_ffff);
    format!("{prefix}-{start:08x}{:08x}", N.fetch_add(1, Ordering::Relaxed))
}

/// The body as JSON: 413 over the size limit, 400 for anything that is not JSON.
fn json_body(body: Body) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| ApiError { status: e.status().as_u16(), ..ApiError::invalid(e.body_text(), None) })?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))
}

/// Runs `fut` within the request timeout; when it expires the future (and with it the
/// engine request) is dropped.
pub async fn within<T>(limit: Option<Duration>, fut: impl Future<Output = Result<T, ApiError>>) -> Result<T, ApiError> {
    match limit {
        Some(t) => tokio::time::timeout(t, fut).await.unwrap_or_else(|_| {
            Err(ApiError {
                status: 504,
                ..ApiError::invalid(format!("request timed out after {:.1} s", t.as_secs_f64()), None)
            })
        }),
        None => fut.await,
    }
}

fn respond(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn auth(State(st): St, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|v| v == key);
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
                return stream::completions(engine, req, id, st.request_timeout);
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
                return stream::chat(engine, req, id, st.request_timeout);
            }
            Ok(Json(within(st.request_timeout, openai::chat_completions(engine, &req, &id)).await?).into_response())
        }
        .await,
    )
}

async fn models(State(st): St) -> Response {
    respond(st.engine().map(|e| {
        let m = e.model();
        Json(json!({"object": "list", "data": [{"id": m.name, "object": "model", "created": unix_time(),
            "owned_by": "weft", "max_model_len": m.model.config.max_position_embeddings}]}))
        .into_response()
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    #[allow(dead_code)]
    model: Option<String>,
    prompt: String,
}

async fn tokenize(State(st): St, body: Body) -> Response {
    respond((|| {
        let engine = st.engine()?;
        let req: TokenizeRequest =
            crate::api::parse_split::<TokenizeRequest, Value>(json_body(body)?, &["model", "prompt"], &[])?.0;
        let tokens = engine
            .model()
            .tokenizer
            .encode(&req.prompt)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?;
        let max = engine.model().model.config.max_position_embeddings;
        Ok(Json(json!({"tokens": tokens, "count": tokens.len(), "max_model_len": max})).into_response())
    })())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    #[allow(dead_code)]
    model: Option<String>,
    tokens: Vec<u32>,
}

async fn detokenize(State(st): St, body: Body) -> Response {
    respond((|| {
        let engine = st.engine()?;
        let req: DetokenizeRequest =
            crate::api::parse_split::<_, Value>(json_body(body)?, &["model", "tokens"], &[])?.0;
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
}

const NATIVE_KEYS: &[&str] = &["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream"];

impl NativeParams {
    /// An engine request for `prompt`, through the same checks as the OpenAI routes.
    pub fn request(&self, engine: &EngineHandle, prompt: &str) -> Result<Request, ApiError> {
        let fields = openai::GenerationFields {
            max_tokens: Some(self.max_tokens.unwrap_or(128)),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            stop: self.stop.clone().map(openai::OneOrMany::Many),
            ..Default::default()
        };
        let req = CompletionRequest {
            prompt: openai::PromptInput::Text(prompt.to_owned()),
            logprobs: None,
            echo: None,
            gen: fields,
        };
        Ok(req.engine_requests(engine)?.remove(0))
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
            let (own, params): (GenerateOwn, NativeParams) =
                crate::api::parse_split(json_body(body)?, &["prompt"], NATIVE_KEYS)?;
            let req = params.request(engine, &own.prompt)?;
            if params.stream.unwrap_or(false) {
                return stream::generate(engine, req, st.request_timeout);
            }
            let start = Instant::now();
            let s = engine.submit(req)?;
            let (choices, p, c) = within(st.request_timeout, gather(s, 1)).await?;
            Ok(Json(native_result(&choices[0], p, c, start.elapsed())).into_response())
        }
        .await,
    )
}

fn native_result(c: &openai::Choice, prompt: usize, completion: usize, took: Duration) -> Value {
    json!({"text": c.text, "finish_reason": openai::finish_reason(c.finish), "usage": openai::usage(prompt, completion),
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
            let (own, params): (BatchOwn, NativeParams) =
                crate::api::parse_split(json_body(body)?, &["prompts"], NATIVE_KEYS)?;
            if params.stream.unwrap_or(false) {
                return Err(ApiError::invalid("stream is not supported on /generate/batch", Some("stream")));
            }
            if own.prompts.is_empty() || own.prompts.len() > st.max_batch_prompts {
                return Err(ApiError::invalid(
                    format!("prompts must hold 1 to {} prompts, got {}", st.max_batch_prompts, own.prompts.len()),
                    Some("prompts"),
                ));
            }
            let reqs = own.prompts.iter().map(|p| params.request(engine, p)).collect::<Result<Vec<_>, _>>()?;
            let start = Instant::now();
            // Everything enters the engine before anything is awaited, so all prompts batch.
            let streams = reqs.into_iter().map(|r| engine.submit(r)).collect::<Result<Vec<_>, _>>()?;
            let tasks: Vec<_> = streams
                .into_iter()
                .map(|s| {
                    tokio::spawn(async move {
                        let r = gather(s, 1).await;
                        (r, start.elapsed())
                    })
                })
                .collect();
            let total = own.prompts.len();
            let results = within(st.request_timeout, async {
                let mut out = Vec::with_capacity(total);
                for t in tasks {
                    let (r, took) = t.await.map_err(|e| ApiError::internal(e.to_string()))?;
                    let (c, p, n) = r?;
                    out.push(native_result(&c[0], p, n, took));
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
    } else if st.engine.get().is_none() {
        "loading"
    } else {
        return (StatusCode::OK, Json(json!({"status": "ok"}))).into_response();
    };
    (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "1")], Json(json!({"status": status}))).into_response()
}

async fn metrics(State(st): St) -> Response {
    let stats = st.engine.get().map(EngineHandle::stats).unwrap_or_default();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.metrics.render(&stats)).into_response()
}
