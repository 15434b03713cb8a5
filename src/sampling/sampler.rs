//! Logits processors and the sampler, applied in vLLM's order: logit bias, penalties, then
//! (unless greedy) temperature, top-k, top-p, min-p and a draw from the sequence's RNG.

use super::{candidates, SamplingParams};
use crate::grammar::TokenMask;
use crate::kernels::exp::exp_scaled;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// A token with its log-probability under the model's (unprocessed) distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
}

/// A prompt token's log-probability given the tokens before it, its rank in that
/// distribution (1 = the most likely), and the `top` most likely tokens there.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    pub token: TokenLogprob,
    pub rank: usize,
    pub top: Vec<TokenLogprob>,
}

impl PromptLogprob {
    /// Scores `id` under a row of raw logits.
    pub fn score(logits: &[f32], id: u32, top: usize) -> Self {
        let (token, top) = log_probs(logits, id, top);
        let l = logits[id as usize];
        let rank = 1 + logits.iter().filter(|&&x| x > l).count();
        PromptLogprob { token, rank, top }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub id: u32,
    /// The chosen token's log-probability and the top alternatives, when asked for.
    pub logprobs: Option<(TokenLogprob, Vec<TokenLogprob>)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Occurrences of each token in the output so far (frequency/presence penalties).
    output_counts: HashMap<u32, u32>,
    /// Tokens of prompt and output (repetition penalty).
    seen: HashMap<u32, ()>,
    scratch: Vec<f32>,
    /// A draw's candidates, their weights, and every token's weight (top-p, plain) or
    /// the candidates' logits (top-k).
    order: Vec<u32>,
    probs: Vec<f32>,
    weights: Vec<f32>,
    /// Tokens kept from being drawn for the first `hold_for` samples (min_tokens).
    held: Vec<u32>,
    hold_for: usize,
    sampled: usize,
}

impl Sampler {
    /// `prompt` seeds the repetition penalty's set of seen tokens.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let seen =
            if params.repetition_penalty != 1.0 { prompt.iter().map(|&t| (t, ())).collect() } else { HashMap::new() };
        Sampler {
            params,
            rng,
            output_counts: HashMap::new(),
            seen,
            scratch: Vec::new(),
            order: Vec::new(),
            probs: Vec::new(),
            weights: Vec::new(),
            held: Vec::new(),
            hold_for: 0,
            sampled: 0,
        }
    }

    /// Keeps `ids` (EOS, stop tokens) from being drawn for the first `tokens` samples:
    /// vLLM's `min_tokens`.
    pub fn hold(&mut self, ids: Vec<u32>, tokens: usize) {
        self.held = ids;
        self.hold_for = tokens;
    }

    /// Records a token the sequence produced, for the penalties.
    fn observe(&mut self, id: u32) {
        *self.output_counts.entry(id).or_default() += 1;
        self.sampled += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(id, ());
        }
    }

    /// Picks the next token from a row of raw logits and records it.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        self.sample_masked(logits, None)
    }

    /// [`Sampler::sample`] among the tokens `allowed` (a structured-output grammar's mask)
    /// only. Log-probabilities stay those of the model's own distribution, as vLLM reports them.
    pub fn sample_masked(&mut self, logits: &[f32], allowed: Option<&TokenMask>) -> Sampled {
        let logprobs = self.params.logprobs.map(|_| ());
        let id = if self.params.is_greedy() && !self.has_processors() && allowed.is_none() {
            // Plain greedy: nothing to change in the row, so no copy of it.
            argmax(logits)
        } else {
            let x = &mut self.scratch;
            x.clear();
            x.extend_from_slice(logits);
            if let Some(mask) = allowed {
                mask_out(x, mask);
            }
            self.apply_processors();
            if self.params.is_greedy() {
                argmax(&self.scratch)
            } else {
                self.draw()
            }
        };
        let logprobs = logprobs.map(|_| log_probs(logits, id, self.params.logprobs.unwrap_or(0)));
        self.observe(id);
        Sampled { id, logprobs }
    }

    /// Whether any logits processor is on (bias or a penalty).
    fn has_processors(&self) -> bool {
        let p = &self.params;
        !p.logit_bias.is_empty()
            || self.sampled < self.hold_for
            || p.repetition_penalty != 1.0
            || p.frequency_penalty != 0.0
            || p.presence_penalty != 0.0
    }

    fn apply_processors(&mut self) {
        let p = &self.params;
        let x = &mut self.scratch;
        for (&id, &b) in &p.logit_bias {
            x[id as usize] += b;
        }
        if self.sampled < self.hold_for {
            for &id in &self.held {
                if let Some(v) = x.get_mut(id as usize) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            for &id in self.seen.keys() {
                let v = &mut x[id as usize];
                *v = if *v > 0.0 { *v / p.repetition_penalty } else { *v * p.repetition_penalty };
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&id, &n) in &self.output_counts {
                x[id as usize] -= p.frequency_penalty * n as f32 + p.presence_penalty;
            }
        }
    }

    /// Temperature, top-k, top-p, min-p, then a draw. Works on the candidates only
    /// ([`candidates`]), so that no setting sorts the whole vocabulary; top-p alone is
    /// taken over the whole distribution, after top-k over the k renormalised, as vLLM does.
    fn draw(&mut self) -> u32 {
        let p = &self.params;
        let x = &self.scratch;
        let scale = 1.0 / p.temperature;
        let max = largest(x);
        let (order, probs, w) = (&mut self.order, &mut self.probs, &mut self.weights);
        if p.top_k > 0 {
            candidates::top_k(x, p.top_k, order);
            // The candidates' logits, then their weights.
            w.clear();
            w.extend(order.iter().map(|&i| x[i as usize]));
            probs.resize(w.len(), 0.0);
            exp_scaled(w, max, scale, probs);
            if p.top_p < 1.0 {
                let total: f32 = probs.iter().sum();
                let mut cum = 0.0;
                let keep = probs
                    .iter()
                    .position(|q| {
                        cum += q / total;
                        cum >= p.top_p
                    })
                    .map_or(probs.len(), |i| i + 1);
                probs.truncate(keep);
                order.truncate(keep);
            }
        } else {
            w.resize(x.len(), 0.0);
            exp_scaled(x, max, scale, w);
            if p.top_p < 1.0 {
                candidates::nucleus(x, w, max, scale, p.top_p, order);
                probs.clear();
                probs.extend(order.iter().map(|&i| w[i as usize]));
            } else {
                order.clear();
                order.extend(0..x.len() as u32);
                std::mem::swap(probs, w);
            }
        }
        if p.min_p > 0.0 {
            let top = probs.iter().cloned().fold(0.0, f32::max);
            for q in probs.iter_mut() {
                if *q < p.min_p * top {
                    *q = 0.0;
                }
            }
        }
        let at = pick(probs, self.rng.random::<f32>());
        at.map_or(order[0], |i| order[i])
    }
}

