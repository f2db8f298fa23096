//! Synthetic stacks laid out as CoreCLR's JIT lays them out, with the unwind
//! information the JIT emitted for the same shapes on .NET 8 (read from a
//! live process: `push rax` frameless Tier1 methods, `push rbp` without a
//! frame register, RBP-framed Tier0 methods).

use super::*;
use std::collections::HashMap;

const STACK_TOP: u64 = 0x7000_0000;

/// A stack of words and code bytes, as a recorded sample would bring them.
struct Recorded {
    stack: HashMap<u64, u64>,
    stack_range: Range<u64>,
    code: Vec<(u64, Vec<u8>)>,
}

impl Memory for Recorded {
    fn stack_word(&self, addr: u64) -> Option<u64> {
        if addr < self.stack_range.start || addr.checked_add(8)? > self.stack_range.end {
            return None;
        }
        Some(self.stack.get(&addr).copied().unwrap_or(0xdead_beef))
    }

    fn code_bytes(&self, _region: &ManagedCode, range: Range<u64>) -> Option<&[u8]> {
        let (start, bytes) = self.code.iter().find(|(s, b)| *s <= range.start && range.end <= s + b.len() as u64)?;
        bytes.get((range.start - start) as usize..(range.end - start) as usize)
    }

    fn leaf_code(&self, range: Range<u64>) -> Option<&[u8]> {
        let (start, bytes) = self.code.iter().find(|(s, b)| *s <= range.start && range.end <= s + b.len() as u64)?;
        bytes.get((range.start - start) as usize..(range.end - start) as usize)
    }
}

/// One JIT'd body at `start` with `code`, one RUNTIME_FUNCTION and its
/// UNWIND_INFO placed (as the JIT places it) right after the code.
fn body(start: u64, code: &[u8], unwind: &[u8]) -> (ManagedCode, (u64, Vec<u8>)) {
    let base = start - 0x1000;
    let begin = 0x1000u32;
    let end = begin + code.len() as u32;
    let unwind_rva = (end + 3) & !3;
    let mut functions = Vec::new();
    for v in [begin, end, unwind_rva] {
        functions.extend_from_slice(&v.to_le_bytes());
    }
    let region = ManagedCode {
        code: start..start + code.len() as u64,
        base,
        functions: functions.into(),
        unwind: UnwindBytes::Copied { rva: unwind_rva, bytes: unwind.to_vec().into() },
        tag: start,
        frameless: false,
        body_rules: Default::default(),
        function_pages: Default::default(),
    };
    (region, (start, code.to_vec()))
}

const MAIN: u64 = 0x10000;
const A3: u64 = 0x10040;
const A4: u64 = 0x10080;
const A5: u64 = 0x100c0;
const HOT: u64 = 0x10100;
const UNKNOWN_STUB: u64 = 0x90000;

/// `push rax; call; inc eax; add rsp,8; ret`: frameless, one alloc of 8.
const FRAMELESS: [u8; 13] = [0x50, 0xe8, 0, 0, 0, 0, 0xff, 0xc0, 0x48, 0x83, 0xc4, 0x08, 0xc3];
/// UNWIND_INFO v1, prolog 1, 1 code: at 1, UWOP_ALLOC_SMALL 8.
const FRAMELESS_UNWIND: [u8; 8] = [0x01, 0x01, 0x01, 0x00, 0x01, 0x02, 0, 0];
/// `push rbp; xor eax,eax; nop...; pop rbp; ret`
const PUSH_RBP: [u8; 8] = [0x55, 0x31, 0xc0, 0x90, 0x90, 0x90, 0x5d, 0xc3];
/// prolog 1, 1 code: at 1, UWOP_PUSH_NONVOL rbp.
const PUSH_RBP_UNWIND: [u8; 8] = [0x01, 0x01, 0x01, 0x00, 0x01, 0x50, 0, 0];
/// `push rbp; mov rbp,rsp; sub rsp,16; call...; add rsp,16; pop rbp; ret`
const FRAMED: [u8; 21] =
    [0x55, 0x48, 0x8b, 0xec, 0x48, 0x83, 0xec, 0x10, 0xe8, 0, 0, 0, 0, 0x90, 0x48, 0x83, 0xc4, 0x10, 0x5d, 0xc3, 0x90];
/// prolog 8, frame register RBP at offset 0, 3 codes: at 8 alloc 16, at 4
/// set FP, at 1 push rbp.
const FRAMED_UNWIND: [u8; 12] = [0x01, 0x08, 0x03, 0x05, 0x08, 0x12, 0x04, 0x03, 0x01, 0x50, 0, 0];

/// FRAMED with its call in a loop: `call; jmp back to the call`, so its
/// return address points at a `jmp` (the same unwind information).
const LOOPING: [u8; 21] =
    [0x55, 0x48, 0x8b, 0xec, 0x48, 0x83, 0xec, 0x10, 0xe8, 0, 0, 0, 0, 0xeb, 0xf9, 0x48, 0x83, 0xc4, 0x10, 0x5d, 0xc3];

