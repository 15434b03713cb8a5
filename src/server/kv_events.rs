//! The prefix cache's events for KV-aware routers (Dynamo, llm-d), on vLLM's wire: a ZMQ
//! PUB socket sends `[topic, 8-byte big-endian sequence number, msgpack payload]`, the
//! payload `[timestamp, [events...], data_parallel_rank]`; an optional ROUTER socket replays
//! the last `buffer_steps` batches from a sequence number a subscriber asks for, then sends
//! sequence −1. The engine never waits for this: its batches come through a bounded queue.

use crate::engine::KvEventBatch;
use crate::kv::{BlockHash, KvEvent};
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use tokio::sync::mpsc::Receiver;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// `--kv-events-config`: vLLM's `KVEventsConfig` keys.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    pub enable_kv_cache_events: bool,
    /// `zmq`, or `null` for none (vLLM's names); unset means `zmq` when enabled.
    pub publisher: Option<String>,
    /// Where the PUB socket listens (`tcp://*:5557`) or, without a wildcard host, connects.
    pub endpoint: String,
    /// Where the ROUTER socket that replays past batches listens.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Accepted for vLLM's sake; each subscriber's queue holds [`PUB_QUEUE`] messages.
    pub hwm: usize,
    /// Batches waiting between the engine and the socket; beyond it they are dropped and a
    /// snapshot follows.
    pub max_queue_size: usize,
    pub topic: String,
}

/// Messages queued per subscriber before a slow one misses some (fixed in the ZMQ crate).
const PUB_QUEUE: usize = 100_000;

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: PUB_QUEUE,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl std::str::FromStr for KvEventsConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let de = &mut serde_json::Deserializer::from_str(s);
        let cfg: KvEventsConfig = serde_path_to_error::deserialize(de)
            .map_err(|e| format!("--kv-events-config: {}: {}", e.path(), e.inner()))?;
        match cfg.publisher.as_deref() {
            None | Some("zmq") | Some("null") => {}
            Some(other) => return Err(format!("--kv-events-config: publisher {other:?} is not \"zmq\" or \"null\"")),
        }
        for (key, endpoint) in [("endpoint", Some(&cfg.endpoint)), ("replay_endpoint", cfg.replay_endpoint.as_ref())] {
            if let Some(e) = endpoint {
                tcp_address(e).map_err(|m| format!("--kv-events-config: {key}: {m}"))?;
            }
        }
        if cfg.max_queue_size == 0 {
            return Err("--kv-events-config: max_queue_size must be at least 1".into());
        }
        Ok(cfg)
    }
}

impl KvEventsConfig {
    /// Whether events are published at all.
    pub fn enabled(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref() != Some("null")
    }
}

/// `tcp://host:port` → (`tcp://addr:port` as the ZMQ crate takes it, whether to bind): as
/// vLLM, a wildcard host (`*`, `::`) binds, any other connects.
fn tcp_address(endpoint: &str) -> Result<(String, bool), String> {
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| format!("{endpoint:?} is not tcp://HOST:PORT"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("{endpoint:?} has no port"))?;
    port.parse::<u16>().map_err(|_| format!("{endpoint:?} has no valid port"))?;
    Ok(match host {
        "*" => (format!("tcp://0.0.0.0:{port}"), true),
        "::" | "[::]" => (format!("tcp://[::]:{port}"), true),
        _ => (endpoint.to_string(), false),
    })
}

/// vLLM's external block hash: the low 64 bits, signed.
fn external(hash: BlockHash) -> i64 {
    hash as u64 as i64
}

