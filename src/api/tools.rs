//! Tool calling: the request's `tools` and `tool_choice`, the model family's tool-call format
//! (read off its chat template), the grammar that enforces a call when one is required, and
//! the parser that turns generated text back into OpenAI `tool_calls` — whole, or as a
//! stream in which ordinary text flows until a call begins.

use super::ApiError;
use crate::grammar::Grammar;
use serde::Deserialize;
use serde_json::{json, Value};

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
}

impl ToolFormat {
    /// The format a chat template writes assistant tool calls in, if it is one of these.
    pub fn detect(template: &str) -> Option<Self> {
        if template.contains("<tool_call>") {
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
            ToolFormat::Hermes => "<tool_call>",
            ToolFormat::Mistral => "[TOOL_CALLS]",
            ToolFormat::Llama3Json => "<|python_tag|>",
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
        let format = template.and_then(ToolFormat::detect);
        if format.is_none() && choice != ToolChoice::None {
            return Err(bad("this model's chat template writes no tool-call format weft can read \
                (Hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS])"
                .into()));
        }
        Ok(Tools { tools, choice, parallel: parallel.unwrap_or(true), format })
    }

    /// The tools as the template sees them (none when there are none).
    pub fn template_tools(&self) -> Option<Vec<Value>> {
        (!self.tools.is_empty()).then(|| self.tools.iter().map(Tool::to_value).collect())
    }

    /// Whether generated text is read for calls.
    pub fn parses(&self) -> Option<ToolFormat> {
        self.format.filter(|_| self.choice != ToolChoice::None)
    }

    /// For `required` and a named function: the grammar of the format's calls, each a JSON
    /// object whose name is one of the allowed tools and whose arguments follow its schema.
    pub fn grammar(&self) -> Option<Grammar> {
        let format = self.format?;
        let allowed: Vec<&Tool> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
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
            ToolFormat::Hermes => {
                let rep = if many { " (\"\\n\" call)*" } else { "" };
                format!("start: call{rep}\ncall: \"<tool_call>\\n\" %json {call} \"\\n</tool_call>\"")
            }
            ToolFormat::Llama3Json => format!("start: %json {call}"),
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

/// Reads calls out of a whole answer: the text before the first call, and the calls; `None`
/// when the text holds no well-formed call (then it is all content).
pub fn parse(format: ToolFormat, text: &str) -> Option<(String, Vec<ToolCall>)> {
    let call = |v: &Value| -> Option<ToolCall> {
        let name = v.get("name")?.as_str()?.to_owned();
        let args = v.get(format.arguments_key()).or_else(|| v.get("arguments")).cloned().unwrap_or(json!({}));
        let arguments = match args {
            Value::String(s) => s,
            v => v.to_string(),
        };
        Some(ToolCall { name, arguments })
    };
    match format {
        ToolFormat::Hermes => {
            let start = text.find("<tool_call>")?;
            let mut calls = Vec::new();
            let parts: Vec<&str> = text[start..].split("<tool_call>").skip(1).collect();
            for (i, part) in parts.iter().enumerate() {
                let closed = part.contains("</tool_call>");
                let body = part.split("</tool_call>").next().unwrap_or("").trim();
                match serde_json::from_str(body).ok().and_then(|v| call(&v)) {
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
            let v: Value = serde_json::from_str(body).ok()?;
            Some((String::new(), vec![call(&v)?]))
        }
        ToolFormat::Mistral => {
            let start = text.find("[TOOL_CALLS]")?;
            let body = text[start + "[TOOL_CALLS]".len()..].trim();
            let list: Vec<Value> = serde_json::from_str(body).ok()?;
            let calls = list.iter().map(call).collect::<Option<Vec<_>>>()?;
            Some((text[..start].trim().to_owned(), calls))
        }
    }
}

/// A streamed answer read for calls: text flows out as content until a call may have begun
/// (the format's marker, or for Llama 3 a `{` opening the answer); from there it is kept and
/// parsed at the end.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    /// Text not yet sent: a possible start of the marker, or everything from a call on.
    held: String,
    in_call: bool,
    /// Llama 3: the answer began with text, so it holds no call.
    text_only: bool,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> Self {
        ToolStream { format, held: String::new(), in_call: false, text_only: false }
    }

    /// Takes the next piece of text; returns the content that can be sent now.
    pub fn push(&mut self, piece: &str) -> String {
        self.held.push_str(piece);
        if self.in_call {
            return String::new();
        }
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

    /// At the end: the content still held, and the calls (none when the held text did not
    /// parse as calls: then it is content).
    pub fn finish(self) -> (String, Vec<ToolCall>) {
        if !self.in_call {
            return (self.held, Vec::new());
        }
        match parse(self.format, &self.held) {
            Some((content, calls)) => (content, calls),
            None => (self.held, Vec::new()),
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
                ToolCall { name: "f".into(), arguments: "{\"x\":1}".into() },
                ToolCall { name: "g".into(), arguments: "{}".into() }
            ]
        );
        let (_, calls) =
            parse(ToolFormat::Llama3Json, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": \"b\"}}").unwrap();
        assert_eq!(calls[0].arguments, "{\"a\":\"b\"}");
        let (_, calls) = parse(ToolFormat::Mistral, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]").unwrap();
        assert_eq!(calls[0].name, "f");
        assert!(parse(ToolFormat::Hermes, "no call here").is_none());
        assert!(parse(ToolFormat::Llama3Json, "Paris.").is_none());
        assert!(parse(ToolFormat::Hermes, "<tool_call>\n{broken").is_none());
        let cut = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"na";
        assert_eq!(parse(ToolFormat::Hermes, cut).unwrap().1.len(), 1);
    }

    fn stream(format: ToolFormat, pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut s = ToolStream::new(format);
        let mut out: String = pieces.iter().map(|p| s.push(p)).collect();
        let (rest, calls) = s.finish();
        out += &rest;
        (out, calls)
    }

    #[test]
    fn streams_send_text_until_a_call_begins() {
        let (text, calls) =
            stream(ToolFormat::Hermes, &["Hi <tool", "_call>\n{\"name\": \"f\", ", "\"arguments\": {}}\n</tool_call>"]);
        assert_eq!((text.as_str(), calls.len()), ("Hi ", 1));
        assert_eq!(stream(ToolFormat::Hermes, &["a <to", "o b"]), ("a <too b".into(), vec![]));
        let (text, calls) = stream(ToolFormat::Llama3Json, &[" {\"name\": \"f\",", " \"parameters\": {}}"]);
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        assert_eq!(stream(ToolFormat::Llama3Json, &["Par", "is {x}"]), ("Paris {x}".into(), vec![]));
        let (text, calls) = stream(ToolFormat::Mistral, &["[TOOL_", "CALLS][{\"name\": \"f\", \"arguments\": {}}]"]);
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        // A call that never closes is text after all.
        assert_eq!(stream(ToolFormat::Hermes, &["<tool_call>{"]).0, "<tool_call>{");
    }

    #[test]
    fn choices_are_checked() {
        let tool: Tool = serde_json::from_value(json!({"type": "function", "function": {"name": "f"}})).unwrap();
        let t = Some("{{ '<tool_call>' }}");
        assert!(Tools::new(vec![tool.clone()], Some(ToolChoice::Named("g".into())), None, t).is_err());
        assert!(Tools::new(vec![], Some(ToolChoice::Required), None, t).is_err());
        assert!(Tools::new(vec![tool.clone()], None, None, Some("plain")).is_err());
        assert!(Tools::new(vec![tool.clone()], Some(ToolChoice::None), None, Some("plain")).is_ok());
        let tools = Tools::new(vec![tool], Some(ToolChoice::Required), None, t).unwrap();
        assert!(matches!(tools.grammar(), Some(Grammar::Lark(g)) if g.contains("<tool_call>")));
        let c: ToolChoice = serde_json::from_value(json!({"type": "function", "function": {"name": "f"}})).unwrap();
        assert_eq!(c, ToolChoice::Named("f".into()));
    }
}
