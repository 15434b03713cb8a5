//! Speculative decoding changes speed, never output: every event a request gets (token
//! ids, text, logprobs, finish reason, usage) is the same with n-gram or draft-model
//! speculation as without, alone and among 31 others. Seeded sampling is held to the same
//! bar — identical draws per seed, which is stronger than matching the distribution.

mod common;

use common::{assert_all_blocks_free, model, model_as, reference, shared_models, SMOL, STORIES};
use weft::engine::speculative::SpeculativeConfig;
use weft::engine::{EngineConfig, EngineHandle, Event, Request};
use weft::model::WeightDtype;
use weft::sampling::SamplingParams;

/// A request's events, grouped by sample (samples of `n > 1` interleave as the batch runs),
/// without `cached_tokens` (which prompts repeat an earlier one's depends on timing).
fn by_sample(mut s: weft::engine::RequestStream) -> Vec<Event> {
    let mut all: Vec<Event> = std::iter::from_fn(|| s.blocking_recv()).collect();
    // What the prefix cache held differs between engines; the tokens must not.
    for e in &mut all {
        match e {
            Event::Finished { usage, .. } => usage.cached_tokens = 0,
            Event::Token { cached_tokens, .. } => *cached_tokens = 0,
            _ => {}
        }
    }
    all.sort_by_key(|e| match e {
        Event::Token { index, .. } | Event::Finished { index, .. } => *index,
        Event::Error { .. } | Event::PromptLogprobs { .. } | Event::Embedding { .. } => usize::MAX,
    });
    all
}

fn events(e: &EngineHandle, r: &Request) -> Vec<Event> {
    by_sample(e.submit(r.clone()).unwrap())
}

/// 32 requests over the reference prompts with the options speculation must leave alone:
/// greedy and seeded sampling, penalties, stop strings, logprobs, `n = 2`, short `max_tokens`.
fn requests(prompts: &[Vec<u32>]) -> Vec<Request> {
    (0..32)
        .map(|i| {
            let mut r = Request::new(prompts[i % prompts.len()].clone(), 32);
            r.stop.ignore_eos = i % 3 != 0;
            match i % 8 {
                0 | 1 => {}
                2 => {
                    r.sampling =
                        SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(i as u64), ..Default::default() }
                }
                3 => {
                    r.sampling =
                        SamplingParams { repetition_penalty: 1.3, frequency_penalty: 0.4, ..Default::default() }
                }
                4 => r.stop.stop_strings = vec![".".into(), " and".into()],
                5 => r.sampling.logprobs = Some(3),
                6 => {
                    r.n = 2;
                    r.sampling = SamplingParams { temperature: 1.0, seed: Some(7 + i as u64), ..Default::default() };
                }
                _ => r.stop.max_tokens = 1 + i % 4,
            }
            r
        })
        .collect()
}

fn spec(json: &str) -> Option<SpeculativeConfig> {
    Some(SpeculativeConfig::parse(json).unwrap())
}

/// Runs `reqs` one at a time without speculation, then with `speculative` one at a time and
/// all at once; every request's events must match. Returns the draft tokens verified and
/// accepted in both speculating engines.
fn same_events(
    target: std::sync::Arc<weft::loaded::LoadedModel>,
    speculative: Option<SpeculativeConfig>,
    reqs: &[Request],
) -> (u64, u64) {
    let base = EngineConfig { kv_cache_memory: 64 << 20, ..EngineConfig::default() };
    let plain = EngineHandle::start(target.clone(), EngineConfig { max_num_seqs: 1, ..base.clone() }).unwrap();
    let want: Vec<Vec<Event>> = reqs.iter().map(|r| events(&plain, r)).collect();
    let cfg = EngineConfig { speculative, ..base };
    let alone = EngineHandle::start(target.clone(), EngineConfig { max_num_seqs: 1, ..cfg.clone() }).unwrap();
    for (i, (r, w)) in reqs.iter().zip(&want).enumerate() {
        assert_eq!(&events(&alone, r), w, "request {i} alone");
    }
    let busy = EngineHandle::start(target, cfg).unwrap();
    let streams: Vec<_> = reqs.iter().map(|r| busy.submit(r.clone()).unwrap()).collect();
    for (i, (s, w)) in streams.into_iter().zip(&want).enumerate() {
        assert_eq!(&by_sample(s), w, "request {i} among {}", reqs.len());
    }
    assert_all_blocks_free(&alone);
    assert_all_blocks_free(&busy);
    let (a, b) = (alone.stats(), busy.stats());
    (a.spec_draft_tokens + b.spec_draft_tokens, a.spec_accepted_tokens + b.spec_accepted_tokens)
}

