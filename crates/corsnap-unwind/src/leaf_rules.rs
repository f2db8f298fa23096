//! How to step out of the code the process's samples were lately taken in.
//!
//! A sample's first frame is an exact instruction pointer, seldom the same
//! twice, so [`crate::known_addresses`] does not hold it, and every sample
//! looked its frame up afresh: for managed code the region, the function,
//! its unwind record and the code at the address (to see an epilogue); for
//! native code the module's row table (page index, row starts, row rule).
//! At 100 samples a second each of those reads is a cache miss waiting on
//! the last. Measured on pool.cs and taskfaults.cs (.NET 10), that first
//! frame took 2.5 to 5 µs of a 4 to 10 µs walk, native or managed alike.
//!
//! But samples fall again and again in the same few stretches of code, and
//! over a stretch one rule holds: a native CFI row, or a managed function's
//! body (past its prologue, outside its epilogues). Such a stretch is kept
//! here with its rule, by the 16-byte granules around the address it was met
//! at, direct-mapped: a later sample in one of them whose address lies in
//! the stretch is stepped by the rule, after one read of the code at the
//! address for a managed body (no epilogue starts there). Nothing is kept
//! whose rule did not give the very step the full lookup gave.
//!
//! A body with no frame (its return address right at the stack pointer) is
//! stepped by its rule in its epilogue too, which can only be its `ret` or
//! a tail call's `jmp` (see [`FrameRule::holds_in_epilogue`]): on `pool.cs`
//! (.NET 10, 10 s) 404 of 1,939 leaves missed this table, most at the `ret`
//! of small getters, each looked up in full (about 5 µs); with that, 243.
//!
//! The table is the process's, not a thread's: a stretch's rule is the
//! code's, and threads running the same code learn it for each other. Each
//! thread used to keep 509 entries of its own: on taskfaults.cs (.NET 10,
//! two threads throwing in pool tasks, their leaves spread over the
//! runtime's exception code) a quarter of the leaves were found there, from
//! the first second to the twenty-fourth. One table of 8191 entries for all
//! found half in a 6-second run (20 KiB a thread less, 256 KiB a process
//! more), and over 20-second runs the handler's median fell from 15.4–15.9
//! to 12.4–13.7 µs, three runs each, alternating with the old build.
//!
//! Threads write it at once (the agent, and event callbacks), so each entry
//! is a sequence lock of plain atomics: a writer claims it by moving its
//! sequence from even to odd, and gives up if another writer holds it; a
//! reader takes what it read only if the sequence was even and the same
//! before and after. Nothing blocks or allocates, and a lost race only loses
//! an entry. A signal handler does not write it: a claim is a locked
//! instruction on a line that is cold at 100 samples a second, and a stretch
//! is up to 16 entries. The handler hands what its walk learned
//! ([`LearnedStretch`]) to the agent, which keeps it.

use std::ops::Range;

use crate::frame_rule::FrameRule;
use crate::known_addresses::key;
use crate::seqlock_table::SeqlockTable;

/// Entries in a process's table (32 bytes each: 256 KiB). Prime, so that
/// granules spread over it whatever the code's alignment.
pub(crate) const LEAF_RULES: usize = 8191;
/// Addresses are kept by granules of this many bytes.
const GRANULE: u64 = 16;
/// How far from the address met a stretch is entered (8 granules either
/// side: about a hot loop's length).
pub(crate) const NEIGHBOURHOOD: u64 = 128;
/// Flags in the high byte of an entry's end (addresses are below 2^56).
const NATIVE: u64 = 1 << 56;
const FROM_BP: u64 = 1 << 57;
const RESTORES_BP: u64 = 1 << 58;
const END_MASK: u64 = (1 << 56) - 1;

