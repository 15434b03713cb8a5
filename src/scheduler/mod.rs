//! Who runs in the next step. Pure logic over sequence metadata and the block allocator:
//! every running decode first (one token each, so no prefill can hold a stream back), then
//! unfinished prefill chunks, then waiting sequences, within `max_num_seqs`,
//! `max_num_batched_tokens` and the free KV blocks; ordered by priority, then arrival. A
//! sequence being admitted reuses the longest chain of cached blocks of its prefix and
//! prefills only the rest. When blocks run out the lowest-priority, newest running sequence
//! not yet in the step is preempted (its blocks released, requeued for recompute) — never a
//! failure. A decoding sequence may carry draft tokens (speculative decoding): they ride in
//! its decode as extra rows, only on the token budget and free blocks left once every
//! decode and prefill chunk has its rows — a draft never delays a prompt or preempts anyone.

mod sequence;

pub use sequence::{SeqId, Sequence};

use crate::kv::{BlockAllocator, BlockTable, KvEvent, SnapshotIndex, Worth};
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Reuse cached KV blocks of identical prefixes.
    pub prefix_caching: bool,
    /// Log the blocks stored in and evicted from the prefix cache ([`Scheduler::take_kv_events`]).
    pub kv_events: bool,
    /// A model with recurrent layers keeps this many state snapshots for the prefix cache,
    /// and resumes only after a cached block whose snapshot it holds (`None`: no recurrent
    /// state, every cached block is a place to resume).
    pub state_snapshots: Option<usize>,
    /// The longest draft a decode carries. A recurrent model keeps the state after each of
    /// a draft's rows, in snapshots past the prefix cache's, to go back to the last accepted.
    pub max_draft: usize,
    /// A prompt cut by the token budget is cut at a multiple of this many positions where
    /// it can be (1: anywhere): a recurrent model's prompt then goes through its layers in
    /// the same runs however busy the step is, and gives the same bits.
    pub prefill_align: usize,
}

impl SchedulerConfig {
    /// How much of `seq`'s remaining tokens a step with `budget` of its `full` prompt budget
    /// left computes: all that fit, ended at a multiple of [`SchedulerConfig::prefill_align`]
    /// where the budget cuts the prompt. Where no multiple lies within the budget, none of
    /// them if other prompts took part of it (the next step starts with this one), else as
    /// many as fit.
    fn chunk<S>(&self, seq: &Sequence<S>, budget: usize, full: usize) -> usize {
        let n = seq.remaining().min(budget);
        if n == seq.remaining() {
            return n;
        }
        let end = (seq.num_computed + n) / self.prefill_align * self.prefill_align;
        if end > seq.num_computed {
            end - seq.num_computed
        } else if budget < full {
            0
        } else {
            n
        }
    }
}

/// A copy a fork asks of the caches: the parent's partially filled last block, or its
/// recurrent state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheCopy {
    Block { src: u32, dst: u32 },
    State { src: u32, dst: u32 },
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
    /// The last `draft` of the `num_tokens` rows are the sequence's draft tokens: their
    /// logits and the row before them verify the draft.
    pub draft: usize,
    /// Every row wants logits: the sequence scores its prompt (prompt logprobs).
    pub every_row: bool,
}

impl Scheduled {
    /// The next `n` uncomputed tokens of `seq`.
    fn chunk<S>(seq: &Sequence<S>, n: usize) -> Self {
        let context_len = seq.num_computed;
        let sample = context_len + n == seq.tokens.len();
        Scheduled { id: seq.id, context_len, num_tokens: n, sample, draft: 0, every_row: seq.prompt_logits }
    }

    /// Rows that want logits: the sampled row and the draft rows, or all of them.
    pub fn logit_rows(&self) -> usize {
        if self.every_row {
            self.num_tokens
        } else if self.sample {
            1 + self.draft
        } else {
            0
        }
    }
}

