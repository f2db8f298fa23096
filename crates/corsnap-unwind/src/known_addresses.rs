//! The return addresses a thread's walks have met, with how to step out of
//! each: the walk cache's main memory.
//!
//! A return address met again is stepped by the rule kept beside it: one
//! entry and the stack words the rule reads, with no region, function table
//! or row table touched. At 100 samples a second each of those is a cache
//! miss, and a frame looked up afresh costs several of them one after the
//! other. So what decides the handler's cost on real code is how many of a
//! walk's frames this memory still holds.
//!
//! Two things used to empty it:
//! - **Maps published.** Entries were keyed by the map's generation, and the
//!   engines publish a map each time they learn code: about 15 a second on
//!   a program that throws in pool tasks, each one making every frame of
//!   every thread's next walk cold again. An entry now serves every map of
//!   its lineage (see `CodeMap::lineage`), in which the address is the same
//!   code: the same native module, or the same managed region with the same
//!   function table. Nothing an entry holds depends on where that region
//!   sits in the map's list, so nothing in it goes stale within a lineage.
//! - **Collisions.** It was direct-mapped, 509 entries: on taskfaults
//!   (.NET 10, about 20 walked frames a sample over several hundred
//!   distinct return addresses) 3.5 frames a sample still missed once
//!   learning had settled, where a direct-mapped table eight times larger
//!   missed 1.0. It is now two-way set-associative, 1021 sets of one cache
//!   line each: a lookup is still one line, which the walk's frame-pointer
//!   prefetch has already asked for.

use crate::frame_rule::FrameRule;
use crate::seqlock_table::SeqlockTable;

/// What a walk found at one return address (or one exact instruction
/// pointer of a native leaf's caller), 32 bytes: two to a cache line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct KnownAddress {
    /// The address looked up (a return address less one).
    pub(crate) address: u64,
    /// The lineage of the map it was found in; 0 for an empty entry.
    lineage: u32,
    /// Managed code: the byte offset of its `RUNTIME_FUNCTION` in its
    /// region's table. Native code: its module's index in the map's list
    /// (a lineage keeps its native modules as they are).
    pub(crate) entry: u32,
    /// How to step out of the frame (`FrameRule::UNSUITABLE` when no rule
    /// of this form serves).
    pub(crate) rule: FrameRule,
    /// In a native module, not managed code.
    pub(crate) native: bool,
}

impl KnownAddress {
    pub(crate) fn new(address: u64, entry: u32, rule: FrameRule, native: bool) -> Self {
        KnownAddress { address, lineage: 0, entry, rule, native }
    }
}

const WAYS: usize = 2;

/// Prime, so that addresses spread over the sets whatever their alignment.
const SETS: usize = 1021;

/// One cache line of entries, most recently learned first.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(64))]
struct Set([KnownAddress; WAYS]);

const _: () = assert!(std::mem::size_of::<KnownAddress>() == 32);
const _: () = assert!(std::mem::size_of::<Set>() == 64);

/// Two-way set-associative by address (64 KiB a thread).
pub(crate) struct KnownAddresses {
    sets: Box<[Set; SETS]>,
}

impl KnownAddresses {
    pub(crate) fn new() -> Self {
        KnownAddresses { sets: Box::new([Set::default(); SETS]) }
    }

    /// Where its sets lie, as (address, bytes).
    pub(crate) fn block(&self) -> (usize, usize) {
        (self.sets.as_ptr() as usize, std::mem::size_of_val(&*self.sets))
    }

    /// The entry for `address` found in a map of `lineage`.
    pub(crate) fn find(&self, lineage: u64, address: u64) -> Option<KnownAddress> {
        let lineage = key(lineage)?;
        self.set(address).0.iter().find(|k| k.lineage == lineage && k.address == address).copied()
    }

    /// Where `address`'s entry would be, for a prefetch.
    pub(crate) fn line_of(&self, address: u64) -> u64 {
        self.set(address) as *const Set as u64
    }