/// The stretches of code samples were lately taken in, with their rules,
/// for every thread of the process (a stretch's rule is the code's, not a
/// thread's): direct-mapped by granule. Read by every thread's walks and
/// written by any thread but a signal handler (the agent, event
/// callbacks), so each entry is a sequence lock of plain atomics: a writer
/// claims it by moving its sequence from even to odd (and gives up if
/// another writer holds it), a reader takes what it read only if the
/// sequence was even and the same before and after. Nothing blocks, nothing
/// allocates; a lost race only loses an entry, which the full lookup
/// serves.
#[derive(Default)]
pub(crate) struct LeafRules {
    entries: SeqlockTable,
}

/// A stretch a walk's leaf was stepped out of by its rule, with that rule
/// checked against the full lookup's step on the thread's stack: for the
/// map's owner to keep ([`crate::CodeMap::keep_leaf_stretch`]). A signal
/// handler hands it on rather than writing a table other threads read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LearnedStretch {
    lineage: u64,
    ip: u64,
    stretch: Range<u64>,
    native: bool,
    rule: FrameRule,
}

impl LearnedStretch {
    pub(crate) fn new(lineage: u64, ip: u64, stretch: Range<u64>, native: bool, rule: FrameRule) -> Self {
        LearnedStretch { lineage, ip, stretch, native, rule }
    }

    /// As four words, to pass between threads through plain atomics;
    /// `None` for one no entry could hold (see [`LeafRules::remember`]).
    pub fn to_words(&self) -> Option<[u64; 4]> {
        let [_, start, end, rest] = encode(key(self.lineage)?, &self.stretch, self.native, self.rule)?;
        Some([self.ip, start, end, rest])
    }

    /// Back from [`LearnedStretch::to_words`].
    pub fn from_words(words: [u64; 4]) -> Self {
        let [ip, start, end, rest] = words;
        let (lineage, stretch, native, rule) = decode(start, end, rest);
        LearnedStretch { lineage: u64::from(lineage), ip, stretch, native, rule }
    }
}

/// An entry's words after its sequence: start, end with flags, lineage
/// with the rule's offsets (the first word is left 0).
fn encode(lineage: u32, stretch: &Range<u64>, native: bool, rule: FrameRule) -> Option<[u64; 4]> {
    let (from_bp, ra_at, bp_at) = rule.parts()?;
    let (ra, bp) = (i16::try_from(ra_at).ok()?, i16::try_from(bp_at.unwrap_or(0)).ok()?);
    if stretch.end > END_MASK || stretch.start >= stretch.end {
        return None;
    }
    let end = stretch.end
        | if native { NATIVE } else { 0 }
        | if from_bp { FROM_BP } else { 0 }
        | if bp_at.is_some() { RESTORES_BP } else { 0 };
    Some([0, stretch.start, end, u64::from(lineage) | u64::from(ra as u16) << 32 | u64::from(bp as u16) << 48])
}

fn decode(start: u64, end: u64, rest: u64) -> (u32, Range<u64>, bool, FrameRule) {
    let (ra_at, bp_at) = (i32::from((rest >> 32) as u16 as i16), i32::from((rest >> 48) as u16 as i16));
    let rule = FrameRule::known(end & FROM_BP != 0, ra_at, (end & RESTORES_BP != 0).then_some(bp_at));
    (rest as u32, start..end & END_MASK, end & NATIVE != 0, rule)
}

/// What a walk may take from [`LeafRules::find`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeafStretch {
    pub(crate) native: bool,
    /// Where the stretch ends (the code at the address may be read up to
    /// here, not past it).
    pub(crate) end: u64,
    pub(crate) rule: FrameRule,
}

impl LeafRules {
    pub(crate) fn new(entries: usize) -> Self {
        LeafRules { entries: SeqlockTable::new(entries) }
    }

    /// Where its entries lie, as (address, bytes).
    pub(crate) fn block(&self) -> (usize, usize) {
        self.entries.block()
    }

    fn index(&self, ip: u64) -> usize {
        ((ip / GRANULE) % self.entries.len().max(1) as u64) as usize
    }

    /// Where `ip`'s entry lies, for a prefetch.
    pub(crate) fn line_of(&self, ip: u64) -> u64 {
        self.entries.line_of(self.index(ip))
    }

