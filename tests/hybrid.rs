//! Hybrid attention (Qwen3.5's gated DeltaNet layers beside full attention): the recurrent
//! state through every engine path — prompts in chunks of any size, `n > 1` forks,
//! preemption, prefix-cache hits that resume from a snapshot, a busy batch.

mod common;

use common::{
    assert_all_blocks_free, collect, engine, greedy, random_ids, reference, shared_models, Lcg, MARGIN, QWEN35,
};
use weft::engine::{EngineConfig, EngineHandle, Request};
use weft::sampling::SamplingParams;

const GGUF: &str = "tiny-qwen35/tiny-qwen35.gguf";

/// Greedy ids from both forms, prefilled in 8-token chunks (so the recurrence crosses a
/// step boundary every 8 tokens) and in one step, equal the reference where margins allow.
#[test]
fn chunked_prefill_meets_the_reference() {
    if shared_models().is_none() {
        return;
    }
    for path in [QWEN35, GGUF] {
        for budget in [8, 512] {
            let e = engine(path, EngineConfig { max_num_batched_tokens: budget, ..EngineConfig::default() });
            for case in reference(QWEN35) {
                let out = collect(e.submit(greedy(&case.prompt_ids, case.generated_ids.len())).unwrap());
                let stop = case.margins.iter().position(|&g| g <= MARGIN).unwrap_or(case.margins.len());
                assert_eq!(out[0].tokens[..stop], case.generated_ids[..stop], "{path} budget {budget} {}", case.id);
            }
            assert_all_blocks_free(&e);
        }
    }
}

/// A shared 200-token system prompt, then different questions: the second request resumes
/// after the shared prompt's last whole block (from the snapshot taken there) and gives
/// the ids it gives with no cache; so do `n = 3` greedy samples, each forked from its
/// parent's state.
#[test]
fn prefix_hits_resume_from_snapshots_and_forks_copy_the_state() {
    if shared_models().is_none() {
        return;
    }
    let system = random_ids(200, 50_000, 5);
    let ask = |tail: &[u32]| [system.clone(), tail.to_vec()].concat();
    let (a, b) = (ask(&[11, 12, 13]), ask(&[21, 22, 23, 24, 25]));
    let off = engine(GGUF, EngineConfig { prefix_caching: false, ..EngineConfig::default() });
    let want = collect(off.submit(greedy(&b, 12)).unwrap()).remove(0);
    let on = engine(GGUF, EngineConfig { max_num_batched_tokens: 64, ..EngineConfig::default() });
    collect(on.submit(greedy(&a, 4)).unwrap());
    let got = collect(on.submit(greedy(&b, 12)).unwrap()).remove(0);
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.usage.cached_tokens, 192, "resumed after the shared prompt's 12 whole blocks");
    let mut n3 = greedy(&b, 12);
    n3.n = 3;
    for out in collect(on.submit(n3).unwrap()) {
        assert_eq!(out.tokens, want.tokens, "a forked sample");
    }
    assert_all_blocks_free(&on);
}

/// With room for two snapshots only, the end of a shared system prompt stays while each
/// request's own prompt end and the block boundaries inside prompts come and go: from the
/// third request on (the second finds the shared blocks but no snapshot after them, and
/// takes one), each resumes after the shared prompt and gives the ids it gives with no cache.
#[test]
fn a_shared_prompt_keeps_its_snapshot_in_a_small_store() {
    if shared_models().is_none() {
        return;
    }
    let system = random_ids(200, 50_000, 6);
    let off = engine(GGUF, EngineConfig { prefix_caching: false, ..EngineConfig::default() });
    let cfg = EngineConfig { state_snapshots: Some(2), max_num_batched_tokens: 64, ..EngineConfig::default() };
    let on = engine(GGUF, cfg);
    for i in 0..5 {
        let prompt = [system.clone(), random_ids(40, 50_000, 100 + i)].concat();
        let want = collect(off.submit(greedy(&prompt, 8)).unwrap()).remove(0);
        let got = collect(on.submit(greedy(&prompt, 8)).unwrap()).remove(0);
        assert_eq!(got.tokens, want.tokens, "request {i}");
        let resumed = if i >= 2 { 192 } else { 0 };
        assert_eq!(got.usage.cached_tokens, resumed, "request {i}: the shared prompt's 12 whole blocks");
    }
    assert_all_blocks_free(&on);
}

