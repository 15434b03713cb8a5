//! weft: a continuous-batching LLM inference engine.
//!
//! Layers, from the bottom: [`kernels`] (numeric kernels), [`kv`] (paged KV cache),
//! [`model`] (weights and the ragged-batch forward pass), [`tokenizer`], [`grammar`]
//! (structured output), [`loaded`] (a model path opened into weights and tokenizer),
//! [`sampling`], [`scheduler`] (who runs each step), [`engine`] (the serving loop), [`api`]
//! (OpenAI request and response types), [`server`] (HTTP) and [`cli`].

#![deny(unsafe_op_in_unsafe_fn)]

pub mod api;
pub mod cli;
pub mod engine;
pub mod grammar;
pub mod kernels;
pub mod kv;
pub mod loaded;
pub mod model;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod tokenizer;