    /// The stretch holding `ip`, kept from a map of `lineage`.
    pub(crate) fn find(&self, lineage: u64, ip: u64) -> Option<LeafStretch> {
        let lineage = key(lineage)?;
        let [start, end, rest] = self.entries.read(self.index(ip))?;
        let (entry_lineage, stretch, native, rule) = decode(start, end, rest);
        if entry_lineage != lineage || !stretch.contains(&ip) {
            return None;
        }
        Some(LeafStretch { native, end: stretch.end, rule })
    }

    /// Keeps `stretch`, met at `ip`, with its rule: in the entry of every
    /// granule of the stretch within [`NEIGHBOURHOOD`] bytes of `ip`, since
    /// a hot loop's samples fall on many granules of one stretch, and each
    /// would otherwise pay the full lookup once before it could be taken.
    /// Not kept: a rule whose offsets do not fit 16 bits (a frame of more
    /// than 32 KiB), or that is not known.
    pub(crate) fn remember(&self, learned: &LearnedStretch) {
        let Some(lineage) = key(learned.lineage) else { return };
        let (ip, stretch) = (learned.ip, &learned.stretch);
        let Some([_, start, end, rest]) = encode(lineage, stretch, learned.native, learned.rule) else { return };
        if !stretch.contains(&ip) {
            return;
        }
        let from = stretch.start.max(ip.saturating_sub(NEIGHBOURHOOD)) & !(GRANULE - 1);
        let to = stretch.end.min(ip.saturating_add(NEIGHBOURHOOD));
        let mut at = from;
        while at < to {
            self.entries.write(self.index(at), [start, end, rest]);
            at += GRANULE;
        }
    }
}

