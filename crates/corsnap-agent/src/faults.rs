//! Fault injection for tests, switched on only by `CORSNAP_FAULTS` (a
//! comma-separated list). Each fault makes one part of the agent fail the way
//! it could in the field, so the tests can check the program carries on and
//! the samples that could be taken are kept:
//!
//! - `callback`: every other `ThreadCreated` callback panics (the panic must
//!   stop at the FFI boundary);
//! - `names`: every other function name fails to resolve;
//! - `socket`: the connection to the CLI breaks after 20 sends;
//! - `buffer`: the per-tick frame buffer holds only 8 frames, so deep or
//!   numerous stacks are cut short.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

pub const ENV_FAULTS: &str = "CORSNAP_FAULTS";

#[derive(Debug, Default)]
pub struct Faults {
    pub callback: bool,
    pub names: bool,
    pub socket: bool,
    pub buffer: bool,
    counter: AtomicU64,
}

static FAULTS: OnceLock<Faults> = OnceLock::new();

/// The faults switched on for this process (none unless the variable is set).
pub fn get() -> &'static Faults {
    FAULTS.get_or_init(|| {
        let spec = std::env::var(ENV_FAULTS).unwrap_or_default();
        let has = |name: &str| spec.split(',').any(|f| f.trim() == name);
        Faults {
            callback: has("callback"),
            names: has("names"),
            socket: has("socket"),
            buffer: has("buffer"),
            ..Default::default()
        }
    })
}

impl Faults {
    /// True once every `n` calls.
    pub fn every(&self, n: u64) -> bool {
        self.counter.fetch_add(1, Ordering::Relaxed) % n == n - 1
    }
}
