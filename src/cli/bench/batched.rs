//! The batched table, like llama.cpp's `llama-batched-bench`: for each batch size B, B
//! prompts of PP tokens enter at once, then each decodes TG tokens; beside it, llama.cpp on
//! the same file (`--llama-cpp`) and the bare forward loop at one stream.

use super::measure::*;
use super::BenchArgs;
use crate::engine::{EngineConfig, EngineHandle, Request};
use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Decode tokens/s of the model's forward pass driven directly (no engine, scheduler or
/// sampler): the yardstick for the engine's single-request overhead.
fn bare_decode(model: &crate::model::Decoder, kv: crate::kv::KvCacheDtype, prompt: &[u32], gen: usize) -> f64 {
    use crate::kv::{BlockAllocator, BlockTable, KvCache};
    use crate::model::{SeqStep, StepInput, Workspace};
    let c = &model.config;
    let n = prompt.len() + gen;
    let mut kv = KvCache::new(model.kv_dtype(kv), &c.kv_shapes(), n.div_ceil(16), 16).with_states(c.state_floats());
    let mut alloc = BlockAllocator::new(kv.num_blocks(), false);
    let mut table = BlockTable::default();
    table.reserve(&mut alloc, n, 16).expect("sized for the sequence");
    let mut ws = Workspace::default();
    let (mut feed, mut ctx, mut start) = (prompt.to_vec(), 0, Instant::now());
    for step in 0..gen {
        if step == 1 {
            start = Instant::now();
        }
        let seq = [SeqStep::sampled(ctx, feed.len(), table.blocks())];
        let next = crate::sampling::argmax(model.forward(&StepInput { tokens: &feed, seqs: &seq }, &mut kv, &mut ws));
        ctx += feed.len();
        feed = vec![next];
    }
    (gen - 1) as f64 / start.elapsed().as_secs_f64()
}

/// One run of the batched table at batch size `b`: its row, printed and as JSON.
fn batched_row(
    args: &BenchArgs,
    model: &Arc<crate::loaded::LoadedModel>,
    base: &EngineConfig,
    b: usize,
    rng: &mut Rng,
) -> Result<Value> {
    let vocab = model.model.config.vocab_size;
    let cfg = EngineConfig {
        max_num_seqs: b,
        max_num_batched_tokens: base.max_num_batched_tokens.max(b * args.prompt_tokens),
        ..base.clone()
    };
    let engine = EngineHandle::start(model.clone(), cfg)?;
    ensure!(
        engine.config().max_num_seqs == b,
        "--kv-cache-memory holds the recurrent state of {} sequences, not B={b}: raise it",
        engine.config().max_num_seqs
    );
    let reqs = (0..b)
        .map(|_| {
            let mut r = Request::new(random_prompt(rng, args.prompt_tokens, vocab), args.gen_tokens);
            r.stop.ignore_eos = true;
            (Duration::ZERO, r)
        })
        .collect();
    let t = drive(&engine, reqs)?;
    let start = t.iter().map(|x| x.sent).min().context("no requests")?;
    let pp_end = t.iter().filter_map(|x| x.tokens.first()).max().context("no tokens")?;
    let end = t.iter().filter_map(|x| x.tokens.last()).max().context("no tokens")?;
    let (pp, tg) = ((*pp_end - start).as_secs_f64(), (*end - *pp_end).as_secs_f64());
    // Only the tokens after the last prompt's first: where prompts were prefilled in
    // several steps, the first ones decoded meanwhile, in the prefill's time.
    let decoded: usize = t.iter().map(|x| x.tokens.iter().filter(|&&at| at > *pp_end).count()).sum();
    let overlapped: usize = t.iter().map(|x| x.tokens.len() - 1).sum::<usize>() - decoded;
    let st = engine.stats();
    let overhead = st.overhead_time.as_secs_f64() / (st.overhead_time + st.forward_time).as_secs_f64();
    let row = json!({"batch": b, "pp": args.prompt_tokens, "tg": args.gen_tokens, "pp_s": pp, "pp_tok_s": (b * args.prompt_tokens) as f64 / pp,
        "tg_s": tg, "tg_tok_s": decoded as f64 / tg, "total_tok_s": (b * (args.prompt_tokens + args.gen_tokens)) as f64 / (pp + tg),
        "overhead_fraction": overhead, "tokens_during_prefill": overlapped});
    println!(
        "{:>4} {:>5} {:>5} {:>9.3} {:>10.1} {:>9.3} {:>10.1} {:>10.1} {:>8.2}%",
        b,
        args.prompt_tokens,
        args.gen_tokens,
        pp,
        row["pp_tok_s"].as_f64().unwrap(),
        tg,
        row["tg_tok_s"].as_f64().unwrap(),
        row["total_tok_s"].as_f64().unwrap(),
        overhead * 100.0
    );
    if overlapped > decoded {
        // The sequences that started first finish first, so TG timed fewer than B streams.
        println!(
            "  B={b}: {overlapped} tokens decoded while prompts were still prefilling, left out of TG, and \
             {decoded} after, as the batch drained: more --gen-tokens time B streams"
        );
    } else if overlapped > 0 {
        println!("  B={b}: {overlapped} tokens decoded while prompts were still prefilling, left out of TG");
    }
    let mut row = row;
    if let (Some(moe), true) = (&model.model.config.moe, st.moe_decode.layer_runs > 0) {
        row["experts"] = expert_balance(b, moe.num_experts, &st.moe_decode, st.forward_time, st.moe.time);
    }
    drop(engine);
    if b == 1 {
        // This VM's memory bandwidth flips between phases within minutes: the read that one
        // stream's decode is set against is taken right after it, and the bare forward
        // loop next, not at the end of the run.
        let pool = crate::engine::thread_pool(base.threads)?;
        row["read_gb_s"] = json!(pool.install(crate::cli::machine::read_bandwidth));
        let prompt = random_prompt(rng, args.prompt_tokens, vocab);
        let bare = pool.install(|| bare_decode(&model.model, args.engine.kv_cache_dtype, &prompt, args.gen_tokens));
        row["bare_tg_tok_s"] = json!(bare);
    }
    Ok(row)
}

