//! The Responses API (`/v1/responses`), as OpenAI documents it and vLLM serves it: a request
//! becomes a chat request (instructions, the stored conversation of `previous_response_id`,
//! the input items, function tools), runs as one, and its answer is told back as output
//! items ([`output`]). Conversations are kept for `previous_response_id` in a bounded
//! [`store`].

pub mod output;
pub mod store;

use super::chat::ChatMessage;
use super::openai::{ChatRequest, GenerationFields, JsonSchemaFormat, ResponseFormat, StreamOptions};
use super::tools::{Function, Tool, ToolChoice};
use super::{parse_split, ApiError};
use serde::Deserialize;
use serde_json::{json, Value};

/// A `/v1/responses` request. Fields of OpenAI's that change nothing here (`reasoning`,
/// `include`, `service_tier`, …) are ignored, as vLLM ignores them.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    pub input: Input,
    pub model: Option<String>,
    pub instructions: Option<String>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub text: Option<TextConfig>,
    pub max_output_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stream: Option<bool>,
    /// Keep the conversation for `previous_response_id` (OpenAI's default: true).
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    pub metadata: Option<serde_json::Map<String, Value>>,
    pub user: Option<String>,
    /// Run detached and poll: not offered.
    pub background: Option<bool>,
    /// vLLM's extras.
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
}

/// `input`: a user message's text, or a list of items.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// `text`: the output's format.
#[derive(Debug, Clone, Deserialize)]
pub struct TextConfig {
    pub format: Option<TextFormat>,
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormat {
    Text,
    JsonObject,
    JsonSchema { name: Option<String>, schema: Option<Value>, strict: Option<bool> },
}

impl ResponsesRequest {
    pub fn parse(body: Value) -> Result<Self, ApiError> {
        let (own, _): (ResponsesRequest, Value) = parse_split(body)?;
        if own.background == Some(true) {
            return Err(ApiError::invalid(
                "background responses are not supported: send the request and wait",
                Some("background"),
            ));
        }
        Ok(own)
    }

    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn stores(&self) -> bool {
        self.store.unwrap_or(true)
    }

    /// The input items as chat messages (without the instructions).
    pub fn input_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        match &self.input {
            Input::Text(t) => Ok(vec![ChatMessage::new("user", Some(t.clone()))]),
            Input::Items(items) => {
                let mut out: Vec<ChatMessage> = Vec::new();
                for (i, item) in items.iter().enumerate() {
                    read_item(item, &mut out).map_err(|m| ApiError::invalid(m, Some(&format!("input[{i}]"))))?;
                }
                Ok(out)
            }
        }
    }

    /// The chat request this one runs as: `history` (a stored conversation) after the
    /// instructions, then `input`.
    pub fn chat(&self, history: &[ChatMessage], input: &[ChatMessage]) -> Result<ChatRequest, ApiError> {
        let mut messages = Vec::with_capacity(history.len() + input.len() + 1);
        if let Some(i) = &self.instructions {
            messages.push(ChatMessage::new("system", Some(i.clone())));
        }
        messages.extend_from_slice(history);
        messages.extend_from_slice(input);
        if messages.is_empty() {
            return Err(ApiError::invalid("input must not be empty", Some("input")));
        }
        let tools = self.tools.iter().flatten().map(function_tool).collect::<Result<Vec<_>, _>>()?;
        let tool_choice = self.tool_choice.as_ref().map(tool_choice).transpose()?;
        let response_format = match self.text.as_ref().and_then(|t| t.format.clone()) {
            None | Some(TextFormat::Text) => None,
            Some(TextFormat::JsonObject) => Some(ResponseFormat::JsonObject),
            Some(TextFormat::JsonSchema { name, schema, strict }) => {
                Some(ResponseFormat::JsonSchema { json_schema: JsonSchemaFormat { name, schema, strict } })
            }
        };
        let streaming = self.streaming();
        Ok(ChatRequest {
            messages,
            logprobs: None,
            top_logprobs: None,
            max_completion_tokens: self.max_output_tokens,
            add_generation_prompt: None,
            chat_template_kwargs: None,
            tools: (!tools.is_empty()).then_some(tools),
            tool_choice,
            parallel_tool_calls: self.parallel_tool_calls,
            gen: GenerationFields {
                model: self.model.clone(),
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: self.seed,
                stream: Some(streaming),
                stream_options: streaming
                    .then_some(StreamOptions { include_usage: Some(true), continuous_usage_stats: None }),
                response_format,
                ..Default::default()
            },
        })
    }
}