/// Owns every sequence (one record each, indexed by id) and decides who runs. `S` is what
/// the engine keeps per sequence (sampler, detokenizer, stop state); the scheduler never
/// looks at it, so it is tested with `()`.
pub struct Scheduler<S = ()> {
    cfg: SchedulerConfig,
    alloc: BlockAllocator,
    seqs: HashMap<SeqId, Sequence<S>>,
    /// Ids sorted by (priority, arrival).
    waiting: Vec<SeqId>,
    /// Ids sorted by (priority, arrival); the last one is the first to be preempted.
    running: Vec<SeqId>,
    preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and how many of them were found.
    prefix_queries: u64,
    prefix_hits: u64,
    /// Prefill tokens allowed in a step that carries decodes (the step-time budget).
    prefill_limit: Option<usize>,
    /// State slots no running sequence holds.
    free_slots: Vec<u32>,
    /// Whose state after which cached block is kept (recurrent models).
    snapshots: Option<SnapshotIndex>,
}

/// Gives an empty sequence the longest chain of cached blocks of its tokens (leaving at
/// least its last token to compute, so it gets logits); returns the tokens reused. With
/// `snapshots` (a recurrent model), the chain ends at the last block whose state after it
/// is kept, and the sequence is to resume from that snapshot.
fn reuse_prefix<S>(
    alloc: &mut BlockAllocator,
    seq: &mut Sequence<S>,
    bs: usize,
    snapshots: Option<&mut SnapshotIndex>,
) -> usize {
    debug_assert!(seq.num_computed == 0 && seq.block_table.blocks().is_empty());
    seq.block_hashes.clear();
    let mut chain = Vec::new();
    for i in 0..(seq.tokens.len() - 1) / bs {
        let hash = seq.chain_hash(chain.last().map(|&(_, h)| h), i, bs);
        let Some(block) = alloc.lookup(hash) else { break };
        chain.push((block, hash));
    }
    seq.snapshot_blocks = (chain.len(), seq.tokens.len() / bs);
    if let Some(ix) = snapshots {
        // The deepest block with a snapshot: its chain is kept, its state restored.
        let n = chain.len();
        let resume = chain.iter().rev().enumerate().find_map(|(back, &(_, h))| Some((n - back, ix.lookup(h)?)));
        // A prefix that two prompts share ends where one resumes.
        if let Some((keep, _)) = resume {
            ix.claim(chain[keep - 1].1, Worth::Shared);
        }
        chain.truncate(resume.map_or(0, |(keep, _)| keep));
        seq.restore = resume.map(|(_, slot)| slot);
    }
    for (block, hash) in chain {
        alloc.retain(block);
        seq.block_table.push(block);
        seq.block_hashes.push(hash);
    }
    seq.num_computed = seq.block_hashes.len() * bs;
    seq.num_computed
}

/// The snapshots a step of `n` tokens after `seq.num_computed` takes: at the last token of
/// each block of its admitted tokens that it completes (the last `most` of them, besides
/// the two worth more, [`Sequence::snapshot_blocks`]), into slots claimed from `ix`.
fn plan_captures<S>(ix: &mut SnapshotIndex, seq: &mut Sequence<S>, n: usize, bs: usize, most: usize) {
    let (shared, admitted) = seq.snapshot_blocks;
    let (done, end) = (seq.num_computed / bs, ((seq.num_computed + n) / bs).min(admitted));
    let mut parent = seq.block_hashes.last().copied();
    let mut chosen = Vec::new();
    for i in seq.block_hashes.len()..end {
        let hash = seq.chain_hash(parent, i, bs);
        if i >= done {
            let worth = match i + 1 {
                b if b == shared => Worth::Shared,
                b if b == admitted => Worth::PromptEnd,
                _ => Worth::Passing,
            };
            chosen.push((i, hash, worth));
        }
        parent = Some(hash);
    }
    let passing = chosen.iter().filter(|c| c.2 == Worth::Passing).count();
    let mut skip = passing.saturating_sub(most.saturating_sub(chosen.len() - passing));
    // In the order the forward pass writes them, so that a slot claimed twice in one
    // step holds the state its last claim is for.
    for (i, hash, worth) in chosen {
        if worth == Worth::Passing && skip > 0 {
            skip -= 1;
            continue;
        }
        if let Some(slot) = ix.claim(hash, worth) {
            seq.captures.push(((i + 1) * bs - 1, slot));
        }
    }
}

