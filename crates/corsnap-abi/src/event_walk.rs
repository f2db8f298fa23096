//! Walks of the calling thread's own stack, for events (an exception thrown,
//! an allocation tick, a class loaded, a collection triggered): corsnap's
//! unwinder, the signal engine's, run synchronously inside the runtime's
//! callback on the thread the event happens on, instead of a
//! `DoStackSnapshot`.
//!
//! # What a walk does, and why it is safe on any thread at any time
//!
//! [`walk_own_stack`] runs inside a profiler callback: the runtime holds
//! whatever locks it holds there, and other threads may be walking too. So:
//!
//! 1. It borrows a walker (a walk cache and a frame buffer) from a fixed
//!    pool ([`CACHE_POOL`], every walker made at install) by swapping a
//!    slot's pointer with null, and gives it back by storing it again: a
//!    try, never a wait. With every walker out (more threads walking at once
//!    than the pool holds) it makes one. The caches remember the paths their
//!    walks took (`corsnap_unwind::WalkCache::remember_paths`). The agent's
//!    thread takes walkers out the same way, for a moment, to read the
//!    events counted on their kept walks ([`take_repeats`]); a walk that
//!    finds a slot empty goes on to the next.
//! 2. Having the walker counts it in: only then does it load the published
//!    map ([`MAP`], an atomic pointer). The agent (on its thread, or on one
//!    it lends its event walker to, one at a time: a thread that compiled
//!    a method, or whose event met code not known yet) frees a replaced
//!    map only after seeing, after the swap, every walker back in the pool (both
//!    sides `SeqCst`; giving back is a release, seen by the agent's load),
//!    so the map stays alive for the walk. A walk on a walker of its own
//!    counts itself in with one atomic add on its thread's [`Stripe`]
//!    instead, and the agent waits for every stripe's count to be zero too.
//!    (Every walk used to count itself on its stripe: two more locked
//!    instructions an event, which wait for the frames written before them,
//!    0.3% of the CPU of an exception storm on .NET 10.) One stripe per
//!    thread (nearly: threads share one by a hash of their thread pointer),
//!    each on a cache line of its own, because one count for all made two
//!    threads throwing at once pass its line between their cores.
//! 3. It takes its own registers with three instructions (`lea` of `rip`,
//!    `mov` of `rsp` and `rbp`) inside this function's body: at that
//!    instruction the function's `.eh_frame` describes exactly that `rsp`,
//!    so the walk starts here and unwinds the agent's frames, the runtime's
//!    native frames (`.eh_frame`) and the managed ones (their `UNWIND_INFO`),
//!    as the signal handler does from an interrupted context.
//! 4. The stack is bounded by the mapping the map lists for this stack
//!    pointer, cut to the bounds the thread library gives for this thread
//!    (`pthread_getattr_np`, asked once per thread: a mapping may have
//!    merged with a neighbour that is unmapped since; not the main
//!    thread's, whose `[stack]` merges with nothing); for a stack the map
//!    does not list yet (a thread newer than the map), by those bounds
//!    alone, and the agent reads the stacks again at its next round. Only
//!    when the thread library cannot say is the walk refused
//!    ([`OwnWalkError::UnknownStack`]), the agent woken to read the stacks,
//!    and the caller falls back to `DoStackSnapshot`.
//! 5. Memory is read only through the signal handler's `LiveMemory`: this
//!    thread's stack mapping and the code regions of the map; a hijacked
//!    return address is undone from the runtime's thread object as there.
//! 6. Nothing allocates unless the walk met code the map does not know yet:
//!    then, and only then, the stack (as deep as the walk went) is copied
//!    into the caller's vector, so the agent can learn that code and walk
//!    the copy again, as it does for signal samples. The guesses the walk
//!    made past unknown code are never kept as fact.

use std::cell::Cell;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corsnap_unwind::{lookup_address, CodeMap, Regs, Walk, WalkCache};

use crate::signal::{LiveMemory, MAX_FRAMES};

mod express;
mod replay;

pub use express::count_on_ticket;
pub use replay::{Counted, Repeats};

/// The map event walks read; replaced whole, freed only when no walk runs.
static MAP: AtomicPtr<CodeMap> = AtomicPtr::new(null_mut());
/// A thread's count of its walks running now.
#[repr(align(64))]
struct Stripe {
    in_flight: AtomicU64,
}

const STRIPES: usize = 16;
static STRIPE: [Stripe; STRIPES] = [const { Stripe { in_flight: AtomicU64::new(0) } }; STRIPES];

/// The calling thread's stripe, by a hash of its thread pointer.
fn own_stripe() -> &'static Stripe {
    &STRIPE[(crate::thread_hash() >> 60) as usize % STRIPES]
}

/// Whether no walk can be using a map replaced before the call: every
/// pooled walker is in the pool (all are made at install, so an empty slot
/// is a walker lent out), and no stripe counts a walk on a walker of its
/// own.
fn none_in_flight() -> bool {
    CACHE_POOL.iter().all(|slot| !slot.0.load(Ordering::SeqCst).is_null())
        && STRIPE.iter().all(|s| s.in_flight.load(Ordering::SeqCst) == 0)
}
/// Walk caches, with their frame buffers, lent to walks (null: lent out, or
/// none made).
const POOL: usize = 32;
static CACHE_POOL: [PoolSlot; POOL] = [const { PoolSlot(AtomicPtr::new(null_mut())) }; POOL];

/// A pool slot on a cache line of its own: threads borrowing neighbouring
/// slots at every event would otherwise pass one line between their cores.
#[repr(align(64))]
struct PoolSlot(AtomicPtr<Walker>);

/// Words before the frames in the buffer a walk hands its caller, for the
/// caller's own use (the head of a tally's key).
pub const HEAD_ROOM: usize = 8;

/// What a walk borrows from the pool: its cache, and the buffer its frames
/// go to (reused: an 8 KiB array zeroed on the stack at every event was
/// measured at a few percent of an exception storm's time).
struct Walker {
    cache: WalkCache,
    words: [u64; HEAD_ROOM + MAX_FRAMES],
    /// The bounds of its last walk's stack (the map's mapping cut to the
    /// thread library's bounds), the map generation they were found in and
    /// the thread they are of (its `pthread_self`): a thread mostly borrows
    /// the same walker, and the search of the map's stacks was cold at every
    /// event (the thread library's bounds, a thread-local, cost a
    /// `__tls_get_addr` call each).
    stack: Option<(u64, u64, std::ops::Range<u64>)>,
    /// Its walks, their frames, the frames taken from remembered paths and
    /// from the last walk's deep end, and the walks replayed (plain counts:
    /// the walker is one walk's alone; summed into [`TOTALS`] when the pool
    /// is emptied).
    counts: [u64; 5],
    /// Its last walks that can be replayed ([`replay`]).
    replays: replay::Replays,
}

