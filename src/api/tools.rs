//! Tool calling: the request's `tools` and `tool_choice`, the model family's tool-call format
//! (read off its chat template), the grammar that enforces a call when one is required, and
//! the parser that turns generated text back into OpenAI `tool_calls` — whole, or as a
//! stream in which ordinary text flows until a call begins.

use super::ApiError;
use crate::grammar::Grammar;
use serde::Deserialize;
use serde_json::{json, value::RawValue, Value};

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// Hermes / Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, repeated.
    Hermes,
    /// Llama 3.x: the whole answer is `{"name": ..., "parameters": {...}}` (after an optional
    /// `<|python_tag|>`).
    Llama3Json,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
    Mistral,
    /// weft's own, for templates with no tool format: Hermes' call blocks, taught by a
    /// system message weft writes ([`GENERIC_INSTRUCTION`]) and enforced by a grammar.
    Generic,
    /// gpt-oss's harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json
    /// <|message|>{...}<|call|>`, read by [`super::harmony`] with the channels.
    Harmony,
}

/// The system message's part that teaches a model with no tool format of its own to call
/// tools; the tools follow it, one JSON object per line.
pub const GENERIC_INSTRUCTION: &str = "You can call the functions listed below. To call one, reply with \
nothing but\n<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<its arguments>}}\n</tool_call>\n\
(one such block per call). Otherwise, answer in plain text.\n\nFunctions:";

impl ToolFormat {
    /// The format a chat template writes assistant tool calls in, if it is one of these.
    pub fn detect(template: &str) -> Option<Self> {
        if template.contains("<|channel|>") && template.contains("<|message|>") {
            Some(ToolFormat::Harmony)
        } else if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if template.contains("\"parameters\"") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The text that opens a call (for Llama 3, the `{` that opens the answer).
    pub fn marker(self) -> &'static str {
        match self {
            ToolFormat::Hermes | ToolFormat::Generic => "<tool_call>",
            ToolFormat::Mistral => "[TOOL_CALLS]",
            ToolFormat::Llama3Json => "<|python_tag|>",
            ToolFormat::Harmony => "<|channel|>",
        }
    }

    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        }
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Mode(String),
            Named { function: Named },
        }
        #[derive(Deserialize)]
        struct Named {
            name: String,
        }
        match Raw::deserialize(d)? {
            Raw::Mode(m) => match m.as_str() {
                "none" => Ok(ToolChoice::None),
                "auto" => Ok(ToolChoice::Auto),
                "required" => Ok(ToolChoice::Required),
                other => Err(serde::de::Error::custom(format!(
                    "unknown tool_choice {other:?} (expected none, auto, required or a named function)"
                ))),
            },
            Raw::Named { function } => Ok(ToolChoice::Named(function.name)),
        }
    }
}

/// One entry of `tools`: `{"type": "function", "function": {name, description, parameters}}`.
#[derive(Debug, Clone, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: Function,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Function {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Value>,
}

impl Tool {
    /// The tool as a chat template sees it (transformers passes the JSON schema form).
    pub fn to_value(&self) -> Value {
        let mut f = json!({"name": self.function.name});
        if let Some(d) = &self.function.description {
            f["description"] = d.clone().into();
        }
        f["parameters"] =
            self.function.parameters.clone().unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        json!({"type": "function", "function": f})
    }
}

/// A request's tools, checked against each other and the model's format.
#[derive(Debug, Clone)]
pub struct Tools {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Several calls in one answer.
    pub parallel: bool,
    pub format: Option<ToolFormat>,
}

/// A parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments object, as JSON text (what OpenAI sends).
    pub arguments: String,
}

impl Tools {
    pub fn new(
        tools: Vec<Tool>,
        choice: Option<ToolChoice>,
        parallel: Option<bool>,
        template: Option<&str>,
    ) -> Result<Self, ApiError> {
        let bad = |m: String| ApiError::invalid(m, Some("tools"));
        if let Some(t) = tools.iter().find(|t| t.kind != "function") {
            return Err(bad(format!("tool type {:?} is not supported (only \"function\")", t.kind)));
        }
        let choice = choice.unwrap_or(if tools.is_empty() { ToolChoice::None } else { ToolChoice::Auto });
        match &choice {
            ToolChoice::Required if tools.is_empty() => {
                return Err(ApiError::invalid("tool_choice \"required\" needs tools", Some("tool_choice")))
            }
            ToolChoice::Named(n) if !tools.iter().any(|t| &t.function.name == n) => {
                return Err(ApiError::invalid(
                    format!("tool_choice names {n:?}, which is not in tools"),
                    Some("tool_choice"),
                ))
            }
            _ => {}
        }
        // A template with no tool format gets weft's.
        let format =
            template.and_then(ToolFormat::detect).or_else(|| (!tools.is_empty()).then_some(ToolFormat::Generic));
        Ok(Tools { tools, choice, parallel: parallel.unwrap_or(true), format })
    }