/// Where a draw `u` in [0, 1) falls among weights `probs` (≥ 0, not normalised): the first
/// index whose running sum passes `u` times the total, only one with weight counting; none
/// when every weight is 0. Blocks' sums first, summed in lanes, so that the walk one value
/// at a time covers one block rather than the vocabulary.
fn pick(probs: &[f32], u: f32) -> Option<usize> {
    const BLOCK: usize = 256;
    let block_sum = |b: &[f32]| {
        let mut lanes = [0f32; 16];
        let chunks = b.chunks_exact(16);
        let tail: f32 = chunks.remainder().iter().sum();
        for c in chunks {
            lanes.iter_mut().zip(c).for_each(|(l, &q)| *l += q);
        }
        lanes.iter().sum::<f32>() + tail
    };
    let sums: Vec<f32> = probs.chunks(BLOCK).map(block_sum).collect();
    let mut r = u * sums.iter().sum::<f32>();
    for (b, &sum) in sums.iter().enumerate() {
        if r >= sum {
            r -= sum;
            continue;
        }
        // The draw is in this block (or, by rounding, a sliver past its end: walk on).
        for (i, &q) in probs.iter().enumerate().skip(b * BLOCK) {
            r -= q;
            if r < 0.0 && q > 0.0 {
                return Some(i);
            }
        }
        break;
    }
    // Rounding left a sliver: the last candidate with mass.
    probs.iter().rposition(|&q| q > 0.0)
}

/// Sets every logit the mask does not allow to -inf (ids past the mask's end included).
fn mask_out(x: &mut [f32], allowed: &TokenMask) {
    let words = allowed.as_slice();
    for (w, chunk) in x.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, v) in chunk.iter_mut().enumerate() {
            if bits >> b & 1 == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

/// Log-probability of `id` and the `top` most likely tokens under `log_softmax(logits)`.
fn log_probs(logits: &[f32], id: u32, top: usize) -> (TokenLogprob, Vec<TokenLogprob>) {
    let max = largest(logits);
    let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
    let lp = |i: u32| TokenLogprob { id: i, logprob: logits[i as usize] - lse };
    let mut best: Vec<u32> = Vec::with_capacity(top + 1);
    if top > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = top.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        idx.truncate(k);
        idx.sort_unstable_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b)));
        best = idx;
    }
    (lp(id), best.into_iter().map(lp).collect())
}

