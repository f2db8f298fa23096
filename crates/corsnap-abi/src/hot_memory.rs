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
//! It is a buddy allocator: a block freed merges with its buddy when that
//! is free, and a request with no free block of its size splits a larger
//! one. (Without merging, the blocks a growing vector leaves behind, and
//! those of maps replaced, stayed on the lists of their sizes while larger
//! ones were carved anew: on a 50-thread program 19 MiB of the reservation
//! were touched for 16 MiB of blocks, 20 MiB of huge pages resident, 16
//! MiB with merging.) A free 2 MiB block is given back to the kernel
//! (`MADV_DONTNEED`) until it is taken again.
//! When the last block is freed (the agent detached), the reservation is
//! unmapped, so an unloaded agent leaves none of it behind.
//!
//! Never used by a signal handler: the handler neither allocates nor frees.
//! The lock below is held for a few instructions, a few dozen for a merge
//! or a split (and for the reservation's `mmap`, `munmap` and `madvise`), by
//! the agent's thread or by a thread dropping the agent's objects.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::large_blocks;

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
    /// The first free block of each size below 2 MiB, 0 for none. A free
    /// block's first words are its list's next and previous blocks (0:
    /// none) and its class.
    free: [usize; CLASSES],
    /// The free 2 MiB blocks, kept here rather than linked through their
    /// first words: they are given back to the kernel, and a write would
    /// fault a huge page in again.
    free_huge: [usize; RESERVATION / HUGE_PAGE],
    free_huge_count: usize,
    /// A bit for each 64 bytes of the reservation: set where a free block
    /// begins, so that a block freed can find its buddy free and merge.
    free_starts: [u64; FREE_START_WORDS],
    /// Blocks handed out and not yet given back.
    live: usize,
    /// Bytes in those blocks.
    live_bytes: usize,
}

const FREE_START_WORDS: usize = RESERVATION >> MIN_SHIFT >> 6;

/// Only touched with `LOCKED` held.
struct ArenaCell(std::cell::UnsafeCell<Arena>);
// SAFETY: every access to the arena goes through `with_arena`, which holds
// the spin lock.
unsafe impl Sync for ArenaCell {}

static ARENA: ArenaCell = ArenaCell(std::cell::UnsafeCell::new(Arena {
    used: 0,
    free: [0; CLASSES],
    free_huge: [0; RESERVATION / HUGE_PAGE],
    free_huge_count: 0,
    free_starts: [0; FREE_START_WORDS],
    live: 0,
    live_bytes: 0,
}));

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
    let Some(base) = large_blocks::map_aligned(RESERVATION, HUGE_PAGE, libc::MAP_NORESERVE) else { return 0 };
    // A hint: refused (THP off), the memory is ordinary pages.
    // SAFETY: the reservation just mapped, which nothing refers to yet.
    unsafe { libc::madvise(base as *mut libc::c_void, RESERVATION, libc::MADV_HUGEPAGE) };
    base
}

