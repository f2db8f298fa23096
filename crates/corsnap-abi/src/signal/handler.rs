//! The `SIGPROF` handler, which copies the interrupted thread's live stack
//! for the agent to walk (copy-first sampling), or walks it where it stands
//! when the copy cannot be made, and leaves the sample in the thread's ring.
//!
//! # Why the walk is the agent's
//!
//! At 100 samples a second everything a walk reads is cold, and each read
//! waits on the one before: the stack word gives the return address, the
//! return address the walk cache's line, the line the rule that finds the
//! next stack word. On this VM a cold read is 400 to 600 ns, and a
//! 30-frame exception stack (`taskfaults.cs`) cost 5 to 8 µs at the median.
//! A copy of the same stack reads it in order, which the CPU's prefetchers
//! stream, and writes it with streaming stores: `bench/walks.py` gave
//! handler medians of 3.8 against 5.3 µs (.NET 10) and 2.7 against 6.0 µs
//! (.NET 8) on `taskfaults.cs`, and lower medians and p99s on every program,
//! against the same build walking in the handler (`CORSNAP_WALK_IN_HANDLER=1`).
//! The agent's thread walks the copies one after another, its caches warm.
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
//! 3. The lines the next steps read one after another (the fd's entry in
//!    [`PERF_FDS`] or the slot's in [`SLOTS`], the map, then the slot's
//!    other lines and its perf page) are prefetched: a hint that reads
//!    nothing into the program and never faults, whatever the address, so
//!    their misses overlap. The slot is found in [`SLOTS`] (a static array
//!    of atomic pointers) and checked to belong to this thread: the first
//!    time by `gettid` (a plain system call), which then leaves the
//!    thread's `pthread_self` in the slot; after that by `pthread_self`
//!    alone, which in glibc reads the thread pointer (`%fs`) and takes no
//!    lock (0.2 to 0.3 µs less a sample here than the system call). Then
//!    the sample's weight: a perf event's period (one store marks its
//!    records read; every 64th sample an `ioctl` sets a new period), or a
//!    periodic timer's period times
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
//! 7. Copy-first ([`COPY_FIRST`], set by the agent): when the stack from 128
//!    bytes below the stack pointer (the red zone, which the kernel leaves
//!    alone, and where an epilogue's unwind rule may still find a register
//!    it popped) up to a little past the thread's root (the slot's
//!    `copy_end`, which the agent learns from its walks of the thread's
//!    copies; the mapping's end before that) fits a free run of the copy
//!    pool, the run is taken (a bounded compare-and-swap, [`copy_pool`]), the
//!    stack copied into it as in step 10, and a record with no frames
//!    published ([`DEFERRED`]). Otherwise (a stack deeper than two blocks,
//!    no run free) the handler walks, as below.
//! 8. `corsnap_unwind::walk` is safe Rust that never allocates (framehop with
//!    `MustNotAllocateDuringUnwind`, pe-unwind-info is `no_std`); it reads
//!    memory only through [`LiveMemory`], which allows that stack range and
//!    the code regions of the map, and nothing else; and, when a managed
//!    frame returns into native code, 16 bytes of the runtime's object for
//!    this thread, read with `process_vm_readv` (a system call, so an
//!    address no longer mapped is an error, never a fault) into the
//!    handler's stack, to undo a return-address hijack ([`hijacked_return`]).
//! 9. The time-stamp counter (`RDTSC`, one instruction that reads no
//!    memory) is read at entry, and once more just before the record is
//!    published, which gives both the sample's time and the handler's own
//!    (storing included); the agent converts them ([`sample_time`]). Where
//!    the kernel does not keep time by the counter, the sample's time is
//!    `clock_gettime(CLOCK_MONOTONIC)`, on POSIX's async-signal-safe list.
//! 10. The frames go into the slot's single-producer ring with relaxed stores
//!     and one release store (the ring, the slot and the copy pool had
//!     their pages mapped when the sampler made them, not at a first touch
//!     here); a full ring drops the sample and counts it. A
//!     stack copy goes into a block of the shared pool, taken with a bounded
//!     compare-and-swap and written 16 bytes at a time with streaming stores,
//!     then a store fence, before the record is published ([`copy_pool`]).
//!     When a copy meets the hijack trampoline among the words it copies
//!     (only then), the same 16 bytes of the thread object are read once
//!     more, the same way, to put back a hijack the walk did not meet
//!     ([`LiveMemory::copy_into`], [`LiveMemory::copied_word`]).
//!     A stretch of code the walk learned at its leaf, and the return
//!     addresses it looked up in full, go into the slot's mailboxes for the
//!     agent the same way (relaxed stores, one release store; a full mailbox
//!     drops them): the handler writes nothing that other threads' handlers
//!     read ([`LearnedMailbox`]). The slot's counters are on its own lines,
//!     which only the agent reads: samples, a relaxed atomic add; what the
//!     walk found where (`walk_counts`), which no other thread writes, a
//!     relaxed load and store.
//!
//! The slot's walk cache and scratch buffer are touched only by the handler
//! on the slot's own thread, and a handler never interrupts itself: `SIGPROF`
//! stays blocked while its handler runs (no `SA_NODEFER`).

