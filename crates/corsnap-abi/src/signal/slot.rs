//! One sampled thread's slot: what its handler reads and writes (the clock,
//! the walk cache, the mailboxes for what walks learned), and the agent's
//! side of it (draining its ring, keeping what it learned).

use super::*;

/// One sampled thread: its walk scratch (used only by the handler on that
/// thread) and the ring the agent drains.
///
/// In declaration order (`repr(C)`): what the handler reads at every sample
/// comes first, then [`Walking`], whose own first fields are the handler's
/// too, so that they share two or three adjacent cache lines. At 100 Hz each
/// line the handler touches is a miss of its own.
#[repr(C)]
pub struct ThreadSlot {
    pub(super) tid: u32,
    /// The thread's `pthread_self`, once its handler has checked `tid` with
    /// `gettid` (0 before): the cheaper check from then on.
    pub(super) owner: AtomicUsize,
    /// The perf event that samples this thread, or -1 (a POSIX timer
    /// does). Changed only by the agent ([`Sampler::set_thread_clock`]),
    /// which closes a replaced event once no handler can be using it.
    pub(super) perf_fd: AtomicI32,
    /// Its ring buffer's control page (0 without one): the handler marks
    /// each overflow record read, so the event never stops for a full
    /// buffer and needs no system call to go on.
    pub(super) perf_page: AtomicUsize,
    /// The period the perf event is running now (the weight of its next
    /// sample). Set by the handler as it changes it, read by the agent
    /// when it starts a new event for the thread.
    pub(super) perf_period_ns: AtomicU64,
    /// The mean CPU time between samples, in nanoseconds.
    pub(super) interval_ns: AtomicU64,
    /// The POSIX timer that samples this thread (-1: none yet, or a perf
    /// event does). Periodic: the handler draws a new random period every
    /// [`PERIOD_CHANGE_EVERY`] samples (see [`TimerState`]).
    pub(super) timer_id: std::sync::atomic::AtomicI32,
    /// Which clock samples the thread now: [`CLOCK_PERF`] or
    /// [`CLOCK_TIMER`]. A thread with a perf event may be moved to a timer
    /// and back ([`Sampler::set_thread_clock`]); the handler re-arms the
    /// timer only while it is the clock.
    pub(super) clock: AtomicU8,
    /// The thread's CPU time when the agent last armed the timer (at the
    /// start, when the timer became the clock, when sampling resumed): the
    /// first sample after weighs exactly the CPU time since.
    pub(super) timer_base_ns: AtomicU64,
    /// How many times the agent has armed the timer: stored after
    /// `timer_base_ns`, so a handler that sees a new count reads the base
    /// that came with it.
    pub(super) timer_arms: AtomicU64,
    /// The runtime's object for this thread (its `ThreadID`), 0 if none is
    /// known: where a hijacked return address is kept.
    pub(super) runtime_thread: AtomicU64,
    /// How far up the stack a copy for a deferred walk goes: a little past
    /// the deepest root the agent's walks of this thread's copies reached
    /// (0 while none has: then to the stack mapping's end, which on a
    /// thread-pool thread holds its thread-local storage, about as much
    /// again as the frames).
    pub(super) copy_end: AtomicU64,
    /// Leaf stretches the handler's walks learned, for the agent to keep
    /// in the map's leaf table, which every thread's walks read.
    pub(super) learned: LearnedMailbox<4, LEARNED_STRETCHES>,
    /// Return addresses the handler's walks looked up in full, for the
    /// agent to keep in the map's table of them, which every thread's walks
    /// read.
    pub(super) learned_addresses: LearnedMailbox<3, LEARNED_ADDRESSES>,
    /// Samples written.
    pub samples: AtomicU64,
    /// Of the walks, how many took their leaf's step from a kept stretch;
    /// the return addresses they looked up (in no table), those they took
    /// from the process's table, and the frames stepped by a compiled body
    /// rule (see [`corsnap_unwind::Walk`]), the frames it stepped one by one
    /// and those it took from the last complete walk, and how many took
    /// their leaf's step from its native module's granule: what the
    /// handler's cost follows.
    pub walk_counts: [AtomicU64; 7],
    pub(super) walking: UnsafeCell<Walking>,
    /// Of those, samples taken on request ([`Sampler::request_sample`]):
    /// what a request waits on, since a timer's sample may land meanwhile.
    pub requested_samples: AtomicU64,
    /// Samples dropped because the ring was full.
    pub dropped_full: AtomicU64,
    /// Signals whose stack pointer was in no known stack mapping.
    pub unknown_stack: AtomicU64,
    pub(super) ring: Ring,
}

