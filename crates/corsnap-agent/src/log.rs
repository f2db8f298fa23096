//! The agent's own log file. Off unless `CORSNAP_AGENT_LOG` names a file:
//! the profiled program's stdout and stderr are not ours to write to.
//!
//! Logging takes a lock, so the sampler never logs while the runtime is
//! suspended.

use std::fmt;
use std::fs::File;
use std::io::Write;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

static LOG: Mutex<Option<File>> = Mutex::new(None);

/// Opens the log file, if a path is given (from `CORSNAP_AGENT_LOG` at
/// start-up, or from the attach request).
pub fn init(path: Option<&str>) {
    let Some(path) = path.filter(|p| !p.is_empty()) else { return };
    use std::os::unix::fs::OpenOptionsExt;
    if let Ok(file) = std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(path) {
        *LOG.lock().unwrap_or_else(|p| p.into_inner()) = Some(file);
    }
}

pub fn write(args: fmt::Arguments<'_>) {
    let mut guard = LOG.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(file) = guard.as_mut() {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let _ = writeln!(file, "{}.{:03} [pid {}] {}", now.as_secs(), now.subsec_millis(), std::process::id(), args);
    }
}

/// Replaces the default hook, which prints to stderr (the application's) and
/// asks `std::thread::current()` for a name (which would register a
/// thread-local destructor on our native threads).
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        write(format_args!("panic (caught at the FFI boundary): {info}"));
    }));
}