/// Main -> A3 -> A4 -> A5 -> Hot, with Hot's leaf in its loop. Returns the
/// map, the memory and the leaf registers.
fn chain() -> (CodeMap, Recorded, Regs) {
    chain_with_main(&FRAMED)
}

fn chain_with_main(main: &[u8]) -> (CodeMap, Recorded, Regs) {
    chain_of(main, false)
}

/// The chain with each body's rule compiled (see [`body_rules`]) when
/// `body_rules`.
fn chain_of(main: &[u8], body_rules: bool) -> (CodeMap, Recorded, Regs) {
    chain_unknowing(main, body_rules, None)
}

/// The chain, with the body at `unknown` (if any) left out of the map.
fn chain_unknowing(main: &[u8], body_rules: bool, unknown: Option<u64>) -> (CodeMap, Recorded, Regs) {
    let sp0 = STACK_TOP - 0x100;
    let mut stack = HashMap::new();
    stack.insert(sp0, 0); // Main's return address: the root
    stack.insert(sp0 - 8, 0); // Main: push rbp (no caller frame)
    let main_bp = sp0 - 8;
    // Main's 16 bytes of locals, then the call.
    stack.insert(sp0 - 32, MAIN + 13); // return into Main after its call
    stack.insert(sp0 - 40, 0x1111); // A3: push rax
    stack.insert(sp0 - 48, A3 + 6);
    stack.insert(sp0 - 56, 0x2222); // A4: push rax
    stack.insert(sp0 - 64, A4 + 6);
    stack.insert(sp0 - 72, 0x3333); // A5: push rax
    stack.insert(sp0 - 80, A5 + 6);
    stack.insert(sp0 - 88, main_bp); // Hot: push rbp (Main's, untouched by A3..A5)
    let mut managed = Vec::new();
    let mut code = Vec::new();
    for (start, bytes, unwind) in [
        (MAIN, main, &FRAMED_UNWIND[..]),
        (A3, &FRAMELESS[..], &FRAMELESS_UNWIND[..]),
        (A4, &FRAMELESS[..], &FRAMELESS_UNWIND[..]),
        (A5, &FRAMELESS[..], &FRAMELESS_UNWIND[..]),
        (HOT, &PUSH_RBP[..], &PUSH_RBP_UNWIND[..]),
    ] {
        let (region, c) = body(start, bytes, unwind);
        code.push(c);
        if unknown == Some(start) {
            continue;
        }
        managed.push(if body_rules { region.with_body_rules(None) } else { region });
    }
    let stacks = vec![Range { start: STACK_TOP - 0x10000, end: STACK_TOP }];
    let map = CodeMap::new(Vec::new(), managed, stacks, 0);
    let mem = Recorded { stack, stack_range: STACK_TOP - 0x10000..STACK_TOP, code };
    (map, mem, Regs { ip: HOT + 3, sp: sp0 - 88, bp: main_bp })
}

fn run(map: &CodeMap, mem: &Recorded, regs: Regs) -> (Vec<u64>, u32) {
    let mut out = [0u64; 64];
    let w = walk(map, mem, regs, &mut WalkCache::new(), &mut out);
    (out[..w.len].iter().map(|&f| address_of(f)).collect(), w.flags)
}

#[test]
fn frameless_tier1_callers_are_all_recovered() {
    let (map, mem, regs) = chain();
    let (frames, flags) = run(&map, &mem, regs);
    assert_eq!(frames, [HOT + 3, A5 + 6, A4 + 6, A3 + 6, MAIN + 13]);
    assert_eq!(flags, flags::COMPLETE);
}

#[test]
fn a_walk_from_the_first_frame_in_unknown_code_ends_as_the_walk_that_knows_it() {
    // What an event's stack copy keeps (from the first frame in unknown
    // code up) and how the agent walks it again once the code is learned.
    let (unknowing, mem, regs) = chain_unknowing(&FRAMED, false, Some(A4));
    let mut out = [0u64; 64];
    let first = walk(&unknowing, &mem, regs, &mut WalkCache::new(), &mut out);
    assert_ne!(first.flags & flags::UNKNOWN_CODE, 0);
    let (at, from) = first.first_unknown.expect("the frame in A4");
    assert_eq!((at, address_of(out[at])), (2, A4 + 6));
    assert_eq!(out[at] & EXACT_IP, 0);
    let (knowing, ..) = chain();
    let mut again = [0u64; 64];
    let w = walk_from(&knowing, &mem, from, false, &mut WalkCache::new(), &mut again, None);
    assert_eq!(&again[..w.len], &[A4 + 6, A3 + 6, MAIN + 13]);
    assert_eq!(w.flags, flags::COMPLETE);
    assert_eq!(w.first_unknown, None);
    // A walk from the leaf knowing everything has no first unknown frame.
    assert_eq!(walk(&knowing, &mem, regs, &mut WalkCache::new(), &mut out).first_unknown, None);
}

