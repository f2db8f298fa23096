//! Stack copies in blocks shared by every thread, not in the thread's ring.
//!
//! A walk that meets code not known yet keeps a copy of the stack, to be
//! walked again once the agent has learned that code. At start-up most
//! walks meet such code, and a copy is large: a program's main thread, deep
//! in the host, the runtime and the JIT, copied 1,200 words on average and
//! up to the 4,096 allowed (measured over 40 runs of `chain.cs`). In the
//! thread's own ring (8,192 words) three or four such copies left no room
//! for the next, whose walk was then cut at the unknown code and shown as
//! `[incomplete stack]`: 2 to 10 samples a run, a few milliseconds of a
//! 3-second profile, but up to 24 ms when the agent's thread waited for a
//! core (seen in CI), which broke the 99% whole-stack test of frameless
//! chains on .NET 9.
//!
//! So a copy goes into one of [`BLOCKS`] blocks of [`BLOCK_WORDS`] words,
//! taken by whichever thread needs one and given back when the agent drains
//! the sample. The bursts come from one or two threads at a time, so a
//! pool shared by all holds far more copies for each of them than their
//! rings could, for 2 MiB, mapped when the pool is made (a page first
//! touched inside the handler was a page fault there, see [`CopyPool::create`]).
//! A thread that finds no free block copies into its ring as before.
//!
//! Async-signal-safe: taking a block is a compare-and-swap on one word
//! (bounded retries, never a wait); writing it is plain and streaming
//! stores (then a store fence) into memory allocated before sampling began
//! and freed only after every handler has left.

use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

/// Blocks in the pool: one bit each in [`USED`].
pub(super) const BLOCKS: usize = 64;
/// Words in one block. A copy deeper than one takes two adjacent blocks
/// (see [`CopyPool::take`]): [`super::STACK_COPY_WORDS`] is two blocks.
pub(super) const BLOCK_WORDS: usize = 4096;
/// Blocks one copy may take, adjacent.
pub(super) const MAX_RUN: usize = super::STACK_COPY_WORDS.div_ceil(BLOCK_WORDS);

/// The process's pool: the handler has no other way to reach it.
pub(super) static POOL: CopyPool = CopyPool::new();

pub(super) struct CopyPool {
    /// Bit `i` set: block `i` holds a copy not drained yet.
    used: AtomicU64,
    /// The blocks, `BLOCKS * BLOCK_WORDS` words; null while no sampler is
    /// installed.
    words: AtomicPtr<AtomicU64>,
}

fn layout() -> std::alloc::Layout {
    // Lines of their own: a copy is written with 16-byte streaming stores.
    std::alloc::Layout::array::<AtomicU64>(BLOCKS * BLOCK_WORDS)
        .and_then(|l| l.align_to(64))
        .expect("a fixed, small layout")
}

/// A block taken for one copy: one of the pool's, or a run of adjacent
/// ones (`words` spans them all).
pub(super) struct Block {
    pub(super) index: usize,
    words: &'static [AtomicU64],
}

/// How many blocks a copy of `words` words takes.
pub(super) fn blocks_for(words: usize) -> usize {
    words.div_ceil(BLOCK_WORDS).clamp(1, MAX_RUN)
}

impl Block {
    /// The words this block (or run of blocks) holds.
    pub(super) fn capacity(&self) -> usize {
        self.words.len()
    }

    /// Stores word `i` of the copy.
    pub(super) fn store(&self, i: usize, word: u64) {
        if let Some(w) = self.words.get(i) {
            w.store(word, Ordering::Relaxed);
        }
    }

    /// Copies `stack` (the interrupted thread's own, from its stack
    /// pointer up) into the block's first words, at most the block's
    /// length, and returns how many it copied: 16 bytes at a time, with
    /// streaming stores, then a store fence.
    ///
    /// A block is cold when it is taken (64 of them, 2 MiB, in turn), and
    /// an ordinary store to a cold line first reads the line in; streaming
    /// stores write whole lines without reading them. The copy was stored
    /// word by word before, each word checked against the stack's bounds
    /// and compared with the hijack trampoline on the way: on taskfaults.cs
    /// (.NET 10, 3 s runs at 100 Hz, three alternating pairs, the copy
    /// alone timed in the handler) 7.5 to 8.4 µs a copy (2.9 to 4.3 ns a
    /// word, copies of 1,700 words on average), against 3.3 to 4.6 µs
    /// (1.4 to 2.3 ns a word) this way. Loads, streaming stores and
    /// `sfence` are instructions: no call, nothing that can block.
    ///
    /// # Safety
    /// `stack` must be mapped and readable, and hold still while it is
    /// copied (the calling thread's own stack, above its signal frame).
    pub(super) unsafe fn copy_from(&self, stack: std::ops::Range<u64>) -> usize {
        let n = (((stack.end.saturating_sub(stack.start)) / 8) as usize).min(self.words.len());
        let (src, dst) = (stack.start as *const u8, self.words.as_ptr() as *mut u8);
        let pairs = n / 2;
        // SAFETY: the source as the caller promised (read unaligned); the
        // destination is this block's first `n` words, 64-byte aligned
        // (see `layout`, and a block is a multiple of 64 bytes), which no
        // other thread reads or writes while the block is taken (the agent
        // reads it after the record naming it is published with release,
        // and the ring's acquire; the fence below orders the streaming
        // stores before that release). AtomicU64 has u64's size and
        // alignment. SSE2 is part of x86-64.
        unsafe {
            use std::arch::x86_64::{_mm_loadu_si128, _mm_sfence, _mm_stream_si128};
            for i in 0..pairs {
                let v = _mm_loadu_si128(src.add(16 * i) as *const _);
                _mm_stream_si128(dst.add(16 * i) as *mut _, v);
            }
            if n % 2 == 1 {
                std::ptr::copy_nonoverlapping(src.add(16 * pairs), dst.add(16 * pairs), 8);
            }
            _mm_sfence();
        }
        n
    }

