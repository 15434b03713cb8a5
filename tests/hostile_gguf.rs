//! Untrusted model files: truncated, random, absurd counts and lengths, deep nesting, bad
//! numbers. Each is refused with a clear error and exit code 1 by the real binary, in
//! bounded memory; a seeded mutation run over a real file's header, and one over request
//! bodies, never makes weft panic.

mod common;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Stdio};

const GGUF: &str = "stories260k/stories260k.gguf";

/// A scratch directory that goes with its test.
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// A GGUF v3 header: `n_tensors`, `n_kv`, then `rest` as is.
fn header(n_tensors: u64, n_kv: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(n_tensors.to_le_bytes());
    b.extend(n_kv.to_le_bytes());
    b.extend(rest);
    b
}

fn string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

/// The real file with the value of metadata `key` (right after its type) overwritten.
fn patched(original: &[u8], key: &str, value: &[u8]) -> Vec<u8> {
    let needle = string(key);
    let at = original.windows(needle.len()).position(|w| w == needle).expect("key in file") + needle.len() + 4;
    let mut b = original.to_vec();
    b[at..at + value.len()].copy_from_slice(value);
    b
}

/// Runs `cmd` to its end: its exit code, stderr, and its own peak resident memory in MB
/// (from `wait4` on its pid, so other tests' children do not count).
fn run_measured(cmd: &mut Command) -> (Option<i32>, String, f64) {
    use std::io::Read;
    // Reaped by `wait4` below, which std does not see.
    #[allow(clippy::zombie_processes)]
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let (mut status, pid) = (0, child.id() as libc::pid_t);
    // SAFETY: zeroed is a valid rusage, and wait4 only writes the two it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::wait4(pid, &mut status, 0, &mut usage) }, pid);
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    (code, stderr, usage.ru_maxrss as f64 / 1024.0)
}

