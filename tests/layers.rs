//! The architecture as a test: data flows down through the layers that `src/lib.rs` lists,
//! and no two source files import each other. Read from the `crate::` and `super::` paths
//! in each file's code (comments and the tests at a file's end left out).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The top-level modules from the bottom up: each may use those before it, never after.
const LAYERS: [&str; 12] = [
    "kernels",
    "kv",
    "model",
    "tokenizer",
    "grammar",
    "loaded",
    "sampling",
    "scheduler",
    "engine",
    "api",
    "server",
    "cli",
];

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src/` (`src/engine/core.rs` → `engine::core`).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

/// A file's code: its lines before its `#[cfg(test)]` items, without comments.
fn code(text: &str) -> String {
    let end = text.find("\n#[cfg(test)]").unwrap_or(text.len());
    text[..end].lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The module paths a file names: `crate::a::b` and `super::…::x`, with `use` groups
/// (`crate::a::{b, c::d}`) expanded one level.
fn named_paths(module: &[String], code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < bytes.len() {
        if !code.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let at_word_start = i == 0 || !word(bytes[i - 1]);
        let rest = &code[i..];
        let (base, skip) = if at_word_start && rest.starts_with("crate::") {
            (Vec::new(), "crate::".len())
        } else if at_word_start && rest.starts_with("super::") {
            // `super` from `a/b.rs` (module a::b) is `a`; from `a/mod.rs` (module a), its parent.
            let mut base = module.to_vec();
            let mut skip = 0;
            while code[i + skip..].starts_with("super::") {
                base.pop();
                skip += "super::".len();
            }
            (base, skip)
        } else {
            i += 1;
            continue;
        };
        let tail = &code[i + skip..];
        let end = tail.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(tail.len());
        let mut segs: Vec<String> = tail[..end].split("::").filter(|s| !s.is_empty()).map(str::to_owned).collect();
        if tail[end..].starts_with('{') {
            let group = &tail[end + 1..tail[end..].find('}').map_or(tail.len(), |j| end + j)];
            for item in group.split(',') {
                let first = item.trim().split("::").next().unwrap_or("").split(' ').next().unwrap_or("");
                if !first.is_empty() {
                    let mut p = base.clone();
                    p.extend(segs.iter().cloned());
                    p.push(first.to_owned());
                    out.push(p);
                }
            }
        } else {
            let mut p = base;
            p.append(&mut segs);
            out.push(p);
        }
        i += skip + end;
    }
    out
}

#[test]
fn data_flows_down_and_no_two_files_import_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let modules: BTreeMap<Vec<String>, PathBuf> = files.iter().map(|f| (module_of(&src, f), f.clone())).collect();
    let file_of = |path: &[String]| (1..=path.len()).rev().find_map(|n| modules.get(&path[..n]));
    let mut imports: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    let mut upward = Vec::new();
    for file in &files {
        let module = module_of(&src, file);
        let text = std::fs::read_to_string(file).unwrap();
        for path in named_paths(&module, &code(&text)) {
            let layer = |m: &[String]| m.first().and_then(|top| LAYERS.iter().position(|l| l == top));
            if let (Some(from), Some(to)) = (layer(&module), layer(&path)) {
                if to > from {
                    upward.push(format!("{} uses {}", file.display(), path.join("::")));
                }
            }
            if let Some(target) = file_of(&path).filter(|t| *t != file) {
                imports.entry(file.clone()).or_default().insert(target.clone());
            }
        }
    }
    assert!(upward.is_empty(), "imports that go up a layer:\n{}", upward.join("\n"));
    let mut mutual = Vec::new();
    for (a, targets) in &imports {
        for b in targets {
            if a < b && imports.get(b).is_some_and(|t| t.contains(a)) {
                mutual.push(format!("{} <-> {}", a.display(), b.display()));
            }
        }
    }
    assert!(mutual.is_empty(), "files that import each other:\n{}", mutual.join("\n"));
    // Every top-level module is a layer, so none escapes the rule.
    for top in modules.keys().filter(|m| m.len() == 1) {
        assert!(LAYERS.contains(&top[0].as_str()), "src/{}: add it to LAYERS and lib.rs's layer doc", top[0]);
    }
}
