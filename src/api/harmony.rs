//! gpt-oss's harmony format read back from generated text: the `analysis` channel is the
//! reasoning, `final` (and `commentary` to no one) the answer, and a `commentary` message to
//! `functions.NAME` a tool call whose body is its arguments — whole, or as the text streams.
//!
//! A message is `[<|start|>ROLE] <|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>FORMAT]
//! <|message|>BODY` ended by `<|end|>` (another message follows), `<|call|>` or `<|return|>`.
//! The markers are special tokens of gpt-oss's vocabulary; the text read here has them
//! written out ([`MARKERS`]).

use super::tools::CallDelta;

/// Harmony's special tokens, as they are written in the text read here.
pub const MARKERS: [&str; 7] =
    ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"];

/// The markers that end a message's body.
const ENDS: [&str; 3] = ["<|end|>", "<|return|>", "<|call|>"];

/// A header longer than this is not harmony: what was held is sent as the answer.
const MAX_HEADER: usize = 512;

/// What a piece of the answer adds: reasoning, answer text, and pieces of calls.
#[derive(Debug, Default, PartialEq)]
pub struct Delta {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<CallDelta>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.calls.is_empty()
    }
}

/// Where a message's body goes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Body {
    Reasoning,
    Content,
    /// The arguments of call `index`.
    Call(usize),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Reading a message's header, up to `<|message|>`.
    Header,
    Body(Body),
    /// After `<|end|>`, until the next message starts.
    Between,
    /// After `<|call|>` or `<|return|>`: the answer is over.
    Done,
    /// The text is not harmony: all of it is the answer.
    Plain,
}

/// Reads a streamed harmony answer; text that may be the start of a marker is held back
/// until it is known.
#[derive(Debug)]
pub struct HarmonyStream {
    state: State,
    held: String,
    calls: usize,
    /// Whether any message has begun (before one has, text that is not a header is plain).
    started: bool,
}

impl Default for HarmonyStream {
    fn default() -> Self {
        HarmonyStream { state: State::Header, held: String::new(), calls: 0, started: false }
    }
}

impl HarmonyStream {
    /// Takes the next piece of text; returns what can be sent now.
    pub fn push(&mut self, piece: &str) -> Delta {
        self.held.push_str(piece);
        let mut out = Delta::default();
        loop {
            match self.state {
                State::Done => {
                    self.held.clear();
                    return out;
                }
                State::Plain => {
                    out.content.push_str(&std::mem::take(&mut self.held));
                    return out;
                }
                State::Header => {
                    if let Some(at) = self.held.find("<|message|>") {
                        let header: String = self.held.drain(..at + "<|message|>".len()).collect();
                        let body = self.open(&header[..at], &mut out);
                        (self.state, self.started) = (State::Body(body), true);
                        continue;
                    }
                    let t = self.held.trim_start();
                    let harmony = t.starts_with("<|") || "<|".starts_with(t);
                    if (!self.started && !harmony) || self.held.len() > MAX_HEADER {
                        self.state = State::Plain;
                        continue;
                    }
                    return out;
                }
                State::Body(body) => {
                    let end = ENDS.iter().filter_map(|m| self.held.find(m).map(|at| (at, *m))).min();
                    let (text, next) = match end {
                        Some((at, m)) => {
                            let text: String = self.held.drain(..at).collect();
                            self.held.drain(..m.len());
                            (text, Some(if m == "<|end|>" { State::Between } else { State::Done }))
                        }
                        None => {
                            let keep = held_back(&self.held);
                            (self.held.drain(..self.held.len() - keep).collect(), None)
                        }
                    };
                    self.emit(body, text, &mut out);
                    match next {
                        Some(s) => self.state = s,
                        None => return out,
                    }
                }
                State::Between => match ["<|start|>", "<|channel|>"].iter().filter_map(|m| self.held.find(m)).min() {
                    Some(at) => {
                        self.held.drain(..at);
                        self.state = State::Header;
                    }
                    None if self.held.len() > MAX_HEADER => self.state = State::Plain,
                    None => return out,
                },
            }
        }
    }

    /// What is still held, at the end; and whether the answer called a tool.
    pub fn finish(mut self) -> (Delta, bool) {
        let mut out = Delta::default();
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Body(body) => self.emit(body, held, &mut out),
            State::Header if !self.started => out.content = held,
            State::Plain => out.content = held,
            State::Header | State::Between | State::Done => {}
        }
        (out, self.calls > 0)
    }

    /// The body a message's `header` opens (its call's name sent, for a call).
    fn open(&mut self, header: &str, out: &mut Delta) -> Body {
        let header = header.strip_prefix("<|start|>").unwrap_or(header);
        let word_after = |key: &str| {
            header.find(key).map(|at| {
                let rest = &header[at + key.len()..];
                let end = rest.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(rest.len());
                &rest[..end]
            })
        };
        let channel = word_after("<|channel|>").unwrap_or("");
        match word_after("to=").and_then(|r| r.strip_prefix("functions.")) {
            Some(name) => {
                let index = self.calls;
                self.calls += 1;
                out.calls.push(CallDelta { index, name: Some(name.to_owned()), arguments: String::new() });
                Body::Call(index)
            }
            None if channel == "analysis" => Body::Reasoning,
            None => Body::Content,
        }
    }

    fn emit(&self, body: Body, text: String, out: &mut Delta) {
        if text.is_empty() {
            return;
        }
        match body {
            Body::Reasoning => out.reasoning.push_str(&text),
            Body::Content => out.content.push_str(&text),
            Body::Call(index) => match out.calls.last_mut() {
                Some(c) if c.index == index => c.arguments.push_str(&text),
                _ => out.calls.push(CallDelta { index, name: None, arguments: text }),
            },
        }
    }
}

