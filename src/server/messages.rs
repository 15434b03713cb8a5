//! `/v1/messages` and `/v1/messages/count_tokens`, Anthropic's API, with its error shape.
//! The model name is not checked here: Anthropic's clients send Claude's names (and more
//! than one), as llama-server's users found.

use super::body::{json_body, JsonBody};
use super::stream::{self, within};
use super::AppState;
use crate::api::answer::{thinks, Answer};
use crate::api::messages::output::{message, MessageStream};
use crate::api::messages::{error_body, MessagesRequest};
use crate::api::openai;
use crate::api::{off_runtime, random_id, ApiError};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;

type St = State<Arc<AppState>>;

/// The response, or the error in Anthropic's shape.
fn anthropic(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| {
        let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, Json(error_body(&e))).into_response();
        if matches!(e.status, 429 | 503) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    })
}

pub async fn create(State(st): St, body: JsonBody) -> Response {
    anthropic(
        async {
            let engine = st.engine()?;
            let req = MessagesRequest::parse(json_body(body)?)?;
            let model = req.model.clone().unwrap_or_else(|| engine.model().name.clone());
            let mut chat = req.chat(false)?;
            chat.gen.model = None;
            let thinks = thinks(engine.model().tokenizer.chat_template.as_deref());
            if req.streaming() {
                let make = move |prompt_tokens| Box::new(MessageStream::new(&model, prompt_tokens, thinks)) as _;
                return stream::translated(engine, chat, st.stream_ctx(), make).await;
            }
            let body = within(st.request_timeout, openai::chat_completions(engine, &chat, "")).await?;
            Ok(Json(message(&random_id("msg"), &model, &Answer::from_chat(&body, thinks))).into_response())
        }
        .await,
    )
}

pub async fn count_tokens(State(st): St, body: JsonBody) -> Response {
    anthropic(
        async {
            let engine = st.engine()?.clone();
            let mut chat = MessagesRequest::parse(json_body(body)?)?.chat(true)?;
            chat.gen.model = None;
            let prompt = off_runtime(move || chat.prompt(&engine)).await?;
            Ok(Json(json!({"input_tokens": prompt.len()})).into_response())
        }
        .await,
    )
}
