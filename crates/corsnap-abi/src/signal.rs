//! The signal sampler's unsafe core: per-thread CPU timers, the `SIGPROF`
//! handler that walks the interrupted thread's stack, the buffers it writes
//! to, and the trampoline that lets the agent's library be unloaded safely.
//!
//! # What runs in the handler, and why each step is async-signal-safe
//!
//! The handler ([`on_signal`]) runs on whatever thread the kernel interrupted,
//! which may hold any lock of libc, the loader or the runtime. It therefore
//! calls nothing that takes a lock or allocates, and touches only memory that
//! was set up before the signal could arrive:
//!
//! 1. `errno` is saved first and restored last (the interrupted code may be
//!    about to read it).
//! 2. The kernel's `siginfo_t` is read for `si_code` (only `SI_TIMER`
//!    signals are ours; anything else is counted and ignored), the slot index
//!    our timer put in `si_value`, and `si_overrun`.
//! 3. The slot is found in [`SLOTS`] (a static array of atomic pointers) and
//!    checked to belong to this thread: the first time by `gettid` (a plain
//!    system call), which then leaves the thread's `pthread_self` in the
//!    slot; after that by `pthread_self` alone, which in glibc reads the
//!    thread pointer (`%fs`) and takes no lock (0.2 to 0.3 µs less a
//!    sample here than the system call). Then the sample's weight: a perf
//!    event's period (one store marks its records read; every 16th sample
//!    an `ioctl` sets a new period), or a periodic timer's period times
//!    1 + `si_overrun` (every 16th sample `clock_gettime` of the thread's
//!    CPU clock and `timer_settime` with a new period, both on POSIX's
//!    async-signal-safe list; see [`TimerState`]). A timer signal that
//!    arrives while sampling is off, or after the timer stopped being the
//!    thread's clock, disarms it (`timer_settime`).
//! 4. The code map is loaded from [`MAP`] (an atomic pointer). The trampoline
//!    counted us in before calling the handler, and the agent frees a
//!    replaced map only after seeing that count at zero, so the map stays
//!    alive until we return.
//! 5. The interrupted registers come from the kernel's `ucontext_t`.
//! 6. The stack is bounded by the mapping containing the interrupted stack
//!    pointer, taken from the map (a sorted array, binary search), or the
//!    one the thread's last sample found in the same map, if it holds it.
//! 7. `corsnap_unwind::walk` is safe Rust that never allocates (framehop with
//!    `MustNotAllocateDuringUnwind`, pe-unwind-info is `no_std`); it reads
//!    memory only through [`LiveMemory`], which allows that stack range and
//!    the code regions of the map, and nothing else; and, when a managed
//!    frame returns into native code, 16 bytes of the runtime's object for
//!    this thread, read with `process_vm_readv` (a system call, so an
//!    address no longer mapped is an error, never a fault) into the
//!    handler's stack, to undo a return-address hijack ([`hijacked_return`]).
//! 8. `clock_gettime(CLOCK_MONOTONIC)` is on POSIX's async-signal-safe list
//!    (and served by the vDSO).
//! 9. The frames go into the slot's single-producer ring with relaxed stores
//!    and one release store; a full ring drops the sample and counts it. A
//!    stack copy goes into a block of the shared pool, taken with a bounded
//!    compare-and-swap and written with relaxed stores ([`copy_pool`]).
//!    Before a copy (only then), the same 16 bytes of the thread object are
//!    read once more, the same way, to put back a hijack the walk did not
//!    meet ([`LiveMemory::hijack_in_stack`]).
//!    A stretch of code the walk learned at its leaf, and the return
//!    addresses it looked up in full, go into the slot's mailboxes for the
//!    agent the same way (relaxed stores, one release store; a full mailbox
//!    drops them): the handler writes nothing that other threads' handlers
//!    read ([`LearnedMailbox`]). The slot's counters are on its own lines,
//!    which only the agent reads: samples, a relaxed atomic add; what the
//!    walk found where (`walk_counts`), which no other thread writes, a
//!    relaxed load and store.
//!
//! The slot's walk cache and scratch buffer are touched only by the handler
//! on the slot's own thread, and a handler never interrupts itself: `SIGPROF`
//! stays blocked while its handler runs (no `SA_NODEFER`).
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

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corsnap_unwind::{CodeMap, ManagedCode, Memory, Regs, WalkCache};

mod copy_pool;
use copy_pool::POOL;

/// The signal the timers raise. The runtime owns `SIGRTMIN` and several
/// others; `SIGPROF` is free in CoreCLR and is what profilers use.
pub const SAMPLE_SIGNAL: c_int = libc::SIGPROF;
/// Frames kept per sample; deeper stacks keep their leaf end.
pub const MAX_FRAMES: usize = 1024;
/// Each thread's ring holds this many 8-byte words (64 KiB): tens of
/// samples between two drains.
pub const RING_WORDS: usize = 8192;
/// Threads that can be sampled at once.
pub const MAX_SLOTS: usize = 16384;
/// A record in a ring: header, weight, time, time in the handler, words of
/// stack copy, then the frames, then the copy (if any).
const RECORD_HEAD: usize = 5;
/// When a walk met code the map does not know yet, the handler also keeps
/// up to this many words of the stack (and the registers), so the agent can
/// walk the sample again once it has learned that code.
const STACK_COPY_WORDS: usize = 4096;
/// Words copied past a splice frame's stack pointer.
const SPLICE_SLACK_WORDS: usize = 16;

/// `si_code` of a signal raised by a POSIX timer.
const SI_TIMER: c_int = -2;
/// `si_code`s of a signal raised by a perf event's overflow (`F_SETSIG`):
/// `POLL_HUP` when its refresh count ran out, `POLL_IN` otherwise.
const POLL_IN: c_int = 1;
const POLL_HUP: c_int = 6;
/// `si_code` of a signal queued with `rt_tgsigqueueinfo`: corsnap's own
/// request for one sample now (walk verification), when from our own pid.
const SI_QUEUE: c_int = -1;
/// `si_pid` for queued signals (`_sifields._rt`).
const SI_PID_OFFSET: usize = 16;
/// Record flag: a sample taken on request ([`SignalSampler::request_sample`]),
/// not by the clock; it carries no weight.
pub const REQUESTED: u32 = 1 << 16;

/// Perf event fds up to this number can be mapped to slots in the handler.
const MAX_PERF_FD: usize = 65536;

// siginfo_t for timer signals (kernel `__sifields._timer`): si_code at 8,
// si_overrun at 20, si_value at 24; 128 bytes in all.
const _: () = assert!(std::mem::size_of::<libc::siginfo_t>() == 128);
const SI_CODE_OFFSET: usize = 8;
const SI_OVERRUN_OFFSET: usize = 20;
const SI_VALUE_OFFSET: usize = 24;
// For SIGPOLL-style signals (`__sifields._sigpoll`): si_band (a long) at 16,
// si_fd at 24.
const SI_FD_OFFSET: usize = 24;

/// The slots of the threads being sampled, indexed by the value each
/// thread's timer carries.
static SLOTS: [AtomicPtr<ThreadSlot>; MAX_SLOTS] = [const { AtomicPtr::new(null_mut()) }; MAX_SLOTS];
/// Slot index + 1 of the thread whose perf event has each fd (0: none).
static PERF_FDS: [std::sync::atomic::AtomicU32; MAX_PERF_FD] =
    [const { std::sync::atomic::AtomicU32::new(0) }; MAX_PERF_FD];
/// The code map walks read; replaced whole, freed only when no handler runs.
static MAP: AtomicPtr<CodeMap> = AtomicPtr::new(null_mut());
/// Samples are taken only while this is set.
static ENABLED: AtomicBool = AtomicBool::new(false);
/// Counters for signals that could not become samples.
static NOT_READY: AtomicU64 = AtomicU64::new(0);
/// Where the runtime's thread object keeps a hijacked return address: the
/// byte offset of `Thread::m_pvHJRetAddr`, which `m_ppvHJRetAddrPtr` (the
/// stack slot it came from) follows. 0 while unknown.
static HIJACK_FIELDS: AtomicU64 = AtomicU64::new(0);
/// The runtime's hijack trampoline, once a hijack has been seen, for maps
/// that did not find it in libcoreclr (a return address never equal to it
/// is never a hijacked one). 0 while unknown.
static HIJACK_TRAMPOLINE: AtomicU64 = AtomicU64::new(0);
/// Native return addresses of managed frames already found not to be the
/// trampoline, so the thread object is read once per address, not once per
/// sample. Filled first come, first kept; 0 is an empty entry.
static NOT_HIJACKS: [AtomicU64; 64] = [const { AtomicU64::new(0) }; 64];
static HIJACKS_UNDONE: AtomicU64 = AtomicU64::new(0);
static FOREIGN: AtomicU64 = AtomicU64::new(0);
static NO_SLOT: AtomicU64 = AtomicU64::new(0);
static PANICKED: AtomicU64 = AtomicU64::new(0);

/// One sampled thread: its walk scratch (used only by the handler on that
/// thread) and the ring the agent drains.
///
/// In declaration order (`repr(C)`): what the handler reads at every sample
/// comes first, then [`Walking`], whose own first fields are the handler's
/// too, so that they share two or three adjacent cache lines. At 100 Hz each
/// line the handler touches is a miss of its own.
#[repr(C)]
pub struct ThreadSlot {
    tid: u32,
    /// The thread's `pthread_self`, once its handler has checked `tid` with
    /// `gettid` (0 before): the cheaper check from then on.
    owner: AtomicUsize,
    /// The perf event that samples this thread, or -1 (a POSIX timer
    /// does). Changed only by the agent ([`Sampler::set_thread_clock`]),
    /// which closes a replaced event once no handler can be using it.
    perf_fd: AtomicI32,
    /// Its ring buffer's control page (0 without one): the handler marks
    /// each overflow record read, so the event never stops for a full
    /// buffer and needs no system call to go on.
    perf_page: AtomicUsize,
    /// The period the perf event is running now (the weight of its next
    /// sample). Set by the handler as it changes it, read by the agent
    /// when it starts a new event for the thread.
    perf_period_ns: AtomicU64,
    /// The mean CPU time between samples, in nanoseconds.
    interval_ns: AtomicU64,
    /// The POSIX timer that samples this thread (-1: none yet, or a perf
    /// event does). Periodic: the handler draws a new random period every
    /// [`PERIOD_CHANGE_EVERY`] samples (see [`TimerState`]).
    timer_id: std::sync::atomic::AtomicI32,
    /// Which clock samples the thread now: [`CLOCK_PERF`] or
    /// [`CLOCK_TIMER`]. A thread with a perf event may be moved to a timer
    /// and back ([`Sampler::set_thread_clock`]); the handler re-arms the
    /// timer only while it is the clock.
    clock: AtomicU8,
    /// The thread's CPU time when the agent last armed the timer (at the
    /// start, when the timer became the clock, when sampling resumed): the
    /// first sample after weighs exactly the CPU time since.
    timer_base_ns: AtomicU64,
    /// How many times the agent has armed the timer: stored after
    /// `timer_base_ns`, so a handler that sees a new count reads the base
    /// that came with it.
    timer_arms: AtomicU64,
    /// The runtime's object for this thread (its `ThreadID`), 0 if none is
    /// known: where a hijacked return address is kept.
    runtime_thread: AtomicU64,
    /// Leaf stretches the handler's walks learned, for the agent to keep
    /// in the map's leaf table, which every thread's walks read.
    learned: LearnedMailbox<4, LEARNED_STRETCHES>,
    /// Return addresses the handler's walks looked up in full, for the
    /// agent to keep in the map's table of them, which every thread's walks
    /// read.
    learned_addresses: LearnedMailbox<3, LEARNED_ADDRESSES>,
    /// Samples written.
    pub samples: AtomicU64,
    /// Of the walks, how many took their leaf's step from a kept stretch;
    /// and the return addresses they looked up in full, and those they took
    /// from the process's table (see [`corsnap_unwind::Walk`]): what the
    /// handler's cost follows.
    pub walk_counts: [AtomicU64; 3],
    walking: UnsafeCell<Walking>,
    /// Of those, samples taken on request ([`Sampler::request_sample`]):
    /// what a request waits on, since a timer's sample may land meanwhile.
    pub requested_samples: AtomicU64,
    /// Samples dropped because the ring was full.
    pub dropped_full: AtomicU64,
    /// Signals whose stack pointer was in no known stack mapping.
    pub unknown_stack: AtomicU64,
    ring: Ring,
}