/// Bytes at the end of `text` that could grow into a marker ending a body.
fn held_back(text: &str) -> usize {
    let (len, longest) = (text.len(), ENDS.iter().map(|m| m.len()).max().unwrap_or(0));
    (1..len.min(longest) + 1)
        .rev()
        .find(|&k| text.is_char_boundary(len - k) && ENDS.iter().any(|m| m.starts_with(&text[len - k..])))
        .unwrap_or(0)
}

/// A whole answer read at once: as [`HarmonyStream`] reads it streamed.
pub fn read(text: &str) -> (Delta, bool) {
    let mut s = HarmonyStream::default();
    let mut first = s.push(text);
    let (rest, called) = s.finish();
    first.reasoning.push_str(&rest.reasoning);
    first.content.push_str(&rest.content);
    for c in rest.calls {
        match first.calls.last_mut() {
            Some(last) if last.index == c.index && c.name.is_none() => last.arguments.push_str(&c.arguments),
            _ => first.calls.push(c),
        }
    }
    (first, called)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (reasoning, content, calls as (name, arguments), called) of pieces read in turn.
    fn read_pieces(pieces: &[&str]) -> (String, String, Vec<(String, String)>, bool) {
        let mut s = HarmonyStream::default();
        let mut deltas: Vec<Delta> = pieces.iter().map(|p| s.push(p)).collect();
        let (last, called) = s.finish();
        deltas.push(last);
        let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::<(String, String)>::new());
        for d in deltas {
            reasoning += &d.reasoning;
            content += &d.content;
            for c in d.calls {
                match c.name {
                    Some(n) => {
                        assert_eq!(c.index, calls.len());
                        calls.push((n, c.arguments));
                    }
                    None => calls[c.index].1 += &c.arguments,
                }
            }
        }
        (reasoning, content, calls, called)
    }

    fn cut_everywhere(text: &str) -> (String, String, Vec<(String, String)>, bool) {
        let whole = read_pieces(&[text]);
        let chars: Vec<char> = text.chars().collect();
        for size in 1..9 {
            let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(read_pieces(&refs), whole, "pieces of {size}");
        }
        let (d, called) = read(text);
        assert_eq!((d.reasoning.as_str(), d.content.as_str(), called), (whole.0.as_str(), whole.1.as_str(), whole.3));
        whole
    }

    #[test]
    fn analysis_is_reasoning_and_final_the_answer() {
        let text = "<|channel|>analysis<|message|>User asks 2+2. Easy: 4.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>";
        let (r, c, calls, called) = cut_everywhere(text);
        assert_eq!((r.as_str(), c.as_str(), calls.len(), called), ("User asks 2+2. Easy: 4.", "It is 4.", 0, false));
        // Stopped at <|return|> (the stop token is not in the text): the same.
        let cut = text.strip_suffix("<|return|>").unwrap();
        assert_eq!(cut_everywhere(cut).1, "It is 4.");
    }

    #[test]
    fn a_commentary_message_to_a_function_is_a_call() {
        for header in [
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>",
        ] {
            let text =
                format!("<|channel|>analysis<|message|>Need weather.<|end|>{header}{{\"location\":\"Paris\"}}<|call|>");
            let (r, c, calls, called) = cut_everywhere(&text);
            assert_eq!((r.as_str(), c.as_str(), called), ("Need weather.", "", true));
            assert_eq!(calls, [("get_weather".to_owned(), "{\"location\":\"Paris\"}".to_owned())]);
        }
    }

    #[test]
    fn text_that_is_not_harmony_is_the_answer() {
        assert_eq!(cut_everywhere("Just text, <|not a marker.").1, "Just text, <|not a marker.");
        assert_eq!(cut_everywhere("").1, "");
        // Cut off inside the reasoning: all of it is reasoning.
        assert_eq!(cut_everywhere("<|channel|>analysis<|message|>Thinking <|en").0, "Thinking <|en");
        // Commentary to no one (a preamble) is answer text.
        let (_, c, _, _) = cut_everywhere(
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
        );
        assert_eq!(c, "Checking.Done.");
    }
}
