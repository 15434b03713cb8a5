//! A sequence: one record of everything about it, owned by the scheduler; `state` is what
//! the engine adds (sampler, detokenizer, stop state), opaque to the scheduler.

use crate::kv::{BlockHash, BlockTable};
use std::sync::Arc;

pub type SeqId = u64;

#[derive(Debug)]
pub struct Sequence<S = ()> {
    pub id: SeqId,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub num_computed: usize,
    /// Proposed continuation (speculative decoding), verified in the next decode step
    /// beside the last token; never part of `tokens` until accepted.
    pub draft: Vec<u32>,
    pub block_table: BlockTable,
    /// Its slot in the recurrent state cache while it runs (a hybrid model's DeltaNet
    /// state; every running sequence holds one, `max_num_seqs` in all).
    pub state_slot: Option<u32>,
    /// The snapshot its state slot is to be set from before its next step: it resumes
    /// after a cached prefix (hybrid models).
    pub restore: Option<u32>,
    /// This step's snapshots to take: (position of a block's last token, snapshot slot).
    pub captures: Vec<(usize, u32)>,
    /// At its last admission, the whole blocks of its tokens found in the prefix cache and
    /// the whole blocks of its tokens: the states after them are worth keeping more than
    /// others (the end of a prefix that another prompt sent too, and of its own prompt,
    /// [`Worth`]), and blocks past the second, its own output, take no snapshot.
    ///
    /// [`Worth`]: crate::kv::Worth
    pub snapshot_blocks: (usize, usize),
    /// Lower runs first.
    pub priority: i32,
    /// Submission order, the tie-breaker.
    pub arrival: u64,
    /// Waiting again after being admitted once (preempted, or a fork that found no room).
    pub requeued: bool,
    /// Isolates this tenant's cached prefix blocks from everyone else's.
    pub cache_salt: Option<Arc<str>>,
    /// Hashes of the full blocks in the block table, in order (the prefix-cache chain).
    pub block_hashes: Vec<BlockHash>,
    /// Prompt tokens found in the prefix cache when the sequence was first admitted.
    pub cached_tokens: usize,
    /// Wants logits for every row it computes (prompt logprobs), so never reuses cached blocks.
    pub prompt_logits: bool,
    /// Computes every prompt row itself (a mean-pooled embedding), so never reuses cached blocks.
    pub whole_prompt: bool,
    pub state: S,
}

impl<S> Sequence<S> {
    pub fn new(id: SeqId, prompt: Vec<u32>, priority: i32, arrival: u64, state: S) -> Self {
        Sequence {
            id,
            tokens: prompt,
            num_computed: 0,
            draft: Vec::new(),
            block_table: BlockTable::default(),
            state_slot: None,
            restore: None,
            captures: Vec::new(),
            snapshot_blocks: (0, 0),
            priority,
            arrival,
            requeued: false,
            cache_salt: None,
            block_hashes: Vec::new(),
            cached_tokens: 0,
            prompt_logits: false,
            whole_prompt: false,
            state,
        }
    }

    /// Tokens not yet in the cache.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Whether its next step is a decode: one token to compute (the last sampled one).
    pub fn is_decode(&self) -> bool {
        self.remaining() == 1
    }

    /// The hash of full block `i`, given the hashes of the blocks before it.
    pub(super) fn hash_block(&self, i: usize, block_size: usize) -> BlockHash {
        self.chain_hash(i.checked_sub(1).map(|p| self.block_hashes[p]), i, block_size)
    }

    /// The hash of full block `i` after a block of hash `parent` (`None`: the first).
    pub(super) fn chain_hash(&self, parent: Option<BlockHash>, i: usize, block_size: usize) -> BlockHash {
        crate::kv::block_hash(parent, self.cache_salt.as_deref(), &self.tokens[i * block_size..(i + 1) * block_size])
    }

    pub(super) fn order_key(&self) -> (i32, u64, SeqId) {
        (self.priority, self.arrival, self.id)
    }
}
