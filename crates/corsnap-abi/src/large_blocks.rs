//! The agent's large blocks, mapped by the agent itself rather than by
//! glibc's `malloc`, so that the agent cannot change how the application's
//! own `malloc` behaves.
//!
//! glibc serves a request of at least its mmap threshold (128 KiB at first)
//! with a mapping of its own, and when such a block is freed it raises the
//! threshold, process-wide, to that block's size (its "dynamic threshold",
//! `malloc/malloc.c`'s `free`). From then on the application's requests
//! below the new threshold come from the heap, and a `calloc` from the heap
//! must clear its memory, where a fresh mapping came cleared by the kernel.
//! On .NET 10 (`bench/events.py`'s `alloc`, `-e alloc`) the agent's
//! sampler thread freed one such block of its own early in the run (`perf
//! probe` on glibc's `munmap_chunk`: the only one in the application's
//! process). How much that cost the program is within this VM's noise:
//! recording cost +2.8% against +4.2% for the build before in one run of 20
//! interleaved rounds (paired medians), then +3.2/+2.5, +3.2/+3.1 and
//! +2.8/+3.0 in three more; the runtime's delivery of its allocation
//! events alone costs 1 to 3%. Whatever it costs, an agent has no business
//! changing the application's allocator settings.
//!
//! So every block of [`LARGE`] bytes or more the agent allocates (outside
//! its hot arena, see [`crate::hot_memory`]) is an anonymous mapping made
//! and unmapped here: glibc never hands the agent a mapping of its own and
//! never sees one freed.

use std::alloc::Layout;
use std::ptr::null_mut;

/// glibc's default mmap threshold (`DEFAULT_MMAP_THRESHOLD_MIN`): blocks
/// smaller than it glibc serves from its heaps, whatever its threshold is.
pub const LARGE: usize = 128 << 10;
/// The page size on x86-64 Linux, the only target of the agent.
const PAGE: usize = 4096;

/// Whether a block of this layout is mapped here when the hot arena does
/// not serve it.
#[inline]
pub fn is_large(layout: Layout) -> bool {
    layout.size() >= LARGE
}

fn mapped_len(size: usize) -> usize {
    size.div_ceil(PAGE) * PAGE
}

/// A new zeroed mapping for `layout` (a large one), or null.
pub fn map(layout: Layout) -> *mut u8 {
    map_aligned(mapped_len(layout.size()), layout.align(), 0).map_or(null_mut(), |start| start as *mut u8)
}

/// A new private anonymous read-write mapping of `len` bytes (a multiple
/// of the page) starting at a multiple of `align` (a power of two), with
/// `flags` added to `MAP_PRIVATE | MAP_ANONYMOUS`; `None` if the kernel
/// refuses. Above a page, the alignment is had by mapping `align` bytes
/// more and unmapping what lies outside the aligned span.
pub(crate) fn map_aligned(len: usize, align: usize, flags: libc::c_int) -> Option<usize> {
    let extra = if align > PAGE { align } else { 0 };
    // SAFETY: a fresh private anonymous mapping, no address asked for; no
    // memory of anyone's is touched.
    let raw = unsafe {
        libc::mmap(
            null_mut(),
            len + extra,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let raw = raw as usize;
    let start = raw.next_multiple_of(align.max(PAGE));
    // SAFETY: the head and tail are parts of the mapping just made, which
    // nothing refers to yet, outside the span kept; both are page-aligned
    // (the alignment is a multiple of the page).
    unsafe {
        if start > raw {
            libc::munmap(raw as *mut libc::c_void, start - raw);
        }
        let (end, raw_end) = (start + len, raw + len + extra);
        if raw_end > end {
            libc::munmap(end as *mut libc::c_void, raw_end - end);
        }
    }
    Some(start)
}

/// Unmaps a block [`map`] made for `layout`.
///
/// # Safety
/// `ptr` came from [`map`] (or [`remap`]) with this layout and is not used
/// again.
pub unsafe fn unmap(ptr: *mut u8, layout: Layout) {
    // SAFETY: the caller's contract: our mapping, of this length.
    unsafe { libc::munmap(ptr as *mut libc::c_void, mapped_len(layout.size())) };
}

/// A large block grown or shrunk to `new_size` (still large), moved by the
/// kernel if it must (`mremap`), its contents kept; null if it could not be
/// (the old block is then untouched).
///
/// # Safety
/// `ptr` came from [`map`] (or [`remap`]) with `layout`, whose alignment is
/// at most a page.
pub unsafe fn remap(ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
    // SAFETY: the caller's contract: our mapping, of this length; mremap
    // moves or resizes it as a whole.
    let moved = unsafe {
        libc::mremap(ptr as *mut libc::c_void, mapped_len(layout.size()), mapped_len(new_size), libc::MREMAP_MAYMOVE)
    };
    if moved == libc::MAP_FAILED {
        null_mut()
    } else {
        moved as *mut u8
    }
}

/// Whether [`remap`] can resize a block of `layout` to `new_size`.
pub fn can_remap(layout: Layout, new_size: usize) -> bool {
    is_large(layout) && new_size >= LARGE && layout.align() <= PAGE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_are_zeroed_aligned_resized_with_their_contents_and_given_back() {
        let layout = Layout::from_size_align(LARGE + 10, 8).unwrap();
        let block = map(layout);
        assert!(!block.is_null());
        // SAFETY: a block of `layout.size()` bytes, ours.
        let bytes = unsafe { std::slice::from_raw_parts_mut(block, layout.size()) };
        assert!(bytes.iter().all(|&b| b == 0), "zeroed");
        bytes[layout.size() - 1] = 7;
        assert!(can_remap(layout, 4 * LARGE));
        // SAFETY: our block, of `layout`.
        let grown = unsafe { remap(block, layout, 4 * LARGE) };
        assert!(!grown.is_null());
        // SAFETY: the grown block holds 4 * LARGE bytes.
        assert_eq!(unsafe { *grown.add(layout.size() - 1) }, 7, "contents kept");
        // SAFETY: our block, of its new size.
        unsafe { unmap(grown, Layout::from_size_align(4 * LARGE, 8).unwrap()) };

        let aligned = Layout::from_size_align(LARGE, 1 << 16).unwrap();
        let block = map(aligned);
        assert_eq!(block as usize % (1 << 16), 0, "aligned");
        assert!(!can_remap(aligned, 2 * LARGE));
        // SAFETY: our block, of `aligned`.
        unsafe { unmap(block, aligned) };
        assert!(!is_large(Layout::from_size_align(LARGE - 1, 8).unwrap()));
    }
}