    /// Whether one of the copy's first `n` words is `value`. Plain loads of
    /// memory only this thread writes while the block is taken, eight words
    /// at a time, so that the compiler can compare them together.
    pub(super) fn contains(&self, n: usize, value: u64) -> bool {
        let n = n.min(self.words.len());
        // SAFETY: the block's first `n` words, written by this thread (see
        // `copy_from`); nothing writes them while this slice lives.
        let words = unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u64, n) };
        words.chunks(8).any(|chunk| chunk.iter().fold(false, |any, &w| any | (w == value)))
    }
}

/// The bits of `used` that blocks `index..index + run` stand for.
fn run_bits(index: usize, run: usize) -> u64 {
    (u64::MAX >> (64 - run)) << index
}

impl CopyPool {
    pub(super) const fn new() -> CopyPool {
        CopyPool { used: AtomicU64::new(0), words: AtomicPtr::new(std::ptr::null_mut()) }
    }

    /// Allocates the blocks, and has their pages mapped at once (2 MiB of
    /// the process's memory): zeroed by the allocator, they were mapped
    /// when a copy first landed in them, a page fault inside the handler
    /// for each new page, and at start-up, when most copies are made, the
    /// handler took 55 µs or more for a quarter of its copies (measured
    /// on `taskfaults.cs`, .NET 10). Called when the sampler is installed,
    /// before any handler runs.
    pub(super) fn create(&self) {
        if !self.words.load(Ordering::SeqCst).is_null() {
            return;
        }
        // SAFETY: a non-zero size; AtomicU64's all-zero bit pattern is 0.
        let p = unsafe { std::alloc::alloc_zeroed(layout()) } as *mut AtomicU64;
        crate::process::populate(p as usize, layout().size());
        self.used.store(0, Ordering::SeqCst);
        self.words.store(p, Ordering::SeqCst);
    }

    /// Frees the blocks. Called only when no handler runs or can run any
    /// more, and every slot (with the copies its ring still names) is gone.
    pub(super) fn destroy(&self) {
        let p = self.words.swap(std::ptr::null_mut(), Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: allocated in `create` with the same layout; no reader
            // is left (see above).
            unsafe { std::alloc::dealloc(p as *mut u8, layout()) };
        }
        self.used.store(0, Ordering::SeqCst);
    }

    /// Takes free blocks for a copy of `words` words: as many adjacent ones
    /// as it needs ([`blocks_for`]), else a single one, which holds the
    /// copy's first [`BLOCK_WORDS`] words; `None` if no block is free.
    /// From the signal handler: one load and at most four
    /// compare-and-swaps.
    ///
    /// Two blocks for a deep stack: at start-up most copies are of stacks
    /// deep in the host, the runtime and the JIT, and on taskfaults.cs
    /// (.NET 10) 17 of 22 copies in three runs reached the one block's
    /// 4,096 words; a walk of a copy that stops short of the frame where
    /// the handler's walk was known again ends there, an incomplete stack.
    pub(super) fn take(&self, words: usize) -> Option<Block> {
        let pool = self.words.load(Ordering::Acquire);
        if pool.is_null() {
            return None;
        }
        let wanted = blocks_for(words);
        let mut used = self.used.load(Ordering::Relaxed);
        for _ in 0..4 {
            let free = !used;
            // Bit i of `starts`: blocks i..i + run are all free.
            let mut run = wanted;
            let mut starts = (1..wanted).fold(free, |s, k| s & (free >> k));
            if starts == 0 {
                run = 1;
                starts = free;
            }
            if starts == 0 {
                return None;
            }
            let index = starts.trailing_zeros() as usize;
            let bits = run_bits(index, run);
            match self.used.compare_exchange_weak(used, used | bits, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Some(Block { index, words: block_words(pool, index, run) }),
                Err(now) => used = now,
            }
        }
        None
    }