impl Walker {
    fn new() -> Box<Walker> {
        let mut cache = WalkCache::new();
        cache.remember_paths();
        Box::new(Walker {
            cache,
            words: [0; HEAD_ROOM + MAX_FRAMES],
            stack: None,
            counts: [0; 5],
            replays: replay::Replays::new(),
        })
    }

    /// The bounds its last walk found for the stack holding `sp`, in the
    /// same map, if that walk was `thread`'s. (By thread, not only by stack
    /// pointer: a thread that ended may leave its place to another whose
    /// stack overlaps its own and ends elsewhere. A thread pointer is in its
    /// stack's mapping, at its top end, so a later thread with the same
    /// pointer has a stack that ends where the bounds do, and a walk reads
    /// only from its stack pointer up.)
    #[inline]
    fn last_stack(&self, generation: u64, thread: u64, sp: u64) -> Option<std::ops::Range<u64>> {
        let (found_in, found_by, stack) = self.stack.as_ref()?;
        (*found_in == generation && *found_by == thread && stack.contains(&sp)).then(|| stack.clone())
    }

    /// Adds its counts to [`TOTALS`].
    fn count_out(&mut self) {
        for (total, count) in TOTALS.iter().zip(std::mem::take(&mut self.counts)) {
            total.fetch_add(count, Ordering::Relaxed);
        }
    }
}

/// Walks, frames, frames from remembered paths and from last walks, and
/// walks replayed, of walkers no longer in the pool.
static TOTALS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
/// Set by a walk whose stack the map does not list: the agent reads the
/// process's stacks again and publishes.
static STACKS_STALE: AtomicBool = AtomicBool::new(false);
/// Set by a walk that met code the map does not know, until the next map is
/// published.
static CODE_UNKNOWN: AtomicBool = AtomicBool::new(false);
/// Set with [`STACKS_STALE`] or [`CODE_UNKNOWN`] until the agent was asked
/// to wake for it.
static WAKE_WANTED: AtomicBool = AtomicBool::new(false);
/// Walks whose stack the map did not list (they fell back).
static UNKNOWN_STACKS: AtomicU64 = AtomicU64::new(0);
/// Walks whose stack the map did not list, served by the thread library's.
static OWN_STACKS: AtomicU64 = AtomicU64::new(0);
/// Walks made before the first map was published (they fell back).
static NO_MAP: AtomicU64 = AtomicU64::new(0);
/// Walks that used a cache of their own (the pool was empty).
static POOL_EMPTY: AtomicU64 = AtomicU64::new(0);
/// Frames of native code at the leaf that walks stepped one by one (not
/// replayed, not from a remembered path): what the modules' row tables
/// would have made cheaper. Live, unlike [`TOTALS`]: the agent compiles
/// the tables once these frames have cost about what compiling them does
/// (see `corsnap_agent::event_walks::TABLES_AFTER_NATIVE_FRAMES`).
static NATIVE_FRAMES_STEPPED: AtomicU64 = AtomicU64::new(0);

/// Frames of native code at the leaf that event walks stepped one by one
/// so far (see [`NATIVE_FRAMES_STEPPED`]).
pub fn native_frames_stepped() -> u64 {
    NATIVE_FRAMES_STEPPED.load(Ordering::Relaxed)
}

/// Words of stack kept at most when a walk met unknown code and still
/// reached the root (256 KiB): the copy goes as deep as the walk went. An
/// exception thrown in a catch block sits on the first one's dispatch, and
/// its stack is deeper than the signal handler's 32 KiB copies.
pub const MAX_COPY_WORDS: usize = 32768;
/// Words kept of a walk that met unknown code and did not reach the root
/// (32 KiB, as the signal handler keeps): how far its guesses reach is
/// unknown, and a copy is made at every such event until the code is
/// learned.
const LOST_COPY_WORDS: usize = 4096;
/// Words copied beyond the deepest frame a complete walk reached.
const COPY_SLACK_WORDS: usize = 64;

/// Why a walk of one's own stack could not be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnWalkError {
    /// No map is published (the walker is not running).
    NoMap,
    /// The stack pointer is in no stack the map lists.
    UnknownStack,
}

/// A walk that met code not known yet keeps this of its stack.
#[derive(Debug, Clone)]
pub struct OwnStackCopy {
    /// The registers at the first frame in unknown code (a caller's frame:
    /// `ip` is a return address) or, when the walk could not say where that
    /// was, at the leaf (`from_frame` 0).
    pub regs: Regs,
    /// How many of the walk's frames (after the leading native frames were
    /// dropped) come before `regs`: found by unwind information, they stand
    /// as they are, and only the stack from `regs.sp` up is kept. (The
    /// frames between an event's callback and the code it happened in, the
    /// runtime's exception dispatch among them, took most of the 24 KiB a
    /// `validate` exception's copy held on .NET 10; from the unknown frame
    /// to the root, 2 to 3 KiB are left; ARCHITECTURE.md, *Event stacks*.)
    pub from_frame: usize,
    /// Whether `regs` are the leaf's (the walk met no unknown code it could
    /// place): a walk again starts there with an exact instruction pointer.
    pub from_leaf: bool,
    /// The words from `regs.sp` up.
    pub words: Vec<u64>,
    /// See [`crate::signal::StackCopy::splice`], counted in the frames the
    /// walk returned (after the leading native frames were dropped).
    pub splice: Option<(usize, u64)>,
}

impl OwnStackCopy {
    /// The copy as a walk from `regs` sees it: a splice counted from
    /// `from_frame`.
    pub fn as_stack_copy(&self) -> crate::signal::StackCopy<'_> {
        let splice = self.splice.and_then(|(i, sp)| Some((i.checked_sub(self.from_frame)?, sp)));
        crate::signal::StackCopy {
            regs: self.regs,
            start: self.regs.sp,
            words: &self.words,
            splice,
            from_leaf: self.from_leaf,
        }
    }
}

