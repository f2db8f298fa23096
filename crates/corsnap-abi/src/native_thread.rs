//! Threads the agent starts, made with `pthread_create` directly.
//!
//! A Rust `std::thread` registers thread-local destructors with glibc, and
//! glibc then refuses to unmap a library that has registered any: the agent's
//! `.so` would stay in the process forever after detach. These threads run
//! plain Rust code and never touch `std::thread`'s machinery; the agent's code
//! must also avoid `thread_local!` values that need dropping and
//! `std::thread::current()` on them.

use std::ffi::c_void;
use std::time::Duration;

/// A joinable thread that never registers thread-local destructors.
#[derive(Debug)]
pub struct NativeThread {
    handle: libc::pthread_t,
    joined: bool,
}

struct Start {
    body: Box<dyn FnOnce() + Send>,
}

extern "C" fn thread_main(arg: *mut c_void) -> *mut c_void {
    // SAFETY: `arg` is the Box<Start> leaked by `spawn`, handed over exactly once.
    let start = unsafe { Box::from_raw(arg as *mut Start) };
    // A panic must not unwind out of a C thread entry point.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(start.body));
    std::ptr::null_mut()
}

impl NativeThread {
    /// Starts `body` on a new OS thread named `name` (15 bytes at most are kept).
    pub fn spawn(name: &str, body: impl FnOnce() + Send + 'static) -> std::io::Result<NativeThread> {
        let start = Box::into_raw(Box::new(Start { body: Box::new(body) }));
        let mut handle: libc::pthread_t = 0;
        // SAFETY: plain pthread_create with default attributes; on failure the
        // Box is reclaimed here, on success the thread owns it.
        let rc = unsafe { libc::pthread_create(&mut handle, std::ptr::null(), thread_main, start as *mut c_void) };
        if rc != 0 {
            // SAFETY: the thread was not created, so the Box is still ours.
            drop(unsafe { Box::from_raw(start) });
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        let mut cname = [0u8; 16];
        for (dst, src) in cname.iter_mut().zip(name.bytes().take(15)) {
            *dst = src;
        }
        // SAFETY: NUL-terminated buffer of at most 16 bytes; failure is harmless.
        unsafe { libc::pthread_setname_np(handle, cname.as_ptr() as *const libc::c_char) };
        Ok(NativeThread { handle, joined: false })
    }

    /// Waits for the thread to finish.
    pub fn join(mut self) {
        // SAFETY: joinable thread we created and have not joined.
        unsafe { libc::pthread_join(self.handle, std::ptr::null_mut()) };
        self.joined = true;
    }

    /// Waits at most `timeout`; `Err(self)` if the thread is still running.
    pub fn join_timeout(mut self, timeout: Duration) -> Result<(), NativeThread> {
        let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: valid out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
        let total_ns = now.tv_nsec as u128 + timeout.as_nanos();
        let deadline = libc::timespec {
            tv_sec: now.tv_sec + (total_ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (total_ns % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: joinable thread we created and have not joined.
        let rc = unsafe { libc::pthread_timedjoin_np(self.handle, std::ptr::null_mut(), &deadline) };
        if rc == 0 {
            self.joined = true;
            Ok(())
        } else {
            Err(self)
        }
    }
}

impl Drop for NativeThread {
    fn drop(&mut self) {
        if !self.joined {
            // Not joined: let it clean up after itself when it ends.
            // SAFETY: joinable thread we created and have not joined or detached.
            unsafe { libc::pthread_detach(self.handle) };
        }
    }
}

/// Writes all of `buf` to a socket with `MSG_NOSIGNAL`, so a peer that went
/// away yields `EPIPE` instead of a `SIGPIPE` that would kill the host
/// process (a library cannot assume its host ignores `SIGPIPE`).
pub fn send_all(socket: &impl std::os::fd::AsRawFd, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: valid fd and buffer for the call's duration.
        let n = unsafe { libc::send(socket.as_raw_fd(), buf.as_ptr() as *const c_void, buf.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// The process and user on the other end of a connected Unix socket
/// (`SO_PEERCRED`): the CLI uses it to accept only its own agent.
pub fn peer_credentials(socket: &impl std::os::fd::AsRawFd) -> std::io::Result<(u32, u32)> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: valid fd, out-buffer of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.pid as u32, cred.uid))
}

/// The effective user id of this process.
pub fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// The calling thread's kernel thread id.
pub fn current_os_tid() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as u32 }
}

/// CPU time consumed so far by thread `os_tid` of this process, in
/// nanoseconds, or `None` if the thread is gone.
pub fn thread_cpu_time_ns(os_tid: u32) -> Option<u64> {
    // The kernel's per-thread CPU clock id: MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED).
    let clock = ((!(os_tid as libc::clockid_t)) << 3) | 6;
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer; an invalid clock id returns an error.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn native_thread_runs_and_joins() {
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        let t = NativeThread::spawn("test", move || flag.store(true, Ordering::SeqCst)).unwrap();
        t.join();
        assert!(ran.load(Ordering::SeqCst));
    }

    #[test]
    fn join_timeout_reports_a_running_thread() {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let t = NativeThread::spawn("spin", move || {
            while !s.load(Ordering::SeqCst) {
                std::hint::spin_loop();
            }
        })
        .unwrap();
        let t = t.join_timeout(Duration::from_millis(20)).unwrap_err();
        stop.store(true, Ordering::SeqCst);
        t.join_timeout(Duration::from_secs(5)).unwrap();
    }

    #[test]
    fn own_cpu_clock_is_readable() {
        let a = thread_cpu_time_ns(current_os_tid()).unwrap();
        let mut x = 0u64;
        for i in 0..1_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        std::hint::black_box(x);
        assert!(thread_cpu_time_ns(current_os_tid()).unwrap() > a);
    }
}

/// A hash of the calling thread's pointer, spread over all 64 bits: its
/// top bits pick the calling thread's place in a small table of per-thread
/// things. Threads' pointers lie a stack's size apart (often a multiple of
/// any small table's size), so their bare bits would send most threads to
/// the same place. Reads the thread pointer only: no lock, no system call.
pub fn thread_hash() -> u64 {
    // SAFETY: pthread_self has no preconditions; glibc's reads the thread
    // pointer.
    let me = unsafe { libc::pthread_self() } as u64;
    (me >> 12).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A count that several threads add to at once, each on a line of its own
/// (by [`thread_hash`]): one shared counter passed its line between the
/// cores of two threads throwing exceptions at every throw.
#[derive(Debug, Default)]
pub struct StripedCounter {
    stripes: [PaddedCount; COUNTER_STRIPES],
}

const COUNTER_STRIPES: usize = 16;

#[derive(Debug, Default)]
#[repr(align(128))]
struct PaddedCount(std::sync::atomic::AtomicU64);

impl StripedCounter {
    pub fn add(&self, n: u64) {
        let stripe = (thread_hash() >> 60) as usize % COUNTER_STRIPES;
        self.stripes[stripe].0.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// The sum over the stripes: exact once no thread is adding.
    pub fn sum(&self) -> u64 {
        self.stripes.iter().map(|s| s.0.load(std::sync::atomic::Ordering::Relaxed)).sum()
    }

    pub fn reset(&self) {
        for stripe in &self.stripes {
            stripe.0.store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
