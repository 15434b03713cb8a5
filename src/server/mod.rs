//! `weft serve`: the engine behind an HTTP API — OpenAI-compatible completions and chat
//! (with SSE streaming), the native `/generate` and `/generate/batch`, tokenization, health,
//! Prometheus metrics and an OpenAPI document. axum + tokio on the async side; the engine
//! stays on its own thread behind its [`EngineHandle`].

mod accept;
mod body;
pub mod kv_events;
mod messages;
mod metrics;
mod openapi;
mod responses;
mod routes;
mod stream;

use crate::engine::{EngineHandle, Observer};
use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::watch;

use self::accept::ConnLimits;
pub use self::metrics::Metrics;
use sha2::Digest;

/// How the server listens and what it allows: plain values, so that whatever starts the
/// server (the command line, a test) decides where they come from.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    /// 0: any free port, printed at start.
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on API routes.
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// Most prompts one /generate/batch call may carry.
    pub max_batch_prompts: usize,
    /// Abort requests running longer than this.
    pub request_timeout: Option<Duration>,
    /// On SIGTERM/Ctrl-C, how long in-flight requests may take to finish.
    pub shutdown_grace: Duration,
    /// Close a connection whose request headers (or next request) take longer.
    pub header_read_timeout: Duration,
    /// Open connections at most; beyond it new ones wait in the listen backlog.
    pub max_connections: usize,
    /// Publish the prefix cache's events for KV-aware routers (the engine must have been
    /// started with a KV-event queue).
    pub kv_events: Option<kv_events::KvEventsConfig>,
}

/// Loads the model and starts the engine, reporting to the observer it is given; run off
/// the async workers while `/health` answers 503.
pub type EngineStarter = Box<dyn FnOnce(Arc<dyn Observer>) -> Result<EngineHandle> + Send>;

/// What every handler sees.
pub struct AppState {
    /// Set once the model is loaded and a warm-up step has run.
    engine: OnceLock<EngineHandle>,
    metrics: Arc<Metrics>,
    shutting_down: AtomicBool,
    /// SHA-256 of `--api-key`, compared in constant time.
    api_key: Option<[u8; 32]>,
    max_batch_prompts: usize,
    /// Largest request body, bytes.
    max_body_bytes: usize,
    request_timeout: Option<Duration>,
    /// Turns true when the shutdown grace is over.
    grace_over: watch::Receiver<bool>,
    /// Responses kept for `previous_response_id`.
    responses: crate::api::responses::store::Store,
}

impl AppState {
    fn engine(&self) -> Result<&EngineHandle, crate::api::ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(crate::api::ApiError::unavailable("the server is shutting down"));
        }
        let engine =
            self.engine.get().ok_or_else(|| crate::api::ApiError::unavailable("the model is still loading"))?;
        if !engine.is_alive() {
            return Err(crate::api::ApiError::unavailable("the engine is down"));
        }
        Ok(engine)
    }

    fn stream_ctx(&self) -> stream::Ctx {
        stream::Ctx { timeout: self.request_timeout, grace_over: self.grace_over.clone() }
    }
}