#[test]
fn a_return_address_at_a_jump_back_into_the_loop_is_no_epilogue() {
    // Found by walk verification on .NET 8: Tier0 `call JIT_Patchpoint;
    // jmp loop` lost every caller of the looping method.
    let (map, mem, regs) = chain_with_main(&LOOPING);
    let (frames, flags) = run(&map, &mem, regs);
    assert_eq!(frames, [HOT + 3, A5 + 6, A4 + 6, A3 + 6, MAIN + 13]);
    assert_eq!(flags, flags::COMPLETE);
    // A jump out of the function is a tail call, which is an epilogue: at
    // it, only the return address is left on the stack.
    let mut tail = LOOPING;
    tail[14] = 0x7f;
    let (map, mut mem, _) = chain_with_main(&tail);
    let sp = STACK_TOP - 0x200;
    mem.stack.insert(sp, A4 + 6);
    let (frames, _) = run(&map, &mem, Regs { ip: MAIN + 13, sp, bp: 0 });
    assert_eq!(frames[..2], [MAIN + 13, A4 + 6]);
}

#[test]
fn compiled_body_rules_walk_as_the_full_lookup_does_and_leave_prologues_and_epilogues_to_it() {
    for main in [&FRAMED[..], &LOOPING[..]] {
        let (full, mem, regs) = chain_of(main, false);
        let (compiled, _, _) = chain_of(main, true);
        assert!(compiled.managed().iter().all(|r| r.body_rules.len() == 1), "one word a function");
        // Each body's rule, compiled and checked: all five have the plain shape.
        assert!(compiled.managed().iter().all(|r| r.body_rule_at(0).is_some()));
        // Every leaf address of every body, at the stack of Hot's body and
        // at the stacks the epilogue test uses: the same walk either way.
        let starts = [(MAIN, main.len()), (A3, 13), (A4, 13), (A5, 13), (HOT, 8)];
        for (start, len) in starts {
            for ip in start..start + len as u64 {
                for sp in [regs.sp, regs.sp + 8, regs.sp + 16, regs.sp + 24] {
                    let at = Regs { ip, sp, bp: regs.bp };
                    assert_eq!(run(&compiled, &mem, at), run(&full, &mem, at), "{ip:#x} sp {sp:#x}");
                }
            }
        }
        let (frames, flags) = run(&compiled, &mem, regs);
        assert_eq!(frames, [HOT + 3, A5 + 6, A4 + 6, A3 + 6, MAIN + 13]);
        assert_eq!(flags, flags::COMPLETE);
        // With the code unreadable to the full lookup (its epilogue check
        // reads the code to the function's end), only the compiled rules
        // can step these frames: they do, and the full lookup cannot.
        let blind = LeafCodeOnly(&mem);
        let mut out = [0u64; 64];
        let w = walk(&compiled, &blind, regs, &mut WalkCache::new(), &mut out);
        let frames: Vec<u64> = out[..w.len].iter().map(|&f| address_of(f)).collect();
        assert_eq!(frames, [HOT + 3, A5 + 6, A4 + 6, A3 + 6, MAIN + 13]);
        let w = walk(&full, &blind, regs, &mut WalkCache::new(), &mut out);
        assert_ne!(w.flags & flags::COMPLETE, flags::COMPLETE);
    }
}

/// A recorded stack whose code only the leaf's epilogue check may read.
struct LeafCodeOnly<'a>(&'a Recorded);

impl Memory for LeafCodeOnly<'_> {
    fn stack_word(&self, addr: u64) -> Option<u64> {
        self.0.stack_word(addr)
    }
    fn code_bytes(&self, _region: &ManagedCode, _range: Range<u64>) -> Option<&[u8]> {
        None
    }
    fn leaf_code(&self, range: Range<u64>) -> Option<&[u8]> {
        self.0.leaf_code(range)
    }
}

#[test]
fn a_frame_pointer_walk_of_the_same_stack_loses_them() {
    // What the probe saw with an RBP chain: Hot's saved RBP is Main's.
    let (_, mem, regs) = chain();
    let bp = regs.bp;
    assert_eq!(mem.stack_word(bp + 8), Some(0), "Main's frame record leads straight to the root");
}

#[test]
fn leaf_in_an_epilogue_or_prologue_unwinds_by_what_is_left_to_run() {
    let (map, mem, regs) = chain();
    // A5 at `add rsp, 8` (Hot has returned): the pushed rax is still there.
    let at_add = Regs { ip: A5 + 8, sp: regs.sp + 16, bp: regs.bp };
    assert_eq!(run(&map, &mem, at_add).0, [A5 + 8, A4 + 6, A3 + 6, MAIN + 13]);
    // A5 at `ret`: only the return address is left.
    let at_ret = Regs { ip: A5 + 12, sp: regs.sp + 24, bp: regs.bp };
    assert_eq!(run(&map, &mem, at_ret).0, [A5 + 12, A4 + 6, A3 + 6, MAIN + 13]);
    // A5 at its first instruction: nothing pushed yet.
    let at_entry = Regs { ip: A5, sp: regs.sp + 24, bp: regs.bp };
    assert_eq!(run(&map, &mem, at_entry).0, [A5, A4 + 6, A3 + 6, MAIN + 13]);
    // Hot at `pop rbp` and at `ret`.
    assert_eq!(run(&map, &mem, Regs { ip: HOT + 6, ..regs }).0[1..], [A5 + 6, A4 + 6, A3 + 6, MAIN + 13]);
    let at_hot_ret = Regs { ip: HOT + 7, sp: regs.sp + 8, bp: regs.bp };
    assert_eq!(run(&map, &mem, at_hot_ret).0[1..], [A5 + 6, A4 + 6, A3 + 6, MAIN + 13]);
}

