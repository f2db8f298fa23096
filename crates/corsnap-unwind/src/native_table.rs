//! A native module's CFI, compiled once into a table of rows by address, for
//! the frames a sample stops in.
//!
//! framehop remembers a rule per address, which serves return addresses
//! (the same call sites again and again) but hardly ever a leaf: an exact
//! instruction pointer, a different one at each sample. Each native leaf
//! was a full `.eh_frame` lookup (a binary search of the module's
//! `.eh_frame_hdr`, the FDE and its CIE parsed, the CFI program run up to
//! the address), cold at 100 samples a second: 7 µs of a 17 µs sample on
//! `taskfaults.cs`, where most leaves are in the runtime's exception code. A
//! cache of the rows leaves were met in (16 a thread) was tried: 25 hits in
//! 460 leaves, the rows are that many.
//!
//! So, as eBPF profilers do, each module's rows are compiled when the module
//! is first seen (on the agent's thread): every row's start address and its
//! rule, in one sorted array (6 bytes a row) with a page index over it. A
//! leaf then costs a few reads of that array, and most cost one: a granule
//! index gives each 64 bytes of code the rule of the row that covers them
//! whole (see [`NativeTable::granules`]). Rows of a shape no rule
//! describes (CFA by expression, a return address not just below the CFA)
//! are left to framehop, as is any address the table has no row for.

use std::ops::Range;
use std::sync::Arc;

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, LittleEndian, Pointer, RegisterRule, UnwindContext,
    UnwindContextStorage, UnwindSection, UnwindTableRow, X86_64,
};

use crate::frame_rule::FrameRule;
use crate::leaf_rules::NEIGHBOURHOOD;
use crate::{Memory, Regs};

/// Rows of the table carry this in place of a rule: no row there, or one
/// no rule describes.
const NO_RULE: u16 = u16::MAX;
/// Rows whose CFI leaves the return address undefined carry this: the
/// outermost frame of a thread (`clone3`, `_start`), where a walk ends.
const END_OF_STACK: u16 = u16::MAX - 1;

/// How to step out of a row's code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowRule {
    Step(CfiRule),
    /// The thread's outermost frame: nothing calls it.
    EndOfStack,
}

impl RowRule {
    /// The row's step, when it has one.
    pub(crate) fn step_rule(&self) -> Option<CfiRule> {
        match self {
            RowRule::Step(rule) => Some(*rule),
            RowRule::EndOfStack => None,
        }
    }

    /// What the walk cache keeps for a return address in this row.
    pub(crate) fn kept(&self) -> Option<FrameRule> {
        match self {
            RowRule::Step(rule) => rule.as_frame_rule(),
            RowRule::EndOfStack => Some(FrameRule::OUTERMOST),
        }
    }
}
/// The page index's granularity (4 KiB of code a page).
const PAGE_SHIFT: u32 = 12;
/// The granule index's granularity (64 bytes of code a granule).
const GRANULE_SHIFT: u32 = 6;
/// A granule no one row covers whole with a rule (or a step out of it):
/// looked up in the rows.
const MIXED: u8 = u8::MAX;
/// A granule in a row whose CFI leaves the return address undefined.
const GRANULE_END_OF_STACK: u8 = u8::MAX - 1;

/// One CFI row reduced to what a step needs: the caller's stack pointer
/// (the CFA) is the stack or frame pointer plus an offset, the return
/// address lies just below it, and the caller's frame pointer is unchanged
/// or saved at an offset from the CFA. The shapes framehop caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CfiRule {
    cfa_from_bp: bool,
    cfa_offset: i32,
    bp_at: Option<i32>,
}

impl CfiRule {
    fn from_row<S: UnwindContextStorage<usize>>(row: &UnwindTableRow<usize, S>) -> Option<CfiRule> {
        if row.register(X86_64::RA) != Some(RegisterRule::Offset(-8)) {
            return None;
        }
        let (cfa_from_bp, cfa_offset) = match row.cfa() {
            CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => (false, *offset),
            CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RBP => (true, *offset),
            _ => return None,
        };
        let bp_at = match row.register(X86_64::RBP) {
            None | Some(RegisterRule::Undefined) | Some(RegisterRule::SameValue) => None,
            Some(RegisterRule::Offset(offset)) => Some(i32::try_from(offset).ok()?),
            Some(_) => return None,
        };
        Some(CfiRule { cfa_from_bp, cfa_offset: i32::try_from(cfa_offset).ok()?, bp_at })
    }

