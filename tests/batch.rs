//! `weft batch` end to end: OpenAI batch lines and plain prompts in, one record per line out
//! (blank lines too), in order; bad lines become error records.

mod common;

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

/// Runs `weft batch` on stories260k over `lines`: the command's output and the records.
fn run_batch(models: &Path, name: &str, lines: &[String], args: &[&str], env: &[(&str, &str)]) -> (Output, Vec<Value>) {
    let dir = tempfile::Builder::new().prefix(&format!("weft-batch-{name}")).tempdir().unwrap();
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["batch", "--model"])
        .arg(models.join("stories260k"))
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let records = std::fs::read_to_string(&output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (out, records)
}

#[test]
fn batch_job_writes_one_record_per_line_in_order() {
    let Some(models) = common::shared_models() else {
        return;
    };
    let mut lines = vec![
        r#"{"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "ignore_eos": true}}"#.to_string(),
        r#"{"prompt": ["Tom and Lily", "The dog"], "max_tokens": 4, "n": 2, "seed": 3, "stop": ["zzz"]}"#.into(),
        "{not json".into(),
        r#"{"custom_id": "chat", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}}"#.into(),
        r#"{"custom_id": "bad", "body": {"prompt": "x", "temperature": "hot"}}"#.into(),
        r#"{"custom_id": "url", "url": "/v1/embeddings", "body": {"input": "x"}}"#.into(),
        "   ".into(),
    ];
    for i in 0..40 {
        lines.push(format!(r#"{{"custom_id": "many-{i}", "body": {{"prompt": "One day", "max_tokens": {}, "temperature": 0.8, "seed": {i}}}}}"#, 1 + i % 7));
    }
    lines.push(String::new());
    let (out, records) = run_batch(&models, "ok", &lines, &["--max-waiting-requests", "8"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Where the job's time went: steps with prompt rows, and decode-only steps.
    assert!(stderr.contains("steps with prompt rows") && stderr.contains("decode-only steps"), "{stderr}");
    assert_eq!(records.len(), lines.len());
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r["id"], format!("batch_req_{i}"));
    }
    let first = &records[0]["response"];
    assert_eq!(first["status_code"], 200);
    assert_eq!(records[0]["custom_id"], "c1");
    let reference = common::reference("stories260k");
    assert_eq!(first["body"]["choices"][0]["text"], reference[1].generated_text_delta.as_str());
    assert_eq!(first["body"]["usage"]["completion_tokens"], 32);
    assert_eq!(records[1]["response"]["body"]["choices"].as_array().unwrap().len(), 4, "2 prompts x n=2");
    assert_eq!(records[2]["error"]["code"], "invalid_json");
    assert_eq!(records[3]["response"]["status_code"], 400, "stories260k has no chat template");
    let bad = &records[4]["response"]["body"]["error"];
    assert_eq!((bad["param"].as_str(), bad["type"].as_str()), (Some("temperature"), Some("invalid_request_error")));
    assert_eq!(records[5]["error"]["code"], "invalid_url");
    assert_eq!(records[6]["error"]["code"], "invalid_line", "a blank line still gets its record");
    assert_eq!(records.last().unwrap()["error"]["code"], "invalid_line");
    for r in &records[7..records.len() - 1] {
        assert_eq!(r["response"]["status_code"], 200, "queued lines wait for room instead of failing: {r}");
    }
}

/// A line the engine fails (a step panic injected in this test build) is reported as a
/// failure, never a success, and the job exits non-zero; every line still has its record.
#[test]
fn batch_job_reports_engine_failures_and_exits_non_zero() {
    let Some(models) = common::shared_models() else {
        return;
    };
    let poison = vec![r#"{"prompt": [300, 300, 300, 4], "max_tokens": 3}"#.to_string()];
    let (out, records) = run_batch(&models, "fail", &poison, &[], &[("WEFT_FAULT_PANIC_TOKEN", "300")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("0 succeeded") && stderr.contains("1 failed in the engine"), "{stderr}");
    assert_eq!(records[0]["response"]["status_code"], 500, "{}", records[0]);
}