#[test]
fn hostile_model_files_are_refused_with_exit_code_1_in_bounded_memory() {
    let Some(models) = common::shared_models() else {
        return;
    };
    let real = std::fs::read(models.join(GGUF)).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let nest = {
        let mut b = string("deep");
        b.extend(9u32.to_le_bytes());
        for _ in 0..10_000 {
            b.extend(9u32.to_le_bytes());
            b.extend(1u64.to_le_bytes());
        }
        header(0, 1, &b)
    };
    let array = |elem_ty: u32, n: u64| {
        let mut b = string("big");
        b.extend(9u32.to_le_bytes());
        b.extend(elem_ty.to_le_bytes());
        b.extend(n.to_le_bytes());
        b.extend([0u8; 64]);
        header(0, 1, &b)
    };
    let tensor = |dims: &[u64], offset: u64| {
        let mut b = string("general.architecture");
        b.extend(8u32.to_le_bytes());
        b.extend(string("llama"));
        b.extend(string("token_embd.weight"));
        b.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
        b.extend(0u32.to_le_bytes());
        b.extend(offset.to_le_bytes());
        header(1, 1, &b)
    };
    let mut long_string = string("s");
    long_string.splice(0..8, (1u64 << 62).to_le_bytes());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("random", (0..4096).map(|_| rng.random()).collect()),
        ("random after magic", [b"GGUF".as_slice(), &(0..4096).map(|_| rng.random()).collect::<Vec<u8>>()].concat()),
        ("truncated in the header", real[..5000].to_vec()),
        ("truncated in the tensor directory", real[..12_000].to_vec()),
        ("truncated in the weights", real[..real.len() / 2].to_vec()),
        ("2^63 tensors and keys", header(1 << 63, 1 << 63, &[])),
        ("key count past the file", header(0, 1_000_000, &[0; 64])),
        ("string of 2^62 bytes", header(0, 1, &long_string)),
        ("arrays nested 10000 deep", nest),
        ("array of 2^40 u8", array(0, 1 << 40)),
        ("array of 2^59 u64", array(10, 1 << 59)),
        ("array of 2^50 strings", array(8, 1 << 50)),
        ("array of an unknown type", array(99, 4)),
        ("tensor shape overflows", tensor(&[1 << 40, 1 << 40], 0)),
        ("tensor offset 2^63", tensor(&[4, 4], 1 << 63)),
        ("block_count 2^32-1", patched(&real, "llama.block_count", &u32::MAX.to_le_bytes())),
        ("head_count 0", patched(&real, "llama.attention.head_count", &0u32.to_le_bytes())),
        ("key_length 2^31", patched(&real, "llama.attention.key_length", &(1u32 << 31).to_le_bytes())),
        ("embedding_length 2^32-1", patched(&real, "llama.embedding_length", &u32::MAX.to_le_bytes())),
        ("embedding_length 0", patched(&real, "llama.embedding_length", &0u32.to_le_bytes())),
        ("feed_forward_length 0", patched(&real, "llama.feed_forward_length", &0u32.to_le_bytes())),
        ("NaN rope base", patched(&real, "llama.rope.freq_base", &f32::NAN.to_le_bytes())),
        (
            "infinite norm epsilon",
            patched(&real, "llama.attention.layer_norm_rms_epsilon", &f32::INFINITY.to_le_bytes()),
        ),
        ("zero norm epsilon", patched(&real, "llama.attention.layer_norm_rms_epsilon", &0f32.to_le_bytes())),
        ("BOS id outside the vocabulary", patched(&real, "tokenizer.ggml.bos_token_id", &99_999u32.to_le_bytes())),
        ("EOS id outside the vocabulary", patched(&real, "tokenizer.ggml.eos_token_id", &u32::MAX.to_le_bytes())),
        ("UNK id outside the vocabulary", patched(&real, "tokenizer.ggml.unknown_token_id", &70_000u32.to_le_bytes())),
    ];
    let dir = scratch();
    let run = |path: &Path| {
        run_measured(
            Command::new(env!("CARGO_BIN_EXE_weft"))
                .args(["generate", "Once", "--max-tokens", "2", "--kv-cache-memory", "64M", "--model"])
                .arg(path),
        )
    };
    // No untrusted number may size an allocation: each run stays far below what one would
    // take (the model and its 64 MB cache need a fraction of this).
    let bounded = |name: &str, rss: f64| assert!(rss < 300.0, "{name} made weft use {rss:.0} MB");
    for (name, bytes) in &cases {
        let path = dir.path().join(format!("{}.gguf", name.replace(' ', "_")));
        std::fs::write(&path, bytes).unwrap();
        let (code, stderr, rss) = run(&path);
        assert_eq!(code, Some(1), "{name}\n{stderr}");
        assert!(stderr.contains("error"), "{name}: no error message: {stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
        bounded(name, rss);
    }
    // An absurd context length is not an error, but it must not size any allocation.
    let huge_ctx = dir.path().join("huge_context.gguf");
    std::fs::write(&huge_ctx, patched(&real, "llama.context_length", &u32::MAX.to_le_bytes())).unwrap();
    let (code, stderr, rss) = run(&huge_ctx);
    assert_eq!(code, Some(0), "{stderr}");
    bounded("an absurd context length", rss);
}

