//! A Messages answer: the `message` object with text and `tool_use` blocks, whole or as
//! Anthropic's event stream (`message_start`, `content_block_start` / `_delta` / `_stop`,
//! `message_delta`, `message_stop`). Both come from the same [`Answer`].

use crate::api::answer::{Answer, Events, Piece, Reader, Translate};
use crate::api::{random_id, ApiError};
use serde_json::{json, Value};

/// Why the answer ended, in Anthropic's words.
fn stop_reason(a: &Answer) -> &'static str {
    match a.finish.as_str() {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        _ if a.stop.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

fn usage(a: &Answer) -> Value {
    json!({"input_tokens": a.prompt_tokens, "output_tokens": a.completion_tokens,
        "cache_read_input_tokens": a.cached_tokens, "cache_creation_input_tokens": 0})
}

/// A call's input object; arguments cut short (by `max_tokens`) give an empty one.
fn input(arguments: &str) -> Value {
    serde_json::from_str::<Value>(arguments).ok().filter(Value::is_object).unwrap_or_else(|| json!({}))
}

/// The `message` object of a finished answer.
pub fn message(id: &str, model: &str, a: &Answer) -> Value {
    let mut content = Vec::new();
    if !a.reasoning.is_empty() {
        // Anthropic signs its own thinking; a local model's has nothing to sign.
        content.push(json!({"type": "thinking", "thinking": a.reasoning, "signature": ""}));
    }
    if !a.text.is_empty() {
        content.push(json!({"type": "text", "text": a.text}));
    }
    for c in &a.calls {
        content.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input(&c.arguments)}));
    }
    json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason(a), "stop_sequence": a.stop, "usage": usage(a)})
}

/// The block open in a stream.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Open {
    Nothing,
    Thinking,
    Text,
    Call,
}

/// Tells a streamed chat completion as Anthropic's events.
pub struct MessageStream {
    id: String,
    model: String,
    prompt_tokens: usize,
    answer: Answer,
    open: Open,
    /// Index of the open block (or of the next one).
    index: usize,
    reader: Reader,
}

impl MessageStream {
    /// `thinks`: the model writes its reasoning first ([`crate::api::answer::thinks`]).
    pub fn new(model: &str, prompt_tokens: usize, thinks: bool) -> Self {
        MessageStream {
            id: random_id("msg"),
            model: model.to_owned(),
            prompt_tokens,
            answer: Answer::default(),
            open: Open::Nothing,
            index: 0,
            reader: Reader::new(thinks),
        }
    }

    fn event(out: &mut Events, name: &'static str, v: Value) {
        let mut e = json!({"type": name});
        if let (Value::Object(e), Value::Object(v)) = (&mut e, v) {
            e.extend(v);
        }
        out.push((name, e));
    }

    fn close(&mut self, out: &mut Events) {
        if self.open != Open::Nothing {
            Self::event(out, "content_block_stop", json!({"index": self.index}));
            self.index += 1;
            self.open = Open::Nothing;
        }
    }
}

impl Translate for MessageStream {
    fn start(&mut self) -> Events {
        let mut out = Vec::new();
        let mut m = message(&self.id, &self.model, &Answer { prompt_tokens: self.prompt_tokens, ..Answer::default() });
        m["stop_reason"] = Value::Null;
        Self::event(&mut out, "message_start", json!({"message": m}));
        out
    }

    fn piece(&mut self, p: Piece, out: &mut Events) {
        self.answer.apply(&p);
        match p {
            Piece::Reasoning(thinking) => {
                if self.open != Open::Thinking {
                    self.close(out);
                    self.open = Open::Thinking;
                    let block = json!({"type": "thinking", "thinking": "", "signature": ""});
                    Self::event(out, "content_block_start", json!({"index": self.index, "content_block": block}));
                }
                let delta = json!({"index": self.index, "delta": {"type": "thinking_delta", "thinking": thinking}});
                Self::event(out, "content_block_delta", delta);
            }
            Piece::Text(text) => {
                if self.open != Open::Text {
                    self.close(out);
                    self.open = Open::Text;
                    let block = json!({"index": self.index, "content_block": {"type": "text", "text": ""}});
                    Self::event(out, "content_block_start", block);
                }
                let delta = json!({"index": self.index, "delta": {"type": "text_delta", "text": text}});
                Self::event(out, "content_block_delta", delta);
            }
            Piece::CallStart { id, name, .. } => {
                self.close(out);
                self.open = Open::Call;
                let block = json!({"type": "tool_use", "id": id, "name": name, "input": {}});
                Self::event(out, "content_block_start", json!({"index": self.index, "content_block": block}));
            }
            Piece::CallArgs { delta, .. } => {
                let d = json!({"index": self.index, "delta": {"type": "input_json_delta", "partial_json": delta}});
                Self::event(out, "content_block_delta", d);
            }
            Piece::Finish(..) | Piece::Usage(_) => {}
        }
    }

    fn reader(&mut self) -> &mut Reader {
        &mut self.reader
    }

    fn end(&mut self, out: &mut Events) {
        self.close(out);
        let delta = json!({"delta": {"stop_reason": stop_reason(&self.answer), "stop_sequence": self.answer.stop},
            "usage": usage(&self.answer)});
        Self::event(out, "message_delta", delta);
        Self::event(out, "message_stop", json!({}));
    }

    fn error(&mut self, e: &ApiError) -> Events {
        let mut out = Vec::new();
        Self::event(&mut out, "error", super::error_body(e));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_blocks_add_up_to_the_message() {
        let chunks = [
            json!({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"content": "On it."}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\": "}}]}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                "finish_reason": "tool_calls"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}),
        ];
        let mut s = MessageStream::new("m", 5, false);
        let mut events = s.start();
        chunks.iter().for_each(|c| events.extend(s.chunk(c)));
        events.extend(s.done());
        let names: Vec<&str> = events.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(events[0].1["message"]["usage"]["input_tokens"], 5);
        assert_eq!(events[4].1["index"], 1);
        assert_eq!(events[8].1["delta"]["stop_reason"], "tool_use");
        let whole = message("id", "m", &s.answer);
        assert_eq!(whole["content"][1]["input"], json!({"x": 1}));
        assert_eq!(whole["content"][0]["text"], "On it.");
    }
}
