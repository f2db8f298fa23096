//! The page the kernel enters the handler through.
//!
//! # Leaving the process
//!
//! The kernel enters the handler through a small trampoline in a page of its
//! own (not part of the agent's library): it counts itself in, calls the
//! current target, counts itself out and returns. On detach the agent deletes
//! every timer, sets `SIGPROF` to `SIG_IGN` (which discards signals already
//! pending on any thread), restores the previous disposition, points the
//! trampoline at a bare `ret`, and waits for the count to reach zero. After
//! that no instruction of the library can run on a signal: a thread that was
//! entering the trampoline at that moment calls the `ret`. The page stays, is
//! named `corsnap-signal-trampoline`, and is reused by the next attach.

use super::*;

pub(super) const TRAMPOLINE_NAME: &str = "corsnap-signal-trampoline";
const PAGE: usize = 4096;
const TRAMPOLINE_MAGIC: u64 = 0x434f_5253_4e41_5031; // "CORSNAP1"
/// Offsets in the data page.
const DATA_MAGIC: usize = 0;
const DATA_IN_FLIGHT: usize = 8;
const DATA_TARGET: usize = 16;
/// Offset of the bare `ret` in the code page.
const RET_STUB: usize = 48;

/// The trampoline's code page followed by its data page (`in_flight`,
/// `target`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Trampoline {
    pub(super) code: usize,
}

impl Trampoline {
    pub(super) fn data(&self) -> usize {
        self.code + PAGE
    }

    pub(super) fn in_flight(&self) -> &'static AtomicU64 {
        // SAFETY: the data page is mapped read-write for the life of the
        // process (never unmapped), 8-aligned.
        unsafe { &*((self.data() + DATA_IN_FLIGHT) as *const AtomicU64) }
    }

    pub(super) fn target(&self) -> &'static AtomicUsize {
        // SAFETY: as above.
        unsafe { &*((self.data() + DATA_TARGET) as *const AtomicUsize) }
    }

    pub(super) fn entry(&self) -> usize {
        self.code
    }

    pub(super) fn idle(&self) -> usize {
        self.code + RET_STUB
    }

    /// Finds the trampoline an earlier attach left, or makes one.
    pub(super) fn get() -> std::io::Result<Trampoline> {
        if let Some(t) = Self::find() {
            return Ok(t);
        }
        Self::create()
    }

    pub(super) fn find() -> Option<Trampoline> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        for line in maps.lines() {
            if !line.contains(TRAMPOLINE_NAME) || !line.contains("r-x") {
                continue;
            }
            let start = u64::from_str_radix(line.split('-').next()?, 16).ok()? as usize;
            let magic = crate::process::read_own_u64((start + PAGE + DATA_MAGIC) as u64)?;
            if magic == TRAMPOLINE_MAGIC {
                return Some(Trampoline { code: start });
            }
        }
        None
    }

    pub(super) fn create() -> std::io::Result<Trampoline> {
        // A memfd mapping shows its name in /proc/self/maps, so the next
        // attach (a fresh copy of this library) finds the page again.
        let name = std::ffi::CString::new(TRAMPOLINE_NAME).expect("no NUL");
        // SAFETY: valid NUL-terminated name.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        let (flags, fd) = if fd >= 0 {
            // SAFETY: fd is ours.
            if unsafe { libc::ftruncate(fd, (2 * PAGE) as libc::off_t) } != 0 {
                // SAFETY: closing our own fd.
                unsafe { libc::close(fd) };
                (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)
            } else {
                (libc::MAP_SHARED, fd)
            }
        } else {
            (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)
        };
        // SAFETY: a fresh mapping of two pages; fd is ours or -1.
        let base = unsafe { libc::mmap(null_mut(), 2 * PAGE, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
        if fd >= 0 {
            // SAFETY: the mapping keeps the memfd alive.
            unsafe { libc::close(fd) };
        }
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let code = base as usize;
        let data = code + PAGE;
        let rel = |field: usize, next_ip: usize| ((data + field) as i64 - (code + next_ip) as i64) as i32;
        let mut bytes = Vec::with_capacity(64);
        // lock inc qword [rip + in_flight]
        bytes.extend_from_slice(&[0xf0, 0x48, 0xff, 0x05]);
        bytes.extend_from_slice(&rel(DATA_IN_FLIGHT, 8).to_le_bytes());
        // sub rsp, 8   (keep the 16-byte alignment the callee expects)
        bytes.extend_from_slice(&[0x48, 0x83, 0xec, 0x08]);
        // mov rax, [rip + target]
        bytes.extend_from_slice(&[0x48, 0x8b, 0x05]);
        bytes.extend_from_slice(&rel(DATA_TARGET, 19).to_le_bytes());
        // call rax
        bytes.extend_from_slice(&[0xff, 0xd0]);
        // add rsp, 8
        bytes.extend_from_slice(&[0x48, 0x83, 0xc4, 0x08]);
        // lock dec qword [rip + in_flight]
        bytes.extend_from_slice(&[0xf0, 0x48, 0xff, 0x0d]);
        bytes.extend_from_slice(&rel(DATA_IN_FLIGHT, 33).to_le_bytes());
        // ret
        bytes.push(0xc3);
        assert_eq!(bytes.len(), 34);
        bytes.resize(RET_STUB, 0xcc);
        bytes.push(0xc3); // the idle target: return at once
                          // SAFETY: the two fresh pages are ours and writable.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), code as *mut u8, bytes.len());
            *((data + DATA_IN_FLIGHT) as *mut u64) = 0;
            *((data + DATA_TARGET) as *mut usize) = code + RET_STUB;
            *((data + DATA_MAGIC) as *mut u64) = TRAMPOLINE_MAGIC;
        }
        // SAFETY: our own first page.
        if unsafe { libc::mprotect(base, PAGE, libc::PROT_READ | libc::PROT_EXEC) } != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: unmapping what we mapped.
            unsafe { libc::munmap(base, 2 * PAGE) };
            return Err(e);
        }
        if fd < 0 {
            // Name the anonymous fallback so `find` can see it.
            // SAFETY: prctl with a valid range and name; failure is harmless.
            unsafe {
                libc::prctl(libc::PR_SET_VMA, libc::PR_SET_VMA_ANON_NAME, base as usize, PAGE, name.as_ptr() as usize)
            };
        }
        Ok(Trampoline { code })
    }
}