    /// Where the caller's frame pointer is read from, for a frame whose
    /// canonical frame address (its caller's stack pointer) is `cfa`; `None`
    /// when the frame leaves it as it is.
    pub(crate) fn bp_slot(&self, cfa: u64) -> Option<u64> {
        cfa.checked_add_signed(i64::from(self.bp_at?))
    }

    /// Whether the frame is found from the frame pointer (else from the
    /// stack pointer).
    pub(crate) fn bp_based(&self) -> bool {
        self.cfa_from_bp
    }

    /// The rule in 16 bits, for [`NativeTable::packed_granules`]: the
    /// frame-pointer flag (bit 15), the CFA's offset in words (bits 6 to 14:
    /// 8 to 4,088 bytes) and where the caller's frame pointer was saved, in
    /// words below the CFA (bits 0 to 5; 0 for not saved). Never 0 (the
    /// CFA is at least a word above its base); `None` for a rule that does
    /// not fit, which the rows serve instead.
    pub(crate) fn packed(&self) -> Option<u16> {
        let words = u16::try_from(self.cfa_offset).ok().filter(|o| o % 8 == 0 && (8..=511 * 8).contains(o))? / 8;
        let bp = match self.bp_at {
            None => 0,
            Some(at) => u16::try_from(-at).ok().filter(|b| b % 8 == 0 && (8..=63 * 8).contains(b))? / 8,
        };
        Some(u16::from(self.cfa_from_bp) << 15 | words << 6 | bp)
    }

    /// Back from [`CfiRule::packed`]; `None` for 0.
    pub(crate) fn unpacked(packed: u16) -> Option<CfiRule> {
        let words = i32::from(packed >> 6 & 0x1ff);
        if words == 0 {
            return None;
        }
        let bp = i32::from(packed & 0x3f);
        Some(CfiRule { cfa_from_bp: packed >> 15 != 0, cfa_offset: words * 8, bp_at: (bp != 0).then_some(-bp * 8) })
    }

    #[cfg(test)]
    pub(crate) fn for_tests(cfa_from_bp: bool, cfa_offset: i32, bp_at: Option<i32>) -> CfiRule {
        CfiRule { cfa_from_bp, cfa_offset, bp_at }
    }

    /// The same step as a [`FrameRule`], which the walk cache keeps per
    /// return address: the return address lies at the CFA less 8, the CFA
    /// is the slot after it (what [`FrameRule::apply`] gives as the
    /// caller's stack pointer), and a saved frame pointer's offset moves
    /// from the CFA to the base. `None` if an offset overflows.
    pub(crate) fn as_frame_rule(&self) -> Option<FrameRule> {
        let ra_at = self.cfa_offset.checked_sub(8)?;
        let bp_at = match self.bp_at {
            Some(at) => Some(self.cfa_offset.checked_add(at)?),
            None => None,
        };
        Some(FrameRule::known(self.cfa_from_bp, ra_at, bp_at))
    }

    /// The caller of a frame at `regs` under this rule.
    pub(crate) fn caller<M: Memory>(&self, mem: &M, regs: Regs) -> Option<Regs> {
        let base = if self.cfa_from_bp { regs.bp } else { regs.sp };
        let cfa = base.checked_add_signed(i64::from(self.cfa_offset))?;
        let ip = mem.stack_word(cfa.checked_sub(8)?)?;
        let bp = match self.bp_at {
            Some(at) => mem.stack_word(cfa.checked_add_signed(i64::from(at))?)?,
            None => regs.bp,
        };
        Some(Regs { ip, sp: cfa, bp })
    }
}

/// A granule's word ([`PackedGranules::granules`]) that lists its rows
/// in [`PackedGranules::rows`] from the index in its low 31 bits.
const SEVERAL_ROWS: u32 = 1 << 31;
/// A row's word that is its granule's last.
const LAST_ROW: u32 = 1 << 31;