/// Registers the sequence's blocks that became full (and written) in the prefix cache.
fn register_full_blocks<S>(alloc: &mut BlockAllocator, seq: &mut Sequence<S>, bs: usize) {
    let full = seq.num_computed / bs;
    if seq.block_hashes.len() >= full {
        return;
    }
    // A block held here as a duplicate of one since evicted takes its place, so the chain
    // the new blocks hang from is cached whole (and a router never hears of an orphan).
    for (j, &hash) in seq.block_hashes.iter().enumerate() {
        if alloc.lookup(hash).is_none() {
            let parent = j.checked_sub(1).map(|p| seq.block_hashes[p]);
            alloc.register(seq.block_table.blocks()[j], hash, parent, &seq.tokens[j * bs..(j + 1) * bs]);
        }
    }
    for i in seq.block_hashes.len()..full {
        let hash = seq.hash_block(i, bs);
        let parent = seq.block_hashes.last().copied();
        alloc.register(seq.block_table.blocks()[i], hash, parent, &seq.tokens[i * bs..(i + 1) * bs]);
        seq.block_hashes.push(hash);
    }
}

/// The snapshot holding the state after row `i` of the draft of the sequence in state slot
/// `slot`: past the prefix cache's `prefix` snapshots, `max_draft` per slot.
fn draft_snapshot(prefix: usize, max_draft: usize, slot: u32, i: usize) -> u32 {
    (prefix + slot as usize * max_draft + i) as u32
}

/// Inserts `id` into a list sorted by the sequences' order keys.
fn insert_sorted<S>(list: &mut Vec<SeqId>, seqs: &HashMap<SeqId, Sequence<S>>, id: SeqId) {
    let key = seqs[&id].order_key();
    let at = list.partition_point(|x| seqs[x].order_key() <= key);
    list.insert(at, id);
}

impl<S> Scheduler<S> {
    pub fn new(cfg: SchedulerConfig) -> Self {
        assert!(cfg.max_num_seqs > 0 && cfg.max_num_batched_tokens > 0 && cfg.block_size > 0);
        let mut alloc = BlockAllocator::new(cfg.num_blocks, cfg.prefix_caching);
        if cfg.kv_events {
            alloc.record_events();
        }
        Scheduler {
            cfg,
            alloc,
            seqs: HashMap::new(),
            waiting: Vec::new(),
            running: Vec::new(),
            preemptions: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            prefill_limit: None,
            free_slots: (0..cfg.max_num_seqs as u32).rev().collect(),
            snapshots: cfg.state_snapshots.map(SnapshotIndex::new),
        }
    }

    /// Queues a new sequence.
    pub fn add(&mut self, seq: Sequence<S>) {
        let id = seq.id;
        assert!(self.seqs.insert(id, seq).is_none(), "sequence {id} added twice");
        insert_sorted(&mut self.waiting, &self.seqs, id);
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Waiting sequences that had been admitted before (preempted, or forks without room).
    pub fn num_requeued(&self) -> usize {
        self.waiting.iter().filter(|id| self.seqs[*id].requeued).count()
    }

    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
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

    /// Full blocks the prefix cache holds (in use or idle).
    pub fn num_cached_blocks(&self) -> usize {
        self.alloc.num_cached()
    }

    /// Recurrent-state snapshots held, and the most kept (0, 0 without a recurrent model).
    pub fn snapshot_counts(&self) -> (usize, usize) {
        self.snapshots.as_ref().map_or((0, 0), |ix| (ix.len(), ix.capacity()))
    }

    /// The prefix cache's events since the last call (none unless `kv_events` is on).
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.alloc.take_events()
    }