struct InFlight(&'static Stripe);

impl InFlight {
    fn enter() -> InFlight {
        let stripe = own_stripe();
        stripe.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(stripe)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A walker borrowed from the pool, given back when dropped.
struct Borrowed {
    index: usize,
    walker: *mut Walker,
}

impl Borrowed {
    #[inline]
    fn take() -> Option<Borrowed> {
        // Start at a place of the thread's own (a hash of its thread
        // pointer), so that a thread mostly takes the same walker, whose
        // paths and last walk are its own stack's and whose memory is warm
        // in its core's cache. Before, the start came from the bare bits of
        // a stack address (>> 12, % 32), which differ little between
        // threads whose stacks lie a stack's size apart, and `validate`'s
        // two throwing workers showed the marks of one walker passed
        // between their cores: the pool slot's swap and the walker's first
        // line were misses at every event, about 1.5% of the CPU on .NET
        // 10, and 0.1% with this start.
        let start = (crate::thread_hash() >> 59) as usize % POOL;
        (0..POOL).map(|i| (start + i) % POOL).find_map(|index| {
            // SeqCst: the walk's load of the map comes after it (step 1).
            let walker = CACHE_POOL[index].0.swap(null_mut(), Ordering::SeqCst);
            // Made only for a walker taken: `then_some` would make (and drop)
            // one for an empty slot too, whose drop stored null back into the
            // slot, over a walker given back in between, lost to the pool.
            (!walker.is_null()).then(|| Borrowed { index, walker })
        })
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        CACHE_POOL[self.index].0.store(self.walker, Ordering::Release);
    }
}

/// A walk of one's own stack, as [`walk_own_stack`] hands it over.
#[derive(Debug)]
pub struct OwnWalk<'w> {
    /// `head` words the caller may fill, then the frames: raw frames as the
    /// signal engine's, the leading native frames (corsnap's own and the
    /// runtime's, between the callback and the code the event happened in)
    /// left out. A replayed walk's are where the walker keeps them: the
    /// caller may write the head, and must leave the frames as they are.
    pub words: &'w mut [u64],
    pub walk: &'w Walk,
    /// The stack to walk again, when the walk met code the map does not
    /// know.
    pub copy: Option<OwnStackCopy>,
    /// [`frames_hash`] of the frames (remembered with a kept walk, not
    /// computed again when it is replayed).
    pub hash: u64,
    /// For a replayed walk: the events its callers counted on it
    /// ([`Repeats`]), which [`take_repeats`] hands on. The head a caller
    /// wrote at the walk's last replay is still in `words`.
    pub repeats: Option<&'w mut Repeats>,
}

/// Walks the calling thread's stack, leaf first (or from `caller`, a
/// caller's frame as a call from it returns: the frames above are not
/// walked), and hands it to `use_walk` ([`OwnWalk`]), with `head` words (at most [`HEAD_ROOM`]) before the
/// frames for the caller. `runtime_thread` is the runtime's object for this
/// thread (its `ThreadID`), for undoing a hijacked return address. A kept
/// walk replaced by this one hands its counted events ([`Repeats`]) to
/// `spill` first, as [`take_repeats`] does.
#[inline(never)]
pub fn walk_own_stack<R>(
    runtime_thread: u64,
    head: usize,
    caller: Option<Regs>,
    mut spill: impl FnMut(Counted<'_>),
    use_walk: impl FnOnce(OwnWalk<'_>) -> R,
) -> Result<R, OwnWalkError> {
    // No map, no walk, and nothing borrowed or made for it.
    if MAP.load(Ordering::Relaxed).is_null() {
        NO_MAP.fetch_add(1, Ordering::Relaxed);
        return Err(OwnWalkError::NoMap);
    }
    let borrowed = Borrowed::take();
    let in_flight = borrowed.is_none().then(InFlight::enter);
    // SAFETY: steps 1 and 2 of the module documentation: counted in (a pooled
    // walker's slot empty, or the thread's stripe) before the load, and the
    // agent frees a replaced map only once it has seen, after its swap, every
    // walker in the pool and every stripe at zero.
    let Some(map) = (unsafe { MAP.load(Ordering::SeqCst).as_ref() }) else {
        NO_MAP.fetch_add(1, Ordering::Relaxed);
        return Err(OwnWalkError::NoMap);
    };
    let from_leaf = caller.is_none();
    let regs = caller.unwrap_or_else(|| {
        let (ip, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers into outputs; touches no memory, no
        // stack and no flags.
        unsafe {
            std::arch::asm!(
                "lea {ip}, [rip]",
                "mov {sp}, rsp",
                "mov {bp}, rbp",
                ip = out(reg) ip,
                sp = out(reg) sp,
                bp = out(reg) bp,
                options(nomem, nostack, preserves_flags)
            );
        }
        Regs { ip, sp, bp }
    });
    let mut own_walker;
    let walker = match &borrowed {
        // SAFETY: a pointer taken out of the pool is this walk's alone until
        // `borrowed` puts it back; the pool's walkers live until `uninstall`,
        // which waits for walks to end.
        Some(b) => unsafe { &mut *b.walker },
        None => {
            POOL_EMPTY.fetch_add(1, Ordering::Relaxed);
            own_walker = Walker::new();
            &mut own_walker
        }
    };
    // The map's range is the whole anonymous mapping that held the stack
    // pointer when the map was read, which may take in a neighbour merged
    // with the stack then and unmapped since; the thread library's bounds
    // are the stack's own (asked once per thread), so the walk, and a copy
    // of an incomplete one (up to 32 KiB above the stack pointer), never
    // read past them.
    // SAFETY: pthread_self has no preconditions; glibc's reads the thread
    // pointer.
    let thread = unsafe { libc::pthread_self() } as u64;
    let stack = match walker.last_stack(map.generation(), thread, regs.sp) {
        Some(stack) => stack,
        None => {
            let own = own_thread_stack(regs.sp);
            let stack = match (map.stack_containing(regs.sp), own) {
                (Some(mapped), Some(own)) => mapped.start.max(own.start)..mapped.end.min(own.end),
                (Some(mapped), None) => mapped,
                (None, Some(own)) => {
                    // A thread made since the map was read: its own stack is known
                    // to its thread library, so its events need not wait for the
                    // agent's thread (slow to be scheduled on a busy machine) to read
                    // the process's stacks again. The map still learns of it at its
                    // next refresh, unhurried.
                    OWN_STACKS.fetch_add(1, Ordering::Relaxed);
                    STACKS_STALE.store(true, Ordering::Relaxed);
                    own
                }
                (None, None) => {
                    UNKNOWN_STACKS.fetch_add(1, Ordering::Relaxed);
                    if !STACKS_STALE.swap(true, Ordering::Relaxed) {
                        WAKE_WANTED.store(true, Ordering::Relaxed);
                    }
                    return Err(OwnWalkError::UnknownStack);
                }
            };
            walker.stack = Some((map.generation(), thread, stack.clone()));
            stack
        }
    };
    let memory = LiveMemory { stack: stack.clone(), map, runtime_thread };
    let Walker { cache, words, counts, replays, .. } = walker;
    let start = replay::Start::new(map.generation(), regs, &stack, runtime_thread);
    let result = if let Some(kept) = replays.replay(&start, &memory) {
        // Its frames are handed over where they are kept, with no copy. A
        // replayed walk took no frame from a path or a last walk: it was
        // not made.
        let (walk, found, words, hash, repeats) = replays.replayed(kept, head);
        for (count, add) in counts.iter_mut().zip([1, found, 0, 0, 1]) {
            *count += add as u64;
        }
        use_walk(OwnWalk { words, walk, copy: None, hash, repeats: Some(repeats) })
    } else {
        let out = &mut words[HEAD_ROOM..];
        // Frames of native code at the leaf are corsnap's own and the
        // runtime's plumbing between the event and the code it happened in
        // (counted by the walk when its way in was all table rules).
        let native_leading = std::cell::Cell::new(0usize);
        let trim = |walk: &mut Walk, out: &mut [u64]| {
            let leading = walk.entry_frames.unwrap_or_else(|| {
                out[..walk.len].iter().take_while(|&&f| map.native_at(lookup_address(f)).is_some()).count()
            });
            native_leading.set(leading);
            out.copy_within(leading..walk.len, 0);
            walk.len -= leading;
            walk.known_frames = walk.known_frames.saturating_sub(leading);
            walk.splice = walk.splice.and_then(|(i, at)| Some((i.checked_sub(leading)?, at)));
            walk.first_unknown = walk.first_unknown.and_then(|(i, at)| Some((i.checked_sub(leading)?, at)));
        };
        let (walk, found, hash) = replays.walk_and_keep(
            start,
            &memory,
            out,
            |recorded, out| corsnap_unwind::walk_from(map, recorded, regs, from_leaf, cache, out, None),
            trim,
            &mut spill,
        );
        // Not in a signal handler: the callback's thread keeps what the
        // walk taught (one leaf stretch at most, and the return addresses
        // looked up in full; a later event from the same place takes its
        // path instead).
        map.keep_learned(cache);
        for (count, add) in counts.iter_mut().zip([1, found, walk.path_frames, walk.rest_frames, 0]) {
            *count += add as u64;
        }
        // One add a walk that was made, and none when a remembered path
        // gave every native frame (a storm of events from one place).
        let stepped = native_leading.get().saturating_sub(walk.path_frames);
        if stepped > 0 {
            NATIVE_FRAMES_STEPPED.fetch_add(stepped as u64, Ordering::Relaxed);
        }
        let mut copy = None;
        if walk.flags & corsnap_unwind::flags::UNKNOWN_CODE != 0 {
            // From the first frame in unknown code (the frames before it
            // stand) as deep as the walk went.
            let (from_frame, from) = match walk.first_unknown {
                Some((i, at)) if at.sp >= regs.sp && at.sp < stack.end && at != regs => (i, at),
                _ => (0, regs),
            };
            let stack_words = ((stack.end - from.sp) / 8) as usize;
            let kept_words = if walk.flags & corsnap_unwind::flags::COMPLETE != 0 {
                (((walk.sp.saturating_sub(from.sp)) / 8) as usize + COPY_SLACK_WORDS).min(MAX_COPY_WORDS)
            } else {
                LOST_COPY_WORDS
            };
            let kept_words = kept_words.min(stack_words);
            // As the signal handler's copies: a hijack the walk stepped over by
            // a guess is put back too.
            let mut hijack = crate::signal::CopyHijack::new(walk.undone_hijack, &memory);
            let kept = memory.copy_own_stack(from.sp, kept_words, &mut hijack);
            copy = Some(OwnStackCopy {
                regs: from,
                from_frame,
                from_leaf: from_leaf && from == regs,
                words: kept,
                splice: walk.splice.map(|(i, at)| (i, at.sp)),
            });
            // The agent learns that code when it takes this event: the sooner,
            // the fewer events need a copy.
            if !CODE_UNKNOWN.swap(true, Ordering::Relaxed) {
                WAKE_WANTED.store(true, Ordering::Relaxed);
            }
        }
        let head = head.min(HEAD_ROOM);
        let words = words.get_mut(HEAD_ROOM - head..HEAD_ROOM + walk.len).unwrap_or_default();
        use_walk(OwnWalk { words, walk: &walk, copy, hash, repeats: None })
    };
    if borrowed.is_none() {
        walker.count_out();
    }
    drop(borrowed);
    drop(in_flight);
    Ok(result)
}

/// The registers of the calling function's frame as this call returns to
/// it: a start for [`walk_own_stack`]'s `caller` that stays the same for
/// every event through the same call (a walk from inside `walk_own_stack`
/// starts at the same place too, but a ticket is checked before any walk,
/// see [`count_on_ticket`]). Inlined, so the call below is the caller's own.
#[inline(always)]
pub fn callers_frame() -> Regs {
    let mut words = [0u64; 3];
    // SAFETY: writes three words into `words`, and reads the stack slot
    // the call just pushed.
    unsafe { read_callers_frame(&mut words) };
    Regs { ip: words[0], sp: words[1], bp: words[2] }
}

/// Writes the return address, the stack pointer after the return and the
/// caller's `rbp` into `out`.
///
/// # Safety
/// `out` is valid for three words' writes.
#[unsafe(naked)]
unsafe extern "C" fn read_callers_frame(out: *mut [u64; 3]) {
    std::arch::naked_asm!(
        "mov rax, [rsp]",
        "mov [rdi], rax",
        "lea rax, [rsp + 8]",
        "mov [rdi + 8], rax",
        "mov [rdi + 16], rbp",
        "ret",
    )
}

/// A kept walk replayed by [`replay_own_stack`]: as [`OwnWalk`] hands a
/// replayed one over.
#[derive(Debug)]
pub struct Replayed<'w> {
    /// `head` words the caller may fill (what it wrote at this walk's last
    /// replay is still there), then the frames, which it must leave as
    /// they are.
    pub words: &'w mut [u64],
    pub walk: &'w Walk,
    /// The events counted on the walk ([`Repeats`]).
    pub repeats: &'w mut Repeats,
}

/// [`walk_own_stack`] from `caller`'s frame when, and only when, a walk
/// its walker kept replays (see [`replay`]): `use_replay`'s answer (whether
/// it counted the event on the walk, which then earns a ticket of the
/// thread's own, see [`express`]), or `false` with nothing done (no map, no walker free, a stack or start the
/// walker has not walked from, a kept walk whose words changed).
///
/// Why a lane of its own: in an exception storm nearly every event is a
/// replay, and its cost was the code and data it touched, cold again at
/// every throw after the runtime's dispatch had run through the caches
/// (under `perf`, samples piled up on the first instruction of each
/// function on the way and on each first load of a structure). This is
/// one function, and touches the pool slot, the walker's stack bounds and
/// the kept walk's start, reads and head, with nothing else inlined
/// into it but what a replay needs.
#[inline(never)]
pub fn replay_own_stack(
    runtime_thread: u64,
    head: usize,
    caller: Regs,
    use_replay: impl FnOnce(Replayed<'_>) -> bool,
) -> bool {
    if MAP.load(Ordering::Relaxed).is_null() {
        return false;
    }
    // Only a pooled walker: one made for the event would have kept nothing.
    let Some(borrowed) = Borrowed::take() else { return false };
    // SAFETY: as in `walk_own_stack`: counted in (the pooled walker's slot
    // empty) before the load, and a replaced map is freed only once every
    // walker is back in the pool.
    let Some(map) = (unsafe { MAP.load(Ordering::SeqCst).as_ref() }) else { return false };
    // SAFETY: as in `walk_own_stack`: the walker is this call's alone until
    // `borrowed` puts it back, and lives until `uninstall`.
    let walker = unsafe { &mut *borrowed.walker };
    // SAFETY: pthread_self has no preconditions.
    let thread = unsafe { libc::pthread_self() } as u64;
    let Some(stack) = walker.last_stack(map.generation(), thread, caller.sp) else { return false };
    let memory = LiveMemory { stack: stack.clone(), map, runtime_thread };
    let Walker { counts, replays, .. } = walker;
    let start = replay::Start::new(map.generation(), caller, &stack, runtime_thread);
    let Some(kept) = replays.replay(&start, &memory) else { return false };
    let (walk, found, words, _, repeats) = replays.replayed(kept, head);
    for (count, add) in counts.iter_mut().zip([1, found, 0, 0, 1]) {
        *count += add as u64;
    }
    let counted = use_replay(Replayed { words, walk, repeats });
    if counted {
        // One more of the same: the walk is worth a ticket of the thread's
        // own, which counts the next ones with less (see `express`).
        if let Some(view) = replays.kept_view(kept, head) {
            express::issue(&view);
        }
    }
    drop(borrowed);
    counted
}

/// A hash of a walk's frames (never 0), for an event tally's key: the
/// same frames always hash the same. foldhash's fixed state hashes a slice
/// four lanes at a time; the frames come from the runtime, not from an
/// adversary, so a fixed seed does.
pub fn frames_hash(frames: &[u64]) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::default().hash_one(frames) | 1
}

/// The calling thread's stack as its thread library describes it, if it
/// holds `sp`: remembered per thread, so a thread asks once. (Not in a signal
/// handler: `pthread_getattr_np` allocates, and on the main thread reads
/// `/proc/self/maps`; the main thread is in every map anyway.)
fn own_thread_stack(sp: u64) -> Option<std::ops::Range<u64>> {
    /// Remembered for the main thread: no bounds asked (an empty range that
    /// holds no stack pointer).
    const MAIN_THREAD: (u64, u64) = (1, 0);
    thread_local! {
        // No destructor: a thread-local with one would pin the agent's
        // library after a detach.
        static OWN_STACK: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    }
    let remembered = OWN_STACK.try_with(Cell::get).unwrap_or((0, 0));
    if remembered == MAIN_THREAD {
        return None;
    }
    if (remembered.0..remembered.1).contains(&sp) {
        return Some(remembered.0..remembered.1);
    }
    // The main thread's bounds would cost a read of `/proc/self/maps`
    // (glibc reads it for them) inside a callback; its stack is the
    // `[stack]` mapping, which grows down, merges with nothing, and is in
    // every map. Two system calls, once per thread.
    // SAFETY: gettid and getpid have no preconditions.
    if unsafe { libc::gettid() == libc::getpid() } {
        let _ = OWN_STACK.try_with(|c| c.set(MAIN_THREAD));
        return None;
    }
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    let (mut base, mut size) = (null_mut(), 0usize);
    // SAFETY: `attr` is initialised by pthread_getattr_np when it returns 0,
    // read by pthread_attr_getstack into two locals, and destroyed once.
    unsafe {
        if libc::pthread_getattr_np(libc::pthread_self(), attr.as_mut_ptr()) != 0 {
            return None;
        }
        let got = libc::pthread_attr_getstack(attr.as_ptr(), &mut base, &mut size);
        libc::pthread_attr_destroy(attr.as_mut_ptr());
        if got != 0 {
            return None;
        }
    }
    let start = base as u64;
    let stack = start..start.checked_add(size as u64)?;
    if !stack.contains(&sp) {
        return None;
    }
    let _ = OWN_STACK.try_with(|c| c.set((stack.start, stack.end)));
    Some(stack)
}

/// Counters of event walks that could not use their own unwinder.
#[derive(Debug, Clone, Copy, Default)]
pub struct EventWalkCounters {
    pub walks: u64,
    pub frames: u64,
    pub path_frames: u64,
    pub rest_frames: u64,
    /// Walks not made: a kept walk from the same place was replayed.
    pub replayed: u64,
    pub no_map: u64,
    pub own_stacks: u64,
    pub unknown_stacks: u64,
    pub pool_empty: u64,
    /// See [`native_frames_stepped`].
    pub native_frames_stepped: u64,
}

pub fn counters() -> EventWalkCounters {
    EventWalkCounters {
        walks: TOTALS[0].load(Ordering::Relaxed),
        frames: TOTALS[1].load(Ordering::Relaxed),
        path_frames: TOTALS[2].load(Ordering::Relaxed),
        rest_frames: TOTALS[3].load(Ordering::Relaxed),
        replayed: TOTALS[4].load(Ordering::Relaxed),
        no_map: NO_MAP.load(Ordering::Relaxed),
        own_stacks: OWN_STACKS.load(Ordering::Relaxed),
        unknown_stacks: UNKNOWN_STACKS.load(Ordering::Relaxed),
        pool_empty: POOL_EMPTY.load(Ordering::Relaxed),
        native_frames_stepped: native_frames_stepped(),
    }
}

/// Whether a walk found its stack missing from the map since the last call.
pub fn take_stacks_stale() -> bool {
    STACKS_STALE.swap(false, Ordering::Relaxed)
}

/// Whether the agent's thread should be woken now to read the stacks again
/// (true once per stale map: one load when there is nothing to do).
#[inline]
pub fn take_wake_request() -> bool {
    WAKE_WANTED.load(Ordering::Relaxed) && WAKE_WANTED.swap(false, Ordering::Relaxed)
}

/// Hands `take` the events callers counted on the pooled walkers' kept
/// walks ([`Repeats`], handed on as [`Counted`]). A walker lent out is passed over, or waited
/// for until `deadline` (the last take before the walkers are collected).
/// The agent's thread only: a walker is taken out of the pool while its
/// counts are read (a walk wanting it takes another), and
/// [`EventMap::uninstall`] frees the walkers on the same thread.
pub fn take_repeats(deadline: Option<Instant>, mut take: impl FnMut(Counted<'_>)) {
    if !INSTALLED.load(Ordering::SeqCst) {
        return;
    }
    for slot in &CACHE_POOL {
        let walker = loop {
            // SeqCst as a walk's borrow; the walk's giving back is a release.
            let walker = slot.0.swap(null_mut(), Ordering::SeqCst);
            if !walker.is_null() || deadline.is_none_or(|d| Instant::now() >= d) {
                break walker;
            }
            std::thread::yield_now();
        };
        if walker.is_null() {
            continue;
        }
        // SAFETY: taken out of the pool, the walker is this thread's alone
        // until it is put back below; the pool's walkers are freed only by
        // `leave`, on this thread.
        unsafe { (*walker).replays.take_repeats(&mut take) };
        slot.0.store(walker, Ordering::Release);
    }
    express::take_counts(&mut take);
}

/// The agent's handle on what event walks read: publishes maps, frees
/// replaced ones once no walk can be using them.
#[derive(Debug)]
pub struct EventMap {
    current: Option<Arc<CodeMap>>,
    retired: Vec<Arc<CodeMap>>,
    left: bool,
}

static INSTALLED: AtomicBool = AtomicBool::new(false);

impl EventMap {
    /// Fills the cache pool. `None` if another `EventMap` is installed.
    pub fn install() -> Option<EventMap> {
        if INSTALLED.swap(true, Ordering::SeqCst) {
            return None;
        }
        // Events counted on tickets after the last recording's last take
        // (at its very end) are not this one's.
        express::take_counts(&mut |_| {});
        for slot in &CACHE_POOL {
            // Read at every event (see `hot_memory`).
            let cache = Box::into_raw(crate::hot_memory::allocate_hot(Walker::new));
            let old = slot.0.swap(cache, Ordering::AcqRel);
            if !old.is_null() {
                // SAFETY: only install and uninstall put caches in the pool,
                // each made by Box::into_raw; an old one is ours to free.
                drop(unsafe { Box::from_raw(old) });
            }
        }
        Some(EventMap { current: None, retired: Vec::new(), left: false })
    }

    /// Makes `map` the one walks read from now on.
    pub fn publish(&mut self, map: Arc<CodeMap>) {
        MAP.store(Arc::as_ptr(&map) as *mut CodeMap, Ordering::SeqCst);
        express::GENERATION.store(map.generation(), Ordering::Release);
        CODE_UNKNOWN.store(false, Ordering::Relaxed);
        if let Some(old) = self.current.replace(map) {
            self.retired.push(old);
        }
        self.reclaim();
    }

    /// Frees replaced maps if no walk is running.
    pub fn reclaim(&mut self) {
        if !self.retired.is_empty() && none_in_flight() {
            self.retired.clear();
        }
    }

    /// Stops walks from using the map and waits (up to `timeout`) for the
    /// running ones to end; `false` if they did not, and then the maps and
    /// caches are left allocated.
    pub fn uninstall(mut self, timeout: Duration) -> bool {
        self.leave(timeout)
    }

    fn leave(&mut self, timeout: Duration) -> bool {
        self.left = true;
        express::GENERATION.store(0, Ordering::Release);
        MAP.store(null_mut(), Ordering::SeqCst);
        let deadline = Instant::now() + timeout;
        while !none_in_flight() {
            if Instant::now() >= deadline {
                std::mem::forget(self.current.take());
                std::mem::forget(std::mem::take(&mut self.retired));
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // Every walker made at install, each once back in its slot: a walk
        // that borrowed one just before the map went finds no map and gives
        // it back at once.
        let mut collected = 0;
        while collected < POOL {
            for slot in &CACHE_POOL {
                let cache = slot.0.swap(null_mut(), Ordering::AcqRel);
                if !cache.is_null() {
                    // SAFETY: made by Box::into_raw in install; no walk holds
                    // it (it was in the pool), and none can use it again.
                    let mut walker = unsafe { Box::from_raw(cache) };
                    walker.count_out();
                    collected += 1;
                }
            }
            if collected < POOL {
                if Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        self.current = None;
        self.retired.clear();
        INSTALLED.store(false, Ordering::SeqCst);
        true
    }
}

impl Drop for EventMap {
    /// A map walks may be reading is never freed under them.
    fn drop(&mut self) {
        if !self.left {
            self.leave(Duration::from_secs(2));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corsnap_unwind::process::{native_module, parse_maps, stack_ranges, LoadedElf};
    use corsnap_unwind::Memory;

    /// Held by a test that installs the event map (one process-wide map:
    /// two tests installing at once would find it taken).
    pub(super) static MAP_OF_A_TEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn own_code_map(with_stacks: bool) -> CodeMap {
        let (objects, _) = crate::process::loaded_objects();
        let natives = objects
            .iter()
            .filter_map(|o| {
                let elf =
                    LoadedElf { name: &o.name, bias: o.bias, segments: &o.segments, eh_frame_hdr: o.eh_frame_hdr };
                native_module(&elf, crate::process::read_own_memory)
            })
            .collect();
        let maps = parse_maps(&std::fs::read_to_string("/proc/self/maps").unwrap());
        let stacks = if with_stacks { stack_ranges(&maps) } else { Vec::new() };
        CodeMap::new(natives, Vec::new(), stacks, 0)
    }

    /// A walk from `depth` calls deeper: its frames (after the leading
    /// native ones), the walk, and whether it came with a copy.
    #[inline(never)]
    fn deeper(depth: u32) -> Result<(Vec<u64>, Walk, bool), OwnWalkError> {
        if depth == 0 {
            return walk_own_stack(
                0,
                0,
                None,
                |_| {},
                |own| {
                    assert_eq!(own.hash, frames_hash(own.words));
                    (own.words.to_vec(), *own.walk, own.copy.is_some())
                },
            );
        }
        let r = deeper(depth - 1);
        std::hint::black_box(depth);
        r
    }

    #[test]
    fn a_walk_of_ones_own_stack_needs_a_map_and_then_reaches_the_root() {
        let _map = MAP_OF_A_TEST.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(deeper(0).err(), Some(OwnWalkError::NoMap));
        let mut events = EventMap::install().expect("first install");
        // A map that lists no stacks (a thread made since it was read): the
        // thread library's description of this thread's stack serves, to
        // the root, and the agent is told its map is stale.
        events.publish(Arc::new(own_code_map(false)));
        let served = OWN_STACKS.load(Ordering::Relaxed);
        let (_, walk, _) = deeper(5).expect("a walk on the thread library's stack");
        assert!(walk.flags & corsnap_unwind::flags::COMPLETE != 0, "{walk:?}");
        assert!(OWN_STACKS.load(Ordering::Relaxed) > served);
        assert!(take_stacks_stale());
        events.publish(Arc::new(own_code_map(true)));
        let stepped = native_frames_stepped();
        let (frames, walk, copied) = deeper(5).expect("a walk");
        // All native: every frame is leading native code, so none is kept;
        // the walk itself went to the root.
        assert!(frames.is_empty(), "{walk:?}");
        assert!(walk.flags & corsnap_unwind::flags::COMPLETE != 0, "{walk:?}");
        assert!(!copied);
        // It stepped them one by one, and counted them (the tests that walk
        // wait for this map's lock, so no other walk adds to the count).
        let first = native_frames_stepped() - stepped;
        assert!(first > 0, "{walk:?}");
        // The same walk again takes the path the first one left (a pool
        // walker is borrowed by where the stack is, so it is the same one),
        // and counts only the frames after it.
        let stepped = native_frames_stepped();
        let (_, again, _) = deeper(5).expect("a walk");
        assert_eq!((again.flags, again.sp), (walk.flags, walk.sp), "the same root, reached the same way");
        assert!(again.path_frames > 0, "{again:?}");
        assert_eq!(native_frames_stepped() - stepped, first.saturating_sub(again.path_frames as u64), "{again:?}");
        // From one call site twice: the same frames, whether the second
        // walk was the first one replayed or made again. (Replayed only if
        // every word the first read is the same: this test's own frames
        // keep `rbp` as a plain register, so a saved `rbp` may differ; the
        // replay itself is tested below, and on the runtime's stacks by the
        // walkers' comparisons.)
        let both: Vec<_> = (0..2).map(|_| deeper(5).expect("a walk")).collect();
        assert_eq!((&both[0].0, both[0].1.flags, both[0].1.sp), (&both[1].0, both[1].1.flags, both[1].1.sp));
        assert_eq!((both[1].1.flags, both[1].1.sp), (walk.flags, walk.sp));
        assert!(events.uninstall(Duration::from_secs(1)));
        assert_eq!(deeper(0).err(), Some(OwnWalkError::NoMap));
    }

    /// Calls [`from_a_caller`] with the registers of this call's caller's
    /// frame as the call returns to it, as the dispatch hook's entry does.
    #[unsafe(naked)]
    extern "C" fn walk_from_here(out: *mut [Option<(u32, u64)>; 3]) {
        std::arch::naked_asm!("mov rsi, rsp", "mov rdx, rbp", "jmp {inner}", inner = sym from_a_caller)
    }

    /// Walks from the leaf, from the caller `walk_from_here` was called by,
    /// and replays from that caller: each one's flags and root, in `out`.
    extern "C" fn from_a_caller(out: *mut [Option<(u32, u64)>; 3], return_slot: *const u64, bp: u64) {
        // SAFETY: the slot `walk_from_here`'s call pushed its return address
        // into, on this stack, live until we return.
        let caller = Regs { ip: unsafe { return_slot.read() }, sp: return_slot as u64 + 8, bp };
        let of = |walk: &Walk| (walk.flags, walk.sp);
        let leaf = walk_own_stack(0, 0, None, |_| {}, |own| of(own.walk)).ok();
        let from_caller = walk_own_stack(0, 0, Some(caller), |_| {}, |own| of(own.walk)).ok();
        let mut replayed = None;
        replay_own_stack(0, 0, caller, |r| {
            replayed = Some(of(r.walk));
            false
        });
        // SAFETY: `out` is the caller's array, written once.
        unsafe { out.write([leaf, from_caller, replayed]) };
    }

    #[test]
    fn a_walk_from_a_callers_frame_reaches_the_root_a_walk_from_the_leaf_does() {
        let _map = MAP_OF_A_TEST.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = [None; 3];
        walk_from_here(&mut out);
        assert_eq!(out, [None; 3], "no map, no walk and no replay");
        let mut events = EventMap::install().expect("install");
        events.publish(Arc::new(own_code_map(true)));
        let mut out = [None; 3];
        walk_from_here(&mut out);
        let [leaf, from_caller, _] = out;
        let (flags, root) = leaf.expect("a walk from the leaf");
        assert!(flags & corsnap_unwind::flags::COMPLETE != 0, "{flags:#x}");
        assert_eq!(from_caller, Some((flags, root)), "the same root, reached the same way");
        assert!(events.uninstall(Duration::from_secs(1)));
    }

    /// A kept walk is replayed only while every word it read holds what it
    /// held: one word changed under it and the walk is made again.
    #[test]
    fn a_kept_walk_is_not_replayed_once_a_word_it_read_changed() {
        let map = own_code_map(true);
        let mut stack_words: Vec<u64> = (0..64).map(|i| 0x1000 + i).collect();
        let base = stack_words.as_mut_ptr() as u64;
        let memory = LiveMemory { stack: base..base + 8 * 64, map: &map, runtime_thread: 0 };
        let start = replay::Start::new(map.generation(), Regs { ip: 1, sp: base, bp: 0 }, &memory.stack, 0);
        let mut replays = replay::Replays::new();
        let mut out = [0u64; 8];
        let complete = Walk { len: 2, flags: corsnap_unwind::flags::COMPLETE, ..Walk::default() };
        // A stand-in walk that reads words 3 and 9 (and one outside the
        // stack) and finds two frames.
        let no_trim = |_: &mut Walk, _: &mut [u64]| {};
        let mut no_spill = |_: Counted<'_>| panic!("nothing counted to spill");
        let walked = replays.walk_and_keep(
            start,
            &memory,
            &mut out,
            |m, out| {
                out[0] = m.stack_word(base + 24).unwrap_or(0);
                out[1] = m.stack_word(base + 72).unwrap_or(0);
                assert_eq!(m.stack_word(base + 8 * 64), None);
                complete
            },
            no_trim,
            &mut no_spill,
        );
        assert_eq!(walked, (complete, 2, frames_hash(&[0x1003, 0x1009])));
        let kept = replays.replay(&start, &memory).expect("replayed");
        // The frames, after the head room asked for, and their hash.
        let (walk, found, used, hash, _) = replays.replayed(kept, 1);
        assert_eq!(
            (*walk, found, &used[1..], hash),
            (complete, 2, &[0x1003, 0x1009][..], frames_hash(&[0x1003, 0x1009]))
        );
        let other = replay::Start { regs: Regs { ip: 2, ..start.regs }, ..start };
        assert_eq!(replays.replay(&other, &memory), None, "another place");
        // SAFETY: a word of our own vector, read only through `memory`.
        unsafe { (base as *mut u64).add(9).write(7) };
        assert_eq!(replays.replay(&start, &memory), None, "a word read changed");
        // A walk that did not reach the root is not kept.
        let lost = Walk { flags: corsnap_unwind::flags::LOST, ..complete };
        replays.walk_and_keep(other, &memory, &mut out, |_, _| lost, no_trim, &mut no_spill);
        assert_eq!(replays.replay(&other, &memory), None);
        // A walk is kept as its caller cut it: the frames after the cut,
        // found counting those before.
        let three = Walk { len: 3, ..complete };
        let cut_first = |walk: &mut Walk, out: &mut [u64]| {
            out.copy_within(1..walk.len, 0);
            walk.len -= 1;
        };
        let (cut, found, hash) = replays.walk_and_keep(
            other,
            &memory,
            &mut out,
            |_, out| {
                out[..3].copy_from_slice(&[0xa1, 0xa2, 0xa3]);
                three
            },
            cut_first,
            &mut no_spill,
        );
        assert_eq!((cut.len, found, &out[..2], hash), (2, 3, &[0xa2, 0xa3][..], frames_hash(&[0xa2, 0xa3])));
        let kept = replays.replay(&other, &memory).expect("replayed");
        let (walk, found, used, hash, _) = replays.replayed(kept, 0);
        assert_eq!((walk.len, found, &*used, hash), (2, 3, &[0xa2, 0xa3][..], frames_hash(&[0xa2, 0xa3])));
        // Two walks kept from one start (a thread that throws from two
        // places at one depth), told apart by a word: each is replayed
        // while the stack holds its own.
        let mut replays = replay::Replays::new();
        let read_word_2 = |m: &dyn Memory, out: &mut [u64], len: usize| {
            out[0] = m.stack_word(base + 16).unwrap_or(0);
            Walk { len, ..complete }
        };
        for (word, len) in [(0xa, 1), (0xb, 2)] {
            // SAFETY: as above.
            unsafe { (base as *mut u64).add(2).write(word) };
            replays.walk_and_keep(start, &memory, &mut out, |m, out| read_word_2(m, out, len), no_trim, &mut no_spill);
        }
        for (word, len) in [(0xa, 1), (0xb, 2), (0xb, 2), (0xa, 1), (0xc, 0)] {
            // SAFETY: as above.
            unsafe { (base as *mut u64).add(2).write(word) };
            let replayed = replays.replay(&start, &memory).map(|kept| replays.replayed(kept, 0).0.len);
            assert_eq!(replayed, (len > 0).then_some(len), "word {word:#x}");
        }
        drop(stack_words);
    }

    /// Events counted on a kept walk are taken as its key (the head its
    /// caller wrote, then its frames) and count, once; a new walk replaces
    /// a kept walk without counts first, and one with counts only when all
    /// have some, handing its counts to the spill first.
    #[test]
    fn events_counted_on_a_kept_walk_are_taken_once_and_never_lost() {
        type Taken = Vec<(Vec<u64>, u64, u64, u64)>;
        let map = own_code_map(true);
        let mut stack_words: Vec<u64> = (0..16).map(|i| 0x1000 + i).collect();
        let base = stack_words.as_mut_ptr() as u64;
        let memory = LiveMemory { stack: base..base + 8 * 16, map: &map, runtime_thread: 0 };
        let start_at = |ip| replay::Start::new(map.generation(), Regs { ip, sp: base, bp: 0 }, &memory.stack, 0);
        let mut replays = replay::Replays::new();
        let out = [0u64; 8];
        let complete = Walk { len: 1, flags: corsnap_unwind::flags::COMPLETE, ..Walk::default() };
        let keep = |replays: &mut replay::Replays, ip: u64| -> Taken {
            let mut spilled = Vec::new();
            replays.walk_and_keep(
                start_at(ip),
                &memory,
                &mut out.clone(),
                |m, out| {
                    out[0] = ip;
                    m.stack_word(base + 8);
                    complete
                },
                |_, _| {},
                &mut |c: Counted<'_>| spilled.push((c.key.to_vec(), c.frames_hash, c.count, c.first_ns)),
            );
            spilled
        };
        let taken = |replays: &mut replay::Replays| -> Taken {
            let mut taken = Vec::new();
            replays
                .take_repeats(&mut |c: Counted<'_>| taken.push((c.key.to_vec(), c.frames_hash, c.count, c.first_ns)));
            taken
        };
        // Counts `count` events on the walk from `ip`, with head `tag`.
        let count = |replays: &mut replay::Replays, ip: u64, tag: u64, count: u64| {
            let kept = replays.replay(&start_at(ip), &memory).expect("replayed");
            let (_, _, words, _, repeats) = replays.replayed(kept, 2);
            words[..2].copy_from_slice(&[0xe, tag]);
            *repeats = replay::Repeats { head: 2, count, first_ns: 70 + ip };
        };
        assert!(keep(&mut replays, 1).is_empty());
        let kept = replays.replay(&start_at(1), &memory).expect("replayed");
        assert_eq!(*replays.replayed(kept, 2).4, replay::Repeats::default(), "nothing counted on a walk just kept");
        count(&mut replays, 1, 0xc, 3);
        // A kept walk's head stays where its caller wrote it.
        let kept = replays.replay(&start_at(1), &memory).expect("replayed");
        assert_eq!(&replays.replayed(kept, 2).2[..], &[0xe, 0xc, 1]);
        // Four more walks from other places: the one holding counts stays.
        for ip in 2..6 {
            assert!(keep(&mut replays, ip).is_empty());
        }
        assert!(replays.replay(&start_at(1), &memory).is_some(), "replaced while others held none");
        assert!(replays.replay(&start_at(2), &memory).is_none(), "the oldest without counts went");
        assert_eq!(taken(&mut replays), vec![(vec![0xe, 0xc, 1], frames_hash(&[1]), 3, 71)]);
        assert_eq!(taken(&mut replays), vec![], "taken once");
        // All four holding counts: the next walk replaces the oldest, whose
        // counts are spilled, and the others' are taken later.
        for ip in [1, 3, 4, 5] {
            count(&mut replays, ip, ip, 2);
        }
        assert_eq!(keep(&mut replays, 6), vec![(vec![0xe, 3, 3], frames_hash(&[3]), 2, 73)]);
        assert!(replays.replay(&start_at(6), &memory).is_some());
        let mut rest = taken(&mut replays);
        rest.sort();
        assert_eq!(
            rest,
            vec![
                (vec![0xe, 1, 1], frames_hash(&[1]), 2, 71),
                (vec![0xe, 4, 4], frames_hash(&[4]), 2, 74),
                (vec![0xe, 5, 5], frames_hash(&[5]), 2, 75)
            ]
        );
        drop(stack_words);
    }
}
