//! Models: configuration, weight loading (safetensors directories and GGUF files) and the
//! decoder forward pass over a ragged batch (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2).

pub mod config;
pub mod convert;
pub mod decoder;
mod delta_net;
pub mod file_type;
pub mod gguf;
pub mod gguf_write;
pub mod loader;
pub mod moe;
pub mod requantize;
mod tensor;
pub mod weight;

pub use config::{Activation, Arch, ModelConfig, Pooling, RopeScaling};
pub use decoder::{Decoder, SeqStep, StepInput, Workspace};
pub use delta_net::RUN as RECURRENT_RUN;
pub use weight::WeightDtype;

/// `v` resized to `n` values: a buffer reused from step to step, as this step's scratch.
fn resize(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}
