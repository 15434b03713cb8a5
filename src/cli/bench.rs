//! `weft bench`: throughput of the engine, measured in one run.
//! - A batched table like llama.cpp's `llama-batched-bench`: for each batch size B, B
//!   prompts of PP tokens enter at once, then each decodes TG tokens.
//! - A serving run on a mixed workload (seeded prompt and output lengths, Poisson arrivals
//!   or all at once): continuous batching against one request at a time through the same
//!   engine, with throughput, TTFT and inter-token latency percentiles and the speedup.
//! - A shared-system-prompt run (one long prefix, many short questions, a few clients at a
//!   time): prefix caching on against off, with TTFT, throughput and whether the greedy
//!   outputs are identical.
//! - With `--speculative-config`, speculative decoding on against off: one stream on an
//!   input-grounded task (rewriting a paragraph, a code edit, proofreading) and on free generation, then
//!   2 to 32 streams at once; decode speed, acceptance rate, draft tokens per output
//!   token (where speculation backs off), and whether the outputs are identical.
//! - With `--llama-cpp`, llama.cpp's own benchmarks on the same GGUF file beside each batch
//!   size of the table, alternated with weft's runs (`--pairs`), and weft's speed against
//!   them ([`super::peer`]).

use super::workload::LengthMix;
use super::EngineArgs;
use crate::engine::{EngineConfig, EngineHandle, Event, Request};
use anyhow::{ensure, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub against: Option<BenchTarget>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Batch sizes for the batched table (0: skip it).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub batch_sizes: Vec<usize>,
    /// Prompt tokens per sequence in the batched table.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Generated tokens per sequence in the batched table.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// A llama.cpp build's `bin` folder: each batch size of the table then also runs
    /// llama.cpp's own benchmark on the same GGUF file and threads (`llama-bench`'s `tg` and
    /// `pp` at B=1, `llama-batched-bench` above), and prints weft's speed against it.
    #[arg(long, value_name = "DIR")]
    pub llama_cpp: Option<PathBuf>,
    /// Alternated runs of weft and llama.cpp per batch size, with `--llama-cpp`: a machine
    /// whose speed drifts shifts both sides of a pair alike, so each pair gives a ratio and
    /// the median is reported.
    #[arg(long, default_value_t = 1, requires = "llama_cpp")]
    pub pairs: usize,
    /// Requests in the serving run (0: skip it).
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Prompt lengths of the serving run, MIN:MAX tokens, uniform (default: the chat mix
    /// of `workloads/chat-mix.json`, short turns to documents, as the CI soak sends).
    #[arg(long, value_parser = parse_range, requires = "output_len")]
    pub prompt_len: Option<(usize, usize)>,
    /// Output lengths of the serving run, MIN:MAX tokens, uniform (with `--prompt-len`).
    #[arg(long, value_parser = parse_range, requires = "prompt_len")]
    pub output_len: Option<(usize, usize)>,
    /// Poisson arrival rate in requests/s (0: all at once).
    #[arg(long, default_value_t = 0.0)]
    pub request_rate: f64,
    /// Requests in the shared-system-prompt run (0: skip it).
    #[arg(long, default_value_t = 64)]
    pub shared_requests: usize,
    /// Tokens of the system prompt every request of that run shares.
    #[arg(long, default_value_t = 1000)]
    pub shared_prefix: usize,
    /// Tokens of each request's own question after it.
    #[arg(long, default_value_t = 30)]
    pub shared_question: usize,
    /// Output tokens per request of that run.
    #[arg(long, default_value_t = 64)]
    pub shared_output: usize,
    /// Concurrent clients in that run.
    #[arg(long, default_value_t = 8)]
    pub shared_concurrency: usize,
    /// Seed for the workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an SVG plot here (default: next to --json, with .svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(clap::Subcommand)]
pub enum BenchTarget {
    /// Load-test a running OpenAI-compatible server over HTTP.
    Serve(super::bench_serve::BenchServeArgs),
}

pub(super) fn parse_range(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s.split_once(':').ok_or_else(|| format!("expected MIN:MAX, got {s:?}"))?;
    let (a, b) =
        (a.parse().map_err(|_| format!("bad MIN in {s:?}"))?, b.parse().map_err(|_| format!("bad MAX in {s:?}"))?);
    if a == 0 || a > b {
        return Err(format!("need 0 < MIN <= MAX, got {s:?}"));
    }
    Ok((a, b))
}

/// A small deterministic generator for the workload (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What one request saw: when it was sent, when each token arrived, which tokens.
struct Timing {
    sent: Instant,
    tokens: Vec<Instant>,
    ids: Vec<u32>,
}

fn random_prompt(rng: &mut Rng, len: usize, vocab: usize) -> Vec<u32> {
    // Skip the lowest ids, where models keep their special tokens.
    (0..len).map(|_| (300 + rng.next() % (vocab as u64 - 300)) as u32).collect()
}

/// Sends `reqs` at their offsets from now and waits for every token of every request.
fn drive(engine: &EngineHandle, reqs: Vec<(Duration, Request)>) -> Result<Vec<Timing>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    rt.block_on(async {
        let start = Instant::now();
        let mut tasks = Vec::new();
        for (at, req) in reqs {
            tokio::time::sleep_until((start + at).into()).await;
            let sent = Instant::now();
            let stream = engine.submit(req)?;
            tasks.push(tokio::spawn(read_stream(sent, stream)));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await?);
        }
        Ok(out)
    })
}

