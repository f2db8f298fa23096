//! Which modules are loaded, learned from load/unload events and, after an
//! attach, from `EnumModules` (seed 001's catch-up).
//!
//! The golden rule: an event is more recent than any enumeration snapped
//! before it, so an event wins even when the enumeration is iterated after the
//! event arrived. Each entry remembers the sequence number of the event that
//! set it; an enumeration records the sequence number current when it was
//! snapped and may only add what no later event has spoken about.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use corsnap_abi::ModuleID;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleState {
    Loaded,
    /// `ModuleUnloadStarted` was seen: the ID must not be used any more.
    Unloading,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    state: ModuleState,
    /// Sequence number of the event that set `state`; 0 for enumeration.
    event_seq: u64,
}

/// An enumeration's point in time, taken before calling `EnumModules`.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot(u64);

#[derive(Debug, Default)]
pub struct ModuleCatalog {
    next_seq: AtomicU64,
    entries: Mutex<HashMap<ModuleID, Entry>>,
}

impl ModuleCatalog {
    fn event(&self, module: ModuleID, state: ModuleState) {
        let seq = self.next_seq.fetch_add(1, Ordering::SeqCst) + 1;
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).insert(module, Entry { state, event_seq: seq });
    }

    pub fn loaded(&self, module: ModuleID) {
        self.event(module, ModuleState::Loaded);
    }

    pub fn unloading(&self, module: ModuleID) {
        self.event(module, ModuleState::Unloading);
    }

    /// Call just before `EnumModules`.
    pub fn begin_enumeration(&self) -> Snapshot {
        Snapshot(self.next_seq.load(Ordering::SeqCst))
    }

    /// Adds a module found by the enumeration snapped at `snapshot`, unless an
    /// event after that point already said something about it.
    pub fn enumerated(&self, snapshot: Snapshot, module: ModuleID) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        match entries.get(&module) {
            Some(e) if e.event_seq > snapshot.0 => {}
            _ => {
                entries.insert(module, Entry { state: ModuleState::Loaded, event_seq: 0 });
            }
        }
    }

    /// `None` for a module never heard of (lazy catch-up: the caller may use
    /// it, as the runtime just handed it over).
    pub fn state(&self, module: ModuleID) -> Option<ModuleState> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).get(&module).map(|e| e.state)
    }

    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unload_after_the_snapshot_wins_even_if_iterated_later() {
        let c = ModuleCatalog::default();
        let snap = c.begin_enumeration();
        // The enumeration contains module 7, but before we iterate it the
        // module starts unloading.
        c.unloading(7);
        c.enumerated(snap, 7);
        assert_eq!(c.state(7), Some(ModuleState::Unloading));
    }

    #[test]
    fn duplicates_between_enumeration_and_load_events_are_harmless() {
        let c = ModuleCatalog::default();
        let snap = c.begin_enumeration();
        c.enumerated(snap, 1);
        c.loaded(1);
        c.enumerated(snap, 1);
        assert_eq!(c.state(1), Some(ModuleState::Loaded));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn an_event_before_the_snapshot_is_superseded_by_the_enumeration() {
        let c = ModuleCatalog::default();
        c.unloading(3);
        // A later enumeration that still lists 3 cannot happen for an
        // unloading module (the golden rule), but a reloaded ID can.
        c.loaded(3);
        let snap = c.begin_enumeration();
        c.enumerated(snap, 3);
        assert_eq!(c.state(3), Some(ModuleState::Loaded));
        assert_eq!(c.state(4), None);
    }
}
