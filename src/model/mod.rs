//! Models: configuration, weight loading (safetensors directories and GGUF files) and the
//! Llama forward pass over a ragged batch.

pub mod config;
pub mod gguf;
pub mod llama;
pub mod loader;
mod tensor;
pub mod weight;

pub use config::{ModelConfig, RopeScaling};
pub use llama::{Llama, SeqStep, StepInput, Workspace};
pub use weight::WeightDtype;
