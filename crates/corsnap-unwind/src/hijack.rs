//! The runtime's hijack trampoline (`OnHijackTripThread`, hand-written
//! assembly in libcoreclr), recognised by its code.
//!
//! To stop a thread running managed code, the runtime may replace the return
//! address of the method it is in with this trampoline's address. When the
//! method returns, it "returns" into the trampoline, which pushes a slot for
//! the real return address (filled in by `OnHijackWorker` from the thread
//! object), saves registers and calls the worker, which waits for the
//! suspension to end. The trampoline's `.eh_frame` describes it as if it had
//! been called: it puts the return address one word above the slot, where
//! the hijacked method's caller keeps its own data. A walk by that CFI ends
//! or goes astray there (a thread the runtime stopped this way walked to an
//! empty managed stack). So the walker steps over the trampoline by its
//! prologue instead, and only at the return site of its one call: anywhere
//! else in it (the slot not yet filled, or already popped) the walk stops.

use std::ops::Range;

/// What the trampoline's prologue says about its frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HijackStub {
    /// Its code: from its first instruction to the end of its `ret`.
    pub range: Range<u64>,
    /// The return address of its call to the worker.
    pub call_return: u64,
    /// From the stack pointer at `call_return` to the slot holding the real
    /// return address (the first push); the caller's stack pointer is the
    /// word above it.
    pub return_slot: u64,
    /// From the stack pointer at `call_return` to the saved `rbp`.
    pub saved_bp: u64,
}

/// The trampoline's first bytes on every runtime seen (3.1 to 10): `push
/// rax` (the slot), then `push rbp; push rbx; push r15; push r14; push r13;
/// push r12`.
pub const HIJACK_STUB_START: &[u8] = &[0x50, 0x55, 0x53, 0x41, 0x57, 0x41, 0x56, 0x41, 0x55, 0x41, 0x54];

/// Decodes the trampoline at `code` (which starts at address `start`):
/// pushes, `mov rdi, rsp`, the stack allocation, `movdqa` stores of the
/// return registers, the call; then the mirror image, up to `ret`. `None`
/// for code that is not exactly that shape.
pub fn parse_hijack_stub(code: &[u8], start: u64) -> Option<HijackStub> {
    let mut at = 0;
    let mut pushes = Vec::new();
    loop {
        match code.get(at..at + 2)? {
            [b @ 0x50..=0x57, _] => {
                pushes.push(u32::from(*b - 0x50));
                at += 1;
            }
            [0x41, b @ 0x50..=0x57] => {
                pushes.push(8 + u32::from(*b - 0x50));
                at += 2;
            }
            _ => break,
        }
    }
    // The slot first (rax), then rbp: both offsets depend on it.
    if pushes.len() < 3 || pushes[0] != 0 || pushes[1] != 5 {
        return None;
    }
    expect(code, &mut at, &[0x48, 0x89, 0xe7])?; // mov rdi, rsp
    let alloc = match code.get(at..at + 5)? {
        [0x48, 0x8d, 0x64, 0x24, disp] if (*disp as i8) < 0 => {
            at += 5;
            u64::from((*disp as i8).unsigned_abs())
        }
        [0x48, 0x83, 0xec, imm, _] => {
            at += 4;
            u64::from(*imm)
        }
        _ => 0,
    };
    skip_vector_moves(code, &mut at, 0x7f);
    expect(code, &mut at, &[0xe8])?; // call rel32
    at += 4;
    code.get(..at)?;
    let call_return = start + at as u64;
    // The way out: the loads, the stack given back, the pops, `ret`.
    skip_vector_moves(code, &mut at, 0x6f);
    match code.get(at..at + 5)? {
        [0x48, 0x8d, 0x64, 0x24, disp] if *disp as i8 as i64 == alloc as i64 => at += 5,
        [0x48, 0x83, 0xc4, imm, _] if u64::from(*imm) == alloc => at += 4,
        _ if alloc == 0 => {}
        _ => return None,
    }
    for _ in 1..pushes.len() {
        match code.get(at)? {
            0x58..=0x5f => at += 1,
            0x41 if matches!(code.get(at + 1)?, 0x58..=0x5f) => at += 2,
            _ => return None,
        }
    }
    expect(code, &mut at, &[0xc3])?;
    let words = pushes.len() as u64;
    Some(HijackStub {
        range: start..start + at as u64,
        call_return,
        return_slot: alloc + (words - 1) * 8,
        saved_bp: alloc + (words - 2) * 8,
    })
}

fn expect(code: &[u8], at: &mut usize, bytes: &[u8]) -> Option<()> {
    (code.get(*at..*at + bytes.len())? == bytes).then(|| *at += bytes.len())
}

/// `movdqa [rsp], xmm0` / `movdqa [rsp+d8], xmmN` (`op` 0x7f), or the loads
/// back (`op` 0x6f).
fn skip_vector_moves(code: &[u8], at: &mut usize, op: u8) {
    loop {
        match code.get(*at..*at + 6) {
            Some([0x66, 0x0f, o, modrm, 0x24, _]) if *o == op && modrm & 0xc7 == 0x44 => *at += 6,
            Some([0x66, 0x0f, o, modrm, 0x24, _]) if *o == op && modrm & 0xc7 == 0x04 => *at += 5,
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn the_trampolines_of_net10_and_net8_are_decoded() {
        // libcoreclr.so 10.0.12 at 0x5fc560: ten pushes (rcx too), 0x20 bytes.
        let net10 = hex("50555341574156415541545152504889e7488d6424e0660f7f0424660f7f4c2410e86aa9f1ff\
             660f6f0424660f6f4c2410488d642420585a59415c415d415e415f5b5dc3662e0f1f84");
        let stub = parse_hijack_stub(&net10, 0x1000).unwrap();
        assert_eq!(stub.call_return, 0x1000 + 38);
        assert_eq!(stub.return_slot, 104);
        assert_eq!(stub.saved_bp, 96);
        assert_eq!(stub.range, 0x1000..0x1000 + 38 + 30);
        // 8.0.33 (and 9.0.22, 3.1.3): nine pushes, 0x28 bytes.
        let net8 = hex("505553415741564155415452504889e7488d6424d8660f7f0424660f7f4c2410e807f6f0ff\
             660f6f0424660f6f4c2410488d642428585a415c415d415e415f5b5dc34885ff");
        let stub = parse_hijack_stub(&net8, 0).unwrap();
        assert_eq!(stub.call_return, 37);
        assert_eq!(stub.return_slot, 0x28 + 64);
        assert_eq!(stub.saved_bp, 0x28 + 56);
        assert_eq!(stub.range.end, 37 + 29);
    }

    #[test]
    fn other_code_is_not_taken_for_the_trampoline() {
        // The same start, but no `mov rdi, rsp`.
        assert_eq!(parse_hijack_stub(&hex("5055534157415641554154524889e5e800000000"), 0), None);
        // Cut short.
        assert_eq!(parse_hijack_stub(&hex("505553415741564155415452504889e7488d6424d8"), 0), None);
        assert_eq!(parse_hijack_stub(&[], 0), None);
    }
}
