//! Rules for managed frames met again, so that a walk through them reads
//! the stack and nothing else.
//!
//! Unwinding a managed frame by its `UNWIND_INFO` touches four places that,
//! at 100 samples a second, are cold in the CPU's caches: the region, the
//! function-table entry, the record, and the code at the return address
//! (for the epilogue check). One after another, each waiting on the last:
//! most of a walk's time. But a return address always sits in a fully
//! established frame (the call was made after the prologue, and the
//! epilogue has not begun), where the whole record reduces to a rule of
//! three numbers: the return address is at a fixed offset from the stack or
//! frame pointer, the caller's stack pointer just above it, and the caller's
//! frame pointer either unchanged or at another fixed offset. The rule is
//! derived from the record once, checked against pe-unwind-info's own
//! result on the same frame, and kept in the walk cache beside the address.
//!
//! Only records that are plainly of this shape get a rule (version 1, no
//! chained record, only pushes, allocations, saves and the frame register);
//! the rest are unwound in full each time, as before.

use crate::large_frame::{
    RBP, UNW_FLAG_CHAININFO, UWOP_ALLOC_LARGE, UWOP_ALLOC_SMALL, UWOP_PUSH_NONVOL, UWOP_SAVE_NONVOL,
    UWOP_SAVE_NONVOL_FAR, UWOP_SAVE_XMM128, UWOP_SAVE_XMM128_FAR, UWOP_SET_FPREG,
};
use crate::{Memory, Regs};

/// How to unwind a managed frame from one return address (see the module
/// documentation); or that no rule is known yet, or that none applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct FrameRule {
    state: RuleState,
    /// The base is the frame pointer (else the stack pointer).
    from_bp: bool,
    /// The caller's frame pointer is read at `bp_at` (else unchanged).
    restores_bp: bool,
    /// The return address's slot, as an offset from the base.
    ra_at: i32,
    /// The saved frame pointer's slot, as an offset from the base.
    bp_at: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum RuleState {
    /// Not derived yet.
    #[default]
    Untried,
    /// Derived and checked.
    Known,
    /// The record is not of the shape a rule describes, or the rule did not
    /// agree with the full unwind: unwound in full each time.
    Unsuitable,
    /// A native frame whose CFI leaves the return address undefined: the
    /// thread's outermost frame (`clone3`, `_start`); the walk ends there.
    Outermost,
}

impl FrameRule {
    pub(crate) const UNSUITABLE: FrameRule =
        FrameRule { state: RuleState::Unsuitable, from_bp: false, restores_bp: false, ra_at: 0, bp_at: 0 };

    /// The thread's outermost frame: the walk is complete there.
    pub(crate) const OUTERMOST: FrameRule =
        FrameRule { state: RuleState::Outermost, from_bp: false, restores_bp: false, ra_at: 0, bp_at: 0 };

    pub(crate) fn is_outermost(&self) -> bool {
        self.state == RuleState::Outermost
    }

    /// A known rule of the given shape: the return address at `ra_at` from
    /// the base (the frame pointer when `from_bp`, else the stack pointer),
    /// the caller's frame pointer at `bp_at` from it when given.
    pub(crate) fn known(from_bp: bool, ra_at: i32, bp_at: Option<i32>) -> FrameRule {
        FrameRule { state: RuleState::Known, from_bp, restores_bp: bp_at.is_some(), ra_at, bp_at: bp_at.unwrap_or(0) }
    }

    pub(crate) fn is_untried(&self) -> bool {
        self.state == RuleState::Untried
    }