use super::*;

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
        let trampoline = self.hijack_trampoline();
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

impl LiveMemory<'_> {
    /// The runtime's hijack trampoline, as the map found it or a walk
    /// learned it; 0 while unknown.
    pub(crate) fn hijack_trampoline(&self) -> u64 {
        self.map.hijack_trampoline().unwrap_or_else(|| HIJACK_TRAMPOLINE.load(Ordering::Relaxed))
    }

    /// Word `i` of a copy of this stack from `sp` up, with a hijacked return
    /// address put back: the one the walk undid (`hijack`), or, the first
    /// time the trampoline turns up among the words, the one the thread
    /// object says it replaced ([`Self::hijack_in_stack`]). Its slot holds
    /// the trampoline, so a copy that never meets the trampoline needs no
    /// look at the thread object: that look (`process_vm_readv`, 17 to 60
    /// µs here, waiting on the process's `mmap_lock` behind the collector's
    /// `madvise` calls) was made before every copy, and set the handler's
    /// p99. Async-signal-safe: one read of this stack, and at most once a
    /// copy [`Self::hijack_in_stack`].
    pub(crate) fn copied_word(&self, sp: u64, i: usize, hijack: &mut CopyHijack) -> u64 {
        let address = sp.wrapping_add(8 * i as u64);
        let word = self.stack_word(address).unwrap_or(0);
        if let CopyHijack::NotLooked { trampoline } = *hijack {
            if word == trampoline && trampoline != 0 {
                *hijack = CopyHijack::Known(self.hijack_in_stack(sp));
            }
        }
        match *hijack {
            CopyHijack::Known(Some((slot, original))) if slot == address => original,
            _ => word,
        }
    }
}

