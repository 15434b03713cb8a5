//! Tool calling over HTTP on the family fixtures' real templates (random weights: only the
//! grammar makes their answers calls): `tool_choice` required and named give parseable calls
//! whose arguments follow the tool's schema, whole and streamed; calls and tool results go
//! back through the template.

mod common;

use common::server::Server;
use common::weather_schema as weather;
use serde_json::{json, Value};

fn count() -> Value {
    json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": false})
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": weather()}},
        {"type": "function", "function": {"name": "count", "parameters": count()}},
    ])
}

fn check_call(call: &Value) {
    let f = &call["function"];
    let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
    let schema = match f["name"].as_str().unwrap() {
        "get_weather" => weather(),
        "count" => count(),
        other => panic!("unknown tool {other}"),
    };
    assert!(jsonschema::validator_for(&schema).unwrap().is_valid(&args), "{args} vs {schema}");
    assert_eq!(call["type"], "function");
    assert!(!call["id"].as_str().unwrap().is_empty());
}

fn body(extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools(), "max_tokens": 400});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

/// `required` and a named function on Qwen2.5's (Hermes), Llama 3's and Mistral's templates
/// (and Qwen3's, on its mixture of experts): every answer is calls that parse and validate;
/// streamed calls arrive as `tool_calls` deltas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_calls_always_parse_and_validate() {
    if common::shared_models().is_none() {
        return;
    }
    for model in ["tiny-qwen2", "tiny-llama3", "tiny-mistral-swa", "tiny-qwen3moe"] {
        let s = Server::start(model, &[]).await;
        for seed in 0..8 {
            let one = json!({"tool_choice": "required", "seed": seed, "parallel_tool_calls": false});
            let (st, v) = s.post("/v1/chat/completions", body(one)).await;
            assert_eq!(st, 200, "{model}: {v}");
            let c = &v["choices"][0];
            assert_eq!(c["finish_reason"], "tool_calls", "{model}: {v}");
            let calls = c["message"]["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1);
            calls.iter().for_each(check_call);
        }
        // Parallel calls: a noise model rarely picks EOS over another call, so the answer may
        // run to max_tokens; the calls it completed are all well-formed.
        let (_, v) = s.post("/v1/chat/completions", body(json!({"tool_choice": "required", "seed": 9}))).await;
        let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{model}: {v}");
        calls.iter().for_each(check_call);
        let named = json!({"tool_choice": {"type": "function", "function": {"name": "count"}}, "seed": 1});
        let (_, v) = s.post("/v1/chat/completions", body(named)).await;
        let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
        assert_eq!((calls.len(), calls[0]["function"]["name"].as_str()), (1, Some("count")), "{model}: {v}");
        check_call(&calls[0]);

        // Streamed: each call opens with its name and its arguments follow in pieces; put
        // together they are the calls the same request gives whole.
        let (_, whole) = s
            .post(
                "/v1/chat/completions",
                body(json!({"tool_choice": "required", "parallel_tool_calls": false, "seed": 3})),
            )
            .await;
        let streamed = json!({"tool_choice": "required", "stream": true, "parallel_tool_calls": false, "seed": 3});
        let events = s.stream("/v1/chat/completions", body(streamed)).await;
        let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        let mut calls: Vec<Value> = Vec::new();
        for d in
            chunks.iter().flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().cloned().unwrap_or_default())
        {
            let k = d["index"].as_u64().unwrap() as usize;
            if calls.len() <= k {
                calls.push(json!({"id": d["id"], "type": "function", "function": {"name": d["function"]["name"], "arguments": ""}}));
            }
            let args = calls[k]["function"]["arguments"].as_str().unwrap().to_owned();
            calls[k]["function"]["arguments"] = (args + d["function"]["arguments"].as_str().unwrap_or("")).into();
        }
        assert!(!calls.is_empty(), "{model}: {events:?}");
        calls.iter().for_each(check_call);
        let strip = |c: &Value| c["function"].clone();
        let whole_usage = whole["usage"].clone();
        let whole: Vec<Value> =
            whole["choices"][0]["message"]["tool_calls"].as_array().unwrap().iter().map(strip).collect();
        assert_eq!(calls.iter().map(strip).collect::<Vec<_>>(), whole, "{model}");
        let pieces = chunks
            .iter()
            .flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().cloned().unwrap_or_default())
            .filter(|d| d["function"]["arguments"].as_str().is_some_and(|a| !a.is_empty()))
            .count();
        assert!(pieces > 1, "{model}: the arguments came in {pieces} deltas");
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");

        // Cut off a few tokens before the end of that call by max_tokens: whole and streamed
        // give the same partial call.
        let tokens = whole_usage["completion_tokens"].as_u64().unwrap();
        let cut = json!({"tool_choice": "required", "parallel_tool_calls": false, "seed": 3, "max_tokens": tokens - 3});
        let (_, whole) = s.post("/v1/chat/completions", body(cut.clone())).await;
        let mut streamed = cut;
        streamed["stream"] = json!(true);
        let events = s.stream("/v1/chat/completions", body(streamed)).await;
        let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        let (mut content, mut name, mut args) = (String::new(), String::new(), String::new());
        for delta in chunks.iter().map(|c| &c["choices"][0]["delta"]) {
            content += delta["content"].as_str().unwrap_or("");
            for d in delta["tool_calls"].as_array().cloned().unwrap_or_default() {
                name += d["function"]["name"].as_str().unwrap_or("");
                args += d["function"]["arguments"].as_str().unwrap_or("");
            }
        }
        let message = &whole["choices"][0]["message"];
        assert_eq!(whole["choices"][0]["finish_reason"], "length", "{model}: {whole}");
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
        let call = &message["tool_calls"][0]["function"];
        let read = |v: &Value| v.as_str().unwrap_or("").to_owned();
        assert_eq!((read(&message["content"]), read(&call["name"]), read(&call["arguments"])), (content, name, args));
        assert!(!read(&call["arguments"]).is_empty(), "{model}: not cut inside the arguments: {whole}");
        s.assert_idle().await;
    }
}

