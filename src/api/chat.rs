//! Chat messages as the API receives them; the model's template (in the tokenizer) turns
//! them into the prompt.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A message. Fields a client's SDK sends back with an earlier answer (`refusal`,
/// `annotations`, `audio`, … as `null`) are accepted and ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// `null` (an assistant message that only calls tools) or absent: no content.
    #[serde(default, deserialize_with = "content_text")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant's earlier calls: `[{"id", "type": "function", "function": {name, arguments}}]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// A tool result's call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// Message content: a string, OpenAI's list of `{"type": "text", "text": ...}` parts, or null.
fn content_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Content {
        Null,
        Text(String),
        Parts(Vec<Part>),
    }
    /// A part's other fields (`image_url`, `input_audio`, …) are read only to be refused.
    #[derive(Deserialize)]
    struct Part {
        #[serde(rename = "type")]
        kind: String,
        text: Option<String>,
    }
    match Content::deserialize(d)? {
        Content::Null => Ok(None),
        Content::Text(s) => Ok(Some(s)),
        Content::Parts(parts) => parts
            .into_iter()
            .map(|p| match (p.kind.as_str(), p.text) {
                ("text", Some(t)) => Ok(t),
                ("text", None) => Err(serde::de::Error::custom("a text content part needs `text`")),
                (kind, _) => Err(serde::de::Error::custom(format!(
                    "content part type {kind:?} is not supported: this model reads text only"
                ))),
            })
            .collect::<Result<String, _>>()
            .map(Some),
    }
}

impl ChatMessage {
    /// A plain message: `role` and its text, no calls.
    pub fn new(role: &str, content: Option<String>) -> Self {
        ChatMessage { role: role.into(), content, name: None, tool_calls: None, tool_call_id: None }
    }

    /// The message as the template sees it. A call's `arguments` (JSON text in OpenAI's API)
    /// become the object templates expect, as vLLM passes them; keys absent here stay absent
    /// there (templates test `'tool_calls' in message`).
    pub fn to_value(&self) -> Value {
        let mut v = json!({"role": self.role, "content": self.content});
        if let Some(n) = &self.name {
            v["name"] = n.clone().into();
        }
        if let Some(calls) = &self.tool_calls {
            let mut calls = calls.clone();
            for c in &mut calls {
                if let Some(args) = c.pointer_mut("/function/arguments") {
                    if let Some(parsed) = args.as_str().and_then(|s| serde_json::from_str::<Value>(s).ok()) {
                        *args = parsed;
                    }
                }
            }
            v["tool_calls"] = Value::Array(calls);
        }
        if let Some(id) = &self.tool_call_id {
            v["tool_call_id"] = id.clone().into();
        }
        v
    }
}

/// The roles a message may have; anything else is refused before the template runs.
pub const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_parts_are_joined() {
        let m: ChatMessage = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(m.content.as_deref(), Some("ab"));
        assert!(serde_json::from_str::<ChatMessage>(r#"{"role":"user","content":[{"type":"image_url"}]}"#).is_err());
    }

    /// What the openai SDK's `message.model_dump()` sends back: nulls, a refusal, tool calls.
    #[test]
    fn an_sdk_answer_goes_back_in() {
        let m: ChatMessage = serde_json::from_value(json!({"role": "assistant", "content": null, "refusal": null,
            "annotations": null, "audio": null, "function_call": null,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}))
        .unwrap();
        let v = m.to_value();
        assert!(v["content"].is_null());
        assert_eq!(v["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        let plain = ChatMessage { tool_calls: None, ..m }.to_value();
        assert!(plain.get("tool_calls").is_none());
    }
}
