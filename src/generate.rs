//! Lockstep generation: a fixed set of prompts is prefilled in one ragged step, then all
//! decode together, one token each per step, until each one stops. The continuous-batching
//! engine generalises this; this path serves `weft generate` and the batching tests.

use crate::kv::{BlockAllocator, BlockTable, KvCache};
use crate::model::{Llama, SeqStep, StepInput, Workspace};
use crate::sampling::{Sampler, SamplingParams};
use anyhow::{ensure, Result};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end the sequence (empty to ignore EOS).
    pub stop_ids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Debug, Clone)]
pub struct GenOutput {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct GenTimings {
    pub prefill: Duration,
    pub decode: Duration,
    pub decode_steps: usize,
}

/// Blocks the requests need at most (prompt plus every generated token).
pub fn blocks_needed(reqs: &[GenRequest], block_size: usize) -> usize {
    reqs.iter()
        .map(|r| (r.prompt.len() + r.max_tokens).div_ceil(block_size))
        .sum()
}

/// Runs all requests to completion; `on_token(request index, token)` sees each new token.
pub fn generate_lockstep(
    model: &Llama,
    kv: &mut KvCache,
    reqs: &[GenRequest],
    mut on_token: impl FnMut(usize, u32),
) -> Result<(Vec<GenOutput>, GenTimings)> {
    let max_ctx = model.config.max_position_embeddings;
    for (i, r) in reqs.iter().enumerate() {
        ensure!(
            !r.prompt.is_empty(),
            "request {i}: empty prompt (this model adds no BOS token)"
        );
        ensure!(
            r.prompt.len() + r.max_tokens <= max_ctx,
            "request {i}: prompt ({} tokens) + max_tokens ({}) exceeds the context length {max_ctx}",
            r.prompt.len(),
            r.max_tokens
        );
    }
    let bs = kv.block_size();
    let mut alloc = BlockAllocator::new(kv.num_blocks());
    let mut tables: Vec<BlockTable> = vec![BlockTable::default(); reqs.len()];
    for (t, r) in tables.iter_mut().zip(reqs) {
        t.reserve(&mut alloc, r.prompt.len() + r.max_tokens, bs)?;
    }
    let mut samplers = reqs
        .iter()
        .map(|r| Sampler::new(r.sampling))
        .collect::<Result<Vec<_>>>()?;
    let mut outs: Vec<GenOutput> = reqs
        .iter()
        .map(|_| GenOutput {
            tokens: Vec::new(),
            finish: FinishReason::Length,
        })
        .collect();
    let mut done: Vec<bool> = reqs.iter().map(|r| r.max_tokens == 0).collect();
    let mut ws = Workspace::default();
    let mut timings = GenTimings::default();
    let vocab = model.config.vocab_size;

    let mut first = true;
    while done.iter().any(|d| !d) {
        let start = Instant::now();
        let active: Vec<usize> = (0..reqs.len()).filter(|&i| !done[i]).collect();
        let mut tokens = Vec::new();
        let mut seqs = Vec::new();
        for &i in &active {
            let (r, o) = (&reqs[i], &outs[i]);
            let (ctx, new): (usize, &[u32]) = if first {
                (0, &r.prompt)
            } else {
                (
                    r.prompt.len() + o.tokens.len() - 1,
                    &o.tokens[o.tokens.len() - 1..],
                )
            };
            tokens.extend_from_slice(new);
            seqs.push(SeqStep {
                context_len: ctx,
                num_tokens: new.len(),
                block_table: tables[i].blocks(),
                sample: true,
            });
        }
        let logits = model.forward(
            &StepInput {
                tokens: &tokens,
                seqs: &seqs,
            },
            kv,
            &mut ws,
        );
        for (row, &i) in active.iter().enumerate() {
            let tok = samplers[i].sample(&logits[row * vocab..(row + 1) * vocab]);
            outs[i].tokens.push(tok);
            on_token(i, tok);
            if reqs[i].stop_ids.contains(&tok) {
                outs[i].finish = FinishReason::Stop;
                done[i] = true;
            } else if outs[i].tokens.len() >= reqs[i].max_tokens {
                done[i] = true;
            }
        }
        if first {
            timings.prefill = start.elapsed();
        } else {
            timings.decode += start.elapsed();
            timings.decode_steps += 1;
        }
        first = false;
    }
    for t in &mut tables {
        t.release(&mut alloc);
    }
    debug_assert_eq!(alloc.num_free(), alloc.num_blocks());
    Ok((outs, timings))
}
