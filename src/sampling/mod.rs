//! Choosing the next token from logits, per sequence with its own RNG, so a seeded
//! request draws the same tokens whatever else shares the batch.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            seed: None,
        }
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    probs: Vec<f32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> anyhow::Result<Self> {
        anyhow::ensure!(
            params.temperature.is_finite() && params.temperature >= 0.0,
            "temperature must be a finite number >= 0, got {}",
            params.temperature
        );
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Ok(Sampler {
            params,
            rng,
            probs: Vec::new(),
        })
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.params.temperature;
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        self.probs.clear();
        self.probs
            .extend(logits.iter().map(|l| ((l - max) * inv_t).exp()));
        let total: f32 = self.probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, p) in self.probs.iter().enumerate() {
            r -= p;
            if r <= 0.0 {
                return i as u32;
            }
        }
        argmax(logits)
    }
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, -1.0, 3.0]), 1);
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.0, 0.5, 0.2]), 1);
    }

    #[test]
    fn same_seed_same_draws_and_low_temperature_is_nearly_greedy() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
        };
        let (mut a, mut b) = (Sampler::new(p).unwrap(), Sampler::new(p).unwrap());
        let da: Vec<u32> = (0..20).map(|_| a.sample(&logits)).collect();
        let db: Vec<u32> = (0..20).map(|_| b.sample(&logits)).collect();
        assert_eq!(da, db);
        assert!(da.iter().any(|&t| t != da[0]), "temperature 1 should vary");
        let mut cold = Sampler::new(SamplingParams {
            temperature: 1e-3,
            seed: Some(1),
        })
        .unwrap();
        assert_eq!(cold.sample(&logits), argmax(&logits));
    }

    #[test]
    fn rejects_bad_temperature() {
        assert!(Sampler::new(SamplingParams {
            temperature: -1.0,
            seed: None
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            temperature: f32::NAN,
            seed: None
        })
        .is_err());
    }
}