/// One input item, added to `out`: a message, a call the model made (joined to the assistant
/// message before it), a call's output. Reasoning items are context the model wrote and
/// reads again only as its answers: they are left out.
fn read_item(item: &Value, out: &mut Vec<ChatMessage>) -> Result<(), String> {
    let kind = item["type"].as_str().unwrap_or(if item.get("role").is_some() { "message" } else { "" });
    let text = |key: &str| item[key].as_str().map(str::to_owned).ok_or_else(|| format!("`{key}` must be a string"));
    match kind {
        "message" => {
            let role = item["role"].as_str().ok_or("a message needs a `role`")?;
            if !["user", "system", "developer", "assistant"].contains(&role) {
                return Err(format!("unknown message role {role:?} (expected user, system, developer or assistant)"));
            }
            out.push(ChatMessage::new(role, Some(content_text(&item["content"])?)));
        }
        "function_call" => {
            let call = json!({"id": text("call_id")?, "type": "function",
                "function": {"name": text("name")?, "arguments": text("arguments")?}});
            match out.last_mut() {
                Some(m) if m.role == "assistant" => m.tool_calls.get_or_insert_with(Vec::new).push(call),
                _ => out.push(ChatMessage { tool_calls: Some(vec![call]), ..ChatMessage::new("assistant", None) }),
            }
        }
        "function_call_output" => {
            let output = match &item["output"] {
                Value::String(s) => s.clone(),
                parts => content_text(parts)?,
            };
            out.push(ChatMessage { tool_call_id: Some(text("call_id")?), ..ChatMessage::new("tool", Some(output)) });
        }
        "reasoning" => {}
        "" => return Err("an input item needs a `type` or a `role`".into()),
        other => return Err(format!("input item type {other:?} is not supported")),
    }
    Ok(())
}

/// A message's content: a string, or text parts (`input_text`, `output_text`, `refusal`).
fn content_text(content: &Value) -> Result<String, String> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p["type"].as_str() {
                Some("input_text" | "output_text" | "text") => {
                    p["text"].as_str().map(str::to_owned).ok_or_else(|| "a text part needs `text`".to_owned())
                }
                Some("refusal") => Ok(p["refusal"].as_str().unwrap_or_default().to_owned()),
                Some(kind) => Err(format!("content part type {kind:?} is not supported: this model reads text only")),
                None => Err("a content part needs a `type`".into()),
            })
            .collect(),
        _ => Err("`content` must be a string or a list of parts".into()),
    }
}

/// A Responses function tool (`{"type": "function", "name", "description", "parameters"}`)
/// as a chat tool; built-in tools are refused by name.
fn function_tool(t: &Value) -> Result<Tool, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("tools"));
    match t["type"].as_str() {
        Some("function") => {}
        Some(other) => return Err(bad(format!("tool type {other:?} is not supported: weft runs function tools only"))),
        None => return Err(bad("a tool needs a `type`".into())),
    }
    let name = t["name"].as_str().ok_or_else(|| bad("a function tool needs a `name`".into()))?;
    Ok(Tool {
        kind: "function".into(),
        function: Function {
            name: name.to_owned(),
            description: t["description"].as_str().map(str::to_owned),
            parameters: t.get("parameters").filter(|p| !p.is_null()).cloned(),
        },
    })
}

/// `tool_choice`: `none`, `auto`, `required`, or `{"type": "function", "name"}`.
fn tool_choice(v: &Value) -> Result<ToolChoice, ApiError> {
    let named = v["name"].as_str().filter(|_| v["type"] == "function");
    let v = match named {
        Some(name) => json!({"type": "function", "function": {"name": name}}),
        None => v.clone(),
    };
    serde_json::from_value(v).map_err(|e| ApiError::invalid(format!("invalid tool_choice: {e}"), Some("tool_choice")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_messages() {
        let req = ResponsesRequest::parse(json!({"model": "m", "instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\": \"Lyon\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get_weather"}, "reasoning": {"effort": "low"}}))
        .unwrap();
        let input = req.input_messages().unwrap();
        let roles: Vec<&str> = input.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
        assert_eq!(input[1].tool_calls.as_ref().unwrap().len(), 2);
        assert_eq!(input[2].tool_call_id.as_deref(), Some("c1"));
        let chat = req.chat(&[], &input).unwrap();
        assert_eq!(chat.messages[0].content.as_deref(), Some("Be brief."));
        assert_eq!(chat.tool_choice, Some(ToolChoice::Named("get_weather".into())));
        assert_eq!(chat.tools.unwrap()[0].function.name, "get_weather");
    }

    #[test]
    fn what_cannot_run_is_refused_by_name() {
        let parse = |v: Value| ResponsesRequest::parse(v).and_then(|r| r.chat(&[], &r.input_messages()?));
        let e = parse(json!({"input": "hi", "tools": [{"type": "web_search_preview"}]})).unwrap_err();
        assert!(e.message.contains("web_search_preview"), "{}", e.message);
        let e = parse(json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}))
            .unwrap_err();
        assert!(e.message.contains("text only") && e.param.as_deref() == Some("input[0]"), "{e:?}");
        assert!(parse(json!({"input": [{"type": "item_reference", "id": "x"}]})).is_err());
        assert!(parse(json!({"input": "hi", "background": true})).is_err());
        assert!(parse(json!({"input": []})).is_err());
        assert!(parse(json!({"input": 5})).is_err());
    }
}