#[test]
fn a_runtime_stub_at_the_leaf_is_stepped_over_by_its_return_address() {
    let (map, mem, regs) = chain();
    // A stub (precode) that A5 jumped into through its call: only the
    // return address is on the stack.
    let in_stub = Regs { ip: UNKNOWN_STUB, sp: regs.sp + 8, bp: regs.bp };
    let (frames, flags) = run(&map, &mem, in_stub);
    assert_eq!(frames, [UNKNOWN_STUB, A5 + 6, A4 + 6, A3 + 6, MAIN + 13]);
    assert_eq!(flags, flags::COMPLETE | flags::UNKNOWN_CODE);
}

#[test]
fn a_signal_frame_continues_with_the_saved_context() {
    let (mut map, mut mem, regs) = chain();
    // A handler frame whose return address is the signal trampoline, with a
    // ucontext_t right above it holding Hot's registers.
    let trampoline = 0x5000_0000;
    map.sigreturn = trampoline;
    let handler_sp = regs.sp - 0x1000;
    let uc = handler_sp + 8;
    mem.stack.insert(handler_sp, trampoline);
    mem.stack.insert(uc + UC_GREGS + 8 * REG_RIP, regs.ip);
    mem.stack.insert(uc + UC_GREGS + 8 * REG_RSP, regs.sp);
    mem.stack.insert(uc + UC_GREGS + 8 * REG_RBP, regs.bp);
    // The handler itself is unknown code that has pushed nothing.
    let handler = Regs { ip: UNKNOWN_STUB, sp: handler_sp, bp: 0 };
    // Make the trampoline "known code" for the stub rule: a native module is
    // not available in a unit test, so put a managed region there.
    let (tramp_region, tramp_code) = body(trampoline - 1, &[0x90, 0x90], &PUSH_RBP_UNWIND);
    let mut managed: Vec<ManagedCode> = map.managed().to_vec();
    managed.push(tramp_region);
    mem.code.push(tramp_code);
    let map = CodeMap::new(Vec::new(), managed, vec![mem.stack_range.clone()], trampoline);
    let mut out = [0u64; 64];
    let w = walk(&map, &mem, handler, &mut WalkCache::new(), &mut out);
    let frames: Vec<u64> = out[..w.len].to_vec();
    assert_eq!(frames, [UNKNOWN_STUB | EXACT_IP, trampoline, (HOT + 3) | EXACT_IP, A5 + 6, A4 + 6, A3 + 6, MAIN + 13]);
    assert_eq!(w.flags, flags::COMPLETE | flags::UNKNOWN_CODE | flags::SIGNAL_FRAME);
}

#[test]
fn a_full_buffer_truncates_and_a_bad_stack_is_lost_not_a_panic() {
    let (map, mem, regs) = chain();
    let mut out = [0u64; 3];
    let w = walk(&map, &mem, regs, &mut WalkCache::new(), &mut out);
    assert_eq!((w.len, w.flags), (3, flags::TRUNCATED));
    // A stack pointer outside the stack: nothing can be read.
    let (frames, flags) = run(&map, &mem, Regs { sp: 0x10, ..regs });
    assert_eq!(frames, [HOT + 3]);
    assert_eq!(flags, flags::LOST);
}

#[test]
fn garbage_never_panics_and_never_reads_outside_the_stack() {
    // xorshift over registers and stack contents.
    let (map, mut mem, _) = chain();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let pick = |v: u64| match v % 6 {
        0 => MAIN + v % 0x30,
        1 => A5 + v % 16,
        2 => HOT + v % 10,
        3 => (STACK_TOP - (v % 0x2000)) & !7,
        4 => UNKNOWN_STUB,
        _ => v,
    };
    for _ in 0..20_000 {
        mem.stack.clear();
        for _ in 0..64 {
            let (a, v) = (next(), next());
            mem.stack.insert(STACK_TOP - 8 * (a % 512) - 8, pick(v));
        }
        let regs = Regs { ip: pick(next()), sp: pick(next()), bp: pick(next()) };
        let (frames, _) = run(&map, &mem, regs);
        assert!(!frames.is_empty());
    }
}

