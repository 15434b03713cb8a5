//! weft: a continuous-batching LLM inference engine.
//!
//! Layers, from the bottom: [`kernels`] (numeric kernels), [`kv`] (paged KV cache),
//! [`model`] (weights and the ragged-batch forward pass), [`tokenizer`], [`sampling`],
//! [`generate`] (running sequences to completion) and [`cli`].

pub mod cli;
pub mod generate;
pub mod kernels;
pub mod kv;
pub mod loaded;
pub mod model;
pub mod sampling;
pub mod tokenizer;
