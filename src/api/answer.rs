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
    /// A thinking model's reasoning (what it wrote inside `<think>…</think>`, or in
    /// harmony's analysis channel: the chunks' `reasoning_content`).
    Reasoning(String),
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
    if let Some(text) = delta["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
        out.push(Piece::Reasoning(text.to_owned()));
    }
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

/// Whether a model thinks before it answers, writing `<think>…</think>` first (Qwen3,
/// DeepSeek-R1's distills): its chat template knows the closing tag.
pub fn thinks(template: Option<&str>) -> bool {
    template.is_some_and(|t| t.contains("</think>"))
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Where a thinking model's text is.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum Think {
    /// Nothing but whitespace yet: a `<think>` may still open.
    #[default]
    Start,
    /// The reasoning; `trim`: the whitespace after `<think>` is still being dropped.
    Inside { trim: bool },
    /// The answer; `trim`: the whitespace after `</think>` is still being dropped.
    After { trim: bool },
}

/// Splits a thinking model's text into its reasoning and its answer as the text streams:
/// text that could still be the start of a tag is held back until it is known.
#[derive(Debug, Default)]
pub struct Thinking {
    state: Think,
    held: String,
}

impl Thinking {
    /// The pieces that `text` completes.
    pub fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.held.push_str(text);
        loop {
            match self.state {
                Think::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_owned();
                        self.state = Think::Inside { trim: true };
                    } else if OPEN.starts_with(t) {
                        return;
                    } else {
                        self.state = Think::After { trim: false };
                    }
                }
                Think::Inside { trim } => {
                    if trim {
                        self.held = self.held.trim_start().to_owned();
                        if self.held.is_empty() {
                            return;
                        }
                        self.state = Think::Inside { trim: false };
                    }
                    if let Some(at) = self.held.find(CLOSE) {
                        let reasoning: String = self.held.drain(..at + CLOSE.len()).collect();
                        emit(out, Piece::Reasoning(reasoning[..at].to_owned()));
                        self.state = Think::After { trim: true };
                        continue;
                    }
                    // Hold back a tail that could grow into the closing tag.
                    let len = self.held.len();
                    let keep = (1..CLOSE.len().min(len + 1))
                        .rev()
                        .find(|&k| self.held.is_char_boundary(len - k) && CLOSE.starts_with(&self.held[len - k..]))
                        .unwrap_or(0);
                    emit(out, Piece::Reasoning(self.held.drain(..len - keep).collect()));
                    return;
                }
                Think::After { trim } => {
                    let text = if trim { self.held.trim_start() } else { &self.held };
                    if !text.is_empty() {
                        self.state = Think::After { trim: false };
                    }
                    emit(out, Piece::Text(text.to_owned()));
                    self.held.clear();
                    return;
                }
            }
        }
    }

    /// `text` split into (reasoning, answer) as far as it can be yet; with `last`, all of
    /// it, nothing held back (this splitter is then spent).
    pub fn split(&mut self, text: &str, last: bool) -> (String, String) {
        let mut pieces = Vec::new();
        self.push(text, &mut pieces);
        if last {
            self.finish(&mut pieces);
        }
        let (mut reasoning, mut answer) = (String::new(), String::new());
        for p in pieces {
            match p {
                Piece::Reasoning(r) => reasoning += &r,
                Piece::Text(t) => answer += &t,
                _ => {}
            }
        }
        (reasoning, answer)
    }

    /// What is still held back, at the end.
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        let held = std::mem::take(&mut self.held);
        match self.state {
            Think::Start | Think::After { trim: false } => emit(out, Piece::Text(held)),
            Think::Inside { .. } => emit(out, Piece::Reasoning(held)),
            Think::After { trim: true } => emit(out, Piece::Text(held.trim_start().to_owned())),
        }
    }
}

/// Adds a text or reasoning piece unless it is empty.
fn emit(out: &mut Vec<Piece>, p: Piece) {
    if !matches!(&p, Piece::Text(t) | Piece::Reasoning(t) if t.is_empty()) {
        out.push(p);
    }
}

/// Reads a streamed answer's chunks into pieces, reasoning split from text when the model
/// thinks.
#[derive(Debug, Default)]
pub struct Reader {
    thinking: Option<Thinking>,
}

impl Reader {
    pub fn new(thinks: bool) -> Self {
        Reader { thinking: thinks.then(Thinking::default) }
    }