/// One event as msgspec writes a tagged, array-like struct: the tag, then the fields.
#[derive(Serialize)]
#[serde(untagged)]
enum Wire<'a> {
    /// tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium
    Stored(&'static str, Vec<i64>, Option<i64>, &'a [u32], usize, Option<i64>, &'static str),
    /// tag, block_hashes, medium
    Removed(&'static str, Vec<i64>, &'static str),
    Cleared([&'static str; 1]),
}

/// The cache's tier as vLLM names it: weft's one KV pool is the engine's working cache,
/// what routers call `GPU` (device) blocks.
const MEDIUM: &str = "GPU";

/// The msgpack payload of one batch: `[ts, [events...], data_parallel_rank]`.
pub fn encode(batch: &KvEventBatch, block_size: usize) -> Vec<u8> {
    let events: Vec<Wire<'_>> = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::Stored { hashes, parent, tokens } => Wire::Stored(
                "BlockStored",
                hashes.iter().map(|&h| external(h)).collect(),
                parent.map(external),
                tokens,
                block_size,
                None,
                MEDIUM,
            ),
            KvEvent::Removed { hashes } => {
                Wire::Removed("BlockRemoved", hashes.iter().map(|&h| external(h)).collect(), MEDIUM)
            }
            KvEvent::Cleared => Wire::Cleared(["AllBlocksCleared"]),
        })
        .collect();
    rmp_serde::to_vec(&(batch.ts, events, 0u32)).expect("plain values encode")
}

/// The bound sockets, before the engine's queue exists.
pub struct Publisher {
    publish: PubSocket,
    replay: Option<RouterSocket>,
    topic: Bytes,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
}

impl Publisher {
    /// Binds (or connects) the sockets; an address in use is a startup error.
    pub async fn bind(cfg: &KvEventsConfig) -> Result<Publisher> {
        let mut publish = PubSocket::new();
        let (addr, bind) = tcp_address(&cfg.endpoint).map_err(anyhow::Error::msg)?;
        if bind {
            publish.bind(&addr).await.with_context(|| format!("kv events: binding {}", cfg.endpoint))?;
        } else {
            publish.connect(&addr).await.with_context(|| format!("kv events: connecting to {}", cfg.endpoint))?;
        }
        let replay = match &cfg.replay_endpoint {
            Some(e) => {
                let (addr, _) = tcp_address(e).map_err(anyhow::Error::msg)?;
                let mut s = RouterSocket::new();
                s.bind(&addr).await.with_context(|| format!("kv events: binding the replay socket {e}"))?;
                Some(s)
            }
            None => None,
        };
        if cfg.hwm != PUB_QUEUE {
            eprintln!(
                "weft: kv events: hwm {} is not used; each subscriber's queue holds {PUB_QUEUE} messages",
                cfg.hwm
            );
        }
        let replay_note = cfg.replay_endpoint.as_deref().map(|e| format!(", replay on {e}")).unwrap_or_default();
        eprintln!("weft: kv events on {}{replay_note}", cfg.endpoint);
        Ok(Publisher {
            publish,
            replay,
            topic: Bytes::from(cfg.topic.clone().into_bytes()),
            buffer: VecDeque::new(),
            buffer_steps: cfg.buffer_steps,
        })
    }

