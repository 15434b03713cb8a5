//! The continuous-batching engine on a real model (stories260k from `../shared/models`):
//! batching changes nothing, seeded sampling is reproducible, a storm of requests with
//! cancels and forced preemption frees every block, stop strings, n > 1, 8-bit caches.

mod common;

use common::{assert_all_blocks_free, collect, engine, greedy, reference, shared_models, Lcg, STORIES};
use weft::engine::{EngineConfig, FinishReason, Request, SubmitError};
use weft::sampling::SamplingParams;

fn random_request(rng: &mut Lcg) -> Request {
    let len = 1 + rng.next(40) as usize;
    let mut prompt: Vec<u32> = (0..len).map(|_| 3 + rng.next(500) as u32).collect();
    prompt[0] = 1;
    let mut r = Request::new(prompt, 1 + rng.next(60) as usize);
    r.stop.ignore_eos = rng.next(2) == 0;
    r.sampling = SamplingParams {
        temperature: [0.0, 0.7, 1.0, 1.3][rng.next(4) as usize],
        top_k: [0, 5, 40][rng.next(3) as usize],
        top_p: [1.0, 0.9, 0.5][rng.next(3) as usize],
        min_p: [0.0, 0.05][rng.next(2) as usize],
        repetition_penalty: [1.0, 1.2][rng.next(2) as usize],
        frequency_penalty: [0.0, 0.5][rng.next(2) as usize],
        presence_penalty: [0.0, -0.3][rng.next(2) as usize],
        seed: Some(rng.next(1000)),
        ..Default::default()
    };
    r
}

/// The reference prompts give the reference ids alone and among 31 other requests with
/// random lengths and sampling settings (greedy ids exact: nothing about a row depends on
/// the rest of the batch).
#[test]
fn greedy_ids_are_the_same_alone_or_among_31_others() {
    if shared_models().is_none() {
        return;
    }
    let cases = reference(STORIES);
    let busy = engine(STORIES, EngineConfig { max_num_batched_tokens: 64, ..EngineConfig::default() });
    let mut rng = Lcg(7);
    for case in &cases {
        let others: Vec<_> = (0..31).map(|_| busy.submit(random_request(&mut rng)).unwrap()).collect();
        let mine = busy.submit(greedy(&case.prompt_ids, case.generated_ids.len())).unwrap();
        let got = collect(mine);
        assert_eq!(got[0].tokens, case.generated_ids, "{} among 31 others", case.id);
        for o in others {
            collect(o);
        }
    }
    assert_all_blocks_free(&busy);
}

/// The same seed gives the same tokens whatever else is in the batch.
#[test]
fn seeded_sampling_is_reproducible_across_batch_compositions() {
    if shared_models().is_none() {
        return;
    }
    let mut rng = Lcg(99);
    let reqs: Vec<Request> = (0..12).map(|_| random_request(&mut rng)).collect();
    let alone = engine(STORIES, EngineConfig { max_num_seqs: 1, ..EngineConfig::default() });
    let want: Vec<_> = reqs.iter().map(|r| collect(alone.submit(r.clone()).unwrap())).collect();
    let busy = engine(STORIES, EngineConfig { max_num_batched_tokens: 48, ..EngineConfig::default() });
    let mut noise = Lcg(3);
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| {
            let extra = (0..3).map(|_| busy.submit(random_request(&mut noise)).unwrap()).collect::<Vec<_>>();
            (busy.submit(r.clone()).unwrap(), extra)
        })
        .collect();
    for ((s, extra), w) in streams.into_iter().zip(&want) {
        assert_eq!(&collect(s), w);
        extra.into_iter().for_each(|e| drop(collect(e)));
    }
}

/// 200 requests, random cancels (dropped streams and explicit aborts), a KV pool small
/// enough to force preemption: every request ends with the right reason and every block
/// is free afterwards — also with n-gram speculation, whose drafts take and give back blocks.
#[test]
fn storm_with_cancels_and_preemption_frees_every_block() {
    if shared_models().is_none() {
        return;
    }
    let ngram = r#"{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":1,"prompt_lookup_max":3}"#;
    for speculative in [None, Some(ngram.parse().unwrap())] {
        storm(speculative);
    }
}