/// How decode steps' rows spread over a mixture's experts, and the share of the forward
/// time its layers take: printed and as JSON.
fn expert_balance(
    b: usize,
    experts: usize,
    m: &crate::model::moe::Stats,
    forward: Duration,
    moe_time: Duration,
) -> Value {
    let runs = m.layer_runs as f64;
    let used = m.experts_used as f64 / runs;
    let per_used = m.routed_rows as f64 / m.experts_used.max(1) as f64;
    let busiest = m.busiest_rows as f64 / runs;
    let share = moe_time.as_secs_f64() / forward.as_secs_f64().max(1e-9);
    println!(
        "  B={b} experts, decode steps: {used:.1} of {experts} used per layer, {per_used:.2} rows each, \
         busiest {busiest:.1}; mixture layers {:.0}% of forward time",
        share * 100.0
    );
    json!({"used_per_layer": used, "rows_per_used_expert": per_used, "busiest_rows": busiest,
        "moe_share_of_forward": share})
}

/// The engine's one-stream decode against the bare forward loop run right after it:
/// each run's difference, their median and range; into `report`.
fn engine_vs_bare(runs: &[Value], report: &mut Value) {
    let speed = |r: &Value, k: &str| r[k].as_f64().unwrap_or(0.0);
    let mut diffs: Vec<f64> =
        runs.iter().map(|r| (speed(r, "tg_tok_s") / speed(r, "bare_tg_tok_s").max(1e-9) - 1.0) * 100.0).collect();
    let median = percentile(&mut diffs, 0.5);
    let (lo, hi) = (diffs.first().copied().unwrap_or(0.0), diffs.last().copied().unwrap_or(0.0));
    let bare: Vec<String> = runs.iter().map(|r| format!("{:.1}", speed(r, "bare_tg_tok_s"))).collect();
    println!(
        "  single request: engine against the bare forward loop run after it ({} tok/s): median {median:+.1}% \
         ({lo:+.1}% to {hi:+.1}%) over {} run{}",
        bare.join(", "),
        runs.len(),
        if runs.len() == 1 { "" } else { "s" }
    );
    report["engine_vs_bare_forward_pct"] = json!({"median": median, "range": [lo, hi]});
}

