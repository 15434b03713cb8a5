//! Recurrent state beside the paged KV cache (Qwen3.5's gated DeltaNet layers): one
//! fixed-size slot per running sequence, holding every such layer's convolution inputs and
//! state matrices, and snapshots of such states at block boundaries of cached prefixes, so
//! that a sequence reusing a prefix resumes from its state there. Which slot and snapshot is
//! whose is the scheduler's to decide, as blocks are; the contents are the model's. Both
//! pools grow as they are first used, so pools sized for the worst case cost only what the
//! busiest moment needed.

/// Slots of `slot_len` floats, allocated as first used.
pub struct StatePool {
    slot_len: usize,
    data: Vec<f32>,
}

impl StatePool {
    fn new(slot_len: usize) -> Self {
        StatePool { slot_len, data: Vec::new() }
    }

    /// Slots allocated so far.
    pub fn num_slots(&self) -> usize {
        self.data.len().checked_div(self.slot_len).unwrap_or(0)
    }

    fn grow(&mut self, slots: usize) {
        if slots * self.slot_len > self.data.len() {
            self.data.resize(slots * self.slot_len, 0.0);
        }
    }

    pub fn get_mut(&mut self, slot: usize) -> &mut [f32] {
        self.grow(slot + 1);
        &mut self.data[slot * self.slot_len..(slot + 1) * self.slot_len]
    }

    /// The given slots (each at most once), in their order, for one step to update in
    /// parallel.
    pub fn many_mut(&mut self, slots: &[usize]) -> Vec<&mut [f32]> {
        if self.slot_len == 0 {
            return slots.iter().map(|_| Default::default()).collect();
        }
        self.grow(slots.iter().max().map_or(0, |&s| s + 1));
        let mut all: Vec<Option<&mut [f32]>> = self.data.chunks_exact_mut(self.slot_len).map(Some).collect();
        slots.iter().map(|&s| all[s].take().unwrap_or_else(|| panic!("state slot {s} given twice"))).collect()
    }
}

pub struct StateCache {
    /// One per running sequence.
    pub slots: StatePool,
    /// States at block boundaries of cached prefixes.
    pub snapshots: StatePool,
}

impl StateCache {
    pub fn new(slot_len: usize) -> Self {
        StateCache { slots: StatePool::new(slot_len), snapshots: StatePool::new(slot_len) }
    }

    /// Floats of one slot (0 for a model without recurrent layers).
    pub fn slot_len(&self) -> usize {
        self.slots.slot_len
    }

    /// Copies slot `src` into slot `dst` (a fork continues from its parent's state).
    pub fn copy_slot(&mut self, src: usize, dst: usize) {
        let n = self.slots.slot_len;
        self.slots.grow(src.max(dst) + 1);
        self.slots.data.copy_within(src * n..(src + 1) * n, dst * n);
    }

    /// Sets slot `slot` to snapshot `snapshot` (a sequence resuming after a cached prefix).
    pub fn restore(&mut self, snapshot: usize, slot: usize) {
        self.slots.get_mut(slot).copy_from_slice(self.snapshots.get_mut(snapshot));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_disjoint_grow_on_use_copy_and_restore() {
        let mut c = StateCache::new(3);
        assert_eq!(c.slots.num_slots(), 0);
        {
            let mut s = c.slots.many_mut(&[2, 0]);
            s[0].fill(2.0);
            s[1].fill(7.0);
        }
        assert_eq!(c.slots.num_slots(), 3);
        c.copy_slot(2, 4);
        c.snapshots.get_mut(1).fill(5.0);
        c.restore(1, 3);
        let s = c.slots.many_mut(&[4, 1, 0, 3]);
        assert_eq!(s.iter().map(|s| s[0]).collect::<Vec<_>>(), [2.0, 0.0, 7.0, 5.0]);
        let mut none = StateCache::new(0);
        assert!(none.slots.many_mut(&[5, 1]).iter().all(|s| s.is_empty()));
    }

    #[test]
    #[should_panic(expected = "given twice")]
    fn a_slot_given_twice_is_refused() {
        StateCache::new(2).slots.many_mut(&[1, 1]);
    }
}
