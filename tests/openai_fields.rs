//! vLLM's and OpenAI's extra request fields that weft honours: `min_tokens`,
//! `include_stop_str_in_output`, `truncate_prompt_tokens`, `best_of`,
//! `stream_options.continuous_usage_stats`; and `suffix`, refused with its reason.

mod common;

use common::{server::Server, SMOL};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extra_fields_do_what_they_say() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    let s = Server::start(SMOL, &["--dtype", "f32"]).await;
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 40, "temperature": 0});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    // The answer ends (EOS) after a few tokens; min_tokens holds EOS back.
    let (_, v) = s.post("/v1/chat/completions", chat(json!({}))).await;
    let short = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(short < 20 && v["choices"][0]["finish_reason"] == "stop", "{v}");
    let (_, v) = s.post("/v1/chat/completions", chat(json!({"min_tokens": 20}))).await;
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 20, "{v}");
    let (st, v) = s.post("/v1/chat/completions", chat(json!({"min_tokens": 41}))).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("min_tokens")));

    let complete = |extra: Value| {
        let mut b = json!({"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let text = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_owned();
    let (_, v) = s.post("/v1/completions", complete(json!({"stop": ["Paris"]}))).await;
    assert_eq!(text(&v), " ");
    let (_, v) =
        s.post("/v1/completions", complete(json!({"stop": ["Paris"], "include_stop_str_in_output": true}))).await;
    assert_eq!(text(&v), " Paris");

    let ids: Vec<u32> = (0..50).map(|i| 100 + i).collect();
    let (_, v) = s.post("/v1/completions", json!({"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 5})).await;
    assert_eq!(v["usage"]["prompt_tokens"], 5, "{v}");
    let (_, v) = s.post("/v1/completions", json!({"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": -1})).await;
    assert_eq!(v["usage"]["prompt_tokens"], 50, "{v}");
    let (st, _) = s.post("/v1/completions", json!({"prompt": ids, "truncate_prompt_tokens": 0})).await;
    assert_eq!(st, 400);

    // best_of: three samples, the likeliest returned; its logprobs only when asked for.
    let body = complete(json!({"best_of": 3, "temperature": 1.0, "seed": 3, "max_tokens": 8}));
    let (st, v) = s.post("/v1/completions", body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);
    assert!(v["choices"][0]["logprobs"].is_null());
    assert_eq!(v["usage"]["completion_tokens"], 24, "every sample counts: {v}");
    let body = complete(json!({"best_of": 4, "n": 2, "temperature": 1.0, "seed": 3, "logprobs": 0, "max_tokens": 8}));
    let (_, v) = s.post("/v1/completions", body).await;
    let total = |c: &Value| {
        c["logprobs"]["token_logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).sum::<f64>()
    };
    let cs = v["choices"].as_array().unwrap();
    assert_eq!(cs.len(), 2);
    assert!(total(&cs[0]) >= total(&cs[1]));
    for (bad, param) in [
        (complete(json!({"best_of": 1, "n": 2})), "best_of"),
        (complete(json!({"best_of": 2, "stream": true})), "best_of"),
        (complete(json!({"best_of": 33})), "best_of"),
        (complete(json!({"suffix": "end"})), "suffix"),
    ] {
        let (st, v) = s.post("/v1/completions", bad).await;
        assert_eq!((st, v["error"]["param"].as_str()), (400, Some(param)), "{v}");
    }

    // continuous_usage_stats: every chunk counts the tokens so far.
    let events = s
        .stream(
            "/v1/completions",
            complete(json!({"stream": true, "stream_options": {"continuous_usage_stats": true}})),
        )
        .await;
    let counts: Vec<u64> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["usage"]["completion_tokens"].as_u64().unwrap())
        .collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]) && *counts.last().unwrap() == 5, "{counts:?}");
    s.assert_idle().await;
}