    /// Keeps `known` as found in a map of `lineage`, first in its set: the
    /// other entry moves second, and the one second before makes way
    /// (unless it was this address's, which it replaces).
    pub(crate) fn remember(&mut self, lineage: u64, known: KnownAddress) {
        let Some(lineage) = key(lineage) else { return };
        let known = KnownAddress { lineage, ..known };
        let set = &mut self.sets[(known.address % SETS as u64) as usize].0;
        if set[0].address != known.address {
            set[1] = set[0];
        }
        set[0] = known;
    }

    fn set(&self, address: u64) -> &Set {
        &self.sets[(address % SETS as u64) as usize]
    }
}

/// Entries in a process's table of return addresses (32 bytes each: 512
/// KiB). Prime, so that addresses spread over it whatever their alignment.
pub(crate) const SHARED_KNOWN_ADDRESSES: usize = 16381;

/// Bit of an entry's rule word (past the rule's own bits) marking native
/// code.
const NATIVE: u64 = 1 << 63;

/// The return addresses every thread's walks have met, with how to step
/// out of each: the process's, behind each thread's own
/// [`KnownAddresses`].
///
/// A thread's table only holds what its own walks looked up. But a return
/// address's rule is the code's, not the thread's, and a thread met for the
/// first time, or running code it has not run before, looked up in full
/// (3 to 4 µs each at 100 samples a second) what other threads already
/// knew: on taskfaults.cs (.NET 10) about two return addresses a walk, over
/// a thousand distinct ones in a 6-second run, each learned once by every
/// thread. An address found here is copied into the thread's table.
///
/// Direct-mapped, entries of [`SeqlockTable`]: read by every walk, written
/// by the agent (what the handlers' walks learned, handed over through
/// their slots) and by walks on other threads than a handler's.
/// The default is a table of no entries (nothing kept, nothing found).
#[derive(Default)]
pub(crate) struct SharedKnownAddresses {
    entries: SeqlockTable,
}

impl SharedKnownAddresses {
    pub(crate) fn new(entries: usize) -> Self {
        SharedKnownAddresses { entries: SeqlockTable::new(entries) }
    }

    /// Where its entries lie, as (address, bytes).
    pub(crate) fn block(&self) -> (usize, usize) {
        self.entries.block()
    }

    fn index(&self, address: u64) -> usize {
        (address % self.entries.len().max(1) as u64) as usize
    }

    /// The entry for `address` found in a map of `lineage`.
    pub(crate) fn find(&self, lineage: u64, address: u64) -> Option<KnownAddress> {
        let lineage = key(lineage)?;
        let words = self.entries.read(self.index(address))?;
        let known = KnownAddress::from_words(words);
        (known.lineage == lineage && known.address == address).then_some(known)
    }

    /// Keeps what [`KnownAddress::to_words`] gave.
    pub(crate) fn remember_words(&self, words: [u64; 3]) {
        let known = KnownAddress::from_words(words);
        if known.lineage != 0 {
            self.entries.write(self.index(known.address), words);
        }
    }
}

impl KnownAddress {
    /// As three words (address; lineage and entry; rule and whether it is
    /// native), found in a map of `lineage`: to pass between threads through
    /// plain atomics. `None` for one no entry could hold.
    pub(crate) fn to_words(self, lineage: u64) -> Option<[u64; 3]> {
        let lineage = key(lineage)?;
        let rule = self.rule.to_word()? | if self.native { NATIVE } else { 0 };
        Some([self.address, u64::from(lineage) | u64::from(self.entry) << 32, rule])
    }

    fn from_words([address, ids, rule]: [u64; 3]) -> KnownAddress {
        KnownAddress {
            address,
            lineage: ids as u32,
            entry: (ids >> 32) as u32,
            rule: FrameRule::from_word(rule),
            native: rule & NATIVE != 0,
        }
    }
}

