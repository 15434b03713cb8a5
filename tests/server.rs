//! The real server on a free loopback port, driven with raw HTTP and with the async-openai
//! client: completions and chat, streaming and not, n > 1, stop, logprobs, every error path,
//! disconnects, 429, timeouts, auth, a 64-stream load test and graceful shutdown.

mod common;

use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{server::Server, SMOL, STORIES};

fn stream_text(events: &[String], field: impl Fn(&Value) -> Option<String>) -> String {
    events.iter().filter(|e| *e != "[DONE]").filter_map(|e| field(&serde_json::from_str(e).unwrap())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_streaming_and_every_error_path() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start(STORIES, &["--max-body-bytes", "2K", "--max-batch-prompts", "4"]).await;
    let reference = common::reference(STORIES);
    let greedy = json!({"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "ignore_eos": true});
    let (st, body) = s.post("/v1/completions", greedy.clone()).await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], reference[1].generated_text_delta.as_str());
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 32, "total_tokens": 37, "prompt_tokens_details": {"cached_tokens": 0}})
    );

    let mut streaming = greedy.clone();
    streaming["stream"] = json!(true);
    streaming["stream_options"] = json!({"include_usage": true});
    let events = s.stream("/v1/completions", streaming).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert_eq!(
        stream_text(&events, |v| v["choices"][0]["text"].as_str().map(str::to_owned)),
        body["choices"][0]["text"]
    );
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 32);

    let (_, body) = s
        .post("/v1/completions", json!({"prompt": ["Tom", "Lily"], "max_tokens": 5, "n": 2, "seed": 1, "logprobs": 2}))
        .await;
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    assert_eq!(choices[3]["index"], 3);
    assert_eq!(choices[0]["logprobs"]["top_logprobs"][0].as_object().unwrap().len(), 2);
    let (_, body) = s
        .post(
            "/v1/completions",
            json!({"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "stop": ["Lily"]}),
        )
        .await;
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["choices"][0]["text"], ", there was a little girl named ");

    // Bad input: clear 4xx answers in OpenAI's error shape, never a 500.
    let cases: Vec<(Value, u16, Option<&str>)> = vec![
        (json!({"prompt": "x", "temperature": "hot"}), 400, Some("temperature")),
        (json!({"prompt": "x", "temperature": -1}), 400, Some("temperature")),
        (json!({"prompt": "x", "response_format": {"type": "yaml"}}), 400, Some("response_format.type")),
        (json!({"prompt": "x", "suffix": "y"}), 400, Some("suffix")),
        (json!({"prompt": "x", "model": "gpt-4"}), 404, Some("model")),
        (json!({"prompt": []}), 400, Some("prompt")),
        (json!({"prompt": [[]]}), 400, Some("prompt")),
        (json!({"prompt": "x", "max_tokens": 600}), 400, Some("max_tokens")),
        (json!({"prompt": "x", "n": 0}), 400, Some("n")),
        (json!({"prompt": "x", "logit_bias": {"abc": 1}}), 400, Some("logit_bias")),
        (json!([1, 2]), 400, None),
    ];
    for (body, status, param) in cases {
        let (st, resp) = s.post("/v1/completions", body.clone()).await;
        assert_eq!(st, status, "{body} -> {resp}");
        assert_eq!(resp["error"]["type"], "invalid_request_error", "{resp}");
        assert_eq!(resp["error"]["param"].as_str(), param, "{body} -> {resp}");
    }
    let (_, resp) = s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 600})).await;
    assert!(resp["error"]["message"].as_str().unwrap().contains("context length of 512"), "{resp}");
    assert_eq!(s.post_raw("/v1/completions", "{\"prompt\": ").await.0, 400);
    assert_eq!(s.post_raw("/v1/completions", vec![0xff, 0xfe, b'{']).await.0, 400);
    assert_eq!(s.post_raw("/v1/completions", "x".repeat(4096)).await.0, 413);
    // Far over the limit, the 413 still reaches a client that is still sending.
    assert_eq!(s.post_raw("/v1/completions", "x".repeat(8 << 20)).await.0, 413);
    // Every answer carries x-request-id: the client's, else weft's own.
    let url = format!("{}/v1/completions", s.base);
    let r = s.http.post(&url).header("x-request-id", "trace-42").body("{}").send().await.unwrap();
    assert_eq!(r.headers()["x-request-id"], "trace-42");
    let r = s.http.get(format!("{}/nope", s.base)).send().await.unwrap();
    assert!(r.headers()["x-request-id"].to_str().unwrap().starts_with("req-"), "{:?}", r.headers());
    // An image part is a 400 that says why.
    let part = json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}});
    let (st, err) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": [part]}]})).await;
    assert_eq!(st, 400, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("reads text only"), "{err}");
    assert_eq!(s.get("/nope").await.0, 404);
    assert_eq!(s.get("/v1/completions").await.0, 405);
    let (st, chat) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!((st, chat["error"]["param"].as_str()), (400, Some("messages")), "stories260k has no chat template");

    // The native and utility routes.
    let (_, models) = s.get("/v1/models").await;
    assert!(models.contains("stories260k"));
    let (_, tok) = s.post("/tokenize", json!({"prompt": "Once upon a time"})).await;
    assert_eq!(tok["tokens"], json!([1, 403, 407, 261, 378]));
    let (_, tok) = s.post("/tokenize", json!({"prompt": "Once upon a time", "add_special_tokens": false})).await;
    assert_eq!(tok["tokens"], json!([403, 407, 261, 378]));
    let (_, detok) = s.post("/detokenize", json!({"tokens": [403, 407]})).await;
    assert_eq!(detok["prompt"], "Once upon");
    assert_eq!(s.post("/detokenize", json!({"tokens": [99999]})).await.0, 400);
    let (_, gen) = s.post("/generate", json!({"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0})).await;
    assert_eq!(gen["text"], reference[1].generated_text_delta.as_str());
    let events = s
        .stream("/generate", json!({"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "stream": true}))
        .await;
    assert_eq!(stream_text(&events, |v| v["text"].as_str().map(str::to_owned)), gen["text"]);
    let (st, batch) = s
        .post(
            "/generate/batch",
            json!({"prompts": ["Once upon a time", "Tom and Lily"], "max_tokens": 8, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(batch["total_prompts"], 2);
    assert_eq!(batch["results"].as_array().unwrap().len(), 2);
    assert!(batch["avg_time_per_prompt"].as_f64().unwrap() > 0.0);
    let (st, resp) = s.post("/generate/batch", json!({"prompts": ["a", "b", "c", "d", "e"]})).await;
    assert_eq!((st, resp["error"]["param"].as_str()), (400, Some("prompts")));
    let (_, doc) = s.get("/openapi.json").await;
    let doc: Value = serde_json::from_str(&doc).unwrap();
    for path in [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/generate/batch",
        "/metrics",
        "/health",
    ] {
        assert!(doc["paths"].get(path).is_some(), "{path} missing from the OpenAPI document");
    }
    s.assert_idle().await;
    assert!(s.metric("weft:generation_tokens_total ").await > 0.0);
}

/// 64 concurrent greedy streams of mixed lengths all complete, each equal to the same
/// request answered without streaming; afterwards nothing runs and every block is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_test_64_concurrent_streams() {
    if common::shared_models().is_none() {
        return;
    }
    let s = std::sync::Arc::new(Server::start(STORIES, &[]).await);
    let prompts = ["Once upon a time", "Tom and Lily", "The little dog", "One day, a girl", "Sam had a red ball"];
    let mut tasks = Vec::new();
    for i in 0..64 {
        let s = s.clone();
        let body =
            json!({"prompt": prompts[i % 5], "max_tokens": 8 + (i * 7) % 90, "temperature": 0, "ignore_eos": true});
        tasks.push(tokio::spawn(async move {
            let mut streaming = body.clone();
            streaming["stream"] = json!(true);
            let events = s.stream("/v1/completions", streaming).await;
            assert_eq!(events.last().unwrap(), "[DONE]");
            let streamed = stream_text(&events, |v| v["choices"][0]["text"].as_str().map(str::to_owned));
            let (st, plain) = s.post("/v1/completions", body).await;
            assert_eq!(st, 200);
            assert_eq!(streamed, plain["choices"][0]["text"].as_str().unwrap(), "request {i}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    s.assert_idle().await;
}

/// Clients that go away, streaming or not, abort their sequences and free their blocks;
/// a full queue answers 429 with Retry-After; a request over --request-timeout is aborted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnects_overload_and_timeouts_free_their_blocks() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    let s =
        Server::start(SMOL, &["--max-num-seqs", "1", "--max-waiting-requests", "1", "--request-timeout", "3"]).await;
    let long = json!({"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": true});

    // Streaming: read the first chunk, then hang up.
    let mut streaming = long.clone();
    streaming["stream"] = json!(true);
    let mut r = s.http.post(format!("{}/v1/completions", s.base)).body(streaming.to_string()).send().await.unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    s.wait_metric("weft:num_requests_running ", 1.0).await;
    drop(r);
    s.assert_idle().await;

    // Non-streaming: the client gives up after 300 ms.
    let quick = reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap();
    assert!(quick.post(format!("{}/v1/completions", s.base)).body(long.to_string()).send().await.is_err());
    s.assert_idle().await;

    // One running, one waiting: the next ones are refused with 429 and Retry-After.
    let spawn = |body: Value| {
        let (http, url) = (s.http.clone(), format!("{}/v1/completions", s.base));
        tokio::spawn(async move { http.post(url).body(body.to_string()).send().await })
    };
    let running = spawn(long.clone());
    s.wait_metric("weft:num_requests_running ", 1.0).await;
    let waiting = spawn(long.clone());
    s.wait_metric("weft:num_requests_waiting ", 1.0).await;
    let busy = [running, waiting];
    let r = s.http.post(format!("{}/v1/completions", s.base)).body(long.to_string()).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    // The two busy ones end at the 3 s request timeout with a 504 and free their blocks.
    for b in busy {
        let r = b.await.unwrap().unwrap();
        assert_eq!(r.status(), 504);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], "timeout_error", "{body}");
    }
    s.assert_idle().await;
}

/// The async-openai client works unchanged: chat and completions, streaming and not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_chat_and_completions() {
    use async_openai::config::OpenAIConfig;
    use async_openai::types::chat::{ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs};
    use async_openai::types::completions::CreateCompletionRequestArgs;
    use async_openai::Client;
    use tokio_stream::StreamExt;
    if common::fixture(SMOL).is_none() {
        return;
    }
    // The exact f32 path, whose greedy answer is known.
    let s = Server::start(SMOL, &["--api-key", "sekret", "--dtype", "f32"]).await;
    let model = "SmolLM2-135M-Instruct.Q4_1";
    let client =
        Client::with_config(OpenAIConfig::new().with_api_base(format!("{}/v1", s.base)).with_api_key("sekret"));
    let msg =
        ChatCompletionRequestUserMessageArgs::default().content("What is the capital of France?").build().unwrap();
    let req = CreateChatCompletionRequestArgs::default()
        .model(model)
        .messages(vec![msg.into()])
        .max_tokens(20u32)
        .temperature(0.0)
        .build()
        .unwrap();
    let resp = client.chat().create(req.clone()).await.unwrap();
    let text = resp.choices[0].message.content.clone().unwrap();
    assert_eq!(text, "The capital of France is Paris.");
    let mut stream = client.chat().create_stream(req).await.unwrap();
    let mut streamed = String::new();
    while let Some(chunk) = stream.next().await {
        for c in chunk.unwrap().choices {
            streamed += &c.delta.content.unwrap_or_default();
        }
    }
    assert_eq!(streamed, text);
    let req = CreateCompletionRequestArgs::default()
        .model(model)
        .prompt("The capital of France is")
        .max_tokens(3u32)
        .temperature(0.0)
        .build()
        .unwrap();
    let resp = client.completions().create(req).await.unwrap();
    assert_eq!(resp.choices[0].text, " Paris.\n");
    // Without the key: 401; health stays open.
    assert_eq!(s.post("/v1/completions", json!({"prompt": "x"})).await.0, 401);
    assert_eq!(s.get("/health").await.0, 200);
}

/// SIGTERM: in-flight requests finish, new ones are refused, the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_then_exits_0() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    let mut s = Server::start(SMOL, &["--shutdown-grace", "20"]).await;
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": true, "stream": true});
    let (http, url) = (s.http.clone(), format!("{}/v1/completions", s.base));
    let in_flight =
        tokio::spawn(async move { http.post(url).body(body.to_string()).send().await.unwrap().text().await.unwrap() });
    s.wait_metric("weft:num_requests_running ", 1.0).await;
    let pid = s.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    // The signal has landed once /health stops saying 200.
    let deadline = Instant::now() + Duration::from_secs(20);
    while s.get("/health").await.0 == 200 {
        assert!(Instant::now() < deadline, "SIGTERM never took effect");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = s.post_raw("/v1/completions", json!({"prompt": "x"}).to_string()).await;
    assert_ne!(refused.0, 200, "new work is refused during shutdown");
    let text = in_flight.await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "the in-flight stream completed: {text}");
    let status = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = s.child.try_wait().unwrap() {
                return st;
            }
            assert!(Instant::now() < deadline, "server did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
    assert!(status.success(), "exit status {status}");
}

/// A repeated prompt is served from the prefix cache: usage reports the cached tokens, the
/// metrics count them, and `--no-enable-prefix-caching` turns it off; a salt isolates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_over_http() {
    if common::shared_models().is_none() {
        return;
    }
    let prompt = common::reference(STORIES)[5].prompt.clone();
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
    let s = Server::start(STORIES, &[]).await;
    let (_, first) = s.post("/v1/completions", body.clone()).await;
    let (_, second) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(first["choices"][0]["text"], second["choices"][0]["text"]);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert_eq!(cached, (prompt_tokens - 1) / 16 * 16, "{second}");
    assert!(cached > 0, "the prompt spans a whole block: {second}");
    assert_eq!(s.metric("weft:prefix_cache_hits_total").await, cached as f64);
    assert_eq!(s.metric("weft:prefix_cache_queries_total").await, 2.0 * prompt_tokens as f64);
    // With usage on every chunk, each chunk reports the cached tokens the final usage does.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let chunks = s.stream("/v1/completions", streamed).await;
    let cached_per_chunk: Vec<u64> = chunks
        .iter()
        .filter(|c| *c != "[DONE]")
        .filter_map(|c| {
            serde_json::from_str::<Value>(c).unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64()
        })
        .collect();
    assert!(cached_per_chunk.len() > 1 && cached_per_chunk.iter().all(|&c| c == cached), "{chunks:?}");
    let mut salted = body.clone();
    salted["cache_salt"] = json!("tenant-b");
    let (_, other) = s.post("/v1/completions", salted).await;
    assert_eq!(other["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "another tenant's salt");

    let off = Server::start(STORIES, &["--no-enable-prefix-caching"]).await;
    off.post("/v1/completions", body.clone()).await;
    let (_, again) = off.post("/v1/completions", body).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

/// `--speculative-config` from the command line: the same greedy text as without, and the
/// spec-decode counters on /metrics account for the drafts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_decoding_over_http() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    // Text that continues by copying itself, so n-gram drafts pay and are made.
    let prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,";
    let body = json!({"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": true});
    let plain = Server::start(SMOL, &[]).await;
    let (_, want) = plain.post("/v1/completions", body.clone()).await;
    let config = r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":4}"#;
    let s = Server::start(SMOL, &["--speculative-config", config]).await;
    let (_, got) = s.post("/v1/completions", body).await;
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
    let drafts = s.metric("weft:spec_decode_num_drafts_total").await;
    let drafted = s.metric("weft:spec_decode_num_draft_tokens_total").await;
    let accepted = s.metric("weft:spec_decode_num_accepted_tokens_total").await;
    assert!(drafts > 0.0 && drafted >= drafts && accepted <= drafted, "{drafts} {drafted} {accepted}");
}
