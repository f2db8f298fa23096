//! The memory a signal handler's walk reads, on huge pages.
//!
//! At 100 samples a second every read a walk makes is cold, and in this VM
//! half of a cold read's cost is finding its page: a TLB miss, whose page
//! walk is two-dimensional under virtualisation. Measured with
//! `bench/programs/handler_floor.c` (dependent loads from 4 MiB at 100 Hz),
//! a load cost about 430 ns on 4 KiB pages and 200 ns on a 2 MiB page. A
//! walk reads its thread's slot, its walk cache (64 KiB of return addresses,
//! one line a frame, each line likely on a page of its own), the process's
//! tables and the map: on 4 KiB pages, a page walk for most of its reads.
//!
//! So what the handler and the event walks read is allocated inside
//! [`allocate_hot`], from one reservation whose 2 MiB chunks the kernel is
//! asked to back with huge pages (`MADV_HUGEPAGE`: transparent huge pages in
//! `madvise` mode, as on these machines, back exactly the ranges asked
//! for). A few TLB entries then cover all of it. Where the kernel gives no
//! huge pages, the memory is plain memory and nothing else changes.
//!
//! The agent installs [`HotAwareAllocator`] as its global allocator: an
//! allocation made inside [`allocate_hot`], on the thread that entered it,
//! comes from the reservation; every other one from the system allocator,
//! as before. A block whose address lies in the reservation goes back to
//! it, whoever frees it. Blocks are powers of two from 64 bytes to 2 MiB,
//! each on a free list of its size; a larger request, or one the
//! reservation has no room left for, is served by the system allocator.
//! When the last block is freed (the agent detached), the reservation is
//! unmapped, so an unloaded agent leaves none of it behind.
//!
//! Never used by a signal handler: the handler neither allocates nor frees.
//! The lock below is held for a few instructions (and for the reservation's
//! `mmap` and `munmap`), by the agent's thread or by a thread dropping the
//! agent's objects.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The reservation's size: address space only (`MAP_NORESERVE`), backed as
/// it is touched.
const RESERVATION: usize = 128 << 20;
const HUGE_PAGE: usize = 2 << 20;
/// Block sizes: 2^6 to 2^21 bytes.
const MIN_SHIFT: u32 = 6;
const MAX_SHIFT: u32 = 21;
const CLASSES: usize = (MAX_SHIFT - MIN_SHIFT + 1) as usize;

/// The thread inside [`allocate_hot`] (`pthread_self`), 0 for none.
static HOT_THREAD: AtomicUsize = AtomicUsize::new(0);
/// The reservation's start, 0 while there is none: read without the lock
/// by `dealloc`, to tell the arena's blocks from the system allocator's.
static BASE: AtomicUsize = AtomicUsize::new(0);
static LOCKED: AtomicBool = AtomicBool::new(false);

struct Arena {
    /// Bytes handed out from the reservation's start (blocks and the gaps
    /// their alignment left, which went to the free lists).
    used: usize,
    /// The first free block of each size (its first word: the next), 0
    /// for none.
    free: [usize; CLASSES],
    /// Blocks handed out and not yet given back.
    live: usize,
    /// Bytes in those blocks.
    live_bytes: usize,
}

/// Only touched with `LOCKED` held.
struct ArenaCell(std::cell::UnsafeCell<Arena>);
// SAFETY: every access to the arena goes through `with_arena`, which holds
// the spin lock.
unsafe impl Sync for ArenaCell {}

static ARENA: ArenaCell =
    ArenaCell(std::cell::UnsafeCell::new(Arena { used: 0, free: [0; CLASSES], live: 0, live_bytes: 0 }));

fn with_arena<R>(f: impl FnOnce(&mut Arena) -> R) -> R {
    let mut spins = 0u32;
    while LOCKED.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        spins += 1;
        if spins.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    // SAFETY: the lock is held until the end of this function, so this is
    // the only reference.
    let r = f(unsafe { &mut *ARENA.0.get() });
    LOCKED.store(false, Ordering::Release);
    r
}

/// The size class of a layout, `None` if it is larger than the largest.
fn class_of(layout: Layout) -> Option<usize> {
    let size = layout.size().max(layout.align()).max(1 << MIN_SHIFT).checked_next_power_of_two()?;
    let shift = size.trailing_zeros();
    (shift <= MAX_SHIFT).then(|| (shift - MIN_SHIFT) as usize)
}

fn class_size(class: usize) -> usize {
    1 << (class as u32 + MIN_SHIFT)
}