    pub fn read(&mut self, chunk: &Value) -> Vec<Piece> {
        let mut out = Vec::new();
        for p in pieces(chunk) {
            match (p, &mut self.thinking) {
                (Piece::Text(t), Some(th)) => th.push(&t, &mut out),
                (p, _) => out.push(p),
            }
        }
        out
    }

    /// The text held back, at the end.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if let Some(th) = &mut self.thinking {
            th.finish(&mut out);
        }
        out
    }
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
    /// A thinking model's reasoning.
    pub reasoning: String,
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
            Piece::Reasoning(t) => self.reasoning.push_str(t),
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

    /// The answer of a non-streaming `chat.completion` body; a thinking model's reasoning
    /// is split from its text as [`Reader`] splits it streamed.
    pub fn from_chat(body: &Value, thinks: bool) -> Self {
        let mut a = Answer::default();
        let choice = &body["choices"][0];
        let message = &choice["message"];
        if let Some(t) = message["reasoning_content"].as_str() {
            a.apply(&Piece::Reasoning(t.to_owned()));
        }
        if let Some(t) = message["content"].as_str() {
            let mut split = Vec::new();
            match thinks {
                true => {
                    let mut th = Thinking::default();
                    th.push(t, &mut split);
                    th.finish(&mut split);
                }
                false => split.push(Piece::Text(t.to_owned())),
            }
            split.iter().for_each(|p| a.apply(p));
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
    /// What reads the chunks into pieces.
    fn reader(&mut self) -> &mut Reader;
    /// One piece of the answer.
    fn piece(&mut self, p: Piece, out: &mut Events);
    /// After the last piece.
    fn end(&mut self, out: &mut Events);
    /// One `chat.completion.chunk` (or the final usage chunk).
    fn chunk(&mut self, chunk: &Value) -> Events {
        let mut out = Vec::new();
        for p in self.reader().read(chunk) {
            self.piece(p, &mut out);
        }
        out
    }
    /// After the last chunk.
    fn done(&mut self) -> Events {
        let mut out = Vec::new();
        for p in self.reader().finish() {
            self.piece(p, &mut out);
        }
        self.end(&mut out);
        out
    }
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
        assert_eq!(streamed, Answer::from_chat(&whole, false));
        assert_eq!((streamed.calls[0].arguments.as_str(), streamed.cached_tokens), ("{\"x\": 1}", 2));
        assert!(pieces(&chunks[0]).is_empty());
    }

    /// Reasoning the chat API already split off (`reasoning_content`, harmony's analysis
    /// channel) reads the same whole and streamed.
    #[test]
    fn reasoning_content_is_reasoning() {
        let whole = json!({"choices": [{"message": {"content": "4.", "reasoning_content": "2 + 2"},
            "finish_reason": "stop"}], "usage": {}});
        let chunks = [
            json!({"choices": [{"delta": {"reasoning_content": "2 +"}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"reasoning_content": " 2"}, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"content": "4."}, "finish_reason": "stop"}]}),
        ];
        let mut streamed = Answer::default();
        chunks.iter().flat_map(pieces).for_each(|p| streamed.apply(&p));
        assert_eq!(streamed, Answer::from_chat(&whole, false));
        assert_eq!((streamed.reasoning.as_str(), streamed.text.as_str()), ("2 + 2", "4."));
    }

    /// A thinking model's text, cut anywhere, splits as it does whole; a text without a
    /// `<think>` is all answer, and a cut-off one all reasoning.
    #[test]
    fn reasoning_splits_wherever_the_text_is_cut() {
        let split = |pieces: &[&str]| {
            let (mut th, mut out) = (Thinking::default(), Vec::new());
            pieces.iter().for_each(|p| th.push(p, &mut out));
            th.finish(&mut out);
            let mut a = Answer::default();
            out.iter().for_each(|p| a.apply(p));
            (a.reasoning, a.text)
        };
        let text = "<think>\nLet me add: 2 + 2 < 5.\n</think>\n\nIt is 4.";
        let whole = split(&[text]);
        assert_eq!(whole, ("Let me add: 2 + 2 < 5.\n".to_owned(), "It is 4.".to_owned()));
        let chars: Vec<char> = text.chars().collect();
        for size in 1..8 {
            let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
            assert_eq!(split(&pieces.iter().map(String::as_str).collect::<Vec<_>>()), whole, "pieces of {size}");
        }
        assert_eq!(split(&["<thi", "s is text"]), (String::new(), "<this is text".to_owned()));
        assert_eq!(split(&["<think>cut off</th"]), ("cut off</th".to_owned(), String::new()));
        assert_eq!(split(&["  plain"]), (String::new(), "  plain".to_owned()));
    }
}
