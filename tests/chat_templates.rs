//! Real chat templates (`../shared/chat-templates/`) rendered by weft against the renderings
//! transformers' jinja2 engine produced: byte for byte, and refused where jinja2 refused.

mod common;

use common::shared_models;
use serde_json::Value;
use weft::tokenizer::{ChatContext, ChatTemplate};

/// Renderings where weft knowingly departs from jinja2: (template, conversations, why).
const KNOWN: &[(&str, &[&str], &str)] = &[
    // `"..."|safe + t | tojson`: jinja2's Markup escapes the JSON it is added to (&#34;),
    // minijinja's safe strings do not; weft's prompt carries the JSON the model was trained on.
    ("meetkai-functionary-medium-v3.1.jinja", &["tool_call"], "Markup concatenation does not escape"),
];

#[test]
fn real_templates_render_as_jinja2_does() {
    let Some(models) = shared_models() else { return };
    let dir = models.join("../chat-templates");
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let mut failures = Vec::new();
    for case in &cases {
        let name = case["template"].as_str().unwrap();
        let id = format!("{name} / {}", case["conversation_id"].as_str().unwrap_or("?"));
        let source = std::fs::read_to_string(dir.join(name)).unwrap();
        let now = chrono::NaiveDateTime::parse_from_str(case["now"].as_str().unwrap(), "%Y-%m-%dT%H:%M:%S").unwrap();
        let token = |k: &str| case[k].as_str().unwrap_or("").to_string();
        let t = match ChatTemplate::with_clock(&source, token("bos_token"), token("eos_token"), Some(now)) {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{id}: does not compile: {e}"));
                continue;
            }
        };
        let ctx = ChatContext {
            messages: case["messages"].as_array().unwrap(),
            tools: case["tools"].as_array().map(Vec::as_slice),
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            kwargs: None,
        };
        let got = t.render(&ctx);
        let conv = case["conversation_id"].as_str().unwrap_or("?");
        // A known difference may render where jinja2 differs; anything else is compared.
        if got.is_ok() && KNOWN.iter().any(|(t, convs, _)| *t == name && convs.contains(&conv)) {
            continue;
        }
        match (case.get("rendered").and_then(Value::as_str), got) {
            (Some(want), Ok(got)) if got == want => {}
            (Some(want), Ok(got)) => {
                failures.push(format!("{id}: rendered differently\n--- want\n{want}\n--- got\n{got}"))
            }
            (Some(_), Err(e)) => failures.push(format!("{id}: refused: {e:#}")),
            (None, Ok(_)) => failures.push(format!("{id}: jinja2 refused ({}) but weft rendered", case["error"])),
            (None, Err(_)) => {}
        }
    }
    assert!(failures.is_empty(), "{} of {} renderings differ:\n{}", failures.len(), cases.len(), failures.join("\n\n"));
    // Every known difference names a template that is still in the set.
    for (t, _, why) in KNOWN {
        assert!(cases.iter().any(|c| c["template"] == *t), "stale known difference {t}: {why}");
    }
}
