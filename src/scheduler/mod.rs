//! Who runs in the next step. Pure logic over sequence metadata and the block allocator:
//! every running decode first (one token each, so no prefill can hold a stream back), then
//! unfinished prefill chunks, then waiting sequences, within `max_num_seqs`,
//! `max_num_batched_tokens` and the free KV blocks; ordered by priority, then arrival. A
//! sequence being admitted reuses the longest chain of cached blocks of its prefix and
//! prefills only the rest. When blocks run out the lowest-priority, newest running sequence
//! not yet in the step is preempted (its blocks released, requeued for recompute) — never a
//! failure.

mod sequence;

pub use sequence::{SeqId, Sequence};

use crate::kv::{BlockAllocator, BlockTable};
use std::collections::HashSet;

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Reuse cached KV blocks of identical prefixes.
    pub prefix_caching: bool,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    /// Tokens already in the cache; this step computes `num_tokens` more after them.
    pub context_len: usize,
    pub num_tokens: usize,
    /// This chunk reaches the end of the sequence, so its last row is sampled.
    pub sample: bool,
}

impl Scheduled {
    /// The next `n` uncomputed tokens of `seq`.
    fn chunk(seq: &Sequence, n: usize) -> Self {
        let context_len = seq.num_computed;
        Scheduled { id: seq.id, context_len, num_tokens: n, sample: context_len + n == seq.tokens.len() }
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    alloc: BlockAllocator,
    /// Sorted by (priority, arrival).
    waiting: Vec<Sequence>,
    /// Sorted by (priority, arrival); the last one is the first to be preempted.
    running: Vec<Sequence>,
    preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and how many of them were found.
    prefix_queries: u64,
    prefix_hits: u64,
    /// Prefill tokens allowed in a step that carries decodes (the step-time budget).
    prefill_limit: Option<usize>,
}

/// The sequence `id` among `lists`.
fn find_mut(lists: [&mut Vec<Sequence>; 2], id: SeqId) -> Option<&mut Sequence> {
    lists.into_iter().flat_map(|l| l.iter_mut()).find(|s| s.id == id)
}

/// Gives an empty sequence the longest chain of cached blocks of its tokens (leaving at
/// least its last token to compute, so it gets logits); returns the tokens reused.
fn reuse_prefix(alloc: &mut BlockAllocator, seq: &mut Sequence, bs: usize) -> usize {
    debug_assert!(seq.num_computed == 0 && seq.block_table.blocks().is_empty());
    seq.block_hashes.clear();
    for i in 0..(seq.tokens.len() - 1) / bs {
        let hash = seq.hash_block(i, bs);
        let Some(block) = alloc.lookup(hash) else { break };
        alloc.retain(block);
        seq.block_table.push(block);
        seq.block_hashes.push(hash);
    }
    seq.num_computed = seq.block_hashes.len() * bs;
    seq.num_computed
}

/// Registers the sequence's blocks that became full (and written) in the prefix cache.
fn register_full_blocks(alloc: &mut BlockAllocator, seq: &mut Sequence, bs: usize) {
    for i in seq.block_hashes.len()..seq.num_computed / bs {
        let hash = seq.hash_block(i, bs);
        alloc.register(seq.block_table.blocks()[i], hash);
        seq.block_hashes.push(hash);
    }
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        assert!(cfg.max_num_seqs > 0 && cfg.max_num_batched_tokens > 0 && cfg.block_size > 0);
        Scheduler {
            cfg,
            alloc: BlockAllocator::new(cfg.num_blocks, cfg.prefix_caching),
            waiting: Vec::new(),
            running: Vec::new(),
            preemptions: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            prefill_limit: None,
        }
    }

