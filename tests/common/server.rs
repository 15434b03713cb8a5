//! The real `weft serve` on a free loopback port, for integration tests over HTTP.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Server {
    pub child: Child,
    pub base: String,
    pub http: reqwest::Client,
}

impl Server {
    /// Starts `weft serve` on port 0 and waits until /health says ready.
    pub async fn start(model: &str, extra: &[&str]) -> Server {
        Self::start_with_env(model, extra, &[]).await
    }

    /// Like [`Server::start`], with extra environment variables.
    pub async fn start_with_env(model: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let path = super::fixture(model).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_weft"));
        cmd.args(["serve", "--port", "0", "--model"]).arg(path);
        if !extra.contains(&"--kv-cache-memory") {
            cmd.args(["--kv-cache-memory", "256M"]);
        }
        let mut child = cmd.args(extra).envs(env.iter().copied()).stderr(Stdio::piped()).spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("weft: listening on ") {
                    let _ = tx.send(addr.to_string());
                }
                // Into the test's captured output, shown when it fails (an engine panic
                // behind a 500, say).
                eprintln!("server: {line}");
            }
        });
        let base = rx.recv_timeout(Duration::from_secs(30)).expect("server printed its address");
        let s = Server { child, base, http: reqwest::Client::new() };
        let deadline = Instant::now() + Duration::from_secs(60);
        while s.get("/health").await.0 != 200 {
            assert!(Instant::now() < deadline, "server never became healthy");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        s
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        match self.http.get(format!("{}{path}", self.base)).send().await {
            Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
            Err(_) => (0, String::new()),
        }
    }

    /// Status and JSON body; status 0 when the connection itself is refused.
    pub async fn post_raw(&self, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let Ok(r) = self.http.post(format!("{}{path}", self.base)).body(body).send().await else {
            return (0, Value::Null);
        };
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.post_raw(path, body.to_string()).await
    }

    /// A streaming request: the `data:` payloads in order (the last is `[DONE]`).
    pub async fn stream(&self, path: &str, body: Value) -> Vec<String> {
        let r = self.http.post(format!("{}{path}", self.base)).body(body.to_string()).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        text.lines().filter_map(|l| l.strip_prefix("data: ").map(str::to_owned)).collect()
    }

    /// A greedy chat request whose `regex` makes the model write a reasoning and an answer
    /// of 3 to 8 lowercase letters each: the (reasoning_content, content) it gets whole,
    /// checked to be those words and to equal the same request's streamed deltas.
    pub async fn chat_reasoning_apart(&self, regex: &str) -> (String, String) {
        let ask = serde_json::json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
            "temperature": 0, "guided_regex": regex});
        let (st, whole) = self.post("/v1/chat/completions", ask.clone()).await;
        assert_eq!(st, 200, "{whole}");
        assert_eq!(whole["choices"][0]["finish_reason"], "stop", "{whole}");
        let message = &whole["choices"][0]["message"];
        let word = |v: &Value| {
            let w = v.as_str().unwrap_or_default().to_owned();
            assert!((3..=8).contains(&w.len()) && w.chars().all(|c| c.is_ascii_lowercase()), "{whole}");
            w
        };
        let apart = (word(&message["reasoning_content"]), word(&message["content"]));
        let mut streamed = ask;
        streamed["stream"] = serde_json::json!(true);
        let events = self.stream("/v1/chat/completions", streamed).await;
        let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        let joined = |key: &str| -> String {
            chunks.iter().map(|c| c["choices"][0]["delta"][key].as_str().unwrap_or("").to_owned()).collect()
        };
        assert_eq!((joined("reasoning_content"), joined("content")), apart);
        apart
    }

    pub async fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }

    /// Waits until a metric reads `want`.
    pub async fn wait_metric(&self, name: &str, want: f64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.metric(name).await != want {
            assert!(Instant::now() < deadline, "{name} never reached {want}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until nothing runs and every KV block is free.
    pub async fn assert_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let running = self.metric("weft:num_requests_running ").await;
            let kv = self.metric("weft:kv_cache_usage_perc ").await;
            if running == 0.0 && kv == 0.0 {
                return;
            }
            assert!(Instant::now() < deadline, "still running {running}, kv usage {kv}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
