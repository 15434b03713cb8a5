//! What the prefix cache tells a KV-aware router: which full blocks it now holds under
//! which hash, which it evicted, and when it forgot everything. The allocator records them in
//! the order they happen; consecutive stores of one chain and consecutive evictions are
//! merged, as vLLM sends them.

use super::BlockHash;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks now cached, each the child of the one before; the first's parent is `parent`
    /// (`None`: the first block of a sequence). `tokens` are all of their tokens in order.
    Stored { hashes: Vec<BlockHash>, parent: Option<BlockHash>, tokens: Vec<u32> },
    /// Cached blocks evicted (their space given to new blocks).
    Removed { hashes: Vec<BlockHash> },
    /// Nothing is cached any more.
    Cleared,
}

/// Appends `event` to `log`, merged into the last event where it continues it.
pub(super) fn push(log: &mut Vec<KvEvent>, event: KvEvent) {
    match (log.last_mut(), event) {
        (
            Some(KvEvent::Stored { hashes, tokens, .. }),
            KvEvent::Stored { hashes: more, parent: Some(parent), tokens: more_tokens },
        ) if hashes.last() == Some(&parent) => {
            hashes.extend(more);
            tokens.extend(more_tokens);
        }
        (Some(KvEvent::Removed { hashes }), KvEvent::Removed { hashes: more }) => hashes.extend(more),
        (_, event) => log.push(event),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_of_stores_and_a_run_of_removals_merge() {
        let mut log = Vec::new();
        push(&mut log, KvEvent::Stored { hashes: vec![1], parent: None, tokens: vec![10, 11] });
        push(&mut log, KvEvent::Stored { hashes: vec![2], parent: Some(1), tokens: vec![12, 13] });
        // Another sequence's block: a new event.
        push(&mut log, KvEvent::Stored { hashes: vec![7], parent: Some(5), tokens: vec![1, 2] });
        push(&mut log, KvEvent::Removed { hashes: vec![3] });
        push(&mut log, KvEvent::Removed { hashes: vec![4] });
        push(&mut log, KvEvent::Cleared);
        push(&mut log, KvEvent::Removed { hashes: vec![9] });
        assert_eq!(
            log,
            vec![
                KvEvent::Stored { hashes: vec![1, 2], parent: None, tokens: vec![10, 11, 12, 13] },
                KvEvent::Stored { hashes: vec![7], parent: Some(5), tokens: vec![1, 2] },
                KvEvent::Removed { hashes: vec![3, 4] },
                KvEvent::Cleared,
                KvEvent::Removed { hashes: vec![9] },
            ]
        );
    }
}
