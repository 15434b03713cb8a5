//! The engine against the reference outputs of real models (`../shared/models`).

mod common;

use common::{
    assert_matches_reference, collect, engine, greedy, model, reference, shared_models, streamed_text, MARGIN, VARIANTS,
};
use weft::engine::EngineConfig;
use weft::kv::{BlockAllocator, BlockTable, KvCache, KvCacheDtype};
use weft::model::{SeqStep, StepInput, Workspace};
use weft::tokenizer::Tokenizer;

#[test]
fn prompt_token_ids_match_reference() {
    if shared_models().is_none() {
        return;
    }
    for (path, refdir) in VARIANTS {
        let m = model(path);
        for case in reference(refdir) {
            let ids = m.tokenizer.encode_with(&case.prompt, case.add_special_tokens).unwrap();
            assert_eq!(ids, case.prompt_ids, "{path} {}", case.id);
        }
    }
}

/// Teacher-forced: feed the reference tokens one decode step at a time and check every
/// step's argmax, plus the top-5 logits after the prompt.
#[test]
fn logits_and_greedy_steps_match_reference() {
    if shared_models().is_none() {
        return;
    }
    for (path, refdir) in VARIANTS {
        assert_matches_reference(&model(path), path, refdir);
    }
}

/// Free-running greedy generation through the engine reproduces the reference ids up to
/// the first step whose margin is too small to call.
#[test]
fn free_running_greedy_matches_reference() {
    if shared_models().is_none() {
        return;
    }
    for (path, refdir) in VARIANTS {
        let e = engine(path, EngineConfig::default());
        for case in reference(refdir) {
            let out = collect(e.submit(greedy(&case.prompt_ids, case.generated_ids.len())).unwrap());
            let stop = case.margins.iter().position(|&g| g <= MARGIN).unwrap_or(case.margins.len());
            assert_eq!(out[0].tokens[..stop], case.generated_ids[..stop], "{path} {}", case.id);
        }
    }
}

/// All reference prompts in one ragged batch (different lengths, sequences leaving at
/// different steps) give exactly the ids each gives alone.
#[test]
fn batching_changes_nothing() {
    if shared_models().is_none() {
        return;
    }
    for (path, refdir) in VARIANTS {
        let cases = reference(refdir);
        let e = engine(path, EngineConfig::default());
        let streams: Vec<_> =
            cases.iter().enumerate().map(|(i, c)| e.submit(greedy(&c.prompt_ids, 24 + 2 * i)).unwrap()).collect();
        let together: Vec<_> = streams.into_iter().map(collect).collect();
        let alone = engine(path, EngineConfig { max_num_seqs: 1, ..EngineConfig::default() });
        for (i, c) in cases.iter().enumerate() {
            let one = collect(alone.submit(greedy(&c.prompt_ids, 24 + 2 * i)).unwrap());
            assert_eq!(together[i][0].tokens, one[0].tokens, "{path} {}", c.id);
        }
    }
}

/// With the prefix cache, a prompt seen before skips its cached blocks (reported as cached
/// tokens) and still gives exactly the ids it gives without the cache, alone and in a batch.
#[test]
fn prefix_caching_changes_nothing() {
    if shared_models().is_none() {
        return;
    }
    for (path, refdir) in VARIANTS {
        let cases = reference(refdir);
        let off = engine(path, EngineConfig { prefix_caching: false, ..EngineConfig::default() });
        let on = engine(path, EngineConfig::default());
        let want: Vec<_> = cases.iter().map(|c| collect(off.submit(greedy(&c.prompt_ids, 8)).unwrap())).collect();
        // First pass fills the cache; the second, all at once, reuses it.
        for (c, w) in cases.iter().zip(&want) {
            assert_eq!(collect(on.submit(greedy(&c.prompt_ids, 8)).unwrap())[0].tokens, w[0].tokens, "{path} {}", c.id);
        }
        let streams: Vec<_> = cases.iter().map(|c| on.submit(greedy(&c.prompt_ids, 8)).unwrap()).collect();
        for ((c, w), s) in cases.iter().zip(&want).zip(streams) {
            let got = collect(s);
            assert_eq!(got[0].tokens, w[0].tokens, "{path} {} (cached)", c.id);
            let bs = EngineConfig::default().block_size;
            assert_eq!(got[0].usage.cached_tokens, (c.prompt_ids.len() - 1) / bs * bs, "{path} {}", c.id);
            assert_eq!(w[0].usage.cached_tokens, 0);
        }
        common::assert_all_blocks_free(&on);
    }
}

/// Streaming deltas concatenate to the reference's streamed text, UTF-8 and spaces intact.
#[test]
fn streamed_text_matches_reference() {
    if shared_models().is_none() {
        return;
    }
    for (path, refdir) in VARIANTS {
        let m = model(path);
        for case in reference(refdir) {
            let text = streamed_text(&m.tokenizer, &case.prompt_ids, &case.generated_ids);
            assert_eq!(text, case.generated_text_delta, "{path} {}", case.id);
        }
    }
}

