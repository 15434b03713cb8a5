//! Block ownership: a reference count per block, the free blocks, and the prefix cache.
//!
//! A full block can be registered under the hash of its contents and everything before it
//! ([`block_hash`]). A later sequence with the same prefix retains it instead of
//! recomputing it. When its last holder lets go, a registered block keeps its hash and
//! stays reusable until the space is needed; then the least recently released is evicted
//! first (a sequence releases its tail before its head, so tails go first).

use super::events::{self, KvEvent};
use super::OutOfBlocks;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};

/// Identifies a full block by its tokens, the blocks before it and the cache salt: 128 bits
/// of SHA-256, so that two different prefixes never meet in practice.
pub type BlockHash = u128;

/// The hash of a full block of `tokens` after the block hashed `parent` (`None` for a
/// sequence's first block, which carries the tenant's `salt`).
pub fn block_hash(parent: Option<BlockHash>, salt: Option<&str>, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    match parent {
        Some(p) => h.update(p.to_le_bytes()),
        None => {
            // Length-prefixed so that no salt is a prefix of another's encoding.
            let salt = salt.unwrap_or("").as_bytes();
            h.update((salt.len() as u64).to_le_bytes());
            h.update(salt);
        }
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    u128::from_le_bytes(h.finalize()[..16].try_into().expect("16 bytes"))
}

/// Hands out block ids; a block returns to the pool when its last holder releases it.
#[derive(Debug)]
pub struct BlockAllocator {
    ref_counts: Vec<u32>,
    /// Free blocks holding nothing reusable.
    free: Vec<u32>,
    /// The hash each registered block is known by.
    hashes: Vec<Option<BlockHash>>,
    by_hash: HashMap<BlockHash, u32>,
    /// Registered blocks nobody holds, by release time: the first is evicted first.
    evictable: BTreeMap<u64, u32>,
    /// When each evictable block was released (its key in `evictable`).
    released_at: Vec<u64>,
    clock: u64,
    caching: bool,
    /// Kept only when someone listens ([`BlockAllocator::record_events`]).
    events: Option<EventLog>,
}

/// The events since they were last taken, and what a snapshot of the cache needs: each
/// registered block's parent and tokens, in the order they were registered.
#[derive(Debug, Default)]
struct EventLog {
    log: Vec<KvEvent>,
    origins: Vec<Option<Origin>>,
    clock: u64,
}

#[derive(Debug)]
struct Origin {
    registered: u64,
    parent: Option<BlockHash>,
    tokens: Box<[u32]>,
}

impl BlockAllocator {
    /// `caching`: whether [`BlockAllocator::register`] keeps blocks for reuse.
    pub fn new(num_blocks: usize, caching: bool) -> Self {
        let num_blocks = u32::try_from(num_blocks).expect("block count fits in u32");
        let n = num_blocks as usize;
        BlockAllocator {
            ref_counts: vec![0; n],
            // Reversed so that blocks are handed out in ascending order.
            free: (0..num_blocks).rev().collect(),
            hashes: vec![None; n],
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; n],
            clock: 0,
            caching,
            events: None,
        }
    }

    /// From now on, keeps a log of the blocks stored in and evicted from the prefix cache.
    pub fn record_events(&mut self) {
        let origins = (0..self.num_blocks()).map(|_| None).collect();
        self.events = Some(EventLog { origins, ..EventLog::default() });
    }

    /// The events since the last call, in the order they happened.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(|e| std::mem::take(&mut e.log)).unwrap_or_default()
    }

    /// Everything cached now, as the events that rebuild it from nothing: `Cleared`, then
    /// each block in the order it was registered (so parents come before children).
    pub fn snapshot(&self) -> Vec<KvEvent> {
        let mut out = vec![KvEvent::Cleared];
        let Some(ev) = &self.events else { return out };
        let mut blocks: Vec<(&Origin, BlockHash)> =
            ev.origins.iter().zip(&self.hashes).filter_map(|(o, h)| Some((o.as_ref()?, (*h)?))).collect();
        blocks.sort_by_key(|(o, _)| o.registered);
        for (o, hash) in blocks {
            events::push(&mut out, KvEvent::Stored { hashes: vec![hash], parent: o.parent, tokens: o.tokens.to_vec() });
        }
        out
    }

    /// Blocks the prefix cache knows, held or not.
    pub fn num_cached(&self) -> usize {
        self.by_hash.len()
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks an allocation can take: the free ones and the cached ones nobody holds.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Cached blocks nobody holds (reusable by a matching prefix, or evictable).
    pub fn num_cached_idle(&self) -> usize {
        self.evictable.len()
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Takes `n` blocks, each with ref count 1, or none at all: free ones first, then the
    /// least recently released cached ones, which lose their hash.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>, OutOfBlocks> {
        if n > self.num_free() {
            return Err(OutOfBlocks { needed: n, free: self.num_free() });
        }
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let (_, b) = self.evictable.pop_first().expect("counted above");
                    let hash = self.hashes[b as usize].take().expect("evictable blocks are registered");
                    self.by_hash.remove(&hash);
                    if let Some(ev) = &mut self.events {
                        ev.origins[b as usize] = None;
                        events::push(&mut ev.log, KvEvent::Removed { hashes: vec![hash] });
                    }
                    b
                }
            };
            self.ref_counts[b as usize] = 1;
            blocks.push(b);
        }
        Ok(blocks)
    }

    /// Adds a holder: to a held block (prefix sharing) or to a cached one nobody holds.
    pub fn retain(&mut self, block: u32) {
        let b = block as usize;
        if self.ref_counts[b] == 0 {
            assert!(self.hashes[b].is_some(), "retain of free block {block}");
            self.evictable.remove(&self.released_at[b]);
        }
        self.ref_counts[b] += 1;
    }

    /// Drops one holder. With none left, a registered block stays cached (evictable), any
    /// other is free.
    pub fn release(&mut self, block: u32) {
        let b = block as usize;
        let rc = &mut self.ref_counts[b];
        assert!(*rc > 0, "double free of block {block}");
        *rc -= 1;
        if *rc == 0 {
            if self.hashes[b].is_some() {
                self.released_at[b] = self.clock;
                self.evictable.insert(self.clock, block);
                self.clock += 1;
            } else {
                self.free.push(block);
            }
        }
    }

    /// The cached block known by `hash`, if any.
    pub fn lookup(&self, hash: BlockHash) -> Option<u32> {
        self.by_hash.get(&hash).copied()
    }

    /// Makes a held, fully written block reusable under `hash` (when caching is on, and
    /// unless the hash is already known: the first block with given contents is kept).
    /// `parent` and `tokens` are what the block's hash was made of, for the event log.
    pub fn register(&mut self, block: u32, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) {
        let b = block as usize;
        assert!(self.ref_counts[b] > 0, "register of unheld block {block}");
        if !self.caching || self.hashes[b].is_some() || self.by_hash.contains_key(&hash) {
            return;
        }
        self.hashes[b] = Some(hash);
        self.by_hash.insert(hash, block);
        if let Some(ev) = &mut self.events {
            ev.origins[b] = Some(Origin { registered: ev.clock, parent, tokens: tokens.into() });
            ev.clock += 1;
            events::push(&mut ev.log, KvEvent::Stored { hashes: vec![hash], parent, tokens: tokens.to_vec() });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_and_release_round_trip() {
        let mut a = BlockAllocator::new(4, true);
        let b = a.allocate(3).unwrap();
        assert_eq!(b, vec![0, 1, 2]);
        assert_eq!(a.num_free(), 1);
        assert_eq!(a.allocate(2), Err(OutOfBlocks { needed: 2, free: 1 }));
        assert_eq!(a.num_free(), 1, "a failed allocation takes nothing");
        for x in b {
            a.release(x);
        }
        assert_eq!(a.num_free(), 4);
    }

    #[test]
    fn shared_block_is_freed_by_its_last_holder() {
        let mut a = BlockAllocator::new(2, true);
        let b = a.allocate(1).unwrap()[0];
        a.retain(b);
        assert_eq!(a.ref_count(b), 2);
        a.release(b);
        assert_eq!(a.num_free(), 1);
        a.release(b);
        assert_eq!(a.num_free(), 2);
        assert_eq!(a.ref_count(b), 0);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_is_caught() {
        let mut a = BlockAllocator::new(1, true);
        let b = a.allocate(1).unwrap()[0];
        a.release(b);
        a.release(b);
    }

    #[test]
    #[should_panic(expected = "retain of free block")]
    fn retaining_an_unregistered_free_block_is_caught() {
        let mut a = BlockAllocator::new(1, true);
        let b = a.allocate(1).unwrap()[0];
        a.release(b);
        a.retain(b);
    }

    #[test]
    fn hashes_chain_and_salt_separates() {
        let h0 = block_hash(None, None, &[1, 2, 3, 4]);
        assert_eq!(h0, block_hash(None, None, &[1, 2, 3, 4]));
        assert_ne!(h0, block_hash(None, Some("tenant"), &[1, 2, 3, 4]));
        assert_ne!(h0, block_hash(None, None, &[1, 2, 3, 5]));
        let h1 = block_hash(Some(h0), None, &[5, 6, 7, 8]);
        assert_ne!(h1, block_hash(Some(block_hash(None, None, &[0, 2, 3, 4])), None, &[5, 6, 7, 8]));
    }

    #[test]
    fn released_registered_blocks_stay_reusable_until_needed() {
        let mut a = BlockAllocator::new(3, true);
        let b = a.allocate(2).unwrap();
        a.register(b[0], 10, None, &[]);
        a.register(b[1], 11, Some(10), &[]);
        // Tail first, as a sequence releases.
        a.release(b[1]);
        a.release(b[0]);
        assert_eq!((a.num_free(), a.num_cached_idle()), (3, 2));
        assert_eq!(a.lookup(10), Some(b[0]));
        a.retain(b[0]);
        assert_eq!((a.ref_count(b[0]), a.num_free()), (1, 2));
        a.release(b[0]);
        // The free block goes first, then the least recently released cached one (b[1]).
        let got = a.allocate(2).unwrap();
        assert_eq!(got, vec![2, b[1]]);
        assert_eq!(a.lookup(11), None, "evicted blocks lose their hash");
        assert_eq!(a.lookup(10), Some(b[0]));
    }

    #[test]
    fn without_caching_nothing_is_kept_and_duplicates_are_not_registered() {
        let mut a = BlockAllocator::new(2, false);
        let b = a.allocate(1).unwrap()[0];
        a.register(b, 1, None, &[]);
        assert_eq!(a.lookup(1), None);
        let mut a = BlockAllocator::new(2, true);
        let b = a.allocate(2).unwrap();
        a.register(b[0], 1, None, &[]);
        a.register(b[1], 1, None, &[]);
        assert_eq!(a.lookup(1), Some(b[0]));
        a.release(b[1]);
        assert_eq!(a.num_cached_idle(), 0, "the duplicate was never cached");
    }

    #[test]
    fn the_event_log_follows_the_cache_and_a_snapshot_rebuilds_it() {
        let mut a = BlockAllocator::new(3, true);
        a.record_events();
        let b = a.allocate(3).unwrap();
        a.register(b[0], 10, None, &[1, 2]);
        a.register(b[1], 11, Some(10), &[3, 4]);
        a.register(b[2], 10, None, &[1, 2]);
        assert_eq!(
            a.take_events(),
            vec![KvEvent::Stored { hashes: vec![10, 11], parent: None, tokens: vec![1, 2, 3, 4] }],
            "a duplicate is not stored twice"
        );
        for &x in b.iter().rev() {
            a.release(x);
        }
        // The free block, then the oldest released cached block (11, the tail).
        a.allocate(2).unwrap();
        assert_eq!(a.take_events(), vec![KvEvent::Removed { hashes: vec![11] }]);
        assert_eq!(a.num_cached(), 1);
        assert_eq!(
            a.snapshot(),
            vec![KvEvent::Cleared, KvEvent::Stored { hashes: vec![10], parent: None, tokens: vec![1, 2] }]
        );
        assert!(a.take_events().is_empty());
        let mut quiet = BlockAllocator::new(1, true);
        let b = quiet.allocate(1).unwrap()[0];
        quiet.register(b, 1, None, &[1]);
        assert!(quiet.take_events().is_empty(), "no log unless asked for");
    }
}
