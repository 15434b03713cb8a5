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
//!
//! How many tokens to draft is priced per sequence and step ([`worth`]): the chance that a
//! draft token is reached and accepted against what its row costs. N-gram drafts are judged
//! by the length of the match that proposed them (a 1-token match is rarely right, a 5-token
//! match in a copied passage nearly always); draft-model drafts by the sequence's record.

pub mod acceptance;
pub mod config;
pub mod draft;
pub mod ngram;

pub use acceptance::{worth, Acceptance, FIRST_PRIOR};
pub use config::{Method, SpeculativeConfig, MAX_SPECULATIVE_TOKENS};

use crate::kv::KvCacheDtype;
use crate::loaded::LoadedModel;
use crate::model::WeightDtype;
use crate::scheduler::{Scheduler, SeqId};
use anyhow::{Context, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// A decoding sequence that may draft this step.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    pub id: SeqId,
    /// Draft tokens that fit its `max_tokens` and the context.
    pub room: usize,
    /// What a draft row costs in the target's step, milliseconds.
    pub row_ms: f64,
}

/// The engine's speculation: a proposer, the most draft tokens per sequence and step, and
/// the acceptance records that price drafts.
pub struct Speculator {
    max_tokens: usize,
    proposer: Proposer,
    /// Over every draft: the prior of the finer estimates.
    pooled: Acceptance,
    /// Per sequence (draft model).
    seqs: HashMap<SeqId, Acceptance>,
    /// Per match length (n-gram), index n.
    by_len: Vec<Acceptance>,
    /// The match length of each n-gram draft now being verified.
    pending: HashMap<SeqId, usize>,
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
        kv: KvCacheDtype,
    ) -> Result<Self> {
        let (proposer, lens) = match &cfg.method {
            &Method::Ngram { min, max } => (Proposer::Ngram { min, max }, max + 1),
            Method::DraftModel { model } => {
                let loaded = LoadedModel::open(model, WeightDtype::Auto)
                    .with_context(|| format!("loading the draft model {}", model.display()))?;
                let d =
                    draft::DraftModel::new(Arc::new(loaded), target, capacity_tokens, block_size, max_catch_up, kv)?;
                (Proposer::Draft(Box::new(d)), 0)
            }
        };
        Ok(Speculator {
            max_tokens: cfg.num_speculative_tokens,
            proposer,
            pooled: Acceptance::pooled(),
            seqs: HashMap::new(),
            by_len: vec![Acceptance::pooled(); lens],
            pending: HashMap::new(),
        })
    }

    /// Gives the sequences of `asks` the drafts worth verifying (possibly none), when a
    /// token of this step costs `token_ms` (the step's predicted time over its decodes).
    pub fn propose<S>(&mut self, sched: &mut Scheduler<S>, asks: &[Ask], token_ms: f64) {
        self.seqs.retain(|&id, _| sched.get(id).is_some());
        self.pending.clear();
        for ask in asks {
            if let Some(seq) = sched.get_mut(ask.id) {
                seq.draft.clear();
            }
        }
        let prior = self.pooled.rate(FIRST_PRIOR);
        match &mut self.proposer {
            &mut Proposer::Ngram { min, max } => {
                for ask in asks {
                    let Some(seq) = sched.get_mut(ask.id) else { continue };
                    let cap = ask.room.min(self.max_tokens);
                    let Some((n, mut draft)) = ngram::propose(&seq.tokens, min, max, cap) else { continue };
                    let record = &mut self.by_len[n];
                    let k = worth(record.rate(prior), token_ms, ask.row_ms, draft.len());
                    if k == 0 {
                        record.rest();
                        continue;
                    }
                    draft.truncate(k);
                    seq.draft = draft;
                    self.pending.insert(ask.id, n);
                }
            }
            Proposer::Draft(d) => {
                d.retain(|id| sched.get(id).is_some());
                let mut want: Vec<(SeqId, &[u32], usize)> = Vec::new();
                for ask in asks {
                    let record = self.seqs.entry(ask.id).or_insert_with(Acceptance::sequence);
                    let k =
                        worth(record.rate(prior), token_ms, ask.row_ms + d.token_ms(), ask.room.min(self.max_tokens));
                    if k == 0 {
                        record.rest();
                    } else if let Some(seq) = sched.get(ask.id) {
                        want.push((ask.id, seq.tokens.as_slice(), k));
                    }
                }
                let drafts = d.propose(&want);
                let ids: Vec<SeqId> = want.iter().map(|w| w.0).collect();
                for (id, draft) in ids.into_iter().zip(drafts) {
                    if let Some(seq) = sched.get_mut(id) {
                        seq.draft = draft;
                    }
                }
            }
        }
    }

    /// Records that `accepted` of a sequence's `drafted` draft tokens were accepted.
    pub fn verified(&mut self, id: SeqId, drafted: usize, accepted: usize) {
        self.pooled.record(drafted, accepted);
        match self.pending.get(&id) {
            Some(&n) => self.by_len[n].record(drafted, accepted),
            None => self.seqs.entry(id).or_insert_with(Acceptance::sequence).record(drafted, accepted),
        }
    }

    /// Forgets all per-sequence state (after an engine failure).
    pub fn reset(&mut self) {
        self.seqs.clear();
        self.pending.clear();
        if let Proposer::Draft(d) = &mut self.proposer {
            d.clear();
        }
    }
}