impl LiveMemory<'_> {
    /// Copies `words` words of this stack from `sp` up into `block`, with a
    /// hijacked return address put back as [`Self::copied_word`] does: the
    /// words copied at once, then the trampoline looked for among them
    /// (only if the walk did not undo the hijack already), then the one
    /// slot written again. Async-signal-safe: loads, streaming and plain
    /// stores, a store fence ([`Block::copy_from`]), and at most once
    /// [`Self::hijack_in_stack`].
    pub(super) fn copy_into(&self, sp: u64, words: usize, hijack: &mut CopyHijack, block: &Block) {
        let end = sp.saturating_add(8 * words as u64).min(self.stack.end);
        let copied = if self.stack.contains(&sp) && end > sp {
            // SAFETY: `sp..end` lies in the mapping that holds this thread's
            // stack pointer, above the signal frame this handler runs on:
            // the thread is us, and nothing else writes there while we run.
            unsafe { block.copy_from(sp..end) }
        } else {
            0
        };
        // Words the stack did not hold are 0, as word by word: the record
        // says `words`, and the block still holds an older copy.
        for i in copied..words {
            block.store(i, 0);
        }
        if let Some((i, original)) = self.hijack_in_copy(sp, copied, hijack, |t| block.contains(copied, t)) {
            block.store(i, original);
        }
    }

    /// `words` words of this stack from `sp` up, as [`Self::copy_into`]
    /// copies them into a block, into a new vector: for a walk of the
    /// calling thread's own stack outside a signal handler (events), which
    /// may allocate. One copy of the whole range, where a word at a time
    /// (each bounds-checked, each pushed) cost about 8 ns a word: 23 µs for
    /// the 3,000 words of a `validate` exception's stack on .NET 10.
    pub(crate) fn copy_own_stack(&self, sp: u64, words: usize, hijack: &mut CopyHijack) -> Vec<u64> {
        let end = sp.saturating_add(8 * words as u64).min(self.stack.end);
        let mut copy = Vec::with_capacity(words);
        if sp.is_multiple_of(8) && self.stack.contains(&sp) && end > sp {
            let n = (((end - sp) / 8) as usize).min(words);
            // SAFETY: `sp..end` lies in the mapping that holds this
            // thread's stack pointer, from a stack pointer this thread took
            // in a frame it has not left: mapped, aligned, and written by no
            // other thread. `copy` has room for `words` >= `n` words, and its
            // first `n` are written before its length says so.
            unsafe {
                std::ptr::copy_nonoverlapping(sp as *const u64, copy.as_mut_ptr(), n);
                copy.set_len(n);
            }
        } else {
            copy.extend((0..words).map(|i| self.stack_word(sp.wrapping_add(8 * i as u64)).unwrap_or(0)));
        }
        // Words the stack did not hold are 0, as word by word.
        copy.resize(words, 0);
        if let Some((i, original)) = self.hijack_in_copy(sp, words, hijack, |t| copy.contains(&t)) {
            copy[i] = original;
        }
        copy
    }

    /// After a copy of the stack from `sp` up, of which the first `copied`
    /// words came from the stack: where a hijacked return address is to be
    /// put back, as (index in the copy, original). The hijack is looked up
    /// ([`Self::hijack_in_stack`], once) only when the walk did not undo it
    /// already and `holds` says the copy holds the trampoline. What
    /// [`Self::copy_into`] and [`Self::copy_own_stack`] share.
    fn hijack_in_copy(
        &self,
        sp: u64,
        copied: usize,
        hijack: &mut CopyHijack,
        holds: impl FnOnce(u64) -> bool,
    ) -> Option<(usize, u64)> {
        if let CopyHijack::NotLooked { trampoline } = *hijack {
            if trampoline != 0 && holds(trampoline) {
                *hijack = CopyHijack::Known(self.hijack_in_stack(sp));
            }
        }
        let CopyHijack::Known(Some((slot, original))) = *hijack else { return None };
        let offset = slot.wrapping_sub(sp);
        let i = (offset / 8) as usize;
        (slot >= sp && offset % 8 == 0 && i < copied).then_some((i, original))
    }
}

/// What a stack copy knows of a hijacked return address in it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CopyHijack {
    /// Not looked for yet: looked for when `trampoline` turns up.
    NotLooked { trampoline: u64 },
    /// Looked for (or undone by the walk): the slot and the original.
    Known(Option<(u64, u64)>),
}

impl CopyHijack {
    /// The walk's undone hijack if it met one, else one to look for when
    /// the copy meets the trampoline.
    pub(crate) fn new(undone_by_walk: Option<(u64, u64)>, memory: &LiveMemory<'_>) -> CopyHijack {
        match undone_by_walk {
            Some(h) => CopyHijack::Known(Some(h)),
            None => CopyHijack::NotLooked { trampoline: memory.hijack_trampoline() },
        }
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
        prefetch(addr as usize);
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

/// Asks for the cache line at `addr` (any address: a prefetch never
/// faults).
#[inline(always)]
fn prefetch(addr: usize) {
    // SAFETY: PREFETCHT0 is a hint: it never faults, whatever the address
    // (Intel SDM vol. 2, PREFETCHh), and reads nothing back.
    unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8) };
}