/// A module's rows by 64-byte granule, with their rules in place, for a
/// leaf's step in one or two reads (see [`crate::native_leaves`]). For each
/// granule one word: the rule of the one row that holds the granule whole,
/// packed ([`CfiRule::packed`], 0 for none), or [`SEVERAL_ROWS`] and where
/// its rows are listed in `rows`. A row's word there: where in the granule
/// it begins (bits 16 to 21; the first begins before the granule, or at its
/// start), its packed rule, and [`LAST_ROW`] on the granule's last. A
/// function's prologue and epilogues leave the granules they are in to
/// several rows, and a short function (the runtime has many) is mostly
/// such granules.
#[derive(Debug, Clone, Default)]
pub(crate) struct PackedGranules {
    granules: Arc<[u32]>,
    rows: Arc<[u32]>,
}

impl PackedGranules {
    /// The rule at `offset` (from the granules' origin), and the offsets
    /// around it it holds for: its row within the granule, and the whole
    /// granules next to it with the same rule, as far as a leaf's stretch is
    /// kept (see [`crate::leaf_rules`]).
    pub(crate) fn rule_at(&self, offset: u64) -> Option<(CfiRule, Range<u64>)> {
        let at = usize::try_from(offset >> GRANULE_SHIFT).ok()?;
        let start = (at as u64) << GRANULE_SHIFT;
        let end = start + (1 << GRANULE_SHIFT);
        let word = *self.granules.get(at)?;
        let reach = (NEIGHBOURHOOD >> GRANULE_SHIFT) as usize;
        let whole = |i: usize, packed: u32| self.granules.get(i) == Some(&packed);
        if word & SEVERAL_ROWS == 0 {
            let rule = CfiRule::unpacked(word as u16)?;
            let first = (at.saturating_sub(reach)..at).rev().take_while(|&i| whole(i, word)).last().unwrap_or(at);
            let last = (at + 1..=at + reach).take_while(|&i| whole(i, word)).last().unwrap_or(at);
            return Some((rule, (first as u64) << GRANULE_SHIFT..(last as u64 + 1) << GRANULE_SHIFT));
        }
        let listed = self.rows.get((word & !SEVERAL_ROWS) as usize..)?;
        let in_granule = offset - start;
        let (mut found, mut found_from, mut until) = (None, 0, end);
        for &row in listed {
            let from = u64::from(row >> 16 & 0x3f);
            if from > in_granule {
                until = start + from;
                break;
            }
            (found, found_from) = (Some(row), from);
            if row & LAST_ROW != 0 {
                break;
            }
        }
        let row = found?;
        let rule = CfiRule::unpacked(row as u16)?;
        let last = if row & LAST_ROW != 0 {
            let packed = row & 0xffff;
            (at + 1..=at + reach).take_while(|&i| whole(i, packed)).last().unwrap_or(at)
        } else {
            at
        };
        let stretch_end = if last > at { (last as u64 + 1) << GRANULE_SHIFT } else { until };
        Some((rule, start + found_from..stretch_end))
    }

    /// Bytes held.
    pub(crate) fn size(&self) -> usize {
        (self.granules.len() + self.rows.len()) * 4
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.granules.is_empty()
    }
}

/// A module's rows, by address.
#[derive(Debug)]
pub(crate) struct NativeTable {
    /// The actual address offsets are counted from.
    base: u64,
    /// Each row's first address, as an offset from `base`, ascending; the
    /// row runs to the next one's start.
    starts: Vec<u32>,
    /// Each row's rule: an index into `rules`, or [`NO_RULE`].
    rule_of: Vec<u16>,
    /// The distinct rules (a few dozen in a whole library).
    rules: Vec<CfiRule>,
    /// For each page of code from `base`, the index of the first row that
    /// starts at or after the page's start.
    pages: Vec<u32>,
    /// For each 64-byte granule of code from `base`, the rule of the one
    /// row that covers all of it (an index into `rules`, or
    /// [`GRANULE_END_OF_STACK`]), or [`MIXED`]; empty when the rules do not
    /// fit a byte. A frame is mostly in a function's body, one row long,
    /// and there this is one read, where the search of the rows was three
    /// reads one after another (page index, row starts, row rules), each a
    /// cache miss at 100 samples a second. (A leaf, and a return address
    /// no table knows, are stepped by [`PackedGranules`] first; this serves
    /// what those leave to the full lookup, and the agent's own lookups.)
    granules: Vec<u8>,
}