fn storm(speculative: Option<weft::engine::speculative::SpeculativeConfig>) {
    let speculating = speculative.is_some();
    let c = common::model(STORIES).model.config.clone();
    let kv_dtype = common::model(STORIES).model.kv_dtype(Default::default());
    let per_block = weft::kv::KvCache::bytes_per_block(kv_dtype, &c.kv_shapes(), 4);
    let cfg = EngineConfig {
        block_size: 4,
        kv_cache_memory: per_block * 40,
        max_num_seqs: 24,
        speculative,
        ..EngineConfig::default()
    };
    let e = engine(STORIES, cfg);
    let mut rng = Lcg(2024);
    let mut kept = Vec::new();
    for i in 0..200 {
        let mut r = random_request(&mut rng);
        r.prompt.truncate(60);
        r.stop.max_tokens = r.stop.max_tokens.min(100);
        let max_tokens = r.stop.max_tokens;
        let s = e.submit(r).unwrap();
        match rng.next(10) {
            0 => drop(s),
            1 => {
                e.abort(s.id);
                kept.push((s, max_tokens, true));
            }
            _ => kept.push((s, max_tokens, false)),
        }
        if i % 50 == 49 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    for (s, max_tokens, aborted) in kept {
        let out = collect(s);
        let o = &out[0];
        match o.finish.unwrap() {
            FinishReason::Length => assert_eq!(o.tokens.len(), max_tokens),
            FinishReason::Stop => assert!(o.tokens.len() <= max_tokens),
            FinishReason::Abort => assert!(aborted, "only aborted requests end with abort"),
            FinishReason::Error => panic!("no request should fail"),
        }
    }
    assert_all_blocks_free(&e);
    let st = e.stats();
    assert!(st.preemptions > 0, "the pool was small enough to force preemption");
    assert_eq!(st.spec_drafts > 0, speculating, "drafts were verified exactly when speculating");
}

/// 8-bit caches (FP8, and int8 with row scales, whose copies for forks carry the scales):
/// each reference prompt's greedy ids are the same alone and, twice over (the second time
/// from cached blocks, as two samples), among random requests in a pool small enough to
/// preempt, prompts prefilled in chunks; every block is free afterwards.
#[test]
fn eight_bit_caches_keep_batch_invariance_through_preemption_and_prefix_hits() {
    if shared_models().is_none() {
        return;
    }
    use weft::kv::{KvCacheDtype, KvDtype};
    for (choice, dtype) in [(KvCacheDtype::Fp8, KvDtype::Fp8), (KvCacheDtype::Int8, KvDtype::Int8)] {
        eight_bit_cache(choice, dtype);
    }
}

fn eight_bit_cache(choice: weft::kv::KvCacheDtype, dtype: weft::kv::KvDtype) {
    let c = common::model(STORIES).model.config.clone();
    let per_block = weft::kv::KvCache::bytes_per_block(dtype, &c.kv_shapes(), 4);
    let alone = engine(STORIES, EngineConfig { max_num_seqs: 1, kv_cache_dtype: choice, ..EngineConfig::default() });
    let busy = engine(
        STORIES,
        EngineConfig {
            block_size: 4,
            kv_cache_memory: per_block * 96,
            max_num_batched_tokens: 16,
            kv_cache_dtype: choice,
            ..EngineConfig::default()
        },
    );
    let mut rng = Lcg(11);
    for case in &reference(STORIES) {
        let want = collect(alone.submit(greedy(&case.prompt_ids, 40)).unwrap());
        for round in 0..2 {
            let others: Vec<_> = (0..12)
                .map(|_| {
                    let mut r = random_request(&mut rng);
                    r.stop.max_tokens = r.stop.max_tokens.min(40);
                    busy.submit(r).unwrap()
                })
                .collect();
            // The second time as two samples, forked from the cached prompt.
            let mut mine = greedy(&case.prompt_ids, 40);
            mine.n = 1 + round;
            let got = collect(busy.submit(mine).unwrap());
            assert_eq!(got.len(), 1 + round);
            for o in got {
                assert_eq!(o.tokens, want[0].tokens, "{dtype}: {} in a busy batch, round {round}", case.id);
            }
            others.into_iter().for_each(|o| drop(collect(o)));
        }
    }
    assert_all_blocks_free(&busy);
    let st = busy.stats();
    assert!(st.preemptions > 0 && st.prefix_cache_hits > 0, "{dtype}: {st:?}");
}

/// A stop string ends the text before it, also when it spans several tokens.
#[test]
fn stop_strings_end_the_text() {
    if shared_models().is_none() {
        return;
    }
    let case = &reference(STORIES)[1];
    let e = engine(STORIES, EngineConfig::default());
    let full = collect(e.submit(greedy(&case.prompt_ids, 32)).unwrap()).remove(0);
    assert!(full.text.contains("named Lily"), "{}", full.text);
    for stop in ["named Lily", "ly. She", "e"] {
        let mut r = greedy(&case.prompt_ids, 32);
        r.stop.stop_strings = vec![stop.to_string(), "zzz-never".into()];
        let out = collect(e.submit(r).unwrap()).remove(0);
        assert_eq!(out.finish, Some(FinishReason::Stop));
        assert_eq!(out.text, full.text[..full.text.find(stop).unwrap()], "stop {stop:?}");
    }
    let mut r = greedy(&case.prompt_ids, 32);
    r.stop.stop_token_ids = vec![full.tokens[3]];
    let out = collect(e.submit(r).unwrap()).remove(0);
    assert_eq!((out.tokens.len(), out.finish), (4, Some(FinishReason::Stop)));
    assert_all_blocks_free(&e);
}

/// n > 1 samples share the prompt's blocks and equal n separate requests with seeds
/// seed, seed+1, ...
#[test]
fn n_samples_match_separately_seeded_requests() {
    if shared_models().is_none() {
        return;
    }
    let e = engine(STORIES, EngineConfig::default());
    let prompt = reference(STORIES)[5].prompt_ids.clone();
    let mut r = Request::new(prompt, 20);
    r.stop.ignore_eos = true;
    r.sampling = SamplingParams { temperature: 1.0, seed: Some(41), ..Default::default() };
    r.n = 3;
    let together = collect(e.submit(r.clone()).unwrap());
    assert_eq!(together.len(), 3);
    for (i, o) in together.iter().enumerate() {
        let mut single = r.clone();
        single.n = 1;
        single.sampling.seed = Some(41 + i as u64);
        let alone = &collect(e.submit(single).unwrap())[0];
        assert_eq!((&o.tokens, &o.text, o.finish), (&alone.tokens, &alone.text, alone.finish), "sample {i}");
        // The prompt is computed once; the later requests find it cached.
        assert_eq!(alone.usage.cached_tokens, (o.usage.prompt_tokens - 1) / 16 * 16, "sample {i}");
    }
    assert_all_blocks_free(&e);
}

#[test]
fn bad_requests_and_overload_get_clear_errors() {
    if shared_models().is_none() {
        return;
    }
    let e = engine(STORIES, EngineConfig { max_waiting_requests: 2, max_num_seqs: 1, ..EngineConfig::default() });
    let err = |r: Request| match e.submit(r) {
        Err(SubmitError::Invalid { message, .. }) => message,
        other => panic!("expected invalid, got {:?}", other.map(|s| s.id)),
    };
    assert!(err(Request::new(vec![], 5)).contains("empty"));
    assert!(err(Request::new(vec![1, 9999], 5)).contains("vocabulary"));
    // max_tokens 0 only scores a prompt: one sample.
    assert!(err(Request { n: 2, ..Request::new(vec![1], 0) }).contains("max_tokens"));
    assert!(err(Request::new(vec![1; 500], 100)).contains("context length of 512"));
    let mut r = Request::new(vec![1], 5);
    r.sampling.top_p = 2.0;
    assert!(err(r).contains("top_p"));
    // One request runs at a time and two may wait: of five long ones, some are refused.
    let long = || greedy(&[1], 400);
    let results: Vec<_> = (0..5).map(|_| e.submit(long())).collect();
    let refused = results.iter().filter(|r| matches!(r, Err(SubmitError::Overloaded(2)))).count();
    assert!(refused >= 2, "queue bound of 2 not enforced: {refused} refused");
}

/// The error of a refused request: (param, message).
fn refusal(e: &weft::engine::EngineHandle, r: Request) -> (Option<&'static str>, String) {
    match e.submit(r) {
        Err(SubmitError::Invalid { message, param }) => (param, message),
        other => panic!("expected invalid, got {:?}", other.map(|s| s.id)),
    }
}

/// Every client-controlled number is checked with checked arithmetic and capped, and the
/// error names the field. (A `max_tokens` near 2^64 used to wrap past the context check and
/// crash the engine at the context's end.)
#[test]
fn absurd_numbers_and_sizes_are_refused_naming_the_field() {
    if shared_models().is_none() {
        return;
    }
    let e = engine(STORIES, EngineConfig { max_waiting_requests: 8, ..EngineConfig::default() });
    let with = |f: &dyn Fn(&mut Request)| {
        let mut r = Request::new(vec![1, 5, 6], 8);
        f(&mut r);
        r
    };
    let cases: Vec<(Request, &str)> = vec![
        (with(&|r| r.stop.max_tokens = usize::MAX), "max_tokens"),
        (with(&|r| r.stop.max_tokens = usize::MAX - 2), "max_tokens"),
        (with(&|r| r.stop.max_tokens = 510), "max_tokens"),
        (Request::new(vec![1; 512], 1), "prompt"),
        (with(&|r| r.n = 33), "n"),
        (with(&|r| r.n = usize::MAX), "n"),
        (with(&|r| r.n = 9), "n"), // within max_n but more than can ever wait: 400, not 429
        (with(&|r| r.stop.stop_strings = vec!["a".into(); 17]), "stop"),
        (with(&|r| r.stop.stop_strings = vec!["a".repeat(257)]), "stop"),
        (with(&|r| r.stop.stop_token_ids = vec![512]), "stop_token_ids"),
        (with(&|r| r.stop.stop_token_ids = vec![3; 65]), "stop_token_ids"),
        (with(&|r| r.sampling.logit_bias = (0..301).map(|i| (i, 1.0)).collect()), "logit_bias"),
        (with(&|r| r.sampling.logprobs = Some(21)), "logprobs"),
        (with(&|r| r.sampling.temperature = f32::INFINITY), "temperature"),
    ];
    for (r, field) in cases {
        let (param, message) = refusal(&e, r);
        assert_eq!(param, Some(field), "{message}");
    }
    // The longest request that fits runs to the context's end and finishes with `length`.
    let out = collect(e.submit(greedy(&[1, 5, 6], 509)).unwrap());
    assert_eq!((out[0].tokens.len(), out[0].finish), (509, Some(FinishReason::Length)));
    assert_all_blocks_free(&e);
}

/// With `max_model_len` below the model's context, sequences stop at it.
#[test]
fn max_model_len_bounds_every_sequence() {
    if shared_models().is_none() {
        return;
    }
    let e = engine(STORIES, EngineConfig { max_model_len: 40, ..EngineConfig::default() });
    assert_eq!(e.max_model_len(), 40);
    assert_eq!(refusal(&e, greedy(&[1; 30], 11)).0, Some("max_tokens"));
    let out = collect(e.submit(greedy(&[1; 30], 10)).unwrap());
    assert_eq!((out[0].tokens.len(), out[0].finish), (10, Some(FinishReason::Length)));
}

/// A step that panics (injected in this test build) fails the requests in flight with an
/// error event, counts a failure, and the engine serves the next request with every block
/// free and the same greedy ids as before.
#[test]
fn a_panicking_step_fails_its_requests_and_the_engine_restarts() {
    if shared_models().is_none() {
        return;
    }
    // Process-wide, but no other test in this binary builds a prompt starting 300, 300, 300.
    std::env::set_var("WEFT_FAULT_PANIC_TOKEN", "300");
    let e = engine(STORIES, EngineConfig::default());
    let prompt = reference(STORIES)[1].prompt_ids.clone();
    let before = collect(e.submit(greedy(&prompt, 24)).unwrap());
    let mut bystander = e.submit(greedy(&prompt, 400)).unwrap();
    let first = bystander.blocking_recv();
    assert!(matches!(first, Some(weft::engine::Event::Token { .. })), "{first:?}");
    let mut poison = e.submit(greedy(&[300, 300, 300, 7], 4)).unwrap();
    let last_event = |s: &mut weft::engine::RequestStream| {
        let mut last = None;
        while let Some(ev) = s.blocking_recv() {
            last = Some(ev);
        }
        last
    };
    for s in [&mut poison, &mut bystander] {
        match last_event(s) {
            Some(weft::engine::Event::Error { message }) => assert!(message.contains("injected fault"), "{message}"),
            other => panic!("expected an error event, got {other:?}"),
        }
    }
    assert_eq!(e.stats().engine_failures, 1);
    assert!(e.is_alive());
    assert_all_blocks_free(&e);
    assert_eq!(collect(e.submit(greedy(&prompt, 24)).unwrap()), before);
}

/// Phi-3's longrope takes its long factors past 64 tokens (the fixture's
/// `original_max_position_embeddings`), chosen per row as transformers chooses them: a
/// prompt's rows by its length, later rows by their position. Outputs that cross the edge
/// are the same after a preemption recomputes them, and a prompt past the edge reuses no
/// block of a shorter prompt (whose rows took the short factors).
#[test]
fn longrope_rows_keep_their_factors_through_preemption_and_the_cache() {
    if shared_models().is_none() {
        return;
    }
    let model = common::model("tiny-phi3");
    let mut rng = Lcg(17);
    let prompts: Vec<Vec<u32>> =
        (0..6).map(|_| (0..30 + rng.next(20) as usize).map(|_| 100 + rng.next(900) as u32).collect()).collect();
    let alone =
        weft::engine::EngineHandle::start(model.clone(), EngineConfig { max_num_seqs: 1, ..Default::default() })
            .unwrap();
    let want: Vec<_> = prompts.iter().map(|p| collect(alone.submit(greedy(p, 50)).unwrap()).remove(0)).collect();
    let c = &model.model.config;
    let per_block = weft::kv::KvCache::bytes_per_block(model.model.kv_dtype(Default::default()), &c.kv_shapes(), 16);
    let cfg = EngineConfig { kv_cache_memory: per_block * 14, max_num_batched_tokens: 32, ..Default::default() };
    let busy = weft::engine::EngineHandle::start(model.clone(), cfg).unwrap();
    let streams: Vec<_> = prompts.iter().map(|p| busy.submit(greedy(p, 50)).unwrap()).collect();
    for (i, (s, w)) in streams.into_iter().zip(&want).enumerate() {
        assert_eq!(collect(s).remove(0).tokens, w.tokens, "request {i}");
    }
    assert!(busy.stats().preemptions > 0, "the pool was meant to force preemption");
    // A prompt past the edge that starts with a shorter one's tokens.
    let long = [prompts[0].clone(), prompts[1].clone()].concat();
    let out = collect(busy.submit(greedy(&long, 4)).unwrap()).remove(0);
    assert_eq!(out.usage.cached_tokens, 0, "blocks computed with the short factors are not reused");
    assert_eq!(out.tokens, collect(alone.submit(greedy(&long, 4)).unwrap()).remove(0).tokens);
    assert_all_blocks_free(&busy);
}

/// The step mix accounts for every step: its kinds' forward times add up to the whole, and
/// every row computed is a prompt row or a decode (a prompt's last row left alone counts
/// as a decode, as the scheduler counts it).
#[test]
fn step_mix_accounts_for_every_step_and_row() {
    if shared_models().is_none() {
        return;
    }
    let e = engine(STORIES, EngineConfig { max_num_batched_tokens: 48, ..EngineConfig::default() });
    let (requests, prompt, max_tokens) = (12u64, 20u64, 30u64);
    let streams: Vec<_> = (0..requests)
        .map(|i| {
            let ids: Vec<u32> =
                std::iter::once(1).chain((1..prompt).map(|j| (3 + (i * 31 + j * 7) % 400) as u32)).collect();
            e.submit(greedy(&ids, max_tokens as usize)).unwrap()
        })
        .collect();
    for s in streams {
        assert_eq!(collect(s)[0].tokens.len() as u64, max_tokens);
    }
    // Each step is counted before its events go out, so the last one is in.
    let st = e.stats();
    let mix = st.step_mix;
    assert_eq!(mix.prompt_steps + mix.decode_steps, st.steps);
    assert_eq!(mix.prompt_time + mix.decode_time, st.forward_time);
    let rows = requests * prompt + requests * (max_tokens - 1);
    assert_eq!(mix.prompt_rows + mix.prompt_step_decodes + mix.decode_seqs, rows, "{st:?}");
    assert!((requests * (prompt - 1)..=requests * prompt).contains(&mix.prompt_rows), "{mix:?}");
    assert!(mix.prompt_steps >= 5, "240 prompt rows take five steps of 48: {mix:?}");
    assert!(mix.decode_steps >= max_tokens - 1 && mix.few_steps <= mix.decode_steps, "{mix:?}");
    assert!(mix.few_time <= mix.decode_time);
}
