//! `weft serve`: the command line of the HTTP server.

use super::EngineArgs;
use crate::server::kv_events::KvEventsConfig;
use crate::server::ServerConfig;
use anyhow::Result;
use clap::Args;
use std::time::Duration;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on API routes.
    #[arg(long, env = "WEFT_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest request body, bytes (or 512K, 4M).
    #[arg(long, default_value = "4M", value_parser = super::parse_bytes)]
    pub max_body_bytes: usize,
    /// Most prompts one /generate/batch call may carry.
    #[arg(long, default_value_t = 64)]
    pub max_batch_prompts: usize,
    /// Abort requests running longer than this many seconds (0: never).
    #[arg(long, default_value = "0", value_parser = super::parse_seconds)]
    pub request_timeout: Duration,
    /// On SIGTERM/Ctrl-C, how long in-flight requests may take to finish, seconds.
    #[arg(long, default_value = "30", value_parser = super::parse_seconds)]
    pub shutdown_grace: Duration,
    /// Close a connection whose request headers (or, between requests, whose next
    /// request) do not arrive within this many seconds.
    #[arg(long, default_value = "10", value_parser = super::parse_seconds)]
    pub header_read_timeout: Duration,
    /// Open connections at most; beyond it new ones wait in the listen backlog.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Publish the prefix cache's block events for KV-aware routers, as vLLM's JSON:
    /// `{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
    /// "replay_endpoint":"tcp://*:5558","topic":"","buffer_steps":10000,"max_queue_size":100000}`.
    #[arg(long, value_name = "JSON")]
    pub kv_events_config: Option<KvEventsConfig>,
}

/// Starts the server with the engine these arguments describe.
pub fn run(args: ServeArgs) -> Result<()> {
    let config = ServerConfig {
        host: args.host,
        port: args.port,
        api_key: args.api_key,
        max_body_bytes: args.max_body_bytes,
        max_batch_prompts: args.max_batch_prompts,
        request_timeout: (!args.request_timeout.is_zero()).then_some(args.request_timeout),
        shutdown_grace: args.shutdown_grace,
        header_read_timeout: args.header_read_timeout,
        max_connections: args.max_connections,
        kv_events: args.kv_events_config.filter(KvEventsConfig::enabled),
    };
    let queue = config.kv_events.as_ref().map(|c| c.max_queue_size);
    let engine = args.engine;
    crate::server::run(
        config,
        Box::new(move |observer| {
            let loaded = engine.load()?;
            let config = crate::engine::EngineConfig { kv_events: queue, ..engine.config() };
            crate::engine::EngineHandle::start_observed(std::sync::Arc::new(loaded), config, observer)
        }),
    )
}