/// A map's lineage as an entry holds it (here and in the leaf stretches):
/// none for the empty map's (0), or for one past `u32::MAX` (which never
/// comes: one map is published per batch of code learned), so that no two
/// lineages share a key.
pub(crate) fn key(lineage: u64) -> Option<u32> {
    u32::try_from(lineage).ok().filter(|&l| l != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(address: u64, entry: u32) -> KnownAddress {
        KnownAddress::new(address, entry, FrameRule::default(), false)
    }

    #[test]
    fn an_entry_serves_its_lineage_only() {
        let mut cache = KnownAddresses::new();
        cache.remember(7, known(0x1000, 3));
        assert_eq!(cache.find(7, 0x1000).map(|k| k.entry), Some(3));
        assert_eq!(cache.find(8, 0x1000), None);
        assert_eq!(cache.find(7, 0x1008), None);
        // No lineage (the empty map's, or one that no longer fits): nothing
        // kept, nothing found.
        cache.remember(0, known(0x2000, 1));
        assert_eq!(cache.find(0, 0x2000), None);
        cache.remember(1 << 40, known(0x2000, 1));
        assert_eq!(cache.find(1 << 40, 0x2000), None);
        assert_eq!(cache.find(1 << 40, 0x1000), None);
    }

    #[test]
    fn the_process_table_serves_every_thread_what_one_learned() {
        let shared = SharedKnownAddresses::new(SHARED_KNOWN_ADDRESSES);
        let learned = KnownAddress::new(0x7000_1234, 77, FrameRule::known(true, 8, Some(0)), true);
        shared.remember_words(learned.to_words(3).unwrap());
        let found = shared.find(3, 0x7000_1234).unwrap();
        assert_eq!((found.address, found.entry, found.rule, found.native), (0x7000_1234, 77, learned.rule, true));
        assert_eq!(shared.find(4, 0x7000_1234), None, "another lineage");
        assert_eq!(shared.find(3, 0x7000_1234 + SHARED_KNOWN_ADDRESSES as u64), None, "another address");
        // Nothing for no lineage; an empty entry matches nothing.
        assert_eq!(learned.to_words(0), None);
        assert_eq!(shared.find(3, 0), None);
        let managed = KnownAddress::new(0x10, u32::MAX, FrameRule::UNSUITABLE, false);
        shared.remember_words(managed.to_words(u64::from(u32::MAX)).unwrap());
        let found = shared.find(u64::from(u32::MAX), 0x10).unwrap();
        assert_eq!((found.entry, found.rule, found.native), (u32::MAX, FrameRule::UNSUITABLE, false));
    }

    #[test]
    fn two_addresses_of_one_set_are_both_kept_and_a_third_evicts_the_one_learned_longer_ago() {
        let mut cache = KnownAddresses::new();
        let (a, b, c) = (0x5000, 0x5000 + SETS as u64, 0x5000 + 2 * SETS as u64);
        cache.remember(1, known(a, 1));
        cache.remember(1, known(b, 2));
        assert_eq!(cache.find(1, a).map(|k| k.entry), Some(1));
        assert_eq!(cache.find(1, b).map(|k| k.entry), Some(2));
        // Relearning one makes it the newer.
        cache.remember(1, known(a, 4));
        assert_eq!(cache.find(1, a).map(|k| k.entry), Some(4));
        assert_eq!(cache.find(1, b).map(|k| k.entry), Some(2));
        cache.remember(1, known(c, 3));
        assert_eq!(cache.find(1, c).map(|k| k.entry), Some(3));
        assert_eq!(cache.find(1, b), None, "the older of the two made way");
        assert_eq!(cache.sets[(a % SETS as u64) as usize].0.iter().filter(|k| k.address == a).count(), 1);
        assert_eq!(cache.find(1, a).map(|k| k.entry), Some(4));
    }
}
