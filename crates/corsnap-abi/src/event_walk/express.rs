//! Tickets: a thread's own copies of the walks it replays most, each with
//! what one event from the same place needs to be counted, and nothing
//! else: no walker borrowed, no map read, no lock, no locked instruction.
//!
//! Why: in an exception storm from the dispatch hook, nearly every throw
//! was one more of an event its walker had kept (see [`super::replay`]),
//! and counting it cost about as much as the runtime's own work around the
//! call: not its instructions, but the memory and code it touched, cold
//! again after each dispatch had run through the caches (`perf` put the
//! time on the first instruction of each function on the way, on the
//! first load from each structure, and behind the pool's `xchg`). A ticket
//! holds the kept walk's start, its reads and its key in a few lines of
//! the thread's own, and the check reads those and the stack.
//!
//! Why it is right: a ticket is a copy of a kept walk (its start, its
//! reads and its key), taken when that walk was replayed for the same key,
//! so the replay's argument holds for it. Its map is named by generation:
//! the ticket serves only while the published map is the one it was
//! walked with ([`GENERATION`], which a map published or taken away
//! changes before anything else). Its stack is the thread's own (a ticket
//! is reached only through the thread's own thread-local), whose bounds
//! held every offset when the walk was kept.
//!
//! How its counts reach the agent, with one writer per word:
//! - The owning thread adds to `count` (a load and a store: nobody else
//!   writes it), and sets `first_ns` when `count` equals `seen`.
//! - The agent's thread reads `count`; if it is past `seen`, it hands on
//!   the difference with the ticket's key and `first_ns`, then stores
//!   `seen` (release).
//! - The owner rewrites a ticket's key only when `count` equals `seen`
//!   (loaded with acquire): the agent then has nothing to read there, and
//!   reads it again only after a store of `count` (release) that comes
//!   after the rewrite. What the check reads (the start, the reads) the
//!   agent never reads: the owner rewrites it for the same key at any time
//!   (a map published since, a word changed), and the counts stay.

use std::cell::{Cell, UnsafeCell};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use corsnap_unwind::Regs;

use super::replay::{Counted, KeptView, FRAMES};
use super::HEAD_ROOM;

/// Reads a ticketed walk may have (a 23-frame walk along a frame-pointer
/// chain reads 46).
const READS: usize = 96;
/// Tickets a thread has: the places it throws from most.
const TICKETS: usize = 2;
/// Threads with tickets, at most (about 5 KiB each): others count through
/// the walkers' pool as before.
const THREADS: usize = 256;

/// Takes of the counts per look for threads that are gone (the sampler
/// thread takes every 50 ms).
const LOOK_FOR_THE_DEAD_EVERY: u64 = 20;

/// The generation of the map walks read now, 0 for none: a ticket of
/// another generation does not serve.
pub(super) static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Every thread's tickets, for the agent to take their counts.
static REGISTRY: Mutex<Vec<Owned>> = Mutex::new(Vec::new());

thread_local! {
    /// The calling thread's tickets (null: none yet). No destructor: a
    /// thread-local with one would pin the agent's library after a detach;
    /// the agent frees a dead thread's tickets ([`take_counts`]).
    /// With the ticket that served last (looked at first), here rather than
    /// with the tickets: a line fewer at every event.
    static OWN: Cell<(*mut ThreadTickets, usize)> = const { Cell::new((null_mut(), 0)) };
}

/// A pointer to a thread's tickets in [`REGISTRY`].
struct Owned(*mut ThreadTickets);

// SAFETY: the tickets are shared as the module documentation says: each
// word with one writer, and the agent reads a ticket's key only while its
// owner leaves it as it is (the checks are the owner's alone).
unsafe impl Send for Owned {}

struct ThreadTickets {
    tickets: [Ticket; TICKETS],
    /// The owner's OS thread id: the agent frees the tickets once it is gone.
    tid: i32,
}

#[repr(C, align(64))]
struct Ticket {
    /// What the check reads: the owner's alone.
    check: UnsafeCell<Check>,
    /// Events counted (the owner writes it).
    count: AtomicU64,
    /// The time of the first event since the agent last took (the owner
    /// writes it when `count == seen`).
    first_ns: AtomicU64,
    /// What the agent reads with the counts: the owner writes it only while
    /// the agent has nothing to take.
    key: UnsafeCell<Key>,
    /// Events the agent has taken (the agent writes it), on a line of its
    /// own: the owner reads it at each event.
    seen: Seen,
}

#[repr(align(64))]
struct Seen(AtomicU64);

