//! Per-request generation parameters and their validation.

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

/// A sampling parameter out of its range: which field, and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidParam {
    pub param: &'static str,
    pub message: String,
}

impl SamplingParams {
    /// Checks ranges; `vocab_size` bounds `logit_bias` keys. (Sizes are capped where
    /// requests are admitted.)
    pub fn validate(&self, vocab_size: usize) -> Result<(), InvalidParam> {
        let check = |ok: bool, param: &'static str, message: String| match ok {
            true => Ok(()),
            false => Err(InvalidParam { param, message }),
        };
        let in_range = |v: f32, param: &'static str, ok: bool, range: &str| {
            check(v.is_finite(), param, format!("{param} must be a finite number, got {v}"))?;
            check(ok, param, format!("{param} must be {range}, got {v}"))
        };
        in_range(self.temperature, "temperature", self.temperature >= 0.0, ">= 0")?;
        in_range(self.top_p, "top_p", self.top_p > 0.0 && self.top_p <= 1.0, "in (0, 1]")?;
        in_range(self.min_p, "min_p", (0.0..=1.0).contains(&self.min_p), "in [0, 1]")?;
        in_range(self.repetition_penalty, "repetition_penalty", self.repetition_penalty > 0.0, "> 0")?;
        let penalty = |v: f32, param| in_range(v, param, (-2.0..=2.0).contains(&v), "in [-2, 2]");
        penalty(self.frequency_penalty, "frequency_penalty")?;
        penalty(self.presence_penalty, "presence_penalty")?;
        for (&id, &bias) in &self.logit_bias {
            let outside = format!("logit_bias token id {id} is outside the vocabulary ({vocab_size})");
            check((id as usize) < vocab_size, "logit_bias", outside)?;
            let range = format!("logit_bias for token {id} must be in [-100, 100], got {bias}");
            check((-100.0..=100.0).contains(&bias), "logit_bias", range)?;
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
            let err = p.validate(10).unwrap_err();
            assert_eq!(err.param, name, "{err}");
            assert!(err.message.contains(name), "{err}");
        }
        SamplingParams::default().validate(10).unwrap();
    }
}
