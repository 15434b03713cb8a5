//! Speculative decoding: a proposer guesses a sequence's next tokens, the target model
//! verifies all of them in the sequence's decode row block of the normal step, and the
//! longest prefix the target agrees with is kept, plus the target's own next token.
//!
//! Drafts here are point guesses (n-gram lookup, or the draft model's argmax), so the draft
//! distribution q is one-hot. Rejection sampling with a one-hot q — accept draft d with
//! probability p(d), else draw from p without d — is exactly "draw from p, keep the draft
//! while it equals the draw". That is what verification does, with the sequence's own
//! sampler: every emitted token is drawn from the target's distribution by the same RNG
//! calls as without speculation, so greedy and seeded outputs are unchanged, not just
//! equal in distribution.

pub mod draft;
pub mod ngram;

use crate::loaded::LoadedModel;
use crate::model::WeightDtype;
use crate::scheduler::{Scheduler, SeqId};
use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use std::path::PathBuf;
use std::sync::Arc;

/// Most draft tokens per sequence and step.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;
/// Longest n-gram prompt lookup matches.
const MAX_LOOKUP: usize = 64;

/// `--speculative-config`, vLLM's JSON shape.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeConfig {
    pub method: Method,
    /// Draft tokens proposed per step at most (fewer when they do not pay, see [`worth`]).
    pub num_speculative_tokens: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Method {
    /// Prompt lookup over the sequence's own tokens, matching `min..=max` trailing tokens.
    Ngram { min: usize, max: usize },
    /// A smaller model with the same vocabulary, run greedily on its own KV cache.
    DraftModel { model: PathBuf },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    method: Option<String>,
    num_speculative_tokens: usize,
    prompt_lookup_min: Option<usize>,
    prompt_lookup_max: Option<usize>,
    model: Option<PathBuf>,
}

impl std::str::FromStr for SpeculativeConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s).map_err(|e| format!("{e:#}"))
    }
}

impl SpeculativeConfig {
    /// `{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":5}`
    /// or `{"method":"draft_model","model":PATH,"num_speculative_tokens":4}` (a `model`
    /// without `method` means a draft model, as in vLLM).
    pub fn parse(s: &str) -> Result<Self> {
        let raw: Raw = serde_json::from_str(s).map_err(|e| anyhow::anyhow!("speculative config: {e}"))?;
        let k = raw.num_speculative_tokens;
        ensure!(
            (1..=MAX_SPECULATIVE_TOKENS).contains(&k),
            "num_speculative_tokens must be in 1..={MAX_SPECULATIVE_TOKENS}, got {k}"
        );
        let method = match (raw.method.as_deref(), raw.model) {
            (Some("ngram"), None) => {
                // vLLM's defaults: one bound given sets the other; neither, both 5.
                let (min, max) = match (raw.prompt_lookup_min, raw.prompt_lookup_max) {
                    (Some(a), Some(b)) => (a, b),
                    (Some(a), None) | (None, Some(a)) => (a, a),
                    (None, None) => (5, 5),
                };
                ensure!(
                    1 <= min && min <= max && max <= MAX_LOOKUP,
                    "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= {MAX_LOOKUP}, got {min} and {max}"
                );
                Method::Ngram { min, max }
            }
            (Some("ngram"), Some(_)) => bail!("method \"ngram\" takes no model"),
            (Some("draft_model") | None, Some(model)) => {
                ensure!(
                    raw.prompt_lookup_min.is_none() && raw.prompt_lookup_max.is_none(),
                    "prompt_lookup_min/max belong to method \"ngram\""
                );
                Method::DraftModel { model }
            }
            (Some("draft_model") | None, None) => bail!("a draft model needs \"model\": a path weft can load"),
            (Some(other), _) => bail!("unknown speculative method {other:?} (ngram or draft_model)"),
        };
        Ok(SpeculativeConfig { method, num_speculative_tokens: k })
    }
}

/// The engine's speculation: a proposer, and the most draft tokens per sequence and step.
pub struct Speculator {
    pub max_tokens: usize,
    proposer: Proposer,
}

enum Proposer {
    Ngram { min: usize, max: usize },
    Draft(Box<draft::DraftModel>),
}