    pub fn add(&mut self, seq: Sequence) {
        let at = self.waiting.partition_point(|s| s.order_key() <= seq.order_key());
        self.waiting.insert(at, seq);
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Waiting sequences that had been admitted before (preempted, or forks without room).
    pub fn num_requeued(&self) -> usize {
        self.waiting.iter().filter(|s| s.requeued).count()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// (prompt tokens looked up in the prefix cache, tokens found there), since the start.
    pub fn prefix_cache_counts(&self) -> (u64, u64) {
        (self.prefix_queries, self.prefix_hits)
    }

    /// Blocks held by sequences (cached blocks nobody holds count as free).
    pub fn blocks_used(&self) -> usize {
        self.alloc.num_blocks() - self.alloc.num_free()
    }

    pub fn num_blocks(&self) -> usize {
        self.alloc.num_blocks()
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.running.iter().chain(&self.waiting).find(|s| s.id == id)
    }

    /// Limits the prefill tokens of the next steps that carry decodes (`None`: only the
    /// token budget limits them).
    pub fn set_prefill_limit(&mut self, limit: Option<usize>) {
        self.prefill_limit = limit;
    }

    /// The running sequences that decode next step: (how many, context positions their
    /// rows attend to in total).
    pub fn decode_load(&self) -> (usize, usize) {
        self.running
            .iter()
            .filter(|s| s.tokens.len() - s.num_computed == 1)
            .fold((0, 0), |(n, att), s| (n + 1, att + s.tokens.len()))
    }

    /// Decides the next step. Call [`Scheduler::step_done`] with the result after running it.
    pub fn schedule(&mut self) -> Vec<Scheduled> {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut out = Vec::new();
        let mut taken = HashSet::new();
        let mut preempted = false;
        for decodes in [true, false] {
            if !decodes && !out.is_empty() {
                // Prefill beside decodes: within the step-time budget.
                budget = budget.min(self.prefill_limit.unwrap_or(usize::MAX));
            }
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let seq = &self.running[i];
                let remaining = seq.tokens.len() - seq.num_computed;
                if (remaining == 1) != decodes || taken.contains(&seq.id) {
                    i += 1;
                    continue;
                }
                let n = remaining.min(budget);
                let target = seq.num_computed + n;
                // Free blocks by preempting from the back (never a sequence already in
                // this step) until this one fits, or it is the one preempted.
                let fits = loop {
                    if self.running[i].block_table.reserve(&mut self.alloc, target, bs).is_ok() {
                        break true;
                    }
                    let victim = (i..self.running.len())
                        .rev()
                        .find(|&j| !taken.contains(&self.running[j].id))
                        .expect("sequence i is not in the step");
                    self.preempt(victim);
                    preempted = true;
                    if victim == i {
                        break false;
                    }
                };
                if fits {
                    out.push(Scheduled::chunk(&self.running[i], n));
                    taken.insert(self.running[i].id);
                    budget -= n;
                    i += 1;
                }
            }
        }
        // Admit waiting sequences, unless this step already had to evict.
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs && !self.waiting.is_empty() {
            let seq = &mut self.waiting[0];
            let reused = if self.cfg.prefix_caching { reuse_prefix(&mut self.alloc, seq, bs) } else { 0 };
            let n = (seq.tokens.len() - seq.num_computed).min(budget);
            let target = seq.num_computed + n;
            if seq.block_table.reserve(&mut self.alloc, target, bs).is_err() {
                seq.block_table.release(&mut self.alloc);
                seq.num_computed = 0;
                break;
            }
            if self.cfg.prefix_caching {
                self.prefix_queries += seq.tokens.len() as u64;
                self.prefix_hits += reused as u64;
            }
            let mut seq = self.waiting.remove(0);
            if !seq.requeued {
                seq.cached_tokens = reused;
            }
            seq.requeued = false;
            out.push(Scheduled::chunk(&seq, n));
            budget -= n;
            let at = self.running.partition_point(|s| s.order_key() <= seq.order_key());
            self.running.insert(at, seq);
        }
        out
    }

    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        seq.block_table.release(&mut self.alloc);
        seq.block_hashes.clear();
        seq.num_computed = 0;
        seq.requeued = true;
        self.preemptions += 1;
        self.add(seq);
    }

    /// Records that a step ran: the scheduled tokens are now in the cache.
    /// Blocks that became full are registered in the prefix cache.
    pub fn step_done(&mut self, step: &[Scheduled]) {
        for s in step {
            if let Some(seq) = find_mut([&mut self.running, &mut self.waiting], s.id) {
                seq.num_computed = s.context_len + s.num_tokens;
                register_full_blocks(&mut self.alloc, seq, self.cfg.block_size);
            }
        }
    }

    /// Appends a sampled token to a sequence.
    pub fn append_token(&mut self, id: SeqId, token: u32) {
        if let Some(seq) = find_mut([&mut self.running, &mut self.waiting], id) {
            seq.tokens.push(token);
        }
    }

    /// Removes a finished or aborted sequence and frees its blocks.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let list = if self.running.iter().any(|s| s.id == id) { &mut self.running } else { &mut self.waiting };
        let pos = list.iter().position(|s| s.id == id)?;
        let mut seq = list.remove(pos);
        seq.block_table.release(&mut self.alloc);
        Some(seq)
    }

    /// Starts `child` (holding the same prompt) after running sequence `parent`'s prefill,
    /// with `first_token` appended. It shares the parent's full blocks; the partially
    /// filled last block is copied with `copy_block(src, dst)`. Without room (no free block,
    /// or `max_num_seqs` reached) the child waits and recomputes its prompt instead.
    pub fn fork(&mut self, parent: SeqId, mut child: Sequence, first_token: u32, copy_block: &mut dyn FnMut(u32, u32)) {
        let bs = self.cfg.block_size;
        child.tokens.push(first_token);
        child.requeued = true;
        let Some(p) = self.running.iter().find(|s| s.id == parent) else {
            return self.add(child);
        };
        let computed = p.num_computed;
        let (full, partial) = (computed / bs, computed % bs != 0);
        let shared = p.block_table.blocks()[..computed.div_ceil(bs)].to_vec();
        if self.running.len() >= self.cfg.max_num_seqs || computed + 1 != child.tokens.len() {
            return self.add(child);
        }
        let mut blocks = shared[..full].to_vec();
        if partial {
            let Ok(dst) = self.alloc.allocate(1) else {
                return self.add(child);
            };
            copy_block(shared[full], dst[0]);
            blocks.push(dst[0]);
        }
        for &b in &shared[..full] {
            self.alloc.retain(b);
        }
        child.block_hashes = p.block_hashes.iter().take(full).copied().collect();
        child.block_table = BlockTable::from_blocks(blocks);
        child.num_computed = computed;
        child.requeued = false;
        let at = self.running.partition_point(|s| s.order_key() <= child.order_key());
        self.running.insert(at, child);
    }

    /// Checks that the allocator's books match the sequences' block tables.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut counts = vec![0u32; self.alloc.num_blocks()];
        for s in self.running.iter().chain(&self.waiting) {
            for &b in s.block_table.blocks() {
                counts[b as usize] += 1;
            }
        }
        for (b, &c) in counts.iter().enumerate() {
            let rc = self.alloc.ref_count(b as u32);
            if rc != c {
                return Err(format!("block {b}: ref count {rc}, held by {c} sequences"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
