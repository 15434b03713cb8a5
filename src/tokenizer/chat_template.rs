//! Chat templates: the model's Jinja template rendered with minijinja, plus the
//! Python-compatible helpers real Hugging Face templates use (`str.strip()`,
//! `raise_exception`, `tojson`, loop controls). Compiled once per model.

use anyhow::{anyhow, Result};
use minijinja::{context, Environment, Error, ErrorKind};

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
    /// `messages` are maps with `role`, `content` and optionally `name`.
    pub fn render(&self, messages: &[minijinja::Value], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
        tmpl.render(context! {
            messages => messages,
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

    fn msg(role: &str, content: &str) -> minijinja::Value {
        minijinja::Value::from_pairs(vec![("role", role.to_owned()), ("content", content.to_owned())])
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
}
