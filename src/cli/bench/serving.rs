//! A serving run on a mixed workload (seeded prompt and output lengths, Poisson arrivals or
//! all at once): continuous batching against one request at a time through the same
//! engine, with throughput, TTFT and inter-token latency percentiles and the speedup.

use super::measure::*;
use super::BenchArgs;
use crate::cli::workload::LengthMix;
use crate::engine::{EngineConfig, EngineHandle, Request};
use anyhow::Result;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The serving run of `--requests` requests; its summary.
pub(super) fn run(args: &BenchArgs, model: &Arc<crate::loaded::LoadedModel>, base: &EngineConfig) -> Result<Value> {
    let vocab = model.model.config.vocab_size;
    // Its own generator, so the workload is the same whichever batch sizes ran before.
    let mut rng = Rng(args.seed ^ 0x5DEE_CE66_D1CE_4E5B);
    let mut reqs = Vec::new();
    let mut at = 0.0;
    let mix = match (args.prompt_len, args.output_len) {
        (Some(p), Some(o)) => LengthMix::uniform(p, o),
        _ => LengthMix::chat(),
    };
    let ctx = model.model.config.max_position_embeddings;
    let (mut shortest, mut longest) = (usize::MAX, 0);
    for _ in 0..args.requests {
        let (plen, olen) = mix.draw(&mut |lo, hi| rng.range(lo, hi));
        // Within the model's context, as a client that knows it would send.
        let olen = olen.min(ctx / 4);
        let plen = plen.min(ctx - olen - 1);
        (shortest, longest) = (shortest.min(plen), longest.max(plen));
        let mut r = Request::new(random_prompt(&mut rng, plen, vocab), olen);
        r.stop.ignore_eos = true;
        reqs.push((Duration::from_secs_f64(at), r));
        if args.request_rate > 0.0 {
            at += -(1.0 - rng.unit()).ln() / args.request_rate;
        }
    }
    let rate =
        if args.request_rate > 0.0 { format!("Poisson {} req/s", args.request_rate) } else { "all at once".into() };
    let source = if args.prompt_len.is_some() { "uniform" } else { "the chat mix" };
    println!("\nserving: {} requests, prompts of {shortest}..{longest} tokens from {source}, {rate}", args.requests);
    println!(
        "{:>12} {:>9} {:>10} {:>8} {:>10} {:>10} {:>9} {:>9} {:>8} {:>10} {:>10}",
        "mode",
        "total s",
        "out tok/s",
        "req/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "preempt",
        "step p50",
        "step p99"
    );
    let mut modes = Vec::new();
    for (name, seqs) in [("continuous", base.max_num_seqs), ("sequential", 1)] {
        let engine = EngineHandle::start(
            model.clone(),
            EngineConfig {
                max_num_seqs: seqs,
                max_waiting_requests: base.max_waiting_requests.max(args.requests),
                ..base.clone()
            },
        )?;
        let t0 = Instant::now();
        let t = drive(&engine, reqs.clone())?;
        let total = t0.elapsed().as_secs_f64();
        let st = engine.stats();
        let preemptions = st.preemptions;
        let mut steps: Vec<f64> = st.recent_step_ms.iter().map(|&x| x as f64 / 1e3).collect();
        let out: usize = t.iter().map(|x| x.tokens.len()).sum();
        let mut ttft: Vec<f64> = t.iter().filter_map(Timing::ttft).collect();
        let mut itl: Vec<f64> =
            t.iter().flat_map(|x| x.tokens.windows(2).map(|w| (w[1] - w[0]).as_secs_f64())).collect();
        let m = json!({"mode": name, "max_num_seqs": seqs, "total_s": total, "output_tok_s": out as f64 / total,
            "requests_s": args.requests as f64 / total,
            "ttft_p50_s": percentile(&mut ttft, 0.5), "ttft_p99_s": percentile(&mut ttft, 0.99),
            "itl_p50_s": percentile(&mut itl, 0.5), "itl_p99_s": percentile(&mut itl, 0.99), "preemptions": preemptions,
            "step_p50_s": percentile(&mut steps, 0.5), "step_p99_s": percentile(&mut steps, 0.99),
            "step_max_s": percentile(&mut steps, 1.0),
            "forward_s": st.forward_time.as_secs_f64(), "prompt_step_s": st.step_mix.prompt_time.as_secs_f64(),
            "decode_step_s": st.step_mix.decode_time.as_secs_f64(), "few_decode_step_s": st.step_mix.few_time.as_secs_f64(),
            "decode_seqs_per_step": st.step_mix.decode_batch()});
        println!(
            "{:>12} {:>9.2} {:>10.1} {:>8.2} {:>9.0}ms {:>9.0}ms {:>7.1}ms {:>7.1}ms {:>8} {:>8.1}ms {:>8.1}ms",
            name,
            total,
            m["output_tok_s"].as_f64().unwrap(),
            m["requests_s"].as_f64().unwrap(),
            m["ttft_p50_s"].as_f64().unwrap() * 1e3,
            m["ttft_p99_s"].as_f64().unwrap() * 1e3,
            m["itl_p50_s"].as_f64().unwrap() * 1e3,
            m["itl_p99_s"].as_f64().unwrap() * 1e3,
            preemptions,
            m["step_p50_s"].as_f64().unwrap() * 1e3,
            m["step_p99_s"].as_f64().unwrap() * 1e3
        );
        // Where the wall time went, for the speedup below.
        println!("{:>12}  forward {:.1} s: {}", "", st.forward_time.as_secs_f64(), st.step_mix.summary());
        modes.push(m);
    }
    let speedup = modes[0]["output_tok_s"].as_f64().unwrap_or(0.0) / modes[1]["output_tok_s"].as_f64().unwrap_or(1.0);
    println!("continuous batching: {speedup:.2}x the throughput of one request at a time");
    Ok(json!({"requests": args.requests, "lengths": source, "prompt_len": [shortest, longest],
        "request_rate": args.request_rate, "modes": modes, "speedup": speedup}))
}
