//! llama.cpp as the peer that `weft bench` measures itself against: its own benchmarks run
//! on the same GGUF file with the same threads, their JSON lines parsed, so that the ratios
//! come from one run. `llama-bench` stands for one stream (its `tg` and `pp` tests, as the
//! bars are stated), `llama-batched-bench` for B streams (its `S_TG` and `S_PP`).

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// llama.cpp's speeds at one batch size, tokens per second over all its sequences.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeerSpeed {
    pub tg_tok_s: f64,
    pub pp_tok_s: f64,
}

/// A llama.cpp build's `bin` folder.
pub struct LlamaCpp {
    bin: PathBuf,
    /// Whether llama.cpp may repack the weights (its default); turned off for good once a
    /// run crashes with them repacked.
    repack: Cell<bool>,
}

impl LlamaCpp {
    /// Checks that the folder holds both benchmarks.
    pub fn new(bin: PathBuf) -> Result<Self> {
        for tool in ["llama-bench", "llama-batched-bench"] {
            ensure!(bin.join(tool).is_file(), "--llama-cpp {}: no {tool} there", bin.display());
        }
        Ok(LlamaCpp { bin, repack: Cell::new(true) })
    }

    /// llama.cpp's speeds on `model` with `threads` threads: `batch` prompts of `pp` tokens,
    /// each then decoding `tg`. A run killed by a signal with the weights repacked runs
    /// again without repacking, and so does every later one: llama.cpp's AMX kernels, which
    /// only repacked weights take, crash on some Intel CPUs (llama.cpp issue 20824), and
    /// its next-fastest working path is the peer then.
    pub fn measure(&self, model: &Path, threads: usize, batch: usize, pp: usize, tg: usize) -> Result<PeerSpeed> {
        let (tool, mut args) = command(model, threads, batch, pp, tg, self.repack.get());
        let mut out = self.run(tool, &args)?;
        if self.repack.get() && killed(&out) {
            eprintln!(
                "weft: {tool} crashed with llama.cpp's repacked weights ({}); measuring llama.cpp without \
                 repacking from here on",
                out.status
            );
            self.repack.set(false);
            args = command(model, threads, batch, pp, tg, false).1;
            out = self.run(tool, &args)?;
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(5).collect();
            bail!(
                "{tool} {} failed ({}): {}",
                args.join(" "),
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            );
        }
        if batch == 1 { parse_llama_bench(&stdout) } else { parse_batched_bench(&stdout) }
            .with_context(|| format!("reading {tool}'s output"))
    }

    fn run(&self, tool: &str, args: &[String]) -> Result<Output> {
        let path = self.bin.join(tool);
        Command::new(&path).args(args).output().with_context(|| format!("running {}", path.display()))
    }
}

/// Whether the process ended by a signal (a crash) rather than by exiting.
fn killed(out: &Output) -> bool {
    #[cfg(unix)]
    return std::os::unix::process::ExitStatusExt::signal(&out.status).is_some();
    #[cfg(not(unix))]
    false
}

/// The tool and its arguments for one measurement: one repetition of `llama-bench`'s `pp`
/// and `tg` tests at one stream, else one `llama-batched-bench` run with room for every
/// sequence; without `repack`, with the weights as the file has them.
fn command(
    model: &Path,
    threads: usize,
    batch: usize,
    pp: usize,
    tg: usize,
    repack: bool,
) -> (&'static str, Vec<String>) {
    let model = model.display().to_string();
    let t = threads.to_string();
    let (tool, mut args): (_, Vec<String>) = if batch == 1 {
        let args = ["-m", &model, "-t", &t, "-p", &pp.to_string(), "-n", &tg.to_string(), "-r", "1", "-o", "jsonl"];
        ("llama-bench", args.map(String::from).to_vec())
    } else {
        let ctx = (batch * (pp + tg)).to_string();
        let args = [
            "-m",
            &model,
            "-t",
            &t,
            "-c",
            &ctx,
            "-npp",
            &pp.to_string(),
            "-ntg",
            &tg.to_string(),
            "-npl",
            &batch.to_string(),
            "--output-format",
            "jsonl",
        ];
        ("llama-batched-bench", args.map(String::from).to_vec())
    };
    if !repack {
        let flags = if batch == 1 { ["--repack", "0"].as_slice() } else { ["--no-repack"].as_slice() };
        args.extend(flags.iter().map(|f| f.to_string()));
    }
    (tool, args)
}

/// The JSON objects among a tool's output lines (it prints other lines too).
fn json_lines(stdout: &str) -> impl Iterator<Item = Value> + '_ {
    stdout.lines().filter(|l| l.trim_start().starts_with('{')).filter_map(|l| serde_json::from_str(l).ok())
}