/// Maps the reservation, 2 MiB-aligned, asking for huge pages; 0 if the
/// kernel refuses the mapping.
fn reserve() -> usize {
    // SAFETY: a new private anonymous mapping, no address asked for.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            RESERVATION + HUGE_PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return 0;
    }
    let raw = raw as usize;
    let base = raw.next_multiple_of(HUGE_PAGE);
    // SAFETY: both trims lie inside the mapping just made, which nothing
    // else refers to yet.
    unsafe {
        if base > raw {
            libc::munmap(raw as *mut libc::c_void, base - raw);
        }
        let end = base + RESERVATION;
        let raw_end = raw + RESERVATION + HUGE_PAGE;
        if raw_end > end {
            libc::munmap(end as *mut libc::c_void, raw_end - end);
        }
        // A hint: refused (THP off), the memory is ordinary pages.
        libc::madvise(base as *mut libc::c_void, RESERVATION, libc::MADV_HUGEPAGE);
    }
    base
}

impl Arena {
    fn take(&mut self, class: usize) -> Option<usize> {
        let size = class_size(class);
        let head = self.free[class];
        let block = if head != 0 {
            // SAFETY: a free block of the arena, at least 64 bytes, whose
            // first word was written by `give_back` or `carve`.
            self.free[class] = unsafe { (head as *const usize).read() };
            head
        } else {
            let mut base = BASE.load(Ordering::Relaxed);
            if base == 0 {
                base = reserve();
                if base == 0 {
                    return None;
                }
                BASE.store(base, Ordering::Release);
            }
            let at = self.used.next_multiple_of(size);
            if at + size > RESERVATION {
                return None;
            }
            self.carve(base, self.used, at);
            self.used = at + size;
            base + at
        };
        self.live += 1;
        self.live_bytes += size;
        Some(block)
    }

    /// Puts the gap `[from, to)` of the reservation, left by an alignment,
    /// on the free lists, as the largest aligned blocks that fit.
    fn carve(&mut self, base: usize, mut from: usize, to: usize) {
        while from < to {
            let align = 1usize << from.trailing_zeros().min(MAX_SHIFT);
            let mut size = align;
            while from + size > to {
                size /= 2;
            }
            if size >= 1 << MIN_SHIFT {
                self.give_back(base + from, (size.trailing_zeros() - MIN_SHIFT) as usize);
            }
            from += size.max(1);
        }
    }

    fn give_back(&mut self, block: usize, class: usize) {
        // SAFETY: a block of the arena of at least 64 bytes, 8-aligned, no
        // longer handed out: the arena owns its first word.
        unsafe { (block as *mut usize).write(self.free[class]) };
        self.free[class] = block;
    }

    fn release(&mut self, block: usize, class: usize) {
        self.give_back(block, class);
        self.live -= 1;
        self.live_bytes -= class_size(class);
        if self.live == 0 {
            // Nothing handed out: the whole reservation goes back to the
            // kernel (an agent that detached leaves none of it).
            let base = BASE.swap(0, Ordering::AcqRel);
            // SAFETY: our own mapping, in which no block is live.
            unsafe { libc::munmap(base as *mut libc::c_void, RESERVATION) };
            self.used = 0;
            self.free = [0; CLASSES];
        }
    }
}

/// Runs `f` with this thread's allocations served from the huge-page
/// reservation (see the module documentation): for what a signal handler
/// or an event walk will read. Only one thread at a time: another thread's
/// `f` runs with ordinary allocations.
pub fn allocate_hot<R>(f: impl FnOnce() -> R) -> R {
    struct Leave(bool);
    impl Drop for Leave {
        fn drop(&mut self) {
            if self.0 {
                HOT_THREAD.store(0, Ordering::Release);
            }
        }
    }
    let me = current_thread();
    let entered = HOT_THREAD.compare_exchange(0, me, Ordering::AcqRel, Ordering::Relaxed).is_ok();
    let _leave = Leave(entered);
    f()
}

fn current_thread() -> usize {
    // SAFETY: no preconditions; glibc's reads the thread pointer.
    unsafe { libc::pthread_self() as usize }
}

fn in_reservation(ptr: *mut u8) -> bool {
    let base = BASE.load(Ordering::Acquire);
    base != 0 && (ptr as usize).wrapping_sub(base) < RESERVATION
}

/// What the reservation holds now: (blocks, bytes in them).
pub fn in_use() -> (usize, usize) {
    with_arena(|a| (a.live, a.live_bytes))
}