impl NativeTable {
    /// Compiles the rows of every FDE, in the order of the `.eh_frame_hdr`
    /// search table (by address: the rows come sorted, and nothing but the
    /// table itself is allocated; a sort of all rows first would leave
    /// megabytes of freed heap in the program's resident memory). Sections
    /// are given with their stated addresses; `text` is the code's, `bias`
    /// the module's load bias. `None` without a search table, or when the
    /// code spans more than offsets can (4 GiB): framehop then does it all.
    pub(crate) fn build(
        eh_frame: (u64, &[u8]),
        eh_frame_hdr: (u64, &[u8]),
        text: Range<u64>,
        bias: u64,
    ) -> Option<NativeTable> {
        let bases =
            BaseAddresses::default().set_eh_frame(eh_frame.0).set_eh_frame_hdr(eh_frame_hdr.0).set_text(text.start);
        let header = EhFrameHdr::new(eh_frame_hdr.1, LittleEndian).parse(&bases, 8).ok()?;
        let search = header.table()?;
        let mut section = EhFrame::new(eh_frame.1, LittleEndian);
        section.set_address_size(8);
        let first = match search.iter(&bases).next().ok()??.0 {
            Pointer::Direct(address) => address,
            Pointer::Indirect(_) => return None,
        };
        let base_svma = text.start.min(first);
        let offset = |a: u64| u32::try_from(a.checked_sub(base_svma)?).ok();
        let mut table = NativeTable {
            base: base_svma.wrapping_add(bias),
            starts: Vec::new(),
            rule_of: Vec::new(),
            rules: Vec::new(),
            pages: Vec::new(),
            granules: Vec::new(),
        };
        let mut context: Box<UnwindContext<usize>> = Box::new(UnwindContext::new());
        let mut covered_to = 0u32;
        let mut entries = search.iter(&bases);
        while let Ok(Some((_, fde_at))) = entries.next() {
            let Ok(at) = search.pointer_to_offset(fde_at) else { continue };
            let Ok(fde) = section.fde_from_offset(&bases, at, EhFrame::cie_from_offset) else { continue };
            let Ok(mut rows) = fde.rows(&section, &bases, &mut context) else { continue };
            while let Ok(Some(row)) = rows.next_row() {
                let (Some(start), Some(end)) = (offset(row.start_address()), offset(row.end_address())) else {
                    return None;
                };
                if start < covered_to || end <= start {
                    continue; // overlapping FDEs: the first one's rows stand
                }
                if start > covered_to && !table.starts.is_empty() {
                    table.push(covered_to, NO_RULE); // a gap between FDEs
                }
                let index = if row.register(X86_64::RA) == Some(RegisterRule::Undefined) {
                    END_OF_STACK
                } else {
                    table.rule_index(CfiRule::from_row(row))
                };
                table.push(start, index);
                covered_to = end;
            }
        }
        table.push(covered_to, NO_RULE);
        table.starts.shrink_to_fit();
        table.rule_of.shrink_to_fit();
        table.index_pages();
        table.index_granules();
        Some(table)
    }

    /// Fills [`NativeTable::pages`] from the rows.
    fn index_pages(&mut self) {
        let Some(&last) = self.starts.last() else { return };
        let mut row = 0usize;
        for page in 0..=(last >> PAGE_SHIFT) + 1 {
            let page_start = page << PAGE_SHIFT;
            while row < self.starts.len() && self.starts[row] < page_start {
                row += 1;
            }
            self.pages.push(row as u32);
        }
    }