/// .NET 10's `String.SplitInternal` prologue, as its Tier1 body had it:
/// six pushes, `sub rsp, 0x2d8`, `lea rbp, [rsp+0x300]`; later a
/// `stackalloc` moves RSP by 0x200 more, which no unwind code records.
const SPLIT_PROLOGUE: [u8; 25] = [
    0x55, 0x41, 0x57, 0x41, 0x56, 0x41, 0x55, 0x41, 0x54, 0x53, 0x48, 0x81, 0xec, 0xd8, 0x02, 0x00, 0x00, 0x48, 0x8d,
    0xac, 0x24, 0x00, 0x03, 0x00, 0x00,
];
/// Its UNWIND_INFO, as read from the live process: frame register RBP,
/// `UWOP_SET_FPREG_LARGE` (0x30 * 16 = 0x300), `UWOP_ALLOC_LARGE` 0x5b * 8,
/// then the pushes.
const SPLIT_UNWIND: [u8; 28] = [
    0x19, 0x19, 0x0b, 0xf5, 0x19, 0x0b, 0x30, 0x00, 0x00, 0x00, 0x11, 0x01, 0x5b, 0x00, 0x0a, 0x30, 0x09, 0xc0, 0x07,
    0xd0, 0x05, 0xe0, 0x03, 0xf0, 0x01, 0x50, 0, 0,
];
/// Its epilogue: `lea rsp, [rbp-0x28]`, six pops, `ret`.
const SPLIT_EPILOGUE: [u8; 15] =
    [0x48, 0x8d, 0x65, 0xd8, 0x5b, 0x41, 0x5c, 0x41, 0x5d, 0x41, 0x5e, 0x41, 0x5f, 0x5d, 0xc3];

const LARGE: u64 = 0x20000;

/// A large-frame function at LARGE called from A3's return address, with
/// its body (`nop`s, a call site at 0x40) and epilogue; the memory and the
/// frame's rbp.
fn large_frame() -> (CodeMap, Recorded, u64) {
    let mut code = SPLIT_PROLOGUE.to_vec();
    code.resize(0x60, 0x90);
    code.extend_from_slice(&SPLIT_EPILOGUE);
    let (region, c) = body(LARGE, &code, &SPLIT_UNWIND);
    let sp0 = STACK_TOP - 0x1000; // the stack pointer at the call into the function
    let mut stack = HashMap::new();
    stack.insert(sp0, A3 + 6); // return address
    stack.insert(sp0 - 8, 0x5555); // caller's rbp
    let after_pushes = sp0 - 48;
    let frame_base = after_pushes - 0x2d8;
    let rbp = frame_base + 0x300;
    // `lea rsp, [rbp-0x28]` lands on the pushed rbx.
    assert_eq!(rbp - 0x28, after_pushes);
    let (a3, a3_code) = body(A3, &FRAMELESS, &FRAMELESS_UNWIND);
    let stacks = vec![Range { start: STACK_TOP - 0x10000, end: STACK_TOP }];
    let map = CodeMap::new(Vec::new(), vec![region, a3], stacks, 0);
    let mem = Recorded { stack, stack_range: STACK_TOP - 0x10000..STACK_TOP, code: vec![c, a3_code] };
    (map, mem, rbp)
}

#[test]
fn a_frame_set_by_uwop_set_fpreg_large_unwinds_from_its_frame_pointer() {
    let (map, mem, rbp) = large_frame();
    let sp0 = STACK_TOP - 0x1000;
    // In the body, after a 0x200-byte stackalloc and a call's return address.
    let frame_base = rbp - 0x300;
    let regs = Regs { ip: LARGE + 0x41, sp: frame_base - 0x200 - 8, bp: rbp };
    let mut out = [0u64; 8];
    let w = walk(&map, &mem, regs, &mut WalkCache::new(), &mut out);
    assert!(w.len >= 2, "{w:?}");
    assert_eq!(address_of(out[1]), A3 + 6, "{:x?}", &out[..w.len]);
    // In the epilogue (at its pops), and at its `ret`.
    for (at, sp) in [(0x60 + 4, rbp - 0x28), (0x60 + 14, sp0)] {
        let regs = Regs { ip: LARGE + at, sp, bp: rbp };
        let w = walk(&map, &mem, regs, &mut WalkCache::new(), &mut out);
        assert!(w.len >= 2, "at {at:#x}: {w:?}");
        assert_eq!(address_of(out[1]), A3 + 6, "at {at:#x}: {:x?}", &out[..w.len]);
    }
    // In the prologue, after three pushes: only they are undone.
    let regs = Regs { ip: LARGE + 5, sp: sp0 - 24, bp: 0x5555 };
    let w = walk(&map, &mem, regs, &mut WalkCache::new(), &mut out);
    assert_eq!(address_of(out[1]), A3 + 6, "{:x?}", &out[..w.len]);
}

/// The chain's map with a region of runtime stubs at [`UNKNOWN_STUB`]: no
/// unwind information, its frames stepped by what the stack holds.
fn chain_with_a_stub() -> (CodeMap, Recorded) {
    let (map, mem, _) = chain();
    let stub = ManagedCode {
        code: UNKNOWN_STUB..UNKNOWN_STUB + 0x40,
        base: UNKNOWN_STUB,
        functions: Vec::new().into(),
        unwind: UnwindBytes::InCode,
        tag: 0x10,
        frameless: true,
        body_rules: Default::default(),
        function_pages: Default::default(),
    };
    let mut managed = map.managed().to_vec();
    managed.push(stub);
    (CodeMap::new(Vec::new(), managed, vec![mem.stack_range.clone()], 0), mem)
}

