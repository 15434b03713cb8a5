//! A response's output: the `response` object with its message and function-call items,
//! whole or as the typed event stream (`response.created`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`, …, `response.completed`). Both are built from
//! the same [`Answer`], so a streamed response ends in the object a plain request returns.

use super::ResponsesRequest;
use crate::api::answer::{Answer, Events, Piece, Reader, Translate};
use crate::api::chat::ChatMessage;
use crate::api::{random_id, unix_time, ApiError};
use serde_json::{json, Value};

/// What a response object repeats of its request, and its id.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    echo: Value,
}

impl Meta {
    pub fn new(req: &ResponsesRequest, model: &str) -> Self {
        let format = req.text.as_ref().and_then(|t| serde_json::to_value(&t.format).ok()).filter(|f| !f.is_null());
        let echo = json!({
            "instructions": req.instructions,
            "tools": req.tools.clone().unwrap_or_default(),
            "tool_choice": req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
            "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
            "temperature": req.temperature.unwrap_or(1.0),
            "top_p": req.top_p.unwrap_or(1.0),
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "text": {"format": format.unwrap_or_else(|| json!({"type": "text"}))},
            "metadata": req.metadata.clone().unwrap_or_default(),
            "store": req.stores(),
            "truncation": "disabled",
            "reasoning": {"effort": null, "summary": null},
            "user": req.user,
            "background": false,
            "error": null,
        });
        Meta { id: random_id("resp"), created_at: unix_time(), model: model.to_owned(), echo }
    }

    /// The response object: `status` with its items and, once known, the usage.
    pub fn object(&self, status: &str, output: Vec<Value>, answer: Option<&Answer>) -> Value {
        let mut v = json!({"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output});
        if let (Value::Object(v), Value::Object(echo)) = (&mut v, &self.echo) {
            v.extend(echo.clone());
        }
        v["incomplete_details"] =
            if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null };
        v["usage"] = answer.map_or(Value::Null, usage);
        v
    }

    /// The finished response of `answer`, its items named by `ids`.
    pub fn finished(&self, answer: &Answer, ids: &ItemIds) -> Value {
        let status = if answer.cut_off() { "incomplete" } else { "completed" };
        self.object(status, items(answer, ids), Some(answer))
    }
}

fn usage(a: &Answer) -> Value {
    json!({"input_tokens": a.prompt_tokens, "input_tokens_details": {"cached_tokens": a.cached_tokens},
        "output_tokens": a.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": a.prompt_tokens + a.completion_tokens})
}

/// The ids of a response's items: its reasoning, its message, and per call, the
/// function-call item.
#[derive(Debug, Clone, Default)]
pub struct ItemIds {
    reasoning: String,
    message: String,
    calls: Vec<String>,
}

impl ItemIds {
    pub fn new() -> Self {
        ItemIds { reasoning: random_id("rs"), message: random_id("msg"), calls: Vec::new() }
    }

    fn call(&mut self, index: usize) -> &str {
        while self.calls.len() <= index {
            self.calls.push(random_id("fc"));
        }
        &self.calls[index]
    }
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([text_part(text)]) };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([reasoning_part(text)]) };
    json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
}

fn reasoning_part(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// The output items: the reasoning (of a model that thinks), the message (when there is
/// text), then the calls.
pub fn items(a: &Answer, ids: &ItemIds) -> Vec<Value> {
    let status = if a.cut_off() { "incomplete" } else { "completed" };
    let mut out = Vec::new();
    if !a.reasoning.is_empty() {
        out.push(reasoning_item(&ids.reasoning, &a.reasoning, status));
    }
    if !a.text.is_empty() || a.calls.is_empty() {
        out.push(message_item(&ids.message, &a.text, status));
    }
    let mut ids = ids.clone();
    for (i, c) in a.calls.iter().enumerate() {
        out.push(call_item(ids.call(i), &c.id, &c.name, &c.arguments, status));
    }
    out
}

/// The conversation after `answer`: `messages` and the answer as an assistant message.
pub fn conversation(mut messages: Vec<ChatMessage>, answer: &Answer) -> Vec<ChatMessage> {
    let calls: Vec<Value> = answer
        .calls
        .iter()
        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect();
    let content = (!answer.text.is_empty() || calls.is_empty()).then(|| answer.text.clone());
    messages.push(ChatMessage {
        tool_calls: (!calls.is_empty()).then_some(calls),
        ..ChatMessage::new("assistant", content)
    });
    messages
}

/// The item open in a stream.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Open {
    Nothing,
    Reasoning,
    Message,
    Call(usize),
}

/// Called with the finished answer and response object (to store them).
pub type OnDone = Box<dyn FnOnce(&Answer, Value) + Send>;

/// Tells a streamed chat completion as Responses events; at the end hands the finished
/// response to `on_done` (the store).
pub struct ResponseStream {
    meta: Meta,
    ids: ItemIds,
    answer: Answer,
    open: Open,
    /// Output index of the open item.
    index: usize,
    seq: u64,
    on_done: Option<OnDone>,
    reader: Reader,
}

impl ResponseStream {
    /// `thinks`: the model writes its reasoning first ([`crate::api::answer::thinks`]).
    pub fn new(meta: Meta, thinks: bool, on_done: OnDone) -> Self {
        ResponseStream {
            meta,
            ids: ItemIds::new(),
            answer: Answer::default(),
            open: Open::Nothing,
            index: 0,
            seq: 0,
            on_done: Some(on_done),
            reader: Reader::new(thinks),
        }
    }