/// Whether an epilogue can start with the instruction `code` begins with,
/// as far as its first bytes tell: if not, a managed function's body rule
/// holds at that address. Errs towards yes (the full lookup then decides).
///
/// The full lookup (pe-unwind-info, after Windows' unwinder) takes an
/// address for one in an epilogue only if the instruction there, after an
/// optional REX prefix, is `add rsp, imm`, `lea rsp, [frame register +
/// disp]`, a `pop`, `ret`, or a `jmp` (relative, or `ff /4`, `ff /5`). So
/// every form of those counts here, whatever its operands, and so does code
/// too short to tell.
pub(crate) fn may_begin_epilogue(code: &[u8]) -> bool {
    let rest = match code.first() {
        Some(&b) if b & 0xf0 == 0x40 => &code[1..],
        _ => code,
    };
    let (Some(&op), modrm) = (rest.first(), rest.get(1).copied()) else { return true };
    match op {
        // pop r64; ret; ret imm16; jmp rel32; jmp rel8; pop r/m64.
        0x58..=0x5f | 0xc3 | 0xc2 | 0xe9 | 0xeb | 0x8f => true,
        // add r/m64, imm: `add rsp, imm` is ModRM 0xc4.
        0x81 | 0x83 => modrm.is_none_or(|m| m == 0xc4),
        // lea with rsp as the destination (reg field 4).
        0x8d => modrm.is_none_or(|m| (m >> 3) & 7 == 4),
        // Group 5: jmp r/m (reg field 4) and jmp far (5), any operand.
        0xff => modrm.is_none_or(|m| matches!((m >> 3) & 7, 4 | 5)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stretch_serves_its_lineage_and_its_addresses_only() {
        let rules = LeafRules::new(509);
        let rule = FrameRule::known(false, 8, None);
        rules.remember(&LearnedStretch::new(5, 0x1010, 0x1000..0x1040, false, rule));
        assert!(rules.find(5, 0x1010).is_some_and(|s| !s.native && s.end == 0x1040 && s.rule == rule));
        assert!(rules.find(5, 0x101f).is_some(), "same granule");
        assert!(rules.find(6, 0x1010).is_none(), "another lineage");
        assert!(rules.find(5, 0x1030).is_some(), "another granule of the stretch, near the address");
        assert!(rules.find(5, 0x1040).is_none(), "past the stretch");
        assert!(rules.find(5, 0x0ff0).is_none(), "before the stretch");
        // A long stretch is entered only near the address met.
        rules.remember(&LearnedStretch::new(5, 0x10_0000, 0x8_0000..0x20_0000, true, rule));
        assert!(rules.find(5, 0x10_0000 + NEIGHBOURHOOD - 1).is_some());
        assert!(rules.find(5, 0x10_0000 - NEIGHBOURHOOD).is_some());
        assert!(rules.find(5, 0x10_0000 + 2 * NEIGHBOURHOOD).is_none());
        // Not kept: no rule, an address outside the stretch, no lineage.
        rules.remember(&LearnedStretch::new(5, 0x2000, 0x2000..0x2010, true, FrameRule::UNSUITABLE));
        assert!(rules.find(5, 0x2000).is_none());
        rules.remember(&LearnedStretch::new(5, 0x3000, 0x3010..0x3020, true, rule));
        assert!(rules.find(5, 0x3000).is_none());
        rules.remember(&LearnedStretch::new(0, 0x4000, 0x4000..0x4010, true, rule));
        assert!(rules.find(0, 0x4000).is_none());
    }

    #[test]
    fn a_learned_stretch_goes_through_its_words_unchanged() {
        let learned = LearnedStretch::new(9, 0x5010, 0x5000..0x5040, true, FrameRule::known(true, 8, Some(-16)));
        let words = learned.to_words().expect("fits");
        assert_eq!(LearnedStretch::from_words(words), learned);
        let rules = LeafRules::new(509);
        rules.remember(&LearnedStretch::from_words(words));
        assert!(rules.find(9, 0x5010).is_some_and(|s| s.native && s.end == 0x5040));
        // Offsets past 16 bits, or no rule: nothing to pass on.
        assert!(LearnedStretch::new(9, 0x5010, 0x5000..0x5040, true, FrameRule::known(false, 1 << 16, None))
            .to_words()
            .is_none());
        assert!(LearnedStretch::new(9, 0x5010, 0x5000..0x5040, true, FrameRule::UNSUITABLE).to_words().is_none());
    }

    #[test]
    fn epilogue_instructions_and_unclear_bytes_count_as_a_possible_epilogue() {
        for code in [
            &[0x48, 0x83, 0xc4, 0x28][..], // add rsp, 0x28
            &[0x48, 0x81, 0xc4, 0, 1, 0, 0],
            &[0x48, 0x8d, 0x65, 0x00], // lea rsp, [rbp]
            &[0x5d],                   // pop rbp
            &[0x41, 0x5e],             // pop r14
            &[0xc3],                   // ret
            &[0xe9, 0, 0, 0, 0],       // jmp rel32
            &[0xeb, 0xf0],             // jmp rel8
            &[0x48, 0xff, 0xe0],       // jmp rax
            &[0xff, 0x25, 0, 0, 0, 0], // jmp [rip + disp]
            &[0x8f, 0xc5],             // pop rbp, the long form
            &[0x48],                   // cut short
            &[],
        ] {
            assert!(may_begin_epilogue(code), "{code:02x?}");
        }
        for code in [
            &[0x48, 0x83, 0xc0, 0x01][..], // add rax, 1
            &[0x48, 0x8d, 0x04, 0x24],     // lea rax, [rsp]
            &[0x8b, 0x07],                 // mov eax, [rdi]
            &[0x0f, 0x85, 0, 0, 0, 0],     // jne
            &[0x75, 0xf0],                 // jne rel8
            &[0x48, 0x3b, 0xc1],           // cmp rax, rcx
            &[0xff, 0x15, 0, 0, 0, 0],     // call [rip + disp]
            &[0x66, 0x0f, 0x6f, 0x00],     // movdqa xmm0, [rax]
            &[0x48, 0x83, 0xec, 0x28],     // sub rsp, 0x28
        ] {
            assert!(!may_begin_epilogue(code), "{code:02x?}");
        }
    }
}
