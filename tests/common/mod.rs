//! Helpers for tests that use the real models in `../shared/models`.
#![allow(dead_code)]

pub mod naive;
pub mod server;

use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use weft::kv::{BlockAllocator, BlockTable, KvCache, KvCacheDtype};
use weft::loaded::LoadedModel;
use weft::model::{SeqStep, StepInput, WeightDtype, Workspace};
use weft::sampling::argmax;
use weft::tokenizer::{Detokenizer, Tokenizer};

/// The fixtures most tests run on, relative to the shared models folder.
pub const STORIES: &str = "stories260k";
pub const SMOL: &str = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The family fixtures: a Hugging Face directory each, with llama.cpp's GGUF of it beside
/// it as `NAME/NAME.gguf`.
pub const FAMILIES: &[&str] = &[
    "tiny-llama3",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral-swa",
    "tiny-phi3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-qwen3moe",
    "tiny-mixtral",
    "tiny-gemma4",
];

/// gpt-oss, a family outside [`FAMILIES`]: `weft quantize` does not convert its fused
/// experts yet, and its harmony template writes today's date into chat prompts. The family
/// tests that need neither (step shapes, long prompts) run it too.
pub const GPT_OSS: &str = "tiny-gpt-oss";

/// Qwen3.5, the hybrid family outside [`FAMILIES`]: `weft quantize` does not write its
/// DeltaNet layers. The family tests that need no conversion run it too.
pub const QWEN35: &str = "tiny-qwen35";

/// A deterministic stream of numbers for building mixed workloads.
pub struct Lcg(pub u64);

impl Lcg {
    /// The next number below `n`.
    pub fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// `len` ids from 3 up to `vocab`, drawn with `seed`: a prompt of noise.
pub fn random_ids(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Lcg(seed);
    (0..len).map(|_| 3 + rng.next(vocab as u64 - 3) as u32).collect()
}

/// `$WEFT_SHARED_MODELS`, else `shared/models` beside the repository; `None` when absent,
/// so the suite still runs on a machine without them (the test counts itself as skipped,
/// see [`skip`]) — except in CI (`CI=true`), where a missing fixture fails the test.
pub fn shared_models() -> Option<PathBuf> {
    let dir = shared_dir();
    if dir.join("stories260k").exists() {
        Some(dir)
    } else if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but the shared models are missing at {}", dir.display());
    } else {
        skip();
        None
    }
}

fn shared_dir() -> PathBuf {
    std::env::var_os("WEFT_SHARED_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/models"))
}

/// The file of fixture `rel`: in the shared models, or for the default model ([`SMOL`]) also
/// the copy `weft generate` caches on first use, so that its tests run on a fresh clone.
/// `None` (the test skipped) when neither is there.
pub fn fixture(rel: &str) -> Option<PathBuf> {
    let shared = shared_dir().join(rel);
    let cached = weft::cli::model_cache::cache_dir().join(rel);
    if shared.exists() {
        Some(shared)
    } else if rel == SMOL && cached.exists() {
        Some(cached)
    } else {
        shared_models().map(|d| d.join(rel))
    }
}

/// Counts the calling test as skipped for want of fixtures; the first call arranges for one
/// line at the end of this test binary's run that says how many were, and how to get them.
pub fn skip() {
    static SKIPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    extern "C" fn report() {
        let n = SKIPPED.load(std::sync::atomic::Ordering::Relaxed);
        eprintln!(
            "weft tests: {n} skipped in this binary for want of the shared models at {} \
             (put the project's shared/ folder beside the repository or set WEFT_SHARED_MODELS; \
             `cargo run --release -- generate hi` caches the default model that some tests use)",
            shared_dir().display()
        );
    }
    if SKIPPED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0 {
        // SAFETY: `report` is a plain function that only reads an atomic and prints.
        unsafe { libc::atexit(report) };
    }
}