    fn event(&mut self, out: &mut Events, name: &'static str, v: Value) {
        let mut e = json!({"type": name, "sequence_number": self.seq});
        if let (Value::Object(e), Value::Object(v)) = (&mut e, v) {
            e.extend(v);
        }
        self.seq += 1;
        out.push((name, e));
    }

    /// Ends the open item: its `.done` events.
    fn close(&mut self, out: &mut Events) {
        let index = self.index;
        match self.open {
            Open::Nothing => return,
            Open::Reasoning => {
                let (id, text) = (self.ids.reasoning.clone(), self.answer.reasoning.clone());
                let done = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text});
                self.event(out, "response.reasoning_text.done", done);
                let item = reasoning_item(&id, &text, self.item_status());
                self.event(out, "response.output_item.done", json!({"output_index": index, "item": item}));
            }
            Open::Message => {
                let (id, text) = (self.ids.message.clone(), self.answer.text.clone());
                let at = json!({"item_id": id, "output_index": index, "content_index": 0});
                let mut done = at.clone();
                done["text"] = text.clone().into();
                done["logprobs"] = json!([]);
                self.event(out, "response.output_text.done", done);
                let mut part = at;
                part["part"] = text_part(&text);
                self.event(out, "response.content_part.done", part);
                let item = message_item(&id, &text, self.item_status());
                self.event(out, "response.output_item.done", json!({"output_index": index, "item": item}));
            }
            Open::Call(i) => {
                let c = self.answer.calls[i].clone();
                let id = self.ids.call(i).to_owned();
                self.event(
                    out,
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "name": c.name, "arguments": c.arguments}),
                );
                let item = call_item(&id, &c.id, &c.name, &c.arguments, self.item_status());
                self.event(out, "response.output_item.done", json!({"output_index": index, "item": item}));
            }
        }
        self.index += 1;
        self.open = Open::Nothing;
    }

    fn item_status(&self) -> &'static str {
        if self.answer.cut_off() {
            "incomplete"
        } else {
            "completed"
        }
    }
}

impl Translate for ResponseStream {
    fn start(&mut self) -> Events {
        let mut out = Vec::new();
        let r = self.meta.object("in_progress", vec![], None);
        self.event(&mut out, "response.created", json!({"response": r}));
        self.event(&mut out, "response.in_progress", json!({"response": r}));
        out
    }

    fn piece(&mut self, p: Piece, out: &mut Events) {
        self.answer.apply(&p);
        match p {
            Piece::Reasoning(delta) => {
                if self.open != Open::Reasoning {
                    self.close(out);
                    self.open = Open::Reasoning;
                    let item = reasoning_item(&self.ids.reasoning, "", "in_progress");
                    self.event(out, "response.output_item.added", json!({"output_index": self.index, "item": item}));
                }
                let v = json!({"item_id": self.ids.reasoning, "output_index": self.index, "content_index": 0,
                    "delta": delta});
                self.event(out, "response.reasoning_text.delta", v);
            }
            Piece::Text(delta) => {
                if self.open != Open::Message {
                    self.close(out);
                    self.open = Open::Message;
                    let (id, index) = (self.ids.message.clone(), self.index);
                    let item = message_item(&id, "", "in_progress");
                    self.event(out, "response.output_item.added", json!({"output_index": index, "item": item}));
                    let part = json!({"item_id": id, "output_index": index, "content_index": 0, "part": text_part("")});
                    self.event(out, "response.content_part.added", part);
                }
                let v = json!({"item_id": self.ids.message, "output_index": self.index, "content_index": 0,
                    "delta": delta, "logprobs": []});
                self.event(out, "response.output_text.delta", v);
            }
            Piece::CallStart { index: i, id: call_id, name } => {
                self.close(out);
                self.open = Open::Call(i);
                let id = self.ids.call(i).to_owned();
                let item = call_item(&id, &call_id, &name, "", "in_progress");
                self.event(out, "response.output_item.added", json!({"output_index": self.index, "item": item}));
            }
            Piece::CallArgs { index: i, delta } => {
                let id = self.ids.call(i).to_owned();
                let v = json!({"item_id": id, "output_index": self.index, "delta": delta});
                self.event(out, "response.function_call_arguments.delta", v);
            }
            Piece::Finish(..) | Piece::Usage(_) => {}
        }
    }