    /// Fills [`NativeTable::granules`] from the rows.
    fn index_granules(&mut self) {
        if self.rules.len() >= usize::from(GRANULE_END_OF_STACK) {
            return;
        }
        let Some(&last) = self.starts.last() else { return };
        let count = (last >> GRANULE_SHIFT) as usize + 1;
        self.granules = Vec::with_capacity(count);
        let mut row = 0usize;
        for granule in 0..count as u64 {
            let (start, end) = (granule << GRANULE_SHIFT, (granule + 1) << GRANULE_SHIFT);
            // The last row starting at or before the granule's start.
            while self.starts.get(row + 1).is_some_and(|&next| u64::from(next) <= start) {
                row += 1;
            }
            let whole = u64::from(self.starts[row]) <= start
                && self.starts.get(row + 1).is_some_and(|&next| u64::from(next) >= end);
            let byte = match self.rule_of[row] {
                _ if !whole => MIXED,
                NO_RULE => MIXED,
                END_OF_STACK => GRANULE_END_OF_STACK,
                index => index as u8,
            };
            self.granules.push(byte);
        }
    }

    /// The table's rows as [`PackedGranules`], with `base`, where granule
    /// 0 begins: what [`crate::native_leaves`] reads.
    pub(crate) fn packed_granules(&self) -> (u64, PackedGranules) {
        let Some(&last) = self.starts.last() else { return (self.base, PackedGranules::default()) };
        let count = (last >> GRANULE_SHIFT) as usize + 1;
        let mut granules = Vec::with_capacity(count);
        let mut rows = Vec::new();
        // The packed rule of row `i`: 0 for none (the last row runs to no
        // next row: it is no row, see `build`).
        let packed_rule = |i: usize| match self.rule_of[i] {
            _ if i + 1 >= self.starts.len() => 0,
            NO_RULE | END_OF_STACK => 0,
            index => self.rules.get(usize::from(index)).and_then(CfiRule::packed).unwrap_or(0),
        };
        // The last row starting at or before the granule's start, if any.
        let mut row: Option<usize> = None;
        for granule in 0..count as u64 {
            let (start, end) = (granule << GRANULE_SHIFT, (granule + 1) << GRANULE_SHIFT);
            let starts_at = |i: usize| self.starts.get(i).map(|&s| u64::from(s));
            while starts_at(row.map_or(0, |r| r + 1)).is_some_and(|next| next <= start) {
                row = Some(row.map_or(0, |r| r + 1));
            }
            let first_inside = row.map_or(0, |r| r + 1);
            if starts_at(first_inside).is_none_or(|s| s >= end) {
                // One row holds the granule whole (or none does).
                granules.push(row.map_or(0, |r| u32::from(packed_rule(r))));
                continue;
            }
            let listed = rows.len();
            rows.extend(row.map(|r| u32::from(packed_rule(r))));
            for (i, row_start) in (first_inside..).map_while(|i| Some((i, starts_at(i).filter(|&s| s < end)?))) {
                rows.push(((row_start - start) as u32) << 16 | u32::from(packed_rule(i)));
            }
            if rows[listed..].iter().all(|&e| e & 0xffff == 0) {
                rows.truncate(listed);
                granules.push(0);
                continue;
            }
            if let Some(last) = rows.last_mut() {
                *last |= LAST_ROW;
            }
            granules.push(SEVERAL_ROWS | listed as u32);
        }
        if granules.iter().all(|&g| g == 0) || rows.len() >= SEVERAL_ROWS as usize {
            return (self.base, PackedGranules::default());
        }
        (self.base, PackedGranules { granules: granules.into(), rows: rows.into() })
    }

    /// The index of `rule` in the table's rules, added if new.
    fn rule_index(&mut self, rule: Option<CfiRule>) -> u16 {
        let Some(rule) = rule else { return NO_RULE };
        if let Some(i) = self.rules.iter().position(|r| *r == rule) {
            return i as u16;
        }
        if self.rules.len() >= usize::from(END_OF_STACK) {
            return NO_RULE;
        }
        self.rules.push(rule);
        (self.rules.len() - 1) as u16
    }

    fn push(&mut self, start: u32, rule: u16) {
        // Consecutive rows with one rule are one row.
        if self.rule_of.last() == Some(&rule) {
            return;
        }
        self.starts.push(start);
        self.rule_of.push(rule);
    }