/// Many requests through a pool too small for all of them (fewer state slots than
/// requests, so some wait; too few KV blocks, so some are preempted and recomputed from
/// zero state) beside sampled traffic: each greedy request gives its ids alone.
#[test]
fn preemption_and_a_busy_batch_change_nothing() {
    if shared_models().is_none() {
        return;
    }
    let model = common::model(GGUF);
    let c = &model.model.config;
    let mut rng = Lcg(9);
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| random_ids(1 + rng.next(120) as usize, 50_000, i)).collect();
    let alone = EngineHandle::start(model.clone(), EngineConfig { max_num_seqs: 1, ..Default::default() }).unwrap();
    let want: Vec<_> = prompts.iter().map(|p| collect(alone.submit(greedy(p, 10)).unwrap()).remove(0)).collect();
    let per_block = weft::kv::KvCache::bytes_per_block(model.model.kv_dtype(Default::default()), &c.kv_shapes(), 16);
    let cfg = EngineConfig {
        max_num_batched_tokens: 48,
        // Half of what the snapshots leave goes to running sequences' states: about 14
        // blocks' worth of slots, and about 14 blocks.
        kv_cache_memory: 2 * per_block * 14 + 4 * 4 * c.state_floats(),
        state_snapshots: Some(4),
        ..EngineConfig::default()
    };
    let busy = EngineHandle::start(model.clone(), cfg).unwrap();
    let slots = busy.config().max_num_seqs;
    assert!((1..prompts.len()).contains(&slots), "the state cache was meant to hold fewer sequences: {slots}");
    let noise: Vec<_> = (0..4)
        .map(|i| {
            let mut r = Request::new(vec![7, 8, 9, 10 + i], 20);
            r.sampling = SamplingParams { temperature: 0.9, seed: Some(i as u64), ..Default::default() };
            busy.submit(r).unwrap()
        })
        .collect();
    let streams: Vec<_> = prompts.iter().map(|p| busy.submit(greedy(p, 10)).unwrap()).collect();
    for (i, (s, w)) in streams.into_iter().zip(&want).enumerate() {
        assert_eq!(collect(s).remove(0).tokens, w.tokens, "request {i}");
    }
    noise.into_iter().for_each(|n| drop(collect(n)));
    assert!(busy.stats().preemptions > 0, "the pool was meant to force preemption");
    assert_all_blocks_free(&busy);
}

/// A cache that cannot hold one sequence's state beside the snapshots is a start-up
/// error naming the flag, not a panic in a step.
#[test]
fn a_cache_without_room_for_one_state_is_refused() {
    if shared_models().is_none() {
        return;
    }
    let model = common::model(GGUF);
    let per_state = 4 * model.model.config.state_floats();
    let cfg = EngineConfig { kv_cache_memory: per_state * 5, state_snapshots: Some(4), ..EngineConfig::default() };
    let err = EngineHandle::start(model, cfg).err().expect("no room for a running sequence's state");
    assert!(err.to_string().contains("--kv-cache-memory"), "{err}");
}

