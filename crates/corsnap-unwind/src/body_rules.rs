//! Each managed function's body rule, compiled when its region is learned
//! (on the agent's thread), as [`native_table`](crate::native_table) does for
//! native modules.
//!
//! A managed frame met for the first time was unwound from its
//! `UNWIND_INFO` in full: the record read (in the image, for ReadyToRun
//! code), the code from the address to the function's end read for the
//! epilogue check, pe-unwind-info run, then the rule derived and checked.
//! At 100 samples a second all of it is cold: 4.7 µs for a return address
//! and 8.4 µs for a leaf on `taskfaults.cs`, where exception handling meets
//! hundreds of new return addresses in CoreLib's image every few seconds.
//!
//! But from the end of its prologue to its end, outside an epilogue, a
//! function's frame is the same at every address: one [`FrameRule`]. A
//! return address always lies there (the call was made after the prologue;
//! the JIT puts no epilogue right after a call, as Windows' unwinder
//! requires), and so does a leaf whose code does not begin an epilogue
//! ([`may_begin_epilogue`](crate::leaf_rules::may_begin_epilogue)). So each
//! function's rule and prologue size are kept in one word beside its
//! function-table entry, and such a frame costs the entry's search, that
//! word and the rule's two stack reads.
//!
//! A rule is kept only where it is checked: pe-unwind-info unwinds the same
//! record at the prologue's end over a stack of marked words, and the rule
//! must find the same caller. Records the rule cannot describe (chained,
//! large frames, frame registers other than RBP) get no word, and their
//! frames are unwound in full as before.

use std::collections::HashMap;
use std::ops::Range;

use pe_unwind_info::x86_64::FunctionTableEntries;

use crate::frame_rule::FrameRule;
use crate::{large_frame, Memory, PeState, Regs};

/// A word of no rule.
pub(crate) const NO_BODY_RULE: u64 = 0;

/// A function's rule and prologue size in one word: the rule's
/// [`FrameRule::to_word`] with the return address's offset cut to 24 bits
/// (a frame under 8 MiB) and the prologue's size in the 8 bits freed.
fn pack(rule: FrameRule, prologue: u8) -> Option<u64> {
    let word = rule.to_word()?;
    let ra_at = word as u32 as i32;
    if !(-(1 << 23)..1 << 23).contains(&ra_at) || !rule.is_known() {
        return None;
    }
    Some(word & !0xff00_0000 | u64::from(prologue) << 24)
}

/// Back from [`pack`]: the rule and the prologue's size, or `None` for
/// [`NO_BODY_RULE`].
pub(crate) fn unpack(word: u64) -> Option<(FrameRule, u8)> {
    if word == NO_BODY_RULE {
        return None;
    }
    let prologue = (word >> 24) as u8;
    // The 24-bit offset, sign-extended into the rule's 32.
    let ra_at = ((word as u32) << 8) as i32 >> 8;
    let rule = FrameRule::from_word(word & !0xffff_ffff | u64::from(ra_at as u32));
    Some((rule, prologue))
}

/// The body rule of every entry of the function table `functions` (12-byte
/// `RUNTIME_FUNCTION`s), in the table's order; `info_at(rva)` gives the
/// `UNWIND_INFO` record at `rva` (at least its header and codes). An entry
/// whose record is missing or not of the plain shape gets [`NO_BODY_RULE`].
pub(crate) fn compile<'a>(functions: &[u8], info_at: impl Fn(u32) -> Option<&'a [u8]>) -> Vec<u64> {
    // A ReadyToRun image shares one record among the functions whose
    // prologues are alike (CoreLib: 50,000 functions), and a record's rule
    // does not depend on its function: each record is checked once.
    let mut by_record: HashMap<u32, u64> = HashMap::new();
    functions
        .chunks_exact(12)
        .map(|entry| {
            let field = |i: usize| u32::from_le_bytes([entry[i], entry[i + 1], entry[i + 2], entry[i + 3]]);
            let (begin, end, info_rva) = (field(0), field(4), field(8));
            let Some(info) = info_at(info_rva) else { return NO_BODY_RULE };
            // A function no longer than its prologue has no body.
            match info.get(1) {
                Some(&prologue) if begin.saturating_add(u32::from(prologue)) < end => *by_record
                    .entry(info_rva)
                    .or_insert_with(|| checked_rule(entry, begin..end, info).unwrap_or(NO_BODY_RULE)),
                _ => NO_BODY_RULE,
            }
        })
        .collect()
}