/// The handler's own state for one thread; the fields it uses at every
/// sample first (see [`ThreadSlot`]).
#[repr(C)]
pub(super) struct Walking {
    /// The state of the generator that dithers the sampling periods.
    pub(super) rng: u64,
    pub(super) samples: u64,
    pub(super) timer: TimerState,
    /// The thread's stack mapping as the map of generation
    /// `stack_generation` lists it: found again without a search of the
    /// map's list while the map is the same (0: none yet).
    pub(super) stack_generation: u64,
    pub(super) stack: std::ops::Range<u64>,
    pub(super) frames: [u64; MAX_FRAMES],
    pub(super) cache: WalkCache,
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
pub(super) struct LearnedMailbox<const W: usize, const N: usize> {
    /// Records put in, and taken out, since the slot was made.
    pub(super) head: AtomicU64,
    pub(super) tail: AtomicU64,
    pub(super) words: [[AtomicU64; W]; N],
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
    pub(super) fn push(&self, words: [u64; W]) {
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
    pub(super) fn take(&self, mut f: impl FnMut([u64; W])) {
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
pub(super) struct TimerState {
    /// `ThreadSlot::timer_arms` when the handler last re-armed the timer.
    pub(super) arms_seen: u64,
    /// The period the handler armed (0: it has not, or that failed).
    pub(super) period_ns: u64,
    /// The interval that period was drawn for.
    pub(super) interval_ns: u64,
    /// The thread's CPU time at the expiry of its last sample, as the
    /// kernel schedules expiries (last read clock, plus the periods since).
    pub(super) base_ns: u64,
    /// Samples since the period last changed.
    pub(super) samples: u64,
}

/// [`ThreadSlot::clock`]: a perf event samples the thread.
pub(super) const CLOCK_PERF: u8 = 0;
/// [`ThreadSlot::clock`]: a POSIX CPU timer samples the thread.
pub(super) const CLOCK_TIMER: u8 = 1;

/// Samples between changes of a timer's period (a `timer_settime`, 1 to 2
/// µs).
pub(super) const PERIOD_CHANGE_EVERY: u64 = 16;

/// Samples between changes of a perf event's period. The change is an
/// `ioctl` (`PERF_EVENT_IOC_PERIOD`) that stops and restarts the event's
/// timer, 10 µs or more in this VM: every 16th sample, it was a fifth to a
/// third of the samples between the handler's p90 and p99 (pool.cs and
/// taskfaults.cs, .NET 10). Each thread starts at a period of its own, and
/// a new one every 64 samples still keeps a program whose work repeats at
/// the period from being seen at the same point of it for long (0.64 s at
/// 100 Hz).
pub(super) const PERF_PERIOD_CHANGE_EVERY: u64 = 64;

/// A period drawn uniformly from 0.75 to 1.25 times the interval (xorshift).
pub(super) fn dithered_period(rng: &mut u64, interval_ns: u64) -> u64 {
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
    pub(super) fn timer_rebased(&self) {
        self.timer_base_ns.store(crate::thread_cpu_time_ns(self.tid).unwrap_or(0), Ordering::Relaxed);
        self.timer_arms.fetch_add(1, Ordering::Release);
    }

    /// Disarms the thread's timer from its handler, when sampling is off or
    /// the timer is not the clock: else it would go on signalling. But the
    /// agent may have just armed it (it turns sampling on, or makes the
    /// timer the clock, then arms it): if both hold once it is disarmed, it
    /// is armed again, once, one interval ahead. Async-signal-safe: one or
    /// two `timer_settime`.
    pub(super) fn stop_timer(&self) {
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
            if let Some((block, words)) = record.pooled {
                POOL.release(block, words);
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

impl ThreadSlot {
    /// A walk of this thread's stack reached its root at stack pointer
    /// `root_sp`: copies for deferred walks need go no further (with a
    /// margin for the root frame's own words). A thread's root does not
    /// move, so the deepest seen is kept.
    pub fn note_stack_root(&self, root_sp: u64) {
        self.copy_end.fetch_max(root_sp.saturating_add(ROOT_SLACK_BYTES), Ordering::Relaxed);
    }

    /// A walk of one of this thread's copies did not reach a root: perhaps
    /// because the copy ended short of it. The next copies go to the
    /// stack mapping's end until a walk reaches a root again.
    pub fn forget_stack_root(&self) {
        self.copy_end.store(0, Ordering::Relaxed);
    }

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
        if t >= h {
            return;
        }
        // Only for a ring with records: most threads of a large process
        // have none at a given drain.
        let clock = sample_time::counter_to_ns();
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
            let flags = (word(0) >> 32) as u32;
            let stack = (record.copied >= COPY_HEAD).then(|| StackCopy {
                regs: Regs { ip: rest[0], sp: rest[1], bp: rest[2] },
                start: if flags & DEFERRED != 0 { rest[4] } else { rest[1] },
                words: &rest[COPY_HEAD..],
                splice: (rest[3] != u64::MAX).then_some((rest[3] as usize, rest[4])),
                from_leaf: true,
            });
            f(RawSample {
                weight_ns: word(1),
                time_ns: if ring.counter_time { clock.time_ns(word(2)) } else { word(2) },
                handler_ns: clock.duration_ns(word(3)),
                flags: (word(0) >> 32) as u32,
                frames,
                stack,
            });
            t += record.words();
        }
        ring.tail.store(t, Ordering::Release);
    }
}
