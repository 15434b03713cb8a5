//! `weft batch`: an offline job in the OpenAI batch format. Every line enters the
//! continuous-batching engine at once (waiting for room when the queue is full); results are
//! written one line per input line, in input order, each `body` exactly what the HTTP API
//! returns for that request. A bad line becomes an error record, never a crash.

use super::EngineArgs;
use crate::api::openai::{chat_completions, completions, ChatRequest, CompletionRequest};
use crate::api::ApiError;
use crate::engine::EngineHandle;
use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::io::{BufRead, BufWriter, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct BatchArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// JSONL input: OpenAI batch lines ({custom_id, method, url, body}) or {"prompt": ...}.
    #[arg(long)]
    pub input: PathBuf,
    /// JSONL output: one result per input line, in order.
    #[arg(long)]
    pub output: PathBuf,
}

pub fn run(args: BatchArgs) -> Result<()> {
    let open = || std::fs::File::open(&args.input).with_context(|| format!("opening {}", args.input.display()));
    // One cheap pass for the progress bar's length; the job itself streams the file.
    let total = std::io::BufReader::new(open()?).split(b'\n').count();
    let engine = args.engine.start()?;
    let out = std::fs::File::create(&args.output).with_context(|| format!("creating {}", args.output.display()))?;
    let mut out = BufWriter::new(out);
    let bar = ProgressBar::new(total as u64);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} requests, {msg}, ETA {eta}")?);
    let start = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_time().build()?;
    // Lines in flight or done but not yet written, at most: enough to keep the engine's
    // queue full, few enough that memory stays bounded whatever the file's length.
    let window = engine.config().max_waiting_requests.max(1);
    let (ok, client_errors, server_errors) = rt.block_on(async {
        let mut pending: VecDeque<tokio::task::JoinHandle<Value>> = VecDeque::with_capacity(window);
        let mut counts = (0usize, 0usize, 0usize);
        let mut write = |record: Value, counts: &mut (usize, usize, usize)| -> Result<()> {
            let status = record["response"]["status_code"].as_u64().unwrap_or(0);
            match (record["error"].is_null(), status) {
                (true, 200) => counts.0 += 1,
                (true, 500..) => counts.2 += 1,
                _ => counts.1 += 1,
            }
            serde_json::to_writer(&mut out, &record)?;
            out.write_all(b"\n")?;
            let tokens = engine.stats().generation_tokens_total;
            bar.set_message(format!("{:.1} tokens/s", tokens as f64 / start.elapsed().as_secs_f64()));
            bar.inc(1);
            Ok(())
        };
        for (i, line) in std::io::BufReader::new(open()?).split(b'\n').enumerate() {
            if pending.len() >= window {
                let head = pending.pop_front().expect("window is not empty");
                write(head.await?, &mut counts)?;
            }
            let line = line
                .map_err(|e| e.to_string())
                .and_then(|b| String::from_utf8(b).map_err(|_| "line is not valid UTF-8".into()));
            let engine = engine.clone();
            pending.push_back(tokio::spawn(async move { process_line(&engine, i, line).await }));
        }
        while let Some(head) = pending.pop_front() {
            write(head.await?, &mut counts)?;
        }
        anyhow::Ok(counts)
    })?;
    out.flush()?;
    bar.finish();
    let st = engine.stats();
    eprintln!(
        "weft: {ok} succeeded, {client_errors} refused as invalid, {server_errors} failed in the engine, in {:.1} s; {} prompt and {} generated tokens ({:.1} generated tokens/s); wrote {}",
        start.elapsed().as_secs_f64(),
        st.prompt_tokens_total,
        st.generation_tokens_total,
        st.generation_tokens_total as f64 / start.elapsed().as_secs_f64(),
        args.output.display()
    );
    eprintln!("weft: forward {:.1} s; {}", st.forward_time.as_secs_f64(), st.step_mix.summary());
    anyhow::ensure!(server_errors == 0, "{server_errors} lines failed inside the engine (see their records)");
    Ok(())
}

/// The output record for one input line.
async fn process_line(engine: &EngineHandle, i: usize, line: Result<String, String>) -> Value {
    let id = format!("batch_req_{i}");
    let fail = |custom_id: Value, code: &str, message: String| json!({"id": id, "custom_id": custom_id, "response": null, "error": {"code": code, "message": message}});
    let line = match line {
        Ok(l) if l.trim().is_empty() => return fail(Value::Null, "invalid_line", "the line is empty".into()),
        Ok(l) => l,
        Err(e) => return fail(Value::Null, "invalid_line", e),
    };
    let mut obj = match serde_json::from_str::<Value>(&line) {
        Ok(Value::Object(o)) => o,
        Ok(_) => return fail(Value::Null, "invalid_json", "each line must be a JSON object".into()),
        Err(e) => return fail(Value::Null, "invalid_json", format!("line is not JSON: {e}")),
    };
    let custom_id = obj.remove("custom_id").unwrap_or(Value::Null);
    let (url, body) = if let Some(body) = obj.remove("body") {
        if let Some(k) = obj.keys().find(|k| !["method", "url"].contains(&k.as_str())) {
            return fail(custom_id, "invalid_request", format!("unknown field `{k}`"));
        }
        if obj.get("method").and_then(Value::as_str).is_some_and(|m| m != "POST") {
            return fail(custom_id, "invalid_request", "method must be POST".into());
        }
        let url = obj.get("url").and_then(Value::as_str).unwrap_or("/v1/completions").to_owned();
        (url, body)
    } else if obj.contains_key("prompt") {
        ("/v1/completions".to_owned(), Value::Object(obj))
    } else {
        return fail(custom_id, "invalid_request", "a line needs `body` (OpenAI batch format) or `prompt`".into());
    };
    let request_id = format!("{}-{i}", if url.contains("chat") { "chatcmpl" } else { "cmpl" });
    let result = loop {
        let r = match url.as_str() {
            "/v1/completions" => match CompletionRequest::parse(body.clone()) {
                Ok(req) if req.gen.streaming() => {
                    Err(ApiError::invalid("stream is not supported in batch jobs", Some("stream")))
                }
                Ok(req) => completions(engine, &req, &request_id).await,
                Err(e) => Err(e),
            },
            "/v1/chat/completions" => match ChatRequest::parse(body.clone()) {
                Ok(req) if req.gen.streaming() => {
                    Err(ApiError::invalid("stream is not supported in batch jobs", Some("stream")))
                }
                Ok(req) => chat_completions(engine, &req, &request_id).await,
                Err(e) => Err(e),
            },
            other => {
                return fail(
                    custom_id,
                    "invalid_url",
                    format!("url {other:?} is not /v1/completions or /v1/chat/completions"),
                )
            }
        };
        match r {
            // The queue is full: wait for room rather than fail the line.
            Err(e) if e.status == 429 => tokio::time::sleep(Duration::from_millis(20)).await,
            r => break r,
        }
    };
    let (status, body) = match result {
        Ok(body) => (200, body),
        Err(e) => (e.status, e.body()),
    };
    json!({"id": id, "custom_id": custom_id, "response": {"status_code": status, "request_id": request_id, "body": body}, "error": null})
}
