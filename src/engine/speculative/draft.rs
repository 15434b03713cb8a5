//! A draft model: a smaller model with the target's vocabulary, run greedily on its own
//! paged KV cache. Each step it first catches up on the tokens it has not seen (the prompt,
//! then whatever the target accepted and sampled), then extends every draft by one token per
//! batched forward pass. K/V of drafts the target accepted stay valid, so only rejected
//! positions are recomputed.

use crate::kv::{BlockAllocator, BlockTable, KvCache, KvCacheDtype};
use crate::loaded::LoadedModel;
use crate::model::{SeqStep, StepInput, Workspace};
use crate::sampling::argmax;
use crate::scheduler::SeqId;
use anyhow::{ensure, Result};
use std::collections::HashMap;
use std::sync::Arc;

pub struct DraftModel {
    model: Arc<LoadedModel>,
    kv: KvCache,
    alloc: BlockAllocator,
    seqs: HashMap<SeqId, Fed>,
    ws: Workspace,
    /// Catch-up tokens fed per step at most, so a long prompt is caught up in chunks.
    max_catch_up: usize,
    /// Rows of the target's logits: drafts must be ids below it.
    target_vocab: usize,
    /// The draft model's own context: it drafts only for sequences within it.
    context: usize,
    /// Milliseconds of a drafting pass per sequence in it (a recent average): the price of a
    /// draft token.
    token_ms: f64,
}

/// What the draft cache holds for one sequence: the K/V of `tokens`, in `table`.
#[derive(Default)]
struct Fed {
    tokens: Vec<u32>,
    table: BlockTable,
}

impl DraftModel {
    /// `draft` must share `target`'s vocabulary. Its cache holds `capacity_tokens` positions in
    /// blocks of `block_size`.
    pub fn new(
        draft: Arc<LoadedModel>,
        target: &LoadedModel,
        capacity_tokens: usize,
        block_size: usize,
        max_catch_up: usize,
        kv: KvCacheDtype,
    ) -> Result<Self> {
        same_vocabulary(&draft, target)?;
        let c = &draft.model.config;
        anyhow::ensure!(c.state_floats() == 0, "a draft model with recurrent (DeltaNet) layers is not supported");
        let context = c.max_position_embeddings;
        let num_blocks = capacity_tokens.div_ceil(block_size).max(1);
        let kv = KvCache::new(draft.model.kv_dtype(kv), &c.kv_shapes(), num_blocks, block_size);
        Ok(DraftModel {
            model: draft,
            kv,
            alloc: BlockAllocator::new(num_blocks, false),
            seqs: HashMap::new(),
            ws: Workspace::default(),
            max_catch_up: max_catch_up.max(1),
            target_vocab: target.model.config.vocab_size,
            context,
            token_ms: 0.0,
        })
    }

    /// Forgets sequences that `alive` no longer knows, freeing their blocks.
    pub fn retain(&mut self, alive: impl Fn(SeqId) -> bool) {
        let alloc = &mut self.alloc;
        self.seqs.retain(|&id, fed| {
            let keep = alive(id);
            if !keep {
                fed.table.release(alloc);
            }
            keep
        });
    }

    /// What drafting one token takes, in milliseconds (0 before the first).
    pub fn token_ms(&self) -> f64 {
        self.token_ms
    }

    /// Forgets every sequence (after an engine failure).
    pub fn clear(&mut self) {
        self.retain(|_| false);
    }