/// Seeded mutations of a real file's header (flipped bytes, extreme integers, truncation):
/// loading returns a model or an error, never panics.
#[test]
fn mutated_gguf_headers_never_panic() {
    const RUNS: usize = 300;
    let Some(models) = common::shared_models() else {
        return;
    };
    let real = std::fs::read(models.join(GGUF)).unwrap();
    let header_end = 12_000; // the metadata and tensor directory of this file
    let dir = scratch();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let extremes = [0u64, 1, u32::MAX as u64, 1 << 31, 1 << 32, 1 << 62, u64::MAX, i64::MAX as u64];
    let (mut loaded, mut refused) = (0, 0);
    for run in 0..RUNS {
        let mut b = real.clone();
        for _ in 0..rng.random_range(1..4) {
            let at = rng.random_range(4..header_end);
            match rng.random_range(0..3) {
                0 => b[at] ^= 1 << rng.random_range(0..8),
                1 => {
                    let v = extremes[rng.random_range(0..extremes.len())].to_le_bytes();
                    let w = if rng.random() { 8 } else { 4 };
                    b[at..at + w].copy_from_slice(&v[..w]);
                }
                _ => b.truncate(at),
            }
            if b.len() < header_end {
                break;
            }
        }
        let path = dir.path().join(format!("m{run}.gguf"));
        std::fs::write(&path, &b).unwrap();
        let outcome = std::panic::catch_unwind(|| {
            weft::loaded::LoadedModel::open(&path, weft::model::WeightDtype::Auto).map(|_| ())
        });
        match outcome {
            Ok(Ok(())) => loaded += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => {
                let kept = std::env::temp_dir().join(format!("weft-mutation-{run}.gguf"));
                std::fs::copy(&path, &kept).ok();
                panic!("loading mutation {run} panicked (file kept at {})", kept.display())
            }
        }
        std::fs::remove_file(&path).ok();
    }
    eprintln!("{RUNS} mutated headers: {loaded} loaded, {refused} refused, 0 panics");
    assert!(refused > 0, "no mutation was refused: the mutations do not reach the header");
}

/// Seeded random request bodies, built from every field with hostile values, through the
/// same parsing, checks and submission as the server: never a panic, and every block is
/// free afterwards.
#[test]
fn mutated_request_bodies_never_panic() {
    if common::shared_models().is_none() {
        return;
    }
    use weft::api::openai::{ChatRequest, CompletionRequest};
    let engine = common::engine("stories260k", weft::engine::EngineConfig::default());
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let nasty = || -> Vec<Value> {
        vec![
            json!(null),
            json!(-1),
            json!(0),
            json!(1),
            json!(3),
            json!(511),
            json!(512),
            json!(u32::MAX),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(1e300),
            json!(-0.5),
            json!(0.5),
            json!(2.5),
            json!(""),
            json!("x"),
            json!(true),
            json!([]),
            json!([1, 2]),
            json!([[1], [u32::MAX]]),
            json!(["a", "b"]),
            json!({"a": 1}),
            json!({"5": 1e9}),
            json!([{"role": "user", "content": "hi"}]),
            json!([{"role": "x"}]),
            json!("s".repeat(300)),
        ]
    };
    // Every field either route accepts.
    use weft::api::{fields::keys, openai::GenerationFields};
    let mut fields: Vec<&str> =
        [keys::<CompletionRequest>(), keys::<ChatRequest>(), keys::<GenerationFields>()].concat();
    fields.sort_unstable();
    fields.dedup();
    let values = nasty();
    let (mut accepted, mut refused) = (0, 0);
    for i in 0..3000 {
        let mut body = serde_json::Map::new();
        body.insert("prompt".into(), json!("Once upon a time"));
        body.insert("max_tokens".into(), json!(4));
        for _ in 0..rng.random_range(1..5) {
            let f = fields[rng.random_range(0..fields.len())];
            body.insert(f.into(), values[rng.random_range(0..values.len())].clone());
        }
        let body = Value::Object(body);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let reqs = if i % 2 == 0 {
                CompletionRequest::parse(body.clone()).and_then(|r| r.engine_requests(&engine))
            } else {
                ChatRequest::parse(body.clone()).and_then(|r| r.engine_request(&engine)).map(|r| vec![r])
            };
            // Submitted and dropped at once: the engine aborts them.
            reqs.map(|rs| rs.into_iter().map(|r| engine.submit(r).map(drop)).collect::<Vec<_>>())
        }));
        match outcome {
            Ok(Ok(_)) => accepted += 1,
            Ok(Err(e)) => {
                assert!((400..500).contains(&e.status), "{body} -> {e:?}");
                refused += 1;
            }
            Err(_) => panic!("request body panicked: {body}"),
        }
    }
    eprintln!("3000 mutated bodies: {accepted} accepted, {refused} refused, 0 panics");
    common::assert_all_blocks_free(&engine);
}