/// The handler's own state for one thread; the fields it uses at every
/// sample first (see [`ThreadSlot`]).
#[repr(C)]
struct Walking {
    /// The state of the generator that dithers the sampling periods.
    rng: u64,
    samples: u64,
    timer: TimerState,
    /// The thread's stack mapping as the map of generation
    /// `stack_generation` lists it: found again without a search of the
    /// map's list while the map is the same (0: none yet).
    stack_generation: u64,
    stack: std::ops::Range<u64>,
    frames: [u64; MAX_FRAMES],
    cache: WalkCache,
}

/// What a thread's walks learned (leaf stretches,
/// [`corsnap_unwind::LearnedStretch`]; return addresses,
/// [`corsnap_unwind::WalkCache::take_learned_addresses`]), as records of `W`
/// words on their way from its handler to the agent, which keeps them in
/// the map's tables for every thread: the tables' writes are locked
/// instructions on lines other cores read, which the handler is spared.
/// One producer (the handler, on the slot's thread) and one consumer (the
/// agent), `N` records; a full mailbox drops the record (a later sample
/// learns it again).
struct LearnedMailbox<const W: usize, const N: usize> {
    /// Records put in, and taken out, since the slot was made.
    head: AtomicU64,
    tail: AtomicU64,
    words: [[AtomicU64; W]; N],
}

impl<const W: usize, const N: usize> Default for LearnedMailbox<W, N> {
    fn default() -> Self {
        LearnedMailbox {
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            words: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
        }
    }
}

/// Stretches a mailbox holds between two drains.
const LEARNED_STRETCHES: usize = 8;
/// Return addresses a mailbox holds between two drains: a walk hands on up
/// to [`corsnap_unwind::LEARNED_ADDRESSES`], and a thread new to the code
/// may walk twice between two drains.
const LEARNED_ADDRESSES: usize = 16;

impl<const W: usize, const N: usize> LearnedMailbox<W, N> {
    /// In the handler: relaxed stores and one release store.
    fn push(&self, words: [u64; W]) {
        let head = self.head.load(Ordering::Relaxed);
        if head - self.tail.load(Ordering::Acquire) >= N as u64 {
            return;
        }
        for (cell, word) in self.words[head as usize % N].iter().zip(words) {
            cell.store(word, Ordering::Relaxed);
        }
        self.head.store(head + 1, Ordering::Release);
    }

    /// On the agent's thread: every record put in since the last take.
    fn take(&self, mut f: impl FnMut([u64; W])) {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        for at in tail..head {
            f(self.words[at as usize % N].each_ref().map(|w| w.load(Ordering::Relaxed)));
        }
        self.tail.store(head, Ordering::Release);
    }
}

/// The handler's view of the thread's periodic CPU timer.
///
/// A timer sample used to read the thread's CPU clock (its weight: the CPU
/// time since the last) and re-arm a one-shot timer with a new random
/// delay: two system calls (0.7 and 1.7 µs apiece in a loop here). With
/// `--cpu-clock timer` on pool.cs the handler spent 4.0 to 4.2 µs before its
/// walk at the median, 0.9 to 1.0 µs without them. Now the timer is periodic: the
/// kernel re-arms it from its last expiry, not from when the handler ran
/// (CPU timers fire on the scheduler tick after they expire), so a sample
/// weighs exactly its period times 1 + `si_overrun`, and needs no system
/// call. Every [`PERIOD_CHANGE_EVERY`] samples, or when the agent has
/// armed the timer itself or changed the interval, the handler reads the
/// clock, weighs the CPU time since the expiry it last counted to, and
/// re-arms with a new random period, so that a program whose work repeats
/// at the period is not always seen at the same point of it. The weights
/// add up to the thread's CPU time as before.
#[derive(Debug, Clone, Copy, Default)]
struct TimerState {
    /// `ThreadSlot::timer_arms` when the handler last re-armed the timer.
    arms_seen: u64,
    /// The period the handler armed (0: it has not, or that failed).
    period_ns: u64,
    /// The interval that period was drawn for.
    interval_ns: u64,
    /// The thread's CPU time at the expiry of its last sample, as the
    /// kernel schedules expiries (last read clock, plus the periods since).
    base_ns: u64,
    /// Samples since the period last changed.
    samples: u64,
}

/// [`ThreadSlot::clock`]: a perf event samples the thread.
const CLOCK_PERF: u8 = 0;
/// [`ThreadSlot::clock`]: a POSIX CPU timer samples the thread.
const CLOCK_TIMER: u8 = 1;

/// Samples between changes of a perf event's or a timer's period.
const PERIOD_CHANGE_EVERY: u64 = 16;

/// A period drawn uniformly from 0.75 to 1.25 times the interval (xorshift).
fn dithered_period(rng: &mut u64, interval_ns: u64) -> u64 {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    let interval = interval_ns.max(20_000);
    interval - interval / 4 + *rng % (interval / 2)
}

impl ThreadSlot {
    /// Before the agent arms the thread's timer itself: the handler's next
    /// timer sample weighs the CPU time from now, and re-arms the timer
    /// with a period of its own.
    fn timer_rebased(&self) {
        self.timer_base_ns.store(crate::thread_cpu_time_ns(self.tid).unwrap_or(0), Ordering::Relaxed);
        self.timer_arms.fetch_add(1, Ordering::Release);
    }

    /// Disarms the thread's timer from its handler, when sampling is off or
    /// the timer is not the clock: else it would go on signalling. But the
    /// agent may have just armed it (it turns sampling on, or makes the
    /// timer the clock, then arms it): if both hold once it is disarmed, it
    /// is armed again, once, one interval ahead. Async-signal-safe: one or
    /// two `timer_settime`.
    fn stop_timer(&self) {
        let timer = self.timer_id.load(Ordering::Relaxed);
        let _ = arm_timer(timer, 0, 0);
        if self.clock.load(Ordering::SeqCst) == CLOCK_TIMER && ENABLED.load(Ordering::SeqCst) {
            let _ = arm_timer_once(timer, self.interval_ns.load(Ordering::Relaxed));
        }
    }
}

// SAFETY: `walking` is only touched by the signal handler running on thread
// `tid` (checked with gettid before use, or by `owner`, the pthread_self of
// the thread that passed that check: a thread's pthread_t is reused only
// after it exits, and no signal for this slot reaches another thread: its
// timer and perf event target `tid`), which cannot run twice at once on one
// thread; everything else is atomic.
unsafe impl Sync for ThreadSlot {}
// SAFETY: as above; the slot holds no thread-bound resources.
unsafe impl Send for ThreadSlot {}

impl Drop for ThreadSlot {
    fn drop(&mut self) {
        // Freed only when no handler can touch the slot any more.
        unmap_perf_ring(*self.perf_page.get_mut());
        // Copies its ring still names go back to the pool.
        let ring = &self.ring;
        let (mut t, h) = (ring.tail.load(Ordering::Acquire), ring.head.load(Ordering::Acquire));
        while t < h {
            let record = ring.record_at(t);
            if let Some((block, _)) = record.pooled {
                POOL.release(block);
            }
            t += record.words();
        }
    }
}

impl std::fmt::Debug for ThreadSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadSlot(tid {})", self.tid)
    }
}

/// A single-producer, single-consumer ring of words. The producer is the
/// signal handler on one thread; the consumer is the agent's thread.
struct Ring {
    words: Box<[AtomicU64]>,
    /// Words ever written (producer); published with release.
    head: AtomicUsize,
    /// Words ever consumed (consumer).
    tail: AtomicUsize,
}

impl Ring {
    fn new() -> Ring {
        Ring {
            words: (0..RING_WORDS).map(|_| AtomicU64::new(0)).collect(),
            head: AtomicUsize::new(0),
            tail: AtomicUsize::new(0),
        }
    }

    /// Appends one record, or returns false if it does not fit. With
    /// `copy`, the registers and `copy.1` words of stack from `regs.sp` go
    /// after the frames, if there is room for them (else they are left out).
    /// `copy`: see [`StackToCopy`].
    fn push(&self, mut head: [u64; RECORD_HEAD], frames: &[u64], copy: Option<StackToCopy<'_>>) -> bool {
        let h = self.head.load(Ordering::Relaxed);
        let t = self.tail.load(Ordering::Acquire);
        let free = RING_WORDS - (h - t);
        let base = RECORD_HEAD + frames.len();
        if free < base {
            return false;
        }
        // The copy's words go into a block of the shared pool when one is
        // free (see `copy_pool`): the whole walk's depth, whatever the ring
        // holds. Only its head (registers, splice) goes into the ring.
        let pooled = match &copy {
            Some(_) if free >= base + COPY_HEAD => POOL.take(),
            _ => None,
        };
        // Else, into the ring. A walk through unknown code is kept whole
        // only with the copy that lets it be walked again: its callers
        // beyond that code were guessed. Without room for the copy, the
        // sample keeps the frames up to the unknown one and is marked lost
        // (shown as an incomplete stack). The deep copy when it fits with
        // room to spare for the samples that follow before the next drain,
        // else the one to the splice.
        let copy = copy.map(|mut c| {
            if pooled.is_none() && free < base + COPY_HEAD + c.words + RING_WORDS / 4 {
                c.words = c.words.min(c.min_words);
            }
            c
        });
        // (A pooled copy always fits: its head was checked before the block
        // was taken.)
        let (frames, copy) = match copy {
            Some(c) if pooled.is_none() && free < base + COPY_HEAD + c.words => {
                let keep = c.known_frames.min(frames.len());
                let flags = (head[0] >> 32) as u32 | corsnap_unwind::flags::LOST;
                head[0] = keep as u64 | u64::from(flags) << 32;
                (&frames[..keep], None)
            }
            c => (frames, c),
        };
        let base = RECORD_HEAD + frames.len();
        // Word 4: the words after the frames in the ring (low 32 bits); with
        // a pooled copy, also its length (bits 32..48) and block + 1 (48..).
        head[4] = match (&copy, &pooled) {
            (Some(c), Some(b)) => COPY_HEAD as u64 | (c.words as u64) << 32 | (b.index as u64 + 1) << 48,
            (Some(c), None) => (COPY_HEAD + c.words) as u64,
            (None, _) => 0,
        };
        for (i, &w) in head.iter().chain(frames).enumerate() {
            self.words[(h + i) % RING_WORDS].store(w, Ordering::Relaxed);
        }
        let mut n = base;
        if let Some(c) = copy {
            let (splice_index, splice_sp) = c.splice.map_or((u64::MAX, 0), |(i, sp)| (i as u64, sp));
            for w in [c.regs.ip, c.regs.sp, c.regs.bp, splice_index, splice_sp] {
                self.words[(h + n) % RING_WORDS].store(w, Ordering::Relaxed);
                n += 1;
            }
            for i in 0..c.words {
                let address = c.regs.sp + 8 * i as u64;
                let w = match c.undone_hijack {
                    Some((slot, original)) if slot == address => original,
                    _ => c.memory.stack_word(address).unwrap_or(0),
                };
                match &pooled {
                    Some(b) => b.store(i, w),
                    None => {
                        self.words[(h + n) % RING_WORDS].store(w, Ordering::Relaxed);
                        n += 1;
                    }
                }
            }
        }
        self.head.store(h + n, Ordering::Release);
        true
    }
}

