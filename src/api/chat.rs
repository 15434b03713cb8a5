//! Chat templates: the model's Jinja template rendered with minijinja, plus the
//! Python-compatible helpers real Hugging Face templates use (`str.strip()`,
//! `raise_exception`, `tojson`, loop controls).

use anyhow::{anyhow, Result};
use minijinja::{context, Environment, Error, ErrorKind};
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
    fn to_value(&self) -> minijinja::Value {
        let mut pairs = vec![("role", self.role.clone()), ("content", self.content.clone())];
        if let Some(n) = &self.name {
            pairs.push(("name", n.clone()));
        }
        minijinja::Value::from_pairs(pairs)
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_owned()).map_err(|e| anyhow!("chat template does not parse: {e}"))?;
        Ok(ChatTemplate { env, bos_token, eos_token })
    }

    /// The prompt text for `messages`, ending with the assistant turn's opening when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
        tmpl.render(context! {
            messages => messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>(),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
        .map_err(|e| anyhow!("rendering the chat template: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), name: None }
    }

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let t = ChatTemplate::new(CHATML, String::new(), String::new()).unwrap();
        let out = t.render(&[msg("user", "Hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_helpers_and_raise_exception() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}[{{ m.content.strip() | upper }}]{% endfor %}";
        let t = ChatTemplate::new(src, "<s>".into(), "</s>".into()).unwrap();
        assert_eq!(t.render(&[msg("user", "  hi ")], false).unwrap(), "<s>[HI]");
        let err = t.render(&[msg("tool", "x")], false).unwrap_err().to_string();
        assert!(err.contains("bad role tool"), "{err}");
        assert!(ChatTemplate::new("{% if %}", String::new(), String::new()).is_err());
    }

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