/// A tokenizer built from GGUF metadata alone agrees with the model's tokenizer.json.
#[test]
fn gguf_metadata_tokenizer_matches_tokenizer_json() {
    let Some(dir) = shared_models() else { return };
    let samples = [
        "",
        "Hello world",
        "  leading and   multiple spaces ",
        "tabs\tand\nnewlines\n\n",
        "digits 1234567890 and 3.14159",
        "accents: café naïve façade",
        "CJK 你好世界 and emoji 🦀🚀",
        "<|im_start|>user\nHi<|im_end|>",
        "def f(x):\n    return x ** 2  # comment",
    ];
    for (gguf, folder) in [
        ("stories260k/stories260k.gguf", "stories260k"),
        ("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
        ("tiny-llama3/tiny-llama3.gguf", "tiny-llama3"),
        ("tiny-qwen2/tiny-qwen2.gguf", "tiny-qwen2"),
        ("tiny-mistral-swa/tiny-mistral-swa.gguf", "tiny-mistral-swa"),
        ("tiny-phi3/tiny-phi3.gguf", "tiny-phi3"),
        ("tiny-gemma2/tiny-gemma2.gguf", "tiny-gemma2"),
    ] {
        let g = weft::model::gguf::GgufFile::open(&dir.join(gguf)).unwrap();
        let meta = Tokenizer::from_gguf_metadata(&g, vec![], None, None).unwrap();
        let json = Tokenizer::from_dir(&dir.join(folder)).unwrap();
        let cases = reference(folder);
        for text in samples.iter().copied().chain(cases.iter().map(|c| c.prompt.as_str())) {
            let a = meta.encode(text).unwrap();
            assert_eq!(a, json.encode(text).unwrap(), "{gguf}: {text:?}");
            assert_eq!(meta.decode(&a, false).unwrap(), json.decode(&a, false).unwrap(), "{gguf}: {text:?}");
        }
    }
}

/// A chat request renders the model's template and tokenizes it as transformers'
/// `apply_chat_template` does (no second BOS): the prompt ids of the reference chat cases.
/// Without `max_tokens`, it may use the rest of a small KV cache rather than be refused.
#[test]
fn chat_prompt_ids_match_reference() {
    if shared_models().is_none() {
        return;
    }
    use weft::api::openai::ChatRequest;
    let families = ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral-swa", "tiny-phi3", "tiny-gemma2"];
    let gguf = |f: &str| format!("{f}/{f}.gguf");
    let cases = families
        .iter()
        .flat_map(|f| [(f.to_string(), f.to_string()), (gguf(f), f.to_string())])
        .chain([("tiny-llama3-q/tiny-llama3-q.Q8_0.gguf".into(), "tiny-llama3-q/reference.Q8_0.json".into())]);
    for (path, refs) in cases {
        let (path, refs) = (path.as_str(), refs.as_str());
        let e = engine(path, EngineConfig { kv_cache_memory: 16 << 20, ..EngineConfig::default() });
        let doc = common::reference_json(refs);
        // The fixed date the Llama 3.2 template was rendered with.
        let kwargs = doc["tokenization"].get("chat_template_kwargs").cloned().unwrap_or(serde_json::json!({}));
        let chats: Vec<_> =
            doc["cases"].as_array().unwrap().iter().filter(|c| c.get("messages").is_some()).cloned().collect();
        assert!(!chats.is_empty(), "{path}: no chat case");
        for c in chats {
            let body = serde_json::json!({"messages": c["messages"], "add_generation_prompt": c["add_generation_prompt"],
                "chat_template_kwargs": kwargs});
            let req = ChatRequest::parse(body).unwrap().engine_request(&e).unwrap();
            let want: Vec<u32> =
                c["prompt_token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(req.prompt, want, "{path}");
            assert_eq!(req.prompt.len() + req.stop.max_tokens, e.capacity_tokens().min(e.max_model_len()), "{path}");
            drop(e.submit(req).unwrap());
        }
    }
}

/// `--dtype auto` keeps 16-bit weights 16-bit (half the bytes) and, widening them exactly
/// in the kernel, computes the very logits of the f32 path: bit for bit, both formats.
#[test]
fn sixteen_bit_weights_stay_16_bit_and_exact() {
    if shared_models().is_none() {
        return;
    }
    use weft::model::WeightDtype;
    for family in ["tiny-llama3", "tiny-qwen3", "tiny-phi3", "tiny-gemma2"] {
        for path in [family.to_string(), format!("{family}/{family}.gguf")] {
            let (wide, half) = (model(&path), common::model_as(&path, WeightDtype::Auto));
            let (a, b) = (wide.model.weight_bytes() as f64, half.model.weight_bytes() as f64);
            assert!(b < 0.55 * a, "{path}: {b} bytes of weights against {a} as f32");
            for case in reference(family) {
                let logits = |m: &weft::loaded::LoadedModel| {
                    let c = &m.model.config;
                    let n = case.prompt_ids.len();
                    let mut kv = KvCache::new(
                        m.model.kv_dtype(KvCacheDtype::Auto),
                        c.num_layers,
                        n.div_ceil(16),
                        16,
                        c.num_kv_heads,
                        c.head_dim,
                    );
                    let mut alloc = BlockAllocator::new(kv.num_blocks(), false);
                    let mut table = BlockTable::default();
                    table.reserve(&mut alloc, n, 16).unwrap();
                    let seq =
                        [SeqStep { context_len: 0, num_tokens: n, seq_len: n, block_table: table.blocks(), logits: 1 }];
                    let mut ws = Workspace::default();
                    m.model.forward(&StepInput { tokens: &case.prompt_ids, seqs: &seq }, &mut kv, &mut ws).to_vec()
                };
                assert!(logits(&wide) == logits(&half), "{path} {}", case.id);
            }
        }
    }
}
