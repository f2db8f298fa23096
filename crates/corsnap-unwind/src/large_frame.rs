//! Frames whose `UNWIND_INFO` uses CoreCLR's `UWOP_SET_FPREG_LARGE` (11),
//! which pe-unwind-info does not know (Windows' own unwinder has no such
//! code; CoreCLR's has, in `src/coreclr/unwinder/amd64/unwinder.cpp`).
//!
//! The JIT emits it when the frame pointer is set further than 240 bytes
//! above the stack pointer (`lea rbp, [rsp+0x300]` after a large frame
//! allocation), typically in methods with a `stackalloc` (`localloc`),
//! which then move the stack pointer by amounts no unwind code records: the
//! frame can only be unwound from the frame pointer. .NET 10's
//! `String.SplitInternal` is one: before this, every caller of it was lost
//! to a garbage return address (`[unknown code]`).
//!
//! Such records are interpreted here, the whole of them: the codes in order
//! (the reverse of the prologue's), each applied only once the prologue has
//! passed it, and, in an epilogue, the epilogue's own instructions emulated
//! (Windows' rule: `lea rsp, [fp+d]` or `add rsp, n`, pops, then `ret` or a
//! jump out). Everything is bounds-checked; nothing allocates.

use crate::{Memory, Regs, Step};

// x64 unwind codes (Windows' `UNWIND_CODE`, and CoreCLR's 11), shared
// with `frame_rule.rs`.
pub(crate) const UWOP_PUSH_NONVOL: u8 = 0;
pub(crate) const UWOP_ALLOC_LARGE: u8 = 1;
pub(crate) const UWOP_ALLOC_SMALL: u8 = 2;
pub(crate) const UWOP_SET_FPREG: u8 = 3;
pub(crate) const UWOP_SAVE_NONVOL: u8 = 4;
pub(crate) const UWOP_SAVE_NONVOL_FAR: u8 = 5;
const UWOP_EPILOG: u8 = 6;
pub(crate) const UWOP_SAVE_XMM128: u8 = 8;
pub(crate) const UWOP_SAVE_XMM128_FAR: u8 = 9;
const UWOP_PUSH_MACHFRAME: u8 = 10;
const UWOP_SET_FPREG_LARGE: u8 = 11;
pub(crate) const UNW_FLAG_CHAININFO: u8 = 4;
pub(crate) const RBP: u8 = 5;

/// The slots (2 bytes each) an unwind code takes, `None` for an unknown one.
fn slots(op: u8, info: u8) -> Option<usize> {
    Some(match op {
        UWOP_PUSH_NONVOL | UWOP_ALLOC_SMALL | UWOP_SET_FPREG | UWOP_EPILOG | UWOP_PUSH_MACHFRAME => 1,
        UWOP_ALLOC_LARGE if info == 0 => 2,
        UWOP_ALLOC_LARGE => 3,
        UWOP_SAVE_NONVOL | UWOP_SAVE_XMM128 => 2,
        UWOP_SAVE_NONVOL_FAR | UWOP_SAVE_XMM128_FAR | UWOP_SET_FPREG_LARGE => 3,
        _ => return None,
    })
}

/// Whether the record `info` uses `UWOP_SET_FPREG_LARGE`.
pub(crate) fn uses_large_frame(info: &[u8]) -> bool {
    let Some(&count) = info.get(2) else { return false };
    let codes = info.get(4..4 + 2 * usize::from(count)).unwrap_or(&[]);
    let mut i = 0;
    while let Some(c) = codes.get(2 * i..2 * i + 2) {
        let (op, opinfo) = (c[1] & 0xf, c[1] >> 4);
        if op == UWOP_SET_FPREG_LARGE {
            return true;
        }
        let Some(n) = slots(op, opinfo) else { return false };
        i += n;
    }
    false
}

fn slot_u16(codes: &[u8], slot: usize) -> Option<u64> {
    Some(u64::from(u16::from_le_bytes(codes.get(2 * slot..2 * slot + 2)?.try_into().ok()?)))
}

fn slot_u32(codes: &[u8], slot: usize) -> Option<u64> {
    Some(u64::from(u32::from_le_bytes(codes.get(2 * slot..2 * slot + 4)?.try_into().ok()?)))
}

/// One step through a frame described by `info` (an `UNWIND_INFO` using
/// `UWOP_SET_FPREG_LARGE`), at `offset` bytes into its function, whose code
/// from the instruction pointer on is `code` (for the epilogue check).
pub(crate) fn step<M: Memory>(info: &[u8], mem: &M, regs: Regs, offset: u64, code: &[u8]) -> Step {
    if let Some(step) = epilogue_step(mem, regs, code) {
        return step;
    }
    body_step(info, mem, regs, offset).unwrap_or(Step::Lost)
}

