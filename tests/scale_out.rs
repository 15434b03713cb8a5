//! What a KV-aware router in front of several weft replicas reads: the prefix cache's
//! events on vLLM's ZMQ wire (a subscriber that rebuilds each replica's block set from them,
//! and from the replay socket, holds exactly what the cache holds; a queue nobody drains
//! never stalls the engine and is made whole by a snapshot), the render endpoints and
//! `return_token_ids` a tokenizing frontend uses, and the `vllm:` metrics a gateway scrapes.

mod common;

use common::server::Server;
use rmpv::Value as Mp;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use weft::engine::{EngineConfig, EngineHandle, KvEventBatch};
use weft::kv::KvEvent;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// A router's view of one replica: cached block hashes and their tokens.
#[derive(Default)]
struct View {
    blocks: HashMap<i64, Vec<u64>>,
}

impl View {
    /// Applies one msgpack payload `[ts, [events...], dp_rank]`, checking its shape.
    fn apply(&mut self, payload: &[u8], block_size: usize) {
        let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let top = v.as_array().unwrap();
        assert_eq!(top.len(), 3, "{v}");
        assert!(top[0].as_f64().unwrap() > 1.7e9, "a Unix timestamp: {v}");
        assert_eq!(top[2].as_i64(), Some(0), "data-parallel rank");
        for e in top[1].as_array().unwrap() {
            let e = e.as_array().unwrap();
            match e[0].as_str().unwrap() {
                "BlockStored" => {
                    assert_eq!(e.len(), 7, "{e:?}");
                    let hashes: Vec<i64> = e[1].as_array().unwrap().iter().map(|h| h.as_i64().unwrap()).collect();
                    if let Some(parent) = e[2].as_i64() {
                        assert!(self.blocks.contains_key(&parent), "a stored chain hangs from a cached block");
                    }
                    let tokens: Vec<u64> = e[3].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
                    assert_eq!(e[4].as_u64(), Some(block_size as u64));
                    assert_eq!((&e[5], e[6].as_str()), (&Mp::Nil, Some("GPU")));
                    assert_eq!(tokens.len(), hashes.len() * block_size);
                    for (h, t) in hashes.iter().zip(tokens.chunks(block_size)) {
                        assert!(self.blocks.insert(*h, t.to_vec()).is_none(), "stored twice");
                    }
                }
                "BlockRemoved" => {
                    assert_eq!((e.len(), e[2].as_str()), (3, Some("GPU")));
                    for h in e[1].as_array().unwrap() {
                        assert!(self.blocks.remove(&h.as_i64().unwrap()).is_some(), "removal of an unknown block");
                    }
                }
                "AllBlocksCleared" => {
                    assert_eq!(e.len(), 1);
                    self.blocks.clear();
                }
                other => panic!("unknown event {other}"),
            }
        }
    }

