//! A native leaf's step from one compact map of its module's code, read
//! before anything else a full lookup reads.
//!
//! A sample whose leaf is in native code that no kept stretch holds (see
//! [`crate::leaf_rules`]) used to go the way of any frame: the thread's
//! tables of return addresses and of managed functions, the search of the
//! native modules, the module's entry (hundreds of bytes), its row table's
//! header, the granule byte, the rule it names. At 100 samples a second each
//! was a cold read on its own line, most on 4 KiB pages of the heap, one
//! after another. Timed with the cycle counter on `taskfaults.cs` (.NET 10
//! and 8, where a third of the samples are such leaves, in the runtime's
//! exception code): 9,600 to 14,600 cycles a leaf, against 1,000 to 2,100
//! for a leaf in a kept stretch.
//!
//! So each native module with a row table gets, beside it, its rows by
//! granule with the rules in place ([`PackedGranules`]: a word per 64 bytes
//! of code, the rule of the one row that holds the granule whole, or where
//! the granule's several rows are listed), allocated by the agent on the
//! walks' huge pages. The map keeps for each module only where its code
//! ends, the granules' origin and the granules (48 bytes), beside the
//! module starts it searches already. A leaf not in a kept stretch then
//! costs that entry and its granule's word (and list); a module that holds
//! managed code, the hijack trampoline, or a row whose rule does not pack
//! goes on to the full lookup, which gives the same step: both come from
//! the same rows. A return address no table knows is stepped the same way.

use std::ops::Range;

use crate::frame_rule::FrameRule;
use crate::leaf_rules::LearnedStretch;
use crate::native_table::{CfiRule, PackedGranules};
use crate::{CodeMap, Memory, Regs, WalkCache};

/// A module's granules with their rules in place (see the module's
/// documentation): cheap to clone, shared by every map of the module.
#[derive(Debug, Clone, Default)]
pub(crate) struct LeafGranules {
    /// Where granule 0 begins (actual address).
    pub(crate) base: u64,
    pub(crate) packed: PackedGranules,
}

/// What the map keeps per native module for its leaves: where its code
/// ends, and its granules (empty when it has none, or holds managed code).
#[derive(Debug, Clone, Default)]
pub(crate) struct NativeLeaves {
    pub(crate) end: u64,
    pub(crate) granules: LeafGranules,
}

impl NativeLeaves {
    /// The rule at `ip` (which lies in the module), and the addresses
    /// around it it holds for (see [`PackedGranules::rule_at`]).
    fn rule_at(&self, ip: u64) -> Option<(CfiRule, Range<u64>)> {
        let LeafGranules { base, packed } = &self.granules;
        let (rule, offsets) = packed.rule_at(ip.checked_sub(*base)?)?;
        Some((rule, base + offsets.start..base + offsets.end))
    }
}

/// The rule of the native code at `lookup` from its module's granule,
/// when the granule has one there: with the module's index and the
/// stretch around `lookup` the rule holds for. Never in the hijack
/// trampoline, whose CFI misleads (see `hijack_stub_step`).
fn granule_rule(map: &CodeMap, lookup: u64) -> Option<(usize, CfiRule, Range<u64>)> {
    if map.hijack_stub.as_ref().is_some_and(|s| s.range.contains(&lookup)) {
        return None;
    }
    let i = map.native_starts.partition_point(|&start| start <= lookup).checked_sub(1)?;
    let (rule, stretch) = map.native_leaves.get(i).filter(|l| lookup < l.end)?.rule_at(lookup)?;
    Some((i, rule, stretch))
}

/// The first frame of a walk, at `regs` (an exact address), stepped by its
/// module's granule, when the granule has a rule: the caller, and the rule
/// as the walk cache keeps it. The stretch it holds for goes to the walk
/// cache as learned (the agent keeps it in the process's leaf table, which
/// is one read the next time). `None`: the full lookup decides.
pub(crate) fn native_leaf_step<M: Memory>(
    map: &CodeMap,
    mem: &M,
    regs: Regs,
    cache: &mut WalkCache,
) -> Option<(Regs, FrameRule)> {
    let (_, rule, stretch) = granule_rule(map, regs.ip)?;
    let next = rule.caller(mem, regs)?;
    let kept = rule.as_frame_rule().filter(|kept| kept.apply(mem, regs) == Some(next))?;
    cache.learned = Some(LearnedStretch::new(map.lineage, regs.ip, stretch, true, kept));
    Some((next, kept))
}

/// A frame at a return address (`regs.ip`) that no table of return
/// addresses holds, stepped by its module's granule at the call
/// (`lookup`), as [`native_leaf_step`] steps a leaf: the caller, the
/// module's index, the row's rule. The caller learns the address, as after
/// a full lookup. `None`: the full lookup decides.
pub(crate) fn native_return_step<M: Memory>(
    map: &CodeMap,
    mem: &M,
    regs: Regs,
    lookup: u64,
) -> Option<(Regs, usize, CfiRule)> {
    let (module, rule, _) = granule_rule(map, lookup)?;
    Some((rule.caller(mem, regs)?, module, rule))
}