/// Of the reservation, the bytes the kernel backs with huge pages now
/// (`AnonHugePages` of its mapping in `/proc/self/smaps`); 0 if there is
/// none. For the agent's log, off the signal path.
pub fn huge_page_bytes() -> u64 {
    let base = BASE.load(Ordering::Acquire);
    if base == 0 {
        return 0;
    }
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else { return 0 };
    let mut inside = false;
    let mut total = 0;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-')) {
            let start = range.split('-').next().and_then(|s| u64::from_str_radix(s, 16).ok());
            inside = start.is_some_and(|s| s >= base as u64 && s < (base + RESERVATION) as u64);
        } else if let (true, Some(kib)) = (inside, line.strip_prefix("AnonHugePages:")) {
            total += kib.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0) * 1024;
        }
    }
    total
}

/// The agent's global allocator: the system allocator, except inside
/// [`allocate_hot`] (see the module documentation).
#[derive(Debug)]
pub struct HotAwareAllocator;

impl HotAwareAllocator {
    fn hot_block(layout: Layout) -> Option<*mut u8> {
        let thread = HOT_THREAD.load(Ordering::Relaxed);
        if thread == 0 || thread != current_thread() {
            return None;
        }
        let class = class_of(layout)?;
        with_arena(|a| a.take(class)).map(|b| b as *mut u8)
    }
}

// SAFETY: blocks from the reservation are at least `layout.size()` bytes
// and aligned to their own size, which is at least `layout.align()`; a
// block is handed out once until it is freed, and freed to the list of the
// class its layout gives, the one it was taken from. Everything else is the
// system allocator's, called with the same arguments.
unsafe impl GlobalAlloc for HotAwareAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match Self::hot_block(layout) {
            Some(p) => p,
            // SAFETY: the caller's contract, passed on.
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match Self::hot_block(layout) {
            Some(p) => {
                // SAFETY: a block of at least `layout.size()` bytes, ours.
                unsafe { p.write_bytes(0, layout.size()) };
                p
            }
            // SAFETY: the caller's contract, passed on.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if in_reservation(ptr) {
            if let Some(class) = class_of(layout) {
                with_arena(|a| a.release(ptr as usize, class));
            }
        } else {
            // SAFETY: the caller's contract: a block the system allocator
            // gave (the reservation's are all inside it).
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let hot_now = HOT_THREAD.load(Ordering::Relaxed) == current_thread();
        if !in_reservation(ptr) && !hot_now {
            // SAFETY: the caller's contract, passed on.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // SAFETY: the caller guarantees a valid layout for `new_size`.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: as for `alloc`.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are at least the smaller size, and
            // distinct (the old one is still handed out).
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_the_layout() {
        assert_eq!(class_of(Layout::from_size_align(1, 1).unwrap()), Some(0));
        assert_eq!(class_of(Layout::from_size_align(65, 8).unwrap()), Some(1));
        assert_eq!(class_of(Layout::from_size_align(64, 4096).unwrap()), Some(6));
        assert_eq!(class_of(Layout::from_size_align(2 << 20, 8).unwrap()), Some(CLASSES - 1));
        assert_eq!(class_of(Layout::from_size_align((2 << 20) + 1, 8).unwrap()), None);
    }

    /// The arena's own logic, without the global allocator (the tests of
    /// this crate run on the system allocator; the agent's use both).
    #[test]
    fn blocks_are_aligned_apart_reused_and_the_reservation_goes_with_the_last() {
        let sizes = [1usize, 64, 100, 4096, 40_000, 65_536, 2 << 20, 8];
        let take = |size: usize| {
            let class = class_of(Layout::from_size_align(size, 8).unwrap()).unwrap();
            (with_arena(|a| a.take(class)).expect("a block"), class)
        };
        let blocks: Vec<(usize, usize)> = sizes.iter().map(|&s| take(s)).collect();
        let mut spans: Vec<(usize, usize)> = blocks.iter().map(|&(b, c)| (b, b + class_size(c))).collect();
        for &(b, c) in &blocks {
            assert_eq!(b % class_size(c), 0, "aligned to its size");
            assert!(in_reservation(b as *mut u8));
            // SAFETY: a block of the arena, mapped read-write, ours.
            unsafe {
                (b as *mut u8).write(1);
                ((b + class_size(c) - 1) as *mut u8).write(1);
            }
        }
        spans.sort();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "no two overlap: {spans:x?}");
        assert_eq!(in_use().0, sizes.len());
        // Freed, then taken again: the same block.
        let (b, c) = blocks[3];
        with_arena(|a| a.release(b, c));
        assert_eq!(with_arena(|a| a.take(c)), Some(b));
        for (b, c) in blocks {
            with_arena(|a| a.release(b, c));
        }
        assert_eq!(in_use(), (0, 0));
        assert_eq!(BASE.load(Ordering::Acquire), 0, "unmapped with the last block");
    }
}