/// What a sample that met unknown code keeps of its stack.
struct StackToCopy<'a> {
    regs: Regs,
    /// Stack words to copy, from `regs.sp` up: as deep as the walk went.
    words: usize,
    /// Enough words to reach a little past the splice frame: what is copied
    /// when the ring is short of room for `words`.
    min_words: usize,
    memory: &'a LiveMemory<'a>,
    /// A hijacked return address to put back in the copy: (slot, original).
    undone_hijack: Option<(u64, u64)>,
    /// See `corsnap_unwind::Walk::known_frames`.
    known_frames: usize,
    /// See `corsnap_unwind::Walk::splice`: (index, stack pointer).
    splice: Option<(usize, u64)>,
}

/// Words before the copied stack: the registers, then the splice frame's
/// index (`u64::MAX` for none) and stack pointer.
const COPY_HEAD: usize = 5;

/// What a record's header and word 4 say of its extent (see [`Ring::push`]).
struct RecordExtent {
    frames: usize,
    /// Words after the frames in the ring: the copy's head, and its words
    /// when they are not pooled.
    copied: usize,
    /// The pooled copy: (block, words).
    pooled: Option<(usize, usize)>,
}

impl RecordExtent {
    /// The record's words in the ring.
    fn words(&self) -> usize {
        RECORD_HEAD + self.frames + self.copied
    }
}

impl Ring {
    /// The extent of the record that starts at word `t`.
    fn record_at(&self, t: usize) -> RecordExtent {
        let word = |i: usize| self.words[(t + i) % RING_WORDS].load(Ordering::Relaxed);
        let (header, copy) = (word(0), word(4));
        let block = (copy >> 48) as usize;
        RecordExtent {
            frames: (header & 0xffff_ffff) as usize,
            copied: (copy & 0xffff_ffff) as usize,
            pooled: (block > 0).then(|| (block - 1, ((copy >> 32) & 0xffff) as usize)),
        }
    }
}

/// One sample as the agent drains it.
#[derive(Debug, Clone, Copy)]
pub struct RawSample<'a> {
    /// CPU nanoseconds this sample stands for (the perf period that ran
    /// out, or the timer's interval times 1 + its overrun).
    pub weight_ns: u64,
    /// `CLOCK_MONOTONIC` nanoseconds when it was taken.
    pub time_ns: u64,
    /// `corsnap_unwind::flags`.
    pub flags: u32,
    /// Nanoseconds from entering the handler to storing the sample.
    pub handler_ns: u64,
    /// Leaf first; see `corsnap_unwind::EXACT_IP`.
    pub frames: &'a [u64],
    /// The stack as it was, when the walk met code not known yet.
    pub stack: Option<StackCopy<'a>>,
}

/// A copy of the top of a sampled thread's stack, with its registers.
#[derive(Debug, Clone, Copy)]
pub struct StackCopy<'a> {
    pub regs: Regs,
    /// The words from `regs.sp` up.
    pub words: &'a [u64],
    /// The frame after the last one in unknown code when the sample was
    /// taken: its index among the sample's frames and its stack pointer.
    /// The copy reaches a little past it, no further: a walk that gets
    /// there again takes the sample's frames from it on as they are.
    pub splice: Option<(usize, u64)>,
}

/// Walks a sample again from its stack copy, with `map` (which may know more
/// code now than when the sample was taken). Code bytes are read live, as in
/// the handler: only inside managed regions of `map`, which are mapped.
/// `original` is the sample's walk (its frames and flags): when the copy
/// names a splice frame and the new walk reaches it, the original's frames
/// from there on complete the new walk.
pub fn rewalk(
    map: &CodeMap,
    copy: &StackCopy<'_>,
    original: (&[u64], u32),
    cache: &mut WalkCache,
    out: &mut [u64],
) -> corsnap_unwind::Walk {
    struct CopyMemory<'a> {
        copy: &'a StackCopy<'a>,
        live: LiveMemory<'a>,
    }
    impl Memory for CopyMemory<'_> {
        fn stack_word(&self, addr: u64) -> Option<u64> {
            let offset = addr.checked_sub(self.copy.regs.sp)?;
            if offset % 8 != 0 {
                let i = (offset / 8) as usize;
                let (lo, hi) = (*self.copy.words.get(i)?, *self.copy.words.get(i + 1)?);
                let shift = (offset % 8) * 8;
                return Some(lo >> shift | hi << (64 - shift));
            }
            self.copy.words.get((offset / 8) as usize).copied()
        }
        fn code_bytes(&self, region: &ManagedCode, range: std::ops::Range<u64>) -> Option<&[u8]> {
            self.live.code_bytes(region, range)
        }
    }
    use corsnap_unwind::flags;
    let memory = CopyMemory { copy, live: LiveMemory { stack: 0..0, map, runtime_thread: 0 } };
    let (frames, original_flags) = original;
    let splice = copy.splice.and_then(|(i, sp)| Some((i, frames.get(i)? & !corsnap_unwind::EXACT_IP, sp)));
    let mut walk = corsnap_unwind::walk_until(map, &memory, copy.regs, cache, out, splice.map(|(_, ip, sp)| (ip, sp)));
    // On the agent's thread, not in a handler: what the walk learned is
    // kept at once.
    map.keep_learned(cache);
    if let (true, Some((i, ..))) = (walk.flags & flags::REACHED != 0, splice) {
        let rest = &frames[i..];
        let n = rest.len().min(out.len() - walk.len);
        out[walk.len..walk.len + n].copy_from_slice(&rest[..n]);
        walk.len += n;
        // The original walk knew every frame from the splice on: its ending
        // is this walk's ending; what happened before it is this walk's.
        let ending = flags::COMPLETE | flags::LOST | flags::TRUNCATED | flags::SIGNAL_FRAME | flags::HIJACKED;
        walk.flags = (walk.flags & !flags::REACHED) | (original_flags & ending);
        if n < rest.len() {
            walk.flags = (walk.flags & !flags::COMPLETE) | flags::TRUNCATED;
        }
    }
    walk
}

impl ThreadSlot {
    /// Keeps in `map`'s tables, for every thread's walks, what this
    /// thread's walks learned since the last call: leaf stretches and
    /// return addresses. On the agent's thread.
    pub fn keep_learned(&self, map: &CodeMap) {
        self.learned.take(|words| map.keep_leaf_stretch(&corsnap_unwind::LearnedStretch::from_words(words)));
        self.learned_addresses.take(|words| map.keep_known_address(words));
    }

    pub fn tid(&self) -> u32 {
        self.tid
    }

    /// Hands every complete record to `f`, oldest first, and frees its room.
    pub fn drain(&self, scratch: &mut Vec<u64>, mut f: impl FnMut(RawSample<'_>)) {
        let ring = &self.ring;
        let h = ring.head.load(Ordering::Acquire);
        let mut t = ring.tail.load(Ordering::Relaxed);
        while t < h {
            let word = |i: usize| ring.words[(t + i) % RING_WORDS].load(Ordering::Relaxed);
            let record = ring.record_at(t);
            if record.words() > h - t {
                break; // cannot happen: the producer publishes whole records
            }
            let len = record.frames;
            scratch.clear();
            scratch.extend((0..len + record.copied).map(|i| word(RECORD_HEAD + i)));
            if let Some((block, words)) = record.pooled {
                POOL.read_and_release(block, words, scratch);
            }
            let (frames, rest) = scratch.split_at(len);
            let stack = (record.copied >= COPY_HEAD).then(|| StackCopy {
                regs: Regs { ip: rest[0], sp: rest[1], bp: rest[2] },
                words: &rest[COPY_HEAD..],
                splice: (rest[3] != u64::MAX).then_some((rest[3] as usize, rest[4])),
            });
            f(RawSample {
                weight_ns: word(1),
                time_ns: word(2),
                handler_ns: word(3),
                flags: (word(0) >> 32) as u32,
                frames,
                stack,
            });
            t += record.words();
        }
        ring.tail.store(t, Ordering::Release);
    }
}

/// What the handler may read: the interrupted thread's stack, and code the
/// map lists.
pub(crate) struct LiveMemory<'a> {
    pub(crate) stack: std::ops::Range<u64>,
    pub(crate) map: &'a CodeMap,
    /// The runtime's object for the interrupted thread, 0 if unknown.
    pub(crate) runtime_thread: u64,
}

impl LiveMemory<'_> {
    /// A hijacked return address in this thread's stack from `sp` up, as
    /// (slot, original), whether or not a walk met it: for a copy of the
    /// stack, which a later walk reads without the thread object. A walk
    /// that steps over the hijacked frame by a guess never meets the
    /// trampoline: an OSR body's frame pointer leads to the copy of its
    /// caller's return address that the patchpoint left for it, not to the
    /// Tier0 frame's real one above, which the runtime hijacked. The walk of
    /// the copy, once the body is learned, unwinds by its record to that
    /// real one. Measured on .NET 8 (`gcstop.cs` under load): such walks of
    /// the copy ended at the trampoline, up to 1% of `Straight`'s samples.
    ///
    /// Async-signal-safe: [`hijack_fields`], and one read of this stack.
    /// The thread is the one interrupted (or the calling one), so its fields
    /// and stack hold still; the runtime writes the trampoline into the slot
    /// after both fields, so a slot that holds it has fields to match.
    pub(crate) fn hijack_in_stack(&self, sp: u64) -> Option<(u64, u64)> {
        let trampoline = self.map.hijack_trampoline().unwrap_or_else(|| HIJACK_TRAMPOLINE.load(Ordering::Relaxed));
        if trampoline == 0 {
            return None;
        }
        let (original, slot) = hijack_fields(self.runtime_thread)?;
        if original == 0 || original == trampoline || slot < sp || slot % 8 != 0 {
            return None;
        }
        (self.stack_word(slot)? == trampoline).then_some((slot, original))
    }
}

impl Memory for LiveMemory<'_> {
    fn stack_word(&self, addr: u64) -> Option<u64> {
        if addr < self.stack.start || addr > self.stack.end.checked_sub(8)? {
            return None;
        }
        // SAFETY: the range is the mapping that holds this thread's stack
        // pointer, and the thread is running on it (it is us): mapped.
        Some(unsafe { (addr as *const u64).read_unaligned() })
    }

    fn code_bytes(&self, region: &ManagedCode, range: std::ops::Range<u64>) -> Option<&[u8]> {
        // The frame's own region when the range is in it, checked in
        // constant time: one of this map's regions (its address inside the
        // map's list), the range inside its code. Else (unwind records the
        // runtime keeps elsewhere) a search of the map's regions, which
        // the common case no longer pays for (two binary searches a frame;
        // no change in the handler's median was measurable on pool.cs).
        let own = self.map.managed().as_ptr_range().contains(&(region as *const ManagedCode))
            && region.code.start <= range.start;
        let region = if own && range.end <= region.code.end { region } else { self.map.managed_at(range.start)? };
        if range.start < region.code.start || range.end > region.code.end || range.start > range.end {
            return None;
        }
        // SAFETY: the agent lists a managed region only while its code is
        // mapped (removed, and handlers waited out, before a module unloads),
        // and the range lies inside it.
        Some(unsafe { std::slice::from_raw_parts(range.start as *const u8, (range.end - range.start) as usize) })
    }

    fn hijacked_return(&self, slot: u64, found: u64) -> Option<u64> {
        hijacked_return(self.runtime_thread, &self.stack, slot, found, self.map.hijack_trampoline())
    }

    fn leaf_code(&self, range: std::ops::Range<u64>) -> Option<&[u8]> {
        if range.start > range.end || range.end - range.start > 16 {
            return None;
        }
        // SAFETY: the walker hands a range that starts at the interrupted
        // instruction pointer and lies inside a managed function of a region
        // that this map lists (found in a map of its lineage, and a lineage
        // keeps its regions); the agent lists a managed region only while
        // its code is mapped (see `code_bytes`).
        Some(unsafe { std::slice::from_raw_parts(range.start as *const u8, (range.end - range.start) as usize) })
    }

    fn prefetch(&self, addr: u64) {
        // SAFETY: PREFETCHT0 is a hint: it never faults, whatever the
        // address (Intel SDM vol. 2, PREFETCHh), and reads nothing back.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8) };
    }
}

