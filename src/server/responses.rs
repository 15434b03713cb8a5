//! `/v1/responses`: create a response (streamed or not) and keep its conversation for
//! `previous_response_id`; retrieve or delete a stored one.

use super::body::{json_body, new_id, respond, JsonBody};
use super::stream::{self, within};
use super::AppState;
use crate::api::answer::{thinks, Answer};
use crate::api::openai::{self, check_served};
use crate::api::responses::output::{conversation, ItemIds, Meta, ResponseStream};
use crate::api::responses::ResponsesRequest;
use crate::api::ApiError;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;

type St = State<Arc<AppState>>;

/// OpenAI's 404 for a response id that was never stored, was deleted or has expired.
fn not_found(id: &str, param: Option<&str>) -> ApiError {
    let what = if param.is_some() { "Previous response" } else { "Response" };
    ApiError {
        status: 404,
        code: Some(if param.is_some() { "previous_response_not_found" } else { "response_not_found" }),
        ..ApiError::invalid(format!("{what} with id '{id}' not found."), param)
    }
}

pub async fn create(State(st): St, body: JsonBody) -> Response {
    // The chat request's checks name its fields; this API calls one of them otherwise.
    let renamed = |mut e: ApiError| {
        if e.param.as_deref() == Some("max_tokens") {
            e.param = Some("max_output_tokens".into());
        }
        e
    };
    respond(
        async {
            let engine = st.engine()?;
            let req = ResponsesRequest::parse(json_body(body)?)?;
            check_served(engine, req.model.as_deref())?;
            let history = match &req.previous_response_id {
                None => Vec::new(),
                Some(id) => {
                    st.responses.get(id).ok_or_else(|| not_found(id, Some("previous_response_id")))?.messages.clone()
                }
            };
            let input = req.input_messages()?;
            let chat = req.chat(&history, &input)?;
            let meta = Meta::new(&req, &engine.model().name);
            let mut kept = history;
            kept.extend(input);
            let store = req.stores().then(|| st.clone());
            let thinks = thinks(engine.model().tokenizer.chat_template.as_deref());
            if req.streaming() {
                let on_done = Box::new(move |a: &Answer, r: Value| {
                    if let Some(st) = store {
                        st.responses.put(conversation(kept, a), r);
                    }
                });
                let make = move |_| Box::new(ResponseStream::new(meta, thinks, on_done)) as _;
                return stream::translated(engine, chat, st.stream_ctx(), make).await;
            }
            let body = within(st.request_timeout, openai::chat_completions(engine, &chat, &new_id("chatcmpl"))).await?;
            let answer = Answer::from_chat(&body, thinks);
            let r = meta.finished(&answer, &ItemIds::new());
            if let Some(st) = store {
                st.responses.put(conversation(kept, &answer), r.clone());
            }
            Ok(Json(r).into_response())
        }
        .await
        .map_err(renamed),
    )
}

pub async fn retrieve(State(st): St, Path(id): Path<String>) -> Response {
    respond(st.responses.get(&id).map(|s| Json(s.response.clone()).into_response()).ok_or_else(|| not_found(&id, None)))
}

pub async fn delete(State(st): St, Path(id): Path<String>) -> Response {
    respond(if st.responses.delete(&id) {
        Ok(Json(json!({"id": id, "object": "response", "deleted": true})).into_response())
    } else {
        Err(not_found(&id, None))
    })
}