pub struct Case {
    pub id: String,
    /// Whether the prompt ids include the tokenizer's special tokens (false for chat cases,
    /// whose template writes them).
    pub add_special_tokens: bool,
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub generated_text_delta: String,
    pub top5: Vec<(u32, f32)>,
    pub margins: Vec<f32>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The reference document `rel`: a `.json` file, or a folder's `reference.json`.
pub fn reference_json(rel: &str) -> Value {
    let base = shared_models().unwrap().join(rel);
    let path = if rel.ends_with(".json") { base } else { base.join("reference.json") };
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The cases of `rel` (see [`reference_json`]).
pub fn reference(rel: &str) -> Vec<Case> {
    let doc = reference_json(rel);
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            id: c["id"].as_str().unwrap().into(),
            add_special_tokens: c["add_special_tokens"].as_bool().unwrap_or(true),
            prompt: c["prompt"].as_str().unwrap().into(),
            prompt_ids: ids(&c["prompt_token_ids"]),
            generated_ids: ids(&c["generated_token_ids"]),
            generated_text_delta: c["generated_text_delta"].as_str().unwrap().into(),
            top5: c["last_prompt_top5"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                .collect(),
            margins: c["step_top1_top2_margin"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m.as_f64().unwrap() as f32)
                .collect(),
        })
        .collect()
}

/// Each model is loaded once per test binary and shared by its tests, on the exact f32 path.
/// Steps whose top-1/top-2 reference margin is below this may legitimately differ.
pub const MARGIN: f32 = 1e-3;

/// A KV cache of the model's default element type in blocks of 16, and the block table of
/// one sequence of `n` tokens in it, for driving `Decoder::forward` by hand.
pub fn kv_for(m: &LoadedModel, n: usize) -> (KvCache, BlockTable) {
    kv_as(m, n, KvCacheDtype::Auto)
}

/// [`kv_for`] with the KV cache element type `dtype` asks for.
pub fn kv_as(m: &LoadedModel, n: usize, dtype: KvCacheDtype) -> (KvCache, BlockTable) {
    let c = &m.model.config;
    let kv = KvCache::new(m.model.kv_dtype(dtype), &c.kv_shapes(), n.div_ceil(16), 16).with_states(c.state_floats());
    let mut alloc = BlockAllocator::new(kv.num_blocks(), false);
    let mut table = BlockTable::default();
    table.reserve(&mut alloc, n, 16).unwrap();
    (kv, table)
}

/// Logits at every step of `prompt` followed by `generated`, one token at a time after
/// the prompt.
pub fn teacher_forced(m: &LoadedModel, prompt: &[u32], generated: &[u32]) -> Vec<Vec<f32>> {
    teacher_forced_kv(m, prompt, generated, KvCacheDtype::Auto)
}

/// [`teacher_forced`] over a KV cache of the element type `kv_dtype` asks for.
pub fn teacher_forced_kv(m: &LoadedModel, prompt: &[u32], generated: &[u32], kv_dtype: KvCacheDtype) -> Vec<Vec<f32>> {
    let llama = &m.model;
    let (mut kv, table) = kv_as(m, prompt.len() + generated.len(), kv_dtype);
    let mut ws = Workspace::default();
    let (mut ctx, mut feed, mut out) = (0, prompt.to_vec(), Vec::new());
    for &next in generated {
        let seq = [SeqStep::sampled(ctx, feed.len(), table.blocks())];
        out.push(llama.forward(&StepInput { tokens: &feed, seqs: &seq }, &mut kv, &mut ws).to_vec());
        ctx += feed.len();
        feed = vec![next];
    }
    out
}

/// `got` equals `want` within float rounding (every logit within 1e-4 of `want`'s largest
/// magnitude) and picks the same greedy token.
pub fn assert_logits_close(got: &[f32], want: &[f32], what: &str) {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst <= 1e-4 * scale, "{what}: logits differ by {worst} (largest {scale})");
    assert_eq!(weft::sampling::argmax(got), weft::sampling::argmax(want), "{what}: greedy token");
}

pub fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
    let lse = x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// (mean KL(exact ‖ other), top-1 agreement) over every teacher-forced step of the cases
/// of `refs`: how far `other` (quantized weights or activations) strays from `exact`.
pub fn kl_and_agreement(exact: &LoadedModel, other: &LoadedModel, refs: &str) -> (f64, f64) {
    kl_and_agreement_kv(exact, other, refs, KvCacheDtype::Auto)
}

/// [`kl_and_agreement`] with both models over KV caches of the element type `kv_dtype`
/// asks for (`Auto` gives a quantized model an f16 cache, which strays on its own).
pub fn kl_and_agreement_kv(exact: &LoadedModel, other: &LoadedModel, refs: &str, kv_dtype: KvCacheDtype) -> (f64, f64) {
    let (mut kl, mut agree, mut steps) = (0.0, 0, 0);
    for case in reference(refs) {
        let a = teacher_forced_kv(exact, &case.prompt_ids, &case.generated_ids, kv_dtype);
        let b = teacher_forced_kv(other, &case.prompt_ids, &case.generated_ids, kv_dtype);
        for (p, q) in a.iter().zip(&b) {
            let (lp, lq) = (log_softmax(p), log_softmax(q));
            kl += lp.iter().zip(&lq).map(|(x, y)| x.exp() * (x - y)).sum::<f64>();
            agree += (argmax(p) == argmax(q)) as usize;
            steps += 1;
        }
    }
    (kl / steps as f64, agree as f64 / steps as f64)
}