    /// Appends the first `len` words of block `index` to `out` and gives
    /// the block back. The agent's thread, draining a record that names it.
    /// (A copy of `len` words holds the blocks [`blocks_for`] gives: it was
    /// cut to one block's words when no run was free.)
    pub(super) fn read_and_release(&self, index: usize, len: usize, out: &mut Vec<u64>) {
        let pool = self.words.load(Ordering::Acquire);
        let run = blocks_for(len);
        if index + run <= BLOCKS && !pool.is_null() {
            let words = block_words(pool, index, run);
            out.extend(words.iter().take(len).map(|w| w.load(Ordering::Relaxed)));
        }
        self.release(index, len);
    }

    /// Gives back the blocks from `index` that a copy of `len` words holds,
    /// without reading them (a record never drained, or one that did not
    /// fit in its ring after the blocks were taken).
    pub(super) fn release(&self, index: usize, len: usize) {
        let run = blocks_for(len);
        if index + run <= BLOCKS {
            self.used.fetch_and(!run_bits(index, run), Ordering::Release);
        }
    }

    /// Blocks now holding copies.
    #[cfg(test)]
    pub(super) fn in_use(&self) -> u32 {
        self.used.load(Ordering::Relaxed).count_ones()
    }
}

/// The words of `run` blocks from block `index`.
fn block_words(pool: *mut AtomicU64, index: usize, run: usize) -> &'static [AtomicU64] {
    let run = run.min(BLOCKS.saturating_sub(index));
    // SAFETY: blocks `index..index + run` lie inside the allocation (the
    // run is cut to its end), which lives until `destroy`, called only once
    // nothing can hold a block (see there).
    unsafe { std::slice::from_raw_parts(pool.add(index * BLOCK_WORDS), run * BLOCK_WORDS) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_once_each_and_come_back() {
        let pool = CopyPool::new();
        pool.create();
        let taken: Vec<Block> = (0..BLOCKS).filter_map(|_| pool.take(100)).collect();
        assert_eq!(taken.len(), BLOCKS);
        assert!(pool.take(100).is_none(), "a 65th block");
        taken[3].store(0, 42);
        taken[3].store(BLOCK_WORDS, 7); // past the end: ignored
        let stack: Vec<u64> = (100..120).collect();
        let range = stack.as_ptr() as u64..stack.as_ptr() as u64 + 8 * 20;
        // SAFETY: a live vector's words.
        assert_eq!(unsafe { taken[5].copy_from(range) }, 20);
        assert!(taken[5].contains(20, 117));
        assert!(taken[5].contains(20, 103));
        assert!(!taken[5].contains(17, 117));
        let mut copied = Vec::new();
        pool.read_and_release(taken[5].index, 20, &mut copied);
        assert_eq!(copied, stack);
        let mut out = Vec::new();
        pool.read_and_release(taken[3].index, 1, &mut out);
        assert_eq!(out, [42]);
        // Blocks 3 and 5 are free, not adjacent: a deep copy gets one.
        let single = pool.take(BLOCK_WORDS + 1).expect("a block given back");
        assert_eq!((single.index, single.words.len()), (3, BLOCK_WORDS));
        for b in taken.iter().chain([&single]) {
            pool.release(b.index, 1);
        }
        assert_eq!(pool.in_use(), 0);
        pool.destroy();
        assert!(pool.take(1).is_none(), "no pool");
    }

    #[test]
    fn a_deep_copy_takes_two_adjacent_blocks_and_gives_both_back() {
        let pool = CopyPool::new();
        pool.create();
        let deep = BLOCK_WORDS + 10;
        let first = pool.take(1).expect("block 0");
        let run = pool.take(deep).expect("blocks 1 and 2");
        assert_eq!((run.index, run.words.len()), (1, 2 * BLOCK_WORDS));
        assert_eq!(pool.in_use(), 3);
        let stack: Vec<u64> = (0..deep as u64).collect();
        let range = stack.as_ptr() as u64..stack.as_ptr() as u64 + 8 * deep as u64;
        // SAFETY: a live vector's words.
        assert_eq!(unsafe { run.copy_from(range) }, deep);
        assert!(run.contains(deep, BLOCK_WORDS as u64 + 3));
        assert!(!run.contains(BLOCK_WORDS + 3, BLOCK_WORDS as u64 + 3));
        let mut copied = Vec::new();
        pool.read_and_release(run.index, deep, &mut copied);
        assert_eq!(copied, stack);
        assert_eq!(pool.in_use(), 1, "both blocks of the run are back");
        pool.release(first.index, 1);
        // The last block has no neighbour above it: a run never spans past
        // the pool's end.
        let all: Vec<Block> = (0..BLOCKS - 1).filter_map(|_| pool.take(1)).collect();
        let last = pool.take(deep).expect("the last block alone");
        assert_eq!((last.index, last.words.len()), (BLOCKS - 1, BLOCK_WORDS));
        for b in all.iter().chain([&last]) {
            pool.release(b.index, 1);
        }
        assert_eq!(pool.in_use(), 0);
        pool.destroy();
    }
}