impl Timing {
    /// Seconds from sending to the first token (none if no token came).
    fn ttft(&self) -> Option<f64> {
        self.tokens.first().map(|f| (*f - self.sent).as_secs_f64())
    }
}

async fn read_stream(sent: Instant, mut stream: crate::engine::RequestStream) -> Timing {
    let (mut tokens, mut ids) = (Vec::new(), Vec::new());
    while let Some(ev) = stream.recv().await {
        if let Event::Token { id, .. } = ev {
            tokens.push(Instant::now());
            ids.push(id);
        }
    }
    Timing { sent, tokens, ids }
}

/// `clients` closed-loop clients work through `reqs` in order, each sending its next
/// request when the previous one ended; timings come back in request order.
fn drive_clients(engine: &EngineHandle, reqs: Vec<Request>, clients: usize) -> Result<Vec<Timing>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    rt.block_on(async {
        let reqs = Arc::new(reqs);
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..clients.max(1) {
            let (engine, reqs, next) = (engine.clone(), reqs.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                let mut done = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(r) = reqs.get(i) else { break };
                    let sent = Instant::now();
                    let stream = engine.submit(r.clone())?;
                    done.push((i, read_stream(sent, stream).await));
                }
                anyhow::Ok(done)
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await??);
        }
        all.sort_by_key(|(i, _)| *i);
        Ok(all.into_iter().map(|(_, t)| t).collect())
    })
}

