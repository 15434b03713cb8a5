//! `weft bench serve --url URL`: drives any OpenAI-compatible server (weft, vLLM,
//! llama-server) with N concurrent streaming clients and reports output tokens/s,
//! requests/s, time to first token and inter-token latency percentiles, per concurrency.

use super::measure::{parse_range, percentile};
use crate::cli::workload::LengthMix;
use anyhow::{ensure, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchServeArgs {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Model name to send (default: the first one /v1/models lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Concurrent clients; one run per value.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub concurrency: Vec<usize>,
    /// Requests per run (default: 4 per client, at least 8).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Prompt length in words (about one token each), MIN:MAX, uniform (default: the chat
    /// mix of `workloads/chat-mix.json`, within the server's `max_model_len`).
    #[arg(long, value_parser = parse_range, requires = "output_len")]
    pub prompt_len: Option<(usize, usize)>,
    /// Output tokens per request, MIN:MAX, uniform, with `--prompt-len` (sent as max_tokens
    /// with ignore_eos).
    #[arg(long, value_parser = parse_range, requires = "prompt_len")]
    pub output_len: Option<(usize, usize)>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

const WORDS: &[&str] = &[
    "the", "river", "runs", "past", "old", "mill", "where", "children", "play", "each", "summer", "and", "birds",
    "sing", "in", "tall", "green", "trees", "while", "clouds", "drift", "over", "quiet", "hills",
];

struct Sample {
    ttft: f64,
    gaps: Vec<f64>,
    tokens: usize,
}

/// One streaming completion: time to the first text, gaps between texts, tokens generated.
async fn one(http: &reqwest::Client, url: &str, body: &Value) -> Result<Sample> {
    let start = Instant::now();
    let mut resp = http.post(format!("{url}/v1/completions")).json(body).send().await?;
    ensure!(resp.status().is_success(), "HTTP {}: {}", resp.status(), resp.text().await.unwrap_or_default());
    let (mut first, mut last): (Option<Instant>, Option<Instant>) = (None, None);
    let (mut gaps, mut chunks, mut usage) = (Vec::new(), 0usize, None);
    let mut buf = String::new();
    while let Some(bytes) = resp.chunk().await? {
        buf.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data).context("bad SSE chunk")?;
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage = u["completion_tokens"].as_u64();
                }
                if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                    let now = Instant::now();
                    if first.is_none() {
                        first = Some(now);
                    } else if let Some(prev) = last {
                        gaps.push((now - prev).as_secs_f64());
                    }
                    last = Some(now);
                    chunks += 1;
                }
            }
        }
    }
    let first = first.context("the server sent no text")?;
    Ok(Sample { ttft: (first - start).as_secs_f64(), gaps, tokens: usage.map_or(chunks, |u| u as usize) })
}

pub fn run(args: BenchServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        // A fresh connection per request: servers that close idle keep-alive connections
        // (llama-server) would otherwise fail a request sent on a dying one.
        let http = reqwest::Client::builder().timeout(Duration::from_secs(600)).pool_max_idle_per_host(0).build()?;
        let url = args.url.trim_end_matches('/').to_string();
        let models: Value = http.get(format!("{url}/v1/models")).send().await?.json().await?;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => models["data"][0]["id"].as_str().context("/v1/models lists no model")?.to_string(),
        };
        // Servers that say their context (weft, vLLM) get prompts that fit; else 4096.
        let ctx = models["data"][0]["max_model_len"].as_u64().unwrap_or(4096) as usize;
        let mix = match (args.prompt_len, args.output_len) {
            (Some(p), Some(o)) => LengthMix::uniform(p, o),
            _ => LengthMix::chat(),
        };
        println!("server {url}, model {model}");
        println!("{:>6} {:>8} {:>9} {:>8} {:>10} {:>10} {:>10} {:>9} {:>9}", "conc", "requests", "time s", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99");
        let mut runs = Vec::new();
        let mut state = args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut rand = move |lo: usize, hi: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            lo + (state % (hi - lo + 1) as u64) as usize
        };
        for &conc in &args.concurrency {
            ensure!(conc > 0, "concurrency must be at least 1");
            let n = args.requests.unwrap_or((4 * conc).max(8));
            let bodies: Arc<Vec<Value>> = Arc::new(
                (0..n)
                    .map(|_| {
                        let (words, max_tokens) = mix.draw(&mut rand);
                        let max_tokens = max_tokens.min(ctx / 4);
                        // Room for words of more than one token.
                        let words = words.min((ctx - max_tokens) * 2 / 3);
                        let prompt: Vec<&str> = (0..words).map(|_| WORDS[rand(0, WORDS.len() - 1)]).collect();
                        json!({"model": model, "prompt": prompt.join(" "), "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})
                    })
                    .collect(),
            );
            let next = Arc::new(AtomicUsize::new(0));
            let start = Instant::now();
            let clients: Vec<_> = (0..conc)
                .map(|_| {
                    let (http, url, bodies, next) = (http.clone(), url.clone(), bodies.clone(), next.clone());
                    tokio::spawn(async move {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(body) = bodies.get(i) else { break };
                            out.push(one(&http, &url, body).await?);
                        }
                        anyhow::Ok(out)
                    })
                })
                .collect();
            let mut samples = Vec::new();
            for c in clients {
                samples.extend(c.await??);
            }
            let total = start.elapsed().as_secs_f64();
            let tokens: usize = samples.iter().map(|s| s.tokens).sum();
            let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
            let mut itl: Vec<f64> = samples.iter().flat_map(|s| s.gaps.iter().copied()).collect();
            let r = json!({"concurrency": conc, "requests": n, "total_s": total, "requests_s": n as f64 / total,
                "output_tok_s": tokens as f64 / total, "ttft_p50_s": percentile(&mut ttft, 0.5), "ttft_p99_s": percentile(&mut ttft, 0.99),
                "itl_p50_s": percentile(&mut itl, 0.5), "itl_p99_s": percentile(&mut itl, 0.99)});
            let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
            println!(
                "{:>6} {:>8} {:>9.2} {:>8.2} {:>10.1} {:>8.0}ms {:>8.0}ms {:>7.1}ms {:>7.1}ms",
                conc, n, total, f("requests_s"), f("output_tok_s"), f("ttft_p50_s") * 1e3, f("ttft_p99_s") * 1e3,
                f("itl_p50_s") * 1e3, f("itl_p99_s") * 1e3
            );
            runs.push(r);
        }
        if let Some(path) = &args.json {
            let doc = json!({"url": url, "model": model, "runs": runs});
            std::fs::write(path, serde_json::to_string_pretty(&doc)?).with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {}", path.display());
        }
        Ok(())
    })
}
