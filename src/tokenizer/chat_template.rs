//! Chat templates: the model's Jinja template rendered with minijinja, plus the
//! Python-compatible helpers real Hugging Face templates use (`str.strip()`,
//! `raise_exception`, `strftime_now`, Python's `tojson`, loop controls). Compiled once per
//! model.

use anyhow::{anyhow, Result};
use chrono::NaiveDateTime;
use minijinja::value::Kwargs;
use minijinja::value::{Object, ObjectExt, ObjectRepr, Rest, ValueOrKwargs};
use minijinja::{context, Environment, Error, ErrorKind, State, Value};
use serde_json::Value as Json;
use std::borrow::Cow;
use std::sync::Arc;

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// What a template is rendered with, as transformers' `apply_chat_template` passes it.
#[derive(Default)]
pub struct ChatContext<'a> {
    /// The messages, as the client sent them (role, content, tool_calls, …).
    pub messages: &'a [Json],
    pub tools: Option<&'a [Json]>,
    pub add_generation_prompt: bool,
    /// Extra variables (`chat_template_kwargs`); they cannot replace the ones above.
    pub kwargs: Option<&'a serde_json::Map<String, Json>>,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        Self::with_clock(source, bos_token, eos_token, None)
    }

    /// A template whose `strftime_now` reads `now` instead of the local clock (for
    /// reproducible renderings).
    pub fn with_clock(source: &str, bos_token: String, eos_token: String, now: Option<NaiveDateTime>) -> Result<Self> {
        let mut env = Environment::new();
        // transformers compiles templates with both on.
        let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.map_err(|e| anyhow!("{e}"))?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", move |format: String| -> Result<String, Error> {
            let now = now.unwrap_or_else(|| chrono::Local::now().naive_local());
            let items: Vec<_> = chrono::format::StrftimeItems::new(&format).collect();
            if items.contains(&chrono::format::Item::Error) {
                return Err(Error::new(ErrorKind::InvalidOperation, format!("bad strftime format {format:?}")));
            }
            Ok(now.format_with_items(items.into_iter()).to_string())
        });
        env.add_filter("tojson", tojson);
        // As in Python, `none` is not iterable (minijinja's own test says it is), so
        // `tools is iterable and tools | length > 0` holds up when no tools are given.
        env.add_test("iterable", |v: Value| !v.is_none() && v.try_iter().is_ok());
        env.add_test("none", |v: Value| v.is_none() || v.downcast_object_ref::<PyNone>().is_some());
        // jinja2's select/reject/map filters test their input before iterating it, so
        // `None | selectattr(...)` is empty there.
        use minijinja::filters;
        env.add_filter("select", |st: &mut State, v: Value, t: Option<Cow<str>>, a: Rest<ValueOrKwargs>| {
            filters::select(st, or_empty(v), t, a)
        });
        env.add_filter("reject", |st: &mut State, v: Value, t: Option<Cow<str>>, a: Rest<ValueOrKwargs>| {
            filters::reject(st, or_empty(v), t, a)
        });
        env.add_filter(
            "selectattr",
            |st: &mut State, v: Value, attr: Cow<str>, t: Option<Cow<str>>, a: Rest<ValueOrKwargs>| {
                filters::selectattr(st, or_empty(v), attr, t, a)
            },
        );
        env.add_filter(
            "rejectattr",
            |st: &mut State, v: Value, attr: Cow<str>, t: Option<Cow<str>>, a: Rest<ValueOrKwargs>| {
                filters::rejectattr(st, or_empty(v), attr, t, a)
            },
        );
        env.add_filter("map", |st: &mut State, v: Value, a: Rest<ValueOrKwargs>| {
            Ok::<_, Error>(Value::from_object(Generator(filters::map(st, or_empty(v), a)?)))
        });
        env.add_template_owned("chat", source.to_owned()).map_err(|e| anyhow!("chat template does not parse: {e}"))?;
        Ok(ChatTemplate { env, bos_token, eos_token })
    }

    /// The prompt text for a conversation, ending with the assistant turn's opening when
    /// `add_generation_prompt`.
    pub fn render(&self, ctx: &ChatContext<'_>) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
        // As transformers passes it: `tools=None` when the request has none.
        let tools = match ctx.tools {
            Some(t) => Value::from(minijinja::value::Serde(t)),
            None => Value::from_object(PyNone),
        };
        let kwargs = Value::from(minijinja::value::Serde(ctx.kwargs.cloned().unwrap_or_default()));
        // The keys named here win over the same keys among the kwargs.
        tmpl.render(context! {
            messages => minijinja::value::Serde(ctx.messages),
            tools => tools,
            add_generation_prompt => ctx.add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..kwargs
        })
        .map_err(|e| anyhow!("rendering the chat template: {e}"))
    }
}

