//! Structured output: grammar masks, constrained generation in busy batches, and the API's
//! `response_format` / `structured_outputs` / `guided_*` fields over HTTP.

mod common;

use common::server::Server;
use common::{collect, shared_models, SMOL};
use serde_json::{json, Value};
use weft::engine::{EngineConfig, EngineHandle, FinishReason, Request};
use weft::grammar::{Constraint, Grammar, GrammarCompiler};
use weft::model::WeightDtype;
use weft::tokenizer::Tokenizer;

/// Random weights, the real Qwen2 vocabulary (151k tokens): its free output is noise.
const NOISE: &str = "tiny-qwen2";

/// Five schemas, bounded so that even a noise model's output ends inside `max_tokens`: short
/// values, at most 17 places for whitespace (23 characters each), under 500 tokens in all.
fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}},
            "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "minItems": 1, "maxItems": 4}),
        json!({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
            "required": ["color", "ok"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3,
            "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}}},
            "required": ["tags"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                "y": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["x", "y"],
                "additionalProperties": false},
            "label": {"type": ["string", "null"], "maxLength": 8}},
            "required": ["point", "label"], "additionalProperties": false}),
    ]
}

fn assert_valid(schema: &Value, text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let validator = jsonschema::validator_for(schema).unwrap();
    assert!(validator.is_valid(&v), "{text} does not follow {schema}");
}

/// Whether `text` is one JSON object. JSON bounds no number, and the free-form grammar lets the
/// model write `1e400`, which `Value` (f64) refuses; values are checked for syntax only.
fn is_json_object(text: &str) -> bool {
    serde_json::from_str::<std::collections::BTreeMap<String, serde::de::IgnoredAny>>(text).is_ok()
}

