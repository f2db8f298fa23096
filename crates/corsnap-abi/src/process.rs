//! Reading this process's own memory and loaded-object list, off the signal
//! path: the agent's thread learns code and unwind information this way.
//!
//! Memory is read with `process_vm_readv` on our own pid rather than by
//! dereferencing: an address that is not (or no longer) mapped gives an
//! error, never a fault in the host process.

use std::ffi::{c_int, c_void, CStr};

/// Copies `buf.len()` bytes at `addr` of this process into `buf`; `false` if
/// any of it is not readable.
pub fn read_own_memory(addr: u64, buf: &mut [u8]) -> bool {
    if buf.is_empty() {
        return true;
    }
    let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut c_void, iov_len: buf.len() };
    let remote = libc::iovec { iov_base: addr as usize as *mut c_void, iov_len: buf.len() };
    // SAFETY: the local iovec describes `buf`, which we own mutably; the
    // remote one is only read by the kernel, which checks it.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    n == buf.len() as isize
}

/// Has the kernel map every page of `[addr, addr + len)` (rounded out to
/// whole pages) now, writable, without changing what they hold
/// (`MADV_POPULATE_WRITE`, Linux 5.14; an older kernel refuses it, and
/// the pages are mapped at first touch as before). For memory a signal
/// handler will touch: zeroed allocations are left unmapped until then, and
/// a page fault inside the handler, measured in this VM, took tens of
/// microseconds. On the agent's thread only.
pub fn populate(addr: usize, len: usize) {
    const PAGE: usize = 4096;
    if len == 0 {
        return;
    }
    let start = addr & !(PAGE - 1);
    let end = addr.saturating_add(len).next_multiple_of(PAGE);
    // SAFETY: MADV_POPULATE_WRITE changes no contents: it faults in pages
    // of mappings that already exist (the range holds live allocations of
    // ours, rounded out to their pages), and fails for anything else.
    unsafe { libc::madvise(start as *mut c_void, end - start, libc::MADV_POPULATE_WRITE) };
}

/// `read_own_memory` into a new vector.
pub fn read_own_bytes(addr: u64, len: usize) -> Option<Vec<u8>> {
    let mut v = vec![0u8; len];
    read_own_memory(addr, &mut v).then_some(v)
}

/// A little-endian u64 of our own memory.
pub fn read_own_u64(addr: u64) -> Option<u64> {
    let mut b = [0u8; 8];
    read_own_memory(addr, &mut b).then(|| u64::from_le_bytes(b))
}

/// One ELF object the dynamic loader has mapped (`dl_iterate_phdr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedObject {
    /// As the loader knows it; empty for the main executable.
    pub name: String,
    /// Load bias: actual address minus the address the file states.
    pub bias: u64,
    /// `PT_LOAD` segments: (stated address, size in memory, executable).
    pub segments: Vec<(u64, u64, bool)>,
    /// `PT_GNU_EH_FRAME`: the `.eh_frame_hdr` section (stated address, size).
    pub eh_frame_hdr: Option<(u64, u64)>,
}

/// The objects loaded now, and the loader's (adds, subs) counters, which
/// change whenever an object is loaded or unloaded.
pub fn loaded_objects() -> (Vec<LoadedObject>, (u64, u64)) {
    struct Out {
        objects: Vec<LoadedObject>,
        counters: (u64, u64),
    }
    unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, size: usize, data: *mut c_void) -> c_int {
        // SAFETY: the loader passes a valid info of `size` bytes and our
        // `data` pointer; both live for this call. The counters are only
        // present if the struct is long enough.
        unsafe {
            let out = &mut *(data as *mut Out);
            let info = &*info;
            if size >= std::mem::size_of::<libc::dl_phdr_info>() {
                out.counters = (info.dlpi_adds, info.dlpi_subs);
            }
            let name = if info.dlpi_name.is_null() {
                String::new()
            } else {
                CStr::from_ptr(info.dlpi_name).to_string_lossy().into_owned()
            };
            let mut object = LoadedObject { name, bias: info.dlpi_addr, segments: Vec::new(), eh_frame_hdr: None };
            for i in 0..info.dlpi_phnum as usize {
                let ph = &*info.dlpi_phdr.add(i);
                match ph.p_type {
                    libc::PT_LOAD => object.segments.push((ph.p_vaddr, ph.p_memsz, ph.p_flags & libc::PF_X != 0)),
                    libc::PT_GNU_EH_FRAME => object.eh_frame_hdr = Some((ph.p_vaddr, ph.p_memsz)),
                    _ => {}
                }
            }
            out.objects.push(object);
        }
        0
    }
    let mut out = Out { objects: Vec::new(), counters: (0, 0) };
    // SAFETY: `visit` only touches `out` through the pointer we pass, for the
    // duration of the call. A panic cannot occur inside it (no indexing that
    // can fail, allocation failure aborts).
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut out as *mut Out as *mut c_void) };
    (out.objects, out.counters)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_memory_reads_what_is_there_and_refuses_what_is_not() {
        let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(read_own_u64(data.as_ptr() as u64), Some(u64::from_le_bytes(data)));
        assert_eq!(read_own_u64(8), None, "page zero is never mapped");
    }

    #[test]
    fn libc_is_loaded_with_an_executable_segment_and_eh_frame() {
        let (objects, (adds, _)) = loaded_objects();
        assert!(adds > 0);
        let libc = objects.iter().find(|o| o.name.contains("libc.so")).expect("libc is loaded");
        assert!(libc.segments.iter().any(|s| s.2));
        assert!(libc.eh_frame_hdr.is_some());
    }
}
