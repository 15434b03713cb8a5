//! An assistant's answer as chat completions give it, read back for the APIs built on them
//! (the Responses API, Anthropic's Messages): whole from a `chat.completion` body, or piece
//! by piece from `chat.completion.chunk`s. Both end in the same [`Answer`], so a streamed
//! answer and the same answer read at once agree.

use super::ApiError;
use serde_json::Value;

/// What one chunk brought, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    /// A call opens: its index among the answer's calls, its id and name.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of a call's arguments (JSON text).
    CallArgs {
        index: usize,
        delta: String,
    },
    /// `stop`, `length` or `tool_calls`, and the stop string that ended the answer.
    Finish(String, Option<String>),
    /// The final token counts (OpenAI's `usage` object).
    Usage(Value),
}

/// The pieces of one chat chunk (of choice 0: these APIs draw one sample).
pub fn pieces(chunk: &Value) -> Vec<Piece> {
    let mut out = Vec::new();
    let Some(choice) = chunk["choices"].get(0) else {
        if chunk["usage"].is_object() {
            out.push(Piece::Usage(chunk["usage"].clone()));
        }
        return out;
    };
    let delta = &choice["delta"];
    if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
        out.push(Piece::Text(text.to_owned()));
    }
    for call in delta["tool_calls"].as_array().into_iter().flatten() {
        let index = call["index"].as_u64().unwrap_or(0) as usize;
        if let Some(name) = call["function"]["name"].as_str() {
            let id = call["id"].as_str().unwrap_or_default().to_owned();
            out.push(Piece::CallStart { index, id, name: name.to_owned() });
        }
        if let Some(args) = call["function"]["arguments"].as_str().filter(|a| !a.is_empty()) {
            out.push(Piece::CallArgs { index, delta: args.to_owned() });
        }
    }
    if let Some(f) = choice["finish_reason"].as_str() {
        out.push(Piece::Finish(f.to_owned(), choice["stop_reason"].as_str().map(str::to_owned)));
    }
    out
}

/// A call the model made.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// JSON text, as generated (cut short when the answer was).
    pub arguments: String,
}

/// The whole answer: text, calls, why it ended, and the token counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    pub text: String,
    pub calls: Vec<Call>,
    /// Chat's `finish_reason`: `stop`, `length` or `tool_calls`.
    pub finish: String,
    /// The stop string that ended the answer, if one did.
    pub stop: Option<String>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

impl Answer {
    /// Adds one piece.
    pub fn apply(&mut self, piece: &Piece) {
        match piece {
            Piece::Text(t) => self.text.push_str(t),
            Piece::CallStart { id, name, .. } => {
                self.calls.push(Call { id: id.clone(), name: name.clone(), arguments: String::new() })
            }
            Piece::CallArgs { index, delta } => {
                if let Some(c) = self.calls.get_mut(*index) {
                    c.arguments.push_str(delta);
                }
            }
            Piece::Finish(f, stop) => (self.finish, self.stop) = (f.clone(), stop.clone()),
            Piece::Usage(u) => {
                let count = |v: &Value| v.as_u64().unwrap_or(0) as usize;
                self.prompt_tokens = count(&u["prompt_tokens"]);
                self.completion_tokens = count(&u["completion_tokens"]);
                self.cached_tokens = count(&u["prompt_tokens_details"]["cached_tokens"]);
            }
        }
    }

    /// The answer of a non-streaming `chat.completion` body.
    pub fn from_chat(body: &Value) -> Self {
        let mut a = Answer::default();
        let choice = &body["choices"][0];
        let message = &choice["message"];
        if let Some(t) = message["content"].as_str() {
            a.text = t.to_owned();
        }
        for (index, c) in message["tool_calls"].as_array().into_iter().flatten().enumerate() {
            let name = c["function"]["name"].as_str().unwrap_or_default().to_owned();
            a.apply(&Piece::CallStart { index, id: c["id"].as_str().unwrap_or_default().to_owned(), name });
            let delta = c["function"]["arguments"].as_str().unwrap_or_default().to_owned();
            a.apply(&Piece::CallArgs { index, delta });
        }
        a.finish = choice["finish_reason"].as_str().unwrap_or("stop").to_owned();
        a.stop = choice["stop_reason"].as_str().map(str::to_owned);
        a.apply(&Piece::Usage(body["usage"].clone()));
        a
    }

    /// Whether generation stopped at `max_tokens` (or the context's end).
    pub fn cut_off(&self) -> bool {
        self.finish == "length"
    }
}

/// Named server-sent events (`event: NAME`, `data: JSON`).
pub type Events = Vec<(&'static str, Value)>;

/// Tells a streamed chat completion in another API's events.
pub trait Translate: Send {
    /// Before any chunk.
    fn start(&mut self) -> Events;
    /// One piece of the answer.
    fn piece(&mut self, p: Piece, out: &mut Events);
    /// One `chat.completion.chunk` (or the final usage chunk).
    fn chunk(&mut self, chunk: &Value) -> Events {
        let mut out = Vec::new();
        for p in pieces(chunk) {
            self.piece(p, &mut out);
        }
        out
    }
    /// After the last chunk.
    fn done(&mut self) -> Events;
    /// The stream failed after it began.
    fn error(&mut self, e: &ApiError) -> Events;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The same answer, whole and as chunks, reads the same.
    #[test]
    fn streamed_and_whole_agree() {
        let whole = json!({"choices": [{"message": {"content": "Let me see.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 2}}});
        let chunks = [
            json!({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"content": "Let me"}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"content": " see."}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\""}}]}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                "finish_reason": null}]}),
            json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
            json!({"choices": [], "usage": whole["usage"]}),
        ];
        let mut streamed = Answer::default();
        chunks.iter().flat_map(pieces).for_each(|p| streamed.apply(&p));
        assert_eq!(streamed, Answer::from_chat(&whole));
        assert_eq!((streamed.calls[0].arguments.as_str(), streamed.cached_tokens), ("{\"x\": 1}", 2));
        assert!(pieces(&chunks[0]).is_empty());
    }
}
