//! Prometheus metrics under vLLM's names with a `weft:` prefix, so existing dashboards
//! work; the four a gateway's endpoint picker reads by default (llm-d, the Gateway API
//! Inference Extension) also under vLLM's own `vllm:` prefix, with vLLM's meaning (weft's KV
//! pool counts as the "GPU" blocks), so routers need no configuration. Latencies and step
//! sizes come from the engine's [`Observer`] hook; gauges and totals are read from the
//! engine's stats at scrape time. Each server has its own
//! recorder (no process-global state), rendered by the Prometheus exporter.

use crate::engine::{EngineStats, FinishReason, Observer};
use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use std::time::Duration;

const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const STEP_BUCKETS: &[f64] =
    &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0];

pub struct Metrics {
    /// Engine totals at the moment serving began (after the warm-up request), subtracted
    /// from what the engine reports; observations before then are ignored.
    baseline: std::sync::OnceLock<EngineStats>,
    recorder: PrometheusRecorder,
    engine_failures: Counter,
    handle: PrometheusHandle,
    running: Gauge,
    waiting: Gauge,
    preparing: Gauge,
    kv_usage: Gauge,
    /// The same three under vLLM's own names.
    vllm: [Gauge; 3],
    kv_cached: Gauge,
    /// A hybrid model's recurrent state: slots held / slots, bytes per sequence, snapshots.
    state_usage: Gauge,
    state_bytes: Gauge,
    state_snapshots: Gauge,
    kv_events_dropped: Counter,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    preemptions: Counter,
    prefix_queries: Counter,
    prefix_hits: Counter,
    spec_drafts: Counter,
    spec_draft_tokens: Counter,
    spec_accepted_tokens: Counter,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    step_tokens: Histogram,
    step_seqs: Histogram,
    step_time: Histogram,
}

/// The KV cache as `vllm:cache_config_info` describes it.
pub struct CacheInfo {
    pub block_size: usize,
    pub dtype: crate::kv::KvDtype,
    pub prefix_caching: bool,
}

static META: Metadata<'static> = Metadata::new("weft", Level::INFO, None);

impl Metrics {
    pub fn new() -> anyhow::Result<Self> {
        let mut b = PrometheusBuilder::new();
        for name in [
            "weft:time_to_first_token_seconds",
            "weft:inter_token_latency_seconds",
            "weft:e2e_request_latency_seconds",
            "weft:step_duration_seconds",
        ] {
            b = b.set_buckets_for_metric(Matcher::Full(name.into()), LATENCY_BUCKETS)?;
        }
        b = b.set_buckets_for_metric(Matcher::Prefix("weft:iteration_".into()), STEP_BUCKETS)?;
        let recorder = b.build_recorder();
        let handle = recorder.handle();
        let describe = |name: &'static str, unit: Option<Unit>, help: &'static str| {
            recorder.describe_counter(name.into(), unit, SharedString::const_str(help));
        };
        recorder.describe_gauge(
            "weft:num_requests_preparing".into(),
            None,
            SharedString::const_str("Requests being tokenized or rendered, before the engine."),
        );
        describe("weft:prompt_tokens_total", Some(Unit::Count), "Prompt tokens processed.");
        describe("weft:generation_tokens_total", Some(Unit::Count), "Tokens generated.");
        describe("weft:num_preemptions_total", Some(Unit::Count), "Sequences preempted for lack of KV blocks.");
        describe("weft:prefix_cache_queries_total", Some(Unit::Count), "Prompt tokens looked up in the prefix cache.");
        describe("weft:prefix_cache_hits_total", Some(Unit::Count), "Prompt tokens found in the prefix cache.");
        describe("weft:spec_decode_num_drafts_total", Some(Unit::Count), "Drafts verified by speculative decoding.");
        describe("weft:spec_decode_num_draft_tokens_total", Some(Unit::Count), "Draft tokens verified.");
        describe("weft:spec_decode_num_accepted_tokens_total", Some(Unit::Count), "Draft tokens accepted.");
        describe(
            "weft:kv_events_dropped_total",
            Some(Unit::Count),
            "KV events dropped because their queue was full; a snapshot of the cache followed.",
        );
        recorder.describe_gauge(
            "weft:kv_cache_blocks_cached".into(),
            None,
            SharedString::const_str("Full KV blocks in the prefix cache, in use or idle."),
        );
        for (name, help) in [
            ("weft:state_cache_usage_perc", "Recurrent-state slots held by running sequences, of all (hybrid models)."),
            ("weft:state_cache_bytes_per_sequence", "Bytes of one sequence's recurrent state (hybrid models)."),
            ("weft:state_cache_snapshots", "Recurrent-state snapshots the prefix cache holds (hybrid models)."),
        ] {
            recorder.describe_gauge(name.into(), None, SharedString::const_str(help));
        }
        describe("weft:request_success_total", Some(Unit::Count), "Finished samples, by finish reason.");
        describe(
            "weft:engine_failures_total",
            Some(Unit::Count),
            "Engine steps that failed; their requests got errors and the engine restarted.",
        );
        let g = |n: &'static str| recorder.register_gauge(&Key::from_static_name(n), &META);
        let c = |n: &'static str| recorder.register_counter(&Key::from_static_name(n), &META);
        let h = |n: &'static str| recorder.register_histogram(&Key::from_static_name(n), &META);
        Ok(Metrics {
            baseline: std::sync::OnceLock::new(),
            engine_failures: c("weft:engine_failures_total"),
            running: g("weft:num_requests_running"),
            waiting: g("weft:num_requests_waiting"),
            preparing: g("weft:num_requests_preparing"),
            kv_usage: g("weft:kv_cache_usage_perc"),
            vllm: [g("vllm:num_requests_running"), g("vllm:num_requests_waiting"), g("vllm:kv_cache_usage_perc")],
            kv_cached: g("weft:kv_cache_blocks_cached"),
            state_usage: g("weft:state_cache_usage_perc"),
            state_bytes: g("weft:state_cache_bytes_per_sequence"),
            state_snapshots: g("weft:state_cache_snapshots"),
            kv_events_dropped: c("weft:kv_events_dropped_total"),
            prompt_tokens: c("weft:prompt_tokens_total"),
            generation_tokens: c("weft:generation_tokens_total"),
            preemptions: c("weft:num_preemptions_total"),
            prefix_queries: c("weft:prefix_cache_queries_total"),
            prefix_hits: c("weft:prefix_cache_hits_total"),
            spec_drafts: c("weft:spec_decode_num_drafts_total"),
            spec_draft_tokens: c("weft:spec_decode_num_draft_tokens_total"),
            spec_accepted_tokens: c("weft:spec_decode_num_accepted_tokens_total"),
            ttft: h("weft:time_to_first_token_seconds"),
            itl: h("weft:inter_token_latency_seconds"),
            e2e: h("weft:e2e_request_latency_seconds"),
            step_tokens: h("weft:iteration_tokens_total"),
            step_seqs: h("weft:iteration_batch_size"),
            step_time: h("weft:step_duration_seconds"),
            handle,
            recorder,
        })
    }

