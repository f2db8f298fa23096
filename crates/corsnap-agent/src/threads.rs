//! What the agent knows about managed threads, and the gate that makes
//! `ThreadDestroyed` wait for walks in flight (the seeds' Rule 2).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use corsnap_abi::ThreadID;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadEntry {
    pub os_tid: u32,
    pub name: String,
    /// Changes whenever anything about the entry changes, including a
    /// `ThreadID` being reused for a new thread.
    pub version: u64,
}

/// Fed by the runtime's thread callbacks. Its lock is held only for map
/// operations, never across a call into the runtime (Rule 3), and the
/// sampler never takes it while the runtime is suspended (Rule 1b).
#[derive(Debug, Default)]
pub struct ThreadRegistry {
    entries: Mutex<HashMap<ThreadID, ThreadEntry>>,
    next_version: AtomicU64,
}

impl ThreadRegistry {
    fn update(&self, thread: ThreadID, change: impl FnOnce(&mut ThreadEntry)) {
        let version = self.next_version.fetch_add(1, Ordering::Relaxed) + 1;
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let entry = entries.entry(thread).or_insert_with(|| ThreadEntry { os_tid: 0, name: String::new(), version });
        change(entry);
        entry.version = version;
    }

    /// The runtime may report a thread's name before `ThreadCreated`, so
    /// creation keeps whatever is already known; a reused `ThreadID` starts
    /// clean because `ThreadDestroyed` removed the old entry.
    pub fn created(&self, thread: ThreadID) {
        self.update(thread, |_| {});
    }

    pub fn destroyed(&self, thread: ThreadID) {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).remove(&thread);
    }

    pub fn assigned_os_thread(&self, thread: ThreadID, os_tid: u32) {
        self.update(thread, |e| e.os_tid = os_tid);
    }

    pub fn renamed(&self, thread: ThreadID, name: String) {
        self.update(thread, |e| e.name = name);
    }

    /// Calls `f` with each requested thread's entry (if known) under one
    /// short lock.
    /// The OS thread a managed thread runs on, if the runtime has said.
    pub fn os_tid_of(&self, thread: ThreadID) -> Option<u32> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.get(&thread).map(|e| e.os_tid).filter(|&t| t != 0)
    }

    /// The runtime's thread object (`ThreadID`) on each OS thread that is a
    /// managed thread now.
    pub fn by_os_tid(&self) -> HashMap<u32, ThreadID> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.iter().filter(|(_, e)| e.os_tid != 0).map(|(&t, e)| (e.os_tid, t)).collect()
    }

    /// The name of each OS thread that is a managed thread now (empty if
    /// the program never named it).
    pub fn names_by_os_tid(&self) -> HashMap<u32, String> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.values().filter(|e| e.os_tid != 0).map(|e| (e.os_tid, e.name.clone())).collect()
    }

    pub fn with_entries(
        &self,
        threads: impl Iterator<Item = ThreadID>,
        mut f: impl FnMut(ThreadID, Option<&ThreadEntry>),
    ) {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        for t in threads {
            f(t, entries.get(&t));
        }
    }
}

/// Open while the sampler walks stacks under a runtime suspension.
///
/// The flag is an atomic so the sampler can raise and lower it while the
/// runtime is suspended without taking a lock. `ThreadDestroyed` checks it
/// under `lock` and sleeps on `walk_done`; the sampler takes `lock` only
/// after resuming the runtime, to wake it. The sampler raises the flag only
/// after `SuspendRuntime` has returned: the runtime can call `ThreadDestroyed`
/// while holding its thread-store lock, which `SuspendRuntime` needs, so a
/// flag raised before suspending could deadlock the two.
#[derive(Debug, Default)]
pub struct WalkGate {
    walking: AtomicBool,
    lock: Mutex<()>,
    walk_done: Condvar,
}

impl WalkGate {
    pub fn begin_walk(&self) {
        self.walking.store(true, Ordering::SeqCst);
    }

    /// Lowers the flag; call [`wake_waiters`](Self::wake_waiters) once the
    /// runtime is resumed.
    pub fn end_walk(&self) {
        self.walking.store(false, Ordering::SeqCst);
    }

    pub fn wake_waiters(&self) {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.walk_done.notify_all();
    }

    pub fn wait_until_no_walk(&self) {
        let mut guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        while self.walking.load(Ordering::SeqCst) {
            guard = self.walk_done.wait(guard).unwrap_or_else(|p| p.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn reused_thread_ids_get_a_new_version() {
        let r = ThreadRegistry::default();
        r.created(1);
        r.renamed(1, "worker".into());
        let mut first = None;
        r.with_entries([1].into_iter(), |_, e| first = e.cloned());
        r.destroyed(1);
        r.created(1);
        let mut second = None;
        r.with_entries([1].into_iter(), |_, e| second = e.cloned());
        r.renamed(2, "named-early".into());
        r.created(2);
        let mut early = None;
        r.with_entries([2].into_iter(), |_, e| early = e.cloned());
        assert_eq!(early.unwrap().name, "named-early");
        let (first, second) = (first.unwrap(), second.unwrap());
        assert_eq!(first.name, "worker");
        assert_eq!(second.name, "");
        assert_ne!(first.version, second.version);
    }

    #[test]
    fn destroyed_waits_for_the_walk_in_flight() {
        let gate = Arc::new(WalkGate::default());
        gate.begin_walk();
        let g = gate.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = corsnap_abi::NativeThread::spawn("waiter", move || {
            g.wait_until_no_walk();
            tx.send(()).unwrap();
        })
        .unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err(), "must block while walking");
        gate.end_walk();
        gate.wake_waiters();
        rx.recv_timeout(Duration::from_secs(5)).expect("released after the walk");
        waiter.join();
    }
}