/// `llama-bench -o jsonl`: the prompt test's and the generation test's `avg_ts`.
fn parse_llama_bench(stdout: &str) -> Result<PeerSpeed> {
    let (mut pp, mut tg) = (None, None);
    for v in json_lines(stdout) {
        let (n_prompt, n_gen) = (v["n_prompt"].as_u64().unwrap_or(0), v["n_gen"].as_u64().unwrap_or(0));
        let speed = v["avg_ts"].as_f64();
        match (n_prompt > 0, n_gen > 0) {
            (true, false) => pp = speed,
            (false, true) => tg = speed,
            _ => {}
        }
    }
    Ok(PeerSpeed { tg_tok_s: tg.context("no generation test")?, pp_tok_s: pp.context("no prompt test")? })
}

/// `llama-batched-bench --output-format jsonl`: `speed_tg` and `speed_pp` of its one run.
fn parse_batched_bench(stdout: &str) -> Result<PeerSpeed> {
    let v = json_lines(stdout).find(|v| v.get("speed_tg").is_some()).context("no result line")?;
    let speed = |k: &str| v[k].as_f64().with_context(|| format!("no {k}"));
    Ok(PeerSpeed { tg_tok_s: speed("speed_tg")?, pp_tok_s: speed("speed_pp")? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_stream_runs_llama_bench_and_more_run_batched_bench() {
        let m = Path::new("m.gguf");
        let (tool, args) = command(m, 2, 1, 128, 64, true);
        assert_eq!(tool, "llama-bench");
        assert_eq!(args.join(" "), "-m m.gguf -t 2 -p 128 -n 64 -r 1 -o jsonl");
        let (tool, args) = command(m, 2, 32, 128, 32, true);
        assert_eq!(tool, "llama-batched-bench");
        assert_eq!(args.join(" "), "-m m.gguf -t 2 -c 5120 -npp 128 -ntg 32 -npl 32 --output-format jsonl");
        assert_eq!(
            command(m, 2, 1, 128, 64, false).1.join(" "),
            "-m m.gguf -t 2 -p 128 -n 64 -r 1 -o jsonl --repack 0"
        );
        let no_repack = command(m, 2, 32, 128, 32, false).1.join(" ");
        assert_eq!(no_repack, "-m m.gguf -t 2 -c 5120 -npp 128 -ntg 32 -npl 32 --output-format jsonl --no-repack");
    }

    /// A peer that crashes with repacked weights (as llama.cpp's AMX path does on some Intel
    /// CPUs) is measured again without repacking, and so are its later runs; one that fails
    /// by exiting is an error.
    #[cfg(unix)]
    #[test]
    fn a_crash_with_repacked_weights_runs_again_without() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("calls");
        let script = format!(
            "#!/bin/sh\necho \"$*\" >> {}\ncase \"$*\" in *fail*) exit 1 ;; *repack*) ;; *) kill -SEGV $$ ;; esac\n\
             echo '{{\"speed_tg\": 50.0, \"speed_pp\": 70.0}}'\n",
            log.display()
        );
        for tool in ["llama-bench", "llama-batched-bench"] {
            let path = dir.path().join(tool);
            std::fs::write(&path, &script).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let peer = LlamaCpp::new(dir.path().to_path_buf()).unwrap();
        for _ in 0..2 {
            let speed = peer.measure(Path::new("m.gguf"), 2, 32, 64, 64).unwrap();
            assert_eq!(speed, PeerSpeed { tg_tok_s: 50.0, pp_tok_s: 70.0 });
        }
        assert!(peer.measure(Path::new("fail.gguf"), 2, 32, 64, 64).is_err());
        let calls = std::fs::read_to_string(&log).unwrap();
        let repacked: Vec<bool> = calls.lines().map(|l| !l.contains("--no-repack")).collect();
        assert_eq!(repacked, [true, false, false, false], "{calls}");
    }

    /// Lines as llama.cpp prints them (fields cut down), among its log lines.
    #[test]
    fn parses_both_tools_output() {
        let bench = "load_backend: loaded CPU backend\n\
            {\"model_type\": \"llama 256M Q4_1\", \"n_prompt\": 128, \"n_gen\": 0, \"avg_ts\": 281.5}\n\
            {\"model_type\": \"llama 256M Q4_1\", \"n_prompt\": 0, \"n_gen\": 128, \"avg_ts\": 92.25}\n";
        assert_eq!(parse_llama_bench(bench).unwrap(), PeerSpeed { tg_tok_s: 92.25, pp_tok_s: 281.5 });
        let batched = "main: n_kv_max = 5120\n\
            {\"pp\": 128, \"tg\": 32, \"pl\": 32, \"t_pp\": 60.3, \"speed_pp\": 67.9, \"t_tg\": 20.5, \"speed_tg\": 50.02, \"speed\": 63.4}\n";
        assert_eq!(parse_batched_bench(batched).unwrap(), PeerSpeed { tg_tok_s: 50.02, pp_tok_s: 67.9 });
    }

    #[test]
    fn output_without_results_is_an_error() {
        assert!(parse_llama_bench("{\"n_prompt\": 0, \"n_gen\": 128, \"avg_ts\": 90.0}\n").is_err());
        assert!(parse_batched_bench("main: error\n{\"not\": 1}\n").is_err());
        assert!(LlamaCpp::new(PathBuf::from("/nonexistent")).is_err());
    }
}
