//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): a request becomes
//! a chat request (system, messages with `tool_use` / `tool_result` blocks, custom tools),
//! runs as one, and its answer is told back as content blocks ([`output`]). Errors take
//! Anthropic's shape ([`error_body`]).

pub mod output;

use super::chat::ChatMessage;
use super::openai::{ChatRequest, GenerationFields, OneOrMany, StreamOptions};
use super::tools::{Function, Tool, ToolChoice};
use super::{parse_split, ApiError};
use serde::Deserialize;
use serde_json::{json, Value};

/// A `/v1/messages` request. `metadata`, `service_tier` and the like are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    /// Required by Anthropic's API; `count_tokens` goes without.
    pub max_tokens: Option<usize>,
    pub system: Option<Content>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `{"type": "enabled" | "disabled", "budget_tokens"}`: whether a thinking model
    /// (Qwen3's template's `enable_thinking`) thinks; off unless asked, as Anthropic's.
    pub thinking: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

/// Content: a string, or a list of blocks.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Value>),
}

impl MessagesRequest {
    pub fn parse(body: Value) -> Result<Self, ApiError> {
        Ok(parse_split::<MessagesRequest, Value>(body)?.0)
    }

    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// The chat request this one runs as. `count` (for `count_tokens`) lets `max_tokens` go.
    pub fn chat(&self, count: bool) -> Result<ChatRequest, ApiError> {
        if self.max_tokens.is_none() && !count {
            return Err(ApiError::invalid("max_tokens: Field required", Some("max_tokens")));
        }
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            let text = blocks_text(system).map_err(|m| ApiError::invalid(m, Some("system")))?;
            messages.push(ChatMessage::new("system", Some(text)));
        }
        for (i, m) in self.messages.iter().enumerate() {
            read_message(m, &mut messages).map_err(|e| ApiError::invalid(e, Some(&format!("messages.{i}"))))?;
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages: at least one message is required", Some("messages")));
        }
        let tools = self.tools.iter().flatten().map(custom_tool).collect::<Result<Vec<_>, _>>()?;
        let (tool_choice, parallel) = match &self.tool_choice {
            None => (None, None),
            Some(c) => tool_choice(c)?,
        };
        let streaming = self.streaming();
        Ok(ChatRequest {
            messages,
            logprobs: None,
            top_logprobs: None,
            max_completion_tokens: self.max_tokens,
            add_generation_prompt: None,
            chat_template_kwargs: Some(
                json!({"enable_thinking": self.thinking.as_ref().is_some_and(|t| t["type"] == "enabled")})
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
            ),
            tools: (!tools.is_empty()).then_some(tools),
            tool_choice,
            parallel_tool_calls: parallel,
            gen: GenerationFields {
                model: self.model.clone(),
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                stop: self.stop_sequences.clone().map(OneOrMany::Many),
                stream: Some(streaming),
                stream_options: streaming
                    .then_some(StreamOptions { include_usage: Some(true), continuous_usage_stats: None }),
                ..Default::default()
            },
        })
    }
}

/// One message, added to `out`. A user turn's `tool_result` blocks become tool messages
/// (first: they answer the calls just before) and its text a user message; an assistant
/// turn's `tool_use` blocks become its calls. Thinking blocks are left out.
fn read_message(m: &Message, out: &mut Vec<ChatMessage>) -> Result<(), String> {
    if !["user", "assistant"].contains(&m.role.as_str()) {
        return Err(format!("unknown role {:?} (expected user or assistant)", m.role));
    }
    let blocks = match &m.content {
        Content::Text(t) => {
            out.push(ChatMessage::new(&m.role, Some(t.clone())));
            return Ok(());
        }
        Content::Blocks(b) => b,
    };
    let (mut text, mut calls) = (String::new(), Vec::new());
    for b in blocks {
        match (b["type"].as_str().unwrap_or_default(), m.role.as_str()) {
            ("text", _) => text.push_str(b["text"].as_str().ok_or("a text block needs `text`")?),
            ("tool_use", "assistant") => {
                let (id, name) = (b["id"].as_str(), b["name"].as_str());
                let (Some(id), Some(name)) = (id, name) else {
                    return Err("a tool_use block needs `id` and `name`".into());
                };
                let input = if b["input"].is_null() { json!({}) } else { b["input"].clone() };
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": input.to_string()}}));
            }
            ("tool_result", "user") => {
                let id = b["tool_use_id"].as_str().ok_or("a tool_result block needs `tool_use_id`")?;
                let content = match &b["content"] {
                    Value::Null => String::new(),
                    c => blocks_text(&serde_json::from_value(c.clone()).map_err(|e| e.to_string())?)?,
                };
                let content = if b["is_error"] == true { format!("Error: {content}") } else { content };
                out.push(ChatMessage { tool_call_id: Some(id.to_owned()), ..ChatMessage::new("tool", Some(content)) });
            }
            ("thinking" | "redacted_thinking", "assistant") => {}
            ("image" | "document", _) => {
                return Err("image and document blocks are not supported: this model reads text only".into())
            }
            (kind, role) => return Err(format!("content block type {kind:?} is not supported in a {role} message")),
        }
    }
    if !text.is_empty() || !calls.is_empty() || blocks.is_empty() {
        let content = (!text.is_empty() || calls.is_empty()).then_some(text);
        out.push(ChatMessage {
            tool_calls: (!calls.is_empty()).then_some(calls),
            ..ChatMessage::new(&m.role, content)
        });
    }
    Ok(())
}