    fn reader(&mut self) -> &mut Reader {
        &mut self.reader
    }

    fn end(&mut self, out: &mut Events) {
        if self.answer.text.is_empty() && self.answer.calls.is_empty() {
            // An empty answer is still one (empty) message, as the whole response shows it.
            self.piece(Piece::Text(String::new()), out);
        }
        self.close(out);
        let r = self.meta.finished(&self.answer, &self.ids);
        let name = if self.answer.cut_off() { "response.incomplete" } else { "response.completed" };
        self.event(out, name, json!({"response": r}));
        if let Some(f) = self.on_done.take() {
            f(&self.answer, r);
        }
    }

    fn error(&mut self, e: &ApiError) -> Events {
        let mut out = Vec::new();
        self.event(
            &mut out,
            "error",
            json!({"code": e.code.unwrap_or(e.kind), "message": e.message, "param": e.param}),
        );
        let mut r = self.meta.object("failed", vec![], None);
        r["error"] = json!({"code": "server_error", "message": e.message});
        self.event(&mut out, "response.failed", json!({"response": r}));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn request() -> ResponsesRequest {
        ResponsesRequest::parse(json!({"input": "hi", "text": {"format": {"type": "json_object"}}})).unwrap()
    }

    /// The events of a streamed answer, and the response they end in, which equals the
    /// response of the same answer read whole.
    #[test]
    fn a_streamed_response_ends_in_the_whole_one() {
        let chunks = [
            json!({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"content": "Let me"}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\""}}]}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                "finish_reason": null}]}),
            json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
        ];
        let kept = Arc::new(Mutex::new(None));
        let k = kept.clone();
        let meta = Meta::new(&request(), "m");
        let mut s = ResponseStream::new(meta.clone(), false, Box::new(move |_, r| *k.lock().unwrap() = Some(r)));
        let mut events = s.start();
        chunks.iter().for_each(|c| events.extend(s.chunk(c)));
        events.extend(s.done());
        let names: Vec<&str> = events.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let seqs: Vec<u64> = events.iter().map(|(_, v)| v["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(seqs, (0..events.len() as u64).collect::<Vec<_>>());
        let last = &events.last().unwrap().1["response"];
        assert_eq!(last["output"][1]["arguments"], "{\"x\": 1}");
        assert_eq!(last["output"][0]["content"][0]["text"], "Let me");
        assert_eq!(last["usage"]["total_tokens"], 7);
        assert_eq!(last["text"]["format"]["type"], "json_object");
        assert_eq!(kept.lock().unwrap().as_ref(), Some(last));
        // Read whole, with the stream's item ids, the answer is the same object.
        let whole = json!({"choices": [{"message": {"content": "Let me", "tool_calls": [{"id": "call_1",
            "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}});
        assert_eq!(&meta.finished(&Answer::from_chat(&whole, false), &s.ids), last);
    }

    #[test]
    fn a_cut_off_answer_is_incomplete() {
        let mut s = ResponseStream::new(Meta::new(&request(), "m"), false, Box::new(|_, _| {}));
        s.start();
        s.chunk(&json!({"choices": [{"delta": {"content": "abc"}, "finish_reason": "length"}]}));
        let events = s.done();
        let (name, v) = events.last().unwrap();
        assert_eq!(*name, "response.incomplete");
        assert_eq!(v["response"]["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(v["response"]["output"][0]["status"], "incomplete");
    }

    /// A thinking model's reasoning streams as a reasoning item before the message, and
    /// the whole response shows the same items.
    #[test]
    fn reasoning_comes_first_as_its_own_item() {
        let meta = Meta::new(&request(), "m");
        let mut s = ResponseStream::new(meta.clone(), true, Box::new(|_, _| {}));
        let mut events = s.start();
        for piece in ["<think>\nHm", "m.</th", "ink>\n\nFour."] {
            events.extend(s.chunk(&json!({"choices": [{"delta": {"content": piece}, "finish_reason": null}]})));
        }
        events.extend(s.chunk(&json!({"choices": [{"delta": {}, "finish_reason": "stop"}]})));
        events.extend(s.done());
        let names: Vec<&str> = events.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            &names[2..6],
            [
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done"
            ]
        );
        let last = &events.last().unwrap().1["response"];
        assert_eq!(last["output"][0]["content"][0]["text"], "Hmm.");
        assert_eq!(last["output"][1]["content"][0]["text"], "Four.");
        let whole =
            json!({"choices": [{"message": {"content": "<think>\nHmm.</think>\n\nFour."}, "finish_reason": "stop"}]});
        assert_eq!(&meta.finished(&Answer::from_chat(&whole, true), &s.ids)["output"], &last["output"]);
    }
}