/// `weft bench` does not measure a smaller batch than it names: a batch size whose states
/// the cache cannot hold is an error that says so.
#[test]
fn bench_refuses_a_batch_the_state_cache_cannot_hold() {
    let Some(models) = shared_models() else {
        return;
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["bench", "--model"])
        .arg(models.join(GGUF))
        .args(["--batch-sizes", "64", "--prompt-tokens", "4", "--gen-tokens", "2"])
        .args(["--requests", "0", "--shared-requests", "0", "--kv-cache-memory", "1M"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("recurrent state of") && err.contains("B=64"), "{err}");
}

/// One forward step of `tokens` at `at` for the sequence in state slot 0, with the captures
/// asked for: the logits of its last row.
fn forward_step(
    m: &weft::loaded::LoadedModel,
    (kv, ws): (&mut weft::kv::KvCache, &mut weft::model::Workspace),
    table: &[u32],
    at: usize,
    tokens: &[u32],
    captures: &[(usize, u32)],
) -> Vec<f32> {
    use weft::model::{SeqStep, StepInput};
    let seq = [SeqStep { captures, ..SeqStep::sampled(at, tokens.len(), table) }];
    m.model.forward(&StepInput { tokens, seqs: &seq }, kv, ws).to_vec()
}

/// A 150-token prompt in one step (the delta rule in runs of up to 16 tokens at once, the
/// matrix form) and token by token (the recurrent form) give the same logits within float
/// rounding, and the same greedy token.
#[test]
fn a_prompt_at_once_equals_it_token_by_token() {
    if shared_models().is_none() {
        return;
    }
    let m = common::model(GGUF);
    let prompt = random_ids(150, 50_000, 5);
    let mut ws = weft::model::Workspace::default();
    let (mut kv, table) = common::kv_for(&m, prompt.len());
    let at_once = forward_step(&m, (&mut kv, &mut ws), table.blocks(), 0, &prompt, &[]);
    let (mut kv, table) = common::kv_for(&m, prompt.len());
    let mut one_by_one = Vec::new();
    for (i, t) in prompt.iter().enumerate() {
        one_by_one = forward_step(&m, (&mut kv, &mut ws), table.blocks(), i, std::slice::from_ref(t), &[]);
    }
    common::assert_logits_close(&at_once, &one_by_one, "a prompt at once against token by token");
}

/// The rollback itself, on the forward pass: a verification step of a token and three
/// drafts snapshots the state after each row; restoring the snapshot after the first draft
/// and going on gives, bit for bit, the logits of a sequence that never saw the rest.
#[test]
fn a_draft_cut_short_resumes_from_its_rows_snapshot() {
    if shared_models().is_none() {
        return;
    }
    let m = common::model(GGUF);
    let prompt = random_ids(37, 50_000, 3);
    let (t0, drafts, next) = (501, [502, 503, 504], 505);
    let n = prompt.len();
    let mut ws = weft::model::Workspace::default();
    // Verified: t0 and all three drafts, the state kept after t0, d1 and d2.
    let (mut kv, table) = common::kv_for(&m, n + 8);
    let (bt, rows) = (table.blocks(), [t0, drafts[0], drafts[1], drafts[2]]);
    forward_step(&m, (&mut kv, &mut ws), bt, 0, &prompt, &[]);
    forward_step(&m, (&mut kv, &mut ws), bt, n, &rows, &[(n, 0), (n + 1, 1), (n + 2, 2)]);
    kv.states.restore(1, 0);
    let got = forward_step(&m, (&mut kv, &mut ws), bt, n + 2, &[next], &[]);
    // Never drafted: t0 and d1 decoded one by one, then the same token.
    let (mut kv, table) = common::kv_for(&m, n + 8);
    let bt = table.blocks();
    forward_step(&m, (&mut kv, &mut ws), bt, 0, &prompt, &[]);
    forward_step(&m, (&mut kv, &mut ws), bt, n, &[t0], &[]);
    forward_step(&m, (&mut kv, &mut ws), bt, n + 1, &[drafts[0]], &[]);
    let want = forward_step(&m, (&mut kv, &mut ws), bt, n + 2, &[next], &[]);
    assert!(got == want, "logits after the rollback differ");
}

/// Speculative decoding through the engine (n-gram drafts, nearly all rejected by random
/// weights): greedy ids equal those without drafts, alone and beside other requests.
#[test]
fn speculative_decoding_changes_nothing() {
    if shared_models().is_none() {
        return;
    }
    let plain = engine(GGUF, EngineConfig::default());
    // Ids below a few hundred, so the n-gram drafter finds repeats to propose.
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| random_ids(40 + 10 * i, 300, 21 + i as u64)).collect();
    let want: Vec<_> = prompts.iter().map(|p| collect(plain.submit(greedy(p, 24)).unwrap()).remove(0)).collect();
    let cfg =
        EngineConfig {
            speculative:
                Some(
                    r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":2}"#
                        .parse()
                        .unwrap(),
                ),
            ..EngineConfig::default()
        };
    let spec = engine(GGUF, cfg);
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(collect(spec.submit(greedy(p, 24)).unwrap()).remove(0).tokens, w.tokens, "alone");
    }
    let streams: Vec<_> = prompts.iter().map(|p| spec.submit(greedy(p, 24)).unwrap()).collect();
    for (s, w) in streams.into_iter().zip(&want) {
        assert_eq!(collect(s).remove(0).tokens, w.tokens, "together");
    }
    assert!(spec.stats().spec_drafts > 0, "drafts were verified");
    assert_all_blocks_free(&spec);
}

