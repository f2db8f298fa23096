//! Small operating-system services the command line tool needs, kept here
//! with the rest of corsnap's `unsafe`.

/// Sends signal `signal` to process `pid`.
pub fn send_signal(pid: u32, signal: i32) -> std::io::Result<()> {
    // SAFETY: kill has no memory preconditions.
    if unsafe { libc::kill(pid as libc::pid_t, signal) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The size of the terminal on `fd`, as (rows, columns).
pub fn terminal_size(fd: i32) -> Option<(u16, u16)> {
    // SAFETY: TIOCGWINSZ fills a winsize we own; failure leaves it zeroed.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut size) };
    (rc == 0 && size.ws_row > 0).then_some((size.ws_row, size.ws_col))
}

/// Local time as `2026-11-23_10-56-47`, for file names.
pub fn local_timestamp() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let [year, month, day, hour, minute, second] = local_time(now as i64);
    format!("{year:04}-{month:02}-{day:02}_{hour:02}-{minute:02}-{second:02}")
}

/// The local calendar time of a Unix time in seconds: year, month (1-12),
/// day, hour, minute, second. UTC if the time zone cannot be read.
pub fn local_time(unix_secs: i64) -> [i64; 6] {
    let t: libc::time_t = unix_secs as libc::time_t;
    // SAFETY: localtime_r reads `t` and fills our own zeroed out-struct.
    let tm = unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&t, &mut tm).is_null() && libc::gmtime_r(&t, &mut tm).is_null() {
            return [1970, 1, 1, 0, 0, 0];
        }
        tm
    };
    [
        i64::from(tm.tm_year) + 1900,
        i64::from(tm.tm_mon) + 1,
        i64::from(tm.tm_mday),
        i64::from(tm.tm_hour),
        i64::from(tm.tm_min),
        i64::from(tm.tm_sec),
    ]
}

static STOP_COUNT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
static STOP_FIRST_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// SIGINT, SIGTERM and SIGHUP ask the command line tool to stop: the first
/// is remembered ([`stop_requested`]); another one more than a second later
/// ends the process at once with the shell's status for it. (One request
/// often arrives twice: `timeout` signals its child and then the child's
/// whole process group.) Async-signal-safe: atomics, `clock_gettime`,
/// `_exit`.
extern "C" fn on_stop_signal(signal: libc::c_int) {
    use std::sync::atomic::Ordering;
    let now = crate::signal::monotonic_ns();
    if STOP_COUNT.fetch_add(1, Ordering::SeqCst) == 0 {
        STOP_FIRST_NS.store(now, Ordering::SeqCst);
        STOP_SIGNAL.store(signal, Ordering::SeqCst);
    } else if now.saturating_sub(STOP_FIRST_NS.load(Ordering::SeqCst)) > 1_000_000_000 {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Installs [`on_stop_signal`] for SIGINT, SIGTERM and SIGHUP.
pub fn install_stop_handlers() -> std::io::Result<()> {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction filled in with a plain handler.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            let handler: extern "C" fn(libc::c_int) = on_stop_signal;
            action.sa_sigaction = handler as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// The first stop signal received, if any.
pub fn stop_requested() -> Option<i32> {
    let s = STOP_SIGNAL.load(std::sync::atomic::Ordering::SeqCst);
    (s != 0).then_some(s)
}

#[cfg(test)]
mod tests {
    #[test]
    fn timestamps_read_as_dates() {
        let t = super::local_timestamp();
        assert_eq!(t.len(), 19, "{t}");
        assert!(t.starts_with("20"), "{t}");
    }
}