/// The runtime stops a thread that is in code it cannot stop in by
/// overwriting the return address of the current managed frame with a
/// trampoline of its own (`Thread::HijackThread`), keeping the original in
/// `Thread::m_pvHJRetAddr` and the slot's address in `m_ppvHJRetAddrPtr`.
/// A walk that meets the trampoline would go on from it and lose the real
/// caller. `found` at stack word `slot` is a hijack if the thread object says
/// it took the return address from `slot` and that return address is not
/// what the slot holds now (after `UnhijackThread` both fields are left as
/// they were, and the slot holds the original again).
///
/// Only the trampoline's address is ever a hijack: the fields outlive the
/// hijack, and a later frame whose return address sits in the same slot
/// must not be "put back" to the old one. `known` is the trampoline as the
/// map found it in libcoreclr's code (before sampling starts); without it,
/// the first hijack seen teaches it, and addresses found not to be hijacks
/// meanwhile are remembered.
///
/// Async-signal-safe: atomics, and one `process_vm_readv` of 16 bytes into
/// this stack frame; nothing is dereferenced. Called only for managed
/// frames that return into native code, and most of those addresses are
/// remembered in [`NOT_HIJACKS`] after their first check.
/// The runtime's thread object's two hijack fields, `m_pvHJRetAddr` (the
/// original return address) and `m_ppvHJRetAddrPtr` (the slot it came
/// from), read with one `process_vm_readv` of 16 bytes into this stack frame
/// (async-signal-safe; an object no longer mapped is an error, never a
/// fault). `None` while their offset is unknown, or for a thread the agent
/// does not know (0).
fn hijack_fields(runtime_thread: u64) -> Option<(u64, u64)> {
    let offset = HIJACK_FIELDS.load(Ordering::Relaxed);
    if offset == 0 || runtime_thread == 0 {
        return None;
    }
    let mut fields = [0u8; 16];
    if !crate::process::read_own_memory(runtime_thread.checked_add(offset)?, &mut fields) {
        return None;
    }
    Some((u64::from_le_bytes(fields[..8].try_into().ok()?), u64::from_le_bytes(fields[8..].try_into().ok()?)))
}

