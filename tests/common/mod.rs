//! Helpers for tests that use the real models in `../shared/models`.
#![allow(dead_code)]

use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use weft::loaded::LoadedModel;

/// `$WEFT_SHARED_MODELS`, else `shared/models` beside the repository; `None` (and a note on
/// stderr) when absent, so the suite still runs on a machine without them.
pub fn shared_models() -> Option<PathBuf> {
    let dir = std::env::var_os("WEFT_SHARED_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/models"));
    if dir.join("stories260k").exists() {
        Some(dir)
    } else {
        eprintln!("skipping: no shared models at {}", dir.display());
        None
    }
}

pub struct Case {
    pub id: String,
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub generated_text_delta: String,
    pub top5: Vec<(u32, f32)>,
    pub margins: Vec<f32>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn reference(model_dir: &str) -> Vec<Case> {
    let path = shared_models()
        .unwrap()
        .join(model_dir)
        .join("reference.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            id: c["id"].as_str().unwrap().into(),
            prompt: c["prompt"].as_str().unwrap().into(),
            prompt_ids: ids(&c["prompt_token_ids"]),
            generated_ids: ids(&c["generated_token_ids"]),
            generated_text_delta: c["generated_text_delta"].as_str().unwrap().into(),
            top5: c["last_prompt_top5"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                .collect(),
            margins: c["step_top1_top2_margin"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m.as_f64().unwrap() as f32)
                .collect(),
        })
        .collect()
}

/// Each model is loaded once per test binary and shared by its tests.
pub fn model(rel: &str) -> Arc<LoadedModel> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<LoadedModel>>>> = OnceLock::new();
    let mut map = CACHE.get_or_init(Default::default).lock().unwrap();
    map.entry(rel.to_string())
        .or_insert_with(|| {
            Arc::new(LoadedModel::open(&shared_models().unwrap().join(rel)).unwrap())
        })
        .clone()
}

/// The model variants under test: (path relative to shared/models, reference folder).
pub const VARIANTS: &[(&str, &str)] = &[
    ("stories260k", "stories260k"),
    ("stories260k/stories260k.gguf", "stories260k"),
    (
        "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2-135m-instruct",
    ),
];