    /// The events that rebuild the prefix cache as it is now, from nothing.
    pub fn kv_snapshot(&self) -> Vec<KvEvent> {
        self.alloc.snapshot()
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence<S>> {
        self.seqs.get(&id)
    }

    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence<S>> {
        self.seqs.get_mut(&id)
    }

    /// Every sequence's state at once, in no particular order (each borrowed apart from
    /// the others, so that they can be worked on in parallel).
    pub fn states_mut(&mut self) -> impl Iterator<Item = (SeqId, &mut S)> {
        self.seqs.iter_mut().map(|(&id, q)| (id, &mut q.state))
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
            .map(|id| &self.seqs[id])
            .filter(|s| s.is_decode())
            .fold((0, 0), |(n, att), s| (n + 1, att + s.tokens.len()))
    }

    /// The running sequences whose next step is a decode (one token to compute).
    pub fn decoding(&self) -> Vec<SeqId> {
        self.running.iter().copied().filter(|id| self.seqs[id].is_decode()).collect()
    }

    /// Decides the next step. Call [`Scheduler::step_done`] with the result after running it.
    pub fn schedule(&mut self) -> Vec<Scheduled> {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut out = Vec::new();
        let mut taken = HashSet::new();
        let mut preempted = false;
        // The budget prompts start from once the decodes have theirs.
        let mut full = budget;
        for decodes in [true, false] {
            if !decodes && !out.is_empty() {
                // Prefill beside decodes: within the step-time budget.
                budget = budget.min(self.prefill_limit.unwrap_or(usize::MAX));
            }
            full = budget;
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let id = self.running[i];
                let seq = &self.seqs[&id];
                if seq.is_decode() != decodes || taken.contains(&id) {
                    i += 1;
                    continue;
                }
                let n = self.cfg.chunk(seq, budget, full);
                if n == 0 {
                    i += 1;
                    continue;
                }
                let target = seq.num_computed + n;
                // Free blocks by preempting from the back (never a sequence already in
                // this step) until this one fits, or it is the one preempted.
                let fits = loop {
                    let seq = self.seqs.get_mut(&id).expect("running sequences exist");
                    if seq.block_table.reserve(&mut self.alloc, target, bs).is_ok() {
                        break true;
                    }
                    let victim = (i..self.running.len())
                        .rev()
                        .find(|&j| !taken.contains(&self.running[j]))
                        .expect("sequence i is not in the step");
                    self.preempt(victim);
                    preempted = true;
                    if victim == i {
                        break false;
                    }
                };
                if fits {
                    out.push(Scheduled::chunk(&self.seqs[&id], n));
                    taken.insert(id);
                    budget -= n;
                    i += 1;
                }
            }
        }
        // Admit waiting sequences, unless this step already had to evict.
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs && !self.waiting.is_empty() {
            let id = self.waiting[0];
            let seq = self.seqs.get_mut(&id).expect("waiting sequences exist");
            // A prompt to be scored or mean-pooled computes every row: none comes from the cache.
            let reuse = self.cfg.prefix_caching && !seq.prompt_logits && !seq.whole_prompt;
            seq.restore = None;
            seq.snapshot_blocks = (0, seq.tokens.len() / bs);
            let reused = if reuse { reuse_prefix(&mut self.alloc, seq, bs, self.snapshots.as_mut()) } else { 0 };
            let n = self.cfg.chunk(seq, budget, full);
            let target = seq.num_computed + n;
            if n == 0 || seq.block_table.reserve(&mut self.alloc, target, bs).is_err() {
                seq.block_table.release(&mut self.alloc);
                seq.num_computed = 0;
                seq.restore = None;
                break;
            }
            if self.cfg.prefix_caching {
                self.prefix_queries += seq.tokens.len() as u64;
                self.prefix_hits += reused as u64;
            }
            if !seq.requeued {
                seq.cached_tokens = reused;
            }
            seq.requeued = false;
            seq.state_slot = Some(self.free_slots.pop().expect("a state slot per running sequence"));
            out.push(Scheduled::chunk(seq, n));
            budget -= n;
            self.waiting.remove(0);
            insert_sorted(&mut self.running, &self.seqs, id);
        }
        self.add_drafts(&mut out);
        if let Some(ix) = self.snapshots.as_mut() {
            let most = ix.capacity();
            for s in &out {
                let seq = self.seqs.get_mut(&s.id).expect("scheduled sequences exist");
                seq.captures.clear();
                if self.cfg.prefix_caching {
                    plan_captures(ix, seq, s.num_tokens - s.draft, bs, most);
                }
                // A draft's rows: the state after each but the last, to go back to.
                let slot = seq.state_slot.expect("scheduled sequences hold a state slot");
                seq.captures.extend(
                    (0..s.draft).map(|i| (s.context_len + i, draft_snapshot(most, self.cfg.max_draft, slot, i))),
                );
            }
        }
        out
    }

