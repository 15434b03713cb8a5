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
    let file = std::fs::File::open(&args.input).with_context(|| format!("opening {}", args.input.display()))?;
    let lines: Vec<Result<String, String>> = std::io::BufReader::new(file)
        .split(b'\n')
        .map(|l| {
            l.map_err(|e| e.to_string())
                .and_then(|b| String::from_utf8(b).map_err(|_| "line is not valid UTF-8".into()))
        })
        .filter(|l| l.as_ref().map_or(true, |s| !s.trim().is_empty()))
        .collect();
    let engine = args.engine.start()?;
    let out = std::fs::File::create(&args.output).with_context(|| format!("creating {}", args.output.display()))?;
    let mut out = BufWriter::new(out);
    let bar = ProgressBar::new(lines.len() as u64);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} requests, {msg}, ETA {eta}")?);
    let start = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_time().build()?;
    let (ok, failed) = rt.block_on(async {
        let tasks: Vec<_> = lines
            .into_iter()
            .enumerate()
            .map(|(i, line)| {
                let engine = engine.clone();
                tokio::spawn(async move { process_line(&engine, i, line).await })
            })
            .collect();
        let (mut ok, mut failed) = (0, 0);
        for t in tasks {
            let record = t.await?;
            if record["error"].is_null() && record["response"]["status_code"] == 200 {
                ok += 1;
            } else {
                failed += 1;
            }
            serde_json::to_writer(&mut out, &record)?;
            out.write_all(b"\n")?;
            let tokens = engine.stats().generation_tokens_total;
            bar.set_message(format!("{:.1} tokens/s", tokens as f64 / start.elapsed().as_secs_f64()));
            bar.inc(1);
        }
        anyhow::Ok((ok, failed))
    })?;
    out.flush()?;
    bar.finish();
    let st = engine.stats();
    eprintln!(
        "weft: {ok} succeeded, {failed} failed in {:.1} s; {} prompt and {} generated tokens ({:.1} generated tokens/s); wrote {}",
        start.elapsed().as_secs_f64(),
        st.prompt_tokens_total,
        st.generation_tokens_total,
        st.generation_tokens_total as f64 / start.elapsed().as_secs_f64(),
        args.output.display()
    );
    Ok(())
}

/// The output record for one input line.
async fn process_line(engine: &EngineHandle, i: usize, line: Result<String, String>) -> Value {
    let id = format!("batch_req_{i}");
    let fail = |custom_id: Value, code: &str, message: String| json!({"id": id, "custom_id": custom_id, "response": null, "error": {"code": code, "message": message}});
    let line = match line {
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