fn hijacked_return(
    runtime_thread: u64,
    stack: &std::ops::Range<u64>,
    slot: u64,
    found: u64,
    known: Option<u64>,
) -> Option<u64> {
    if HIJACK_FIELDS.load(Ordering::Relaxed) == 0 || runtime_thread == 0 || found == 0 {
        return None;
    }
    let trampoline = known.unwrap_or_else(|| HIJACK_TRAMPOLINE.load(Ordering::Relaxed));
    if trampoline != 0 && found != trampoline {
        return None;
    }
    if trampoline == 0 && NOT_HIJACKS.iter().any(|a| a.load(Ordering::Relaxed) == found) {
        return None;
    }
    let (original, taken_from) = hijack_fields(runtime_thread)?;
    if taken_from == slot && original != found && original != 0 {
        if trampoline == 0 {
            HIJACK_TRAMPOLINE.store(found, Ordering::Relaxed);
        }
        HIJACKS_UNDONE.fetch_add(1, Ordering::Relaxed);
        return Some(original);
    }
    // Not hijacked: `found` is a real return address and never the
    // trampoline, if the object looked like this thread's (its slot field
    // points into this stack, or still holds the constructor's 0xCC fill).
    let plausible = taken_from == 0xCCCC_CCCC_CCCC_CCCC || stack.contains(&taken_from);
    if trampoline == 0 && plausible {
        if let Some(free) = NOT_HIJACKS.iter().find(|a| a.load(Ordering::Relaxed) == 0) {
            let _ = free.compare_exchange(0, found, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
    None
}

/// The signal handler, entered through the trampoline. Every step is listed
/// in the module documentation.
extern "C" fn on_signal(_signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    // SAFETY: __errno_location returns this thread's errno slot.
    let errno = unsafe { *libc::__errno_location() };
    // The walk is panic-free by construction; should a dependency panic
    // anyway, sampling stops instead of unwinding out of a signal handler.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the kernel passes a valid siginfo_t and ucontext_t for the
        // duration of the handler.
        unsafe { take_sample(info, context) }
    }))
    .is_err()
    {
        ENABLED.store(false, Ordering::Relaxed);
        PANICKED.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// # Safety
/// `info` and `context` are the handler's arguments for a `SA_SIGINFO`
/// handler.
unsafe fn take_sample(info: *mut libc::siginfo_t, context: *mut c_void) {
    let entered = monotonic_ns();
    let raw = info as *const u8;
    if !ENABLED.load(Ordering::Acquire) {
        NOT_READY.fetch_add(1, Ordering::Relaxed);
        // A periodic timer would go on signalling while sampling is off:
        // stopped (the agent arms it again when sampling resumes).
        // SAFETY: offsets inside the 128-byte siginfo_t (asserted above);
        // a slot pointer, as below, stays valid while a handler runs.
        unsafe {
            if (raw.add(SI_CODE_OFFSET) as *const c_int).read_unaligned() == SI_TIMER {
                let index = (raw.add(SI_VALUE_OFFSET) as *const usize).read_unaligned() & 0xffff_ffff;
                if let Some(slot) = SLOTS.get(index).and_then(|s| s.load(Ordering::Acquire).as_ref()) {
                    slot.stop_timer();
                }
            }
        }
        return;
    }
    // SAFETY: offsets inside the 128-byte siginfo_t (asserted above).
    let (code, overrun, value) = unsafe {
        (
            (raw.add(SI_CODE_OFFSET) as *const c_int).read_unaligned(),
            (raw.add(SI_OVERRUN_OFFSET) as *const c_int).read_unaligned(),
            (raw.add(SI_VALUE_OFFSET) as *const usize).read_unaligned(),
        )
    };
    let mut requested = false;
    let index = match code {
        SI_TIMER => value & 0xffff_ffff,
        SI_QUEUE => {
            // SAFETY: si_pid inside the 128-byte siginfo_t.
            let sender = unsafe { (raw.add(SI_PID_OFFSET) as *const c_int).read_unaligned() };
            // SAFETY: getpid has no preconditions and is async-signal-safe.
            let own_pid = unsafe { libc::getpid() };
            if sender != own_pid {
                FOREIGN.fetch_add(1, Ordering::Relaxed);
                return;
            }
            requested = true;
            value & 0xffff_ffff
        }
        POLL_IN | POLL_HUP => {
            // SAFETY: si_fd inside the 128-byte siginfo_t.
            let fd = unsafe { (raw.add(SI_FD_OFFSET) as *const c_int).read_unaligned() };
            match PERF_FDS.get(fd as usize).map(|s| s.load(Ordering::Acquire)) {
                Some(i) if i > 0 => i as usize - 1,
                _ => {
                    NO_SLOT.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
        _ => {
            FOREIGN.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let Some(slot) = SLOTS.get(index).map(|s| s.load(Ordering::Acquire)) else {
        NO_SLOT.fetch_add(1, Ordering::Relaxed);
        return;
    };
    // SAFETY: a non-null slot pointer stays valid until the agent frees it,
    // which it does only after its thread has exited (or after every signal
    // has been discarded and every handler has left, on detach).
    let Some(slot) = (unsafe { slot.as_ref() }) else {
        NO_SLOT.fetch_add(1, Ordering::Relaxed);
        return;
    };
    // SAFETY: pthread_self has no preconditions; glibc's reads the thread
    // pointer and nothing else.
    let me = unsafe { libc::pthread_self() } as usize;
    if slot.owner.load(Ordering::Relaxed) != me {
        // SAFETY: gettid has no preconditions.
        if slot.tid != unsafe { libc::gettid() } as u32 {
            NO_SLOT.fetch_add(1, Ordering::Relaxed);
            return;
        }
        slot.owner.store(me, Ordering::Relaxed);
    }
    // SAFETY: only this thread's handler touches `walking` (tid checked
    // above), and it cannot be re-entered while SIGPROF is blocked.
    let walking = unsafe { &mut *slot.walking.get() };
    let weight_ns = if requested {
        // Asked for, not a clock's: no weight, and the clock is untouched.
        0
    } else if code != SI_TIMER {
        // A perf event's overflow (only those and timers get this far).
        // Loaded once: the agent may replace them (never while a handler
        // that loaded them runs: it waits for none to be in flight).
        let fd = slot.perf_fd.load(Ordering::Acquire);
        let page = slot.perf_page.load(Ordering::Acquire);
        if slot.clock.load(Ordering::Acquire) != CLOCK_PERF || fd < 0 {
            // Raised just before the thread moved to a timer, which weighs
            // the CPU time from then on (or by an event just started, before
            // it became the clock). Marked read, so that the event's buffer
            // never fills.
            consume_perf_records(page);
            NOT_READY.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // The period that just ran out is this sample's weight. Periods are
        // spread around the interval (each thread starts with its own), so a
        // program whose work repeats at the sampling period is not always
        // seen at the same point of it; a new period costs an ioctl of
        // ~10 µs on some kernels, so it changes every PERIOD_CHANGE_EVERY
        // samples. The overflow records are marked read with one store.
        let elapsed = slot.perf_period_ns.load(Ordering::Relaxed);
        walking.samples += 1;
        if walking.samples % PERIOD_CHANGE_EVERY == 0 {
            let period = dithered_period(&mut walking.rng, slot.interval_ns.load(Ordering::Relaxed));
            slot.perf_period_ns.store(period, Ordering::Relaxed);
            set_perf_period(fd, period);
        }
        consume_perf_records(page);
        elapsed
    } else {
        // A CPU timer is checked only at the scheduler tick, so the sample
        // falls on the first tick after its delay ran out: it weighs the CPU
        // time the thread really used since its previous sample (its own CPU
        // clock, one system call), and the next delay is drawn afresh, so
        // which tick is sampled is random and a program whose work repeats
        // with the tick is not always seen at the same point.
        if slot.clock.load(Ordering::Acquire) != CLOCK_TIMER {
            // The thread went back to its perf event while this signal was
            // on its way: the event weighs that CPU time, not this. The
            // agent disarmed the timer, but this handler's last sample may
            // have re-armed it just after: stopped again, for good (the
            // agent arms it when the timer is the clock again).
            slot.stop_timer();
            walking.timer.period_ns = 0;
            NOT_READY.fetch_add(1, Ordering::Relaxed);
            return;
        }
        timer_sample_weight(slot, walking, overrun)
    };
    // SAFETY: see step 4 of the module documentation.
    let Some(map) = (unsafe { MAP.load(Ordering::Acquire).as_ref() }) else {
        NOT_READY.fetch_add(1, Ordering::Relaxed);
        return;
    };
    // SAFETY: the kernel's ucontext_t for this signal.
    let gregs = unsafe { &(*(context as *const libc::ucontext_t)).uc_mcontext.gregs };
    let regs = Regs {
        ip: gregs[libc::REG_RIP as usize] as u64,
        sp: gregs[libc::REG_RSP as usize] as u64,
        bp: gregs[libc::REG_RBP as usize] as u64,
    };
    // The mapping that holds the stack pointer: in one map it is the same
    // at every sample of the thread, and its search was several misses.
    let stack = if walking.stack_generation == map.generation() && walking.stack.contains(&regs.sp) {
        walking.stack.clone()
    } else {
        let Some(stack) = map.stack_containing(regs.sp) else {
            slot.unknown_stack.fetch_add(1, Ordering::Relaxed);
            return;
        };
        walking.stack = stack.clone();
        walking.stack_generation = map.generation();
        stack
    };
    let stack_words = ((stack.end - regs.sp) / 8).min(STACK_COPY_WORDS as u64) as usize;
    let memory = LiveMemory { stack, map, runtime_thread: slot.runtime_thread.load(Ordering::Relaxed) };
    let walk = corsnap_unwind::walk(map, &memory, regs, &mut walking.cache, &mut walking.frames);
    let time_ns = monotonic_ns();
    if let Some(words) = walking.cache.take_learned_stretch().and_then(|s| s.to_words()) {
        slot.learned.push(words);
    }
    walking.cache.take_learned_addresses(|words| slot.learned_addresses.push(words));
    let frames = walking.frames.get(..walk.len).unwrap_or(&[]);
    let record_flags = walk.flags | if requested { REQUESTED } else { 0 };
    let header = frames.len() as u64 | u64::from(record_flags) << 32;
    // A walk that reached the root used the stack up to `walk.sp`: copy that
    // much (and a little more), not the whole allowance, so that several
    // copies fit in the ring between two drains.
    // With a splice frame, the stack up to it is enough (a little past it:
    // its own frame is where the new walk must arrive). That keeps copies
    // small, so a ring holds tens of them while the agent is slow to drain
    // (a program starting up under CPU contention); if the guesses that led
    // to the splice frame were wrong, the new walk does not arrive there and
    // the sample ends incomplete rather than wrong.
    //
    // But the guesses are wrong whenever the code not known yet sits on a
    // frame pointer that is not its caller's (an OSR body's points into the
    // Tier0 frame beneath it): the new walk then runs off the end of a short
    // copy. So the copy goes as deep as the walk went when the ring has room
    // for it, and only to the splice frame when it has not.
    let deep_words = if walk.flags & corsnap_unwind::flags::COMPLETE != 0 {
        (((walk.sp.saturating_sub(regs.sp)) / 8) as usize + 64).min(stack_words)
    } else {
        stack_words
    };
    let splice_words = walk
        .splice
        .map(|(_, at)| (((at.sp.saturating_sub(regs.sp)) / 8) as usize + SPLICE_SLACK_WORDS).min(stack_words));
    let min_copy_words = splice_words.unwrap_or(deep_words).min(deep_words);
    // Built only for a walk that met unknown code: looking for a hijack the
    // walk did not meet reads the thread object.
    let copy = (walk.flags & corsnap_unwind::flags::UNKNOWN_CODE != 0).then(|| StackToCopy {
        regs,
        words: deep_words,
        min_words: min_copy_words,
        memory: &memory,
        undone_hijack: walk.undone_hijack.or_else(|| memory.hijack_in_stack(regs.sp)),
        known_frames: walk.known_frames,
        splice: walk.splice.map(|(i, at)| (i, at.sp)),
    });
    if slot.ring.push([header, weight_ns, time_ns, time_ns.saturating_sub(entered), 0], frames, copy) {
        slot.samples.fetch_add(1, Ordering::Relaxed);
        // Only this handler writes them: a load and a store, no locked
        // instruction.
        let counts = [u64::from(walk.leaf_by_stretch), walk.looked_up.into(), walk.from_process_table.into()];
        for (count, add) in slot.walk_counts.iter().zip(counts).filter(|&(_, add)| add != 0) {
            count.store(count.load(Ordering::Relaxed) + add, Ordering::Relaxed);
        }
        if requested {
            slot.requested_samples.fetch_add(1, Ordering::Release);
        }
    } else {
        slot.dropped_full.fetch_add(1, Ordering::Relaxed);
    }
}

/// What a timer's sample weighs, and the timer re-armed when its period is
/// due to change (see [`TimerState`]). In the handler, on the slot's own
/// thread: two system calls (`clock_gettime`, `timer_settime`), both
/// async-signal-safe, in one sample of [`PERIOD_CHANGE_EVERY`]; none in the
/// others.
fn timer_sample_weight(slot: &ThreadSlot, walking: &mut Walking, overrun: c_int) -> u64 {
    // Acquire: the base the agent stored before counting its arm.
    let arms = slot.timer_arms.load(Ordering::Acquire);
    let interval = slot.interval_ns.load(Ordering::Relaxed);
    let timer = &mut walking.timer;
    timer.samples += 1;
    let periodic = timer.period_ns != 0
        && arms == timer.arms_seen
        && interval == timer.interval_ns
        && timer.samples < PERIOD_CHANGE_EVERY;
    if periodic {
        // The kernel re-armed it from the expiry it fired for: this one,
        // and as many more as it counted overrun, a period apart.
        let weight = timer.period_ns.saturating_mul(1 + u64::try_from(overrun).unwrap_or(0));
        timer.base_ns = timer.base_ns.saturating_add(weight);
        return weight;
    }
    let base = if arms == timer.arms_seen { timer.base_ns } else { slot.timer_base_ns.load(Ordering::Relaxed) };
    let now = thread_cpu_ns();
    let period = dithered_period(&mut walking.rng, interval);
    let armed = arm_timer(slot.timer_id.load(Ordering::Relaxed), period, period).is_ok();
    *timer = TimerState {
        arms_seen: arms,
        period_ns: if armed { period } else { 0 },
        interval_ns: interval,
        base_ns: now,
        samples: 0,
    };
    now.saturating_sub(base)
}

/// The calling thread's CPU time in nanoseconds (a system call; async-
/// signal-safe).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `CLOCK_MONOTONIC` in nanoseconds: on POSIX's async-signal-safe list,
/// served by the vDSO. The clock `std::time::Instant` reads on Linux.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Counters of signals that did not become samples, process-wide.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SignalCounters {
    /// Arrived before the agent was ready or after it stopped.
    pub not_ready: u64,
    /// `SIGPROF`s not raised by our timers (sent by someone else).
    pub foreign: u64,
    /// For a slot that no longer (or never) belonged to the thread.
    pub no_slot: u64,
    /// A dependency panicked inside the handler (sampling then stops).
    pub panicked: u64,
    /// Return addresses the runtime had hijacked, put back in walks.
    pub hijacks_undone: u64,
}

pub fn counters() -> SignalCounters {
    SignalCounters {
        not_ready: NOT_READY.load(Ordering::Relaxed),
        foreign: FOREIGN.load(Ordering::Relaxed),
        no_slot: NO_SLOT.load(Ordering::Relaxed),
        panicked: PANICKED.load(Ordering::Relaxed),
        hijacks_undone: HIJACKS_UNDONE.load(Ordering::Relaxed),
    }
}

/// Tells the handler where the runtime's thread object keeps a hijacked
/// return address (see [`HIJACK_FIELDS`]); the agent finds it.
pub fn set_hijack_fields_offset(offset: u64) {
    HIJACK_FIELDS.store(offset, Ordering::Relaxed);
}

pub fn hijack_fields_offset() -> u64 {
    HIJACK_FIELDS.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------
// The trampoline.

const TRAMPOLINE_NAME: &str = "corsnap-signal-trampoline";
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
struct Trampoline {
    code: usize,
}

impl Trampoline {
    fn data(&self) -> usize {
        self.code + PAGE
    }

    fn in_flight(&self) -> &'static AtomicU64 {
        // SAFETY: the data page is mapped read-write for the life of the
        // process (never unmapped), 8-aligned.
        unsafe { &*((self.data() + DATA_IN_FLIGHT) as *const AtomicU64) }
    }

    fn target(&self) -> &'static AtomicUsize {
        // SAFETY: as above.
        unsafe { &*((self.data() + DATA_TARGET) as *const AtomicUsize) }
    }

    fn entry(&self) -> usize {
        self.code
    }

    fn idle(&self) -> usize {
        self.code + RET_STUB
    }

    /// Finds the trampoline an earlier attach left, or makes one.
    fn get() -> std::io::Result<Trampoline> {
        if let Some(t) = Self::find() {
            return Ok(t);
        }
        Self::create()
    }

    fn find() -> Option<Trampoline> {
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

    fn create() -> std::io::Result<Trampoline> {
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

// ---------------------------------------------------------------------------
// The safe interface the agent uses.

/// Why the signal sampler could not start.
#[derive(Debug)]
pub enum InstallError {
    /// The application has its own `SIGPROF` handler; corsnap will not
    /// replace it or steal its signals.
    SignalInUse,
    /// A system call failed.
    Os(std::io::Error),
}

impl std::fmt::Display for InstallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InstallError::SignalInUse => write!(f, "the program has its own SIGPROF handler"),
            InstallError::Os(e) => write!(f, "{e}"),
        }
    }
}

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The installed signal handler. Only one exists at a time; dropping it
/// without [`SignalSampler::uninstall`] leaves the handler installed, so the
/// agent always uninstalls.
#[derive(Debug)]
pub struct SignalSampler {
    trampoline: Trampoline,
    previous: libc::sigaction,
    retired: Vec<*mut CodeMap>,
    timers: Vec<(usize, i32)>,
    perf_fds: Vec<(usize, i32)>,
    /// Perf events replaced by timers (fd, ring page), closed once no
    /// handler runs ([`Sampler::reclaim`]).
    closing_perf: Vec<(i32, usize)>,
    perf_usable: bool,
    perf_refusal: Option<String>,
    free_slots: Vec<usize>,
    next_slot: usize,
}

// SAFETY: the raw map pointers are owned (Arc::into_raw) and only freed here.
unsafe impl Send for SignalSampler {}

/// A thread's timer, identified by its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId(usize);

impl SignalSampler {
    /// Installs the handler for [`SAMPLE_SIGNAL`] (refusing if the program
    /// has one of its own) with sampling disabled.
    /// `use_perf`: sample with perf events where the kernel allows them
    /// (else, or with `false`, POSIX CPU timers).
    pub fn install(use_perf: bool) -> Result<SignalSampler, InstallError> {
        if INSTALLED.swap(true, Ordering::SeqCst) {
            return Err(InstallError::Os(std::io::Error::other("the signal sampler is already installed")));
        }
        let result = Self::install_inner(use_perf);
        if result.is_err() {
            INSTALLED.store(false, Ordering::SeqCst);
        }
        result
    }

    fn install_inner(use_perf: bool) -> Result<SignalSampler, InstallError> {
        // SAFETY: querying a disposition into a zeroed struct.
        let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        if unsafe { libc::sigaction(SAMPLE_SIGNAL, null_mut(), &mut previous) } != 0 {
            return Err(InstallError::Os(std::io::Error::last_os_error()));
        }
        let trampoline = Trampoline::get().map_err(InstallError::Os)?;
        POOL.create();
        if previous.sa_sigaction != libc::SIG_DFL
            && previous.sa_sigaction != libc::SIG_IGN
            && previous.sa_sigaction != trampoline.entry()
        {
            return Err(InstallError::SignalInUse);
        }
        if previous.sa_sigaction == trampoline.entry() {
            // A detach that could not restore the disposition: what was there
            // before it is the default.
            previous.sa_sigaction = libc::SIG_DFL;
        }
        let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = on_signal;
        trampoline.target().store(handler as usize, Ordering::SeqCst);
        // SAFETY: zeroed sigaction, then filled in.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = trampoline.entry();
        // SA_RESTART: interrupted system calls resume (most of them: socket
        // calls with timeouts do not, which is why timers count CPU time and
        // blocked threads are never signalled). No SA_ONSTACK: the handler
        // runs on the interrupted stack. No SA_NODEFER: never re-entered.
        action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        // SAFETY: valid mask pointer.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: valid action; the entry point is our trampoline's code.
        if unsafe { libc::sigaction(SAMPLE_SIGNAL, &action, null_mut()) } != 0 {
            return Err(InstallError::Os(std::io::Error::last_os_error()));
        }
        let perf_usable = use_perf;
        Ok(SignalSampler {
            trampoline,
            previous,
            retired: Vec::new(),
            timers: Vec::new(),
            perf_fds: Vec::new(),
            closing_perf: Vec::new(),
            perf_usable,
            perf_refusal: (!perf_usable).then(|| "POSIX timers were asked for".to_string()),
            free_slots: Vec::new(),
            next_slot: 0,
        })
    }

    /// Whether our handler is still the one installed (a program may replace
    /// it later).
    pub fn handler_in_place(&self) -> bool {
        // SAFETY: querying into a zeroed struct.
        let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        let ok = unsafe { libc::sigaction(SAMPLE_SIGNAL, null_mut(), &mut current) == 0 };
        ok && current.sa_sigaction == self.trampoline.entry()
    }

    /// glibc's signal return trampoline (`__restore_rt`), which the kernel
    /// puts as the return address of every handler glibc installs: the mark
    /// of a signal frame on a stack. 0 if glibc did not fill it in.
    pub fn sigreturn_trampoline() -> u64 {
        // SAFETY: querying into a zeroed struct.
        let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        if unsafe { libc::sigaction(SAMPLE_SIGNAL, null_mut(), &mut current) } != 0 {
            return 0;
        }
        current.sa_restorer.map_or(0, |f| f as usize as u64)
    }

    /// Starts or stops turning signals into samples.
    pub fn set_enabled(&self, on: bool) {
        ENABLED.store(on, Ordering::Release);
        // Paused perf events cost nothing; timers keep running and their
        // signals are dropped while sampling is off.
        // Each thread's own clock only: one moved to a timer keeps its perf
        // event off.
        for &(index, fd) in &self.perf_fds {
            // SAFETY: slots are freed only with `&mut self`.
            let perf_is_clock = unsafe { SLOTS[index].load(Ordering::Acquire).as_ref() }
                .is_some_and(|slot| slot.clock.load(Ordering::Acquire) == CLOCK_PERF);
            enable_perf_event(fd, on && perf_is_clock);
        }
        if on {
            // A timer that fired while sampling was off was stopped. The
            // first sample weighs the CPU time from now, not the pause.
            for &(index, timer) in &self.timers {
                // SAFETY: slots are freed only with `&mut self`.
                if let Some(slot) = unsafe { SLOTS[index].load(Ordering::Acquire).as_ref() } {
                    if slot.clock.load(Ordering::Acquire) == CLOCK_TIMER {
                        slot.timer_rebased();
                        let _ = arm_timer_once(timer, slot.interval_ns.load(Ordering::Relaxed));
                    }
                }
            }
        }
    }

    /// Publishes a new code map for walks; the old one is freed once no
    /// handler can be using it.
    pub fn publish(&mut self, map: Arc<CodeMap>) {
        let new = Arc::into_raw(map) as *mut CodeMap;
        let old = MAP.swap(new, Ordering::SeqCst);
        if !old.is_null() {
            self.retired.push(old);
        }
        self.reclaim();
    }

    /// Frees replaced maps if no handler is running now: a handler that read
    /// the old pointer counted itself in before reading it.
    pub fn reclaim(&mut self) {
        if (self.retired.is_empty() && self.closing_perf.is_empty())
            || self.trampoline.in_flight().load(Ordering::SeqCst) != 0
        {
            return;
        }
        for (fd, page) in self.closing_perf.drain(..) {
            // SAFETY: our own descriptor and mapping, which no slot refers to
            // any more and no handler holds (count observed at zero after
            // they were taken out of the slot).
            unsafe { libc::close(fd) };
            unmap_perf_ring(page);
        }
        for p in self.retired.drain(..) {
            // SAFETY: made by Arc::into_raw in `publish`, no longer in MAP,
            // and no handler holds it (count observed at zero after the swap).
            drop(unsafe { Arc::from_raw(p as *const CodeMap) });
        }
    }

    /// Starts sampling thread `tid` every `interval_ns` of its CPU time: by a
    /// perf event where the kernel allows one (exact CPU time, dithered
    /// periods), else by a POSIX CPU-time timer (which the kernel checks only
    /// at its scheduler tick, so samples fall on tick boundaries).
    pub fn add_thread(&mut self, tid: u32, interval_ns: u64) -> std::io::Result<SlotId> {
        let index = match self.free_slots.pop() {
            Some(i) => i,
            None if self.next_slot < MAX_SLOTS => {
                self.next_slot += 1;
                self.next_slot - 1
            }
            None => return Err(std::io::Error::other("too many threads")),
        };
        let perf_fd = if self.perf_usable { open_perf_event(tid) } else { Err(std::io::Error::other("off")) };
        let perf_fd = match perf_fd {
            Ok(fd) if (fd as usize) < MAX_PERF_FD => fd,
            Ok(fd) => {
                // SAFETY: our own fd.
                unsafe { libc::close(fd) };
                -1
            }
            Err(e) => {
                if self.perf_usable && e.raw_os_error() != Some(libc::ESRCH) {
                    // Not permitted here (perf_event_paranoid, seccomp): use
                    // timers from now on.
                    self.perf_usable = false;
                    self.perf_refusal = Some(e.to_string());
                }
                -1
            }
        };
        let perf_page = if perf_fd >= 0 {
            match map_perf_ring(perf_fd) {
                Ok(page) => page,
                Err(e) => {
                    // SAFETY: our own fd.
                    unsafe { libc::close(perf_fd) };
                    return Err(e);
                }
            }
        } else {
            0
        };
        let seed = (u64::from(tid) << 32 | index as u64) ^ 0x9e37_79b9_7f4a_7c15;
        let slot = Box::new(ThreadSlot {
            tid,
            owner: AtomicUsize::new(0),
            perf_fd: AtomicI32::new(perf_fd),
            perf_page: AtomicUsize::new(perf_page),
            perf_period_ns: AtomicU64::new(0),
            interval_ns: AtomicU64::new(interval_ns),
            timer_id: std::sync::atomic::AtomicI32::new(-1),
            clock: AtomicU8::new(if perf_fd >= 0 { CLOCK_PERF } else { CLOCK_TIMER }),
            timer_base_ns: AtomicU64::new(crate::thread_cpu_time_ns(tid).unwrap_or(0)),
            // Armed once (below, unless a perf event samples the thread):
            // the handler's first sample weighs from the base above.
            timer_arms: AtomicU64::new(1),
            walking: UnsafeCell::new(Walking {
                cache: WalkCache::new(),
                frames: [0; MAX_FRAMES],
                rng: seed | 1,
                samples: 0,
                timer: TimerState::default(),
                stack_generation: 0,
                stack: 0..0,
            }),
            ring: Ring::new(),
            learned: LearnedMailbox::default(),
            learned_addresses: LearnedMailbox::default(),
            samples: AtomicU64::new(0),
            walk_counts: Default::default(),
            requested_samples: AtomicU64::new(0),
            dropped_full: AtomicU64::new(0),
            unknown_stack: AtomicU64::new(0),
            runtime_thread: AtomicU64::new(0),
        });
        let slot = Box::into_raw(slot);
        // Each thread starts with a period of its own. Set before the event
        // can fire; the handler owns it from then on.
        // SAFETY: the slot is ours alone until it is published below.
        let first_period = unsafe {
            let walking = &mut *(*slot).walking.get();
            let period = dithered_period(&mut walking.rng, interval_ns);
            (*slot).perf_period_ns.store(period, Ordering::Relaxed);
            period
        };
        SLOTS[index].store(slot, Ordering::Release);
        if perf_fd >= 0 {
            PERF_FDS[perf_fd as usize].store(index as u32 + 1, Ordering::Release);
            match start_perf_event(perf_fd, tid, first_period) {
                Ok(()) => {
                    self.perf_fds.push((index, perf_fd));
                    return Ok(SlotId(index));
                }
                Err(e) => {
                    PERF_FDS[perf_fd as usize].store(0, Ordering::Release);
                    // SAFETY: our own fd; nothing was started on it.
                    unsafe { libc::close(perf_fd) };
                    unmap_perf_ring(perf_page);
                    let p = SLOTS[index].swap(null_mut(), Ordering::SeqCst);
                    // SAFETY: no event fired for this slot.
                    drop(unsafe { Box::from_raw(p) });
                    self.free_slots.push(index);
                    return Err(e);
                }
            }
        }
        match create_cpu_timer(tid, index) {
            Ok(timer) => {
                // SAFETY: the slot is published and stays until removed by us.
                let slot_ref = unsafe { &*SLOTS[index].load(Ordering::Acquire) };
                slot_ref.timer_id.store(timer, Ordering::Release);
                if let Err(e) = arm_timer_once(timer, first_period) {
                    delete_timer(timer);
                    let p = SLOTS[index].swap(null_mut(), Ordering::SeqCst);
                    // SAFETY: the timer never ran.
                    drop(unsafe { Box::from_raw(p) });
                    self.free_slots.push(index);
                    return Err(e);
                }
                self.timers.push((index, timer));
                Ok(SlotId(index))
            }
            Err(e) => {
                let p = SLOTS[index].swap(null_mut(), Ordering::SeqCst);
                // SAFETY: no timer exists for this slot, so no handler can
                // have found it.
                drop(unsafe { Box::from_raw(p) });
                self.free_slots.push(index);
                Err(e)
            }
        }
    }

    /// The slot of a sampled thread, for draining.
    pub fn slot(&self, id: SlotId) -> Option<&ThreadSlot> {
        // SAFETY: slots are freed only by `remove_exited_thread` and
        // `uninstall`, which take `&mut self`.
        unsafe { SLOTS.get(id.0)?.load(Ordering::Acquire).as_ref() }
    }

    /// Stops sampling a thread that has exited, and frees its slot. The
    /// caller drains it first. Must only be called once the thread is gone:
    /// a live thread could still have a signal pending.
    pub fn remove_exited_thread(&mut self, id: SlotId) {
        if let Some(pos) = self.timers.iter().position(|&(i, _)| i == id.0) {
            let (_, timer) = self.timers.swap_remove(pos);
            delete_timer(timer);
        }
        if let Some(pos) = self.perf_fds.iter().position(|&(i, _)| i == id.0) {
            let (_, fd) = self.perf_fds.swap_remove(pos);
            close_perf_event(fd);
        }
        let p = SLOTS[id.0].swap(null_mut(), Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: the thread has exited, so no handler runs on it; only
            // its handler ever dereferences the slot.
            drop(unsafe { Box::from_raw(p) });
            self.free_slots.push(id.0);
        }
    }

    /// Changes every thread's interval.
    pub fn set_interval(&self, interval_ns: u64) {
        for slot in SLOTS.iter().take(self.next_slot) {
            // SAFETY: slots are freed only with `&mut self`.
            if let Some(s) = unsafe { slot.load(Ordering::Acquire).as_ref() } {
                s.interval_ns.store(interval_ns, Ordering::Relaxed);
            }
        }
    }

    /// Asks thread `id` for one sample now, with a signal queued to it
    /// (`rt_tgsigqueueinfo`); the record carries [`REQUESTED`]. For walk
    /// verification only: unlike the clocks, this signals a thread whether
    /// it runs or not. `false` if the signal could not be sent.
    pub fn request_sample(&self, id: SlotId) -> bool {
        // SAFETY: slots are freed only with `&mut self`.
        let Some(slot) = (unsafe { SLOTS[id.0].load(Ordering::Acquire).as_ref() }) else { return false };
        // SAFETY: a zeroed siginfo_t filled in at the offsets asserted above.
        unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let raw = &mut info as *mut libc::siginfo_t as *mut u8;
            (raw as *mut c_int).write_unaligned(SAMPLE_SIGNAL);
            (raw.add(SI_CODE_OFFSET) as *mut c_int).write_unaligned(SI_QUEUE);
            (raw.add(SI_PID_OFFSET) as *mut c_int).write_unaligned(libc::getpid());
            (raw.add(SI_PID_OFFSET + 4) as *mut u32).write_unaligned(libc::getuid());
            (raw.add(SI_VALUE_OFFSET) as *mut usize).write_unaligned(id.0);
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                libc::getpid(),
                slot.tid as c_int,
                SAMPLE_SIGNAL,
                &info as *const libc::siginfo_t,
            ) == 0
        }
    }

    /// Tells thread `id`'s handler which runtime thread object is its own
    /// (0: none).
    pub fn set_runtime_thread(&self, id: SlotId, thread: u64) {
        if let Some(slot) = self.slot(id) {
            slot.runtime_thread.store(thread, Ordering::Relaxed);
        }
    }

    /// Samples the slot has stored so far.
    pub fn samples_of(&self, id: SlotId) -> u64 {
        self.slot(id).map_or(0, |s| s.samples.load(Ordering::Acquire))
    }

    /// Samples stored for thread `id` on request so far.
    pub fn requested_samples_of(&self, id: SlotId) -> u64 {
        self.slot(id).map_or(0, |s| s.requested_samples.load(Ordering::Acquire))
    }

    /// Moves thread `id` from its perf event to a POSIX CPU timer
    /// (`timer`) or back. A perf event costs at every context switch (the
    /// kernel schedules it out and in and reprograms its timer), even
    /// disabled, a timer nothing until it fires; so a thread that switches
    /// often is cheaper on a timer, and a thread that runs long stretches
    /// keeps the exact clock. A replaced event is closed once no handler
    /// can be using it, and a new one opened on the way back. `Ok(false)`
    /// if nothing changed (already on that clock, or perf events are not
    /// allowed here).
    pub fn set_thread_clock(&mut self, id: SlotId, timer: bool) -> std::io::Result<bool> {
        // SAFETY: slots are freed only with `&mut self`.
        let Some(slot) = (unsafe { SLOTS.get(id.0).and_then(|s| s.load(Ordering::Acquire).as_ref()) }) else {
            return Ok(false);
        };
        let wanted = if timer { CLOCK_TIMER } else { CLOCK_PERF };
        if !self.perf_usable || slot.clock.load(Ordering::Acquire) == wanted {
            return Ok(false);
        }
        let enabled = ENABLED.load(Ordering::Acquire);
        if timer {
            let mut id_of_timer = slot.timer_id.load(Ordering::Acquire);
            if id_of_timer < 0 {
                id_of_timer = create_cpu_timer(slot.tid, id.0)?;
                slot.timer_id.store(id_of_timer, Ordering::Release);
                self.timers.push((id.0, id_of_timer));
            }
            // The perf event's last period is weighed by its last sample;
            // the timer's first weighs the CPU time from here.
            slot.timer_rebased();
            slot.clock.store(CLOCK_TIMER, Ordering::SeqCst);
            if enabled {
                arm_timer_once(id_of_timer, slot.interval_ns.load(Ordering::Relaxed))?;
            }
            // The event leaves the slot first (a handler then neither
            // signals through it nor finds it), and is closed later.
            let fd = slot.perf_fd.swap(-1, Ordering::SeqCst);
            let page = slot.perf_page.swap(0, Ordering::SeqCst);
            if fd >= 0 {
                self.perf_fds.retain(|&(i, f)| !(i == id.0 && f == fd));
                self.retire_perf_event(fd, page);
            }
        } else {
            let fd = open_perf_event(slot.tid)?;
            if fd as usize >= MAX_PERF_FD {
                // SAFETY: our own fd.
                unsafe { libc::close(fd) };
                return Err(std::io::Error::other("no room for another perf event"));
            }
            let page = match map_perf_ring(fd) {
                Ok(page) => page,
                Err(e) => {
                    // SAFETY: our own fd.
                    unsafe { libc::close(fd) };
                    return Err(e);
                }
            };
            PERF_FDS[fd as usize].store(id.0 as u32 + 1, Ordering::SeqCst);
            slot.perf_page.store(page, Ordering::SeqCst);
            slot.perf_fd.store(fd, Ordering::SeqCst);
            // Started before it is the clock: a signal it raises meanwhile
            // is marked read and dropped by the handler.
            if let Err(e) = start_perf_event(fd, slot.tid, slot.perf_period_ns.load(Ordering::Relaxed)) {
                slot.perf_fd.store(-1, Ordering::SeqCst);
                slot.perf_page.store(0, Ordering::SeqCst);
                self.retire_perf_event(fd, page);
                return Err(e);
            }
            if !enabled {
                enable_perf_event(fd, false);
            }
            self.perf_fds.push((id.0, fd));
            slot.clock.store(CLOCK_PERF, Ordering::SeqCst);
            // Disarmed (a zero delay): a handler that read the old clock
            // just before may arm it once more; its signal then finds the
            // clock changed and is dropped, and re-arms nothing.
            let _ = arm_timer_once(slot.timer_id.load(Ordering::Acquire), 0);
        }
        Ok(true)
    }

    /// Stops a perf event taken out of its slot (no handler finds it any
    /// more): silenced now, closed with its ring once no handler that might
    /// have loaded it is in flight ([`Self::reclaim`]).
    fn retire_perf_event(&mut self, fd: i32, page: usize) {
        PERF_FDS[fd as usize].store(0, Ordering::SeqCst);
        // SAFETY: ioctl and fcntl on our own fd: stopped, and no more
        // signals from it.
        unsafe {
            libc::ioctl(fd, PERF_EVENT_IOC_DISABLE, 0);
            libc::fcntl(fd, libc::F_SETFL, 0);
        }
        self.closing_perf.push((fd, page));
        self.reclaim();
    }

    /// How many threads each clock samples now: (perf events, timers).
    pub fn clocks_in_use(&self) -> (usize, usize) {
        let mut counts = (0, 0);
        for slot in SLOTS.iter().take(self.next_slot) {
            // SAFETY: slots are freed only with `&mut self`.
            if let Some(s) = unsafe { slot.load(Ordering::Acquire).as_ref() } {
                if s.clock.load(Ordering::Relaxed) == CLOCK_PERF {
                    counts.0 += 1;
                } else {
                    counts.1 += 1;
                }
            }
        }
        counts
    }

    /// How many threads perf events sample, and why perf events are not
    /// used (if they are not).
    pub fn perf_status(&self) -> (usize, usize, Option<&str>) {
        (self.perf_fds.len(), self.timers.len(), self.perf_refusal.as_deref())
    }

    /// Stops sampling because the program replaced our handler with its
    /// own: timers and events go, the program's handler stays, and our
    /// buffers are freed once no handler of ours runs.
    pub fn abandon(self, timeout: Duration) -> bool {
        self.leave(timeout, false)
    }

    /// Takes the handler out of the process: no timer, no pending signal, no
    /// handler running, the previous disposition back. After this returns,
    /// no signal can reach the library's code. `false` if handlers were
    /// still running after `timeout` (the slots are then leaked, not freed).
    pub fn uninstall(self, timeout: Duration) -> bool {
        self.leave(timeout, true)
    }

    fn leave(mut self, timeout: Duration, restore: bool) -> bool {
        ENABLED.store(false, Ordering::SeqCst);
        for (_, timer) in std::mem::take(&mut self.timers) {
            delete_timer(timer);
        }
        for (_, fd) in std::mem::take(&mut self.perf_fds) {
            close_perf_event(fd);
        }
        if restore {
            // SAFETY: zeroed sigaction with SIG_IGN: setting a pending signal
            // to be ignored discards it on every thread (POSIX, and Linux
            // does so).
            unsafe {
                let mut ignore: libc::sigaction = std::mem::zeroed();
                ignore.sa_sigaction = libc::SIG_IGN;
                libc::sigemptyset(&mut ignore.sa_mask);
                libc::sigaction(SAMPLE_SIGNAL, &ignore, null_mut());
                libc::sigaction(SAMPLE_SIGNAL, &self.previous, null_mut());
            }
        }
        self.trampoline.target().store(self.trampoline.idle(), Ordering::SeqCst);
        let deadline = Instant::now() + timeout;
        let mut quiet = false;
        while Instant::now() < deadline {
            if self.trampoline.in_flight().load(Ordering::SeqCst) == 0 {
                quiet = true;
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        INSTALLED.store(false, Ordering::SeqCst);
        if !quiet {
            return false;
        }
        let map = MAP.swap(null_mut(), Ordering::SeqCst);
        if !map.is_null() {
            self.retired.push(map);
        }
        self.reclaim();
        debug_assert!(self.closing_perf.is_empty());
        for slot in SLOTS.iter().take(self.next_slot) {
            let p = slot.swap(null_mut(), Ordering::SeqCst);
            if !p.is_null() {
                // SAFETY: no signal is pending or can be raised, and no
                // handler is running (count at zero with the target idle).
                drop(unsafe { Box::from_raw(p) });
            }
        }
        POOL.destroy();
        true
    }
}

/// The kernel's `struct sigevent` (64 bytes) with `SIGEV_THREAD_ID`.
#[repr(C)]
struct KernelSigevent {
    value: usize,
    signo: c_int,
    notify: c_int,
    tid: c_int,
    pad: [c_int; 11],
}
const _: () = assert!(std::mem::size_of::<KernelSigevent>() == 64);
const SIGEV_THREAD_ID: c_int = 4;

/// A timer on thread `tid`'s CPU clock that signals that thread with
/// `slot` in `si_value`. Made with the raw system call: glibc's wrapper
/// would hand back its own id for the same thing.
fn create_cpu_timer(tid: u32, slot: usize) -> std::io::Result<i32> {
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
fn arm_timer_once(id: i32, delay_ns: u64) -> std::io::Result<()> {
    arm_timer(id, delay_ns, 0)
}

/// Arms the timer to fire after `delay_ns` more of the thread's CPU time,
/// then every `period_ns` (0: once); a zero delay disarms it. A system call
/// (on POSIX's async-signal-safe list: the handler re-arms with it).
fn arm_timer(id: i32, delay_ns: u64, period_ns: u64) -> std::io::Result<()> {
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
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
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
const PERF_EVENT_IOC_DISABLE: libc::c_ulong = 0x2401;
const PERF_EVENT_IOC_PERIOD: libc::c_ulong = 0x4008_2404;
const F_SETSIG: c_int = 10;
const F_SETOWN_EX: c_int = 15;
const F_OWNER_TID: c_int = 0;

/// A task-clock perf event on thread `tid` (its CPU time, measured with a
/// high-resolution timer). Kernel time counts too where the kernel lets an
/// unprivileged process measure it; else only user time does.
fn open_perf_event(tid: u32) -> std::io::Result<i32> {
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
const PERF_DATA_HEAD: usize = 1024;
const PERF_DATA_TAIL: usize = 1032;

/// Maps the event's ring buffer; its control page's address.
fn map_perf_ring(fd: i32) -> std::io::Result<usize> {
    // SAFETY: a fresh shared mapping of our own perf fd.
    let page =
        unsafe { libc::mmap(null_mut(), PERF_MMAP_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if page == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(page as usize)
}

fn unmap_perf_ring(page: usize) {
    if page != 0 {
        // SAFETY: a mapping made by `map_perf_ring`, no longer used.
        unsafe { libc::munmap(page as *mut c_void, PERF_MMAP_BYTES) };
    }
}

/// From the handler: marks every overflow record read (`data_tail =
/// data_head`). Two atomic accesses to the mapped control page; no system
/// call.
fn consume_perf_records(page: usize) {
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
fn start_perf_event(fd: i32, tid: u32, period_ns: u64) -> std::io::Result<()> {
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
fn set_perf_period(fd: i32, period_ns: u64) {
    // SAFETY: ioctl on our own fd with a valid pointer.
    unsafe { libc::ioctl(fd, PERF_EVENT_IOC_PERIOD, &period_ns as *const u64) };
}

/// Ends a perf event for good. Closing the fd alone is not enough: the ring
/// buffer's mapping keeps the event alive, still counting and signalling,
/// until the slot is freed; and after a detach, a `SIGPROF` that nobody
/// handles kills the process. So the event is disabled and its signal
/// delivery switched off first.
fn close_perf_event(fd: i32) {
    PERF_FDS[fd as usize].store(0, Ordering::Release);
    // SAFETY: ioctl, fcntl and close on our own fd.
    unsafe {
        libc::ioctl(fd, PERF_EVENT_IOC_DISABLE, 0);
        libc::fcntl(fd, libc::F_SETFL, 0);
        libc::close(fd);
    }
}

fn enable_perf_event(fd: i32, on: bool) {
    // SAFETY: ioctl on our own fd.
    unsafe { libc::ioctl(fd, if on { PERF_EVENT_IOC_ENABLE } else { PERF_EVENT_IOC_DISABLE }, 0) };
}

fn delete_timer(id: i32) {
    // SAFETY: deleting a timer id we created; errors are harmless.
    unsafe { libc::syscall(libc::SYS_timer_delete, id) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use corsnap_unwind::process::{native_module, parse_maps, stack_ranges, LoadedElf};
    use corsnap_unwind::{address_of, flags};

    /// A copy of a stack carries the original return address in place of a
    /// hijack that the walk did not meet, and nothing else is changed: not
    /// a slot below the copy, nor one that no longer holds the trampoline.
    #[test]
    fn a_hijack_the_walk_did_not_meet_is_found_for_the_copy() {
        const OFFSET: u64 = 0x118;
        let trampoline = 0x7000_1000u64;
        let original = 0x7000_5678u64;
        let stub = corsnap_unwind::HijackStub {
            range: trampoline..trampoline + 0x42,
            call_return: trampoline + 0x20,
            return_slot: 0x40,
            saved_bp: 0x38,
        };
        let map = CodeMap::new(Vec::new(), Vec::new(), Vec::new(), 0).with_hijack_stub(Some(stub));
        let mut stack = vec![0u64; 64];
        stack[40] = trampoline;
        let start = stack.as_ptr() as u64;
        let slot = start + 40 * 8;
        // The runtime's thread object: m_pvHJRetAddr, then m_ppvHJRetAddrPtr.
        let mut thread = vec![0u64; 64];
        thread[OFFSET as usize / 8] = original;
        thread[OFFSET as usize / 8 + 1] = slot;
        let runtime_thread = thread.as_ptr() as u64;
        let memory = LiveMemory { stack: start..start + 64 * 8, map: &map, runtime_thread };
        let before = HIJACK_FIELDS.swap(OFFSET, Ordering::Relaxed);
        assert_eq!(memory.hijack_in_stack(start), Some((slot, original)));
        // The slot lies below the copy's first word: not the copy's.
        assert_eq!(memory.hijack_in_stack(slot + 8), None);
        // The hijack was undone (the slot holds the original again).
        stack[40] = original;
        assert_eq!(memory.hijack_in_stack(start), None);
        // A thread the agent does not know.
        stack[40] = trampoline;
        let unknown = LiveMemory { runtime_thread: 0, ..memory };
        assert_eq!(unknown.hijack_in_stack(start), None);
        HIJACK_FIELDS.store(before, Ordering::Relaxed);
        std::hint::black_box((&stack, &thread));
    }

    /// Every native frame the row tables have a rule for unwinds as
    /// framehop unwinds it, as a leaf and as a return address: addresses all
    /// through this process's libraries (libc, libm, the loader, this test's
    /// own code), on a stack whose every word differs, so that a wrong
    /// offset reads a wrong value.
    #[test]
    fn native_frames_unwind_by_the_row_tables_as_by_framehop() {
        struct Distinct;
        impl corsnap_unwind::Memory for Distinct {
            fn stack_word(&self, addr: u64) -> Option<u64> {
                (0x10_0000..0x30_0000).contains(&addr).then(|| addr.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 8)
            }
            fn code_bytes(&self, _: &corsnap_unwind::ManagedCode, _: std::ops::Range<u64>) -> Option<&[u8]> {
                None
            }
        }
        let started = Instant::now();
        let map = own_code_map();
        let bytes = corsnap_unwind::native_table_bytes(&map);
        eprintln!("row tables: {bytes} bytes, built with the map in {:?}", started.elapsed());
        let (objects, _) = crate::process::loaded_objects();
        let mut cache = corsnap_unwind::WalkCache::new();
        let (mut compared, mut ends, mut wrong) = (0u64, 0u64, Vec::new());
        for o in &objects {
            for &(start, len, _) in o.segments.iter().filter(|s| s.2) {
                for address in (o.bias.wrapping_add(start)..o.bias.wrapping_add(start + len)).step_by(37) {
                    for exact in [true, false] {
                        // A return address is looked up one byte back, in the call.
                        let ip = if exact { address } else { address + 1 };
                        let regs = Regs { ip, sp: 0x18_0000, bp: 0x20_0000 };
                        let Some((table, framehop)) =
                            corsnap_unwind::native_frame_both_ways(&map, &Distinct, regs, exact, &mut cache)
                        else {
                            continue;
                        };
                        compared += 1;
                        ends += u64::from(table.is_some_and(|t| t.ip == 0));
                        let same = match framehop {
                            // framehop's end of the stack: a return address of 0.
                            Some(f) if f.ip == 0 => table.is_some_and(|t| t.ip == 0),
                            f => table == f,
                        };
                        if !same && wrong.len() < 10 {
                            wrong.push((o.name.clone(), address - o.bias, exact, table, framehop));
                        }
                    }
                }
            }
        }
        eprintln!("{compared} frames compared, {ends} of them at a row that ends the stack");
        assert!(compared > 20_000, "only {compared} frames had a rule");
        assert!(wrong.is_empty(), "{wrong:#x?}");
    }

    fn own_code_map() -> CodeMap {
        let (objects, _) = crate::process::loaded_objects();
        let natives = objects
            .iter()
            .filter_map(|o| {
                let elf =
                    LoadedElf { name: &o.name, bias: o.bias, segments: &o.segments, eh_frame_hdr: o.eh_frame_hdr };
                native_module(&elf, crate::process::read_own_bytes)
            })
            .collect();
        let maps = parse_maps(&std::fs::read_to_string("/proc/self/maps").unwrap());
        CodeMap::new(natives, Vec::new(), stack_ranges(&maps), SignalSampler::sigreturn_trampoline())
    }

    #[inline(never)]
    fn spin_leaf(stop: &AtomicBool) -> u64 {
        let mut x = 1u64;
        while !stop.load(Ordering::Relaxed) {
            for i in 0..1000u64 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
            }
        }
        x
    }

    #[inline(never)]
    fn spin_middle(stop: &AtomicBool) -> u64 {
        std::hint::black_box(spin_leaf(stop)) + 1
    }

    /// The whole path on this test process: install, a timer on a busy
    /// thread, walks in the handler, drain, and a clean uninstall.
    #[test]
    fn a_busy_thread_is_sampled_with_complete_native_stacks_and_uninstall_leaves_nothing() {
        let use_perf = std::env::var_os("CORSNAP_NO_PERF_EVENTS").is_none();
        let mut sampler = SignalSampler::install(use_perf).expect("SIGPROF is free in the test process");
        let stop = Arc::new(AtomicBool::new(false));
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let s = stop.clone();
        let worker = std::thread::spawn(move || {
            tid_tx.send(crate::current_os_tid()).unwrap();
            spin_middle(&s)
        });
        let tid = tid_rx.recv().unwrap();
        sampler.publish(Arc::new(own_code_map()));
        let slot = sampler.add_thread(tid, 1_000_000).unwrap();
        sampler.set_enabled(true);
        let started = Instant::now();
        let mut samples = Vec::new();
        let mut handler_ns: Vec<u64> = Vec::new();
        let mut scratch = Vec::new();
        while samples.len() < 50 && started.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
            sampler.slot(slot).unwrap().drain(&mut scratch, |s| {
                handler_ns.push(s.handler_ns);
                samples.push((s.flags, s.weight_ns, s.frames.to_vec()))
            });
        }
        assert!(samples.len() >= 50, "only {} samples", samples.len());
        handler_ns.sort_unstable();
        eprintln!(
            "handler: median {} ns, p90 {} ns, {} frames",
            handler_ns[handler_ns.len() / 2],
            handler_ns[handler_ns.len() * 9 / 10],
            samples[samples.len() / 2].2.len()
        );
        let (perf, timers, refusal) = sampler.perf_status();
        eprintln!("sampled by perf events: {perf}, by timers: {timers} ({refusal:?})");
        // Weights are CPU nanoseconds: around the 1 ms interval (perf events),
        // or whole scheduler ticks of it (timers, checked only at a tick).
        let mean = samples.iter().map(|s| s.1).sum::<u64>() / samples.len() as u64;
        assert!((400_000..=5_000_000).contains(&mean), "mean weight {mean} ns");
        let middle = spin_middle as fn(&AtomicBool) -> u64 as usize as u64;
        let in_middle = |f: &u64| (middle..middle + 512).contains(&address_of(*f));
        let complete = samples.iter().filter(|(fl, _, _)| fl & flags::COMPLETE != 0).count();
        let through_middle = samples.iter().filter(|(_, _, fr)| fr.iter().any(in_middle)).count();
        assert!(complete * 100 >= samples.len() * 95, "{complete} of {} complete", samples.len());
        assert!(
            through_middle * 100 >= samples.len() * 95,
            "{through_middle} of {} through spin_middle",
            samples.len()
        );
        // Moved to a timer and back (`--cpu-clock auto`), the thread goes on
        // being sampled, by one clock at a time.
        if perf == 1 {
            for (timer, expected) in [(true, (0, 1)), (false, (1, 0))] {
                assert!(sampler.set_thread_clock(slot, timer).unwrap());
                assert!(!sampler.set_thread_clock(slot, timer).unwrap(), "already on that clock");
                assert_eq!(sampler.clocks_in_use(), expected);
                sampler.slot(slot).unwrap().drain(&mut scratch, |_| {});
                let mut more = 0;
                let started = Instant::now();
                while more < 20 && started.elapsed() < Duration::from_secs(20) {
                    std::thread::sleep(Duration::from_millis(20));
                    sampler.slot(slot).unwrap().drain(&mut scratch, |s| {
                        assert_ne!(s.weight_ns, 0);
                        more += 1;
                    });
                }
                assert!(more >= 20, "only {more} samples after moving to timer={timer}");
            }
        }
        // The worker keeps running through the uninstall and after it: with
        // SIGPROF back to its default action, any late signal of ours (a
        // timer, a perf event kept alive by its mapping) would kill this
        // test process.
        assert!(sampler.uninstall(Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, Ordering::SeqCst);
        worker.join().unwrap();
        // SAFETY: querying into a zeroed struct.
        let mut now: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        unsafe { libc::sigaction(SAMPLE_SIGNAL, null_mut(), &mut now) };
        assert_eq!(now.sa_sigaction, libc::SIG_DFL, "the previous disposition is back");
        // A second install finds the same trampoline page.
        let again = SignalSampler::install(use_perf).unwrap();
        assert_eq!(std::fs::read_to_string("/proc/self/maps").unwrap().matches(TRAMPOLINE_NAME).count(), 2);
        assert!(again.uninstall(Duration::from_secs(5)));
    }
}