    /// Lets the step's decodes carry their drafts, on the token budget and free blocks left
    /// once every decode and prefill chunk has its rows.
    fn add_drafts(&mut self, out: &mut [Scheduled]) {
        let bs = self.cfg.block_size;
        let mut left = self.cfg.max_num_batched_tokens.saturating_sub(out.iter().map(|s| s.num_tokens).sum());
        for step in out.iter_mut() {
            let seq = self.seqs.get_mut(&step.id).expect("scheduled sequences exist");
            if seq.draft.is_empty() {
                continue;
            }
            let decode = step.num_tokens == 1 && step.sample;
            // A recurrent model has room to go back from `max_draft` rows at most.
            let most = if self.snapshots.is_some() { self.cfg.max_draft } else { usize::MAX };
            seq.draft.truncate(if decode { left.min(most) } else { 0 });
            let target = seq.num_computed + 1 + seq.draft.len();
            if seq.block_table.reserve(&mut self.alloc, target, bs).is_err() {
                seq.draft.clear();
            }
            step.draft = seq.draft.len();
            step.num_tokens += step.draft;
            left -= step.draft;
        }
    }

    /// Moves `running[index]` back to waiting with its blocks released, to recompute later.
    fn preempt(&mut self, index: usize) {
        let id = self.running.remove(index);
        let seq = self.seqs.get_mut(&id).expect("running sequences exist");
        seq.block_table.release(&mut self.alloc);
        self.free_slots.extend(seq.state_slot.take());
        seq.restore = None;
        seq.block_hashes.clear();
        seq.num_computed = 0;
        seq.draft.clear();
        seq.requeued = true;
        self.preemptions += 1;
        insert_sorted(&mut self.waiting, &self.seqs, id);
    }

    /// Records that a step ran: the scheduled tokens are now in the cache, and blocks that
    /// became full are registered in the prefix cache. Draft rows count only once
    /// accepted ([`Scheduler::accept_draft`]).
    pub fn step_done(&mut self, step: &[Scheduled]) {
        for s in step {
            if let Some(seq) = self.seqs.get_mut(&s.id) {
                seq.num_computed = s.context_len + s.num_tokens - s.draft;
                register_full_blocks(&mut self.alloc, seq, self.cfg.block_size);
            }
        }
    }

    /// Settles a verified draft after [`Scheduler::step_done`]: its first `accepted` tokens
    /// join the sequence (their K/V are already in the cache); the rest are dropped, and
    /// blocks past the next position to compute go back to the allocator.
    pub fn accept_draft(&mut self, id: SeqId, accepted: usize) {
        let bs = self.cfg.block_size;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let accepted = accepted.min(seq.draft.len());
        if let (Some(ix), Some(slot)) = (&self.snapshots, seq.state_slot) {
            if accepted < seq.draft.len() {
                // The state ran on through the rejected rows: back to the last accepted one's.
                seq.restore = Some(draft_snapshot(ix.capacity(), self.cfg.max_draft, slot, accepted));
            }
        }
        seq.draft.truncate(accepted);
        seq.tokens.append(&mut seq.draft);
        seq.num_computed += accepted;
        seq.block_table.truncate(&mut self.alloc, seq.num_computed + 1, bs);
        register_full_blocks(&mut self.alloc, seq, bs);
    }

