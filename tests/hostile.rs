//! No request can hurt the server: absurd and malicious requests each get a quick 4xx and
//! leave the server serving the same greedy text; clients that vanish mid-stream leave no
//! sequence or KV block behind; a step that panics fails only its requests and the engine
//! restarts; slow or idle connections are closed; open streams end with an error event
//! when the shutdown grace runs out.

mod common;

use common::{server::Server, SMOL, STORIES};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// A JSON array nested `depth` deep.
fn nested(depth: usize) -> String {
    "[".repeat(depth) + &"]".repeat(depth)
}

/// (route, body, the `param` the error must name, if any)
fn hostile_requests() -> Vec<(&'static str, String, Option<&'static str>)> {
    let c = |v: Value, p: Option<&'static str>| ("/v1/completions", v.to_string(), p);
    let chat = |v: Value, p: Option<&'static str>| ("/v1/chat/completions", v.to_string(), p);
    let r = |v: Value, p: Option<&'static str>| ("/v1/responses", v.to_string(), p);
    let m = |v: Value, p: Option<&'static str>| ("/v1/messages", v.to_string(), p);
    let e = |v: Value, p: Option<&'static str>| ("/v1/embeddings", v.to_string(), p);
    let user = json!([{"role": "user", "content": "hi"}]);
    let many_bias: serde_json::Map<String, Value> = (0..301).map(|i| (i.to_string(), json!(1))).collect();
    vec![
        // max_tokens that wrap prompt + max_tokens, on every route that takes it.
        c(json!({"prompt": "x", "max_tokens": u64::MAX}), Some("max_tokens")),
        c(json!({"prompt": "x", "max_tokens": 1u64 << 63}), Some("max_tokens")),
        c(json!({"prompt": "x", "max_tokens": usize::MAX - 1}), Some("max_tokens")),
        chat(json!({"messages": user, "max_completion_tokens": u64::MAX}), Some("max_tokens")),
        chat(json!({"messages": user, "max_tokens": u64::MAX - 3}), Some("max_tokens")),
        ("/generate", json!({"prompt": "x", "max_tokens": u64::MAX}).to_string(), Some("max_tokens")),
        ("/generate/batch", json!({"prompts": ["a", "b"], "max_tokens": u64::MAX}).to_string(), Some("max_tokens")),
        c(json!({"prompt": "x", "max_tokens": -1}), Some("max_tokens")),
        c(json!({"prompt": "x", "max_tokens": 1.5}), Some("max_tokens")),
        // Fan-out: n, prompt lists, and their product.
        c(json!({"prompt": "x", "n": 1000}), Some("n")),
        c(json!({"prompt": "x", "n": u64::MAX}), Some("n")),
        chat(json!({"messages": user, "n": 1000}), Some("n")),
        c(json!({"prompt": vec!["a"; 1025]}), Some("n")),
        c(json!({"prompt": vec!["a"; 40], "n": 32}), Some("n")),
        ("/generate/batch", json!({"prompts": vec!["a"; 65]}).to_string(), Some("prompts")),
        // Sizes the client controls.
        c(json!({"prompt": "x", "stop": vec!["s"; 17]}), Some("stop")),
        c(json!({"prompt": "x", "stop": "s".repeat(10_000)}), Some("stop")),
        c(json!({"prompt": "x", "logit_bias": many_bias}), Some("logit_bias")),
        c(json!({"prompt": "x", "logit_bias": {"99999": 1}}), Some("logit_bias")),
        c(json!({"prompt": "x", "logit_bias": {"5": 1e9}}), Some("logit_bias")),
        c(json!({"prompt": "x", "logprobs": 21}), Some("logprobs")),
        c(json!({"prompt": "x", "logprobs": -1}), Some("logprobs")),
        chat(json!({"messages": user, "logprobs": true, "top_logprobs": 50}), Some("top_logprobs")),
        chat(json!({"messages": user, "top_logprobs": 2}), Some("top_logprobs")),
        c(json!({"prompt": "x", "stop_token_ids": [99999]}), Some("stop_token_ids")),
        c(json!({"prompt": "x", "stop_token_ids": vec![3; 65]}), Some("stop_token_ids")),
        // Prompts: ids outside the vocabulary, over the context.
        c(json!({"prompt": [u32::MAX]}), Some("prompt")),
        c(json!({"prompt": [[1, 2], [99999]]}), Some("prompt")),
        c(json!({"prompt": vec![5; 600]}), Some("prompt")),
        c(json!({"prompt": "Once upon a time ".repeat(12_000)}), Some("prompt")),
        c(json!({"prompt": [[]]}), Some("prompt")),
        // Numbers out of range or of the wrong type.
        c(json!({"prompt": "x", "temperature": 1e39}), Some("temperature")),
        c(json!({"prompt": "x", "top_p": 0}), Some("top_p")),
        c(json!({"prompt": "x", "top_k": -5}), Some("top_k")),
        c(json!({"prompt": "x", "priority": "high"}), Some("priority")),
        c(json!({"prompt": "x", "seed": -1}), Some("seed")),
        c(json!({"prompt": "x", "echo": "yes"}), Some("echo")),
        c(json!({"prompt": "x", "stream_options": {"bogus": 1}}), None),
        // Chat messages.
        chat(json!({"messages": []}), Some("messages")),
        chat(json!({"messages": [{"role": "hacker", "content": "hi"}]}), Some("messages")),
        chat(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), None),
        // Bodies that are not what they should be.
        ("/v1/completions", format!("{{\"prompt\": {}}}", nested(10_000)), None),
        ("/v1/completions", "null".into(), None),
        ("/v1/completions", "{\"prompt\": ".into(), None),
        ("/v1/completions", "x".repeat(5 << 20), None),
        ("/detokenize", json!({"tokens": [99999]}).to_string(), Some("tokens")),
        ("/tokenize", json!({"prompt": 123}).to_string(), Some("prompt")),
        ("/no/such/route", "{}".into(), None),
        // The Responses, Messages (errors in Anthropic's shape: no `param`) and embeddings routes.
        r(json!({"input": "x", "max_output_tokens": u64::MAX}), Some("max_output_tokens")),
        r(json!({"input": [{"type": "function_call_output"}]}), Some("input[0]")),
        r(json!({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}), Some("input[0]")),
        r(json!({"input": "x", "previous_response_id": "resp_none"}), Some("previous_response_id")),
        r(json!({"input": "x", "tools": [{"type": "computer_use_preview"}]}), Some("tools")),
        ("/v1/responses", format!("{{\"input\": {}}}", nested(10_000)), None),
        m(json!({"max_tokens": u64::MAX, "messages": user}), None),
        m(json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}), None),
        m(json!({"max_tokens": 5, "messages": user, "tool_choice": {"type": "sometimes"}}), None),
        ("/v1/messages/count_tokens", json!({"messages": "x"}).to_string(), None),
        e(json!({"input": [u32::MAX]}), Some("input")),
        e(json!({"input": vec!["a"; 2049]}), Some("input")),
        e(json!({"input": vec![5; 600]}), Some("input")),
        e(json!({"input": [[]]}), Some("input")),
        e(json!({"input": "x", "dimensions": 4}), Some("dimensions")),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_a_quick_4xx_and_change_nothing() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start(STORIES, &[]).await;
    // The warm-up request is not traffic.
    assert_eq!(s.metric("weft:prompt_tokens_total ").await, 0.0);
    assert_eq!(s.metric("weft:generation_tokens_total ").await, 0.0);
    let greedy = json!({"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "ignore_eos": true});
    let (st, before) = s.post("/v1/completions", greedy.clone()).await;
    assert_eq!(st, 200, "{before}");
    let requests = hostile_requests();
    assert!(requests.len() >= 30);
    let mut slowest = Duration::ZERO;
    for (route, body, param) in &requests {
        let t0 = Instant::now();
        let (st, resp) = s.post_raw(route, body.clone()).await;
        slowest = slowest.max(t0.elapsed());
        let shown = &body[..body.len().min(120)];
        assert!((400..500).contains(&st), "{route} {shown} -> {st} {resp}");
        if let Some(p) = param {
            assert_eq!(resp["error"]["param"].as_str(), Some(*p), "{route} {shown} -> {resp}");
        }
    }
    // A GET where only POST is routed.
    assert_eq!(s.get("/v1/completions").await.0, 405);
    eprintln!("{} hostile requests, slowest answer {:.0} ms", requests.len() + 1, slowest.as_secs_f64() * 1e3);
    // A hang guard, not a speed test: every answer comes at once in practice.
    assert!(slowest < Duration::from_secs(5), "slowest hostile request took {slowest:?}");
    let (st, after) = s.post("/v1/completions", greedy).await;
    assert_eq!(st, 200, "{after}");
    assert_eq!(after["choices"], before["choices"]);
    assert_eq!(s.get("/health").await.0, 200);
    assert_eq!(s.metric("weft:engine_failures_total ").await, 0.0);
    s.assert_idle().await;
}

/// Tokenizing huge prompts happens off the async workers: /health answers while two
/// 4 MB prompts are still being tokenized (it used to wait for them, ~5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_prompts_do_not_stall_the_server() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    let s = Server::start(SMOL, &["--max-body-bytes", "8M"]).await;
    let big = json!({"prompt": "Once upon a time, ".repeat(220_000), "max_tokens": 1}).to_string();
    let pending: Vec<_> = (0..2)
        .map(|_| {
            let (http, base, big) = (s.http.clone(), s.base.clone(), big.clone());
            tokio::spawn(async move {
                let r = http.post(format!("{base}/v1/completions")).body(big).send().await.unwrap();
                r.status().as_u16()
            })
        })
        .collect();
    // Wait until both are being tokenized (each takes seconds): /metrics answering then
    // already shows the async workers free. /health must answer while both still are.
    s.wait_metric("weft:num_requests_preparing ", 2.0).await;
    assert_eq!(s.get("/health").await.0, 200);
    assert_eq!(s.metric("weft:num_requests_preparing ").await, 2.0, "/health waited for a big prompt");
    for p in pending {
        assert_eq!(p.await.unwrap(), 400, "over the context");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_streams_with_half_the_clients_vanishing_leave_nothing_behind() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start(STORIES, &[]).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut tasks = Vec::new();
    for i in 0..100 {
        let (http, base) = (s.http.clone(), s.base.clone());
        let vanish_after = (i % 2 == 1).then(|| Duration::from_millis(rng.random_range(0..400)));
        let body = json!({"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": true, "stream": true,
                          "seed": i});
        tasks.push(tokio::spawn(async move {
            let run = async {
                let r = http.post(format!("{base}/v1/completions")).body(body.to_string()).send().await.unwrap();
                r.text().await.unwrap_or_default()
            };
            match vanish_after {
                // Dropping the request future closes the connection mid-stream.
                Some(t) => tokio::time::timeout(t, run).await.ok(),
                None => Some(run.await),
            }
        }));
    }
    let mut completed = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        if let Some(text) = t.await.unwrap() {
            assert!(text.trim_end().ends_with("data: [DONE]"), "stream {i} did not finish: {text}");
            completed += 1;
        }
    }
    assert!(completed >= 50, "only {completed} streams completed");
    s.assert_idle().await;
    assert_eq!(s.metric("weft:num_requests_waiting ").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_step_fails_its_requests_and_the_engine_restarts() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    // This test build panics on any step holding a prompt that starts with 300, 300, 300.
    // SmolLM2, not stories260k: the bystander below must still be running when the poisoned
    // request reaches a step, and stories260k finished its 400 tokens in 0.2 s, before a
    // poisoned request delayed by a loaded CI machine arrived.
    let s = Server::start_with_env(SMOL, &[], &[("WEFT_FAULT_PANIC_TOKEN", "300")]).await;
    let greedy = json!({"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "ignore_eos": true});
    let (_, before) = s.post("/v1/completions", greedy.clone()).await;
    let poison = json!({"prompt": [300, 300, 300, 5], "max_tokens": 4});

    // A request running alongside the failing step fails with it (its KV state is suspect).
    // 2,000 tokens take SmolLM2 seconds on any machine; the failing step ends it early.
    let long = json!({"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": true});
    let bystander = {
        let (http, base) = (s.http.clone(), s.base.clone());
        tokio::spawn(async move {
            let r = http.post(format!("{base}/v1/completions")).body(long.to_string()).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        })
    };
    s.wait_metric("weft:num_requests_running ", 1.0).await;
    let (st, body) = s.post("/v1/completions", poison.clone()).await;
    assert_eq!(st, 500, "{body}");
    assert_eq!(body["error"]["type"], "server_error", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("restarted"), "{body}");
    let (st, body) = bystander.await.unwrap();
    assert_eq!(st, 500, "{body}");

    // Streaming: an error event ends the stream; no [DONE], never a silent truncation.
    let mut streaming = poison.clone();
    streaming["stream"] = json!(true);
    let events = s.stream("/v1/completions", streaming).await;
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "server_error", "{events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");

    // The engine came back with every block free and serves the same text.
    assert_eq!(s.metric("weft:engine_failures_total ").await, 2.0);
    assert_eq!(s.get("/health").await.0, 200);
    let (st, after) = s.post("/v1/completions", greedy).await;
    assert_eq!(st, 200, "{after}");
    assert_eq!(after["choices"], before["choices"]);
    s.assert_idle().await;
}

/// `/generate/batch` aborts every one of its sequences when its client leaves and when the
/// request timeout passes (its prompts used to run on for minutes, preempting everyone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_batch_is_cancelled_on_disconnect_and_timeout() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    // The native API honours ignore_eos (this prompt ends greedily after about 30 tokens).
    // Before it did, the requests below could end early and answer within the client's
    // patience. (On a server of its own: under CI's load, 100 tokens can take more than
    // the 2 s timeout below.)
    let s = Server::start(SMOL, &[]).await;
    let short = |ignore_eos| json!({"prompts": ["The capital of France is"], "max_tokens": 100, "temperature": 0, "ignore_eos": ignore_eos});
    let (_, ended) = s.post("/generate/batch", short(false)).await;
    assert_eq!(ended["results"][0]["finish_reason"], "stop", "{ended}");
    let (_, ran_on) = s.post("/generate/batch", short(true)).await;
    assert_eq!(ran_on["results"][0]["usage"]["completion_tokens"], 100, "{ran_on}");
    drop(s);
    let s = Server::start(SMOL, &["--request-timeout", "2"]).await;
    // EOS ignored: 8 x 500 tokens take far longer than the 2 s timeout on any machine.
    let body =
        json!({"prompts": vec!["Write a very long story about a dragon."; 8], "max_tokens": 500, "ignore_eos": true})
            .to_string();
    // A client that gives up after a moment.
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(500)).build().unwrap();
    let r = impatient.post(format!("{}/generate/batch", s.base)).body(body.clone()).send().await;
    assert!(r.is_err(), "the client should have timed out; the server answered {r:?}");
    s.assert_idle().await;
    // A client that waits, but past --request-timeout: a 504, and nothing keeps running.
    let (st, resp) = s.post_raw("/generate/batch", body).await;
    assert_eq!(st, 504, "{resp}");
    assert_eq!(resp["error"]["type"], "timeout_error");
    s.assert_idle().await;
}