    /// The tools as the template sees them (none when there are none, or when weft writes
    /// them into the messages itself).
    pub fn template_tools(&self) -> Option<Vec<Value>> {
        let own = self.format == Some(ToolFormat::Generic);
        (!self.tools.is_empty() && !own).then(|| self.tools.iter().map(Tool::to_value).collect())
    }

    /// The messages as the template is given them. With weft's own format (and tools in
    /// use), the tools and [`GENERIC_INSTRUCTION`] go into the system message, earlier
    /// calls into their assistant message's text, and tool results into user messages, so
    /// that a template that knows nothing of tools renders the whole conversation.
    pub fn template_messages(&self, mut messages: Vec<Value>) -> Vec<Value> {
        if self.format != Some(ToolFormat::Generic) {
            return messages;
        }
        for m in &mut messages {
            if let Some(calls) = m.as_object_mut().and_then(|o| o.remove("tool_calls")) {
                let blocks: Vec<String> = calls
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| {
                        let call = json!({"name": c["function"]["name"], "arguments": c["function"]["arguments"]});
                        format!("<tool_call>\n{}\n</tool_call>", python_json(&call))
                    })
                    .collect();
                let text = m["content"].as_str().unwrap_or_default();
                let text = if text.is_empty() { blocks.join("\n") } else { format!("{text}\n{}", blocks.join("\n")) };
                m["content"] = text.into();
            }
            if m["role"] == "tool" {
                let result = m["content"].as_str().unwrap_or_default();
                *m = json!({"role": "user", "content": format!("<tool_response>\n{result}\n</tool_response>")});
            }
        }
        if self.choice == ToolChoice::None {
            return messages;
        }
        let listed: Vec<String> = self.tools.iter().map(|t| python_json(&t.to_value()["function"])).collect();
        let instruction = format!("{GENERIC_INSTRUCTION}\n{}", listed.join("\n"));
        match messages.first_mut() {
            Some(m) if m["role"] == "system" || m["role"] == "developer" => {
                let text = m["content"].as_str().unwrap_or_default();
                m["content"] = if text.is_empty() { instruction } else { format!("{text}\n\n{instruction}") }.into();
            }
            _ => messages.insert(0, json!({"role": "system", "content": instruction})),
        }
        messages
    }

    /// Whether generated text is read for calls.
    pub fn parses(&self) -> Option<ToolFormat> {
        self.format.filter(|_| self.choice != ToolChoice::None)
    }

    /// For `required` and a named function: the grammar of the format's calls, each a JSON
    /// object whose name is one of the allowed tools and whose arguments follow its schema.
    /// With weft's own format, `auto` too: plain text with no call in it, or calls only.
    pub fn grammar(&self) -> Option<Grammar> {
        let format = self.format?;
        let allowed: Vec<&Tool> = match &self.choice {
            ToolChoice::None => return None,
            ToolChoice::Auto if format != ToolFormat::Generic => return None,
            ToolChoice::Auto => self.tools.iter().collect(),
            ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Named(n) => self.tools.iter().filter(|t| &t.function.name == n).collect(),
        };
        let key = format.arguments_key();
        let calls: Vec<Value> = allowed
            .iter()
            .map(|t| {
                let params = t.function.parameters.clone().unwrap_or_else(|| json!({"type": "object"}));
                json!({"type": "object", "properties": {"name": {"const": t.function.name}, key: params},
                    "required": ["name", key], "additionalProperties": false})
            })
            .collect();
        // Laid out as the templates render calls (Python's json.dumps): ", " and ": ", no
        // other whitespace.
        let layout = json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false});
        let call = json!({"anyOf": calls, "x-guidance": layout});
        // One call, or (parallel) several where the format allows them.
        let many = self.parallel && !matches!(self.choice, ToolChoice::Named(_));
        let lark = match format {
            ToolFormat::Hermes | ToolFormat::Generic => {
                let rep = if many { " (\"\\n\" call)*" } else { "" };
                let calls = format!("calls: call{rep}\ncall: \"<tool_call>\\n\" %json {call} \"\\n</tool_call>\"");
                if self.choice == ToolChoice::Auto {
                    // Text that holds no call marker anywhere, so a call is always a whole one.
                    format!("start: TEXT | calls\nTEXT: /(?s:.+)&~((?s:.*)<tool_call>(?s:.*))/\n{calls}")
                } else {
                    format!("start: calls\n{calls}")
                }
            }
            ToolFormat::Llama3Json => format!("start: %json {call}"),
            ToolFormat::Harmony => {
                // A commentary message to one of the allowed functions, its body the
                // arguments (the name is in the header, not in the JSON).
                let one = |t: &&Tool| {
                    let params = t.function.parameters.clone().unwrap_or_else(|| json!({"type": "object"}));
                    let name = serde_json::to_string(&format!(
                        "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>",
                        t.function.name
                    ))
                    .expect("a string serializes");
                    format!("{name} %json {}", json!({"anyOf": [params], "x-guidance": layout}))
                };
                format!("start: {}", allowed.iter().map(one).collect::<Vec<_>>().join(" | "))
            }
            ToolFormat::Mistral => {
                let max = if many { json!(null) } else { json!(1) };
                let mut list = json!({"type": "array", "items": call, "minItems": 1});
                if !max.is_null() {
                    list["maxItems"] = max;
                }
                format!("start: \"[TOOL_CALLS]\" %json {list}")
            }
        };
        Some(Grammar::Lark(lark))
    }
}