/// The text `generated` adds after `prompt`, streamed through the detokenizer as the
/// engine streams it.
pub fn streamed_text(tok: &Tokenizer, prompt: &[u32], generated: &[u32]) -> String {
    let mut d = Detokenizer::new(tok, prompt, false);
    let mut text = String::new();
    for &id in generated {
        text += &d.push(tok, id).unwrap();
    }
    text + &d.flush(tok).unwrap()
}

/// Teacher-forced over every case of `refdir`: the top-5 logits after the prompt within
/// 1e-3, and every step's argmax where the reference margin is above [`MARGIN`].
pub fn assert_matches_reference(m: &LoadedModel, label: &str, refdir: &str) {
    for case in reference(refdir) {
        let steps = teacher_forced(m, &case.prompt_ids, &case.generated_ids);
        for (step, (logits, &want)) in steps.iter().zip(&case.generated_ids).enumerate() {
            assert_eq!(logits.len(), m.model.config.vocab_size);
            if step == 0 {
                for &(id, want_logit) in &case.top5 {
                    let got = logits[id as usize];
                    assert!((got - want_logit).abs() < 1e-3, "{label} {}: logit[{id}] {got} vs {want_logit}", case.id);
                }
            }
            if case.margins[step] > MARGIN {
                assert_eq!(argmax(logits), want, "{label} {} step {step}", case.id);
            }
        }
    }
}

pub fn model(rel: &str) -> Arc<LoadedModel> {
    model_as(rel, WeightDtype::F32)
}

/// A shared model with its weights in the form `dtype` asks for.
pub fn model_as(rel: &str, dtype: WeightDtype) -> Arc<LoadedModel> {
    type Cache = Mutex<HashMap<(String, WeightDtype), Arc<LoadedModel>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let mut map = CACHE.get_or_init(Default::default).lock().unwrap();
    map.entry((rel.to_string(), dtype))
        .or_insert_with(|| Arc::new(LoadedModel::open(&fixture(rel).unwrap(), dtype).unwrap()))
        .clone()
}

/// The model variants under test on the exact f32 path: (path relative to shared/models,
/// its reference folder or file).
pub const VARIANTS: &[(&str, &str)] = &[
    ("stories260k", "stories260k"),
    ("stories260k/stories260k.gguf", "stories260k"),
    ("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
    ("tiny-llama3", "tiny-llama3"),
    ("tiny-llama3/tiny-llama3.gguf", "tiny-llama3"),
    ("tiny-qwen2", "tiny-qwen2"),
    ("tiny-qwen2/tiny-qwen2.gguf", "tiny-qwen2"),
    ("tiny-qwen3", "tiny-qwen3"),
    ("tiny-qwen3/tiny-qwen3.gguf", "tiny-qwen3"),
    ("tiny-mistral-swa", "tiny-mistral-swa"),
    ("tiny-mistral-swa/tiny-mistral-swa.gguf", "tiny-mistral-swa"),
    ("tiny-phi3", "tiny-phi3"),
    ("tiny-phi3/tiny-phi3.gguf", "tiny-phi3"),
    ("tiny-gemma2", "tiny-gemma2"),
    ("tiny-gemma2/tiny-gemma2.gguf", "tiny-gemma2"),
    ("tiny-gemma3", "tiny-gemma3"),
    ("tiny-gemma3/tiny-gemma3.gguf", "tiny-gemma3"),
    ("tiny-llama3-q/tiny-llama3-q.Q8_0.gguf", "tiny-llama3-q/reference.Q8_0.json"),
    ("tiny-llama3-q/tiny-llama3-q.Q4_0.gguf", "tiny-llama3-q/reference.Q4_0.json"),
    ("tiny-llama3-q/tiny-llama3-q.Q4_1.gguf", "tiny-llama3-q/reference.Q4_1.json"),
    ("tiny-llama3-q/tiny-llama3-q.Q4_K_M.gguf", "tiny-llama3-q/reference.Q4_K_M.json"),
    ("tiny-llama3-q/tiny-llama3-q.Q5_K_M.gguf", "tiny-llama3-q/reference.Q5_K_M.json"),
    ("tiny-llama3-q/tiny-llama3-q.Q6_K.gguf", "tiny-llama3-q/reference.Q6_K.json"),
    // Mixtures of experts (llama.cpp's GGUF stacks each layer's experts in one tensor).
    ("tiny-qwen3moe", "tiny-qwen3moe"),
    ("tiny-qwen3moe/tiny-qwen3moe.gguf", "tiny-qwen3moe"),
    ("tiny-mixtral", "tiny-mixtral"),
    ("tiny-mixtral/tiny-mixtral.gguf", "tiny-mixtral"),
    ("tiny-gpt-oss", "tiny-gpt-oss"),
    ("tiny-gpt-oss/tiny-gpt-oss.gguf", "tiny-gpt-oss"),
    ("tiny-gemma4", "tiny-gemma4"),
    ("tiny-gemma4/tiny-gemma4.gguf", "tiny-gemma4"),
    // Hybrid: gated DeltaNet layers beside full attention.
    (QWEN35, QWEN35),
    ("tiny-qwen35/tiny-qwen35.gguf", QWEN35),
    // Ternary: every form of the same numbers against float activations (the int8 ones,
    // what transformers computes, are judged in tests/ternary.rs).
    ("tiny-bitnet", BITNET_FLOAT),
    ("tiny-bitnet/tiny-bitnet.gguf", BITNET_FLOAT),
    ("tiny-bitnet/tiny-bitnet.TQ2_0.gguf", BITNET_FLOAT),
    ("tiny-bitnet/tiny-bitnet.TQ1_0.gguf", BITNET_FLOAT),
    ("tiny-bitnet/tiny-bitnet.I2_S.gguf", BITNET_FLOAT),
];

/// tiny-bitnet's reference with activations kept in float.
pub const BITNET_FLOAT: &str = "tiny-bitnet/reference.float-activations.json";

use weft::engine::{EngineConfig, EngineHandle, Event, FinishReason, Request, RequestStream, Usage};

/// An engine over a shared model.
pub fn engine(rel: &str, cfg: EngineConfig) -> EngineHandle {
    EngineHandle::start(model(rel), cfg).unwrap()
}

/// What one sample of a request produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: Option<FinishReason>,
    pub usage: Usage,
}

