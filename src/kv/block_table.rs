//! One sequence's blocks, in position order.

use super::{BlockAllocator, OutOfBlocks};

#[derive(Debug, Default, Clone)]
pub struct BlockTable {
    blocks: Vec<u32>,
}

impl BlockTable {
    /// A table over blocks the caller already holds a reference to.
    pub fn from_blocks(blocks: Vec<u32>) -> Self {
        BlockTable { blocks }
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Blocks still to allocate before the sequence can hold `tokens` positions.
    pub fn blocks_missing(&self, tokens: usize, block_size: usize) -> usize {
        tokens.div_ceil(block_size).saturating_sub(self.blocks.len())
    }

    /// Grows the table so it holds `tokens` positions; on failure nothing is taken.
    pub fn reserve(&mut self, alloc: &mut BlockAllocator, tokens: usize, block_size: usize) -> Result<(), OutOfBlocks> {
        let missing = self.blocks_missing(tokens, block_size);
        if missing > 0 {
            self.blocks.extend(alloc.allocate(missing)?);
        }
        Ok(())
    }

    /// Appends a block the caller holds a reference to (a cached prefix block).
    pub fn push(&mut self, block: u32) {
        self.blocks.push(block);
    }

    /// Keeps only the blocks that hold the first `tokens` positions, giving the rest back
    /// (the tail of rejected draft tokens).
    pub fn truncate(&mut self, alloc: &mut BlockAllocator, tokens: usize, block_size: usize) {
        let keep = tokens.div_ceil(block_size);
        while self.blocks.len() > keep {
            alloc.release(self.blocks.pop().expect("longer than keep"));
        }
    }

    /// Gives every block back to the allocator, the tail first, so that cached tails are
    /// evicted before the heads other prompts are likelier to share.
    pub fn release(&mut self, alloc: &mut BlockAllocator) {
        for b in self.blocks.drain(..).rev() {
            alloc.release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_grows_by_whole_blocks_and_release_frees_all() {
        let mut alloc = BlockAllocator::new(5, false);
        let mut t = BlockTable::default();
        t.reserve(&mut alloc, 1, 4).unwrap();
        assert_eq!(t.blocks().len(), 1);
        t.reserve(&mut alloc, 4, 4).unwrap();
        assert_eq!(t.blocks().len(), 1);
        t.reserve(&mut alloc, 9, 4).unwrap();
        assert_eq!(t.blocks().len(), 3);
        assert!(t.reserve(&mut alloc, 40, 4).is_err());
        assert_eq!(t.blocks().len(), 3, "failed reserve keeps the table");
        t.truncate(&mut alloc, 5, 4);
        assert_eq!(t.blocks().len(), 2, "5 positions need two blocks of 4");
        assert_eq!(alloc.num_free(), 3);
        t.release(&mut alloc);
        assert_eq!(alloc.num_free(), 5);
        assert!(t.blocks().is_empty());
    }
}