/// JSON laid out as Python's `json.dumps` writes it (", " and ": "), the layout the call
/// grammar allows and chat templates show calls in.
fn python_json(v: &Value) -> String {
    struct Spaced;
    impl serde_json::ser::Formatter for Spaced {
        fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Spaced);
    serde::Serialize::serialize(v, &mut ser).expect("a JSON value serializes");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// Reads calls out of a whole answer: the text before the first call, and the calls; `None`
/// when the text holds no well-formed call (then it is all content).
/// A whole answer's content and calls as [`ToolStream`] sends them: the same as [`parse`]
/// for complete calls, and for an answer cut off inside a call (by `max_tokens`), the calls
/// opened so far with the arguments generated so far, so that the answer read at once
/// agrees with the same answer streamed.
pub fn read_answer(format: ToolFormat, text: &str) -> Option<(String, Vec<ToolCall>)> {
    if let Some(whole) = parse(format, text) {
        return Some(whole);
    }
    let mut stream = ToolStream::new(format);
    let first = stream.push(text);
    let (last, calls) = stream.finish();
    if !calls {
        return None;
    }
    let mut out: Vec<ToolCall> = Vec::new();
    for d in first.calls.into_iter().chain(last.calls) {
        if d.index == out.len() {
            out.push(ToolCall { name: d.name.unwrap_or_default(), arguments: String::new() });
        }
        out[d.index].arguments.push_str(&d.arguments);
    }
    Some((first.content + &last.content, out))
}

pub fn parse(format: ToolFormat, text: &str) -> Option<(String, Vec<ToolCall>)> {
    // Arguments are kept as the model wrote them, as the stream sends them.
    type Object<'a> = std::collections::HashMap<String, &'a RawValue>;
    let call = |v: &Object| -> Option<ToolCall> {
        let name = serde_json::from_str(v.get("name")?.get()).ok()?;
        let arguments = match v.get(format.arguments_key()).or_else(|| v.get("arguments")) {
            None => "{}".to_owned(),
            Some(raw) if raw.get().starts_with('"') => serde_json::from_str(raw.get()).ok()?,
            Some(raw) => raw.get().to_owned(),
        };
        Some(ToolCall { name, arguments })
    };
    match format {
        // Read with its channels by `api::harmony`, not here.
        ToolFormat::Harmony => None,
        ToolFormat::Hermes | ToolFormat::Generic => {
            let start = text.find("<tool_call>")?;
            let mut calls = Vec::new();
            let parts: Vec<&str> = text[start..].split("<tool_call>").skip(1).collect();
            for (i, part) in parts.iter().enumerate() {
                let closed = part.contains("</tool_call>");
                let body = part.split("</tool_call>").next().unwrap_or("").trim();
                match serde_json::from_str::<Object>(body).ok().and_then(|v| call(&v)) {
                    Some(c) => calls.push(c),
                    // A last call cut off (max_tokens) after complete ones is left out.
                    None if !closed && i + 1 == parts.len() && !calls.is_empty() => {}
                    None => return None,
                }
            }
            Some((text[..start].trim().to_owned(), calls))
        }
        ToolFormat::Llama3Json => {
            let body = text.trim_start();
            let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
            if !body.starts_with('{') {
                return None;
            }
            let v: Object = serde_json::from_str(body).ok()?;
            Some((String::new(), vec![call(&v)?]))
        }
        ToolFormat::Mistral => {
            let start = text.find("[TOOL_CALLS]")?;
            let body = text[start + "[TOOL_CALLS]".len()..].trim();
            let list: Vec<Object> = serde_json::from_str(body).ok()?;
            let calls = list.iter().map(call).collect::<Option<Vec<_>>>()?;
            Some((text[..start].trim().to_owned(), calls))
        }
    }
}

/// What a streamed answer sends next: content, and pieces of calls.
#[derive(Debug, Default, PartialEq)]
pub struct Delta {
    pub content: String,
    pub calls: Vec<CallDelta>,
}

/// A piece of call `index`: its opening (id and name) the first time, then arguments text.
#[derive(Debug, PartialEq)]
pub struct CallDelta {
    pub index: usize,
    pub name: Option<String>,
    pub arguments: String,
}

impl CallDelta {
    /// The OpenAI `tool_calls` delta entry (the id goes with the name, once).
    pub fn to_json(&self, format: ToolFormat) -> Value {
        let mut d = json!({"index": self.index, "function": {"arguments": self.arguments}});
        if let Some(name) = &self.name {
            d["id"] = call_id(format).into();
            d["type"] = "function".into();
            d["function"]["name"] = name.clone().into();
        }
        d
    }
}

/// A streamed answer read for calls, as OpenAI streams them: text flows out as content until
/// a call may have begun (the format's marker, or for Llama 3 a `{` opening the answer); from
/// there a call opens once its name is complete and its arguments follow as they are
/// generated. At the end the whole call text is parsed; if it held no call after all and
/// none was opened, it is content.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    /// Text not yet sent: a possible start of the marker, or everything from a call on.
    held: String,
    in_call: bool,
    /// Llama 3: the answer began with text, so it holds no call.
    text_only: bool,
    /// Per opened call, the bytes of its arguments sent so far.
    sent: Vec<usize>,
    /// The call text read so far (from the start of `held` once in a call).
    scanner: Scanner,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> Self {
        ToolStream {
            format,
            held: String::new(),
            in_call: false,
            text_only: false,
            sent: Vec::new(),
            scanner: Scanner::default(),
        }
    }

    /// Takes the next piece of text; returns what can be sent now.
    pub fn push(&mut self, piece: &str) -> Delta {
        self.held.push_str(piece);
        if self.in_call {
            return Delta { content: String::new(), calls: self.call_deltas() };
        }
        let content = self.read_content();
        let calls = if self.in_call { self.call_deltas() } else { Vec::new() };
        Delta { content, calls }
    }

    /// Before any call: the content that is surely not the start of one.
    fn read_content(&mut self) -> String {
        let marker = self.format.marker();
        if self.format == ToolFormat::Llama3Json {
            if self.text_only {
                return std::mem::take(&mut self.held);
            }
            let t = self.held.trim_start();
            if t.starts_with('{') || t.starts_with(marker) {
                self.in_call = true;
            } else if !t.is_empty() && !marker.starts_with(t) {
                self.text_only = true;
                return std::mem::take(&mut self.held);
            }
            return String::new();
        }
        if let Some(at) = self.held.find(marker) {
            self.in_call = true;
            return self.held.drain(..at).collect();
        }
        // Hold back a tail that could still grow into the marker.
        let len = self.held.len();
        let keep = (1..marker.len().min(len + 1))
            .rev()
            .find(|&k| self.held.is_char_boundary(len - k) && marker.starts_with(&self.held[len - k..]))
            .unwrap_or(0);
        self.held.drain(..len - keep).collect()
    }

    /// Calls opened and arguments grown since the last push.
    fn call_deltas(&mut self) -> Vec<CallDelta> {
        let mut out = Vec::new();
        self.scanner.advance(&self.held);
        // Calls whose arguments are all sent are skipped.
        let settled = self.sent.len().saturating_sub(1);
        for (index, call) in self.scanner.calls.iter().enumerate().skip(settled) {
            let Some(name) = &call.name else { break };
            let opened = index < self.sent.len();
            if !opened {
                self.sent.push(0);
            }
            let arguments = match call.args {
                Some((start, end)) => {
                    let from = start + self.sent[index];
                    let to = end.unwrap_or(self.held.len());
                    self.held.get(from..to).unwrap_or("").to_owned()
                }
                None => String::new(),
            };
            self.sent[index] += arguments.len();
            if !opened || !arguments.is_empty() {
                out.push(CallDelta { index, name: (!opened).then(|| name.clone()), arguments });
            }
        }
        out
    }

    /// At the end: the content still held and the rest of the calls. Returns whether the
    /// answer held calls.
    pub fn finish(mut self) -> (Delta, bool) {
        if !self.in_call {
            return (Delta { content: self.held, calls: Vec::new() }, false);
        }
        let mut out = Delta::default();
        match parse(self.format, &self.held) {
            Some((content, calls)) => {
                out.content = content;
                for (index, c) in calls.into_iter().enumerate() {
                    let opened = index < self.sent.len();
                    let sent = self.sent.get(index).copied().unwrap_or(0);
                    let arguments = c.arguments.get(sent..).unwrap_or("").to_owned();
                    if !opened || !arguments.is_empty() {
                        out.calls.push(CallDelta { index, name: (!opened).then_some(c.name), arguments });
                    }
                }
                (out, true)
            }
            // Calls already opened stand (a cut-off answer); otherwise it was all text.
            None if !self.sent.is_empty() => (out, true),
            None => (Delta { content: std::mem::take(&mut self.held), calls: Vec::new() }, false),
        }
    }
}

