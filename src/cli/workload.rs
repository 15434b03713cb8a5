//! Prompt and output lengths that look like real traffic, drawn from
//! `workloads/chat-mix.json` (the mix the CI soak, `scripts/soak.py`, sends too), or from a
//! uniform range where a benchmark asks for one.

use serde::Deserialize;

/// Lengths `min..=max`, chosen with this relative weight.
#[derive(Debug, Clone, Deserialize, PartialEq)]
struct Bucket {
    weight: u32,
    min: usize,
    max: usize,
}

/// Where a workload's prompt and output lengths come from.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct LengthMix {
    prompt_tokens: Vec<Bucket>,
    output_tokens: Vec<Bucket>,
}

impl LengthMix {
    /// Chat and RAG traffic: short turns to documents of several thousand tokens.
    pub fn chat() -> Self {
        serde_json::from_str(include_str!("../../workloads/chat-mix.json")).expect("workloads/chat-mix.json parses")
    }

    /// Uniform lengths in `prompt` and `output` (MIN, MAX).
    pub fn uniform(prompt: (usize, usize), output: (usize, usize)) -> Self {
        let one = |(min, max)| vec![Bucket { weight: 1, min, max }];
        LengthMix { prompt_tokens: one(prompt), output_tokens: one(output) }
    }

    /// A (prompt, output) length pair; `rand(lo, hi)` draws uniformly from `lo..=hi`.
    pub fn draw(&self, rand: &mut dyn FnMut(usize, usize) -> usize) -> (usize, usize) {
        (pick(&self.prompt_tokens, rand), pick(&self.output_tokens, rand))
    }
}

fn pick(buckets: &[Bucket], rand: &mut dyn FnMut(usize, usize) -> usize) -> usize {
    let total: u32 = buckets.iter().map(|b| b.weight).sum();
    let mut at = rand(0, total as usize - 1) as u32;
    for b in buckets {
        if at < b.weight {
            return rand(b.min, b.max);
        }
        at -= b.weight;
    }
    unreachable!("a draw below the total weight falls in a bucket")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chat mix draws from every bucket, in its ranges, about as often as weighted.
    #[test]
    fn chat_mix_draws_every_bucket() {
        let mix = LengthMix::chat();
        let mut state = 7u64;
        let mut rand = |lo: usize, hi: usize| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + ((state >> 33) % (hi - lo + 1) as u64) as usize
        };
        let draws: Vec<(usize, usize)> = (0..4000).map(|_| mix.draw(&mut rand)).collect();
        let (lo, hi) = (mix.prompt_tokens[0].min, mix.prompt_tokens[3].max);
        assert!(draws.iter().all(|&(p, _)| (lo..=hi).contains(&p)));
        let long = draws.iter().filter(|&&(p, _)| p > 3072).count();
        assert!((100..300).contains(&long), "5 % of 4000 prompts are documents, got {long}");
        let short = draws.iter().filter(|&&(p, _)| p <= 128).count();
        assert!((1600..2000).contains(&short), "45 % are chat turns, got {short}");
        assert_eq!(LengthMix::uniform((3, 3), (5, 5)).draw(&mut rand), (3, 5));
    }
}