impl Speculator {
    /// For `target`, whose KV cache holds `capacity_tokens` positions in blocks of
    /// `block_size`; a draft model gets a cache of as many positions, and catches up at most
    /// `max_catch_up` tokens per step.
    pub fn new(
        cfg: &SpeculativeConfig,
        target: &LoadedModel,
        capacity_tokens: usize,
        block_size: usize,
        max_catch_up: usize,
    ) -> Result<Self> {
        let proposer = match &cfg.method {
            &Method::Ngram { min, max } => Proposer::Ngram { min, max },
            Method::DraftModel { model } => {
                let loaded = LoadedModel::open(model, WeightDtype::Auto)
                    .with_context(|| format!("loading the draft model {}", model.display()))?;
                let d = draft::DraftModel::new(Arc::new(loaded), target, capacity_tokens, block_size, max_catch_up)?;
                Proposer::Draft(Box::new(d))
            }
        };
        Ok(Speculator { max_tokens: cfg.num_speculative_tokens, proposer })
    }

    /// Gives each `(sequence, at most k)` of `want` its draft (possibly none).
    pub fn propose<S>(&mut self, sched: &mut Scheduler<S>, want: &[(SeqId, usize)]) {
        match &mut self.proposer {
            &mut Proposer::Ngram { min, max } => {
                for &(id, k) in want {
                    if let Some(seq) = sched.get_mut(id) {
                        seq.draft = ngram::propose(&seq.tokens, min, max, k);
                    }
                }
            }
            Proposer::Draft(d) => {
                d.retain(|id| sched.get(id).is_some());
                let asks: Vec<(SeqId, &[u32], usize)> =
                    want.iter().filter_map(|&(id, k)| sched.get(id).map(|s| (id, s.tokens.as_slice(), k))).collect();
                let drafts = d.propose(&asks);
                let ids: Vec<SeqId> = asks.iter().map(|a| a.0).collect();
                for (id, draft) in ids.into_iter().zip(drafts) {
                    if let Some(seq) = sched.get_mut(id) {
                        seq.draft = draft;
                    }
                }
            }
        }
    }

    /// What proposing one more draft token costs a sequence, in milliseconds, beyond its
    /// row in the target's step: nothing for n-gram lookup; its share of a drafting pass
    /// for a draft model.
    pub fn token_ms(&self) -> f64 {
        match &self.proposer {
            Proposer::Ngram { .. } => 0.0,
            Proposer::Draft(d) => d.token_ms(),
        }
    }

    /// Forgets all per-sequence state (after an engine failure).
    pub fn reset(&mut self) {
        if let Proposer::Draft(d) = &mut self.proposer {
            d.clear();
        }
    }
}

/// How often draft tokens are accepted, recent drafts weighing most: per sequence, and
/// pooled over the engine's sequences (the prior a sequence starts from).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Acceptance {
    hits: f64,
    tries: f64,
    /// Weight kept by the past at each verified draft.
    decay: f64,
}

/// The pooled estimate before any draft was verified.
pub const FIRST_PRIOR: f64 = 0.7;
/// The prior's weight, in tries.
const PRIOR_TRIES: f64 = 2.0;
/// Weight kept by the past at each step whose drafts were judged not worth it, so a
/// sequence whose drafts stopped paying drifts back to the prior and tries again.
const REST: f64 = 0.95;

impl Acceptance {
    /// One sequence's: the last few drafts count.
    pub fn sequence() -> Self {
        Acceptance { hits: 0.0, tries: 0.0, decay: 0.8 }
    }

    /// The engine's, over every sequence: the last few hundred draft tokens count.
    pub fn pooled() -> Self {
        Acceptance { hits: 0.0, tries: 0.0, decay: 0.99 }
    }

    /// The estimated chance that a draft token is accepted, given that the ones before
    /// were, starting from `prior`.
    pub fn rate(&self, prior: f64) -> f64 {
        (self.hits + PRIOR_TRIES * prior) / (self.tries + PRIOR_TRIES)
    }

    /// A draft of `drafted` tokens had its first `accepted` accepted: `accepted` trials
    /// succeeded, and one failed unless all did.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        let failed = usize::from(accepted < drafted);
        self.hits = self.hits * self.decay + accepted as f64;
        self.tries = self.tries * self.decay + (accepted + failed) as f64;
    }

    /// A step went by in which drafts were not worth proposing.
    pub fn rest(&mut self) {
        self.hits *= REST;
        self.tries *= REST;
    }
}