#[test]
fn json_object_check_takes_any_number_and_only_objects() {
    assert!(is_json_object(r#"{"a": 1e400, "b": [-12345678901234567890123, {"c": null}]}"#));
    assert!(!is_json_object("[1]"));
    assert!(!is_json_object(r#"{"a": 1e}"#));
    assert!(!is_json_object(r#"{"a": 1} x"#));
}

/// Walks the grammar by the text's own tokens, checking each is allowed, then whether it may end.
fn accepts(c: &mut Constraint, tok: &Tokenizer, text: &str) -> bool {
    for id in tok.encode_with(text, false).unwrap() {
        if !c.allowed().unwrap().is_allowed(id) {
            return false;
        }
        c.commit(id).unwrap();
    }
    c.allowed().unwrap().is_allowed(tok.eos_ids[0])
}

#[test]
fn masks_follow_the_grammar() {
    let Some(dir) = shared_models() else { return };
    let tok = Tokenizer::from_dir(&dir.join("smollm2-135m-instruct")).unwrap();
    let g = GrammarCompiler::new(&tok).unwrap();
    let choice = Grammar::Choice(vec!["yes".into(), "no \"way\"".into()]);
    assert!(accepts(&mut g.compile(&choice).unwrap(), &tok, "no \"way\""));
    assert!(!accepts(&mut g.compile(&choice).unwrap(), &tok, "maybe"));
    let schema = Grammar::JsonSchema(schemas()[0].clone());
    assert!(accepts(&mut g.compile(&schema).unwrap(), &tok, r#"{"name": "Ann", "age": 41}"#));
    assert!(!accepts(&mut g.compile(&schema).unwrap(), &tok, r#"{"name": "Ann"}"#));
    assert!(!accepts(&mut g.compile(&schema).unwrap(), &tok, r#"{"name": "Ann", "age": 151}"#));
    // Pretty-printed JSON is whitespace the grammar takes; runs of blank lines are not.
    assert!(accepts(&mut g.compile(&schema).unwrap(), &tok, "{\n  \"name\": \"Ann\",\r\n\t\"age\" : 41\n}"));
    assert!(!accepts(&mut g.compile(&schema).unwrap(), &tok, "{\n\n\n  \"name\": \"Ann\", \"age\": 41}"));
    assert!(!accepts(&mut g.compile(&schema).unwrap(), &tok, "{\"name\":  \"Ann\", \"age\": 41}"));
    let colors = Grammar::JsonSchema(schemas()[2].clone());
    // A 135M model wrote this on a CI machine and ran out of tokens before the `}`.
    let spun = "{\n    \"color\"\n\n:\"blue\"\n\n           \n\n\n,\n\n\"ok\"\n\n:false}";
    assert!(!accepts(&mut g.compile(&colors).unwrap(), &tok, spun));
    let mut c = g.compile(&Grammar::Regex("[0-9]{3}-x".into())).unwrap();
    assert!(accepts(&mut c, &tok, "123-x"));
    assert!(c.is_done(), "nothing can follow a complete fixed-length match");
    assert!(g.compile(&Grammar::Lark("start: (".into())).is_err());
    assert!(g.compile(&Grammar::Choice(vec![])).is_err());
}

/// A request for `schema`: greedy, or sampled with a seed.
fn constrained(e: &EngineHandle, prompt: &[u32], schema: &Value, seed: Option<u64>) -> Request {
    let mut r = Request::new(prompt.to_vec(), 500);
    if let Some(s) = seed {
        r.sampling.temperature = 1.0;
        r.sampling.seed = Some(s);
    }
    r.constraint = Some(e.model().grammars().unwrap().compile(&Grammar::JsonSchema(schema.clone())).unwrap());
    r
}

/// 100 requests over 5 schemas at once, on a real model and on a noise model: every output
/// parses and follows its schema, and batching changes nothing — a constrained greedy request
/// gives the same tokens alone and in the crowd, and so does an unconstrained one beside it.
#[test]
fn hundred_constrained_requests_all_follow_their_schemas() {
    if shared_models().is_none() {
        return;
    }
    for (rel, dtype) in [(SMOL, WeightDtype::Auto), (NOISE, WeightDtype::F32)] {
        let e = EngineHandle::start(common::model_as(rel, dtype), EngineConfig::default()).unwrap();
        let tok = &e.model().tokenizer;
        let prompt = tok.encode("Describe a person as JSON:").unwrap();
        let schemas = schemas();
        let alone = collect(e.submit(constrained(&e, &prompt, &schemas[0], None)).unwrap());
        let free_alone = collect(e.submit(Request::new(prompt.clone(), 40)).unwrap());
        let mut streams = Vec::new();
        for i in 0..100 {
            let seed = (i % 2 == 1).then_some(i as u64);
            streams.push((i % 5, e.submit(constrained(&e, &prompt, &schemas[i % 5], seed)).unwrap()));
        }
        let free = e.submit(Request::new(prompt.clone(), 40)).unwrap();
        for (k, stream) in streams {
            let out = collect(stream);
            assert_eq!(out[0].finish, Some(FinishReason::Stop), "{rel}: {:?}", out[0].text);
            assert_valid(&schemas[k], &out[0].text);
        }
        assert_eq!(collect(free)[0].tokens, free_alone[0].tokens, "{rel}: a mask leaked into another sequence");
        let again = collect(e.submit(constrained(&e, &prompt, &schemas[0], None)).unwrap());
        assert_eq!(again[0].tokens, alone[0].tokens, "{rel}");
        // n = 2 forks after the first masked sample; each sample keeps to the grammar.
        let mut r = constrained(&e, &prompt, &schemas[2], Some(5));
        r.n = 2;
        for out in collect(e.submit(r).unwrap()) {
            assert_valid(&schemas[2], &out.text);
        }
        let st = e.stats();
        assert!(st.grammar_masks > 0);
        eprintln!(
            "{rel}: {} masks, {:.1} µs each",
            st.grammar_masks,
            st.grammar_mask_time.as_secs_f64() * 1e6 / st.grammar_masks as f64
        );
        common::assert_all_blocks_free(&e);
    }
}

/// Every way the API names a constraint, through HTTP; async-openai's `response_format`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_constraints_over_http() {
    use async_openai::config::OpenAIConfig;
    use async_openai::types::chat::{ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs};
    use async_openai::types::chat::{ResponseFormat, ResponseFormatJsonSchema};
    use async_openai::Client;
    if common::fixture(SMOL).is_none() {
        return;
    }
    let s = Server::start(SMOL, &[]).await;
    let client = Client::with_config(OpenAIConfig::new().with_api_base(format!("{}/v1", s.base)));
    let schema = schemas()[0].clone();
    let msg = ChatCompletionRequestUserMessageArgs::default().content("Invent a person.").build().unwrap();
    let req = CreateChatCompletionRequestArgs::default()
        .model("SmolLM2-135M-Instruct.Q4_1")
        .messages(vec![msg.into()])
        .max_tokens(500u32)
        .response_format(ResponseFormat::JsonSchema {
            json_schema: ResponseFormatJsonSchema {
                name: "person".into(),
                schema: schema.clone(),
                strict: Some(true),
                description: None,
            },
        })
        .build()
        .unwrap();
    let resp = client.chat().create(req).await.unwrap();
    assert_valid(&schema, resp.choices[0].message.content.as_deref().unwrap());

    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 500});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let text = |v: &Value| v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    let city = json!({"messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        "max_tokens": 400, "response_format": {"type": "json_object"}});
    let (st, v) = s.post("/v1/chat/completions", city).await;
    assert_eq!(st, 200, "{v}");
    // A free-form object may run to max_tokens (a 135M model writes long, odd ones); one
    // that ends is whole.
    match v["choices"][0]["finish_reason"].as_str() {
        Some("stop") => assert!(is_json_object(&text(&v)), "{v}"),
        _ => assert_eq!(v["usage"]["completion_tokens"], 400, "{v}"),
    }
    let (st, v) = s.post("/v1/chat/completions", chat(json!({"guided_choice": ["left", "right"]}))).await;
    assert_eq!(st, 200, "{v}");
    assert!(["left", "right"].contains(&text(&v).as_str()), "{v}");
    let (_, v) = s.post("/v1/chat/completions", chat(json!({"guided_regex": "[A-Z][a-z]{2,5}!"}))).await;
    let t = text(&v);
    assert!(t.ends_with('!') && t.chars().next().unwrap().is_ascii_uppercase(), "{t}");
    let (_, v) = s.post("/v1/chat/completions", chat(json!({"structured_outputs": {"json": schemas()[1]}}))).await;
    assert_valid(&schemas()[1], &text(&v));
    let (_, v) = s.post("/v1/chat/completions", chat(json!({"guided_json": schemas()[2].to_string()}))).await;
    assert_valid(&schemas()[2], &text(&v));
    let lark = r#"start: "x=" NUM ";"
NUM: /[0-9]{1,3}/"#;
    let (_, v) = s.post("/v1/completions", json!({"prompt": "Set", "guided_grammar": lark, "max_tokens": 20})).await;
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(t.starts_with("x=") && t.ends_with(';'), "{t}");
    // Streaming sends the same constrained text in pieces.
    let events = s
        .stream(
            "/v1/completions",
            json!({"prompt": "Pick", "guided_choice": ["alpha", "beta"],
        "stream": true, "max_tokens": 10}),
        )
        .await;
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(["alpha", "beta"].contains(&streamed.as_str()), "{streamed}");
    // Bad grammars and conflicting constraints are the client's error.
    for bad in [
        json!({"guided_regex": "(unclosed"}),
        json!({"guided_grammar": "start: ("}),
        json!({"guided_json": "not json"}),
        json!({"guided_choice": []}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
        json!({"response_format": {"type": "yaml"}}),
        json!({"guided_choice": ["a"], "guided_regex": "a"}),
    ] {
        let (st, v) = s.post("/v1/chat/completions", chat(bad.clone())).await;
        assert_eq!(st, 400, "{bad}: {v}");
    }
    s.assert_idle().await;
}