/// The signal handler, entered through the trampoline. Every step is listed
/// in the module documentation.
pub(super) extern "C" fn on_signal(_signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
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
    let raw = info as *const u8;
    // At 100 Hz everything below is cold, and each step's address comes
    // from the last: the fd's slot index, the slot, its clock's page, the
    // map. Their first lines are asked for now, together, so that their
    // misses overlap (with each other) instead of
    // coming one after another. A prefetch never faults, so a wrong or null
    // address costs nothing but the request.
    // SAFETY: offsets inside the 128-byte siginfo_t (asserted above).
    let (first_code, first_value) = unsafe {
        (
            (raw.add(SI_CODE_OFFSET) as *const c_int).read_unaligned(),
            (raw.add(SI_VALUE_OFFSET) as *const usize).read_unaligned(),
        )
    };
    if matches!(first_code, POLL_IN | POLL_HUP) {
        // si_fd shares its offset with si_value's low half.
        prefetch(PERF_FDS.as_ptr().wrapping_add(first_value & 0xffff_ffff) as usize);
    } else {
        prefetch(SLOTS.as_ptr().wrapping_add(first_value & 0xffff_ffff) as usize);
    }
    prefetch(MAP.load(Ordering::Relaxed) as usize);
    let entered = sample_time::counter();
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
    // The slot's other lines the clock and the walk read next (see the
    // first prefetches), asked for while its first one is on its way.
    prefetch(slot as *const ThreadSlot as usize + 64);
    prefetch(slot.walking.get() as usize);
    prefetch(slot.walking.get() as usize + 64);
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
    // The perf event's control page, which the weight's step writes.
    prefetch(slot.perf_page.load(Ordering::Relaxed).wrapping_add(PERF_DATA_HEAD));
    // SAFETY: only this thread's handler touches `walking` (tid checked
    // above), and it cannot be re-entered while SIGPROF is blocked.
    let walking = unsafe { &mut *slot.walking.get() };
    walking.cache.prefetch_for_walk(|at| prefetch(at as usize));
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
        // ~10 µs on some kernels, so it changes every
        // PERF_PERIOD_CHANGE_EVERY samples. The overflow records are marked
        // read with one store.
        let elapsed = slot.perf_period_ns.load(Ordering::Relaxed);
        walking.samples += 1;
        if walking.samples % PERF_PERIOD_CHANGE_EVERY == 0 {
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
    map.prefetch_for_walk(|at| prefetch(at as usize));
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
    let stack_words = (((stack.end - regs.sp) / 8) as usize).min(STACK_COPY_WORDS);
    let memory = LiveMemory { stack, map, runtime_thread: slot.runtime_thread.load(Ordering::Relaxed) };
    // With the red zone below the stack pointer: a leaf in an epilogue may
    // have popped a register its unwind rule still reads from there (CFI
    // that says the frame pointer is saved at CFA - 16 after `pop rbp`).
    let copy_start = regs.sp.saturating_sub(RED_ZONE_BYTES).max(memory.stack.start);
    let root_end = slot.copy_end.load(Ordering::Relaxed);
    let copy_end = if root_end > regs.sp && root_end <= memory.stack.end { root_end } else { memory.stack.end };
    let copy_words = ((copy_end - copy_start) / 8) as usize;
    if COPY_FIRST.load(Ordering::Relaxed) && copy_words <= STACK_COPY_WORDS {
        // The whole live stack, copied with streaming stores, costs less
        // than the walk's dependent cold reads: the agent walks the copy.
        if let Some(block) = POOL.take(copy_words) {
            if block.capacity() < copy_words {
                // Only one block was free: walk here rather than cut.
                POOL.release(block.index, block.capacity());
            } else {
                let flags = DEFERRED | if requested { REQUESTED } else { 0 };
                let copy = StackToCopy {
                    regs,
                    words: copy_words,
                    min_words: copy_words,
                    memory: &memory,
                    hijack: CopyHijack::new(None, &memory),
                    known_frames: 0,
                    splice: None,
                };
                let head = [u64::from(flags) << 32, weight_ns, 0, 0, 0];
                if slot.ring.push_deferred(head, copy_start, copy, block, entered) {
                    slot.samples.fetch_add(1, Ordering::Relaxed);
                    if requested {
                        slot.requested_samples.fetch_add(1, Ordering::Release);
                    }
                } else {
                    slot.dropped_full.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
        }
    }
    let walk = corsnap_unwind::walk(map, &memory, regs, &mut walking.cache, &mut walking.frames);
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
        hijack: CopyHijack::new(walk.undone_hijack, &memory),
        known_frames: walk.known_frames,
        splice: walk.splice.map(|(i, at)| (i, at.sp)),
    });
    if slot.ring.push([header, weight_ns, 0, 0, 0], frames, copy, entered) {
        slot.samples.fetch_add(1, Ordering::Relaxed);
        // Only this handler writes them: a load and a store, no locked
        // instruction.
        let counts = [
            u64::from(walk.leaf_by_stretch),
            walk.looked_up.into(),
            walk.from_process_table.into(),
            walk.by_body_rule.into(),
            walk.len.saturating_sub(walk.path_frames + walk.rest_frames) as u64,
            walk.rest_frames as u64,
            u64::from(walk.leaf_by_granule),
        ];
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
