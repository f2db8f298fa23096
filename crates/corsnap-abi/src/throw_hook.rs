//! A call into the agent as the runtime's managed exception dispatch
//! starts (.NET 9 and later), on the throwing thread: every throw, rethrow
//! and hardware fault reaches `System.Runtime.EH.DispatchEx` from one of
//! three small entry points (`RhThrowEx`, `RhRethrow`, `RhThrowHwEx`), and
//! ReJIT puts a few instructions (see [`hook_call`]) just before each one's
//! call of `DispatchEx` (or, should that call not be found, before
//! `DispatchEx`'s own code) that call [`corsnap_exception_dispatched`] with
//! the exception's `MethodTable` (its `ClassID`).
//!
//! Why: on .NET 9 and 10 every way the runtime itself tells a profiler of
//! a throw (the exception callbacks, EventPipe's `ExceptionThrown_V1`, a
//! `FirstChanceException` handler) was measured at about 6% or more of a
//! throw-heavy program before corsnap did anything (README, Benchmarks);
//! the call here is one unmanaged call from managed code.
//!
//! The call goes through `calli unmanaged cdecl`: the JIT puts an inlined
//! P/Invoke frame around it, so the thread is in preemptive mode while the
//! agent walks its stack (a collection may run meanwhile; the walk reads no
//! object). The `MethodTable` is read in managed code, through the
//! runtime's own intrinsic, while the exception is a reported reference.

use std::sync::atomic::{AtomicPtr, Ordering};

use corsnap_unwind::Regs;

/// What the entry point runs: a function of the agent's, given its context,
/// the exception's `ClassID` and the registers of the rewritten method's
/// frame as the call returns to it (where a walk of the throwing thread's
/// stack starts: the agent's own frames are not walked).
#[derive(Debug)]
pub struct Handler {
    run: unsafe fn(*const (), usize, Regs),
    context: *const (),
}

impl Handler {
    /// `run` with `context`. Both are leaked (see [`set_handler`]). `run`
    /// is a function's own type (not a pointer to one), so the code that
    /// calls it is made for it, and it is compiled into that code: one
    /// indirect call a throw, into the section the entry point is in.
    pub fn new<C, F>(context: std::sync::Arc<C>, run: F) -> Handler
    where
        C: Send + Sync + 'static,
        F: Fn(&C, usize, Regs) + Send + Sync + 'static,
    {
        let context: *const (std::sync::Arc<C>, F) = Box::into_raw(Box::new((context, run)));
        Handler { run: run_handler::<C, F>, context: context.cast() }
    }
}

/// Calls a handler's function with its context.
///
/// # Safety
/// `context` is the leaked `(Arc<C>, F)` of a [`Handler`] made for `C` and
/// `F`.
#[link_section = ".text.hot.corsnap_throw"]
unsafe fn run_handler<C, F: Fn(&C, usize, Regs)>(context: *const (), class: usize, caller: Regs) {
    // SAFETY: as the caller promises; never freed.
    let (context, run) = unsafe { &*context.cast::<(std::sync::Arc<C>, F)>() };
    run(context, class, caller);
}

/// The handler (leaked), null for none.
static HANDLER: AtomicPtr<Handler> = AtomicPtr::new(std::ptr::null_mut());

/// Makes [`corsnap_exception_dispatched`] run `handler` (or nothing).
///
/// A handler replaced is leaked, never freed (with its context): a call
/// may still be running it. That is safe and bounded because the library
/// is never unloaded once the hook was asked for: a profiler that enabled
/// ReJIT may not detach (the runtime's `EnsureProfilerDetachable`), so no
/// call can outlive the code or the handler it runs. One handler a
/// recording is the price of an entry point with no read-modify-write:
/// counting the calls in flight (even on per-thread stripes) was a tenth of
/// corsnap's share of an exception storm's CPU.
pub fn set_handler(handler: Option<Handler>) {
    let new = handler.map_or(std::ptr::null_mut(), |h| Box::into_raw(Box::new(h)));
    HANDLER.swap(new, Ordering::AcqRel);
}

/// Called by a rewritten method once per dispatch, on the throwing thread,
/// with the exception's `MethodTable`.
///
/// Three instructions: they hand [`exception_dispatched_from`] the address
/// of the return address (the stack pointer at entry) and the caller's
/// frame pointer, untouched at entry, so the walk starts at the rewritten
/// method's frame. Walking down from inside the agent instead went through eight of
/// its frames before reaching it, and a replayed walk checked each of their
/// stack words at every throw.
#[unsafe(naked)]
#[no_mangle]
#[link_section = ".text.hot.corsnap_throw"]
pub extern "C" fn corsnap_exception_dispatched(method_table: usize) -> i32 {
    // rdi (the `MethodTable`) is passed on as it came; the stack is as the
    // call left it, so the jump is a tail call with the caller's alignment.
    std::arch::naked_asm!(
        "mov rsi, rsp",
        "mov rdx, rbp",
        "jmp {inner}",
        inner = sym exception_dispatched_from,
    )
}