    /// The same, from the engine's own batches (before the wire).
    fn apply_batch(&mut self, batch: &KvEventBatch) {
        let bytes = weft::server::kv_events::encode(batch, 4);
        self.apply(&bytes, 4);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A queue of one batch that nobody reads while requests run: the engine goes on, counts
/// what it dropped, and the next batch that fits starts with `AllBlocksCleared` and the
/// whole cache, so the subscriber ends with exactly the engine's blocks.
#[test]
fn a_full_event_queue_never_stalls_the_engine_and_a_snapshot_resyncs() {
    if common::shared_models().is_none() {
        return common::skip();
    }
    let cfg = EngineConfig {
        kv_events: Some(1),
        block_size: 4,
        // 48 blocks: the prompts below evict each other.
        kv_cache_memory: 48 * 4 * 2 * 2 * 2 * 8 * 4,
        ..EngineConfig::default()
    };
    let e = common::engine("tiny-qwen2", cfg);
    let mut rx = e.kv_events().expect("the queue's receiving end");
    assert!(e.kv_events().is_none(), "taken once");
    let mut rng = common::Lcg(7);
    let prompt =
        |rng: &mut common::Lcg| (0..40 + rng.next(60)).map(|_| 100 + rng.next(5000) as u32).collect::<Vec<_>>();
    for _ in 0..12 {
        let p = prompt(&mut rng);
        common::collect(e.submit(common::greedy(&p, 3)).unwrap());
    }
    // Idle, the engine retries the snapshot into the still-full queue every 10 ms; that loses
    // no event, so the count settles (the last step's events may still be counted after its
    // stream closed) and then stays.
    common::assert_all_blocks_free(&e);
    let settle = Instant::now() + Duration::from_secs(2);
    let mut dropped = e.stats().kv_events_dropped;
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = e.stats().kv_events_dropped;
        if now == dropped {
            break;
        }
        assert!(Instant::now() < settle, "the dropped count keeps growing while idle: {now}");
        dropped = now;
    }
    assert!(dropped > 0, "a queue of one batch overflowed: {:?}", e.stats());
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(e.stats().kv_events_dropped, dropped);
    // Idle now, the engine sends the snapshot as soon as the queue has room; then, with more
    // traffic, the view follows the cache on.
    let mut view = View::default();
    // Drains the queue until the view holds what the cache holds (after a `Cleared` when
    // `resync`).
    let follow = |rx: &mut tokio::sync::mpsc::Receiver<KvEventBatch>, view: &mut View, resync: bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut cleared = !resync;
        loop {
            while let Ok(b) = rx.try_recv() {
                cleared |= b.events.first() == Some(&KvEvent::Cleared);
                view.apply_batch(&b);
            }
            if cleared && view.blocks.len() == e.stats().kv_blocks_cached {
                return;
            }
            assert!(Instant::now() < deadline, "{} blocks seen, {:?}", view.blocks.len(), e.stats());
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    follow(&mut rx, &mut view, true);
    assert!(view.blocks.len() > 4);
    common::collect(e.submit(common::greedy(&prompt(&mut rng), 3)).unwrap());
    follow(&mut rx, &mut view, false);
    common::assert_all_blocks_free(&e);
}

/// With no queue asked for, there is none.
#[test]
fn no_events_unless_asked_for() {
    if common::shared_models().is_none() {
        return common::skip();
    }
    let e = common::engine("tiny-qwen2", EngineConfig::default());
    assert!(e.kv_events().is_none());
    let e: EngineHandle = e;
    common::collect(e.submit(common::greedy(&[1; 40], 2)).unwrap());
    assert_eq!(e.stats().kv_events_dropped, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_on_the_wire_replay_and_tell_the_cache_exactly() {
    if common::shared_models().is_none() {
        return common::skip();
    }
    let (port, replay) = (free_port(), free_port());
    let cfg = json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": format!("tcp://*:{port}"),
        "replay_endpoint": format!("tcp://*:{replay}"), "topic": "kv@weft"});
    let s = Server::start(
        "tiny-qwen2",
        &["--block-size", "4", "--kv-cache-memory", "48K", "--kv-events-config", &cfg.to_string()],
    )
    .await;
    let mut sub = SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    sub.subscribe("").await.unwrap();
    // A subscription takes a moment to reach the publisher.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Prompts long enough to fill blocks, some sharing a prefix, more than the cache holds.
    let shared: Vec<u32> = (0..24).map(|i| 300 + i).collect();
    let mut prompts = Vec::new();
    for i in 0..10u32 {
        let mut p = if i % 2 == 0 { shared.clone() } else { Vec::new() };
        p.extend((0..30).map(|j| 1000 + i * 100 + j));
        prompts.push(p);
    }
    for p in &prompts {
        let (st, _) = s.post("/v1/completions", json!({"prompt": p, "max_tokens": 3, "temperature": 0})).await;
        assert_eq!(st, 200);
    }
    s.assert_idle().await;
    let cached = s.metric("weft:kv_cache_blocks_cached ").await as usize;
    assert!(cached > 0);

    // Live: frames are [topic, 8-byte big-endian seq, payload], numbered from 0.
    let mut live = View::default();
    let mut frames: Vec<(u64, Vec<u8>)> = Vec::new();
    // Everything was sent before the server went idle; a quiet half second ends the stream.
    while let Ok(m) = tokio::time::timeout(Duration::from_millis(500), sub.recv()).await {
        let f = m.unwrap().into_vec();
        assert_eq!((f.len(), &f[0][..]), (3, &b"kv@weft"[..]));
        let seq = u64::from_be_bytes(f[1][..].try_into().unwrap());
        assert_eq!(seq, frames.len() as u64, "sequence numbers run without gaps");
        live.apply(&f[2], 4);
        frames.push((seq, f[2].to_vec()));
    }
    assert_eq!(live.blocks.len(), cached);
    // The shared prefix's first block is cached, with its tokens.
    assert!(live.blocks.values().any(|t| t[..] == [300, 301, 302, 303]), "{:?}", live.blocks.values().next());
    let removed = frames.iter().any(|(_, p)| p.windows(12).any(|w| w == b"BlockRemoved"));
    assert!(removed, "the small cache evicted");

    // Replay from 0 and from the middle: [seq, payload] pairs, then seq -1.
    let mut dealer = DealerSocket::new();
    dealer.connect(&format!("tcp://127.0.0.1:{replay}")).await.unwrap();
    for start in [0, frames.len() as u64 / 2] {
        let ask = ZmqMessage::try_from(vec![bytes::Bytes::new(), bytes::Bytes::copy_from_slice(&start.to_be_bytes())])
            .unwrap();
        dealer.send(ask).await.unwrap();
        let mut replayed = Vec::new();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(10), dealer.recv()).await.unwrap().unwrap().into_vec();
            assert_eq!((m.len(), m[0].len()), (3, 0), "[empty, seq, payload]");
            let seq = i64::from_be_bytes(m[1][..].try_into().unwrap());
            if seq == -1 {
                break;
            }
            replayed.push((seq as u64, m[2].to_vec()));
        }
        assert_eq!(replayed, frames[start as usize..], "from {start}");
        if start == 0 {
            let mut view = View::default();
            for (_, p) in &replayed {
                view.apply(p, 4);
            }
            assert_eq!(view.blocks, live.blocks, "a replay rebuilds the same cache");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn render_and_token_ids_match_what_generation_runs() {
    if common::shared_models().is_none() {
        return common::skip();
    }
    let s = Server::start("tiny-qwen2", &[]).await;
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]);

    // The chat render is the chat route's prompt: /tokenize's ids and the usage's count.
    let (st, r) =
        s.post("/v1/chat/completions/render", json!({"messages": messages, "max_tokens": 5, "seed": 3})).await;
    assert_eq!(st, 200, "{r}");
    let (_, tok) = s.post("/tokenize", json!({"messages": messages})).await;
    assert_eq!(r["token_ids"], tok["tokens"], "{r}");
    assert!(r["request_id"].as_str().unwrap().starts_with("chatcmpl"));
    assert_eq!(
        (r["sampling_params"]["max_tokens"].as_u64(), r["sampling_params"]["seed"].as_u64()),
        (Some(5), Some(3))
    );
    let (_, chat) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": true}),
        )
        .await;
    assert_eq!(chat["prompt_token_ids"], r["token_ids"]);
    let generated = chat["choices"][0]["token_ids"].as_array().unwrap().clone();
    assert_eq!(generated.len() as u64, chat["usage"]["completion_tokens"].as_u64().unwrap());