/// Reads a stream to its end: one [`Output`] per sample index.
pub fn collect(mut stream: RequestStream) -> Vec<Output> {
    let mut outs: Vec<Output> = Vec::new();
    while let Some(ev) = stream.blocking_recv() {
        let (index, text) = match &ev {
            Event::Token { index, text, .. } | Event::Finished { index, text, .. } => (*index, text.clone()),
            Event::Error { message } => panic!("engine error: {message}"),
            Event::PromptLogprobs { .. } | Event::Embedding { .. } => continue,
        };
        if outs.len() <= index {
            outs.resize(index + 1, Output::default());
        }
        let o = &mut outs[index];
        o.text += &text;
        match ev {
            Event::Token { id, .. } => o.tokens.push(id),
            Event::Finished { reason, usage, .. } => {
                o.finish = Some(reason);
                o.usage = usage;
            }
            Event::Error { .. } | Event::PromptLogprobs { .. } | Event::Embedding { .. } => unreachable!(),
        }
    }
    outs
}

pub fn greedy(prompt: &[u32], max_tokens: usize) -> Request {
    let mut r = Request::new(prompt.to_vec(), max_tokens);
    r.stop.ignore_eos = true;
    r
}

/// The reference prompts of `refs` give the same greedy ids alone and all in one ragged
/// batch of `m`'s engine (each case `16 + 2 i` tokens, so they end at different steps).
pub fn assert_batch_invariant(m: Arc<LoadedModel>, refs: &str) {
    let cases = reference(refs);
    let busy = EngineHandle::start(m.clone(), EngineConfig::default()).unwrap();
    let streams: Vec<_> =
        cases.iter().enumerate().map(|(i, c)| busy.submit(greedy(&c.prompt_ids, 16 + 2 * i)).unwrap()).collect();
    let together: Vec<_> = streams.into_iter().map(collect).collect();
    let alone = EngineHandle::start(m, EngineConfig { max_num_seqs: 1, ..EngineConfig::default() }).unwrap();
    for (i, c) in cases.iter().enumerate() {
        let one = collect(alone.submit(greedy(&c.prompt_ids, 16 + 2 * i)).unwrap());
        assert_eq!(together[i][0].tokens, one[0].tokens, "{refs} {}", c.id);
    }
}

/// Waits until the engine has nothing running and checks every KV block is free.
pub fn assert_all_blocks_free(e: &EngineHandle) {
    for _ in 0..500 {
        let st = e.stats();
        if st.running == 0 && st.waiting == 0 && st.kv_blocks_used == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("engine did not release its blocks: {:?}", e.stats());
}

/// The parameters of the `get_weather` tool the tool-call tests offer: short city names and
/// a closed unit set, so random-weight models' calls end.
pub fn weather_schema() -> Value {
    serde_json::json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": false})
}

/// A GGUF file's bytes with the u32 value of metadata `key` replaced.
pub fn patched(original: &[u8], key: &str, value: u32) -> Vec<u8> {
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend(key.as_bytes());
    let at = original.windows(needle.len()).position(|w| w == needle).expect("key in file") + needle.len();
    assert_eq!(original[at..at + 4], 4u32.to_le_bytes(), "{key} is a u32");
    let mut b = original.to_vec();
    b[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
    b
}
