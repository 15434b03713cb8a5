//! The shared-system-prompt run: one long prefix, many short questions, a few clients at a
//! time; prefix caching on against off.

use super::measure::*;
use super::BenchArgs;
use crate::engine::{EngineConfig, EngineHandle, Request};
use anyhow::Result;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// The shared-system-prompt run: the same requests with prefix caching on, then off.
pub(super) fn shared_prefix_run(
    args: &BenchArgs,
    model: &Arc<crate::loaded::LoadedModel>,
    base: EngineConfig,
) -> Result<Value> {
    let vocab = model.model.config.vocab_size;
    let mut rng = Rng(args.seed ^ 0x2545_F491_4F6C_DD1D);
    let system = random_prompt(&mut rng, args.shared_prefix, vocab);
    let reqs: Vec<Request> = (0..args.shared_requests)
        .map(|_| {
            let mut prompt = system.clone();
            prompt.extend(random_prompt(&mut rng, args.shared_question, vocab));
            let mut r = Request::new(prompt, args.shared_output);
            r.stop.ignore_eos = true;
            r
        })
        .collect();
    println!(
        "
shared system prompt: {} requests of a {}-token prefix + {}-token question, {} output tokens, {} clients",
        args.shared_requests, args.shared_prefix, args.shared_question, args.shared_output, args.shared_concurrency
    );
    println!(
        "{:>14} {:>9} {:>10} {:>10} {:>10} {:>9}",
        "prefix cache", "total s", "out tok/s", "TTFT p50", "TTFT p99", "cached"
    );
    let mut modes = Vec::new();
    let mut outputs = Vec::new();
    for caching in [true, false] {
        let engine = EngineHandle::start(model.clone(), EngineConfig { prefix_caching: caching, ..base.clone() })?;
        let t0 = Instant::now();
        let t = drive_clients(&engine, reqs.clone(), args.shared_concurrency)?;
        let total = t0.elapsed().as_secs_f64();
        let st = engine.stats();
        let out: usize = t.iter().map(|x| x.tokens.len()).sum();
        let mut ttft: Vec<f64> = t.iter().filter_map(Timing::ttft).collect();
        let hit = st.prefix_cache_hits as f64 / st.prefix_cache_queries.max(1) as f64;
        let m = json!({"prefix_caching": caching, "total_s": total, "output_tok_s": out as f64 / total,
            "ttft_p50_s": percentile(&mut ttft, 0.5), "ttft_p99_s": percentile(&mut ttft, 0.99), "hit_rate": hit});
        println!(
            "{:>14} {:>9.2} {:>10.1} {:>8.0}ms {:>8.0}ms {:>8.1}%",
            if caching { "on" } else { "off" },
            total,
            m["output_tok_s"].as_f64().unwrap(),
            m["ttft_p50_s"].as_f64().unwrap() * 1e3,
            m["ttft_p99_s"].as_f64().unwrap() * 1e3,
            hit * 100.0
        );
        modes.push(m);
        outputs.push(t.into_iter().map(|x| x.ids).collect::<Vec<_>>());
    }
    let f = |i: usize, k: &str| modes[i][k].as_f64().unwrap_or(0.0);
    let (ttft_ratio, tput_ratio) =
        (f(1, "ttft_p50_s") / f(0, "ttft_p50_s"), f(0, "output_tok_s") / f(1, "output_tok_s"));
    let identical = outputs[0] == outputs[1];
    println!(
        "prefix caching: TTFT p50 {ttft_ratio:.2}x lower, output {tput_ratio:.2}x the tokens/s; greedy outputs {}",
        if identical { "identical" } else { "DIFFER" }
    );
    Ok(
        json!({"requests": args.shared_requests, "prefix_tokens": args.shared_prefix, "question_tokens": args.shared_question,
        "output_tokens": args.shared_output, "concurrency": args.shared_concurrency, "modes": modes,
        "ttft_p50_ratio": ttft_ratio, "throughput_ratio": tput_ratio, "outputs_identical": identical}),
    )
}
