//! Prompts of many chunks, end to end: the f32 path against a naive f64 forward pass over
//! prompts far longer than the references' (crossing sliding windows and Llama 3's RoPE
//! regimes many times over), prefilled in one step or in chunks; and every quantized format
//! and family giving a long prompt the same greedy ids inside a busy batch as alone.

mod common;

use common::naive::Naive;
use common::{
    assert_all_blocks_free, assert_logits_close, collect, greedy, kv_for, model_as, random_ids, shared_models, Lcg,
    FAMILIES, GPT_OSS, MARGIN, QWEN35, SMOL, STORIES,
};
use weft::engine::{EngineConfig, EngineHandle, Request};
use weft::loaded::LoadedModel;
use weft::model::{SeqStep, StepInput, WeightDtype, Workspace};
use weft::sampling::{argmax, SamplingParams};

/// Logits after the prompt and after each of `generated` fed one at a time, the prompt
/// prefilled in steps of `chunk` tokens (each step asking for no logits until the last).
fn forward_chunked(m: &LoadedModel, prompt: &[u32], generated: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let c = &m.model.config;
    let (mut kv, table) = kv_for(m, prompt.len() + generated.len());
    let mut ws = Workspace::default();
    let mut out = Vec::new();
    for start in (0..prompt.len()).step_by(chunk) {
        let end = (start + chunk).min(prompt.len());
        let last = end == prompt.len();
        let seq = [SeqStep {
            context_len: start,
            num_tokens: end - start,
            seq_len: prompt.len(),
            block_table: table.blocks(),
            state_slot: 0,
            captures: &[],
            logits: usize::from(last),
            hidden: 0,
        }];
        let logits = m.model.forward(&StepInput { tokens: &prompt[start..end], seqs: &seq }, &mut kv, &mut ws);
        assert_eq!(logits.len(), usize::from(last) * c.vocab_size, "chunk at {start}: logits only for the last row");
        if last {
            out.push(logits.to_vec());
        }
    }
    for (i, &t) in generated.iter().enumerate() {
        let seq = [SeqStep::sampled(prompt.len() + i, 1, table.blocks())];
        out.push(m.model.forward(&StepInput { tokens: &[t], seqs: &seq }, &mut kv, &mut ws).to_vec());
    }
    out
}

/// The f32 path over a long random prompt against the naive forward pass: every logit
/// within 1e-3 after the prompt and at each of 8 greedy steps, the greedy ids equal where
/// the naive margin allows; and prefilling in one step, in 64-token chunks or in 7-token
/// chunks gives the same logits bit for bit.
#[test]
fn f32_long_prompts_match_a_naive_forward_pass() {
    let Some(models) = shared_models() else { return };
    // stories260k fills its 512 positions; tiny-llama3 runs past Llama 3's original 8192
    // context's low-frequency band; tiny-mistral-swa crosses its 32-token window 90 times.
    for (dir, len) in [(STORIES, 500), ("tiny-llama3", 3000), ("tiny-mistral-swa", 2900)] {
        let m = model_as(dir, WeightDtype::F32);
        let prompt = random_ids(len, m.model.config.vocab_size, len as u64);
        let whole = forward_chunked(&m, &prompt, &[], len);
        // Greedy continuation from weft's own logits, then everything teacher-forced.
        let mut generated = vec![argmax(&whole[0])];
        while generated.len() < 8 {
            let l = forward_chunked(&m, &prompt, &generated, len);
            generated.push(argmax(l.last().unwrap()));
        }
        let steps = forward_chunked(&m, &prompt, &generated[..7], len);
        for chunk in [64, 7] {
            assert_eq!(forward_chunked(&m, &prompt, &generated[..7], chunk), steps, "{dir}: chunks of {chunk}");
        }
        let mut naive = Naive::load(&models.join(dir));
        let mut want = Vec::new();
        for &t in &prompt {
            want = naive.push(t);
        }
        for (step, got) in steps.iter().enumerate() {
            let worst = got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max);
            assert!(worst < 1e-3, "{dir} step {step}: a logit is {worst} from the naive pass");
            let mut sorted = want.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > MARGIN as f64 {
                let best = want.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
                assert_eq!(generated[step] as usize, best, "{dir} step {step}");
            }
            want = naive.push(generated[step]);
        }
    }
}

