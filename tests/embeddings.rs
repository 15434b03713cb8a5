//! Embeddings from a tiny embedding model made at test time out of tiny-qwen3's weights
//! (its files linked into a scratch directory beside sentence-transformers' pooling
//! config): mean and last-token pooling equal a naive f64 computation, prompts longer than
//! a chunk included, the same alone or in a busy batch; over HTTP every input form gives
//! the same vectors, `dimensions` and base64 work, and bad input is a 400.

mod common;

use common::naive::Naive;
use common::server::Server;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use weft::engine::{EngineConfig, EngineHandle, Event, Request};
use weft::loaded::LoadedModel;
use weft::model::WeightDtype;

/// tiny-qwen3 as an embedding model pooled by `mode` (`mean_tokens` or `lasttoken`).
fn embedding_model(mode: &str, matryoshka: bool) -> tempfile::TempDir {
    let src = common::fixture("tiny-qwen3").unwrap();
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::os::unix::fs::symlink(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["is_matryoshka"] = matryoshka.into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
    let pooling = json!({"word_embedding_dimension": 32, format!("pooling_mode_{mode}"): true});
    std::fs::write(dir.path().join("1_Pooling/config.json"), pooling.to_string()).unwrap();
    dir
}

/// The naive embedding of `ids`: the final hidden states' mean (or the last), normalised.
fn naive(dir: &Path, ids: &[u32], mean: bool) -> Vec<f64> {
    let mut n = Naive::load(dir);
    let rows: Vec<Vec<f64>> = ids.iter().map(|&t| n.push_hidden(t)).collect();
    let pooled: Vec<f64> = if mean {
        (0..rows[0].len()).map(|i| rows.iter().map(|r| r[i]).sum::<f64>() / rows.len() as f64).collect()
    } else {
        rows.last().unwrap().clone()
    };
    let norm = pooled.iter().map(|x| x * x).sum::<f64>().sqrt();
    pooled.iter().map(|x| x / norm).collect()
}

fn embed(engine: &EngineHandle, ids: &[u32]) -> Vec<f32> {
    let mut s = engine.submit(Request { embed: true, ..Request::new(ids.to_vec(), 1) }).unwrap();
    let (mut vector, mut finished) = (None, false);
    while let Some(ev) = s.blocking_recv() {
        match ev {
            Event::Embedding { vector: v } => vector = Some(v),
            Event::Finished { usage, .. } => {
                assert_eq!((usage.prompt_tokens, usage.completion_tokens), (ids.len(), 0));
                finished = true;
            }
            Event::Error { message } => panic!("{message}"),
            _ => {}
        }
    }
    assert!(finished);
    vector.expect("an embedding")
}

#[test]
fn pooling_equals_a_naive_computation_alone_and_in_a_batch() {
    if common::shared_models().is_none() {
        return;
    }
    let mut rng = common::Lcg(7);
    // One token, a few, and prompts longer than the 16-token chunk.
    let prompts: Vec<Vec<u32>> =
        [1, 5, 16, 37, 70].iter().map(|&n| (0..n).map(|_| 10 + rng.next(150_000) as u32).collect()).collect();
    for (mode, mean) in [("mean_tokens", true), ("lasttoken", false)] {
        let dir = embedding_model(mode, false);
        let model = Arc::new(LoadedModel::open(dir.path(), WeightDtype::F32).unwrap());
        let config = EngineConfig { max_num_batched_tokens: 16, ..EngineConfig::default() };
        let alone = EngineHandle::start(model.clone(), EngineConfig { max_num_seqs: 1, ..config.clone() }).unwrap();
        let busy = EngineHandle::start(model, config).unwrap();
        // The busy engine also generates, and embeds everything at once.
        let noise: Vec<_> = (0..4).map(|i| busy.submit(common::greedy(&prompts[i], 20)).unwrap()).collect();
        let together: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| embed(&busy, p))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        noise.into_iter().for_each(|s| drop(common::collect(s)));
        for (p, batched) in prompts.iter().zip(&together) {
            let want = naive(dir.path(), p, mean);
            let err = want.iter().zip(batched).map(|(w, g)| (w - *g as f64).abs()).fold(0.0, f64::max);
            assert!(err < 1e-5, "{mode}, {} tokens: off by {err}", p.len());
            assert_eq!(&embed(&alone, p), batched, "{mode}, {} tokens: batched differs from alone", p.len());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_input_form_over_http() {
    if common::shared_models().is_none() {
        return;
    }
    let dir = embedding_model("lasttoken", true);
    let path = dir.path().to_str().unwrap();
    let s = Server::start(path, &["--max-model-len", "64", "--dtype", "f32"]).await;
    let (_, tok) = s.post("/tokenize", json!({"prompt": "Hello world"})).await;
    let ids = tok["tokens"].clone();
    let (st, a) = s.post("/v1/embeddings", json!({"input": "Hello world"})).await;
    assert_eq!(st, 200, "{a}");
    let v = a["data"][0]["embedding"].clone();
    assert_eq!(v.as_array().unwrap().len(), 32);
    assert_eq!(a["usage"]["prompt_tokens"], tok["count"]);
    for input in [json!(["Hello world", "Hi"]), ids.clone(), json!([ids, [1, 2, 3]])] {
        let (st, b) = s.post("/v1/embeddings", json!({"input": input})).await;
        assert_eq!((st, &b["data"][0]["embedding"]), (200, &v), "{input}");
    }
    // base64: the same little-endian f32s.
    let (_, b) = s.post("/v1/embeddings", json!({"input": "Hello world", "encoding_format": "base64"})).await;
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD.decode(b["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let floats: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(json!(floats), v);
    // dimensions: the prefix, normalised again.
    let (_, d) = s.post("/v1/embeddings", json!({"input": "Hello world", "dimensions": 8})).await;
    let short: Vec<f64> = d["data"][0]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let prefix: Vec<f64> = v.as_array().unwrap()[..8].iter().map(|x| x.as_f64().unwrap()).collect();
    let norm = prefix.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!(short.iter().zip(&prefix).all(|(s, p)| (s - p / norm).abs() < 1e-6), "{short:?}");
    for (body, param) in [
        (json!({"input": []}), "input"),
        (json!({"input": ""}), "input"),
        (json!({"input": [[]]}), "input"),
        (json!({"input": vec![1u32; 100]}), "input"),
        (json!({"input": vec!["a"; 2049]}), "input"),
        (json!({"input": "x", "dimensions": 0}), "dimensions"),
        (json!({"input": "x", "dimensions": 33}), "dimensions"),
        (json!({"input": "x", "encoding_format": "hex"}), "encoding_format"),
        (json!({"input": 5}), "input"),
    ] {
        let (st, e) = s.post("/v1/embeddings", body.clone()).await;
        assert_eq!((st, e["error"]["param"].as_str()), (400, Some(param)), "{body}: {e}");
    }
    s.assert_idle().await;
}

/// A plain language model answers too (its last token's final hidden state), and refuses
/// `dimensions`, which it was not trained for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_language_model_answers_with_its_last_token() {
    if common::fixture(common::SMOL).is_none() {
        return;
    }
    let s = Server::start(common::SMOL, &[]).await;
    let (st, a) = s.post("/v1/embeddings", json!({"input": ["Hello", "The cat sat on the mat"]})).await;
    assert_eq!(st, 200, "{a}");
    for d in a["data"].as_array().unwrap() {
        let norm: f64 = d["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap().powi(2)).sum();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    }
    assert_eq!(s.post("/v1/embeddings", json!({"input": "x", "dimensions": 8})).await.0, 400);
    assert_eq!(s.post("/v1/embeddings", json!({"input": "x", "model": "other"})).await.0, 404);
    s.assert_idle().await;
}