/// The largest value of `x` (NaNs skipped; −∞ when empty), sixteen lanes at a time so
/// that it vectorizes, where a fold of `f32::max` ran one value at a time.
fn largest(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
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
    fn held_tokens_wait_for_min_tokens() {
        let mut l = logits();
        l[7] = 50.0;
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        s.hold(vec![7], 2);
        let ids: Vec<u32> = (0..3).map(|_| s.sample(&l).id).collect();
        assert!(ids[0] != 7 && ids[1] != 7 && ids[2] == 7, "{ids:?}");
    }

    #[test]
    fn a_mask_limits_every_sampler_to_its_tokens() {
        let l = logits();
        let mut mask = TokenMask::alloc(40);
        for id in [3, 33, 39] {
            mask.allow_token(id);
        }
        for p in [SamplingParams::default(), params(|_| {}), params(|p| p.top_k = 2), params(|p| p.top_p = 0.5)] {
            let mut s = Sampler::new(p, &[]);
            for _ in 0..50 {
                let id = s.sample_masked(&l, Some(&mask)).id;
                assert!([3, 33, 39].contains(&id), "{id}");
            }
        }
        // Ids past the mask's end (a model vocabulary padded beyond the tokenizer's) never come.
        let mut high = l.clone();
        high[45] = 100.0;
        assert_ne!(Sampler::new(SamplingParams::default(), &[]).sample_masked(&high, Some(&mask)).id, 45);
    }

    fn logits() -> Vec<f32> {
        (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect()
    }

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() };
        f(&mut p);
        p
    }

    fn draws(p: SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p, &[]);
        let l = logits();
        (0..n).map(|_| s.sample(&l).id).collect()
    }

    #[test]
    fn a_pick_falls_in_proportion_and_never_on_a_zero_weight() {
        // Over several blocks, with zero weights at both ends and between.
        let mut w: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32).powi(2) / 1e4).collect();
        w[..3].fill(0.0);
        w[500..520].fill(0.0);
        w[997..].fill(0.0);
        let total: f64 = w.iter().map(|&q| q as f64).sum();
        let mut counts = vec![0usize; w.len()];
        let draws = 200_000;
        for j in 0..draws {
            let i = pick(&w, j as f32 / draws as f32).expect("some weight");
            assert!(w[i] > 0.0, "picked {i} of weight 0");
            counts[i] += 1;
        }
        assert!(pick(&w, 1.0 - f32::EPSILON).is_some_and(|i| w[i] > 0.0));
        for (i, (&c, &q)) in counts.iter().zip(&w).enumerate() {
            let want = q as f64 / total * draws as f64;
            assert!((c as f64 - want).abs() <= 3.0 + want * 0.01, "{i}: {c} picks, want {want:.1}");
        }
        assert_eq!(pick(&[0.0; 300], 0.5), None);
        assert_eq!(pick(&[], 0.5), None);
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, -1.0, 3.0]), 1);
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        assert_eq!(s.sample(&[0.0, 0.5, 0.2]).id, 1);
    }

    #[test]
    fn same_seed_same_draws() {
        let a = draws(params(|_| {}), 30);
        assert_eq!(a, draws(params(|_| {}), 30));
        assert!(a.iter().any(|&t| t != a[0]), "temperature 1 should vary");
        assert_ne!(a, draws(params(|p| p.seed = Some(8)), 30));
    }

    #[test]
    fn top_k_top_p_min_p_restrict_the_candidates() {
        let l = logits();
        let mut order: Vec<u32> = (0..50).collect();
        order.sort_by(|a, b| l[*b as usize].total_cmp(&l[*a as usize]));
        let top3: Vec<u32> = order[..3].to_vec();
        assert!(draws(params(|p| p.top_k = 3), 200).iter().all(|t| top3.contains(t)));
        // A tiny top_p keeps only the most likely token.
        assert!(draws(params(|p| p.top_p = 1e-6), 50).iter().all(|&t| t == order[0]));
        // min_p = 1 keeps only tokens as likely as the best.
        assert!(draws(params(|p| p.min_p = 1.0), 50).iter().all(|&t| t == order[0]));
    }

    #[test]
    fn penalties_and_bias_change_the_greedy_choice() {
        let l = vec![1.0, 0.9, 0.0];
        let mut s = Sampler::new(SamplingParams { logit_bias: [(2, 5.0)].into(), ..Default::default() }, &[]);
        assert_eq!(s.sample(&l).id, 2);
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..Default::default() }, &[0]);
        assert_eq!(s.sample(&l).id, 1, "0.5 < 0.9 after the penalty");
        let mut s = Sampler::new(SamplingParams { presence_penalty: 0.5, ..Default::default() }, &[]);
        assert_eq!(s.sample(&l).id, 0);
        assert_eq!(s.sample(&l).id, 1, "token 0 now pays the presence penalty");
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 0.06, ..Default::default() }, &[]);
        assert_eq!(s.sample(&l).id, 0);
        assert_eq!(s.sample(&l).id, 0, "1.0 - 0.06 > 0.9");
        assert_eq!(s.sample(&l).id, 1, "1.0 - 0.12 < 0.9");
    }

    #[test]
    fn logprobs_are_log_softmax_of_raw_logits() {
        let l = vec![2.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams { logprobs: Some(2), ..Default::default() }, &[]);
        let out = s.sample(&l);
        let (chosen, top) = out.logprobs.unwrap();
        let z = (2f32.exp() + 1f32.exp() + 1.0).ln();
        assert_eq!(chosen.id, 0);
        assert!((chosen.logprob - (2.0 - z)).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.id).collect::<Vec<_>>(), vec![0, 1]);
        assert!((top[1].logprob - (1.0 - z)).abs() < 1e-6);
    }
}