/// A prompt of several default chunks on every quantized format and family: the same greedy
/// ids alone and inside a busy batch that prefills in 64-token chunks beside decodes.
#[test]
fn long_prompts_in_a_busy_batch_on_every_format_and_family() {
    if shared_models().is_none() {
        return;
    }
    let quantized =
        ["Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K"].map(|t| format!("tiny-llama3-q/tiny-llama3-q.{t}.gguf"));
    let families = FAMILIES.iter().chain([&GPT_OSS, &QWEN35]).map(|f| format!("{f}/{f}.gguf"));
    for rel in quantized.into_iter().chain(families).chain([SMOL.to_string()]) {
        let m = model_as(&rel, WeightDtype::Auto);
        let c = &m.model.config;
        let len = 2000.min(c.max_position_embeddings - 40);
        let prompt = random_ids(len, c.vocab_size.min(30_000), 7);
        let alone = EngineHandle::start(m.clone(), EngineConfig { max_num_seqs: 1, ..Default::default() }).unwrap();
        let want = collect(alone.submit(greedy(&prompt, 16)).unwrap()).remove(0);
        let busy =
            EngineHandle::start(m.clone(), EngineConfig { max_num_batched_tokens: 64, ..Default::default() }).unwrap();
        let mut rng = Lcg(11);
        let others: Vec<_> = (0..6)
            .map(|i| {
                let mut r = Request::new(random_ids(1 + rng.next(300) as usize, c.vocab_size.min(30_000), i), 24);
                r.sampling = SamplingParams { temperature: 0.8, seed: Some(i), ..Default::default() };
                busy.submit(r).unwrap()
            })
            .collect();
        let got = collect(busy.submit(greedy(&prompt, 16)).unwrap()).remove(0);
        assert_eq!(got.tokens, want.tokens, "{rel}: a {len}-token prompt in a busy batch");
        others.into_iter().for_each(|o| drop(collect(o)));
        assert_all_blocks_free(&busy);
    }
}

/// A step of no rows, and a step of prompt rows none of which wants logits, on every
/// quantized file and the f32 path: no logits, no panic (the LM head is not called).
#[test]
fn steps_without_logits_compute_none() {
    if shared_models().is_none() {
        return;
    }
    for t in ["Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K"] {
        for dtype in [WeightDtype::Auto, WeightDtype::F32] {
            let m = model_as(&format!("tiny-llama3-q/tiny-llama3-q.{t}.gguf"), dtype);
            let c = &m.model.config;
            let (mut kv, table) = kv_for(&m, 64);
            let mut ws = Workspace::default();
            assert!(m.model.forward(&StepInput { tokens: &[], seqs: &[] }, &mut kv, &mut ws).is_empty());
            let prompt = random_ids(40, c.vocab_size, 5);
            let seq = [SeqStep {
                context_len: 0,
                num_tokens: 40,
                seq_len: 64,
                block_table: table.blocks(),
                state_slot: 0,
                captures: &[],
                logits: 0,
                hidden: 0,
            }];
            assert!(m.model.forward(&StepInput { tokens: &prompt, seqs: &seq }, &mut kv, &mut ws).is_empty(), "{t}");
        }
    }
}

/// Every family on the f32 path, a prompt of several chunks (to the context where it is
/// shorter): prefilling it in one step, in 64-token chunks or in 7-token chunks gives the
/// same logits bit for bit, after the prompt and at each of 4 steps after it. (The naive
/// pass above covers the Llama families; the references cover each family's short prompts.)
/// Qwen3.5's delta rule takes a prompt in runs of 64 positions at once, so there 64-token
/// chunks are bit for bit and 7-token ones (runs cut at every step) equal within rounding.
#[test]
fn f32_chunked_prefill_is_bit_identical_on_every_family() {
    if shared_models().is_none() {
        return;
    }
    for dir in FAMILIES.iter().chain([&STORIES, &GPT_OSS, &QWEN35]) {
        let m = model_as(dir, WeightDtype::F32);
        let c = &m.model.config;
        let len = 1500.min(c.max_position_embeddings - 8);
        let prompt = random_ids(len, c.vocab_size, 3);
        let generated = random_ids(4, c.vocab_size, 4);
        let whole = forward_chunked(&m, &prompt, &generated, len);
        assert!(forward_chunked(&m, &prompt, &generated, 64) == whole, "{dir}: chunks of 64");
        let sevens = forward_chunked(&m, &prompt, &generated, 7);
        if *dir != QWEN35 {
            assert!(sevens == whole, "{dir}: chunks of 7");
            continue;
        }
        for (i, (got, want)) in sevens.iter().zip(&whole).enumerate() {
            assert_logits_close(got, want, &format!("{dir}: chunks of 7, step {i}"));
        }
    }
}
