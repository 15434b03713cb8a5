//! Chat messages as the API receives them; the model's template (in the tokenizer) turns
//! them into the prompt.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    #[serde(deserialize_with = "content_text")]
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Message content: a string, or OpenAI's list of `{"type": "text", "text": ...}` parts.
fn content_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Content {
        Text(String),
        Parts(Vec<Part>),
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Part {
        #[serde(rename = "type")]
        kind: String,
        text: Option<String>,
    }
    match Content::deserialize(d)? {
        Content::Text(s) => Ok(s),
        Content::Parts(parts) => parts
            .into_iter()
            .map(|p| match (p.kind.as_str(), p.text) {
                ("text", Some(t)) => Ok(t),
                (kind, _) => {
                    Err(serde::de::Error::custom(format!("unsupported content part type {kind:?} (only text)")))
                }
            })
            .collect(),
    }
}

impl ChatMessage {
    /// The message as the template sees it.
    pub fn to_value(&self) -> serde_json::Value {
        let mut v = serde_json::json!({"role": self.role, "content": self.content});
        if let Some(n) = &self.name {
            v["name"] = n.clone().into();
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
        assert_eq!(m.content, "ab");
        assert!(serde_json::from_str::<ChatMessage>(r#"{"role":"user","content":[{"type":"image_url"}]}"#).is_err());
    }
}