/// The text of `system` or a tool result: a string, or text blocks.
fn blocks_text(c: &Content) -> Result<String, String> {
    match c {
        Content::Text(t) => Ok(t.clone()),
        Content::Blocks(blocks) => blocks
            .iter()
            .map(|b| match b["type"].as_str() {
                Some("text") => b["text"].as_str().map(str::to_owned).ok_or_else(|| "a text block needs `text`".into()),
                Some("image" | "document") => {
                    Err("image and document blocks are not supported: this model reads text only".into())
                }
                other => Err(format!("content block type {other:?} is not supported here")),
            })
            .collect(),
    }
}

/// A custom tool (`{"name", "description", "input_schema"}`) as a chat tool; Anthropic's
/// server tools (web search, bash, computer use, …) are refused by name.
fn custom_tool(t: &Value) -> Result<Tool, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("tools"));
    if let Some(kind) = t["type"].as_str().filter(|k| *k != "custom") {
        return Err(bad(format!("tool type {kind:?} is not supported: weft runs custom tools only")));
    }
    let name = t["name"].as_str().ok_or_else(|| bad("a tool needs a `name`".into()))?;
    Ok(Tool {
        kind: "function".into(),
        function: Function {
            name: name.to_owned(),
            description: t["description"].as_str().map(str::to_owned),
            parameters: t.get("input_schema").filter(|p| !p.is_null()).cloned(),
        },
    })
}

/// `tool_choice`: `auto`, `any` (a call is required), `tool` (that one), `none`; and
/// whether calls may come several at once.
fn tool_choice(c: &Value) -> Result<(Option<ToolChoice>, Option<bool>), ApiError> {
    let choice = match c["type"].as_str() {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => ToolChoice::Named(
            c["name"]
                .as_str()
                .ok_or_else(|| ApiError::invalid("tool_choice of type tool needs a `name`", Some("tool_choice")))?
                .to_owned(),
        ),
        _ => return Err(ApiError::invalid("tool_choice.type must be auto, any, tool or none", Some("tool_choice"))),
    };
    Ok((Some(choice), c["disable_parallel_tool_use"].as_bool().map(|d| !d)))
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(e: &ApiError) -> Value {
    let kind = match e.status {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_become_messages() {
        let req = MessagesRequest::parse(json!({"model": "m", "max_tokens": 10,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "…", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny"}]}, {"type": "text", "text": "And now?"}]}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true}, "metadata": {"user_id": "u"}}))
        .unwrap();
        let chat = req.chat(false).unwrap();
        let roles: Vec<&str> = chat.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        let call = &chat.messages[2].tool_calls.as_ref().unwrap()[0];
        assert_eq!(call["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(chat.messages[3].content.as_deref(), Some("sunny"));
        assert_eq!((chat.tool_choice, chat.parallel_tool_calls), (Some(ToolChoice::Required), Some(false)));
    }

    #[test]
    fn what_cannot_run_is_refused() {
        let chat = |v: Value| MessagesRequest::parse(v).and_then(|r| r.chat(false));
        let user = json!([{"role": "user", "content": "hi"}]);
        assert!(chat(json!({"messages": user})).unwrap_err().message.contains("max_tokens"));
        let e =
            chat(json!({"max_tokens": 5, "messages": user, "tools": [{"type": "web_search_20250305", "name": "w"}]}))
                .unwrap_err();
        assert!(e.message.contains("web_search_20250305"));
        let image = json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]);
        let e = chat(json!({"max_tokens": 5, "messages": image})).unwrap_err();
        assert!(e.message.contains("text only") && e.param.as_deref() == Some("messages.0"));
        assert!(chat(json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]})).is_err());
        assert_eq!(error_body(&ApiError::overloaded("busy"))["error"]["type"], "rate_limit_error");
    }
}