    /// Sends the engine's batches, numbered from 0, and answers replay requests, until the
    /// engine's queue closes.
    pub async fn run(mut self, mut batches: Receiver<KvEventBatch>, block_size: usize) {
        let mut seq = 0u64;
        loop {
            let replay = async {
                match &mut self.replay {
                    Some(s) => s.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                batch = batches.recv() => {
                    let Some(batch) = batch else { return };
                    let payload = Bytes::from(encode(&batch, block_size));
                    let frames = vec![self.topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
                    if let Err(e) = self.publish.send(ZmqMessage::try_from(frames).expect("three frames")).await {
                        eprintln!("weft: kv events: sending batch {seq}: {e}");
                    }
                    if self.buffer_steps > 0 {
                        if self.buffer.len() == self.buffer_steps {
                            self.buffer.pop_front();
                        }
                        self.buffer.push_back((seq, payload));
                    }
                    seq += 1;
                }
                request = replay => {
                    if let Ok(request) = request {
                        if let Err(e) = self.answer_replay(request).await {
                            eprintln!("weft: kv events: replay: {e:#}");
                        }
                    }
                }
            }
        }
    }

    /// `[identity, "", start]` → `[identity, "", seq, payload]` for each kept batch from
    /// `start` on, then `[identity, "", -1, ""]`.
    async fn answer_replay(&mut self, request: ZmqMessage) -> Result<()> {
        let frames = request.into_vec();
        let [identity, _, start] = frames.as_slice() else {
            bail!("a request of {} frames, not 3", frames.len());
        };
        let start: [u8; 8] = start.as_ref().try_into().context("the start is not 8 bytes")?;
        let start = u64::from_be_bytes(start);
        let socket = self.replay.as_mut().expect("asked on the replay socket");
        let empty = Bytes::new();
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            let frames =
                vec![identity.clone(), empty.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
            socket.send(ZmqMessage::try_from(frames).expect("four frames")).await?;
        }
        let end = vec![identity.clone(), empty.clone(), Bytes::copy_from_slice(&(-1i64).to_be_bytes()), empty];
        socket.send(ZmqMessage::try_from(end).expect("four frames")).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_takes_vllm_keys_and_names_a_bad_one() {
        let cfg: KvEventsConfig =
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", "topic": "kv"}"#
                .parse()
                .unwrap();
        assert!(cfg.enabled());
        assert_eq!((cfg.endpoint.as_str(), cfg.buffer_steps), ("tcp://*:6000", 10_000));
        let off: KvEventsConfig = r#"{"enable_kv_cache_events": true, "publisher": "null"}"#.parse().unwrap();
        assert!(!off.enabled());
        for (bad, names) in [
            (r#"{"enable_kv_cache_events": true, "endpont": "x"}"#, "endpont"),
            (r#"{"buffer_steps": -1}"#, "buffer_steps"),
            (r#"{"publisher": "nats"}"#, "publisher"),
            (r#"{"endpoint": "ipc:///tmp/x"}"#, "endpoint"),
            (r#"{"replay_endpoint": "tcp://*:x"}"#, "replay_endpoint"),
            (r#"{"max_queue_size": 0}"#, "max_queue_size"),
            ("{", "--kv-events-config"),
        ] {
            let e = bad.parse::<KvEventsConfig>().unwrap_err();
            assert!(e.contains(names), "{bad}: {e}");
        }
        assert_eq!(tcp_address("tcp://*:5557"), Ok(("tcp://0.0.0.0:5557".into(), true)));
        assert_eq!(tcp_address("tcp://127.0.0.1:5557"), Ok(("tcp://127.0.0.1:5557".into(), false)));
    }

    #[test]
    fn batches_encode_as_vllm_msgspec_arrays() {
        let batch = KvEventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::Stored { hashes: vec![u128::MAX, 2], parent: None, tokens: vec![1, 2, 3, 4] },
                KvEvent::Removed { hashes: vec![(1 << 64) | 7] },
                KvEvent::Cleared,
            ],
        };
        use rmpv::Value;
        let value = rmpv::decode::read_value(&mut encode(&batch, 2).as_slice()).unwrap();
        let ints = |xs: &[i64]| Value::Array(xs.iter().map(|&x| x.into()).collect());
        assert_eq!(
            value,
            Value::Array(vec![
                Value::F64(1.5),
                Value::Array(vec![
                    Value::Array(vec![
                        "BlockStored".into(),
                        ints(&[-1, 2]),
                        Value::Nil,
                        ints(&[1, 2, 3, 4]),
                        2.into(),
                        Value::Nil,
                        "GPU".into(),
                    ]),
                    Value::Array(vec!["BlockRemoved".into(), ints(&[7]), "GPU".into()]),
                    Value::Array(vec!["AllBlocksCleared".into()]),
                ]),
                0.into(),
            ])
        );
    }
}