/// Runs the server until SIGTERM/Ctrl-C, then drains within the grace period; `start`
/// brings up the engine once the socket listens.
pub fn run(args: ServerConfig, start: EngineStarter) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", args.host, args.port).parse().context("bad --host/--port")?;
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        let (grace_tx, grace_over) = watch::channel(false);
        let state = Arc::new(AppState {
            engine: OnceLock::new(),
            metrics: Arc::new(Metrics::new()?),
            shutting_down: AtomicBool::new(false),
            api_key: args.api_key.as_deref().map(|k| sha2::Sha256::digest(k.as_bytes()).into()),
            max_batch_prompts: args.max_batch_prompts,
            max_body_bytes: args.max_body_bytes,
            request_timeout: args.request_timeout,
            grace_over,
            responses: Default::default(),
        });
        eprintln!("weft: listening on http://{local}");
        let publisher = match &args.kv_events {
            Some(cfg) => Some(kv_events::Publisher::bind(cfg).await?),
            None => None,
        };
        // Load and warm up in the background so /health can say 503 meanwhile.
        let loader = state.clone();
        let runtime = tokio::runtime::Handle::current();
        let load = tokio::task::spawn_blocking(move || -> Result<()> {
            let engine = start(loader.metrics.clone())?;
            if let (Some(publisher), Some(events)) = (publisher, engine.kv_events()) {
                runtime.spawn(publisher.run(events, engine.config().block_size));
            }
            warm_up(&engine)?;
            // The warm-up request is not traffic: metrics start counting from here.
            let config = engine.config();
            let cache = metrics::CacheInfo {
                block_size: config.block_size,
                dtype: engine.model().model.kv_dtype(config.kv_cache_dtype),
                prefix_caching: config.prefix_caching,
            };
            // What the cache holds, as vLLM says at start: a big model's 1 GiB default is a few
            // thousand tokens.
            let per_token = crate::kv::KvCache::bytes_per_block(cache.dtype, &engine.model().model.config.kv_shapes(), 1);
            loader.metrics.start(&engine.stats(), cache);
            eprintln!(
                "weft: the KV cache holds {} tokens ({:.1} KB a token; --kv-cache-memory), {} sequences at once at most",
                engine.capacity_tokens(),
                per_token as f64 / 1e3,
                config.max_num_seqs
            );
            let _ = loader.engine.set(engine);
            eprintln!("weft: ready");
            Ok(())
        });
        let watch_state = state.clone();
        tokio::spawn(async move {
            match load.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    eprintln!("weft: error: {e:#}");
                    std::process::exit(1);
                }
                Err(e) => {
                    eprintln!("weft: error: model loading panicked: {e}");
                    std::process::exit(1);
                }
            }
            // The engine restarts itself after a failed step; if its thread ever ends
            // anyway, exit non-zero so a supervisor starts a fresh process.
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let dead = watch_state.engine.get().is_some_and(|e| !e.is_alive());
                if dead && !watch_state.shutting_down.load(Ordering::SeqCst) {
                    eprintln!("weft: error: the engine thread ended; exiting");
                    std::process::exit(1);
                }
            }
        });
        let app = routes::router(state.clone());
        let grace = args.shutdown_grace;
        let limits = ConnLimits {
            header_read_timeout: args.header_read_timeout.max(Duration::from_millis(100)),
            max_connections: args.max_connections.max(1),
        };
        let (stop_tx, stop_rx) = watch::channel(false);
        let shutdown_state = state.clone();
        tokio::spawn(async move {
            shutdown_signal().await;
            eprintln!("weft: shutting down; in-flight requests have {:.0} s to finish", grace.as_secs_f64());
            shutdown_state.shutting_down.store(true, Ordering::SeqCst);
            let _ = stop_tx.send(true);
        });
        let mut grace_stop = stop_rx.clone();
        let server = tokio::spawn(accept::serve(listener, app, limits, stop_rx));
        tokio::select! {
            r = server => r??,
            _ = async {
                let _ = grace_stop.wait_for(|s| *s).await;
                tokio::time::sleep(grace).await;
            } => {
                eprintln!("weft: grace period over; ending the remaining streams");
                let _ = grace_tx.send(true);
                // Let the streams write their error event before the process ends.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(())
    })
}

/// One tiny request through the whole engine, so the first real one pays no start-up cost.
fn warm_up(engine: &EngineHandle) -> Result<()> {
    let tok = &engine.model().tokenizer;
    let mut prompt = tok.encode("Hello")?;
    if prompt.is_empty() {
        prompt = vec![tok.bos_id.unwrap_or(0)];
    }
    let mut stream = engine.submit(crate::engine::Request::new(prompt, 1))?;
    while stream.blocking_recv().is_some() {}
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