    /// The rule of the `UNWIND_INFO` record `info` (header first) at
    /// `offset` bytes into its function, for a return address; `None` if
    /// the record is not of the plain shape this describes, or the address
    /// is inside the prologue (a call there: a stack probe).
    pub(crate) fn derive(info: &[u8], offset: u32) -> Option<FrameRule> {
        let header = info.get(..4)?;
        let (version, flags) = (header[0] & 7, header[0] >> 3);
        if version != 1 || flags & UNW_FLAG_CHAININFO != 0 || offset < u32::from(header[1]) {
            return None;
        }
        let count = usize::from(header[2]);
        let codes = info.get(4..4 + 2 * count)?;
        let slot = |i: usize| -> Option<u32> {
            Some(u32::from(u16::from_le_bytes([*codes.get(2 * i)?, *codes.get(2 * i + 1)?])))
        };
        let frame_register = header[3] & 0xf;
        let from_bp = match frame_register {
            0 => false,
            RBP => true,
            _ => return None,
        };
        // Where the established frame's stack pointer is, from the base: the
        // frame pointer was set that far above it.
        let established: i64 = if from_bp { -(i64::from(header[3] >> 4) * 16) } else { 0 };
        let mut at = established;
        let mut bp_at = None;
        let mut frame_pointer_set = false;
        let mut i = 0;
        // The codes run from the last prologue instruction back to the
        // first: each undone in order walks up the frame.
        while i < count {
            let code = codes.get(2 * i..2 * i + 2)?;
            let (op, op_info) = (code[1] & 0xf, code[1] >> 4);
            match op {
                UWOP_PUSH_NONVOL => {
                    if op_info == RBP {
                        bp_at = Some(at);
                    }
                    at += 8;
                    i += 1;
                }
                UWOP_ALLOC_SMALL => {
                    at += i64::from(op_info) * 8 + 8;
                    i += 1;
                }
                UWOP_ALLOC_LARGE if op_info == 0 => {
                    at += i64::from(slot(i + 1)?) * 8;
                    i += 2;
                }
                UWOP_ALLOC_LARGE if op_info == 1 => {
                    at += i64::from(slot(i + 1)? | slot(i + 2)? << 16);
                    i += 3;
                }
                UWOP_SET_FPREG => {
                    // Windows' unwinder sets the stack pointer from the
                    // frame register here, whatever the codes undone before
                    // (instructions after it in the prologue) moved.
                    frame_pointer_set = true;
                    at = established;
                    i += 1;
                }
                UWOP_SAVE_NONVOL => {
                    if op_info == RBP {
                        bp_at = Some(established + i64::from(slot(i + 1)?) * 8);
                    }
                    i += 2;
                }
                UWOP_SAVE_NONVOL_FAR => {
                    if op_info == RBP {
                        bp_at = Some(established + i64::from(slot(i + 1)? | slot(i + 2)? << 16));
                    }
                    i += 3;
                }
                UWOP_SAVE_XMM128 => i += 2,
                UWOP_SAVE_XMM128_FAR => i += 3,
                _ => return None,
            }
        }
        if frame_pointer_set != from_bp {
            return None;
        }
        Some(FrameRule {
            state: RuleState::Known,
            from_bp,
            restores_bp: bp_at.is_some(),
            ra_at: i32::try_from(at).ok()?,
            bp_at: i32::try_from(bp_at.unwrap_or(0)).ok()?,
        })
    }

    /// Whether the rule was derived and checked (else it unwinds nothing).
    pub(crate) fn is_known(&self) -> bool {
        self.state == RuleState::Known
    }

    /// Whether the rule also holds in the function's epilogue: a frame
    /// whose return address is right at the stack pointer, with no frame
    /// pointer, holds nothing above it, so its epilogue is the `ret` (or a
    /// tail call's `jmp`) alone, where the return address is still at the
    /// stack pointer. A leaf stopped there (the last instruction of a
    /// getter, say) is stepped by the rule, as anywhere in the body.
    pub(crate) fn holds_in_epilogue(&self) -> bool {
        self.is_known() && !self.from_bp && !self.restores_bp && self.ra_at == 0
    }

    /// A known rule as [`FrameRule::known`] takes it: from the frame
    /// pointer, the return address's slot, the saved frame pointer's.
    pub(crate) fn parts(&self) -> Option<(bool, i32, Option<i32>)> {
        self.is_known().then_some((self.from_bp, self.ra_at, self.restores_bp.then_some(self.bp_at)))
    }

    /// The rule in one word, to share between threads through plain
    /// atomics: the return address's offset in the low 32 bits, the saved
    /// frame pointer's in the next 24, then the state and the two flags.
    /// `None` for a frame pointer saved more than 8 MiB from the base.
    pub(crate) fn to_word(self) -> Option<u64> {
        if !(-(1 << 23)..1 << 23).contains(&self.bp_at) {
            return None;
        }
        let state = match self.state {
            RuleState::Untried => 0,
            RuleState::Known => 1,
            RuleState::Unsuitable => 2,
            RuleState::Outermost => 3,
        };
        Some(
            u64::from(self.ra_at as u32)
                | (u64::from(self.bp_at as u32) & 0xff_ffff) << 32
                | state << 56
                | u64::from(self.from_bp) << 58
                | u64::from(self.restores_bp) << 59,
        )
    }

    /// Back from [`FrameRule::to_word`] (bits past 59 are ignored).
    pub(crate) fn from_word(word: u64) -> FrameRule {
        let state = match (word >> 56) & 3 {
            0 => RuleState::Untried,
            1 => RuleState::Known,
            2 => RuleState::Unsuitable,
            _ => RuleState::Outermost,
        };
        // The 24-bit offset, sign-extended.
        let bp_at = (((word >> 32) as u32) << 8) as i32 >> 8;
        FrameRule {
            state,
            from_bp: word >> 58 & 1 != 0,
            restores_bp: word >> 59 & 1 != 0,
            ra_at: word as u32 as i32,
            bp_at,
        }
    }

