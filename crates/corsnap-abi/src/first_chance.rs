//! An entry point for managed code in the process, `corsnap_first_chance`:
//! a startup hook's `AppDomain.FirstChanceException` handler calls it
//! through a function pointer, on the throwing thread
//! (`bench/programs/firstchance_hook.cs`). It measures, for
//! `bench/events.py`'s `firstchance-walk` row, what recording throws would
//! cost if the runtime told corsnap of them that way instead of through
//! the profiler's callbacks or EventPipe; nothing else calls it.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The handler's address (a `fn()`), 0 for none.
static HANDLER: AtomicUsize = AtomicUsize::new(0);

/// What `corsnap_first_chance` runs, or nothing (`None`).
pub fn set_handler(handler: Option<fn()>) {
    HANDLER.store(handler.map_or(0, |f| f as usize), Ordering::Release);
}

/// Called by managed code once per throw, on the throwing thread.
#[no_mangle]
pub extern "C" fn corsnap_first_chance() {
    let handler = HANDLER.load(Ordering::Acquire);
    if handler == 0 {
        return;
    }
    // SAFETY: only `set_handler` stores here, and only a `fn()`'s address
    // (or 0, returned for above); a `fn()` and a `usize` have the same size.
    let handler = unsafe { std::mem::transmute::<usize, fn()>(handler) };
    // No panic unwinds into the managed caller.
    let _ = std::panic::catch_unwind(handler);
}