#[test]
fn a_stub_that_pushed_a_word_is_stepped_over_to_its_caller() {
    // A virtual-dispatch resolve stub pushes rdx before its lookup: the
    // return address is one word down.
    let (map, mut mem) = chain_with_a_stub();
    let sp = STACK_TOP - 0x400;
    mem.stack.insert(sp, 0x1234_5678); // the pushed rdx: no code
    mem.stack.insert(sp + 8, A4 + 6); // return into A4
    let (frames, _) = run(&map, &mem, Regs { ip: UNKNOWN_STUB + 0x10, sp, bp: 0 });
    assert_eq!(frames[..2], [UNKNOWN_STUB + 0x10, A4 + 6]);
    // Nothing pushed: the word on top.
    mem.stack.insert(sp, A5 + 6);
    let (frames, _) = run(&map, &mem, Regs { ip: UNKNOWN_STUB + 0x10, sp, bp: 0 });
    assert_eq!(frames[..2], [UNKNOWN_STUB + 0x10, A5 + 6]);
}

#[test]
fn a_stub_s_instruction_met_at_the_leaf_is_kept_with_its_step() {
    let (map, mut mem) = chain_with_a_stub();
    // `pop rdx` after a lookup that pushed rdx: the return address is one
    // word down.
    mem.code.push((UNKNOWN_STUB, vec![0x5a; 0x40]));
    let sp = STACK_TOP - 0x400;
    mem.stack.insert(sp, 0x1234_5678);
    mem.stack.insert(sp + 8, A4 + 6);
    let mut out = [0u64; 64];
    for (ip, on_top) in [(UNKNOWN_STUB + 0x10, false), (UNKNOWN_STUB + 0x20, true)] {
        if on_top {
            mem.stack.insert(sp, A4 + 6);
        }
        let at = Regs { ip, sp, bp: 0 };
        let mut first = WalkCache::new();
        let w = walk(&map, &mem, at, &mut first, &mut out);
        assert_eq!(address_of(out[1]), A4 + 6);
        assert!(!w.leaf_by_stretch);
        map.keep_learned(&mut first);
        let again = walk(&map, &mem, at, &mut WalkCache::new(), &mut out);
        assert_eq!((again.len, again.flags, address_of(out[1])), (w.len, w.flags, A4 + 6), "{ip:#x}");
        // With the return address on top, the stub's `pop` is no matter: the
        // kept step serves. One word down, the code at the address could be
        // an epilogue's, and the walk looks the stub up as before.
        assert_eq!(again.leaf_by_stretch, on_top, "{ip:#x}");
    }
    // Another instruction of the stub is not the one kept.
    let other = walk(&map, &mem, Regs { ip: UNKNOWN_STUB + 0x21, sp, bp: 0 }, &mut WalkCache::new(), &mut out);
    assert!(!other.leaf_by_stretch);
}

/// An OSR body's UNWIND_INFO as .NET 10's JIT emitted it for
/// `Enumerable.Sum`: its own prologue (`push rax` of the Tier0 frame's
/// saved rbp, `sub rsp, 0x30`, four register saves) and, at prolog offset 0,
/// the Tier0 frame it sits on (`ALLOC_LARGE 0xb8`, `push rbp`).
const OSR_UNWIND: [u8; 36] = [
    0x19, 0x29, 0x0d, 0x00, 0x29, 0x34, 0x1a, 0x00, 0x21, 0xd4, 0x1b, 0x00, 0x19, 0xe4, 0x1c, 0x00, 0x11, 0xf4, 0x1d,
    0x00, 0x09, 0x52, 0x05, 0x02, 0x00, 0x01, 0x17, 0x00, 0x00, 0x50, 0x00, 0x00, 0, 0, 0, 0,
];

#[test]
fn an_osr_body_unwinds_through_the_tier0_frame_it_sits_on() {
    let mut code = vec![0x90u8; 0x100];
    code[0xd1] = 0xc4; // after the call: vmovsd, no epilogue
    let (region, c) = body(LARGE, &code, &OSR_UNWIND);
    let (a3, a3_code) = body(A3, &FRAMELESS, &FRAMELESS_UNWIND);
    let stacks = vec![Range { start: STACK_TOP - 0x10000, end: STACK_TOP }];
    let map = CodeMap::new(Vec::new(), vec![region, a3], stacks, 0);
    let sp0 = STACK_TOP - 0x1000; // where the Tier0 method's return address is
    let mut stack = HashMap::new();
    stack.insert(sp0, A3 + 6);
    stack.insert(sp0 - 8, 0x5555); // Tier0: push rbp
    let osr_sp = sp0 - 8 - 0xb8 - 8 - 0x30;
    let mem = Recorded { stack, stack_range: STACK_TOP - 0x10000..STACK_TOP, code: vec![c, a3_code] };
    // A return address into the OSR body, pushed by its call.
    let mut mem = mem;
    mem.stack.insert(osr_sp - 8, LARGE + 0xd1);
    let regs = Regs { ip: LARGE + 0xd1, sp: osr_sp, bp: osr_sp + 0x30 };
    let mut out = [0u64; 8];
    let w = walk(&map, &mem, regs, &mut WalkCache::new(), &mut out);
    assert!(w.len >= 2, "{w:?}");
    // The leaf is exact here; what matters is the caller.
    assert_eq!(address_of(out[1]), A3 + 6, "{:x?}", &out[..w.len]);
}

