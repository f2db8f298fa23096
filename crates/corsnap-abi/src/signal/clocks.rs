//! The two clocks that raise `SIGPROF` on a thread's CPU time: POSIX CPU
//! timers and perf events (raw system calls, and the perf ring's one
//! control word the handler writes).

use super::*;

/// The kernel's `struct sigevent` (64 bytes) with `SIGEV_THREAD_ID`.
#[repr(C)]
struct KernelSigevent {
    pub(super) value: usize,
    signo: c_int,
    notify: c_int,
    pub(super) tid: c_int,
    pad: [c_int; 11],
}
const _: () = assert!(std::mem::size_of::<KernelSigevent>() == 64);
const SIGEV_THREAD_ID: c_int = 4;

/// A timer on thread `tid`'s CPU clock that signals that thread with
/// `slot` in `si_value`. Made with the raw system call: glibc's wrapper
/// would hand back its own id for the same thing.
pub(super) fn create_cpu_timer(tid: u32, slot: usize) -> std::io::Result<i32> {
    // MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)
    let clock = ((!tid) << 3 | 6) as c_int;
    let event =
        KernelSigevent { value: slot, signo: SAMPLE_SIGNAL, notify: SIGEV_THREAD_ID, tid: tid as c_int, pad: [0; 11] };
    let mut id: c_int = 0;
    // SAFETY: valid pointers to a kernel sigevent and an int.
    let rc =
        unsafe { libc::syscall(libc::SYS_timer_create, clock, &event as *const KernelSigevent, &mut id as *mut c_int) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(id)
}

/// Arms the timer to fire once, after `delay_ns` more of the thread's CPU
/// time.
pub(super) fn arm_timer_once(id: i32, delay_ns: u64) -> std::io::Result<()> {
    arm_timer(id, delay_ns, 0)
}

/// Arms the timer to fire after `delay_ns` more of the thread's CPU time,
/// then every `period_ns` (0: once); a zero delay disarms it. A system call
/// (on POSIX's async-signal-safe list: the handler re-arms with it).
pub(super) fn arm_timer(id: i32, delay_ns: u64, period_ns: u64) -> std::io::Result<()> {
    let spec_of =
        |ns: u64| libc::timespec { tv_sec: (ns / 1_000_000_000) as i64, tv_nsec: (ns % 1_000_000_000) as i64 };
    let spec = libc::itimerspec { it_interval: spec_of(period_ns), it_value: spec_of(delay_ns) };
    // SAFETY: valid itimerspec; the kernel checks the id.
    let rc = unsafe {
        libc::syscall(libc::SYS_timer_settime, id, 0, &spec as *const libc::itimerspec, null_mut::<libc::itimerspec>())
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `struct perf_event_attr`, the first 64 bytes (`PERF_ATTR_SIZE_VER0`):
/// all corsnap sets.
#[repr(C)]
struct PerfEventAttr {
    kind: u32,
    pub(super) size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    pub(super) flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}
const _: () = assert!(std::mem::size_of::<PerfEventAttr>() == 64);
const SYS_PERF_EVENT_OPEN: libc::c_long = 298;
const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_TASK_CLOCK: u64 = 1;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
const ATTR_DISABLED: u64 = 1;
const ATTR_EXCLUDE_KERNEL: u64 = 1 << 5;
const ATTR_EXCLUDE_HV: u64 = 1 << 6;
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
pub(super) const PERF_EVENT_IOC_DISABLE: libc::c_ulong = 0x2401;
const PERF_EVENT_IOC_PERIOD: libc::c_ulong = 0x4008_2404;
pub(super) const F_SETSIG: c_int = 10;
const F_SETOWN_EX: c_int = 15;
const F_OWNER_TID: c_int = 0;

/// A task-clock perf event on thread `tid` (its CPU time, measured with a
/// high-resolution timer). Kernel time counts too where the kernel lets an
/// unprivileged process measure it; else only user time does.
pub(super) fn open_perf_event(tid: u32) -> std::io::Result<i32> {
    let mut attr = PerfEventAttr {
        kind: PERF_TYPE_SOFTWARE,
        size: 64,
        config: PERF_COUNT_SW_TASK_CLOCK,
        sample_period: 10_000_000,
        sample_type: 0,
        read_format: 0,
        flags: ATTR_DISABLED | ATTR_EXCLUDE_HV,
        wakeup_events: 1,
        bp_type: 0,
        config1: 0,
    };
    for attempt in 0..2 {
        // SAFETY: a valid attr of the size it states; pid = tid, any CPU.
        let fd = unsafe {
            libc::syscall(
                SYS_PERF_EVENT_OPEN,
                &attr as *const PerfEventAttr,
                tid as c_int,
                -1,
                -1,
                PERF_FLAG_FD_CLOEXEC,
            )
        };
        if fd >= 0 {
            return Ok(fd as i32);
        }
        let e = std::io::Error::last_os_error();
        if attempt == 0 && matches!(e.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM)) {
            attr.flags |= ATTR_EXCLUDE_KERNEL;
            continue;
        }
        return Err(e);
    }
    Err(std::io::Error::from_raw_os_error(libc::EACCES))
}

/// The size of a perf event's mapping: the control page and one data page
/// (512 eight-byte overflow records).
const PERF_MMAP_BYTES: usize = 2 * 4096;
/// `struct perf_event_mmap_page`: `data_head` at 1024, `data_tail` at 1032.
pub(super) const PERF_DATA_HEAD: usize = 1024;
const PERF_DATA_TAIL: usize = 1032;

/// Maps the event's ring buffer; its control page's address.
pub(super) fn map_perf_ring(fd: i32) -> std::io::Result<usize> {
    // SAFETY: a fresh shared mapping of our own perf fd.
    let page =
        unsafe { libc::mmap(null_mut(), PERF_MMAP_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if page == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(page as usize)
}

pub(super) fn unmap_perf_ring(page: usize) {
    if page != 0 {
        // SAFETY: a mapping made by `map_perf_ring`, no longer used.
        unsafe { libc::munmap(page as *mut c_void, PERF_MMAP_BYTES) };
    }
}

/// From the handler: marks every overflow record read (`data_tail =
/// data_head`). Two atomic accesses to the mapped control page; no system
/// call.
pub(super) fn consume_perf_records(page: usize) {
    if page == 0 {
        return;
    }
    // SAFETY: the control page stays mapped while the slot exists (unmapped
    // only after its thread has exited, or after every handler has left);
    // both fields are 8-aligned u64s the kernel shares with us.
    unsafe {
        let head = &*((page + PERF_DATA_HEAD) as *const AtomicU64);
        let tail = &*((page + PERF_DATA_TAIL) as *const AtomicU64);
        tail.store(head.load(Ordering::Acquire), Ordering::Release);
    }
}

/// Makes the event's overflows signal thread `tid` with `SAMPLE_SIGNAL`
/// (carrying the fd), and starts it.
pub(super) fn start_perf_event(fd: i32, tid: u32, period_ns: u64) -> std::io::Result<()> {
    #[repr(C)]
    struct FOwnerEx {
        kind: c_int,
        pid: c_int,
    }
    let owner = FOwnerEx { kind: F_OWNER_TID, pid: tid as c_int };
    // SAFETY: fcntl and ioctl on our own fd with valid arguments.
    unsafe {
        if libc::fcntl(fd, F_SETOWN_EX, &owner as *const FOwnerEx) != 0
            || libc::fcntl(fd, F_SETSIG, SAMPLE_SIGNAL) != 0
            || libc::fcntl(fd, libc::F_SETFL, libc::O_ASYNC) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        let period = period_ns;
        if libc::ioctl(fd, PERF_EVENT_IOC_PERIOD, &period as *const u64) != 0
            || libc::ioctl(fd, PERF_EVENT_IOC_ENABLE, 0) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The event's next period. A system call on an fd the slot owns; no lock,
/// no allocation (safe in the handler).
pub(super) fn set_perf_period(fd: i32, period_ns: u64) {
    // SAFETY: ioctl on our own fd with a valid pointer.
    unsafe { libc::ioctl(fd, PERF_EVENT_IOC_PERIOD, &period_ns as *const u64) };
}

/// Ends a perf event for good. Closing the fd alone is not enough: the ring
/// buffer's mapping keeps the event alive, still counting and signalling,
/// until the slot is freed; and after a detach, a `SIGPROF` that nobody
/// handles kills the process. So the event is disabled and its signal
/// delivery switched off first.
pub(super) fn close_perf_event(fd: i32) {
    PERF_FDS[fd as usize].store(0, Ordering::Release);
    // SAFETY: ioctl, fcntl and close on our own fd.
    unsafe {
        libc::ioctl(fd, PERF_EVENT_IOC_DISABLE, 0);
        libc::fcntl(fd, libc::F_SETFL, 0);
        libc::close(fd);
    }
}

pub(super) fn enable_perf_event(fd: i32, on: bool) {
    // SAFETY: ioctl on our own fd.
    unsafe { libc::ioctl(fd, if on { PERF_EVENT_IOC_ENABLE } else { PERF_EVENT_IOC_DISABLE }, 0) };
}

pub(super) fn delete_timer(id: i32) {
    // SAFETY: deleting a timer id we created; errors are harmless.
    unsafe { libc::syscall(libc::SYS_timer_delete, id) };
}