    /// Starts counting: totals so far (the warm-up) are left out. `cache` is the KV cache's
    /// shape, published once as vLLM's `cache_config_info`.
    pub fn start(&self, stats: &EngineStats, cache: CacheInfo) {
        let _ = self.baseline.set(stats.clone());
        let labels = vec![
            Label::new("block_size", cache.block_size.to_string()),
            Label::new("num_gpu_blocks", stats.kv_blocks_total.to_string()),
            Label::new("num_cpu_blocks", "0"),
            Label::new("cache_dtype", cache.dtype.to_string()),
            Label::new("enable_prefix_caching", if cache.prefix_caching { "True" } else { "False" }),
        ];
        let key = Key::from_parts("vllm:cache_config_info", labels);
        self.recorder.register_gauge(&key, &META).set(1.0);
    }

    fn live(&self) -> bool {
        self.baseline.get().is_some()
    }

    /// The Prometheus text exposition, with gauges and totals taken from `stats` now.
    pub fn render(&self, stats: &EngineStats) -> String {
        let base = self.baseline.get().cloned().unwrap_or_default();
        self.running.set(stats.running as f64);
        self.waiting.set(stats.waiting as f64);
        self.preparing.set(crate::api::preparing() as f64);
        let usage = stats.kv_blocks_used as f64 / stats.kv_blocks_total.max(1) as f64;
        self.kv_usage.set(usage);
        for (g, x) in self.vllm.iter().zip([stats.running as f64, stats.waiting as f64, usage]) {
            g.set(x);
        }
        self.kv_cached.set(stats.kv_blocks_cached as f64);
        self.state_usage.set(stats.state_slots_used as f64 / stats.state_slots_total.max(1) as f64);
        self.state_bytes.set(stats.state_bytes_per_seq as f64);
        self.state_snapshots.set(stats.state_snapshots as f64);
        self.kv_events_dropped.absolute(stats.kv_events_dropped);
        self.prompt_tokens.absolute(stats.prompt_tokens_total.saturating_sub(base.prompt_tokens_total));
        self.generation_tokens.absolute(stats.generation_tokens_total.saturating_sub(base.generation_tokens_total));
        self.preemptions.absolute(stats.preemptions.saturating_sub(base.preemptions));
        self.prefix_queries.absolute(stats.prefix_cache_queries.saturating_sub(base.prefix_cache_queries));
        self.prefix_hits.absolute(stats.prefix_cache_hits.saturating_sub(base.prefix_cache_hits));
        self.spec_drafts.absolute(stats.spec_drafts.saturating_sub(base.spec_drafts));
        self.spec_draft_tokens.absolute(stats.spec_draft_tokens.saturating_sub(base.spec_draft_tokens));
        self.spec_accepted_tokens.absolute(stats.spec_accepted_tokens.saturating_sub(base.spec_accepted_tokens));
        self.engine_failures.absolute(stats.engine_failures.saturating_sub(base.engine_failures));
        self.handle.render()
    }
}

impl Observer for Metrics {
    fn step(&self, tokens: usize, seqs: usize, time: Duration) {
        if self.live() {
            self.step_tokens.record(tokens as f64);
            self.step_seqs.record(seqs as f64);
            self.step_time.record(time.as_secs_f64());
        }
    }
    fn first_token(&self, ttft: Duration) {
        if self.live() {
            self.ttft.record(ttft.as_secs_f64());
        }
    }
    fn token(&self, gap: Duration) {
        if self.live() {
            self.itl.record(gap.as_secs_f64());
        }
    }
    fn finished(&self, reason: FinishReason, e2e: Duration) {
        if !self.live() {
            return;
        }
        self.e2e.record(e2e.as_secs_f64());
        let key = Key::from_parts("weft:request_success_total", vec![Label::new("finished_reason", reason.as_str())]);
        self.recorder.register_counter(&key, &META).increment(1);
    }
}