/// Maps that keep every region of the last (adding others) share its
/// lineage, and so the frames walks remember; one that drops or replaces a
/// region starts another.
#[test]
fn a_map_that_only_adds_code_keeps_its_lineage() {
    let (a, _) = body(0x10000, &[0x90; 16], &[1, 0, 0, 0]);
    let (b, _) = body(0x20000, &[0x90; 16], &[1, 0, 0, 0]);
    let first = CodeMap::new(Vec::new(), vec![a.clone()], Vec::new(), 0);
    let added = first.with_same_natives(vec![b.clone(), a.clone()], vec![0x7000..0x8000, 0x9000..0xa000]);
    assert_eq!(added.lineage(), first.lineage());
    assert_ne!(added.generation(), first.generation());
    let dropped = added.with_same_natives(vec![b.clone()], Vec::new());
    assert_ne!(dropped.lineage(), added.lineage());
    let (a_again, _) = body(0x10000, &[0x90; 16], &[1, 0, 0, 0]);
    let replaced = first.with_same_natives(vec![a_again, b], Vec::new());
    assert_ne!(replaced.lineage(), first.lineage(), "the same range learned again may unwind otherwise");
}

/// The runtime's hijack trampoline, for the tests below: where a hijacked
/// return address points.
const TRAMPOLINE: u64 = 0x4000_0000;

/// A memory whose runtime thread object says the return address at `slot`
/// was `original` before the runtime hijacked it.
struct Hijacked<'a> {
    recorded: &'a Recorded,
    slot: u64,
    original: u64,
}

impl Memory for Hijacked<'_> {
    fn stack_word(&self, addr: u64) -> Option<u64> {
        self.recorded.stack_word(addr)
    }

    fn code_bytes(&self, region: &ManagedCode, range: Range<u64>) -> Option<&[u8]> {
        self.recorded.code_bytes(region, range)
    }

    fn hijacked_return(&self, slot: u64, found: u64) -> Option<u64> {
        (slot == self.slot && found == TRAMPOLINE).then_some(self.original)
    }
}

/// Main calls a method the map does not list yet (JIT'd after its region's
/// table was read), whose return address the runtime hijacked: on Core 3.1,
/// at a program's first collections, 0.5% of one test's samples skipped
/// Main this way (the trampoline's preceding code's row led past it).
/// Returns the map, the stack, the leaf's registers and the hijacked slot.
fn hijacked_unknown_method() -> (CodeMap, Recorded, Regs, u64) {
    let sp0 = STACK_TOP - 0x100;
    let mut stack = HashMap::new();
    stack.insert(sp0, 0); // Main's return address: the root
    stack.insert(sp0 - 8, 0); // Main: push rbp
    let main_bp = sp0 - 8;
    let slot = sp0 - 32; // Main's call pushed its return address here...
    stack.insert(slot, TRAMPOLINE); // ...which the runtime hijacked
    stack.insert(sp0 - 40, main_bp); // the unknown method: push rbp; mov rbp,rsp
    stack.insert(sp0 - 56, 0); // its locals: nothing that looks like code
    let (region, code) = body(MAIN, &FRAMED, &FRAMED_UNWIND);
    let stacks = vec![Range { start: STACK_TOP - 0x10000, end: STACK_TOP }];
    let stub = HijackStub {
        range: TRAMPOLINE..TRAMPOLINE + 0x40,
        call_return: TRAMPOLINE + 0x20,
        return_slot: 0x78,
        saved_bp: 0x70,
    };
    let map = CodeMap::new(Vec::new(), vec![region], stacks, 0).with_hijack_stub(Some(stub));
    let mem = Recorded { stack, stack_range: STACK_TOP - 0x10000..STACK_TOP, code: vec![code] };
    (map, mem, Regs { ip: UNKNOWN_STUB, sp: sp0 - 56, bp: sp0 - 40 }, slot)
}

#[test]
fn a_hijacked_return_address_over_unknown_code_is_put_back() {
    let (map, recorded, regs, slot) = hijacked_unknown_method();
    let mem = Hijacked { recorded: &recorded, slot, original: MAIN + 13 };
    let mut out = [0u64; 64];
    let w = walk(&map, &mem, regs, &mut WalkCache::new(), &mut out);
    let frames: Vec<u64> = out[..w.len].iter().map(|&f| address_of(f)).collect();
    assert_eq!(frames, [UNKNOWN_STUB, MAIN + 13]);
    assert_eq!(w.flags, flags::COMPLETE | flags::UNKNOWN_CODE | flags::HIJACKED);
    assert_eq!(w.undone_hijack, Some((slot, MAIN + 13)));
}

#[test]
fn a_hijacked_return_address_that_cannot_be_put_back_ends_the_walk() {
    // A stack copy walked again on the agent's thread knows no thread
    // object: the walk stops at the trampoline rather than go on from the
    // code before it.
    let (map, mem, regs, _) = hijacked_unknown_method();
    let (frames, flags) = run(&map, &mem, regs);
    assert_eq!(frames, [UNKNOWN_STUB]);
    assert_eq!(flags, flags::LOST | flags::UNKNOWN_CODE);
}

