//! What the scheduler knows of a sequence.

use crate::kv::BlockTable;

pub type SeqId = u64;

#[derive(Debug)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub num_computed: usize,
    pub block_table: BlockTable,
    /// Lower runs first.
    pub priority: i32,
    /// Submission order, the tie-breaker.
    pub arrival: u64,
    /// Waiting again after being admitted once (preempted, or a fork that found no room).
    pub requeued: bool,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>, priority: i32, arrival: u64) -> Self {
        Sequence {
            id,
            tokens: prompt,
            num_computed: 0,
            block_table: BlockTable::default(),
            priority,
            arrival,
            requeued: false,
        }
    }

    pub(super) fn order_key(&self) -> (i32, u64, SeqId) {
        (self.priority, self.arrival, self.id)
    }
}