/// A ticket's walk as the check reads it: its start, then its reads.
#[repr(C)]
struct Check {
    /// 0: an empty ticket.
    generation: u64,
    regs: Regs,
    runtime_thread: u64,
    stack_start: u64,
    reads: usize,
    /// The first words of the key, as `count_on_ticket` compares them.
    head: [u64; HEAD_ROOM],
    offsets: [u32; READS],
    words: [u64; READS],
}

/// A ticket's key: the tally's, head and frames, and the frames' hash.
#[repr(C)]
struct Key {
    len: usize,
    frames_hash: u64,
    words: [u64; HEAD_ROOM + FRAMES],
}

impl ThreadTickets {
    fn new(tid: i32) -> ThreadTickets {
        let ticket = || Ticket {
            check: UnsafeCell::new(Check {
                generation: 0,
                regs: Regs { ip: 0, sp: 0, bp: 0 },
                runtime_thread: 0,
                stack_start: 0,
                reads: 0,
                head: [0; HEAD_ROOM],
                offsets: [0; READS],
                words: [0; READS],
            }),
            count: AtomicU64::new(0),
            first_ns: AtomicU64::new(0),
            key: UnsafeCell::new(Key { len: 0, frames_hash: 0, words: [0; HEAD_ROOM + FRAMES] }),
            seen: Seen(AtomicU64::new(0)),
        };
        ThreadTickets { tickets: std::array::from_fn(|_| ticket()), tid }
    }
}

impl Check {
    /// Whether every word the walk read still holds what it held.
    #[inline]
    fn holds(&self) -> bool {
        let (offsets, words) = (&self.offsets[..self.reads], &self.words[..self.reads]);
        let start = self.stack_start as *const u8;
        let mut differs = 0u64;
        for (&offset, &word) in offsets.iter().zip(words) {
            // SAFETY: the ticket is the calling thread's (reached through its
            // own thread-local), and `stack_start` and every offset were
            // inside that thread's stack, which it runs on, when the walk
            // was kept (`StackReads::keep`): mapped, for as long as the
            // thread lives.
            differs |= unsafe { start.add(offset as usize).cast::<u64>().read_unaligned() } ^ word;
        }
        differs == 0
    }
}

/// Counts one more event on a ticket of the calling thread's: from
/// `caller`'s frame, on `runtime_thread`, whose key opens with `head`
/// (compared word by word; the ticket's key may have more head words after
/// them, which its walk decides). `false`, with nothing counted, when no
/// ticket serves.
#[inline(never)]
#[link_section = ".text.hot.corsnap_throw"]
pub fn count_on_ticket(runtime_thread: u64, caller: Regs, head: &[u64], now_ns: impl FnOnce() -> u64) -> bool {
    let generation = GENERATION.load(Ordering::Acquire);
    let Ok((own, last)) = OWN.try_with(Cell::get) else { return false };
    if generation == 0 || own.is_null() {
        return false;
    }
    // SAFETY: a thread's tickets are freed only once the thread is gone
    // (`take_counts`); this is the thread.
    let tickets = unsafe { &*own };
    for k in 0..TICKETS {
        let i = (last + k) % TICKETS;
        let ticket = &tickets.tickets[i];
        // SAFETY: a check is this thread's alone, and not written meanwhile.
        let check = unsafe { &*ticket.check.get() };
        let same_head = check
            .head
            .get(..head.len())
            .is_some_and(|opens| opens.iter().zip(head).fold(0, |differs, (a, b)| differs | (a ^ b)) == 0);
        if check.generation != generation
            || check.regs != caller
            || check.runtime_thread != runtime_thread
            || !same_head
            || !check.holds()
        {
            continue;
        }
        let count = ticket.count.load(Ordering::Relaxed);
        // The first event since the agent's last take. (An event counted
        // while the agent takes, between its load of `count` and its store
        // of `seen`, finds them unequal and keeps the time before: its
        // batch's time is one take early.)
        if count == ticket.seen.0.load(Ordering::Acquire) {
            ticket.first_ns.store(now_ns(), Ordering::Relaxed);
        }
        ticket.count.store(count + 1, Ordering::Release);
        if i != last {
            let _ = OWN.try_with(|cell| cell.set((own, i)));
        }
        return true;
    }
    false
}