    // Streamed chat: the first chunk has the prompt's ids, then each token's chunk its id.
    let chunks: Vec<Value> = s
        .stream(
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": true, "stream": true}),
        )
        .await
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["prompt_token_ids"], r["token_ids"]);
    let streamed: Vec<Value> =
        chunks.iter().filter_map(|c| c["choices"][0]["token_ids"].as_array()).flatten().cloned().collect();
    assert_eq!(streamed, generated);

    // Completions from those ids give the same tokens; streamed, the same again.
    let body = json!({"prompt": r["token_ids"], "max_tokens": 6, "temperature": 0, "return_token_ids": true});
    let (_, c) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(c["choices"][0]["prompt_token_ids"], r["token_ids"]);
    assert_eq!(c["choices"][0]["token_ids"].as_array().unwrap(), &generated);
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let chunks: Vec<Value> = s
        .stream("/v1/completions", stream_body)
        .await
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["prompt_token_ids"], r["token_ids"]);
    let streamed: Vec<Value> =
        chunks.iter().filter_map(|c| c["choices"][0]["token_ids"].as_array()).flatten().cloned().collect();
    assert_eq!(streamed, generated);

    // Completions render: one request per prompt, text tokenized as /tokenize does.
    let (st, list) = s.post("/v1/completions/render", json!({"prompt": ["Hello world", "Hi"], "max_tokens": 2})).await;
    assert_eq!(st, 200, "{list}");
    let (_, hello) = s.post("/tokenize", json!({"prompt": "Hello world"})).await;
    assert_eq!((list.as_array().unwrap().len(), &list[0]["token_ids"]), (2, &hello["tokens"]));
    assert_ne!(list[0]["request_id"], list[1]["request_id"]);

    // The same caps and 400s as generation.
    let long: Vec<u32> = vec![5; 40_000];
    for (path, body, param) in [
        ("/v1/completions/render", json!({"prompt": long}), "max_model_len"),
        ("/v1/completions/render", json!({"prompt": "x", "n": 100_000}), "n"),
        ("/v1/completions/render", json!({"prompt": [999_999_999u32]}), "vocabulary"),
        ("/v1/chat/completions/render", json!({"messages": []}), "messages"),
        ("/v1/chat/completions/render", json!({"messages": messages, "temperature": "hot"}), "temperature"),
        ("/v1/chat/completions/render", json!({"messages": messages, "top_logprobs": 10_000}), "top_logprobs"),
    ] {
        let (st, e) = s.post(path, body).await;
        assert_eq!(st, 400, "{path}: {e}");
        assert!(e.to_string().contains(param), "{path}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_reads_vllm_metrics_with_no_configuration() {
    if common::shared_models().is_none() {
        return common::skip();
    }
    let s = Server::start("tiny-qwen2", &["--block-size", "8", "--kv-cache-memory", "1M"]).await;
    let (_, text) = s.get("/metrics").await;
    for name in ["vllm:num_requests_waiting ", "vllm:num_requests_running ", "vllm:kv_cache_usage_perc "] {
        assert_eq!(s.metric(name).await, 0.0, "{name}");
    }
    let info = text.lines().find(|l| l.starts_with("vllm:cache_config_info{")).expect("cache_config_info");
    // 1 MiB of f32 K and V for 2 layers of 2 heads of dim 8, in blocks of 8: 512 blocks.
    let labels: HashSet<&str> = info.split(['{', '}', ',']).collect();
    assert!(labels.contains("block_size=\"8\"") && labels.contains("num_gpu_blocks=\"512\""), "{info}");
    assert!(info.trim_end().ends_with(" 1"), "{info}");
    // Under load the gauges move with weft's own.
    let (st, _) = s.post("/v1/completions", json!({"prompt": "Hello", "max_tokens": 2})).await;
    assert_eq!(st, 200);
    assert_eq!(s.metric("vllm:kv_cache_usage_perc ").await, s.metric("weft:kv_cache_usage_perc ").await);
}

#[test]
fn a_bad_kv_events_config_is_a_startup_error_naming_the_key() {
    for (cfg, names) in [
        (r#"{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}"#, "endpont"),
        (r#"{"enable_kv_cache_events": true, "endpoint": "ipc:///x"}"#, "endpoint"),
        (r#"{"enable_kv_cache_events": "yes"}"#, "enable_kv_cache_events"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(["serve", "--port", "0", "--kv-events-config", cfg])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(names) && err.contains("--kv-events-config"), "{cfg}: {err}");
    }
}

/// A GGUF's tokenizer written as a Hugging Face folder (what Dynamo's frontend reads) reads
/// back as the same tokenizer: the same ids for text with special tokens, the same special
/// ids and chat template, as the original Hugging Face folder where there is one.
#[test]
fn export_tokenizer_writes_a_folder_that_tokenizes_as_the_gguf() {
    if common::shared_models().is_none() {
        return common::skip();
    }
    use weft::tokenizer::Tokenizer;
    let texts =
        ["Hello world, how are you?", "<|im_start|>user\nHi<|im_end|>\n", "  spaces\tand\nnewlines ü 日本 🎉", ""];
    for (gguf, hf) in [
        (common::SMOL, Some("smollm2-135m-instruct")),
        ("tiny-qwen2/tiny-qwen2.gguf", Some("tiny-qwen2")),
        ("tiny-gemma3/tiny-gemma3.gguf", Some("tiny-gemma3")),
        ("tiny-llama3-q/tiny-llama3-q.Q8_0.gguf", None),
    ] {
        let Some(path) = common::fixture(gguf) else { continue };
        let out = tempfile::tempdir().unwrap();
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(["export-tokenizer", "--model"])
            .arg(&path)
            .arg("--out")
            .arg(out.path())
            .status()
            .unwrap();
        assert!(status.success(), "{gguf}");
        let g = weft::model::gguf::GgufFile::open(&path).unwrap();
        let from_gguf = Tokenizer::from_gguf(&g).unwrap();
        let exported = Tokenizer::from_dir(out.path()).unwrap();
        let mut tokenizers = vec![("exported", exported)];
        if let Some(dir) = hf.and_then(common::fixture) {
            tokenizers.push(("hf", Tokenizer::from_dir(&dir).unwrap()));
        }
        for (what, t) in &tokenizers {
            for text in texts {
                assert_eq!(t.encode(text).unwrap(), from_gguf.encode(text).unwrap(), "{gguf} {what}: {text:?}");
            }
            assert_eq!(
                (&t.eos_ids, t.bos_id, t.adds_bos),
                (&from_gguf.eos_ids, from_gguf.bos_id, from_gguf.adds_bos),
                "{gguf} {what}"
            );
        }
        assert_eq!(tokenizers[0].1.chat_template, from_gguf.chat_template, "{gguf}");
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap()).unwrap();
        assert!(config["max_position_embeddings"].as_u64().unwrap() > 0 && config["model_type"].is_string());
        assert!(config["architectures"][0].as_str().unwrap().ends_with("ForCausalLM"), "{config}");
        // What transformers reads the folder with, where the original says.
        if let Some(dir) = hf.and_then(common::fixture) {
            let original: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
            assert_eq!(
                (&config["architectures"], &config["model_type"]),
                (&original["architectures"], &original["model_type"]),
                "{gguf}"
            );
        }
    }
}