/// Over HTTP: chat completions, and the state cache in the metrics (bytes per sequence,
/// snapshots taken for the prefix cache), every slot free once idle.
#[tokio::test(flavor = "multi_thread")]
async fn served_with_its_state_in_the_metrics() {
    if shared_models().is_none() {
        return;
    }
    let s = common::server::Server::start(GGUF, &[]).await;
    let long = "word ".repeat(60);
    for q in ["first", "second"] {
        let body = serde_json::json!({
            "messages": [{"role": "system", "content": long}, {"role": "user", "content": q}],
            "max_tokens": 5,
            "temperature": 0,
        });
        let (st, v) = s.post("/v1/chat/completions", body).await;
        assert_eq!(st, 200, "{v}");
    }
    s.assert_idle().await;
    let per_seq = s.metric("weft:state_cache_bytes_per_sequence ").await;
    let model = common::model(GGUF);
    assert_eq!(per_seq as usize, 4 * model.model.config.state_floats());
    assert!(s.metric("weft:state_cache_snapshots ").await > 0.0);
    assert_eq!(s.metric("weft:state_cache_usage_perc ").await, 0.0);
}

/// Layer patterns and state shapes weft does not support are load errors naming the key,
/// from GGUF metadata and from a Hugging Face config.
#[test]
fn unsupported_layouts_are_load_errors_naming_the_key() {
    let Some(models) = shared_models() else { return };
    use weft::loaded::LoadedModel;
    use weft::model::WeightDtype;
    let dir = tempfile::tempdir().unwrap();
    let open = |path: &std::path::Path| match LoadedModel::open(path, WeightDtype::Auto) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => format!("{e:#}"),
    };
    let real = std::fs::read(models.join(GGUF)).unwrap();
    for (key, value, says) in [
        ("qwen35moe.ssm.time_step_rank", 3, "ssm.time_step_rank) 3 is not a multiple"),
        ("qwen35moe.ssm.conv_kernel", 0, "ssm.conv_kernel) 0 is not within"),
        ("qwen35moe.ssm.group_count", 0, "ssm.group_count) 0 is not within"),
        ("qwen35moe.block_count", 5, "attention.recurrent_layers) has 4 entries for 5 layers"),
    ] {
        let path = dir.path().join("bad.gguf");
        std::fs::write(&path, common::patched(&real, key, value)).unwrap();
        let err = open(&path);
        assert!(err.contains(says), "{key} = {value}: {err}");
    }
    let src = models.join(QWEN35);
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), hf.join(f)).unwrap();
    }
    let config = std::fs::read_to_string(src.join("config.json")).unwrap();
    for (from, to, says) in [
        ("\"full_attention\"\n", "\"sliding_attention\"\n", "layer type 'sliding_attention'"),
        ("\"linear_num_value_heads\": 4", "\"linear_num_value_heads\": 3", "linear_num_value_heads"),
        ("\"linear_conv_kernel_dim\": 4,", "", "needs linear_conv_kernel_dim"),
    ] {
        assert!(config.contains(from), "{from}");
        std::fs::write(hf.join("config.json"), config.replace(from, to)).unwrap();
        let err = open(&hf);
        assert!(err.contains(says), "{from} -> {to}: {err}");
    }
}

/// The GGUF requantized by `weft quantize` (Q8_0 and Q4_K_M, the DeltaNet's small tensors
/// kept as they are) and computed in its block formats: close to the same weights widened,
/// and batch invariant.
#[test]
fn block_formats_stay_close_to_the_exact_path() {
    let Some(models) = shared_models() else { return };
    use weft::loaded::LoadedModel;
    use weft::model::file_type::parse_file_type_name;
    use weft::model::WeightDtype;
    let dir = tempfile::tempdir().unwrap();
    // Hidden size 32 with random weights: int8 activations move logits a lot; this guards
    // the whole path (every product counted, no shape refused), not the rounding.
    for (t, min_agree, max_kl) in [("q8_0", 0.6, 0.6), ("q4_k_m", 0.4, 1.5)] {
        let path = dir.path().join(format!("q.{t}.gguf"));
        weft::model::requantize::requantize(&models.join(GGUF), &path, parse_file_type_name(t).unwrap()).unwrap();
        let q = LoadedModel::open(&path, WeightDtype::Auto).unwrap();
        let by = q.model.products_by_format();
        assert_eq!(by.iter().map(|(_, n)| n).sum::<usize>(), q.model.config.matmul_params(), "{t}: {by:?}");
        let exact = LoadedModel::open(&path, WeightDtype::F32).unwrap();
        let (kl, agree) = common::kl_and_agreement(&exact, &q, QWEN35);
        eprintln!("tiny-qwen35 {t}: mean KLD {kl:.5}, top-1 agreement {:.1}%", agree * 100.0);
        assert!(agree >= min_agree && kl < max_kl, "{t}: KLD {kl}, agreement {agree}");
        common::assert_batch_invariant(std::sync::Arc::new(q), QWEN35);
    }
}