/// Draft tokens worth verifying, at most `max`, for a sequence whose drafts are accepted at
/// `rate`, in a step of `decodes` decoding sequences predicted to take `step_ms`, where each
/// extra row costs `row_ms`.
///
/// Draft token j adds a token only if it and all before it are accepted: probability
/// rate^j. Its row costs `row_ms`. The step makes tokens at `decodes / step_ms`; a row is
/// worth adding while it makes tokens faster than that. One stream is bound by reading the
/// weights, so `step_ms` is large against `row_ms` and even unlikely drafts pay. Many streams
/// make the step compute-bound: a row costs about as much as a stream's whole token, and only
/// near-certain drafts still pay — speculation backs off by itself as the batch grows.
pub fn worth(rate: f64, step_ms: f64, decodes: usize, row_ms: f64, max: usize) -> usize {
    let per_token = step_ms / decodes.max(1) as f64;
    let mut k = 0;
    let mut p = rate;
    while k < max && p * per_token > row_ms {
        k += 1;
        p *= rate;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_shaped_configs() {
        let c = SpeculativeConfig::parse(
            r#"{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":5}"#,
        )
        .unwrap();
        assert_eq!(c, SpeculativeConfig { method: Method::Ngram { min: 2, max: 5 }, num_speculative_tokens: 4 });
        let c = SpeculativeConfig::parse(r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}"#);
        assert_eq!(c.unwrap().method, Method::Ngram { min: 4, max: 4 });
        let c = SpeculativeConfig::parse(r#"{"model":"d.gguf","num_speculative_tokens":2}"#).unwrap();
        assert_eq!(c.method, Method::DraftModel { model: "d.gguf".into() });
        for (bad, says) in [
            (r#"{"method":"ngram","num_speculative_tokens":0}"#, "num_speculative_tokens"),
            (r#"{"method":"ngram","num_speculative_tokens":99}"#, "num_speculative_tokens"),
            (r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":3,"prompt_lookup_max":2}"#, "min"),
            (r#"{"method":"eagle","num_speculative_tokens":2}"#, "eagle"),
            (r#"{"method":"draft_model","num_speculative_tokens":2}"#, "model"),
            (r#"{"method":"ngram","num_speculative_tokens":2,"typo":1}"#, "typo"),
            (r#"{"method":"ngram"}"#, "num_speculative_tokens"),
        ] {
            let err = SpeculativeConfig::parse(bad).unwrap_err().to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn acceptance_follows_recent_drafts_and_rests_back_to_the_prior() {
        let mut a = Acceptance::sequence();
        assert!((a.rate(0.6) - 0.6).abs() < 1e-9, "no drafts yet: the prior");
        for _ in 0..20 {
            a.record(4, 0);
        }
        assert!(a.rate(0.7) < 0.21, "{}", a.rate(0.7));
        for _ in 0..200 {
            a.rest();
        }
        assert!((a.rate(0.7) - 0.7).abs() < 0.01, "{}", a.rate(0.7));
        for _ in 0..20 {
            a.record(4, 4);
        }
        assert!(a.rate(0.7) > 0.95, "{}", a.rate(0.7));
        // The pooled estimate remembers longer: ten good drafts after a hundred bad ones
        // convince one sequence's estimate, not the pool's.
        let (mut pooled, mut one) = (Acceptance::pooled(), Acceptance::sequence());
        for accepted in [0; 100].into_iter().chain([4; 10]) {
            pooled.record(4, accepted);
            one.record(4, accepted);
        }
        assert!(pooled.rate(0.7) < 0.5 && one.rate(0.7) > 0.9, "{} {}", pooled.rate(0.7), one.rate(0.7));
    }

    #[test]
    fn drafts_shrink_as_the_step_turns_compute_bound() {
        // One stream: a 6 ms step, rows at 1 ms: tokens accepted 70% of the time pay up to
        // 0.7^5 · 6 = 1.01 ms.
        assert_eq!(worth(0.7, 6.0, 1, 1.0, 8), 5);
        assert_eq!(worth(0.7, 6.0, 1, 1.0, 3), 3, "capped");
        // 32 streams in a 64 ms step: a stream's token costs 2 ms, so only p > 0.5 pays.
        assert_eq!(worth(0.7, 64.0, 32, 1.0, 8), 1);
        assert_eq!(worth(0.4, 64.0, 32, 1.0, 8), 0);
        assert_eq!(worth(0.99, 6.0, 1, 0.0, 4), 4, "free rows: the cap");
    }
}