    /// Whether the frame is found from the frame pointer (else from the
    /// stack pointer).
    pub(crate) fn bp_based(&self) -> bool {
        self.from_bp
    }

    /// Where the caller's frame pointer is read from for a frame at `regs`;
    /// `None` when the frame leaves it as it is.
    pub(crate) fn bp_slot(&self, regs: Regs) -> Option<u64> {
        let base = if self.from_bp { regs.bp } else { regs.sp };
        self.restores_bp.then(|| base.checked_add_signed(i64::from(self.bp_at))).flatten()
    }

    /// The caller's registers: two stack reads at most.
    pub(crate) fn apply<M: Memory>(&self, mem: &M, regs: Regs) -> Option<Regs> {
        if self.state != RuleState::Known {
            return None;
        }
        let base = if self.from_bp { regs.bp } else { regs.sp };
        let ra_slot = base.checked_add_signed(i64::from(self.ra_at))?;
        let ip = mem.stack_word(ra_slot)?;
        let bp =
            if self.restores_bp { mem.stack_word(base.checked_add_signed(i64::from(self.bp_at))?)? } else { regs.bp };
        Some(Regs { ip, sp: ra_slot.checked_add(8)?, bp })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    use crate::stack_words::StackWords as Stack;

    #[test]
    fn a_frame_on_rbp_with_pushes_and_an_allocation() {
        // push rbp; push rbx; sub rsp, 0x28; lea rbp, [rsp+0x30]: prologue
        // of 1 + 1 + 4 + 5 bytes; codes in reverse.
        let info = [
            1, 11, 4, 0x35, // v1, prologue 11, 4 codes, frame register rbp at offset 3*16
            11, 0x03, // SET_FPREG
            6, 0x42, // ALLOC_SMALL (4 + 1) * 8 = 0x28
            2, 0x30, // PUSH rbx
            1, 0x50, // PUSH rbp
        ];
        let rule = FrameRule::derive(&info, 40).unwrap();
        // rsp = rbp - 0x30; + 0x28 alloc; rbx at +0x28, rbp at +0x30, ra at +0x38.
        assert_eq!((rule.from_bp, rule.restores_bp, rule.ra_at, rule.bp_at), (true, true, 0x08, 0x00));
        let bp = 0x7000_0100;
        let stack = Stack(HashMap::from([(bp, 0x7000_0200), (bp + 8, 0x4242)]));
        let next = rule.apply(&stack, Regs { ip: 0x1000, sp: bp - 0x30, bp }).unwrap();
        assert_eq!(next, Regs { ip: 0x4242, sp: bp + 16, bp: 0x7000_0200 });
        assert!(FrameRule::derive(&info, 5).is_none(), "inside the prologue");
    }

    #[test]
    fn a_rule_goes_through_its_word_unchanged() {
        for rule in [
            FrameRule::known(true, 8, Some(0)),
            FrameRule::known(false, 0x18, None),
            FrameRule::known(true, -0x7000, Some(-(1 << 23))),
            FrameRule::known(false, i32::MAX, Some((1 << 23) - 1)),
            FrameRule::UNSUITABLE,
            FrameRule::OUTERMOST,
            FrameRule::default(),
        ] {
            assert_eq!(FrameRule::from_word(rule.to_word().unwrap()), rule, "{rule:?}");
        }
        assert_eq!(FrameRule::known(true, 8, Some(1 << 23)).to_word(), None);
    }

    #[test]
    fn a_frameless_body_and_records_of_other_shapes() {
        // sub rsp, 0x18 only: the return address right above the allocation.
        let info = [1, 4, 1, 0, 4, 0x22];
        let rule = FrameRule::derive(&info, 9).unwrap();
        assert_eq!((rule.from_bp, rule.restores_bp, rule.ra_at), (false, false, 0x18));
        let stack = Stack(HashMap::from([(0x5018, 0x99)]));
        assert_eq!(rule.apply(&stack, Regs { ip: 1, sp: 0x5000, bp: 7 }), Some(Regs { ip: 0x99, sp: 0x5020, bp: 7 }));
        // Chained, version 2, a machine frame: no rule.
        assert!(FrameRule::derive(&[1 | UNW_FLAG_CHAININFO << 3, 0, 0, 0], 1).is_none());
        assert!(FrameRule::derive(&[2, 0, 0, 0], 1).is_none());
        assert!(FrameRule::derive(&[1, 0, 1, 0, 0, 0x0a], 1).is_none());
    }
}