    /// The rule of the row holding `address` (actual), if it has one (a
    /// step, or the end of the stack), and addresses around it the rule
    /// holds for: its granule, when one row covers the granule whole (see
    /// [`NativeTable::granules`]); else the row's (to the next row's start;
    /// the last row, which has none, only `address` itself).
    pub(crate) fn row_at(&self, address: u64) -> Option<(RowRule, Range<u64>)> {
        let offset = u32::try_from(address.checked_sub(self.base)?).ok()?;
        let at = (offset >> GRANULE_SHIFT) as usize;
        let Some(&byte) = self.granules.get(at).filter(|&&byte| byte != MIXED) else {
            return self.row_by_search(address, offset);
        };
        let rule = match byte {
            GRANULE_END_OF_STACK => RowRule::EndOfStack,
            index => RowRule::Step(*self.rules.get(usize::from(index))?),
        };
        // With the granules around it that have the same rule (one row: rows
        // with one rule are merged), as far as a leaf's stretch is kept from
        // the address met (see [`crate::leaf_rules`]): reads of the line
        // just read.
        let reach = (NEIGHBOURHOOD >> GRANULE_SHIFT) as usize;
        let same = |i: usize| self.granules.get(i) == Some(&byte);
        let first = (at.saturating_sub(reach)..at).rev().take_while(|&i| same(i)).last().unwrap_or(at);
        let last = (at + 1..=at + reach).take_while(|&i| same(i)).last().unwrap_or(at);
        let range = self.base + ((first as u64) << GRANULE_SHIFT)..self.base + ((last as u64 + 1) << GRANULE_SHIFT);
        Some((rule, range))
    }

    /// [`NativeTable::row_at`] by the rows alone, for the address at
    /// `offset` from `base`: the row's whole range.
    fn row_by_search(&self, address: u64, offset: u32) -> Option<(RowRule, Range<u64>)> {
        let page = (offset >> PAGE_SHIFT) as usize;
        // Rows starting in this page lie in pages[page]..pages[page + 1]; the
        // row holding the address is the last one starting at or before it,
        // which may have started in an earlier page.
        let (from, to) = (*self.pages.get(page)? as usize, *self.pages.get(page + 1)? as usize);
        let in_page = self.starts.get(from..to)?;
        let i = from + in_page.partition_point(|&s| s <= offset);
        let row = i.checked_sub(1)?;
        let rule = match *self.rule_of.get(row)? {
            END_OF_STACK => RowRule::EndOfStack,
            index => RowRule::Step(self.rules.get(usize::from(index)).copied()?),
        };
        let start = self.base + u64::from(*self.starts.get(row)?);
        let end = self.starts.get(row + 1).map_or(address + 1, |&next| self.base + u64::from(next));
        Some((rule, start..end))
    }