fn body_step<M: Memory>(info: &[u8], mem: &M, regs: Regs, offset: u64) -> Option<Step> {
    let (flags, count, frame) = (info.first()? >> 3, *info.get(2)?, *info.get(3)?);
    if flags & UNW_FLAG_CHAININFO != 0 || frame & 0xf != RBP {
        return None;
    }
    let codes = info.get(4..4 + 2 * usize::from(count))?;
    let (mut sp, mut bp) = (regs.sp, regs.bp);
    // Where SAVE_NONVOL offsets count from: the stack pointer once the
    // frame pointer is set (recomputed from it), else the current one.
    let mut base = sp;
    let mut i = 0;
    while i < usize::from(count) {
        let prolog_offset = u64::from(*codes.get(2 * i)?);
        let (op, opinfo) = (codes.get(2 * i + 1)? & 0xf, codes.get(2 * i + 1)? >> 4);
        let n = slots(op, opinfo)?;
        // A code applies once the prologue has executed its instruction.
        let done = prolog_offset <= offset;
        match op {
            UWOP_PUSH_NONVOL if done => {
                let v = mem.stack_word(sp)?;
                if opinfo == RBP {
                    bp = v;
                }
                sp += 8;
            }
            UWOP_ALLOC_LARGE if done => {
                sp += if opinfo == 0 { slot_u16(codes, i + 1)? * 8 } else { slot_u32(codes, i + 1)? };
            }
            UWOP_ALLOC_SMALL if done => sp += u64::from(opinfo) * 8 + 8,
            UWOP_SET_FPREG if done => {
                sp = regs.bp.checked_sub(u64::from(frame >> 4) * 16)?;
                base = sp;
            }
            UWOP_SET_FPREG_LARGE if done => {
                sp = regs.bp.checked_sub(slot_u32(codes, i + 1)? * 16)?;
                base = sp;
            }
            UWOP_SAVE_NONVOL if done && opinfo == RBP => bp = mem.stack_word(base + slot_u16(codes, i + 1)? * 8)?,
            UWOP_SAVE_NONVOL_FAR if done && opinfo == RBP => bp = mem.stack_word(base + slot_u32(codes, i + 1)?)?,
            UWOP_PUSH_MACHFRAME => return None,
            _ => {}
        }
        i += n;
    }
    let ra = mem.stack_word(sp)?;
    Some(Step::Next(Regs { ip: ra, sp: sp + 8, bp }))
}

/// Windows' epilogue rule, as CoreCLR's unwinder applies it: at `lea rsp,
/// [rbp+d]` or `add rsp, n`, then only pops, then `ret` (or a jump: a tail
/// call), the thread is in an epilogue: emulate it. `None`: not one.
fn epilogue_step<M: Memory>(mem: &M, regs: Regs, code: &[u8]) -> Option<Step> {
    let (mut sp, mut bp) = (regs.sp, regs.bp);
    let mut at = 0usize;
    let byte = |i: usize| code.get(i).copied();
    let i32_at = |i: usize| Some(i64::from(i32::from_le_bytes(code.get(i..i + 4)?.try_into().ok()?)));
    match (byte(0)?, byte(1)?, byte(2)?) {
        // lea rsp, [rbp+disp8] / [rbp+disp32]
        (0x48, 0x8d, 0x65) => {
            sp = regs.bp.wrapping_add_signed(i64::from(byte(3)? as i8));
            at = 4;
        }
        (0x48, 0x8d, 0xa5) => {
            sp = regs.bp.wrapping_add_signed(i32_at(3)?);
            at = 7;
        }
        // add rsp, imm8 / imm32
        (0x48, 0x83, 0xc4) => {
            sp += u64::from(byte(3)?);
            at = 4;
        }
        (0x48, 0x81, 0xc4) => {
            sp = sp.wrapping_add_signed(i32_at(3)?);
            at = 7;
        }
        _ => {}
    }
    loop {
        match byte(at)? {
            // pop r64 (rbp is 0x5d)
            0x58..=0x5f => {
                let v = mem.stack_word(sp)?;
                if byte(at)? == 0x5d {
                    bp = v;
                }
                sp += 8;
                at += 1;
            }
            0x41 if matches!(byte(at + 1)?, 0x58..=0x5f) => {
                mem.stack_word(sp)?;
                sp += 8;
                at += 2;
            }
            // ret, or, after the frame was taken down, a jump out (a tail
            // call; a bare jump is a jump within the function).
            0xc3 | 0xc2 => {
                let ra = mem.stack_word(sp)?;
                return Some(Step::Next(Regs { ip: ra, sp: sp + 8, bp }));
            }
            0xe9 | 0xeb | 0xff if at > 0 => {
                let ra = mem.stack_word(sp)?;
                return Some(Step::Next(Regs { ip: ra, sp: sp + 8, bp }));
            }
            _ => return None,
        }
    }
}