/// The shared-system-prompt run: the same requests with prefix caching on, then off.
fn shared_prefix_run(args: &BenchArgs, model: &Arc<crate::loaded::LoadedModel>, base: EngineConfig) -> Result<Value> {
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

/// A paragraph for the input-grounded task: most of a faithful rewrite copies it.
const PARAGRAPH: &str = "Alice Morgan opened the bakery on Elm Street at six every morning. Alice \
baked bread while her brother Tom Morgan served coffee to the first customers. On Saturdays Alice \
and Tom sold apple pies at the market, and Tom always kept the best pie for their neighbour, Mrs. \
Green. When the old oven broke in winter, Mrs. Green lent Alice her own oven until the new one came.";

/// The paragraph with five words misspelled, for the proofreading task.
fn misspelled(text: &str) -> String {
    [("bakery", "bakry"), ("morning", "mornign"), ("customers", "custmers"), ("market", "markit"), ("winter", "wintr")]
        .iter()
        .fold(text.to_string(), |t, (right, wrong)| t.replace(right, wrong))
}

/// Code for the code-edit task: a rename leaves the rest as it was.
const CODE: &str = "def total_price(items, tax):
    total = 0
    for item in items:
        total = total + item.price * item.quantity
    total = total + total * tax
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
";

/// Speculative decoding on against off, greedy, through the model's chat template: one
/// stream on grounded tasks and on free generation (each run three times, alternating,
/// the fastest kept: this machine's speed drifts), then 32 streams at once (twice each).
fn speculative_run(
    model: &Arc<crate::loaded::LoadedModel>,
    base: &EngineConfig,
    spec: &crate::engine::speculative::SpeculativeConfig,
) -> Result<Value> {
    use crate::tokenizer::ChatContext;
    let tok = &model.tokenizer;
    let template = tok.chat().map_err(|e| anyhow::anyhow!("the speculative run needs a chat template: {e}"))?;
    let chat = |text: &str| -> Result<Vec<u32>> {
        let messages = [json!({"role": "user", "content": text})];
        let text =
            template.render(&ChatContext { messages: &messages, add_generation_prompt: true, ..Default::default() })?;
        tok.encode_with(&text, false)
    };
    let tasks = [
        ("rewrite", chat(&format!("Rewrite this paragraph with the names changed (Alice to Maria, Tom to Ben, Mrs. Green to Mr. Hill):\n\n{PARAGRAPH}"))?),
        ("code edit", chat(&format!("Rename the variable `items` to `products` in this Python code and show the whole code:\n\n```python\n{CODE}```"))?),
        ("proofread", chat(&format!("Correct the spelling mistakes in this paragraph and write it out in full:\n\n{}", misspelled(PARAGRAPH)))?),
        ("free", chat("Write a short story about a dragon who learns to cook.")?),
    ];
    let request = |prompt: &[u32]| Request::new(prompt.to_vec(), 256);
    let off = EngineHandle::start(model.clone(), EngineConfig { speculative: None, ..base.clone() })?;
    let on = EngineHandle::start(model.clone(), EngineConfig { speculative: Some(spec.clone()), ..base.clone() })?;
    println!("\nspeculative decoding ({spec:?}), greedy, chat template; one stream, then many at once");
    println!("(drafted: draft tokens verified per output token; accepted: the share of them kept)");
    println!(
        "{:>10} {:>7} {:>12} {:>12} {:>7} {:>9} {:>8} {:>10}",
        "task", "tokens", "off tok/s", "on tok/s", "ratio", "accepted", "drafted", "identical"
    );
    let accepted = |e: &EngineHandle| {
        let st = e.stats();
        (st.spec_draft_tokens, st.spec_accepted_tokens)
    };
    // Decode speed: tokens after the first over the time since the first.
    let decode_rate = |t: &Timing| {
        (t.tokens.len().saturating_sub(1)) as f64 / (t.tokens[t.tokens.len() - 1] - t.tokens[0]).as_secs_f64().max(1e-9)
    };
    let mut rows = Vec::new();
    for (name, prompt) in &tasks {
        let (mut best_off, mut best_on, mut ids) = (0f64, 0f64, Vec::new());
        let before = accepted(&on);
        for _ in 0..3 {
            for (engine, best) in [(&off, &mut best_off), (&on, &mut best_on)] {
                let t = drive(engine, vec![(Duration::ZERO, request(prompt))])?.remove(0);
                ensure!(t.tokens.len() > 1, "the {name} task produced no output to time");
                *best = best.max(decode_rate(&t));
                ids.push(t.ids);
            }
        }
        let after = accepted(&on);
        let rate = (after.1 - before.1) as f64 / (after.0 - before.0).max(1) as f64;
        let drafted = (after.0 - before.0) as f64 / 3.0 / ids[0].len() as f64;
        let identical = ids.windows(2).all(|w| w[0] == w[1]);
        println!(
            "{name:>10} {:>7} {best_off:>12.1} {best_on:>12.1} {:>6.2}x {:>8.1}% {drafted:>8.2} {:>10}",
            ids[0].len(),
            best_on / best_off,
            100.0 * rate,
            if identical { "yes" } else { "NO" }
        );
        rows.push(json!({"task": name, "tokens": ids[0].len(), "off_tok_s": best_off, "on_tok_s": best_on,
            "ratio": best_on / best_off, "acceptance": rate, "drafted_per_token": drafted, "identical": identical}));
    }
    // Many streams: the tasks' prompts in turn, all sent at once. As the batch grows the
    // step turns compute-bound and drafts should fade out (the "drafted" column).
    for streams in [2, 4, 8, 16, 32] {
        let many: Vec<(Duration, Request)> =
            (0..streams).map(|i| (Duration::ZERO, request(&tasks[i % tasks.len()].1))).collect();
        // (best tokens/s, outputs) per engine; alternating runs, as above.
        let mut tput: Vec<(f64, Vec<Vec<u32>>)> = vec![(0.0, Vec::new()), (0.0, Vec::new())];
        let before = accepted(&on);
        for _ in 0..2 {
            for (engine, best) in [&off, &on].into_iter().zip(tput.iter_mut()) {
                let t0 = Instant::now();
                let t = drive(engine, many.clone())?;
                let out: usize = t.iter().map(|x| x.tokens.len()).sum();
                best.0 = best.0.max(out as f64 / t0.elapsed().as_secs_f64());
                best.1 = t.into_iter().map(|x| x.ids).collect();
            }
        }
        let after = accepted(&on);
        let tokens: usize = tput[0].1.iter().map(Vec::len).sum();
        let drafted = (after.0 - before.0) as f64 / 2.0 / tokens as f64;
        let rate = (after.1 - before.1) as f64 / (after.0 - before.0).max(1) as f64;
        let identical = tput[0].1 == tput[1].1;
        let ratio = tput[1].0 / tput[0].0;
        let name = format!("{streams} streams");
        println!(
            "{name:>10} {tokens:>7} {:>12.1} {:>12.1} {ratio:>6.2}x {:>8.1}% {drafted:>8.2} {:>10}",
            tput[0].0,
            tput[1].0,
            100.0 * rate,
            if identical { "yes" } else { "NO" }
        );
        rows.push(
            json!({"task": name, "tokens": tokens, "off_tok_s": tput[0].0, "on_tok_s": tput[1].0, "ratio": ratio,
            "acceptance": rate, "drafted_per_token": drafted, "identical": identical}),
        );
    }
    Ok(json!({"config": format!("{spec:?}"), "runs": rows}))
}

/// Decode tokens/s of the model's forward pass driven directly (no engine, scheduler or
/// sampler): the yardstick for the engine's single-request overhead.
fn bare_decode(model: &crate::model::Decoder, kv: crate::kv::KvCacheDtype, prompt: &[u32], gen: usize) -> f64 {
    use crate::kv::{BlockAllocator, BlockTable, KvCache};
    use crate::model::{SeqStep, StepInput, Workspace};
    let c = &model.config;
    let n = prompt.len() + gen;
    let mut kv = KvCache::new(model.kv_dtype(kv), c.num_layers, n.div_ceil(16), 16, c.num_kv_heads, c.head_dim);
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
    if overlapped > 0 {
        println!("  B={b}: {overlapped} tokens decoded while prompts were still prefilling, left out of TG");
    }
    Ok(row)
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

/// The `p` quantile of `v` (sorted in place), interpolated between the two nearest values:
/// the median of an even count is the mean of the middle two.
pub(super) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let at = (v.len() - 1) as f64 * p;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (at - lo as f64)
}

/// Decode next to this machine's limits, measured now: weight bytes read per token and the
/// bandwidth that makes at B=1 against a streaming read; matrix GFLOP/s at the largest
/// batch against the peak of the arithmetic the matrices use (int8 multiply-adds for block
/// formats, f32 FMA otherwise).
fn print_limits(model: &crate::loaded::LoadedModel, rows: &[Value], threads: usize) -> Result<Value> {
    let pool = crate::engine::thread_pool(threads)?;
    let (read_gbs, fma_peak, int8_peak) =
        pool.install(|| (super::machine::read_bandwidth(), super::machine::fma_peak(), super::machine::int8_peak()));
    let bytes = model.model.weight_bytes() as f64;
    let flops_per_token = 2.0 * model.model.config.matmul_params() as f64;
    let tok_s = |b: u64| rows.iter().find(|r| r["batch"] == b).and_then(|r| r["tg_tok_s"].as_f64());
    let mut out = json!({
        "weight_bytes_per_token": bytes,
        "read_gb_s": read_gbs,
        "fma_peak_gflop_s": fma_peak,
        "int8_peak_gop_s": int8_peak.map(|(p, _)| p),
    });
    println!("  weights read per decoded token at B=1: {:.1} MB", bytes / 1e6);
    if let Some(t) = tok_s(1) {
        let gbs = bytes * t / 1e9;
        println!(
            "  B=1: {gbs:.1} GB/s of weights, {:.0}% of a streaming read ({read_gbs:.1} GB/s)",
            100.0 * gbs / read_gbs
        );
        out["b1_gb_s"] = json!(gbs);
    }
    if let Some(r) = rows.iter().max_by_key(|r| r["batch"].as_u64()) {
        let (b, t) = (r["batch"].as_u64().unwrap_or(0), r["tg_tok_s"].as_f64().unwrap_or(0.0));
        let gflops = flops_per_token * t / 1e9;
        let (peak, what) = match int8_peak {
            Some((p, step)) if model.model.quantized() => (p, format!("int8 multiply-add peak ({step})")),
            _ => (fma_peak, "f32 FMA peak".to_string()),
        };
        println!(
            "  B={b}: {gflops:.1} GFLOP/s-equivalent in matrix multiplies, {:.0}% of the {what} ({peak:.0})",
            100.0 * gflops / peak
        );
        out["max_batch_gflop_s"] = json!(gflops);
        let ceiling =
            if model.model.quantized() { pool.install(|| step_ceiling(model, fma_peak, int8_peak)) } else { None };
        if let Some(ceiling) = ceiling {
            let parts: Vec<String> = ceiling
                .formats
                .iter()
                .map(|(name, share, rate)| format!("{name} {:.0}% of products at {rate:.1} G/s", 100.0 * share))
                .collect();
            println!(
                "  B={b}: {t:.1} tok/s is {:.0}% of what the kernels' innermost steps alone allow on this machine ({:.1} tok/s: {})",
                100.0 * t / ceiling.tok_s,
                ceiling.tok_s,
                parts.join(", ")
            );
            // The peer's median over the pairs, against the same ceiling.
            let peer = r
                .get("llama_cpp_pairs")
                .and_then(Value::as_array)
                .cloned()
                .or_else(|| r.get("llama_cpp").map(|p| vec![p.clone()]));
            if let Some(peer) = peer {
                let theirs =
                    percentile(&mut peer.iter().filter_map(|p| p["tg_tok_s"].as_f64()).collect::<Vec<_>>(), 0.5);
                println!("  B={b}: llama.cpp's {theirs:.1} tok/s is {:.0}% of it", 100.0 * theirs / ceiling.tok_s);
            }
            out["step_ceiling_tok_s"] = json!(ceiling.tok_s);
        }
    }
    Ok(out)
}

/// The matrices' decode ceiling at any batch: each format's products at the rate of its
/// kernels' innermost step ([`super::machine::avx2_step_rate`]; with VNNI every format's is
/// one `vpdpbusd`, the int8 peak; float matrices at the FMA peak), nothing else counted.
struct StepCeiling {
    tok_s: f64,
    /// Format, share of the products, G products/s.
    formats: Vec<(String, f64, f64)>,
}

fn step_ceiling(
    model: &crate::loaded::LoadedModel,
    fma_peak: f64,
    int8_peak: Option<(f64, &str)>,
) -> Option<StepCeiling> {
    let by = model.model.products_by_format();
    let total: usize = by.iter().map(|(_, n)| n).sum();
    let vnni = crate::kernels::qmatmul::vnni();
    let mut seconds = 0.0;
    let mut formats = Vec::new();
    // Each distinct step measured once, so that formats sharing one share its rate.
    let mut steps: Vec<(crate::kernels::qmatmul::Avx2Step, f64)> = Vec::new();
    for (t, n) in by {
        // Operations count a multiply-add as two; rates here are products.
        let rate = match t {
            None => fma_peak / 2.0,
            Some(_) if vnni => int8_peak?.0 / 2.0,
            Some(t) => {
                let step = crate::kernels::qmatmul::avx2_step(t);
                match steps.iter().find(|(s, _)| *s == step) {
                    Some(&(_, rate)) => rate,
                    None => {
                        let rate = super::machine::avx2_step_rate(step)?;
                        steps.push((step, rate));
                        rate
                    }
                }
            }
        };
        seconds += n as f64 / (rate * 1e9);
        let name = t.map_or("float".to_string(), |t| format!("{t:?}"));
        formats.push((name, n as f64 / total as f64, rate));
    }
    (seconds > 0.0).then(|| StepCeiling { tok_s: 1.0 / seconds, formats })
}

pub fn run(args: BenchArgs) -> Result<()> {
    if let Some(BenchTarget::Serve(a)) = args.against {
        return super::bench_serve::run(a);
    }
    let engine = args.engine.start()?;
    let model: Arc<crate::loaded::LoadedModel> = engine.model_arc();
    drop(engine);
    let vocab = model.model.config.vocab_size;
    let base = args.engine.config();
    let threads = crate::engine::thread_pool(base.threads)?.current_num_threads();
    println!(
        "model {} ({} MB of weights, {:?}; {} KV cache), {threads} threads",
        model.name,
        model.model.weight_bytes() / 1_000_000,
        args.engine.dtype,
        model.model.kv_dtype(base.kv_cache_dtype)
    );
    let mut rng = Rng(args.seed ^ 0x9E37_79B9_7F4A_7C15);
    let mut report = json!({"model": model.name, "threads": threads});

    let batch_sizes: Vec<usize> = args.batch_sizes.iter().copied().filter(|&b| b > 0).collect();
    if !batch_sizes.is_empty() {
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
                Some((super::peer::LlamaCpp::new(dir.clone())?, file))
            }
            None => None,
        };
        ensure!(args.pairs > 0, "--pairs must be at least 1");
        for &b in &batch_sizes {
            let mut runs = Vec::new();
            for _ in 0..args.pairs {
                let mut row = batched_row(&args, &model, &base, b, &mut rng)?;
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
            rows.push(median_run(b, runs));
        }
        if batch_sizes.contains(&1) {
            let engine_b1 = rows.iter().find(|r| r["batch"] == 1).and_then(|r| r["tg_tok_s"].as_f64()).unwrap_or(0.0);
            let prompt = random_prompt(&mut rng, args.prompt_tokens, vocab);
            let bare = crate::engine::thread_pool(base.threads)?
                .install(|| bare_decode(&model.model, args.engine.kv_cache_dtype, &prompt, args.gen_tokens));
            println!(
                "  single request: engine {engine_b1:.1} tokens/s, bare forward loop {bare:.1} ({:+.1}%)",
                (engine_b1 / bare - 1.0) * 100.0
            );
            report["bare_forward_tg_tok_s"] = json!(bare);
        }
        let first = rows.first().and_then(|r| r["tg_tok_s"].as_f64()).unwrap_or(0.0);
        for r in &rows {
            let b = r["batch"].as_u64().unwrap_or(0);
            println!("  decode at B={b}: {:.2}x B={}", r["tg_tok_s"].as_f64().unwrap_or(0.0) / first, batch_sizes[0]);
        }
        report["limits"] = print_limits(&model, &rows, base.threads)?;
        report["batched"] = Value::Array(rows);
    }

    if args.requests > 0 {
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
        println!(
            "\nserving: {} requests, prompts of {shortest}..{longest} tokens from {source}, {rate}",
            args.requests
        );
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
                "step_max_s": percentile(&mut steps, 1.0)});
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
            modes.push(m);
        }
        let speedup =
            modes[0]["output_tok_s"].as_f64().unwrap_or(0.0) / modes[1]["output_tok_s"].as_f64().unwrap_or(1.0);
        println!("continuous batching: {speedup:.2}x the throughput of one request at a time");
        report["serving"] = json!({"requests": args.requests, "lengths": source, "prompt_len": [shortest, longest],
            "request_rate": args.request_rate, "modes": modes, "speedup": speedup});
    }

    if args.shared_requests > 0 {
        report["shared_prefix"] = shared_prefix_run(&args, &model, base.clone())?;
    }

    if let Some(spec) = &base.speculative {
        report["speculative"] = speculative_run(&model, &base, spec)?;
    }

    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("\nwrote {}", path.display());
    }
    let plot = args.plot.clone().or_else(|| args.json.as_ref().map(|j| j.with_extension("svg")));
    if let Some(path) = plot {
        std::fs::write(&path, super::plot::svg(&report)).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::percentile;

    /// The median of two ratios is their mean, not the larger (1.83x and 0.83x: 1.33x).
    #[test]
    fn percentiles_interpolate() {
        assert!((percentile(&mut [1.83, 0.83], 0.5) - 1.33).abs() < 1e-12);
        assert_eq!(percentile(&mut [3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(percentile(&mut [4.0, 1.0, 3.0, 2.0], 1.0), 4.0);
        assert_eq!(percentile(&mut [4.0, 1.0, 3.0, 2.0], 0.0), 1.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }
}
