//! Who runs in the next step. Pure logic over sequence metadata and the block allocator:
//! running sequences first (decodes and unfinished prefill chunks), then waiting ones,
//! within `max_num_seqs`, `max_num_batched_tokens` and the free KV blocks; ordered by
//! priority, then arrival. When blocks run out the lowest-priority, newest running
//! sequence is preempted (its blocks freed, requeued for recompute) — never a failure.

mod sequence;

pub use sequence::{SeqId, Sequence};

use crate::kv::{BlockAllocator, BlockTable};

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
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
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        assert!(cfg.max_num_seqs > 0 && cfg.max_num_batched_tokens > 0 && cfg.block_size > 0);
        Scheduler {
            cfg,
            alloc: BlockAllocator::new(cfg.num_blocks),
            waiting: Vec::new(),
            running: Vec::new(),
            preemptions: 0,
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

    pub fn blocks_used(&self) -> usize {
        self.alloc.num_blocks() - self.alloc.num_free()
    }

    pub fn num_blocks(&self) -> usize {
        self.alloc.num_blocks()
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.running.iter().chain(&self.waiting).find(|s| s.id == id)
    }

    fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.running.iter_mut().chain(self.waiting.iter_mut()).find(|s| s.id == id)
    }

    /// Decides the next step. Call [`Scheduler::step_done`] with the result after running it.
    pub fn schedule(&mut self) -> Vec<Scheduled> {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut out = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let n = (seq.tokens.len() - seq.num_computed).min(budget);
            let target = seq.num_computed + n;
            // Free blocks by preempting from the back until this sequence fits.
            let fits = loop {
                let seq = &mut self.running[i];
                if seq.block_table.reserve(&mut self.alloc, target, bs).is_ok() {
                    break true;
                }
                let victim = self.running.len() - 1;
                self.preempt(victim);
                preempted = true;
                if victim == i {
                    break false;
                }
            };
            if !fits {
                break;
            }
            out.push(Scheduled::chunk(&self.running[i], n));
            budget -= n;
            i += 1;
        }
        // Admit waiting sequences, unless this step already had to evict.
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs && !self.waiting.is_empty() {
            let seq = &mut self.waiting[0];
            let n = (seq.tokens.len() - seq.num_computed).min(budget);
            let target = seq.num_computed + n;
            if seq.block_table.reserve(&mut self.alloc, target, bs).is_err() {
                break;
            }
            let mut seq = self.waiting.remove(0);
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
        seq.num_computed = 0;
        seq.requeued = true;
        self.preemptions += 1;
        self.add(seq);
    }

    /// Records that a step ran: the scheduled tokens are now in the cache.
    pub fn step_done(&mut self, step: &[Scheduled]) {
        for s in step {
            if let Some(seq) = self.get_mut(s.id) {
                seq.num_computed = s.context_len + s.num_tokens;
            }
        }
    }

    /// Appends a sampled token to a sequence.
    pub fn append_token(&mut self, id: SeqId, token: u32) {
        if let Some(seq) = self.get_mut(id) {
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