/// An answer with calls (content null, as the openai SDK's `model_dump()` gives it back) and
/// the tool's result go back through each template; `/tokenize` renders the tools as chat does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_and_results_go_back_through_the_template() {
    if common::shared_models().is_none() {
        return;
    }
    for model in ["tiny-qwen2", "tiny-llama3", "tiny-mistral-swa"] {
        let s = Server::start(model, &[]).await;
        let messages = json!([
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": null, "refusal": null, "audio": null, "function_call": null,
             "tool_calls": [{"id": "abc123XYZ", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
            {"role": "tool", "tool_call_id": "abc123XYZ", "content": "21 degrees"},
        ]);
        let (st, v) =
            s.post("/v1/chat/completions", json!({"messages": messages, "tools": tools(), "max_tokens": 3})).await;
        assert_eq!(st, 200, "{model}: {v}");
        let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let (st, t) = s.post("/tokenize", json!({"messages": messages, "tools": tools()})).await;
        assert_eq!(st, 200, "{model}: {t}");
        assert_eq!(t["count"].as_u64().unwrap(), prompt_tokens, "{model}");
        let (_, bare) = s.post("/tokenize", json!({"messages": messages})).await;
        assert!(bare["count"].as_u64().unwrap() < prompt_tokens, "{model}: the tools are in the prompt");
        s.assert_idle().await;
    }
}

/// A model whose template has no tool-call format gets weft's: the tools in the system
/// message and a grammar. `required` and named calls always validate, streamed too; `auto`
/// is plain text or whole calls, never a broken call; results go back in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_without_calls_gets_weft_s_format() {
    if common::shared_models().is_none() {
        return;
    }
    let smol = Server::start(common::SMOL, &[]).await;
    for seed in 0..6 {
        let choice =
            if seed % 2 == 0 { json!("required") } else { json!({"type": "function", "function": {"name": "count"}}) };
        let (st, v) = smol.post("/v1/chat/completions", body(json!({"tool_choice": choice, "seed": seed}))).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
        v["choices"][0]["message"]["tool_calls"].as_array().unwrap().iter().for_each(check_call);
        let (st, v) = smol.post("/v1/chat/completions", body(json!({"tool_choice": "auto", "seed": seed}))).await;
        assert_eq!(st, 200, "{v}");
        let m = &v["choices"][0]["message"];
        match m["tool_calls"].as_array() {
            Some(calls) => calls.iter().for_each(check_call),
            None => assert!(!m["content"].as_str().unwrap().contains("<tool_call>"), "{v}"),
        }
    }
    let one = json!({"tool_choice": "required", "stream": true, "parallel_tool_calls": false});
    let events = smol.stream("/v1/chat/completions", body(one)).await;
    let deltas: Vec<Value> = events.iter().filter_map(|e| serde_json::from_str(e).ok()).collect();
    let args: String = deltas
        .iter()
        .filter_map(|d| d["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert!(serde_json::from_str::<Value>(&args).is_ok(), "{args}");
    assert_eq!(deltas.iter().rev().find_map(|d| d["choices"][0]["finish_reason"].as_str()), Some("tool_calls"));
    let call = json!({"id": "c1", "type": "function", "function": {"name": "count", "arguments": "{\"n\": 3}"}});
    let messages = json!([{"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1 2 3"}]);
    let (st, v) =
        smol.post("/v1/chat/completions", json!({"messages": messages, "tools": tools(), "max_tokens": 4})).await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = smol.post("/v1/chat/completions", body(json!({"tool_choice": "none", "max_tokens": 4}))).await;
    assert!(st == 200 && v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    smol.assert_idle().await;
}

/// gpt-oss's harmony (its real template; a grammar makes the noise model write harmony):
/// the analysis channel comes back as `reasoning_content` and the final one as content,
/// and a commentary message to a function as a call, whole and streamed alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harmony_channels_and_calls_come_back_apart() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start("tiny-gpt-oss", &[]).await;
    s.chat_reasoning_apart(
        r"<\|channel\|>analysis<\|message\|>[a-z]{3,8}<\|end\|><\|start\|>assistant<\|channel\|>final<\|message\|>[a-z]{3,8}",
    )
    .await;

    // A required call: a commentary message to the function, its body the arguments.
    // (gpt-oss's template writes each tool's description, so the tool has one.)
    let weather_only = json!([tools()[0]]);
    let body = |extra: Value| {
        let mut b = body(extra);
        b["tools"] = weather_only.clone();
        b
    };
    let call = json!({"tool_choice": "required", "seed": 1, "parallel_tool_calls": false});
    let (st, v) = s.post("/v1/chat/completions", body(call.clone())).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    check_call(&calls[0]);
    let mut streamed = call;
    streamed["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", body(streamed)).await;
    let (mut name, mut args) = (String::new(), String::new());
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        for d in c["choices"][0]["delta"]["tool_calls"].as_array().cloned().unwrap_or_default() {
            name += d["function"]["name"].as_str().unwrap_or("");
            args += d["function"]["arguments"].as_str().unwrap_or("");
        }
    }
    let f = &calls[0]["function"];
    assert_eq!((f["name"].as_str().unwrap(), f["arguments"].as_str().unwrap()), (name.as_str(), args.as_str()));

    // A stop string inside the answer (inside a token, as "over" in " government" was when
    // the soak found this): the answer ends before it, whole as streamed.
    let plain = json!({"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 24, "temperature": 0});
    let (st, v) = s.post("/v1/chat/completions", plain.clone()).await;
    assert_eq!(st, 200, "{v}");
    let full = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    let chars: Vec<char> = full.chars().collect();
    let at = chars.len() / 2;
    let stop: String = chars[at..at + 3].iter().collect();
    let mut stopped = plain;
    stopped["stop"] = json!([stop]);
    let (st, v) = s.post("/v1/chat/completions", stopped.clone()).await;
    assert_eq!(st, 200, "{v}");
    let whole = v["choices"][0]["message"]["content"].as_str().unwrap_or("").to_owned();
    assert_eq!(whole, full[..full.find(&stop).unwrap()], "stop {stop:?} in {full:?}");
    assert_eq!(v["choices"][0]["stop_reason"], json!(stop), "{v}");
    stopped["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", stopped).await;
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert_eq!(streamed, whole);
    s.assert_idle().await;
}
