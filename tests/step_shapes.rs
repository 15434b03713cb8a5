//! Every step shape that real traffic makes, on every weight format and family: random
//! schedules (prompts from one token to several chunk budgets, budgets from 1 to 1024
//! tokens a step, decodes and chunks mixed, `n > 1`, prefix-cache hits that leave one token
//! to compute, preemption under a small KV pool, n-gram drafts on and off) must give each
//! greedy sequence the ids it gets alone, and leave every KV block free.

mod common;

use common::{
    assert_all_blocks_free, collect, greedy, model_as, shared_models, Lcg, FAMILIES, GPT_OSS, QWEN35, SMOL, STORIES,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use weft::engine::{EngineConfig, EngineHandle, EngineStats, FinishReason, Request};
use weft::kernels::quant::GgmlType;
use weft::loaded::LoadedModel;
use weft::model::file_type::{FileType, Mix};
use weft::model::WeightDtype;
use weft::sampling::SamplingParams;

const NGRAM: &str = r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":2}"#;

/// Prefill budgets a schedule draws from: one token a step, odd sizes, the default, and more.
const BUDGETS: [usize; 10] = [1, 2, 3, 7, 16, 31, 64, 100, 512, 1024];

/// Block sizes a schedule draws from: the AVX2 attention's multiples of 8 and the portable
/// path's smaller blocks (more block boundaries, the same bits).
const BLOCKS: [usize; 5] = [2, 4, 8, 16, 16];

/// Longest prompt a schedule sends (the tiny models' attention over it stays cheap).
const LONGEST: usize = 2600;

/// What the schedules of one model exercised, for the report at the end of a test.
#[derive(Default, Debug)]
struct Seen {
    schedules: usize,
    requests: usize,
    steps: u64,
    preemptions: u64,
    prefix_hits: u64,
    drafts: u64,
    longest_prompt: usize,
}

impl Seen {
    fn add(&mut self, st: &EngineStats, requests: usize, longest: usize) {
        self.schedules += 1;
        self.requests += requests;
        self.steps += st.steps;
        self.preemptions += st.preemptions;
        self.prefix_hits += st.prefix_cache_hits;
        self.drafts += st.spec_drafts;
        self.longest_prompt = self.longest_prompt.max(longest);
    }
}

/// A request checked against its run alone, or one that only keeps the batch busy.
struct Planned {
    request: Request,
    checked: bool,
}

/// One model's greedy ids alone: one request at a time, default chunks, no drafts, no
/// prefix cache, memoised by (prompt, max_tokens).
struct Alone {
    engine: EngineHandle,
    known: HashMap<(Vec<u32>, usize), Vec<u32>>,
}

impl Alone {
    fn new(model: Arc<LoadedModel>) -> Self {
        let cfg = EngineConfig {
            max_num_seqs: 1,
            prefix_caching: false,
            kv_cache_memory: 256 << 20,
            ..EngineConfig::default()
        };
        Alone { engine: EngineHandle::start(model, cfg).unwrap(), known: HashMap::new() }
    }

    fn ids(&mut self, r: &Request) -> Vec<u32> {
        let key = (r.prompt.clone(), r.stop.max_tokens);
        if let Some(ids) = self.known.get(&key) {
            return ids.clone();
        }
        let out = collect(self.engine.submit(greedy(&r.prompt, r.stop.max_tokens)).unwrap()).remove(0);
        self.known.insert(key, out.tokens.clone());
        out.tokens
    }
}

fn pick<T: Copy>(rng: &mut Lcg, xs: &[T]) -> T {
    xs[rng.next(xs.len() as u64) as usize]
}

/// A prompt of `len` tokens below `vocab`, with repeats for the n-gram drafter to find.
fn prompt(rng: &mut Lcg, len: usize, vocab: u32) -> Vec<u32> {
    let mut p: Vec<u32> = Vec::with_capacity(len);
    while p.len() < len {
        if p.len() > 8 && rng.next(4) == 0 {
            let start = rng.next(p.len() as u64 - 4) as usize;
            let run: Vec<u32> = p[start..start + 4].to_vec();
            p.extend(run);
        } else {
            p.push(3 + rng.next(vocab as u64 - 3) as u32);
        }
    }
    p.truncate(len);
    p
}

/// A random schedule for a model of context `ctx` and vocabulary `vocab`: its engine
/// settings and two waves of requests (the second repeats prefixes of the first, whose
/// blocks are cached by then).
fn schedule(rng: &mut Lcg, model: &LoadedModel, blocks: &[usize]) -> (EngineConfig, [Vec<Planned>; 2]) {
    let c = &model.model.config;
    let vocab = c.vocab_size.min(30_000) as u32;
    let budget = pick(rng, &BUDGETS);
    let block_size = pick(rng, blocks);
    let recurrent = c.state_floats() > 0;
    let speculative: Option<weft::engine::speculative::SpeculativeConfig> =
        (rng.next(2) == 0).then(|| NGRAM.parse().unwrap());
    let longest = (3 * budget + budget / 2).clamp(4, LONGEST).min(c.max_position_embeddings - 40);
    let mut first = Vec::new();
    for _ in 0..3 + rng.next(4) {
        // Lengths from a short chat turn to several chunks: a third within one chunk.
        let upto = if rng.next(3) == 0 { budget.min(longest) } else { longest };
        let len = 1 + rng.next(upto as u64);
        let mut r = greedy(&prompt(rng, len as usize, vocab), 1 + rng.next(12) as usize);
        r.n = pick(rng, &[1, 1, 1, 2, 3]);
        first.push(Planned { request: r, checked: true });
    }
    // Prefix hits: the same prompt (all cached but the token that must be computed), its
    // whole blocks and one token more, and one token beyond it.
    let mut second = Vec::new();
    for p in &first {
        let base = &p.request.prompt;
        let variant = match rng.next(4) {
            0 => base.clone(),
            1 => base[..base.len() / block_size * block_size].iter().copied().chain([5]).collect(),
            2 => base.iter().copied().chain([6]).collect(),
            _ => {
                let len = 1 + rng.next(longest as u64) as usize;
                prompt(rng, len, vocab)
            }
        };
        second.push(Planned { request: greedy(&variant, 1 + rng.next(12) as usize), checked: true });
    }
    // Sampled requests that only keep the batch busy.
    for wave in [&mut first, &mut second] {
        for _ in 0..rng.next(4) {
            let len = 1 + rng.next(longest as u64) as usize;
            let mut r = Request::new(prompt(rng, len, vocab), 1 + rng.next(16) as usize);
            r.sampling = SamplingParams { temperature: 0.9, seed: Some(rng.next(1000)), ..Default::default() };
            wave.push(Planned { request: r, checked: false });
        }
    }
    // A pool that holds everything at once, or, one schedule in three, little more than the
    // largest request: then sequences are preempted and recomputed.
    let blocks = |r: &Request| (r.prompt.len() + r.stop.max_tokens + 4).div_ceil(block_size) * r.n + 4;
    let all: Vec<&Request> = first.iter().chain(&second).map(|p| &p.request).collect();
    let largest = all.iter().map(|r| blocks(r)).max().unwrap();
    let total: usize = all.iter().map(|r| blocks(r)).sum();
    let pool = if rng.next(3) == 0 { largest + rng.next(8) as usize } else { total + 8 };
    let kv_dtype = model.model.kv_dtype(Default::default());
    let per_block = weft::kv::KvCache::bytes_per_block(kv_dtype, &c.kv_shapes(), block_size);
    // A hybrid model's state slots and a few prefix snapshots beside the blocks.
    let snapshots = if recurrent { pick(rng, &[0, 2, 64]) } else { 0 };
    let drafts = speculative.as_ref().map_or(0, |s| s.num_speculative_tokens);
    let states = (EngineConfig::default().max_num_seqs * (1 + drafts) + snapshots) * 4 * c.state_floats();
    let cfg = EngineConfig {
        max_num_batched_tokens: budget,
        block_size,
        kv_cache_memory: per_block * pool + states,
        state_snapshots: Some(snapshots),
        speculative,
        ..EngineConfig::default()
    };
    (cfg, [first, second])
}

/// `schedules` random schedules of `model`: every checked sequence's greedy ids equal its
/// ids alone, every request ends, and every block is free afterwards.
fn run_schedules(label: &str, model: Arc<LoadedModel>, schedules: usize, seed: u64, blocks: &[usize]) -> Seen {
    let t0 = std::time::Instant::now();
    let mut alone = Alone::new(model.clone());
    let mut seen = Seen::default();
    for s in 0..schedules {
        let mut rng = Lcg(seed * 1000 + s as u64);
        let (cfg, waves) = schedule(&mut rng, &model, blocks);
        let what = format!(
            "{label} schedule {s}: budget {}, block {}, pool {} B, drafts {}",
            cfg.max_num_batched_tokens,
            cfg.block_size,
            cfg.kv_cache_memory,
            cfg.speculative.is_some()
        );
        let t1 = std::time::Instant::now();
        let engine = EngineHandle::start(model.clone(), cfg).unwrap();
        let (mut requests, mut longest) = (0, 0);
        for wave in waves {
            let streams: Vec<_> = wave.iter().map(|p| engine.submit(p.request.clone()).unwrap()).collect();
            for (p, stream) in wave.iter().zip(streams) {
                let outs = collect(stream);
                let r = &p.request;
                assert_eq!(outs.len(), r.n, "{what}: one output per sample");
                for (i, o) in outs.iter().enumerate() {
                    assert!(o.finish.is_some_and(|f| f != FinishReason::Error), "{what}: sample {i} ended {o:?}");
                }
                if p.checked {
                    let want = alone.ids(r);
                    for (i, o) in outs.iter().enumerate() {
                        assert_eq!(o.tokens, want, "{what}: prompt of {} tokens, sample {i}", r.prompt.len());
                    }
                }
                requests += 1;
                longest = longest.max(r.prompt.len());
            }
        }
        assert_all_blocks_free(&engine);
        eprintln!("  {what}: {:.1} s, {} steps", t1.elapsed().as_secs_f64(), engine.stats().steps);
        seen.add(&engine.stats(), requests, longest);
    }
    eprintln!("{label}: {seen:?} in {:.1} s", t0.elapsed().as_secs_f64());
    seen
}

/// tiny-llama3-q (hidden 256, so K-quant super-blocks apply) in `base`, requantized from its
/// Q8_0 file into the scratch directory `dir`.
fn requantized(base: GgmlType, dir: &Path) -> Arc<LoadedModel> {
    let src = shared_models().unwrap().join("tiny-llama3-q/tiny-llama3-q.Q8_0.gguf");
    let out = dir.join(format!("{base}.gguf"));
    weft::model::requantize::requantize(&src, &out, FileType { base, mix: Mix::Pure }).unwrap();
    Arc::new(LoadedModel::open(&out, WeightDtype::Auto).unwrap())
}

/// The files of tiny-llama3-q as they come (Q8_0, Q4_0, Q4_1, and the K-quant mixes).
const QUANTIZED: [&str; 6] = ["Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K"];

#[test]
fn every_stored_quantized_format() {
    if shared_models().is_none() {
        return;
    }
    for (i, t) in QUANTIZED.iter().enumerate() {
        let rel = format!("tiny-llama3-q/tiny-llama3-q.{t}.gguf");
        run_schedules(t, model_as(&rel, WeightDtype::Auto), 5, 10 + i as u64, &BLOCKS);
    }
}

/// The block formats no fixture stores (Q5_0, Q5_1, IQ4_NL, IQ4_XS), F16, and the f32 path.
#[test]
fn every_written_format_and_f32() {
    if shared_models().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let written = [GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Iq4Nl, GgmlType::Iq4Xs, GgmlType::F16];
    for (i, t) in written.into_iter().enumerate() {
        run_schedules(&t.to_string(), requantized(t, dir.path()), 4, 20 + i as u64, &BLOCKS);
    }
    run_schedules("F32", model_as("tiny-llama3-q/tiny-llama3-q.Q8_0.gguf", WeightDtype::F32), 4, 30, &BLOCKS);
}

/// Each family fixture as it loads by default (GGUF: F16 matrices; SmolLM2: Q4_1), and
/// stories260k's f32 safetensors.
#[test]
fn every_family() {
    if shared_models().is_none() {
        return;
    }
    let files = FAMILIES.iter().chain([&GPT_OSS, &QWEN35]).map(|f| format!("{f}/{f}.gguf"));
    let files = files.chain([SMOL.to_string(), STORIES.to_string()]);
    for (i, rel) in files.enumerate() {
        // SmolLM2 is 135M parameters: one schedule, on the AVX2 attention's blocks.
        let (schedules, blocks) = if rel == SMOL { (1, &[16][..]) } else { (4, &BLOCKS[..]) };
        run_schedules(&rel, model_as(&rel, WeightDtype::Auto), schedules, 40 + i as u64, blocks);
    }
}