/// One call object found in call text so far: its name once that string is complete, and
/// the byte range of its arguments object (the end once the object has closed).
#[derive(Debug, Default)]
struct Scanned {
    name: Option<String>,
    args: Option<(usize, Option<usize>)>,
}

/// Finds the call objects in growing call text — each `{...}` outside any object — and, in
/// each, the `name` string and the `arguments` / `parameters` object. Enough of JSON's
/// syntax to stream a call's arguments as they are generated; the whole answer is still
/// parsed by serde_json at the end. It resumes where it stopped (at most at the start of
/// a string not yet closed), so each piece of text is read about once.
#[derive(Debug, Default)]
struct Scanner {
    /// Where reading resumes.
    pos: usize,
    depth: usize,
    /// At depth 1: whether the next string is a key, and the key whose value comes next.
    at_key: bool,
    key: Option<String>,
    calls: Vec<Scanned>,
}

impl Scanner {
    /// Reads `text` (what was read before, with more after it) as far as it is complete.
    fn advance(&mut self, text: &str) {
        let b = text.as_bytes();
        while self.pos < b.len() {
            let i = self.pos;
            match b[i] {
                b'"' => {
                    let mut j = i + 1;
                    while j < b.len() && b[j] != b'"' {
                        j += if b[j] == b'\\' { 2 } else { 1 };
                    }
                    if j >= b.len() {
                        // The string is not closed yet: read it again when it is.
                        return;
                    }
                    if self.depth == 1 {
                        let s = &text[i..=j];
                        if self.at_key {
                            self.key = serde_json::from_str(s).ok();
                            self.at_key = false;
                        } else if self.key.as_deref() == Some("name") {
                            if let Some(c) = self.calls.last_mut() {
                                c.name = serde_json::from_str(s).ok();
                            }
                        }
                    }
                    self.pos = j;
                }
                b'{' if self.depth == 0 => {
                    self.calls.push(Scanned::default());
                    (self.depth, self.at_key, self.key) = (1, true, None);
                }
                b'{' if self.depth == 1 && matches!(self.key.as_deref(), Some("arguments" | "parameters")) => {
                    if let Some(c) = self.calls.last_mut() {
                        c.args = Some((i, None));
                    }
                    self.depth = 2;
                }
                b'{' | b'[' if self.depth > 0 => self.depth += 1,
                b'}' | b']' if self.depth > 0 => {
                    self.depth -= 1;
                    if self.depth == 1 {
                        if let Some(Scanned { args: Some((_, end @ None)), .. }) = self.calls.last_mut() {
                            *end = Some(i + 1);
                        }
                    }
                }
                b',' if self.depth == 1 => (self.at_key, self.key) = (true, None),
                _ => {}
            }
            self.pos += 1;
        }
    }
}

