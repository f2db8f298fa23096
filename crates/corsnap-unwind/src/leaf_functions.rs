//! The functions a thread's samples met lately at the leaf.
//!
//! A leaf is an exact instruction pointer, not a return address: it is
//! seldom the same address twice, so the walk cache (by address) does not
//! know it, and each sample searched the managed regions and then the
//! function table of the region it lies in: two binary searches, cold at
//! 100 samples a second (CoreLib's table has tens of thousands of entries).
//! But a thread's leaves fall in few functions, its hot ones: the last few
//! are kept here by their address range, and a leaf inside one of them goes
//! straight to its function-table entry.

use std::ops::Range;

/// How many functions are kept (a scan of six cache lines).
const LEAF_FUNCTIONS: usize = 16;

#[derive(Debug, Clone, Copy, Default)]
struct LeafFunction {
    begin: u64,
    end: u64,
    region: u32,
    /// Byte offset of its `RUNTIME_FUNCTION` in the region's table.
    entry: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct LeafFunctions {
    /// The map the entries' region indexes are of.
    generation: u64,
    /// The entry replaced next (oldest first).
    next: usize,
    entries: [LeafFunction; LEAF_FUNCTIONS],
}

impl LeafFunctions {
    pub(crate) fn new() -> Self {
        LeafFunctions { generation: 0, next: 0, entries: [LeafFunction::default(); LEAF_FUNCTIONS] }
    }

    /// The region index and function-table entry of the function holding
    /// `address`, if it is one of those kept for this map.
    pub(crate) fn find(&self, generation: u64, address: u64) -> Option<(u32, u32)> {
        if generation == 0 || generation != self.generation {
            return None;
        }
        self.entries.iter().find(|f| f.begin <= address && address < f.end).map(|f| (f.region, f.entry))
    }

    pub(crate) fn remember(&mut self, generation: u64, function: Range<u64>, region: u32, entry: u32) {
        if generation == 0 {
            return;
        }
        if generation != self.generation {
            *self = LeafFunctions::new();
            self.generation = generation;
        }
        self.entries[self.next] = LeafFunction { begin: function.start, end: function.end, region, entry };
        self.next = (self.next + 1) % LEAF_FUNCTIONS;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leaf_inside_a_kept_function_of_the_same_map_is_found() {
        let mut leaves = LeafFunctions::new();
        leaves.remember(3, 0x1000..0x1080, 7, 120);
        assert_eq!(leaves.find(3, 0x1000), Some((7, 120)));
        assert_eq!(leaves.find(3, 0x107f), Some((7, 120)));
        assert_eq!(leaves.find(3, 0x1080), None);
        assert_eq!(leaves.find(4, 0x1010), None, "another map: region indexes differ");
        // The oldest goes first.
        for i in 0..LEAF_FUNCTIONS as u64 {
            leaves.remember(3, 0x2000 + i * 0x100..0x2080 + i * 0x100, 1, 0);
        }
        assert_eq!(leaves.find(3, 0x1010), None);
        assert_eq!(leaves.find(3, 0x2010), Some((1, 0)));
        // A new map starts empty.
        leaves.remember(4, 0x9000..0x9010, 2, 12);
        assert_eq!(leaves.find(4, 0x2010), None);
        assert_eq!(leaves.find(4, 0x9000), Some((2, 12)));
    }
}
