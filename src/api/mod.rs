//! The OpenAI-compatible API, independent of transport: request types and their checks,
//! conversion to engine requests, and the response bodies. `weft batch` writes exactly
//! these bodies; the HTTP server sends them.

pub mod answer;
pub mod chat;
pub mod embeddings;
pub mod fields;
pub mod harmony;
pub mod messages;
pub mod openai;
pub mod render;
pub mod responses;
pub mod tools;

use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};

/// An error in OpenAI's shape, with the HTTP status it maps to.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
        }
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        ApiError {
            status: 429,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("overloaded"),
        }
    }

    /// OpenAI's 404 for a model this server does not serve.
    pub fn model_not_found(model: &str, served: &str) -> Self {
        ApiError {
            status: 404,
            code: Some("model_not_found"),
            ..ApiError::invalid(
                format!("The model `{model}` does not exist; this server serves `{served}`."),
                Some("model"),
            )
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError { status: 503, message: message.into(), kind: "service_unavailable", param: None, code: None }
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        ApiError { status: 504, message: message.into(), kind: "timeout_error", param: None, code: Some("timeout") }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: 500, message: message.into(), kind: "server_error", param: None, code: None }
    }

    /// `{"error": {"message", "type", "param", "code"}}`
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<crate::engine::SubmitError> for ApiError {
    fn from(e: crate::engine::SubmitError) -> Self {
        use crate::engine::SubmitError::*;
        match e {
            Invalid { message, param } => ApiError::invalid(message, param),
            Overloaded(_) => ApiError::overloaded(e.to_string()),
            ShutDown => ApiError::unavailable(e.to_string()),
        }
    }
}

/// Request fields of OpenAI's or vLLM's API that weft cannot honour, with the reason. They
/// are refused: ignoring them would hand back text the client cannot use.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("functions", "`functions` is OpenAI's deprecated form of `tools`; send `tools`"),
    ("function_call", "`function_call` is OpenAI's deprecated form of `tool_choice`; send `tool_choice`"),
    ("suffix", "`suffix` (fill-in-the-middle) is not supported: weft builds no FIM prompts"),
];

/// Logs an ignored request field, once per name (and for a bounded number of names, so a
/// client sending endless new names cannot grow the set).
fn warn_ignored(name: &str) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    let name: String = name.chars().take(64).collect();
    if seen.len() < 256 && !seen.contains(&name) {
        eprintln!("weft: warning: ignoring request field `{name}`, which weft does not use");
        seen.push(name);
    }
}

/// Deserializes a JSON object into its own fields (`A`) and the shared generation fields
/// (`B`), each type's keys as serde reads them ([`fields::keys`]), naming the field of a
/// type error. Fields weft
/// cannot honour are refused; any other unknown field is ignored (as vLLM does), with a
/// warning the first time its name is seen. (Two passes instead of `serde(flatten)`, which
/// loses the field's name.)
pub fn parse_split<A: DeserializeOwned, B: DeserializeOwned>(v: Value) -> Result<(A, B), ApiError> {
    let (own, shared) = (fields::keys::<A>(), fields::keys::<B>());
    let Value::Object(map) = v else {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    };
    let known = |k: &str| own.contains(&k) || shared.contains(&k);
    if let Some((k, why)) = UNSUPPORTED.iter().find(|(k, _)| !known(k) && map.contains_key(*k)) {
        return Err(ApiError::invalid(*why, Some(k)));
    }
    let (map, ignored): (serde_json::Map<_, _>, serde_json::Map<_, _>) = map.into_iter().partition(|(k, _)| known(k));
    ignored.keys().for_each(|k| warn_ignored(k));
    let (a, b): (serde_json::Map<_, _>, serde_json::Map<_, _>) =
        map.into_iter().partition(|(k, _)| own.contains(&k.as_str()));
    Ok((deserialize(Value::Object(a))?, deserialize(Value::Object(b))?))
}

fn deserialize<T: DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path.as_str());
        ApiError::invalid(format!("invalid value for `{path}`: {}", e.inner()), param)
    })
}

/// Runs CPU-heavy request preparation (tokenizing, rendering chat templates) on tokio's
/// blocking pool, two at a time, so a huge prompt never stalls the async workers that
/// answer `/health` and stream tokens, nor takes both cores from the engine.
pub async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    static PERMITS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);
    let _permit = PERMITS.acquire().await.map_err(|e| ApiError::internal(e.to_string()))?;
    let work = move || {
        let _counted = Preparing::start();
        f()
    };
    tokio::task::spawn_blocking(work).await.map_err(|e| ApiError::internal(format!("preparing the request: {e}")))?
}

/// Requests being tokenized or rendered off the async workers right now.
static PREPARING: AtomicUsize = AtomicUsize::new(0);

/// One request's preparation, counted in [`PREPARING`] while it runs (panics included).
struct Preparing;

impl Preparing {
    fn start() -> Self {
        PREPARING.fetch_add(1, Ordering::SeqCst);
        Preparing
    }
}

impl Drop for Preparing {
    fn drop(&mut self) {
        PREPARING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How many requests [`off_runtime`] is preparing now (a gauge in `/metrics`).
pub fn preparing() -> usize {
    PREPARING.load(Ordering::SeqCst)
}

/// An object's id: `prefix`, `_` and 24 random alphanumerics (the Responses and Messages
/// APIs' shape).
pub fn random_id(prefix: &str) -> String {
    use rand::Rng;
    let tail: String = rand::rng().sample_iter(rand::distr::Alphanumeric).take(24).map(char::from).collect();
    format!("{prefix}_{tail}")
}

/// Seconds since the Unix epoch, for `created` fields.
pub fn unix_time() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
