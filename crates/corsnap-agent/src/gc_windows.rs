//! When garbage collections ran, and on which thread, so CPU samples taken
//! in them read as garbage collection.
//!
//! Microsoft's `libcoreclr.so` ships without symbols: on .NET 8 and 10 the
//! collector's own frames are anonymous `libcoreclr.so+0x…` addresses. The
//! runtime tells the profiler when a collection starts and ends
//! (`GarbageCollectionStarted`/`Finished`, with `COR_PRF_HIGH_BASIC_GC`, which
//! costs two callbacks a collection and none of the heap walks the full GC
//! monitoring does), on the thread doing it. A sample of that thread between
//! the two, and any sample of a thread the runtime named as one of its GC
//! threads, gets a `[garbage collection]` frame above its managed frames, in
//! place of the collector's anonymous frames (named ones, where symbols are
//! at hand, stay beneath it).
//!
//! Times are `CLOCK_MONOTONIC`, the clock the signal handler stamps samples
//! with. Samples are resolved a few milliseconds after they are taken, so the
//! last [`KEPT`] windows are kept.

use std::collections::VecDeque;
use std::sync::Mutex;

const KEPT: usize = 1024;

#[derive(Debug, Default)]
pub struct GcWindows {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The collection under way: its thread and start.
    open: Option<(u32, u64)>,
    /// Finished collections: (thread, start, end), oldest first.
    done: VecDeque<(u32, u64, u64)>,
}

impl GcWindows {
    pub fn started(&self, tid: u32, now: u64) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.open = Some((tid, now));
    }

    pub fn finished(&self, now: u64) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((tid, start)) = inner.open.take() {
            if inner.done.len() >= KEPT {
                inner.done.pop_front();
            }
            inner.done.push_back((tid, start, now));
        }
    }

    /// Whether thread `tid` was collecting at `time`.
    pub fn collecting(&self, tid: u32, time: u64) -> bool {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.open.is_some_and(|(t, start)| t == tid && time >= start) {
            return true;
        }
        inner.done.iter().rev().any(|&(t, start, end)| t == tid && (start..=end).contains(&time))
    }
}

/// Whether a thread's kernel name is one the runtime gives its GC threads
/// (`.NET Server GC`, `.NET BGC`, `.NET Background GC`...).
pub fn is_gc_thread_name(name: &str) -> bool {
    let name = name.trim();
    name.starts_with(".NET Server GC")
        || name.starts_with(".NET BGC")
        || name.starts_with(".NET Background GC")
        || name == ".NET GC"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_fall_in_the_window_of_their_own_thread_only() {
        let w = GcWindows::default();
        w.started(7, 100);
        assert!(w.collecting(7, 150));
        assert!(!w.collecting(8, 150));
        assert!(!w.collecting(7, 50));
        w.finished(200);
        assert!(w.collecting(7, 200));
        assert!(!w.collecting(7, 201));
        w.started(8, 300);
        w.finished(400);
        assert!(w.collecting(7, 120) && w.collecting(8, 350) && !w.collecting(7, 350));
        // A finish without a start is ignored.
        w.finished(500);
        assert!(!w.collecting(8, 450));
    }

    #[test]
    fn gc_thread_names() {
        assert!(is_gc_thread_name(".NET Server GC"));
        assert!(is_gc_thread_name(".NET BGC"));
        assert!(!is_gc_thread_name(".NET TP Worker"));
        assert!(!is_gc_thread_name("main"));
    }
}
