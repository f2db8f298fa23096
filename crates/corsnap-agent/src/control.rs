//! The control thread: obeys the CLI's commands, and takes the agent out of
//! the process when told to or when the CLI disappears (seed 002).
//!
//! Detach, in the seed's order:
//! 1. shut every way into the library other than the profiling API: stop the
//!    sampler and *join* it (a stop flag alone could leave a sample in
//!    flight), hang up the socket; this thread is the last of ours;
//! 2. call `RequestProfilerDetach`, with an expected completion time taken
//!    from our longest callback;
//! 3. return, ending this thread. Linux has no `FreeLibraryAndExitThread`,
//!    so `ProfilerDetachSucceeded` (which the runtime calls before it
//!    unloads us, and waits for) joins this thread: by the time the library
//!    goes, no instruction of it can still be running here.

use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use corsnap_abi::NativeThread;
use corsnap_wire::{read_command, Command, Message, Severity};

use crate::{log, Running, MAX_RATE_HZ};

pub fn start(running: Arc<Running>, socket: UnixStream) -> io::Result<NativeThread> {
    NativeThread::spawn("corsnap-control", move || run(running, socket))
}

fn notice(severity: Severity, text: String) -> Message {
    Message::Notice { severity, text }
}

fn run(running: Arc<Running>, mut socket: UnixStream) {
    let shared = &running.shared;
    let why = loop {
        match read_command(&mut socket) {
            Ok(Some(Ok(command))) => {
                if let Some(why) = obey(&running, command) {
                    break why;
                }
            }
            Ok(Some(Err(e))) => {
                log::write(format_args!("rejected a malformed command: {e}"));
                shared.post(notice(Severity::Warning, format!("the agent rejected a malformed command ({e})")));
            }
            Ok(None) => break "corsnap went away".to_string(),
            // A peer that closes with our samples still unread in its
            // socket resets the connection (AF_UNIX gives the survivor
            // ECONNRESET, not an end of file): a killed CLI, under load.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe) => {
                break format!("corsnap went away ({e})")
            }
            Err(e) => break format!("the connection to corsnap failed ({e})"),
        }
    };
    if shared.shutting_down.load(Ordering::SeqCst) {
        // The runtime is exiting and Shutdown is stopping everything.
        return;
    }
    detach(&running, &why);
}

/// Carries out one command; `Some(reason)` means: detach now.
fn obey(running: &Running, command: Command) -> Option<String> {
    let shared = &running.shared;
    match command {
        Command::Detach => return Some("corsnap asked the agent to detach".to_string()),
        Command::SetRate(hz) => {
            let hz = hz.min(MAX_RATE_HZ);
            shared.signal.set_rate(hz);
            shared.post(notice(Severity::Info, format!("sampling rate is now {hz} Hz")));
        }
        Command::SnapshotNow => shared.signal.request_snapshot(),
        Command::ForceGc => {
            // This thread has never run managed code and is not inside a
            // callback: the two conditions ForceGC sets.
            let text = match shared.info.force_gc() {
                Ok(()) => "forced a garbage collection".to_string(),
                Err(e) => format!("ForceGC failed: {e}"),
            };
            shared.post(notice(Severity::Info, text));
        }
        Command::Exceptions(on) => {
            let was = shared.watching_exceptions.swap(on, Ordering::SeqCst);
            if on {
                shared.exceptions_seen.reset();
            }
            // The mask lets a session deliver before it starts, and is taken
            // back after it stops.
            let mask = || shared.apply_event_mask().map_err(|e| e.to_string());
            let session = || crate::watch_exception_events(shared, on);
            let changed = if on { mask().and_then(|()| session()) } else { session().and_then(|()| mask()) };
            let text = match changed {
                Ok(()) if on => "watching exceptions".to_string(),
                Ok(()) => {
                    format!("stopped watching exceptions: {} thrown", shared.exceptions_seen.sum())
                }
                Err(e) => {
                    shared.watching_exceptions.store(was, Ordering::SeqCst);
                    format!("cannot change exception monitoring: {e}")
                }
            };
            shared.post(notice(Severity::Info, text));
        }
    }
    None
}

fn detach(running: &Running, why: &str) {
    log::write(format_args!("detaching: {why}"));
    // The rewritten dispatch calls into this library: put back first.
    crate::remove_throw_hook(&running.shared);
    crate::stop_event_pipe_sessions(&running.shared);
    if !running.stop_sampler(&format!("detached ({why})")) {
        // A sampler still running may still have its signal handler (and
        // timers) in place: unloading the library under it could crash the
        // program. Stay loaded and let it finish on its own.
        log::write(format_args!("the sampler did not stop; not detaching, the agent stays loaded"));
        let _ = running.socket.shutdown(std::net::Shutdown::Both);
        return;
    }
    let _ = running.socket.shutdown(std::net::Shutdown::Both);
    let longest_ms = running.shared.longest_callback_ns.load(Ordering::Relaxed) / 1_000_000;
    let expected_ms = (longest_ms * 2).clamp(10, 5000) as u32;
    match running.shared.info.request_profiler_detach(expected_ms) {
        Ok(()) => log::write(format_args!("RequestProfilerDetach({expected_ms} ms) accepted")),
        // Detach impossible: everything of ours is already stopped, so the
        // agent stays loaded but quiet and harmless.
        Err(e) if running.shared.exceptions_from_hook => log::write(format_args!(
            "cannot detach ({e}: the exception hook enabled ReJIT at start-up, and the runtime lets no profiler that \
             did leave); the dispatch hook is reverted and the agent stays loaded, idle"
        )),
        Err(e) => log::write(format_args!("cannot detach ({e}); the agent stays loaded, idle")),
    }
}