    /// Drafts for each `(sequence, its tokens, at most k)`, in order. A sequence still
    /// catching up on a long prompt, or finding no room in the draft cache, gets none.
    pub fn propose(&mut self, want: &[(SeqId, &[u32], usize)]) -> Vec<Vec<u32>> {
        let bs = self.kv.block_size();
        let mut drafts = vec![Vec::new(); want.len()];
        // The draft model feeds positions up to len + k - 2: within its own context.
        let ks: Vec<usize> = want.iter().map(|&(_, t, k)| k.min((self.context + 1).saturating_sub(t.len()))).collect();
        // (index in `want`, first position to feed, tokens to feed) for the catch-up pass.
        let mut feeds: Vec<(usize, usize, usize)> = Vec::new();
        let mut budget = self.max_catch_up;
        for (i, &(id, tokens, _)) in want.iter().enumerate() {
            let k = ks[i];
            if k == 0 {
                continue;
            }
            let fed = self.seqs.entry(id).or_default();
            let common = fed.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
            fed.tokens.truncate(common);
            fed.table.truncate(&mut self.alloc, common, bs);
            let n = (tokens.len() - common).min(budget);
            if n == 0 {
                continue;
            }
            // Room for the catch-up and the k - 1 drafts fed back after it.
            if fed.table.reserve(&mut self.alloc, common + n + k - 1, bs).is_err() {
                fed.table.release(&mut self.alloc);
                fed.tokens.clear();
                continue;
            }
            budget -= n;
            feeds.push((i, common, n));
        }
        // Pass 0 feeds the catch-up; pass j feeds draft token j back. Only sequences whose
        // catch-up reached their end draft.
        let mut active: Vec<(usize, usize, usize)> = feeds;
        let mut input: Vec<u32> = Vec::new();
        for pass in 0.. {
            // After pass 0, exactly the sequences that reached their end hold a draft token.
            active.retain(|&(i, ..)| pass == 0 || (!drafts[i].is_empty() && drafts[i].len() < ks[i]));
            if active.is_empty() {
                break;
            }
            input.clear();
            let mut steps = Vec::with_capacity(active.len());
            for &(i, start, n) in &active {
                let (id, tokens, _) = want[i];
                let fed = &self.seqs[&id];
                if pass == 0 {
                    input.extend_from_slice(&tokens[start..start + n]);
                } else {
                    input.push(*drafts[i].last().expect("a pass after 0 feeds a draft"));
                }
                let reaches_end = pass > 0 || start + n == tokens.len();
                steps.push(SeqStep {
                    context_len: start,
                    num_tokens: n,
                    seq_len: start + n,
                    block_table: fed.table.blocks(),
                    // A draft model attends in every layer ([`DraftModel::new`]): no state.
                    state_slot: 0,
                    captures: &[],
                    logits: usize::from(reaches_end),
                    hidden: 0,
                });
            }
            let vocab = self.model.model.config.vocab_size;
            let t0 = std::time::Instant::now();
            let logits =
                self.model.model.forward(&StepInput { tokens: &input, seqs: &steps }, &mut self.kv, &mut self.ws);
            if pass > 0 {
                // Drafting passes only: the catch-up pass may carry a whole prompt.
                let ms = t0.elapsed().as_secs_f64() * 1e3 / active.len() as f64;
                self.token_ms = if self.token_ms == 0.0 { ms } else { 0.9 * self.token_ms + 0.1 * ms };
            }
            let mut pick = logits.chunks_exact(vocab).map(argmax);
            let mut fed_at = 0;
            for a in active.iter_mut() {
                let (i, start, n) = *a;
                let (id, tokens, _) = want[i];
                let fed = self.seqs.get_mut(&id).expect("fed above");
                fed.tokens.extend_from_slice(&input[fed_at..fed_at + n]);
                fed_at += n;
                if pass > 0 || start + n == tokens.len() {
                    drafts[i].push(pick.next().expect("one pick per row with logits"));
                }
                *a = (i, start + n, 1);
            }
        }
        // A padded draft vocabulary may pick ids the target does not have: the draft ends there.
        for d in &mut drafts {
            if let Some(bad) = d.iter().position(|&t| t as usize >= self.target_vocab) {
                d.truncate(bad);
            }
        }
        drafts
    }
}

/// Refuses a draft whose token ids would mean different text than the target's.
fn same_vocabulary(draft: &LoadedModel, target: &LoadedModel) -> Result<()> {
    let (d, t) = (&draft.tokenizer, &target.tokenizer);
    ensure!(
        d.vocab_size() == t.vocab_size(),
        "the draft model's vocabulary has {} tokens, the target's {}: speculative decoding needs the same vocabulary",
        d.vocab_size(),
        t.vocab_size()
    );
    // Every 61st id decodes to the same text (a cheap check against a different tokenizer).
    for id in (0..t.vocab_size() as u32).step_by(61) {
        ensure!(
            d.decode(&[id], false).ok() == t.decode(&[id], false).ok(),
            "token {id} decodes differently in the draft model: speculative decoding needs the same vocabulary"
        );
    }
    Ok(())
}