impl Arena {
    /// A block of `class`: a free one of its size; else a larger free one
    /// split, its other halves freed; else one carved from the reservation
    /// past what is used.
    fn take(&mut self, class: usize) -> Option<usize> {
        let base = match BASE.load(Ordering::Relaxed) {
            0 => {
                let base = reserve();
                if base == 0 {
                    return None;
                }
                BASE.store(base, Ordering::Release);
                base
            }
            base => base,
        };
        let block = loop {
            if let Some(mut larger) = (class..CLASSES).find(|&c| self.has_free(c)) {
                let block = self.take_free(base, larger);
                while larger > class {
                    larger -= 1;
                    self.give_back(base, block + class_size(larger), larger);
                }
                break block;
            }
            let size = class_size(class);
            let at = self.used.next_multiple_of(size);
            if at + size > RESERVATION {
                return None;
            }
            if at > self.used {
                // The gap its alignment leaves is freed first (it may merge
                // into a block of this size), then the lists are asked again.
                let from = std::mem::replace(&mut self.used, at);
                self.carve(base, from, at);
                continue;
            }
            self.used = at + size;
            break base + at;
        };
        self.live += 1;
        self.live_bytes += class_size(class);
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
                self.free_merged(base, base + from, (size.trailing_zeros() - MIN_SHIFT) as usize);
            }
            from += size.max(1);
        }
    }

    fn has_free(&self, class: usize) -> bool {
        if class == CLASSES - 1 {
            self.free_huge_count > 0
        } else {
            self.free[class] != 0
        }
    }

    /// A free block of `class` (which has one), off its list.
    fn take_free(&mut self, base: usize, class: usize) -> usize {
        if class == CLASSES - 1 {
            self.free_huge_count -= 1;
            self.free_huge[self.free_huge_count]
        } else {
            let block = self.free[class];
            self.unlink(base, block, class);
            block
        }
    }

    fn free_start_bit(base: usize, block: usize) -> (usize, u64) {
        let unit = (block - base) >> MIN_SHIFT;
        (unit / 64, 1 << (unit % 64))
    }

    /// Whether a free block of `class` begins at `block`.
    fn is_free(&self, base: usize, block: usize, class: usize) -> bool {
        let (word, bit) = Self::free_start_bit(base, block);
        // SAFETY: a free block's third word is its class (`give_back`).
        self.free_starts[word] & bit != 0 && unsafe { (block as *const usize).add(2).read() } == class
    }

    /// Puts `block` at the head of its class's list.
    fn give_back(&mut self, base: usize, block: usize, class: usize) {
        if class == CLASSES - 1 {
            // At most one a 2 MiB chunk of the reservation.
            self.free_huge[self.free_huge_count] = block;
            self.free_huge_count += 1;
            return;
        }
        let next = self.free[class];
        // SAFETY: a block of the arena of at least 64 bytes, 8-aligned, no
        // longer handed out: the arena owns its first words, and those of
        // the free block after it.
        unsafe {
            let words = block as *mut usize;
            words.write(next);
            words.add(1).write(0);
            words.add(2).write(class);
            if next != 0 {
                (next as *mut usize).add(1).write(block);
            }
        }
        self.free[class] = block;
        let (word, bit) = Self::free_start_bit(base, block);
        self.free_starts[word] |= bit;
    }

    /// Takes the free `block` off its class's list.
    fn unlink(&mut self, base: usize, block: usize, class: usize) {
        // SAFETY: a free block of the arena: its words are its links, and
        // those of its neighbours on the list are theirs.
        unsafe {
            let words = block as *mut usize;
            let (next, prev) = (words.read(), words.add(1).read());
            if prev == 0 {
                self.free[class] = next;
            } else {
                (prev as *mut usize).write(next);
            }
            if next != 0 {
                (next as *mut usize).add(1).write(prev);
            }
        }
        let (word, bit) = Self::free_start_bit(base, block);
        self.free_starts[word] &= !bit;
    }

    /// Frees `block`, merged with its buddies, so that freed memory serves
    /// larger blocks again. A whole free 2 MiB block goes back to the
    /// kernel until it is taken again.
    fn release(&mut self, block: usize, class: usize) {
        let base = BASE.load(Ordering::Relaxed);
        self.live -= 1;
        self.live_bytes -= class_size(class);
        if self.live == 0 {
            // Nothing handed out: the whole reservation goes back to the
            // kernel (an agent that detached leaves none of it).
            BASE.store(0, Ordering::Release);
            // SAFETY: our own mapping, in which no block is live.
            unsafe { libc::munmap(base as *mut libc::c_void, RESERVATION) };
            let used_words = (self.used >> MIN_SHIFT).div_ceil(64);
            self.used = 0;
            self.free = [0; CLASSES];
            self.free_huge_count = 0;
            // Only the words in use: the rest were never touched.
            self.free_starts[..used_words].fill(0);
            return;
        }
        self.free_merged(base, block, class);
    }

    /// Puts the free `block` on a list, merged with its buddy (the other
    /// half of the block twice its size) while that is free.
    fn free_merged(&mut self, base: usize, mut block: usize, mut class: usize) {
        while class + 1 < CLASSES {
            let buddy = base + ((block - base) ^ class_size(class));
            if buddy + class_size(class) > base + self.used || !self.is_free(base, buddy, class) {
                break;
            }
            self.unlink(base, buddy, class);
            block = block.min(buddy);
            class += 1;
        }
        if class + 1 == CLASSES {
            // SAFETY: a free 2 MiB block of our mapping: its contents are
            // no one's, and are zero when next touched.
            unsafe { libc::madvise(block as *mut libc::c_void, class_size(class), libc::MADV_DONTNEED) };
        }
        self.give_back(base, block, class);
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
// class its layout gives, the one it was taken from. A large block outside
// the reservation is a mapping of its own (`large_blocks`), made, resized
// and unmapped with the layout it was made for (the size alone says which
// it is: a caller frees with the layout it allocated with). Everything else
// is the system allocator's, called with the same arguments.
unsafe impl GlobalAlloc for HotAwareAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match Self::hot_block(layout) {
            Some(p) => p,
            None if large_blocks::is_large(layout) => large_blocks::map(layout),
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
            // A fresh mapping is zeroed.
            None if large_blocks::is_large(layout) => large_blocks::map(layout),
            // SAFETY: the caller's contract, passed on.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if in_reservation(ptr) {
            if let Some(class) = class_of(layout) {
                with_arena(|a| a.release(ptr as usize, class));
            }
        } else if large_blocks::is_large(layout) {
            // SAFETY: a large block outside the reservation is one
            // `large_blocks::map` made for this layout.
            unsafe { large_blocks::unmap(ptr, layout) }
        } else {
            // SAFETY: the caller's contract: a block the system allocator
            // gave (the reservation's are all inside it, large ones are
            // mapped by `large_blocks`).
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let hot_now = HOT_THREAD.load(Ordering::Relaxed) == current_thread();
        if !in_reservation(ptr) && !hot_now {
            if large_blocks::can_remap(layout, new_size) {
                // SAFETY: a large block outside the reservation, mapped by
                // `large_blocks` for `layout`, whose alignment it checked.
                return unsafe { large_blocks::remap(ptr, layout, new_size) };
            }
            if !large_blocks::is_large(layout) && new_size < large_blocks::LARGE {
                // SAFETY: the caller's contract, passed on.
                return unsafe { System.realloc(ptr, layout, new_size) };
            }
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

        // Buddies merge: 64 blocks of 64 bytes freed serve a 4 KiB block;
        // two 1 MiB buddies freed make a 2 MiB block, given back to the
        // kernel (zero when touched again) and taken whole.
        let huge = CLASSES - 1;
        let keep = with_arena(|a| a.take(huge)).expect("a block");
        let small: Vec<usize> = (0..64).map(|_| with_arena(|a| a.take(0)).expect("a block")).collect();
        let first = *small.iter().min().unwrap();
        for b in small {
            with_arena(|a| a.release(b, 0));
        }
        assert_eq!(with_arena(|a| a.take(6)), Some(first), "the 64-byte blocks merged into 4 KiB");
        with_arena(|a| a.release(first, 6));
        let halves = [with_arena(|a| a.take(huge - 1)).unwrap(), with_arena(|a| a.take(huge - 1)).unwrap()];
        assert_eq!(halves[0] ^ halves[1], 1 << 20, "buddies: {halves:x?}");
        for &h in &halves {
            // SAFETY: a block of the arena, mapped read-write, ours.
            unsafe { (h as *mut u8).add(100).write(7) };
        }
        let before = with_arena(|a| a.free_huge_count);
        for h in halves {
            with_arena(|a| a.release(h, huge - 1));
        }
        assert_eq!(with_arena(|a| a.free_huge_count), before + 1);
        let whole = with_arena(|a| a.take(huge)).unwrap();
        assert_eq!(whole, halves[0].min(halves[1]));
        // SAFETY: as above.
        assert_eq!(unsafe { (whole as *const u8).add(100).read() }, 0, "given back to the kernel");
        with_arena(|a| a.release(whole, huge));
        with_arena(|a| a.release(keep, huge));
        assert_eq!(BASE.load(Ordering::Acquire), 0);
    }
}