/// Reads until the server closes the connection (or `limit` passes); true if it closed.
fn closed_within(tcp: &mut std::net::TcpStream, limit: Duration) -> bool {
    tcp.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match tcp.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_idle_connections_are_closed() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start(STORIES, &["--header-read-timeout", "0.5", "--max-connections", "8"]).await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    tokio::task::spawn_blocking(move || {
        // Half a request head, never finished.
        let mut slow = std::net::TcpStream::connect(&addr).unwrap();
        slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
        // A connection that never sends anything.
        let mut idle = std::net::TcpStream::connect(&addr).unwrap();
        // Keep-alive after one request, then silence.
        let mut kept = std::net::TcpStream::connect(&addr).unwrap();
        kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        for (name, tcp) in [("slow", &mut slow), ("idle", &mut idle), ("kept-alive", &mut kept)] {
            assert!(closed_within(tcp, Duration::from_secs(10)), "{name} connection stayed open");
        }
        // More idle connections than the cap: once they time out, new clients are served.
        let hogs: Vec<_> = (0..12).map(|_| std::net::TcpStream::connect(&addr).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(100));
        drop(hogs);
    })
    .await
    .unwrap();
    assert_eq!(s.get("/health").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_from_the_environment() {
    if common::shared_models().is_none() {
        return;
    }
    // /health is open, so the server starts; the API routes need the key.
    let s = Server::start_with_env(STORIES, &[], &[("WEFT_API_KEY", "s3cret")]).await;
    let body = json!({"prompt": "x", "max_tokens": 2}).to_string();
    let url = format!("{}/v1/completions", s.base);
    let status = |key: Option<&str>| {
        let mut r = s.http.post(&url).body(body.clone());
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        async move { r.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(status(None).await, 401);
    assert_eq!(status(Some("s3cre")).await, 401);
    assert_eq!(status(Some("s3cret!")).await, 401);
    assert_eq!(status(Some("s3cret")).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_still_open_when_the_grace_ends_get_an_error_event() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    let s = Server::start(SMOL, &["--shutdown-grace", "1"]).await;
    let (http, base) = (s.http.clone(), s.base.clone());
    let body = json!({"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let stream = tokio::spawn(async move {
        let r = http.post(format!("{base}/v1/completions")).body(body.to_string()).send().await.unwrap();
        r.text().await.unwrap_or_default()
    });
    s.wait_metric("weft:num_requests_running ", 1.0).await;
    let pid = s.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let text = tokio::time::timeout(Duration::from_secs(30), stream).await.expect("stream ended").unwrap();
    let last = text.lines().rev().find_map(|l| l.strip_prefix("data: ")).unwrap_or_default();
    let last: Value = serde_json::from_str(last).unwrap_or(Value::Null);
    assert_eq!(last["error"]["type"], "service_unavailable", "{}", &text[text.len().saturating_sub(300)..]);
}
