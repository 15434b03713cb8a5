//! Block ownership: a free list and a reference count per block.

use super::OutOfBlocks;

/// Hands out block ids; a block returns to the free list when its last holder releases it.
#[derive(Debug)]
pub struct BlockAllocator {
    ref_counts: Vec<u32>,
    free: Vec<u32>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        let num_blocks = u32::try_from(num_blocks).expect("block count fits in u32");
        // Reversed so that blocks are handed out in ascending order.
        BlockAllocator { ref_counts: vec![0; num_blocks as usize], free: (0..num_blocks).rev().collect() }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Takes `n` free blocks, each with ref count 1, or none at all.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>, OutOfBlocks> {
        if n > self.free.len() {
            return Err(OutOfBlocks { needed: n, free: self.free.len() });
        }
        let blocks = self.free.split_off(self.free.len() - n);
        let blocks: Vec<u32> = blocks.into_iter().rev().collect();
        for &b in &blocks {
            self.ref_counts[b as usize] = 1;
        }
        Ok(blocks)
    }

    /// Adds a holder to an allocated block (prefix sharing).
    pub fn retain(&mut self, block: u32) {
        let rc = &mut self.ref_counts[block as usize];
        assert!(*rc > 0, "retain of free block {block}");
        *rc += 1;
    }

    /// Drops one holder; the block is free again when none remain.
    pub fn release(&mut self, block: u32) {
        let rc = &mut self.ref_counts[block as usize];
        assert!(*rc > 0, "double free of block {block}");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_and_release_round_trip() {
        let mut a = BlockAllocator::new(4);
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
        let mut a = BlockAllocator::new(2);
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
        let mut a = BlockAllocator::new(1);
        let b = a.allocate(1).unwrap()[0];
        a.release(b);
        a.release(b);
    }
}
