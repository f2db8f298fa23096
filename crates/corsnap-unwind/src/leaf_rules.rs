//! How to step out of the code a thread's samples were lately taken in.
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
//! But a thread's samples fall again and again in the same few stretches of
//! code, and over a stretch one rule holds: a native CFI row, or a managed
//! function's body (past its prologue, outside its epilogues). Such a
//! stretch is kept here with its rule, by the 16-byte granules around the
//! address it was met at, direct-mapped: a later sample in one of them
//! whose address lies in the stretch is stepped by the rule, after one read
//! of the code at the address for a managed body (no epilogue starts
//! there). Nothing is kept whose rule did not give the very step the full
//! lookup gave.

use std::ops::Range;

use crate::frame_rule::FrameRule;
use crate::known_addresses::key;

#[derive(Debug, Clone, Copy, Default)]
struct LeafRule {
    /// The stretch: a CFI row, or a function's body after its prologue.
    start: u64,
    end: u64,
    /// The lineage of the map it was found in (see `CodeMap::lineage`,
    /// and [`crate::known_addresses`] for why a lineage's maps agree); 0 for
    /// an empty entry.
    lineage: u32,
    /// A native row (exact for every address in it); else a managed body,
    /// where an epilogue may start at any instruction.
    native: bool,
    rule: FrameRule,
}

/// Entries (40 bytes each: 20 KiB a thread).
const LEAF_RULES: usize = 509;

/// Addresses are kept by granules of this many bytes.
const GRANULE: u64 = 16;

/// How far from the address met a stretch is entered (8 granules either
/// side: about a hot loop's length).
const NEIGHBOURHOOD: u64 = 128;

pub(crate) struct LeafRules {
    entries: Box<[LeafRule; LEAF_RULES]>,
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
    pub(crate) fn new() -> Self {
        LeafRules { entries: Box::new([LeafRule::default(); LEAF_RULES]) }
    }

    /// The stretch holding `ip`, kept from a map of `lineage`.
    pub(crate) fn find(&self, lineage: u64, ip: u64) -> Option<LeafStretch> {
        let lineage = key(lineage)?;
        let e = &self.entries[slot(ip)];
        (e.lineage == lineage && e.start <= ip && ip < e.end).then_some(LeafStretch {
            native: e.native,
            end: e.end,
            rule: e.rule,
        })
    }

    /// Keeps `stretch`, met at `ip`, with its rule: in the entry of every
    /// granule of the stretch within [`NEIGHBOURHOOD`] bytes of `ip`, since
    /// a hot loop's samples fall on many granules of one stretch, and each
    /// would otherwise pay the full lookup once before it could be taken.
    pub(crate) fn remember(&mut self, lineage: u64, ip: u64, stretch: Range<u64>, native: bool, rule: FrameRule) {
        let Some(lineage) = key(lineage) else { return };
        if !rule.is_known() || !stretch.contains(&ip) {
            return;
        }
        let entry = LeafRule { start: stretch.start, end: stretch.end, lineage, native, rule };
        let from = stretch.start.max(ip.saturating_sub(NEIGHBOURHOOD)) & !(GRANULE - 1);
        let to = stretch.end.min(ip.saturating_add(NEIGHBOURHOOD));
        let mut at = from;
        while at < to {
            self.entries[slot(at)] = entry;
            at += GRANULE;
        }
    }
}

fn slot(ip: u64) -> usize {
    ((ip / GRANULE) % LEAF_RULES as u64) as usize
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
        let mut rules = LeafRules::new();
        let rule = FrameRule::known(false, 8, None);
        rules.remember(5, 0x1010, 0x1000..0x1040, false, rule);
        assert!(rules.find(5, 0x1010).is_some_and(|s| !s.native && s.end == 0x1040 && s.rule == rule));
        assert!(rules.find(5, 0x101f).is_some(), "same granule");
        assert!(rules.find(6, 0x1010).is_none(), "another lineage");
        assert!(rules.find(5, 0x1030).is_some(), "another granule of the stretch, near the address");
        assert!(rules.find(5, 0x1040).is_none(), "past the stretch");
        assert!(rules.find(5, 0x0ff0).is_none(), "before the stretch");
        // A long stretch is entered only near the address met.
        rules.remember(5, 0x10_0000, 0x8_0000..0x20_0000, true, rule);
        assert!(rules.find(5, 0x10_0000 + NEIGHBOURHOOD - 1).is_some());
        assert!(rules.find(5, 0x10_0000 - NEIGHBOURHOOD).is_some());
        assert!(rules.find(5, 0x10_0000 + 2 * NEIGHBOURHOOD).is_none());
        // Not kept: no rule, an address outside the stretch, no lineage.
        rules.remember(5, 0x2000, 0x2000..0x2010, true, FrameRule::UNSUITABLE);
        assert!(rules.find(5, 0x2000).is_none());
        rules.remember(5, 0x3000, 0x3010..0x3020, true, rule);
        assert!(rules.find(5, 0x3000).is_none());
        rules.remember(0, 0x4000, 0x4000..0x4010, true, rule);
        assert!(rules.find(0, 0x4000).is_none());
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