    /// Bytes held.
    pub(crate) fn size(&self) -> usize {
        self.starts.len() * 4
            + self.rule_of.len() * 2
            + self.pages.len() * 4
            + self.rules.len() * 12
            + self.granules.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Over rows of every length (a byte, under a granule, granules long,
    /// across pages), with gaps and the end of the stack, the granule index
    /// gives every address the rule the search of the rows gives, and a
    /// stretch inside that row which holds the address.
    #[test]
    fn the_granule_index_agrees_with_the_rows_everywhere() {
        let rules = vec![
            CfiRule::for_tests(false, 8, None),
            CfiRule::for_tests(false, 16, Some(-16)),
            CfiRule::for_tests(true, 16, Some(-16)),
        ];
        let mut table = NativeTable {
            base: 0x40_0000,
            starts: Vec::new(),
            rule_of: Vec::new(),
            rules,
            pages: Vec::new(),
            granules: Vec::new(),
        };
        let rows: [(u32, u16); 12] = [
            (0, 0),
            (1, 1),
            (4, 2),
            (300, 0),
            (301, NO_RULE),
            (320, 1),
            (384, 2),
            (4000, END_OF_STACK),
            (4100, 0),
            (9000, 1),
            (9003, 2),
            (9100, NO_RULE),
        ];
        for (start, rule) in rows {
            table.push(start, rule);
        }
        table.index_pages();
        table.index_granules();
        assert!(table.granules.iter().any(|&g| g != MIXED) && table.granules.contains(&MIXED));
        let mut by_granule = 0;
        for offset in 0..9200u32 {
            let address = table.base + u64::from(offset);
            let searched = table.row_by_search(address, offset);
            let found = table.row_at(address);
            assert_eq!(found.as_ref().map(|f| f.0), searched.as_ref().map(|s| s.0), "at {offset}");
            if let (Some((_, stretch)), Some((_, row))) = (found, searched) {
                assert!(stretch.contains(&address), "at {offset}: {stretch:x?}");
                assert!(row.start <= stretch.start && stretch.end <= row.end, "at {offset}: {stretch:x?} {row:x?}");
                by_granule += usize::from(stretch != row);
            }
        }
        assert!(by_granule > 8000, "{by_granule} addresses served by granules");
        // The packed granules give every address the rows' rule (all of
        // these fit), in a stretch of the row that holds the address.
        let (base, packed) = table.packed_granules();
        assert_eq!(base, table.base);
        assert!(!packed.rows.is_empty(), "granules of several rows");
        let mut by_packed = 0;
        for offset in 0..9200u32 {
            let searched = table.row_by_search(table.base + u64::from(offset), offset);
            match (packed.rule_at(u64::from(offset)), &searched) {
                (Some((rule, stretch)), Some((found, row))) => {
                    assert_eq!(RowRule::Step(rule), *found, "at {offset}");
                    let stretch = table.base + stretch.start..table.base + stretch.end;
                    assert!(stretch.contains(&(table.base + u64::from(offset))), "at {offset}: {stretch:x?}");
                    assert!(row.start <= stretch.start && stretch.end <= row.end, "at {offset}: {stretch:x?} {row:x?}");
                    by_packed += 1;
                }
                (Some(rule), None) => panic!("at {offset}: {rule:?} where the rows have none"),
                (None, Some((RowRule::Step(_), _))) => panic!("at {offset}: no rule where the rows have one"),
                (None, _) => {}
            }
        }
        assert!(by_packed > 8500, "{by_packed} addresses served by packed granules");
    }

    #[test]
    fn rules_pack_into_16_bits_and_back_or_not_at_all() {
        for (from_bp, cfa_offset, bp_at) in [
            (false, 8, None),
            (false, 16, Some(-16)),
            (true, 16, Some(-16)),
            (false, 0x98, Some(-0x48)),
            (true, 4088, Some(-504)),
        ] {
            let rule = CfiRule::for_tests(from_bp, cfa_offset, bp_at);
            let packed = rule.packed().expect("fits");
            assert_ne!(packed, 0);
            assert_eq!(CfiRule::unpacked(packed), Some(rule));
        }
        for (cfa_offset, bp_at) in
            [(4096, None), (0, None), (12, None), (-8, None), (16, Some(-512)), (16, Some(8)), (16, Some(-12))]
        {
            assert_eq!(CfiRule::for_tests(false, cfa_offset, bp_at).packed(), None, "{cfa_offset} {bp_at:?}");
        }
        assert_eq!(CfiRule::unpacked(0), None);
    }

    use crate::stack_words::StackWords as Stack;

    #[test]
    fn a_row_rule_and_its_frame_rule_take_the_same_step() {
        let bp = 0x7000_0100;
        let sp = 0x7000_0040;
        let stack = Stack(HashMap::from_iter((0..64).map(|i| (sp + 8 * i, 0x1000 + i))));
        let regs = Regs { ip: 0x4000, sp, bp };
        for (from_bp, cfa_offset, bp_at) in [
            (false, 8, None),
            (false, 0x38, Some(-16)),
            (true, 16, Some(-16)),
            (true, 0x40, None),
            (false, 0x98, Some(-0x48)),
        ] {
            let row = CfiRule { cfa_from_bp: from_bp, cfa_offset, bp_at };
            let frame = row.as_frame_rule().expect("no overflow");
            assert_eq!(frame.apply(&stack, regs), row.caller(&stack, regs), "{row:?}");
            assert!(row.caller(&stack, regs).is_some(), "{row:?}");
            assert_eq!(frame.bp_based(), row.bp_based());
            let cfa = row.caller(&stack, regs).unwrap().sp;
            assert_eq!(frame.bp_slot(regs), row.bp_slot(cfa), "{row:?}");
        }
        assert!(CfiRule { cfa_from_bp: false, cfa_offset: i32::MIN, bp_at: None }.as_frame_rule().is_none());
    }
}
