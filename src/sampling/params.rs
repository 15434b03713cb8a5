//! Per-request generation parameters and their validation.

use anyhow::{ensure, Result};
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0 = off).
    pub min_p: f32,
    /// > 1 discourages tokens already in the prompt or output (1 = off).
    pub repetition_penalty: f32,
    /// Subtracted once per occurrence in the output (0 = off).
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurs in the output (0 = off).
    pub presence_penalty: f32,
    /// Added to the logits of these token ids.
    pub logit_bias: HashMap<u32, f32>,
    /// RNG seed; a random one when absent.
    pub seed: Option<u64>,
    /// Return the sampled token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: HashMap::new(),
            seed: None,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Checks ranges; `vocab_size` bounds `logit_bias` keys. (Sizes are capped by the
    /// engine's [`crate::engine::RequestLimits`].)
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        let finite = |v: f32, name: &str| {
            ensure!(v.is_finite(), "{name} must be a finite number, got {v}");
            Ok(())
        };
        finite(self.temperature, "temperature")?;
        ensure!(self.temperature >= 0.0, "temperature must be >= 0, got {}", self.temperature);
        finite(self.top_p, "top_p")?;
        ensure!(self.top_p > 0.0 && self.top_p <= 1.0, "top_p must be in (0, 1], got {}", self.top_p);
        finite(self.min_p, "min_p")?;
        ensure!((0.0..=1.0).contains(&self.min_p), "min_p must be in [0, 1], got {}", self.min_p);
        finite(self.repetition_penalty, "repetition_penalty")?;
        ensure!(self.repetition_penalty > 0.0, "repetition_penalty must be > 0, got {}", self.repetition_penalty);
        finite(self.frequency_penalty, "frequency_penalty")?;
        ensure!(
            (-2.0..=2.0).contains(&self.frequency_penalty),
            "frequency_penalty must be in [-2, 2], got {}",
            self.frequency_penalty
        );
        finite(self.presence_penalty, "presence_penalty")?;
        ensure!(
            (-2.0..=2.0).contains(&self.presence_penalty),
            "presence_penalty must be in [-2, 2], got {}",
            self.presence_penalty
        );
        for (&id, &bias) in &self.logit_bias {
            ensure!((id as usize) < vocab_size, "logit_bias token id {id} is outside the vocabulary ({vocab_size})");
            ensure!((-100.0..=100.0).contains(&bias), "logit_bias for token {id} must be in [-100, 100], got {bias}");
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// When a sequence stops, besides running out of `max_tokens`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StopCondition {
    pub max_tokens: usize,
    /// Stop on these token ids (EOS is added unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Stop when the output text contains one of these; the text ends before it.
    pub stop_strings: Vec<String>,
    pub ignore_eos: bool,
    /// The matched stop string stays in the output.
    pub include_stop_str_in_output: bool,
    /// EOS and the stop token ids cannot be drawn before this many tokens.
    pub min_tokens: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_bad_field() {
        let bad = [
            SamplingParams { temperature: -0.5, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { min_p: 1.5, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
            SamplingParams { frequency_penalty: 3.0, ..Default::default() },
            SamplingParams { presence_penalty: f32::NAN, ..Default::default() },
            SamplingParams { logit_bias: [(10, 1.0)].into(), ..Default::default() },
        ];
        let names = [
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
        ];
        for (p, name) in bad.iter().zip(names) {
            let err = p.validate(10).unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
        SamplingParams::default().validate(10).unwrap();
    }
}