/// Copies a kept walk (just replayed for the key it holds) into a ticket of
/// the calling thread's: the one with the same key if there is one (only
/// its check is rewritten: a map published since, or the stack changed
/// under it, and the counts it holds stay), else one the agent has nothing
/// to take from, the one that served least lately. Nothing if none is
/// free, or the walk reads or holds too much for a ticket.
pub(super) fn issue(kept: &KeptView<'_>) {
    if kept.offsets.len() > READS || kept.key.len() > HEAD_ROOM + FRAMES || kept.key.is_empty() {
        return;
    }
    let Some((own, last)) = own_tickets() else { return };
    let same_key = |ticket: &Ticket| {
        // SAFETY: only this thread writes a key, so reading it here races
        // with nothing.
        let key = unsafe { &*ticket.key.get() };
        key.frames_hash == kept.frames_hash && key.words[..key.len] == *kept.key
    };
    let drained = |ticket: &Ticket| ticket.count.load(Ordering::Relaxed) == ticket.seen.0.load(Ordering::Acquire);
    let order = (1..=TICKETS).map(|k| (last + k) % TICKETS);
    let Some((i, rekey)) = order
        .clone()
        .find(|&i| same_key(&own.tickets[i]))
        .map(|i| (i, false))
        .or_else(|| order.clone().find(|&i| drained(&own.tickets[i])).map(|i| (i, true)))
    else {
        return;
    };
    let ticket = &own.tickets[i];
    if rekey {
        // SAFETY: the agent reads a key only while `count` is past `seen`,
        // and only this thread moves `count`: nobody reads it now, and the
        // agent's next read comes after a store of `count` (release) that
        // follows this write.
        let key = unsafe { &mut *ticket.key.get() };
        key.len = kept.key.len();
        key.words[..kept.key.len()].copy_from_slice(kept.key);
        key.frames_hash = kept.frames_hash;
    }
    // SAFETY: a check is this thread's alone.
    let check = unsafe { &mut *ticket.check.get() };
    check.generation = kept.start.generation;
    check.regs = kept.start.regs;
    check.runtime_thread = kept.start.runtime_thread;
    check.stack_start = kept.start.stack.0;
    check.reads = kept.offsets.len();
    check.offsets[..kept.offsets.len()].copy_from_slice(kept.offsets);
    check.words[..kept.words.len()].copy_from_slice(kept.words);
    let head = kept.key.len().min(HEAD_ROOM);
    check.head[..head].copy_from_slice(&kept.key[..head]);
    let _ = OWN.try_with(|cell| cell.set((cell.get().0, i)));
}

/// The calling thread's tickets, made and registered the first time (unless
/// [`THREADS`] threads have some, or the agent is reading the registry),
/// and the one that served last.
fn own_tickets() -> Option<(&'static ThreadTickets, usize)> {
    let (own, last) = OWN.try_with(Cell::get).ok()?;
    if !own.is_null() {
        // SAFETY: freed only once the thread is gone; this is the thread.
        return Some((unsafe { &*own }, last));
    }
    let mut registry = REGISTRY.try_lock().ok()?;
    if registry.len() >= THREADS {
        return None;
    }
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let made = Box::into_raw(Box::new(ThreadTickets::new(tid)));
    registry.push(Owned(made));
    OWN.try_with(|own| own.set((made, 0))).ok()?;
    // SAFETY: just made; freed only once this thread is gone.
    Some((unsafe { &*made }, 0))
}