/// Batch size `b`'s runs as one row: the run with the median decode speed, and with a
/// peer, every pair's ratios and their medians.
fn median_run(b: usize, mut runs: Vec<Value>) -> Value {
    let pairs: Vec<Value> = runs.iter().filter_map(|r| r.get("llama_cpp").cloned()).collect();
    let tg = |r: &Value| r["tg_tok_s"].as_f64().unwrap_or(0.0);
    runs.sort_by(|x, y| tg(x).total_cmp(&tg(y)));
    let mut row = runs[runs.len() / 2].clone();
    if pairs.len() > 1 {
        // Median and range of each ratio over the pairs.
        let spread = |k: &str| {
            let mut v: Vec<f64> = pairs.iter().filter_map(|p| p[k].as_f64()).collect();
            let median = percentile(&mut v, 0.5);
            (median, v.first().copied().unwrap_or(0.0), v.last().copied().unwrap_or(0.0))
        };
        let ((tg, tg_lo, tg_hi), (pp, pp_lo, pp_hi)) = (spread("tg_ratio"), spread("pp_ratio"));
        println!(
            "{b:>4} weft against llama.cpp over {} alternated pairs: median {tg:.2}x TG ({tg_lo:.2}-{tg_hi:.2}), \
             {pp:.2}x PP ({pp_lo:.2}-{pp_hi:.2})",
            pairs.len()
        );
        row["llama_cpp_pairs"] = Value::Array(pairs);
        row["llama_cpp_median"] = json!({"tg_ratio": tg, "pp_ratio": pp});
        row["llama_cpp_range"] = json!({"tg_ratio": [tg_lo, tg_hi], "pp_ratio": [pp_lo, pp_hi]});
    }
    row
}

/// The batched table at each of `--batch-sizes`, with llama.cpp beside it when asked, the
/// bare forward loop at one stream and the machine's limits; into `report`.
pub(super) fn run(
    args: &BenchArgs,
    model: &Arc<crate::loaded::LoadedModel>,
    base: &EngineConfig,
    threads: usize,
    rng: &mut Rng,
    report: &mut Value,
) -> Result<()> {
    let batch_sizes: Vec<usize> = args.batch_sizes.iter().copied().filter(|&b| b > 0).collect();
    if batch_sizes.is_empty() {
        return Ok(());
    }
    {
        ensure!(args.prompt_tokens > 0 && args.gen_tokens > 1, "need --prompt-tokens > 0 and --gen-tokens > 1");
        println!("\nbatched: B prompts of PP tokens enter together, then each decodes TG tokens");
        println!(
            "{:>4} {:>5} {:>5} {:>9} {:>10} {:>9} {:>10} {:>10} {:>9}",
            "B", "PP", "TG", "PP s", "PP tok/s", "TG s", "TG tok/s", "total t/s", "overhead"
        );
        let mut rows = Vec::new();
        let peer = match &args.llama_cpp {
            Some(dir) => {
                let file = args.engine.model.clone().filter(|m| m.extension().is_some_and(|e| e == "gguf"));
                let file = file.context("--llama-cpp compares on a GGUF file: pass it with --model")?;
                Some((crate::cli::peer::LlamaCpp::new(dir.clone())?, file))
            }
            None => None,
        };
        ensure!(args.pairs > 0, "--pairs must be at least 1");
        for &b in &batch_sizes {
            let mut runs = Vec::new();
            for _ in 0..args.pairs {
                let mut row = batched_row(args, model, base, b, rng)?;
                if let Some((llama, file)) = &peer {
                    let theirs = llama.measure(file, threads, b, args.prompt_tokens, args.gen_tokens)?;
                    let ours = |k: &str| row[k].as_f64().unwrap_or(0.0);
                    let (tg, pp) = (ours("tg_tok_s") / theirs.tg_tok_s, ours("pp_tok_s") / theirs.pp_tok_s);
                    let tool = if b == 1 { "llama-bench tg/pp" } else { "llama-batched-bench S_TG/S_PP" };
                    println!(
                        "{:>4} llama.cpp ({tool}): TG {:.1} tok/s, PP {:.1} tok/s; weft {tg:.2}x TG, {pp:.2}x PP",
                        b, theirs.tg_tok_s, theirs.pp_tok_s
                    );
                    row["llama_cpp"] = json!({"tg_tok_s": theirs.tg_tok_s, "pp_tok_s": theirs.pp_tok_s,
                        "tg_ratio": tg, "pp_ratio": pp});
                }
                runs.push(row);
            }
            let ones = (b == 1).then(|| runs.clone());
            rows.push(median_run(b, runs));
            if let Some(runs) = ones {
                engine_vs_bare(&runs, report);
            }
        }
        let first = rows.first().and_then(|r| r["tg_tok_s"].as_f64()).unwrap_or(0.0);
        for r in &rows {
            let b = r["batch"].as_u64().unwrap_or(0);
            println!("  decode at B={b}: {:.2}x B={}", r["tg_tok_s"].as_f64().unwrap_or(0.0) / first, batch_sizes[0]);
        }
        report["limits"] = super::limits::print_limits(model, &rows, base.threads)?;
        report["batched"] = Value::Array(rows);
    }

    Ok(())
}
