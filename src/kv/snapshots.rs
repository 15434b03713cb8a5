//! Which recurrent-state snapshot holds the state after which cached block: a bounded map
//! from a block's chain hash (its tokens and every token before them) to a snapshot slot,
//! least recently used first out. A state after a prefix depends on that prefix alone, so a
//! snapshot stays right for its hash even when the block itself is evicted and computed again.

use super::BlockHash;
use std::collections::HashMap;

pub struct SnapshotIndex {
    capacity: usize,
    /// Hash → (slot, last use).
    map: HashMap<BlockHash, (u32, u64)>,
    /// Slots never handed out yet.
    fresh: std::ops::Range<u32>,
    clock: u64,
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
        self.map.get_mut(&hash).map(|(slot, used)| {
            *used = clock;
            *slot
        })
    }

    /// A slot to write the state after block `hash` into: its own if held, else a fresh one
    /// or the least recently used one's; `None` with no capacity.
    pub fn claim(&mut self, hash: BlockHash) -> Option<u32> {
        if let Some(slot) = self.lookup(hash) {
            return Some(slot);
        }
        let slot = match self.fresh.next() {
            Some(s) => s,
            None => {
                let (&old, &(slot, _)) = self.map.iter().min_by_key(|(_, &(_, used))| used)?;
                self.map.remove(&old);
                slot
            }
        };
        self.map.insert(hash, (slot, self.clock));
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
        let sa = ix.claim(a).unwrap();
        let sb = ix.claim(b).unwrap();
        assert_ne!(sa, sb);
        assert_eq!(ix.claim(a), Some(sa), "claiming a held hash keeps its slot");
        assert_eq!(ix.lookup(a), Some(sa));
        // b is now the least recently used: c takes its slot.
        assert_eq!(ix.claim(c), Some(sb));
        assert_eq!(ix.lookup(b), None);
        assert_eq!((ix.lookup(a), ix.lookup(c), ix.len()), (Some(sa), Some(sb), 2));
        assert_eq!(SnapshotIndex::new(0).claim(a), None);
    }
}
