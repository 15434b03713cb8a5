//! Prompt logprobs: the prefill's own rows score the prompt (echo + logprobs, vLLM's
//! `prompt_logprobs`, `max_tokens: 0`), equal to what generation reports for the same text.

mod common;

use common::server::Server;
use common::{collect, SMOL};
use serde_json::{json, Value};
use weft::engine::{EngineConfig, EngineHandle, Event, Request, RequestStream};
use weft::model::WeightDtype;
use weft::sampling::{PromptLogprob, TokenLogprob};

/// A stream's prompt scores and each generated token's logprob.
fn scores(mut stream: RequestStream) -> (Vec<PromptLogprob>, Vec<TokenLogprob>) {
    let (mut prompt, mut gen) = (Vec::new(), Vec::new());
    while let Some(ev) = stream.blocking_recv() {
        match ev {
            Event::PromptLogprobs { logprobs } => prompt.extend(logprobs),
            Event::Token { logprobs, .. } => gen.push(logprobs.unwrap().0),
            Event::Error { message } => panic!("{message}"),
            Event::Finished { .. } | Event::Embedding { .. } => {}
        }
    }
    (prompt, gen)
}

fn scoring(prompt: &[u32]) -> Request {
    let mut r = Request::new(prompt.to_vec(), 0);
    r.prompt_logprobs = Some(3);
    r
}

/// Greedy generation reports logprobs for its tokens (decode rows); scoring prompt + output
/// (prefill rows, in chunks, with `max_tokens: 0`) gives the same numbers, alone and inside a
/// busy batch, on the exact f32 path; the prefix cache never short-cuts a scored prompt.
#[test]
fn scoring_a_text_matches_generating_it() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    let model = common::model_as(SMOL, WeightDtype::F32);
    // Small prefill chunks: the prompt is scored across several steps.
    let cfg = EngineConfig { max_num_batched_tokens: 16, ..Default::default() };
    let e = EngineHandle::start(model, cfg).unwrap();
    let prompt = e.model().tokenizer.encode("The quick brown fox jumps over the lazy dog. Then it").unwrap();
    let mut gen = Request::new(prompt.clone(), 24);
    gen.sampling.logprobs = Some(0);
    gen.stop.ignore_eos = true;
    let generated = collect(e.submit(gen.clone()).unwrap())[0].tokens.clone();
    let (_, gen_lps) = scores(e.submit(gen).unwrap());
    let text: Vec<u32> = prompt.iter().chain(&generated).copied().collect();

    let (alone, none) = scores(e.submit(scoring(&text)).unwrap());
    assert!(none.is_empty(), "max_tokens 0 generates nothing");
    assert_eq!(alone.len(), text.len() - 1);
    for (i, p) in alone.iter().enumerate() {
        assert_eq!(p.token.id, text[i + 1]);
        assert!(p.rank >= 1 && p.top.len() == 3 && p.top[0].logprob >= p.token.logprob);
        assert_eq!(p.rank == 1, p.top[0].id == p.token.id);
    }
    for (j, g) in gen_lps.iter().enumerate() {
        let p = &alone[prompt.len() - 1 + j];
        assert!(
            (p.token.logprob - g.logprob).abs() < 1e-5,
            "token {j}: scored {} generated {}",
            p.token.logprob,
            g.logprob
        );
    }
    // Busy: generating requests around it, one sharing its prefix (a prefix-cache hit for
    // anyone else).
    let mut others: Vec<_> = (0..6)
        .map(|k| {
            let mut r = Request::new(text[..10 + k].to_vec(), 20);
            r.stop.ignore_eos = true;
            e.submit(r).unwrap()
        })
        .collect();
    let busy = e.submit(scoring(&text)).unwrap();
    others.push(e.submit(scoring(&text[..20])).unwrap());
    let (busy, _) = scores(busy);
    assert_eq!(busy.len(), alone.len());
    for s in others {
        collect(s);
    }
    for (a, b) in alone.iter().zip(&busy) {
        assert!((a.token.logprob - b.token.logprob).abs() < 1e-5);
        assert_eq!(a.rank, b.rank);
    }
    common::assert_all_blocks_free(&e);
}

/// lm-evaluation-harness's request: token ids, `echo`, `logprobs: 1`, `max_tokens` 0 or 1;
/// vLLM's `prompt_logprobs`; streaming with `echo` sends the prompt first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_logprobs_over_http() {
    if common::fixture(SMOL).is_none() {
        return;
    }
    let s = Server::start(SMOL, &["--dtype", "f32"]).await;
    let text = "Paris is the capital of France.";
    let (_, tok) = s.post("/tokenize", json!({"prompt": text})).await;
    let ids: Vec<u64> = tok["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    for max_tokens in [0, 1] {
        let (st, v) = s
            .post(
                "/v1/completions",
                json!({"prompt": ids, "echo": true, "logprobs": 1, "max_tokens": max_tokens,
                "temperature": 0}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), ids.len() + max_tokens);
        assert!(lps[0].is_null() && c["logprobs"]["top_logprobs"][0].is_null());
        assert!(lps[1..].iter().all(|x| x.as_f64().unwrap() <= 0.0));
        assert_eq!(c["logprobs"]["top_logprobs"][1].as_object().unwrap().len(), 1);
        assert!(c["text"].as_str().unwrap().starts_with(text));
        assert_eq!(v["usage"]["completion_tokens"], max_tokens);
        if max_tokens == 0 {
            assert_eq!(c["finish_reason"], "length");
        }
    }
    let (st, v) = s.post("/v1/completions", json!({"prompt": text, "prompt_logprobs": 2, "max_tokens": 1})).await;
    assert_eq!(st, 200, "{v}");
    let pl = v["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(pl.len(), ids.len());
    assert!(pl[0].is_null());
    let entry = pl[1].as_object().unwrap();
    assert!(entry.contains_key(&ids[1].to_string()) && (2..=3).contains(&entry.len()));
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0,
            "max_tokens": 1}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert!(v["prompt_logprobs"].as_array().unwrap().len() > 3);
    // Streaming: the prompt (with its logprobs) comes first, then the generated tokens.
    let events = s
        .stream(
            "/v1/completions",
            json!({"prompt": text, "echo": true, "logprobs": 0, "max_tokens": 3,
            "temperature": 0, "stream": true}),
        )
        .await;
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["text"], text);
    assert_eq!(first["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().len(), ids.len());
    let (_, plain) = s.post("/v1/completions", json!({"prompt": text, "max_tokens": 3, "temperature": 0})).await;
    let streamed: String = events[1..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(streamed, plain["choices"][0]["text"].as_str().unwrap());
    for (bad, param) in [
        (json!({"prompt": text, "prompt_logprobs": 1, "stream": true}), "prompt_logprobs"),
        (json!({"prompt": text, "prompt_logprobs": 1000}), "prompt_logprobs"),
        (json!({"prompt": text, "max_tokens": 0, "n": 2}), "max_tokens"),
    ] {
        let (st, v) = s.post("/v1/completions", bad).await;
        assert_eq!((st, v["error"]["param"].as_str()), (400, Some(param)), "{v}");
    }
    s.assert_idle().await;
}