/// [`corsnap_exception_dispatched`]'s body: `return_slot` is where the call
/// left its return address, `caller_bp` the caller's frame pointer. Returns
/// 0, for a `calli` signature that returns an `int32` (see
/// [`REUSABLE_SIGNATURES`]).
#[link_section = ".text.hot.corsnap_throw"]
extern "C" fn exception_dispatched_from(method_table: usize, return_slot: *const u64, caller_bp: u64) -> i32 {
    let handler = HANDLER.load(Ordering::Acquire);
    if handler.is_null() {
        return 0;
    }
    // SAFETY: `return_slot` is the stack pointer at the entry point's entry:
    // the slot the call pushed its return address into, on this thread's
    // own stack just above this function's frame, live until we return;
    // the call left it 8-byte aligned.
    let caller = Regs { ip: unsafe { return_slot.read() }, sp: return_slot as u64 + 8, bp: caller_bp };
    // SAFETY: a handler is never freed (see `set_handler`), and was fully
    // written before its pointer was published (release/acquire).
    let Handler { run, context } = unsafe { &*handler };
    // No panic unwinds into the managed caller.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `context` is the one `Handler::new` made for `run`.
        unsafe { run(*context, method_table, caller) }
    }));
    0
}

/// The `calli` signature made when CoreLib has none of
/// [`REUSABLE_SIGNATURES`]: `unmanaged cdecl void (native int)` (ECMA-335
/// II.23.2.3: C calling convention, one parameter, `void`, `ELEMENT_TYPE_I`).
pub const CALLI_SIGNATURE: [u8; 4] = [0x01, 0x01, 0x01, 0x18];

/// Signatures a `calli` of [`corsnap_exception_dispatched`] may use, as
/// CoreLib may already hold them in its `StandAloneSig` table, with whether
/// each returns an `int32` (which the hook call then pops). Making a new one
/// needs CoreLib's metadata opened for writing, which copies all of it: 20
/// ms of the agent's start-up (.NET 10). The C calling convention or the
/// platform's default for unmanaged code (`0x09`, the same on Linux x64),
/// `void` or `int32` (the entry returns 0 in `eax`), one `native int`.
/// CoreLib 9.0 and 10.0 hold `unmanaged int32 (native int)`.
pub const REUSABLE_SIGNATURES: [(&[u8], bool); 4] = [
    (&CALLI_SIGNATURE, false),
    (&[0x09, 0x01, 0x01, 0x18], false),
    (&[0x01, 0x01, 0x08, 0x18], true),
    (&[0x09, 0x01, 0x08, 0x18], true),
];

/// The evaluation stack [`hook_call`] needs.
pub const HOOK_CALL_STACK: u16 = 2;

/// The instructions that call the agent, for a method whose argument 1 is
/// the dispatch's `ref ExInfo`, its exception already set: the entry
/// points just before their call of `DispatchEx(ref StackFrameIterator, ref
/// ExInfo)` (which they pass their own argument 1), or `DispatchEx` before
/// its code. `ldarg.1; call instance object ExInfo::get_ThrownException();
/// call RuntimeHelpers::GetMethodTable(object); ldc.i8 <entry>; conv.i;
/// calli <signature>` (and `pop` when `returns_int32`): they leave the
/// evaluation stack as they found it. `thrown_exception`,
/// `get_method_table`: CoreLib's tokens (the exception's field itself is
/// private to `ExInfo`, and the JIT checks access:
/// `FieldAccessException`); `signature`: a `StandAloneSig` in CoreLib of
/// one of [`REUSABLE_SIGNATURES`].
pub fn hook_call(thrown_exception: u32, get_method_table: u32, signature: u32, returns_int32: bool) -> Vec<u8> {
    let entry = corsnap_exception_dispatched as *const () as usize as u64;
    let mut il = Vec::with_capacity(27);
    il.push(0x03); // ldarg.1
    il.push(0x28); // call
    il.extend_from_slice(&thrown_exception.to_le_bytes());
    il.push(0x28); // call
    il.extend_from_slice(&get_method_table.to_le_bytes());
    il.push(0x21); // ldc.i8
    il.extend_from_slice(&entry.to_le_bytes());
    il.push(0xD3); // conv.i
    il.push(0x29); // calli
    il.extend_from_slice(&signature.to_le_bytes());
    if returns_int32 {
        il.push(0x26); // pop
    }
    il
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hook_call_loads_the_class_and_calls_the_entry() {
        let il = hook_call(0x0400_0010, 0x0600_0020, 0x1100_0030, false);
        assert_eq!(il.len(), 26);
        assert_eq!(&il[..2], &[0x03, 0x28]);
        assert_eq!(&il[2..6], &0x0400_0010u32.to_le_bytes());
        assert_eq!(il[6], 0x28);
        assert_eq!(il[11], 0x21);
        let entry = u64::from_le_bytes(il[12..20].try_into().unwrap());
        assert_eq!(entry as usize, corsnap_exception_dispatched as *const () as usize);
        assert_eq!(&il[20..22], &[0xD3, 0x29]);
        assert_eq!(&il[22..], &0x1100_0030u32.to_le_bytes());
        let popped = hook_call(0x0400_0010, 0x0600_0020, 0x1100_0030, true);
        assert_eq!(popped[..26], il[..]);
        assert_eq!(popped[26..], [0x26]);
    }
}