#[test]
fn return_addresses_one_thread_looked_up_serve_another_thread_s_first_walk() {
    let (map, mem, regs) = chain();
    let learned = |cache: &mut WalkCache| {
        let mut words = Vec::new();
        cache.take_learned_addresses(|w| words.push(w));
        words
    };
    let mut first = WalkCache::new();
    let mut out = [0u64; 64];
    let w = walk(&map, &mem, regs, &mut first, &mut out);
    assert_eq!(w.flags, flags::COMPLETE);
    // Hot's callers: A5, A4, A3 and Main's return addresses, each looked up
    // in full.
    let words = learned(&mut first);
    assert_eq!(words.len(), 4);
    for w in words {
        map.keep_known_address(w);
    }
    // Another thread's first walk finds them all in the process's table,
    // and walks the same frames.
    let mut second = WalkCache::new();
    let again = walk(&map, &mem, regs, &mut second, &mut out);
    assert_eq!((again.len, again.flags), (w.len, w.flags));
    assert_eq!(learned(&mut second), Vec::<[u64; 3]>::new());
    // A map built afresh (another lineage, and a table of its own) finds
    // none of them.
    let other = CodeMap::new(Vec::new(), map.managed.clone(), map.stacks.clone(), 0);
    let mut third = WalkCache::new();
    walk(&other, &mem, regs, &mut third, &mut out);
    assert_eq!(learned(&mut third).len(), 4);
}

#[test]
fn a_leaf_stepped_by_a_kept_stretch_still_leaves_its_path() {
    // An event walk starts in the walker's own code, whose stretch the first
    // thread to walk keeps in the process's table. A second thread's walks
    // step their first frame by that stretch: their path must still be
    // remembered and taken (it was not: one of two throwing threads walked
    // every frame each time).
    let (map, mem, regs) = chain();
    let mut out = [0u64; 64];
    let mut first = WalkCache::new();
    first.remember_paths();
    let whole = walk(&map, &mem, regs, &mut first, &mut out);
    assert_eq!(whole.flags, flags::COMPLETE);
    map.keep_learned(&mut first);
    let mut second = WalkCache::new();
    second.remember_paths();
    let by_stretch = walk(&map, &mem, regs, &mut second, &mut out);
    assert!(by_stretch.leaf_by_stretch, "the leaf came from the kept stretch");
    assert_eq!(by_stretch.path_frames, 0, "no path yet");
    let again = walk(&map, &mem, regs, &mut second, &mut out);
    assert_eq!((again.len, again.flags), (whole.len, whole.flags));
    assert!(
        again.path_frames + again.rest_frames >= whole.len - 1,
        "{} + {} of {}",
        again.path_frames,
        again.rest_frames,
        whole.len
    );
    assert!(again.path_frames >= 1, "the leaf's step is on the path");
}

/// A getter with no prologue: `mov eax, [rdi+8]; ret`.
const GETTER: u64 = 0x10140;
const GETTER_CODE: [u8; 4] = [0x8b, 0x47, 0x08, 0xc3];
/// UNWIND_INFO v1, no prologue, no codes.
const GETTER_UNWIND: [u8; 4] = [0x01, 0x00, 0x00, 0x00];

#[test]
fn a_leaf_at_the_ret_of_a_function_with_no_frame_is_stepped_by_its_kept_stretch() {
    // A5 calls the getter in place of Hot: its return address is the
    // getter's frame, all of it, at its `mov` and at its `ret` alike.
    let (chain_map, mem, regs) = chain_of(&FRAMED, true);
    let mut managed: Vec<ManagedCode> = chain_map.managed().iter().filter(|r| r.code.start != HOT).cloned().collect();
    let (getter, code) = body(GETTER, &GETTER_CODE, &GETTER_UNWIND);
    managed.push(getter.with_body_rules(None));
    let mut mem = mem;
    mem.code.push(code);
    let map = CodeMap::new(Vec::new(), managed, chain_map.stacks.clone(), 0);
    let sp = regs.sp + 8;
    let callers = [A5 + 6, A4 + 6, A3 + 6, MAIN + 13];
    let mut out = [0u64; 64];
    for ip in [GETTER, GETTER + 3] {
        let at = Regs { ip, sp, bp: regs.bp };
        let mut first = WalkCache::new();
        let w = walk(&map, &mem, at, &mut first, &mut out);
        let frames: Vec<u64> = out[..w.len].iter().map(|&f| address_of(f)).collect();
        assert_eq!(frames[1..], callers, "{ip:#x}");
        assert_eq!(w.flags, flags::COMPLETE);
        map.keep_learned(&mut first);
        // Another thread's walk steps the leaf by the stretch the first kept,
        // at the `ret` too: nothing is on the stack above the return address.
        let again = walk(&map, &mem, at, &mut WalkCache::new(), &mut out);
        assert!(again.leaf_by_stretch, "{ip:#x}");
        assert_eq!((again.len, again.flags), (w.len, w.flags));
    }
}