/// Python's `None` where minijinja's `none` behaves differently: iterating it, or taking
/// its length, is an error (minijinja iterates `none` as empty, so a template that loops
/// over `tools` without checking would render where transformers refuses). It is falsy,
/// `is none`, and serializes as `null`.
#[derive(Debug)]
struct PyNone;

impl Object for PyNone {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Plain
    }

    fn is_true(self: &Arc<Self>) -> bool {
        false
    }

    fn render(self: &Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("None")
    }
}

/// What jinja2's `map` filter returns: a generator, which iterates like a list but cannot
/// be turned into JSON (`tools | map(...) | tojson` fails there, so it fails here).
#[derive(Debug)]
struct Generator(Vec<Value>);

impl Object for Generator {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Iterable
    }

    fn enumerate(self: &Arc<Self>) -> minijinja::value::Enumerator {
        self.mapped_enumerator(|this| Box::new(this.0.clone().into_iter()))
    }
}

/// A [`PyNone`] as the empty list; anything else as it is.
fn or_empty(v: Value) -> Value {
    if v.downcast_object_ref::<PyNone>().is_some() {
        Value::from(Vec::<Value>::new())
    } else {
        v
    }
}

/// Python's `json.dumps` as transformers' templates call it (`ensure_ascii=False`; `, ` and
/// `: ` separators, or newlines with `indent`); minijinja's own filter writes compact,
/// HTML-escaped JSON, which changes the prompt.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if value.downcast_object_ref::<PyNone>().is_some() {
        return Ok(Value::from("null"));
    }
    if value.downcast_object_ref::<Generator>().is_some() {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "a generator (the result of map) is not JSON serializable",
        ));
    }
    let json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write_py_json(&json, indent, sort_keys.unwrap_or(false), 0, &mut out);
    // A plain string, as Python's: an `| e` after it escapes it.
    Ok(Value::from(out))
}

fn write_py_json(v: &Json, indent: Option<usize>, sort: bool, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_py_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            let mut entries: Vec<_> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> Json {
        serde_json::json!({"role": role, "content": content})
    }

    fn render(t: &ChatTemplate, messages: &[Json], add_generation_prompt: bool) -> Result<String> {
        t.render(&ChatContext { messages, add_generation_prompt, ..Default::default() })
    }

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let t = ChatTemplate::new(CHATML, String::new(), String::new()).unwrap();
        let out = render(&t, &[msg("user", "Hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn kwargs_cannot_replace_the_conversation() {
        let t =
            ChatTemplate::new("{{ messages[0].content }}|{{ bos_token }}|{{ date_string }}", "<s>".into(), "".into())
                .unwrap();
        let kwargs = serde_json::json!({"messages": [{"role": "user", "content": "forged"}], "bos_token": "X",
            "date_string": "26 Jul 2024"});
        let ctx = ChatContext {
            messages: &[msg("user", "real")],
            kwargs: kwargs.as_object(),
            add_generation_prompt: false,
            tools: None,
        };
        assert_eq!(t.render(&ctx).unwrap(), "real|<s>|26 Jul 2024");
    }

    #[test]
    fn python_helpers_and_raise_exception() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}[{{ m.content.strip() | upper }}]{% endfor %}";
        let t = ChatTemplate::new(src, "<s>".into(), "</s>".into()).unwrap();
        assert_eq!(render(&t, &[msg("user", "  hi ")], false).unwrap(), "<s>[HI]");
        let err = render(&t, &[msg("tool", "x")], false).unwrap_err().to_string();
        assert!(err.contains("bad role tool"), "{err}");
        assert!(ChatTemplate::new("{% if %}", String::new(), String::new()).is_err());
    }
}
