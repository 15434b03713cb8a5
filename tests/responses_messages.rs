//! The Responses API and Anthropic's Messages API over HTTP: each runs the chat request it
//! converts to (the same greedy tokens as `/v1/chat/completions`), streams the typed events
//! that end in the whole object, keeps conversations for `previous_response_id` within its
//! bounds, and answers bad input with a 4xx in its own error shape.

mod common;

use common::server::Server;
use serde_json::{json, Value};

fn events(data: &[String]) -> Vec<Value> {
    data.iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_run_as_chat_and_keep_conversations() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start("tiny-qwen2", &[]).await;
    // The same greedy tokens as the chat request it stands for.
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let (_, chat) =
        s.post("/v1/chat/completions", json!({"messages": messages, "max_tokens": 6, "temperature": 0})).await;
    let (st, r) = s
        .post(
            "/v1/responses",
            json!({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["output"][0]["content"][0]["text"], chat["choices"][0]["message"]["content"], "{r}");
    assert_eq!(
        (r["status"].as_str(), r["incomplete_details"]["reason"].as_str()),
        (Some("incomplete"), Some("max_output_tokens"))
    );
    assert_eq!(r["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    let id = r["id"].as_str().unwrap();
    assert!(id.starts_with("resp_"));
    let (st, got) = s.get(&format!("/v1/responses/{id}")).await;
    assert_eq!((st, serde_json::from_str::<Value>(&got).unwrap()), (200, r.clone()));

    // The next turn carries the conversation (not the instructions): its prompt is the chat
    // prompt of the whole exchange.
    let answer = r["output"][0]["content"][0]["text"].clone();
    let (_, next) =
        s.post("/v1/responses", json!({"input": "More", "previous_response_id": id, "max_output_tokens": 2})).await;
    let whole = json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer},
        {"role": "user", "content": "More"}]);
    let (_, tok) = s.post("/tokenize", json!({"messages": whole})).await;
    assert_eq!(next["usage"]["input_tokens"], tok["count"], "{next}");

    // Streamed: the typed events, numbered, ending in the object a plain request returns.
    let ev = events(&s.stream("/v1/responses", json!({"input": "Hi", "max_output_tokens": 4, "stream": true})).await);
    let t = types(&ev);
    assert_eq!(
        &t[..4],
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    );
    assert_eq!(t.last(), Some(&"response.incomplete"));
    let seq: Vec<u64> = ev.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
    assert_eq!(seq, (0..ev.len() as u64).collect::<Vec<_>>());
    let text: String =
        ev.iter().filter(|e| e["type"] == "response.output_text.delta").map(|e| e["delta"].as_str().unwrap()).collect();
    let last = &ev.last().unwrap()["response"];
    assert_eq!(last["output"][0]["content"][0]["text"], text);
    let (_, kept) = s.get(&format!("/v1/responses/{}", last["id"].as_str().unwrap())).await;
    assert_eq!(&serde_json::from_str::<Value>(&kept).unwrap(), last);

    // A function call and its output go round.
    let tool = json!({"type": "function", "name": "get_weather", "parameters": common::weather_schema()});
    let (st, r) = s
        .post(
            "/v1/responses",
            json!({"input": "Weather?", "tools": [tool], "tool_choice": "required", "max_output_tokens": 200,
                "parallel_tool_calls": false, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    let call = r["output"].as_array().unwrap().iter().find(|o| o["type"] == "function_call").unwrap().clone();
    assert!(serde_json::from_str::<Value>(call["arguments"].as_str().unwrap()).is_ok(), "{call}");
    let input = json!([call, {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]);
    let (st, r) = s.post("/v1/responses", json!({"input": input, "tools": [tool], "max_output_tokens": 2})).await;
    assert_eq!(st, 200, "{r}");

    // Not stored, deleted, or unknown: OpenAI's 404s.
    let (_, r) = s.post("/v1/responses", json!({"input": "Hi", "max_output_tokens": 1, "store": false})).await;
    let (st, e) = s.post("/v1/responses", json!({"input": "x", "previous_response_id": r["id"]})).await;
    assert_eq!(
        (st, e["error"]["code"].as_str(), e["error"]["param"].as_str()),
        (404, Some("previous_response_not_found"), Some("previous_response_id"))
    );
    let r = s.http.delete(format!("{}/v1/responses/{id}", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(s.get(&format!("/v1/responses/{id}")).await.0, 404);

    // Bad input: 400s that name the field.
    for (body, param) in [
        (json!({"input": "x", "tools": [{"type": "web_search_preview"}]}), "tools"),
        (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}), "input[0]"),
        (json!({"input": "x", "max_output_tokens": 1_000_000}), "max_output_tokens"),
        (json!({"input": "x", "temperature": "hot"}), "temperature"),
        (json!({"input": "x", "tool_choice": "sometimes", "tools": [tool]}), "tool_choice"),
        (json!({"input": "x", "model": "gpt-9"}), "model"),
    ] {
        let (st, e) = s.post("/v1/responses", body.clone()).await;
        assert!(matches!(st, 400 | 404), "{body}: {st} {e}");
        assert_eq!(e["error"]["param"].as_str(), Some(param), "{body}: {e}");
    }
    assert_eq!(s.post_raw("/v1/responses", "{").await.0, 400);
    s.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_speak_anthropic() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start("tiny-qwen2", &["--api-key", "sekrit"]).await;
    let post = |path: &'static str, body: Value, key: Option<&'static str>| {
        let mut r = s.http.post(format!("{}{path}", s.base)).body(body.to_string());
        if let Some(k) = key {
            r = r.header("x-api-key", k);
        }
        async move {
            let r = r.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.text().await.unwrap())
        }
    };
    let hi = json!({"model": "claude-sonnet-4-6", "max_tokens": 5, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}]});
    assert_eq!(post("/v1/messages", hi.clone(), None).await.0, 401);
    let (st, m) = post("/v1/messages", hi.clone(), Some("sekrit")).await;
    let m: Value = serde_json::from_str(&m).unwrap();
    assert_eq!(st, 200, "{m}");
    assert_eq!(
        (m["type"].as_str(), m["model"].as_str(), m["stop_reason"].as_str()),
        (Some("message"), Some("claude-sonnet-4-6"), Some("max_tokens"))
    );
    assert_eq!(m["usage"]["output_tokens"], 5);
    let (_, n) = post("/v1/messages/count_tokens", json!({"messages": hi["messages"]}), Some("sekrit")).await;
    assert_eq!(serde_json::from_str::<Value>(&n).unwrap()["input_tokens"], m["usage"]["input_tokens"]);

    // A stop sequence that ends the answer is named, as Anthropic names it.
    let text = m["content"][0]["text"].as_str().unwrap();
    let tail: String = text.chars().rev().take(2).collect::<Vec<_>>().into_iter().rev().collect();
    let mut stopped = hi.clone();
    stopped["stop_sequences"] = json!(["never-generated", tail]);
    let (_, st) = post("/v1/messages", stopped, Some("sekrit")).await;
    let st: Value = serde_json::from_str(&st).unwrap();
    assert_eq!(
        (st["stop_reason"].as_str(), st["stop_sequence"].as_str()),
        (Some("stop_sequence"), Some(tail.as_str())),
        "{st}"
    );

    // Streamed: Anthropic's events, adding up to the same text.
    let mut streamed = hi.clone();
    streamed["stream"] = true.into();
    let (st, body) = post("/v1/messages", streamed, Some("sekrit")).await;
    assert_eq!(st, 200);
    let ev: Vec<Value> =
        body.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect();
    let t = types(&ev);
    assert_eq!(
        (t[0], t[1], t[t.len() - 2], t[t.len() - 1]),
        ("message_start", "content_block_start", "message_delta", "message_stop")
    );
    let text: String = ev.iter().filter_map(|e| e["delta"]["text"].as_str()).collect();
    assert_eq!(text, m["content"][0]["text"].as_str().unwrap());

    // A tool-use round trip.
    let tool = json!({"name": "get_weather", "input_schema": common::weather_schema()});
    let (st, m) = post(
        "/v1/messages",
        // One call, greedy: sampled parallel calls can run to max_tokens first.
        json!({"max_tokens": 200, "tools": [tool], "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "temperature": 0, "messages": [{"role": "user", "content": "Weather?"}]}),
        Some("sekrit"),
    )
    .await;
    let m: Value = serde_json::from_str(&m).unwrap();
    assert_eq!((st, m["stop_reason"].as_str()), (200, Some("tool_use")), "{m}");
    let use_ = m["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").unwrap();
    assert!(use_["input"]["city"].is_string(), "{m}");
    let back = json!({"max_tokens": 2, "tools": [tool], "messages": [{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": m["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_["id"], "content": "sunny"}]}]});
    assert_eq!(post("/v1/messages", back, Some("sekrit")).await.0, 200);

    // Bad input: Anthropic's error shape.
    for body in [
        json!({"messages": [{"role": "user", "content": "Hi"}]}),
        json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
        json!({"max_tokens": 5, "messages": [], "tools": [{"type": "bash_20250124", "name": "bash"}]}),
        json!({"max_tokens": 5, "messages": "Hi"}),
    ] {
        let (st, e) = post("/v1/messages", body.clone(), Some("sekrit")).await;
        let e: Value = serde_json::from_str(&e).unwrap();
        assert_eq!(
            (st, e["type"].as_str(), e["error"]["type"].as_str()),
            (400, Some("error"), Some("invalid_request_error")),
            "{body}: {e}"
        );
    }
}

/// A thinking model (Qwen3's template) thinks on Messages only when asked, as Anthropic's
/// models do: without `thinking`, the template is told `enable_thinking: false` and writes
/// the empty think block itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_ask_a_thinking_model_to_think_only_when_told() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start("tiny-qwen3", &[]).await;
    let count = |thinking: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}]});
        if !thinking.is_null() {
            body["thinking"] = thinking;
        }
        let s = &s;
        async move { s.post("/v1/messages/count_tokens", body).await.1["input_tokens"].as_u64().unwrap() }
    };
    let (plain, enabled) = (count(Value::Null).await, count(json!({"type": "enabled", "budget_tokens": 1024})).await);
    let disabled = count(json!({"type": "disabled"})).await;
    assert_eq!(plain, disabled);
    assert!(plain > enabled, "the empty think block is written when thinking is off: {plain} vs {enabled}");
    let (st, m) = s
        .post(
            "/v1/messages",
            json!({"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 64},
            "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await;
    assert_eq!(st, 200, "{m}");
}

/// A thinking model's `<think>…</think>` comes back apart in chat completions as
/// `reasoning_content`, whole and streamed alike, the answer without the tags (the Responses
/// and Messages APIs read it from there). A grammar makes the noise model think.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_comes_back_apart_from_the_answer() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start("tiny-qwen3", &[]).await;
    s.chat_reasoning_apart(r"<think>[a-z]{3,8}</think>[a-z]{3,8}").await;
    s.assert_idle().await;
}
