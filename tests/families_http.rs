//! Every model family served over HTTP: the reference prompts through `/v1/completions`
//! and the chat cases through `/v1/chat/completions` give the reference continuations.

mod common;

use common::server::Server;
use common::{reference_json, shared_models, FAMILIES};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn families_serve_the_reference_continuations() {
    if shared_models().is_none() {
        return;
    }
    for family in FAMILIES {
        let doc = reference_json(family);
        let kwargs = doc["tokenization"].get("chat_template_kwargs").cloned().unwrap_or(json!({}));
        for path in [family.to_string(), format!("{family}/{family}.gguf")] {
            let s = Server::start(&path, &[]).await;
            for case in doc["cases"].as_array().unwrap() {
                let id = format!("{path} {}", case["id"]);
                let n = case["generated_token_ids"].as_array().unwrap().len();
                let common =
                    json!({"max_tokens": n, "temperature": 0, "ignore_eos": true, "skip_special_tokens": false});
                let (status, body) = match case.get("messages") {
                    Some(messages) => {
                        let mut req = json!({"messages": messages, "add_generation_prompt": case["add_generation_prompt"],
                            "chat_template_kwargs": kwargs});
                        // /tokenize with the same messages gives the ids the chat endpoint uses.
                        let (st, tok) = s.post("/tokenize", req.clone()).await;
                        assert_eq!((st, &tok["tokens"]), (200, &case["prompt_token_ids"]), "{id}: /tokenize");
                        merge(&mut req, &common);
                        s.post("/v1/chat/completions", req).await
                    }
                    None => {
                        let mut req = json!({"prompt": case["prompt"]});
                        merge(&mut req, &common);
                        s.post("/v1/completions", req).await
                    }
                };
                assert_eq!(status, 200, "{id}: {body}");
                assert_eq!(body["usage"]["prompt_tokens"], case["num_prompt_tokens"], "{id}");
                assert_eq!(body["usage"]["completion_tokens"], n, "{id}");
                // Text is compared where no step is too close to call.
                if case["min_step_margin"].as_f64().unwrap() > 1e-3 {
                    let choice = &body["choices"][0];
                    let text = choice["text"].as_str().or(choice["message"]["content"].as_str()).unwrap();
                    assert_eq!(text, case["generated_text_delta"].as_str().unwrap(), "{id}");
                }
            }
        }
    }
}

fn merge(into: &mut Value, from: &Value) {
    for (k, v) in from.as_object().unwrap() {
        into[k] = v.clone();
    }
}

/// `--chat-template FILE` replaces the model's template; one that does not parse stops the
/// server at startup with the file named.
#[tokio::test(flavor = "multi_thread")]
async fn chat_template_flag_overrides_the_model_template() {
    let Some(models) = shared_models() else { return };
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("plain.jinja");
    std::fs::write(&good, "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    let s = Server::start("tiny-qwen2", &["--chat-template", good.to_str().unwrap()]).await;
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    // "Hello" + " world", with none of the model's own ChatML around it.
    assert_eq!(body["usage"]["prompt_tokens"], 2, "{body}");

    let bad = dir.path().join("broken.jinja");
    std::fs::write(&bad, "{% for m in messages %}").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["serve", "--port", "0", "--model"])
        .arg(models.join("tiny-qwen2"))
        .arg("--chat-template")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("broken.jinja") && err.contains("does not parse"), "{err}");
}

/// `--served-model-name`: the first name is reported, every name is accepted, any other
/// model is OpenAI's 404 `model_not_found`; `/v1/models/{id}` and `/version` answer;
/// unknown request fields are ignored.
#[tokio::test(flavor = "multi_thread")]
async fn served_model_names_and_model_routes() {
    if shared_models().is_none() {
        return;
    }
    let s = Server::start("tiny-qwen2", &["--served-model-name", "qwen-tiny", "gpt-3.5-turbo"]).await;
    let (_, list) = s.get("/v1/models").await;
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list["data"][0]["id"], "qwen-tiny");
    for name in ["qwen-tiny", "gpt-3.5-turbo"] {
        let (status, body) = s.post("/v1/completions", json!({"model": name, "prompt": "Hi", "max_tokens": 1})).await;
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(body["model"], "qwen-tiny");
        let (status, card) = s.get(&format!("/v1/models/{name}")).await;
        assert_eq!(status, 200, "{card}");
        assert_eq!(serde_json::from_str::<Value>(&card).unwrap()["id"], name);
    }
    let (status, body) = s
        .post("/v1/chat/completions", json!({"model": "tiny-qwen2", "messages": [{"role": "user", "content": "Hi"}]}))
        .await;
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("model_not_found")), "{body}");
    assert_eq!(s.get("/v1/models/other").await.0, 404);
    // Tokenizing answers for the models served, as the completions do.
    let chat = json!([{"role": "user", "content": "Hi"}]);
    for (route, body) in [
        ("/tokenize", json!({"prompt": "Hi"})),
        ("/tokenize", json!({"messages": chat})),
        ("/detokenize", json!({"tokens": [1]})),
    ] {
        let mut named = body.clone();
        named["model"] = json!("gpt-3.5-turbo");
        assert_eq!(s.post(route, named.clone()).await.0, 200, "{route}");
        named["model"] = json!("tiny-qwen2");
        let (status, err) = s.post(route, named).await;
        assert_eq!((status, err["error"]["code"].as_str()), (404, Some("model_not_found")), "{route}: {err}");
    }
    // Fields weft has no use for are ignored (as vLLM does); ones it cannot honour are refused.
    let extra = json!({"model": "qwen-tiny", "prompt": "Hi", "max_tokens": 1, "store": true,
        "metadata": {"k": "v"}, "service_tier": "auto", "some_new_field": [1, 2]});
    let (status, body) = s.post("/v1/completions", extra).await;
    assert_eq!(status, 200, "{body}");
    let functions = json!({"messages": [{"role": "user", "content": "Hi"}], "functions": [], "max_tokens": 1});
    let (status, body) = s.post("/v1/chat/completions", functions).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("functions")), "{body}");
    let (status, version) = s.get("/version").await;
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&version).unwrap()["version"], env!("CARGO_PKG_VERSION"));
}
