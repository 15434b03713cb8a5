//! The paged KV cache: a pool of fixed-size blocks per layer ([`KvCache`]), who owns which
//! block ([`BlockAllocator`], ref-counted so prefixes can be shared, with the prefix cache of
//! full blocks known by content hash), each sequence's list of blocks ([`BlockTable`]), and
//! beside them the fixed-size recurrent state of hybrid models ([`StateCache`]).

mod allocator;
mod block_table;
mod cache;
mod events;
mod snapshots;
mod state;

pub use allocator::{block_hash, BlockAllocator, BlockHash};
pub use block_table::BlockTable;
pub use cache::{KvCache, KvCacheDtype, KvDtype, KvShape};
pub use events::KvEvent;
pub use snapshots::{SnapshotIndex, Worth};
pub use state::{StateCache, StatePool};

/// Raised when a sequence needs more blocks than are free; the caller decides what to evict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV cache out of blocks: need {needed}, {free} free")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub free: usize,
}