/// The agent's thread: hands `take` every ticket's events not taken yet
/// ([`Counted`], as the walkers' kept walks hand theirs on), and frees the
/// tickets of threads that are gone.
pub(super) fn take_counts(take: &mut impl FnMut(Counted<'_>)) {
    let Ok(mut registry) = REGISTRY.lock() else { return };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    // Whether each owner is still alive is asked at one take in
    // `LOOK_FOR_THE_DEAD_EVERY` (a system call per thread).
    static TAKES: AtomicU64 = AtomicU64::new(0);
    let look_for_the_dead = TAKES.fetch_add(1, Ordering::Relaxed).is_multiple_of(LOOK_FOR_THE_DEAD_EVERY);
    registry.retain(|owned| {
        // SAFETY: registered tickets are freed only here, below.
        let tickets = unsafe { &*owned.0 };
        for ticket in &tickets.tickets {
            let count = ticket.count.load(Ordering::Acquire);
            let seen = ticket.seen.0.load(Ordering::Relaxed);
            if count <= seen {
                continue;
            }
            // SAFETY: `count` is past `seen`: the owner leaves the key as it
            // is until we store `seen`, and its writes came before the store
            // of `count` we loaded (acquire).
            let key = unsafe { &*ticket.key.get() };
            take(Counted {
                key: &key.words[..key.len],
                frames_hash: key.frames_hash,
                count: count - seen,
                first_ns: ticket.first_ns.load(Ordering::Relaxed),
            });
            ticket.seen.0.store(count, Ordering::Release);
        }
        // SAFETY: tgkill with signal 0 only checks that the thread exists.
        let gone = look_for_the_dead
            && unsafe { libc::syscall(libc::SYS_tgkill, pid, tickets.tid, 0) } == -1
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            // SAFETY: made by Box::into_raw in `own_tickets`; the thread that
            // could reach it is gone, and the registry held its only other
            // pointer. Its counts were taken above.
            drop(unsafe { Box::from_raw(owned.0) });
        }
        !gone
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_walk::replay::Start;

    /// Every ticket's counts, as (key, count).
    fn taken() -> Vec<(Vec<u64>, u64)> {
        let mut all = Vec::new();
        take_counts(&mut |c: Counted<'_>| all.push((c.key.to_vec(), c.count)));
        all
    }

    #[test]
    fn a_ticket_counts_while_its_words_hold_and_hands_its_counts_on_once() {
        let _map = super::super::tests::MAP_OF_A_TEST.lock().unwrap_or_else(|p| p.into_inner());
        // A stand-in stack the checks read (this thread's own memory).
        let mut stack: Vec<u64> = (0..32).map(|i| 0x5000 + i).collect();
        let base = stack.as_mut_ptr() as u64;
        let regs = Regs { ip: 0x1234, sp: base, bp: 0 };
        GENERATION.store(77, Ordering::Release);
        let start = Start { generation: 77, regs, stack: (base, base + 8 * 32), runtime_thread: 9 };
        let offsets = [8u32, 24, 200];
        let words = [0x5001, 0x5003, 0x5019];
        static KEY_A: [u64; 7] = [1, 9, 99, 0xa, 0, 0xf1, 0xf2];
        let view =
            |key: &'static [u64]| KeptView { start: &start, offsets: &offsets, words: &words, key, frames_hash: 5 };
        let head_a = [1, 9, 99, 0xa];
        assert!(!count_on_ticket(9, regs, &head_a, || 1), "no ticket yet");
        issue(&view(&KEY_A));
        for _ in 0..3 {
            assert!(count_on_ticket(9, regs, &head_a, || 1));
        }
        assert!(!count_on_ticket(9, regs, &[1, 9, 99, 0xb], || 1), "another type");
        assert!(!count_on_ticket(8, regs, &head_a, || 1), "another runtime thread");
        assert!(!count_on_ticket(9, Regs { ip: 0x1235, ..regs }, &head_a, || 1), "another place");
        stack[3] = 7;
        assert!(!count_on_ticket(9, regs, &head_a, || 1), "a word read changed");
        stack[3] = 0x5003;
        GENERATION.store(78, Ordering::Release);
        assert!(!count_on_ticket(9, regs, &head_a, || 1), "another map");
        // The same key walked again with the new map: its check is
        // rewritten, and the counts it holds stay.
        let start_78 = Start { generation: 78, ..start };
        issue(&KeptView { start: &start_78, ..view(&KEY_A) });
        assert!(count_on_ticket(9, regs, &head_a, || 1));
        // Another key while the first one's counts wait: the other ticket.
        static KEY_B: [u64; 6] = [1, 9, 99, 0xb, 0, 0xf3];
        static KEY_C: [u64; 6] = [1, 9, 99, 0xc, 0, 0xf4];
        issue(&KeptView { start: &start_78, ..view(&KEY_B) });
        assert!(count_on_ticket(9, regs, &[1, 9, 99, 0xb], || 1));
        // A third while both wait: no ticket for it.
        issue(&KeptView { start: &start_78, ..view(&KEY_C) });
        assert!(!count_on_ticket(9, regs, &[1, 9, 99, 0xc], || 1));
        let mut all = taken();
        all.sort();
        assert_eq!(all, vec![(KEY_A.to_vec(), 4), (KEY_B.to_vec(), 1)]);
        assert_eq!(taken(), vec![], "taken once");
        // Both drained: the third key gets one.
        issue(&KeptView { start: &start_78, ..view(&KEY_C) });
        assert!(count_on_ticket(9, regs, &[1, 9, 99, 0xc], || 1));
        assert_eq!(taken(), vec![(KEY_C.to_vec(), 1)]);
        GENERATION.store(0, Ordering::Release);
        assert!(!count_on_ticket(9, regs, &[1, 9, 99, 0xc], || 1), "no map");
    }
}
