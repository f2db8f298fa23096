//! The rule caches framehop's unwinder needs, in one small pool that every
//! walk shares.
//!
//! framehop steps only the native frames a module's row table has no row
//! for (see `native_frame_step`), which walks seldom meet; but its cache
//! is 32 KiB (509 rules), and when each walk cache held one, a 50-thread
//! program paid 1.8 MiB of resident memory for it. So the caches live here,
//! [`POOL`] of them, made when the first walk cache is made and freed with
//! the last (walk caches are made and dropped off the signal path, so the
//! pool is too, and an agent that detached leaves none behind).
//!
//! A walk borrows a cache with `try_lock` on each slot in turn: one atomic
//! compare-and-swap a slot, never a wait, and the guard's drop one more
//! (no thread ever waits on these locks, so an unlock never has a waiter to
//! wake). That is safe in a signal handler, including one that interrupted
//! a walk on the same thread that holds a cache: the handler takes another.

use std::sync::atomic::{AtomicUsize, Ordering};

use framehop::x86_64::CacheX86_64;
use framehop::MustNotAllocateDuringUnwind;
use parking_lot::{MappedMutexGuard, Mutex, MutexGuard};

type Cache = CacheX86_64<MustNotAllocateDuringUnwind>;

/// Walks through framehop at once that get a cache; more lose the frame.
const POOL: usize = 8;

static CACHES: [Mutex<Option<Box<Cache>>>; POOL] = [const { parking_lot::const_mutex(None) }; POOL];
/// Walk caches alive: the pool is filled when this leaves 0, emptied when
/// it returns to 0.
static SHARES: AtomicUsize = AtomicUsize::new(0);

/// A walk cache's part in the pool's lifetime.
#[derive(Debug)]
pub(crate) struct Share(());

impl Share {
    /// Never in a signal handler: the first share allocates the caches.
    pub(crate) fn new() -> Share {
        if SHARES.fetch_add(1, Ordering::AcqRel) == 0 {
            for slot in &CACHES {
                // A slot held now is being emptied by the last share's drop
                // racing this one: left empty, one cache fewer.
                if let Some(mut cache) = slot.try_lock() {
                    cache.get_or_insert_with(|| Box::new(Cache::new_in()));
                }
            }
        }
        Share(())
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        if SHARES.fetch_sub(1, Ordering::AcqRel) == 1 {
            // No walk cache is left, so no walk runs to hold a cache. Each
            // is taken only while that is still so: a walk cache made in
            // the meantime (on another thread) keeps those not yet taken.
            for slot in &CACHES {
                if let Some(mut cache) = slot.try_lock() {
                    if SHARES.load(Ordering::Acquire) == 0 {
                        cache.take();
                    }
                }
            }
        }
    }
}

/// A cache of the pool, `None` if every one is lent out (or none is made).
/// No allocation, no wait: safe in a signal handler.
pub(crate) fn borrow() -> Option<MappedMutexGuard<'static, Cache>> {
    CACHES.iter().find_map(|slot| MutexGuard::try_map(slot.try_lock()?, |cache| cache.as_deref_mut()).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caches_are_lent_once_each_and_live_with_the_walk_caches() {
        let share = Share::new();
        // Other tests may hold some at the same time: at most the pool's.
        let lent: Vec<_> = std::iter::from_fn(borrow).take(POOL + 1).collect();
        assert!(!lent.is_empty() && lent.len() <= POOL, "{} lent", lent.len());
        let mut addresses: Vec<*const Cache> = lent.iter().map(|c| &**c as *const Cache).collect();
        addresses.sort();
        addresses.dedup();
        assert_eq!(addresses.len(), lent.len(), "each lent once");
        drop(lent);
        assert!(borrow().is_some());
        drop(share);
    }
}
