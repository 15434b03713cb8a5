//! Request bodies read as JSON within the size limit, ids, and errors as responses: what
//! every route's handler uses.

use super::AppState;
use crate::api::{unix_time, ApiError};
use axum::extract::{FromRequest, Request as HttpRequest};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_stream::StreamExt;

/// Request ids: a per-process prefix from the clock, then a counter.
pub fn new_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let start = START.get_or_init(|| unix_time() & 0xffff_ffff);
    format!("{prefix}-{start:08x}{:08x}", N.fetch_add(1, Ordering::Relaxed))
}

/// A request body read whole, up to `--max-body-bytes`, as JSON: 413 over the limit, 400
/// for anything that is not JSON. Past the limit the rest is still read and dropped (up to
/// [`DRAIN_BYTES`] more, within [`DRAIN_TIME`]) before the 413 goes out: a socket closed
/// with unread data is reset, and a client still sending would lose the answer.
pub struct JsonBody(Result<Value, ApiError>);

/// Bytes past the limit read and dropped so that the 413 reaches the client.
const DRAIN_BYTES: usize = 64 << 20;
/// How long that may take.
const DRAIN_TIME: Duration = Duration::from_secs(2);

impl FromRequest<Arc<AppState>> for JsonBody {
    type Rejection = std::convert::Infallible;

    async fn from_request(req: HttpRequest, st: &Arc<AppState>) -> Result<Self, Self::Rejection> {
        Ok(JsonBody(read_json(req.into_body(), st.max_body_bytes).await))
    }
}

async fn read_json(body: axum::body::Body, limit: usize) -> Result<Value, ApiError> {
    let mut stream = body.into_data_stream();
    let (mut bytes, mut seen) = (Vec::new(), 0usize);
    let unreadable = |e: axum::Error| ApiError::invalid(format!("reading the request body: {e}"), None);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(unreadable)?;
        seen = seen.saturating_add(chunk.len());
        if seen > limit {
            break;
        }
        bytes.extend_from_slice(&chunk);
    }
    if seen > limit {
        let drain = async {
            while seen <= limit.saturating_add(DRAIN_BYTES) {
                match stream.next().await {
                    Some(Ok(chunk)) => seen += chunk.len(),
                    _ => break,
                }
            }
        };
        let _ = tokio::time::timeout(DRAIN_TIME, drain).await;
        let message = format!("the request body is larger than --max-body-bytes ({limit} bytes)");
        return Err(ApiError { status: 413, ..ApiError::invalid(message, None) });
    }
    serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))
}

/// The body's JSON, or why there is none.
pub fn json_body(body: JsonBody) -> Result<Value, ApiError> {
    body.0
}

pub fn respond(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}