/// An id for a call: Mistral's templates insist on nine alphanumerics; others get OpenAI's shape.
pub fn call_id(format: ToolFormat) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    let alnum = |rng: &mut rand::rngs::ThreadRng, n: usize| -> String {
        (0..n).map(|_| rng.sample(rand::distr::Alphanumeric) as char).collect()
    };
    match format {
        ToolFormat::Mistral => alnum(&mut rng, 9),
        _ => format!("call_{}", alnum(&mut rng, 24)),
    }
}

/// The OpenAI `tool_calls` array of a message.
pub fn tool_calls_json(format: ToolFormat, calls: &[ToolCall]) -> Value {
    Value::Array(
        calls
            .iter()
            .map(|c| json!({"id": call_id(format), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_parses() {
        let (content, calls) =
            parse(ToolFormat::Hermes, "Let me look.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>")
                .unwrap();
        assert_eq!(content, "Let me look.");
        assert_eq!(
            calls,
            vec![
                ToolCall { name: "f".into(), arguments: "{\"x\": 1}".into() },
                ToolCall { name: "g".into(), arguments: "{}".into() }
            ]
        );
        let (_, calls) =
            parse(ToolFormat::Llama3Json, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": \"b\"}}").unwrap();
        assert_eq!(calls[0].arguments, "{\"a\": \"b\"}");
        let (_, calls) = parse(ToolFormat::Mistral, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]").unwrap();
        assert_eq!(calls[0].name, "f");
        assert!(parse(ToolFormat::Hermes, "no call here").is_none());
        assert!(parse(ToolFormat::Llama3Json, "Paris.").is_none());
        assert!(parse(ToolFormat::Hermes, "<tool_call>\n{broken").is_none());
        let cut = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"na";
        assert_eq!(parse(ToolFormat::Hermes, cut).unwrap().1.len(), 1);
    }

    /// Streams `pieces`; returns the content, the calls put together from their deltas, and
    /// how many deltas carried arguments.
    fn stream(format: ToolFormat, pieces: &[&str]) -> (String, Vec<ToolCall>, usize) {
        let mut s = ToolStream::new(format);
        let mut deltas: Vec<Delta> = pieces.iter().map(|p| s.push(p)).collect();
        deltas.push(s.finish().0);
        let (mut text, mut calls, mut pieces) = (String::new(), Vec::<ToolCall>::new(), 0);
        for d in deltas {
            text += &d.content;
            for c in d.calls {
                if let Some(name) = c.name {
                    assert_eq!(c.index, calls.len(), "calls open in order");
                    calls.push(ToolCall { name, arguments: String::new() });
                }
                pieces += usize::from(!c.arguments.is_empty());
                calls[c.index].arguments += &c.arguments;
            }
        }
        (text, calls, pieces)
    }

    #[test]
    fn arguments_stream_as_they_are_generated() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"s\": \"a}\\\"b\", \"l\": [1, {\"x\": 2}]}}\n</tool_call>\n<tool_call>\n{\"arguments\": {\"y\": 3}, \"name\": \"g\"}\n</tool_call>";
        let whole = parse(ToolFormat::Hermes, text).unwrap().1;
        assert_eq!(whole[0].arguments, "{\"s\": \"a}\\\"b\", \"l\": [1, {\"x\": 2}]}");
        // Cut into pieces of every size: the deltas always add up to the whole answer's calls.
        for size in 1..12 {
            let chars: Vec<char> = text.chars().collect();
            let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
            let pieces: Vec<&str> = pieces.iter().map(|p| p.as_str()).collect();
            let (content, calls, n) = stream(ToolFormat::Hermes, &pieces);
            assert_eq!((content.as_str(), &calls), ("", &whole), "pieces of {size}");
            assert!(n > 2 || size > 8, "arguments came in {n} deltas for pieces of {size}");
        }
        let (_, calls, n) = stream(
            ToolFormat::Mistral,
            &[
                "[TOOL_CALLS][{\"name\": \"f\", \"argu",
                "ments\": {\"a\":",
                " 1}}, {\"name\"",
                ": \"g\", \"arguments\": {}}]",
            ],
        );
        assert_eq!(
            (calls.len(), calls[0].arguments.as_str(), calls[1].arguments.as_str(), n),
            (2, "{\"a\": 1}", "{}", 3)
        );
    }

    #[test]
    fn streams_send_text_until_a_call_begins() {
        let (text, calls, _) =
            stream(ToolFormat::Hermes, &["Hi <tool", "_call>\n{\"name\": \"f\", ", "\"arguments\": {}}\n</tool_call>"]);
        assert_eq!((text.as_str(), calls.len()), ("Hi ", 1));
        assert_eq!(stream(ToolFormat::Hermes, &["a <to", "o b"]), ("a <too b".into(), vec![], 0));
        let (text, calls, _) = stream(ToolFormat::Llama3Json, &[" {\"name\": \"f\",", " \"parameters\": {}}"]);
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        assert_eq!(stream(ToolFormat::Llama3Json, &["Par", "is {x}"]), ("Paris {x}".into(), vec![], 0));
        let (text, calls, _) = stream(ToolFormat::Mistral, &["[TOOL_", "CALLS][{\"name\": \"f\", \"arguments\": {}}]"]);
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        // A call that never opens is text after all; one that opened stands.
        assert_eq!(stream(ToolFormat::Hermes, &["<tool_call>{"]).0, "<tool_call>{");
        let (text, calls, _) = stream(ToolFormat::Hermes, &["<tool_call>{\"name\": \"f\", \"arguments\": {\"a"]);
        assert_eq!((text.as_str(), calls[0].arguments.as_str()), ("", "{\"a"));
    }

    /// weft's own format: the tools and the instruction join the system message; earlier
    /// calls and their results become text a template without tools can render.
    #[test]
    fn a_template_without_tools_gets_them_as_text() {
        let tool: Tool = serde_json::from_value(json!({"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}))
        .unwrap();
        let tools = Tools::new(vec![tool], Some(ToolChoice::Required), None, Some("plain")).unwrap();
        let messages = tools.template_messages(vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Go"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "f", "arguments": {"x": 1}}}]}),
            json!({"role": "tool", "tool_call_id": "c", "content": "2"}),
        ]);
        let system = messages[0]["content"].as_str().unwrap();
        assert!(system.starts_with("Be brief.\n\nYou can call") && system.ends_with("\"name\": \"f\", \"parameters\": {\"type\": \"object\", \"properties\": {\"x\": {\"type\": \"integer\"}}}}"), "{system}");
        assert_eq!(
            messages[2],
            json!({"role": "assistant", "content": "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>"})
        );
        assert_eq!(messages[3], json!({"role": "user", "content": "<tool_response>\n2\n</tool_response>"}));
        let (_, calls) = parse(ToolFormat::Generic, messages[2]["content"].as_str().unwrap()).unwrap();
        assert_eq!(calls[0].arguments, "{\"x\": 1}");
    }

    #[test]
    fn choices_are_checked() {
        let tool: Tool = serde_json::from_value(json!({"type": "function", "function": {"name": "f"}})).unwrap();
        let t = Some("{{ '<tool_call>' }}");
        assert!(Tools::new(vec![tool.clone()], Some(ToolChoice::Named("g".into())), None, t).is_err());
        assert!(Tools::new(vec![], Some(ToolChoice::Required), None, t).is_err());
        // A template with no tool format gets weft's, `auto` included.
        let own = Tools::new(vec![tool.clone()], None, None, Some("plain")).unwrap();
        assert_eq!(own.format, Some(ToolFormat::Generic));
        assert!(matches!(own.grammar(), Some(Grammar::Lark(g)) if g.contains("TEXT | calls")));
        assert!(own.template_tools().is_none());
        assert!(Tools::new(vec![tool.clone()], Some(ToolChoice::None), None, Some("plain"))
            .unwrap()
            .grammar()
            .is_none());
        let tools = Tools::new(vec![tool], Some(ToolChoice::Required), None, t).unwrap();
        assert!(matches!(tools.grammar(), Some(Grammar::Lark(g)) if g.contains("<tool_call>")));
        let c: ToolChoice = serde_json::from_value(json!({"type": "function", "function": {"name": "f"}})).unwrap();
        assert_eq!(c, ToolChoice::Named("f".into()));
    }
}