/// The packed rule of the record `info` of the function at RVAs `function`
/// (whose table entry is `entry`), where pe-unwind-info agrees with it at
/// the end of the prologue, which lies inside the function.
fn checked_rule(entry: &[u8], function: Range<u32>, info: &[u8]) -> Option<u64> {
    if large_frame::uses_large_frame(info) {
        return None;
    }
    let prologue = *info.get(1)?;
    let (at, end) = (function.start.checked_add(u32::from(prologue))?, function.end);
    let rule = FrameRule::derive(info, u32::from(prologue))?;
    // The frame over a stack whose every word is its own address, marked:
    // each slot read shows where it was read.
    let stack = MarkedStack { words: STACK.clone() };
    let regs = Regs { ip: 0, sp: STACK.start + STACK_SIZE / 2, bp: STACK.start + STACK_SIZE * 3 / 4 };
    let mut state = PeState { sp: regs.sp, bp: regs.bp, mem: &stack };
    let code_len = usize::try_from(end.checked_sub(at).filter(|&n| n > 0)?).ok()?;
    let memory_at_rva = |r: u32| -> Option<&[u8]> {
        // The code at the address: bytes that are no epilogue (a body
        // address outside one, as every address this rule serves).
        if r == at {
            crate::NOT_AN_EPILOGUE.get(..code_len)
        } else if r == u32::from_le_bytes(entry.get(8..12)?.try_into().ok()?) {
            Some(info)
        } else {
            None
        }
    };
    let full = FunctionTableEntries::parse(entry).unwind_frame(&mut state, memory_at_rva, at)?;
    let by_rule = rule.apply(&stack, regs)?;
    (by_rule == Regs { ip: full, sp: state.sp, bp: state.bp }).then(|| pack(rule, prologue)).flatten()
}

/// Where [`checked_rule`]'s marked stack lies: any range works, as nothing
/// is read from the process.
const STACK: Range<u64> = 0x1000_0000..0x1000_0000 + STACK_SIZE;
const STACK_SIZE: u64 = 1 << 24;

/// A stack whose word at `a` is `a` with a mark (so that no word read is
/// mistaken for a register's value).
struct MarkedStack {
    words: Range<u64>,
}

impl Memory for MarkedStack {
    fn stack_word(&self, addr: u64) -> Option<u64> {
        (addr.is_multiple_of(8) && self.words.contains(&addr)).then_some(addr ^ 0x5a5a_0000_0000_0000)
    }
    fn code_bytes(&self, _: &crate::ManagedCode, _: Range<u64>) -> Option<&[u8]> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(begin: u32, end: u32, info: u32) -> Vec<u8> {
        [begin, end, info].iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn a_framed_body_gets_its_rule_and_prologue() {
        // push rbp; mov rbp, rsp; sub rsp, 16: prologue 8, RBP at offset 0.
        let info = [0x01, 0x08, 0x03, 0x05, 0x08, 0x12, 0x04, 0x03, 0x01, 0x50, 0, 0];
        let words = compile(&table(0x1000, 0x1020, 0x1020), |rva| (rva == 0x1020).then_some(&info[..]));
        let (rule, prologue) = unpack(words[0]).unwrap();
        assert_eq!(prologue, 8);
        assert_eq!(rule, FrameRule::derive(&info, 8).unwrap());
    }

    #[test]
    fn negative_offsets_and_frameless_bodies_round_trip() {
        for rule in [FrameRule::known(true, -0x30, Some(-0x38)), FrameRule::known(false, 0x48, None)] {
            assert_eq!(unpack(pack(rule, 200).unwrap()), Some((rule, 200)));
        }
        assert_eq!(pack(FrameRule::known(false, 1 << 23, None), 1), None, "a frame of 8 MiB or more");
    }

    #[test]
    fn records_without_a_plain_rule_or_a_body_get_none() {
        // Chained record (flag 4).
        let chained = [0x21, 0x01, 0x01, 0x00, 0x01, 0x50, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        // Prologue as long as the function.
        let whole = [0x01, 0x20, 0x01, 0x00, 0x01, 0x50, 0, 0];
        for info in [&chained[..], &whole[..]] {
            let words = compile(&table(0x1000, 0x1020, 0x1020), |_| Some(info));
            assert_eq!(words, [NO_BODY_RULE]);
        }
        assert_eq!(compile(&table(0x1000, 0x1020, 0x1020), |_| None), [NO_BODY_RULE]);
    }
}
