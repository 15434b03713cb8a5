//! Choosing the next token, per sequence: request parameters ([`SamplingParams`]), the
//! logits processors and samplers they configure ([`Sampler`]), and log-probabilities.
//! Each sequence has its own RNG, so a seeded request draws the same tokens whatever else
//! shares the batch.

mod candidates;
mod params;
mod sampler;

pub use params::{SamplingParams, StopCondition};
pub use sampler::{argmax, PromptLogprob, Sampled, Sampler, TokenLogprob};