#[test]
fn ngram_speculation_changes_no_event() {
    if shared_models().is_none() {
        return;
    }
    let config = r#"{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":1,"prompt_lookup_max":3}"#;
    for rel in [STORIES, SMOL, "tiny-mixtral/tiny-mixtral.gguf"] {
        let prompts: Vec<Vec<u32>> =
            reference(rel.split('/').next().unwrap()).into_iter().map(|c| c.prompt_ids).collect();
        let (drafted, accepted) = same_events(model(rel), spec(config), &requests(&prompts));
        eprintln!("{rel}: {accepted} of {drafted} draft tokens accepted");
        // stories260k's rows cost about as much as its whole step (its LM head is most of
        // the model), so drafts rarely pay there and may not be made; SmolLM2's do.
        if rel == SMOL {
            assert!(accepted > 0 && accepted < drafted, "{rel}: drafts verified, some accepted ({accepted}/{drafted})");
        }
    }
}

/// Phi-3's longrope switches factor sets when the sequence grows past 64 tokens (the
/// fixture's `original_max_position_embeddings`): drafts never carry a step across, so the
/// output crossing it is the same with speculation.
#[test]
fn speculation_keeps_longrope_switch_where_it_was() {
    if shared_models().is_none() {
        return;
    }
    let config = r#"{"method":"ngram","num_speculative_tokens":8,"prompt_lookup_min":1,"prompt_lookup_max":1}"#;
    // Prompts that repeat themselves up to just short of the edge, so n-gram drafts exist
    // (and the step-time model is still warming up: drafts at the cap) right where it lies.
    let prompts: Vec<Vec<u32>> = reference("tiny-phi3")
        .into_iter()
        .map(|c| c.prompt_ids.iter().copied().cycle().take(57 + c.prompt_ids.len() % 5).collect())
        .collect();
    let reqs: Vec<Request> = prompts
        .iter()
        .map(|p| {
            let mut r = Request::new(p.clone(), 80);
            r.stop.ignore_eos = true;
            // Logprobs show any change in the numbers, not just in the argmax.
            r.sampling.logprobs = Some(2);
            r
        })
        .collect();
    let (drafted, _) = same_events(model("tiny-phi3"), spec(config), &reqs);
    assert!(drafted > 0, "the random-weight model repeats itself, so n-gram drafts exist");
}

/// SmolLM2 Q4_1 drafts for SmolLM2 on the exact f32 path: the same model, so most drafts
/// are accepted, and the output is the f32 path's, event for event.
#[test]
fn draft_model_speculation_changes_no_event() {
    let Some(models) = shared_models() else {
        return;
    };
    let draft = models.join(SMOL);
    let config =
        format!(r#"{{"method":"draft_model","model":{:?},"num_speculative_tokens":3}}"#, draft.to_str().unwrap());
    let prompts: Vec<Vec<u32>> = reference("smollm2-135m-instruct").into_iter().map(|c| c.prompt_ids).collect();
    let reqs: Vec<Request> = requests(&prompts).into_iter().step_by(4).collect();
    let (drafted, accepted) = same_events(model_as(SMOL, WeightDtype::F32), spec(&config), &reqs);
    let rate = accepted as f64 / drafted.max(1) as f64;
    eprintln!("draft model: {accepted} of {drafted} draft tokens accepted ({:.1}%)", 100.0 * rate);
    assert!(rate > 0.5, "a quantized copy of the target agrees with it most of the time: {rate}");
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let Some(models) = shared_models() else {
        return;
    };
    let config = format!(r#"{{"model":{:?},"num_speculative_tokens":2}}"#, models.join(STORIES).to_str().unwrap());
    let cfg = EngineConfig { speculative: spec(&config), kv_cache_memory: 16 << 20, ..EngineConfig::default() };
    let err = EngineHandle::start(model(SMOL), cfg).err().expect("different vocabularies");
    assert!(err.to_string().contains("vocabulary"), "{err}");
}

/// A ternary draft for a ternary target (tiny-bitnet's TQ1_0 file drafting for its TQ2_0
/// file, both on the default int8 path): drafts agree, and no event changes.
#[test]
fn a_bitnet_draft_changes_no_event() {
    let Some(models) = shared_models() else {
        return;
    };
    let draft = models.join("tiny-bitnet/tiny-bitnet.TQ1_0.gguf");
    let config =
        format!(r#"{{"method":"draft_model","model":{:?},"num_speculative_tokens":3}}"#, draft.to_str().unwrap());
    let prompts: Vec<Vec<u32>> = reference("tiny-bitnet").into_iter().map(|c| c.prompt_ids).collect();
    let reqs: Vec<Request> = requests(&prompts).into_iter().step_by(4).collect();
    let target = model_as("tiny-bitnet/tiny-bitnet.TQ2_0.gguf", WeightDtype::Auto);
    let (drafted, accepted) = same_events(target, spec(&config), &reqs);
    eprintln!("BitNet draft: {accepted} of {drafted} draft tokens accepted");
    assert!(accepted > drafted / 2, "the same numbers draft the same tokens: {accepted}/{drafted}");
}