    /// Appends a sampled token to a sequence.
    pub fn append_token(&mut self, id: SeqId, token: u32) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.tokens.push(token);
        }
    }

    /// Removes a finished or aborted sequence, frees its blocks, and hands its record back.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence<S>> {
        let mut seq = self.seqs.remove(&id)?;
        for list in [&mut self.running, &mut self.waiting] {
            if let Some(pos) = list.iter().position(|&x| x == id) {
                list.remove(pos);
            }
        }
        seq.block_table.release(&mut self.alloc);
        self.free_slots.extend(seq.state_slot.take());
        Some(seq)
    }

    /// Starts `child` (holding the same prompt) after running sequence `parent`'s prefill,
    /// with `first_token` appended. It shares the parent's full blocks; the partially
    /// filled last block and the parent's recurrent state are copied with `copy`. Without
    /// room (no free block, or `max_num_seqs` reached) the child waits and recomputes its
    /// prompt instead.
    pub fn fork(&mut self, parent: SeqId, mut child: Sequence<S>, first_token: u32, copy: &mut dyn FnMut(CacheCopy)) {
        let bs = self.cfg.block_size;
        child.tokens.push(first_token);
        child.requeued = true;
        let Some(p) = self.seqs.get(&parent).filter(|_| self.running.contains(&parent)) else {
            return self.add(child);
        };
        let computed = p.num_computed;
        let parent_slot = p.state_slot.expect("running sequences hold a state slot");
        let (full, partial) = (computed / bs, computed % bs != 0);
        let shared = p.block_table.blocks()[..computed.div_ceil(bs)].to_vec();
        let hashes: Vec<_> = p.block_hashes.iter().take(full).copied().collect();
        if self.running.len() >= self.cfg.max_num_seqs || computed + 1 != child.tokens.len() {
            return self.add(child);
        }
        let mut blocks = shared[..full].to_vec();
        if partial {
            let Ok(dst) = self.alloc.allocate(1) else {
                return self.add(child);
            };
            copy(CacheCopy::Block { src: shared[full], dst: dst[0] });
            blocks.push(dst[0]);
        }
        for &b in &shared[..full] {
            self.alloc.retain(b);
        }
        child.block_hashes = hashes;
        child.block_table = BlockTable::from_blocks(blocks);
        child.num_computed = computed;
        child.requeued = false;
        let slot = self.free_slots.pop().expect("a state slot per running sequence");
        copy(CacheCopy::State { src: parent_slot, dst: slot });
        child.state_slot = Some(slot);
        let id = child.id;
        assert!(self.seqs.insert(id, child).is_none(), "sequence {id} added twice");
        insert_sorted(&mut self.running, &self.seqs, id);
    }

    /// Checks that the allocator's books match the sequences' block tables and that every
    /// sequence is in exactly one list.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut counts = vec![0u32; self.alloc.num_blocks()];
        for s in self.seqs.values() {
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
        let mut slots: Vec<u32> = self.running.iter().filter_map(|id| self.seqs[id].state_slot).collect();
        if slots.len() != self.running.len() || self.waiting.iter().any(|id| self.seqs[id].state_slot.is_some()) {
            return Err("a running sequence without a state slot, or a waiting one with".into());
        }
        slots.extend(&self.free_slots);
        slots.sort_unstable();
        if slots != (0..self.cfg.max_num_seqs as u32).collect::<Vec<_>>() {
            return Err(format!("state slots held and free are not each slot once: {slots:?}"));
        }
        if self.running.len() + self.waiting.len() != self.seqs.len() {
            return Err(format!(
                "{} running + {} waiting but {} sequences",
                self.running.len(),
                self.waiting.len(),
                self.seqs.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
