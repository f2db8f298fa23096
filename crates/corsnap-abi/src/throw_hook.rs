//! A call into the agent at the start of the runtime's managed exception
//! dispatch (.NET 9 and later), on the throwing thread: every throw,
//! rethrow and hardware fault reaches `System.Runtime.EH.DispatchEx`, and
//! ReJIT puts a few instructions before its code (see [`prologue`]) that
//! call [`corsnap_exception_dispatched`] with the exception's `MethodTable`
//! (its `ClassID`).
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

use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the entry point runs, given the exception's `ClassID`.
pub type Handler = dyn Fn(usize) + Send + Sync;

/// The handler (a leaked `Box<Box<Handler>>`, for a thin pointer), null for
/// none.
static HANDLER: AtomicPtr<Box<Handler>> = AtomicPtr::new(std::ptr::null_mut());
/// Calls inside [`corsnap_exception_dispatched`] now, counted on the
/// calling thread's stripe (by [`crate::thread_hash`]), each on a cache line
/// of its own: one count for all passed its line between two throwing
/// threads' cores twice a throw (a fifth of corsnap's share of `validate`'s
/// CPU on .NET 10).
#[repr(align(64))]
struct Stripe(AtomicU64);

const STRIPES: usize = 16;
static IN_FLIGHT: [Stripe; STRIPES] = [const { Stripe(AtomicU64::new(0)) }; STRIPES];

fn own_stripe() -> &'static AtomicU64 {
    &IN_FLIGHT[(crate::thread_hash() >> 60) as usize % STRIPES].0
}

/// Makes [`corsnap_exception_dispatched`] run `handler` (or nothing). The
/// handler it replaces is dropped once no call can be running it (waited
/// for up to `wait`; `false`, and the old handler leaked, if calls were
/// still in flight then).
pub fn set_handler(handler: Option<Box<Handler>>, wait: Duration) -> bool {
    let new = handler.map_or(std::ptr::null_mut(), |h| Box::into_raw(Box::new(h)));
    let old = HANDLER.swap(new, Ordering::SeqCst);
    if old.is_null() {
        return true;
    }
    // A call that loaded `old` counted itself in before (both SeqCst), so
    // once the count is seen at zero none is left running it.
    let deadline = Instant::now() + wait;
    while IN_FLIGHT.iter().any(|s| s.0.load(Ordering::SeqCst) != 0) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    // SAFETY: `old` came from `Box::into_raw` above, was swapped out, and no
    // call still uses it.
    drop(unsafe { Box::from_raw(old) });
    true
}

/// Called by the rewritten `DispatchEx` once per dispatch, on the throwing
/// thread, with the exception's `MethodTable`.
#[no_mangle]
pub extern "C" fn corsnap_exception_dispatched(method_table: usize) {
    let stripe = own_stripe();
    stripe.fetch_add(1, Ordering::SeqCst);
    let handler = HANDLER.load(Ordering::SeqCst);
    if !handler.is_null() {
        // SAFETY: a live handler: `set_handler` frees a replaced one only
        // after this call has counted itself out.
        let handler = unsafe { &*handler };
        // No panic unwinds into the managed caller.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(method_table)));
    }
    stripe.fetch_sub(1, Ordering::SeqCst);
}

/// The `calli` signature: `unmanaged cdecl void (native int)`
/// (ECMA-335 II.23.2.3: C calling convention, one parameter, `void`,
/// `ELEMENT_TYPE_I`).
pub const CALLI_SIGNATURE: [u8; 4] = [0x01, 0x01, 0x01, 0x18];

/// The evaluation stack [`prologue`] needs.
pub const PROLOGUE_STACK: u16 = 2;

/// The instructions put before `DispatchEx(ref StackFrameIterator, ref
/// ExInfo)`'s code: `ldarg.1; call instance object
/// ExInfo::get_ThrownException(); call RuntimeHelpers::GetMethodTable(object);
/// ldc.i8 <entry>; conv.i; calli <signature>`. `thrown_exception`,
/// `get_method_table`: CoreLib's tokens (the exception's field itself is
/// private to `ExInfo`, and the JIT checks access: `FieldAccessException`);
/// `signature`: a `StandAloneSig` of [`CALLI_SIGNATURE`] in CoreLib.
pub fn prologue(thrown_exception: u32, get_method_table: u32, signature: u32) -> Vec<u8> {
    let entry = corsnap_exception_dispatched as *const () as usize as u64;
    let mut il = Vec::with_capacity(26);
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
    il
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prologue_loads_the_class_and_calls_the_entry() {
        let il = prologue(0x0400_0010, 0x0600_0020, 0x1100_0030);
        assert_eq!(il.len(), 26);
        assert_eq!(&il[..2], &[0x03, 0x28]);
        assert_eq!(&il[2..6], &0x0400_0010u32.to_le_bytes());
        assert_eq!(il[6], 0x28);
        assert_eq!(il[11], 0x21);
        let entry = u64::from_le_bytes(il[12..20].try_into().unwrap());
        assert_eq!(entry as usize, corsnap_exception_dispatched as *const () as usize);
        assert_eq!(&il[20..22], &[0xD3, 0x29]);
        assert_eq!(&il[22..], &0x1100_0030u32.to_le_bytes());
    }
}
