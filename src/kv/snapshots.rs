//! Which recurrent-state snapshot holds the state after which cached block: a bounded map
//! from a block's chain hash (its tokens and every token before them) to a snapshot slot. A
//! state after a prefix depends on that prefix alone, so a snapshot stays right for its hash
//! even when the block itself is evicted and computed again.
//!
//! Snapshots are large (a state per DeltaNet layer: 66 MB a sequence on Qwen3.5-35B-A3B), so
//! few fit, and a prompt passes a block boundary every 16 tokens. Each snapshot has a
//! [`Worth`], and a claim takes the slot of the least recently used one worth no more than
//! it: the boundaries inside prompts and each prompt's own end then never push out the
//! end of a system prompt that requests share.

use super::BlockHash;
use std::collections::HashMap;

/// What a snapshot is worth keeping for, least first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Worth {
    /// A block boundary inside a prompt.
    Passing,
    /// A prompt's last whole block: its conversation's next turn resumes there.
    PromptEnd,
    /// The end of a prefix that two prompts share: where a prompt left the cached blocks
    /// of another, or a snapshot that a prompt resumed from.
    Shared,
}

pub struct SnapshotIndex {
    capacity: usize,
    /// Hash → its snapshot.
    map: HashMap<BlockHash, Held>,
    /// Slots never handed out yet.
    fresh: std::ops::Range<u32>,
    clock: u64,
}

/// One snapshot held: its slot, its last use and its worth.
#[derive(Clone, Copy)]
struct Held {
    slot: u32,
    used: u64,
    worth: Worth,
}

impl SnapshotIndex {
    pub fn new(capacity: usize) -> Self {
        SnapshotIndex { capacity, map: HashMap::new(), fresh: 0..capacity as u32, clock: 0 }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Snapshots held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The snapshot of the state after block `hash`, if one is held (now most recently used).
    pub fn lookup(&mut self, hash: BlockHash) -> Option<u32> {
        self.clock += 1;
        let clock = self.clock;
        self.map.get_mut(&hash).map(|held| {
            held.used = clock;
            held.slot
        })
    }

    /// A slot to write the state after block `hash` into, now most recently used: its own
    /// if held (worth at least `worth` from now on), else a fresh one, else that of the
    /// least recently used snapshot among the least worth, if that is worth no more than
    /// `worth`; `None` if none is.
    pub fn claim(&mut self, hash: BlockHash, worth: Worth) -> Option<u32> {
        self.clock += 1;
        if let Some(held) = self.map.get_mut(&hash) {
            (held.used, held.worth) = (self.clock, held.worth.max(worth));
            return Some(held.slot);
        }
        let slot = match self.fresh.next() {
            Some(s) => s,
            None => {
                let (&old, &held) = self.map.iter().min_by_key(|(_, h)| (h.worth, h.used))?;
                if held.worth > worth {
                    return None;
                }
                self.map.remove(&old);
                held.slot
            }
        };
        self.map.insert(hash, Held { slot, used: self.clock, worth });
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_goes_first() {
        let mut ix = SnapshotIndex::new(2);
        let (a, b, c): (BlockHash, BlockHash, BlockHash) = (1, 2, 3);
        let sa = ix.claim(a, Worth::Passing).unwrap();
        let sb = ix.claim(b, Worth::Passing).unwrap();
        assert_ne!(sa, sb);
        assert_eq!(ix.claim(a, Worth::Passing), Some(sa), "claiming a held hash keeps its slot");
        assert_eq!(ix.lookup(a), Some(sa));
        // b is now the least recently used: c takes its slot.
        assert_eq!(ix.claim(c, Worth::Passing), Some(sb));
        assert_eq!(ix.lookup(b), None);
        assert_eq!((ix.lookup(a), ix.lookup(c), ix.len()), (Some(sa), Some(sb), 2));
        assert_eq!(SnapshotIndex::new(0).claim(a, Worth::Shared), None);
    }

    #[test]
    fn a_claim_never_pushes_out_a_snapshot_worth_more() {
        let mut ix = SnapshotIndex::new(2);
        let (system, end_1, end_2, inside): (BlockHash, BlockHash, BlockHash, BlockHash) = (1, 2, 3, 4);
        let kept = ix.claim(system, Worth::Shared).unwrap();
        let first = ix.claim(end_1, Worth::PromptEnd).unwrap();
        // A boundary inside a prompt finds no slot it may take.
        assert_eq!(ix.claim(inside, Worth::Passing), None);
        // The next prompt's end takes the older prompt end's slot, more recently used
        // than the system prompt's or not.
        assert_eq!(ix.claim(end_2, Worth::PromptEnd), Some(first));
        assert_eq!((ix.lookup(system), ix.lookup(end_1)), (Some(kept), None));
        // A prompt end that a prompt resumes from is shared from then on.
        assert_eq!(ix.claim(end_2, Worth::Shared), Some(first));
        assert_eq!(ix.claim(end_1, Worth::PromptEnd), None);
        // Among equals the least recently used goes.
        ix.lookup(end_2);
        assert_eq!(ix.claim(inside, Worth::Shared), Some(kept));
        assert_eq!((ix.lookup(system), ix.lookup(end_2)), (None, Some(first)));
    }
}
