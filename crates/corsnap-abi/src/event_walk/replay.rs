//! Walks of one's own stack replayed: when an event comes from the same
//! place as a recent one (the same registers on the same stack, the same
//! map) and every stack word that walk read still holds what it held, the
//! walk's frames are that walk's, without walking.
//!
//! Why it is right: a walk is a function of its registers, the map (its
//! code and unwind information do not change within one map) and the
//! stack words it reads; the walk cache only decides which words it needs
//! (a remembered path or last walk is taken only as far as the words it
//! checks still hold). So a walk that reads the same words finds the same
//! frames, and checking the words one walk read is enough to know a new
//! walk would read them too: it would begin as that walk did, and each
//! step's next read depends only on what came before. A walk whose outcome
//! came from anything else is never kept: one that met code the map did not
//! know (its callers are guesses), that did not reach the root, or that
//! asked the runtime's thread object whether a return address was hijacked
//! and could have been told yes.
//!
//! Why: in an exception storm nearly every throw of a thread comes from the
//! same place with the same stack, and its walk (32 frames on
//! `bench/programs/events.cs validate`, .NET 8), even along remembered
//! paths, took a third of corsnap's time in the throwing threads. The check
//! is one read and compare per word, with no dependency between them.

use std::cell::Cell;
use std::ops::Range;

use corsnap_unwind::{flags, ManagedCode, Memory, Regs, Walk};

use crate::signal::LiveMemory;

/// Stack words a kept walk may have read (a 32-frame walk along a path
/// reads about two a frame).
const READS: usize = 160;
/// Frames a kept walk may have.
pub(super) const FRAMES: usize = 128;
/// Words kept before a kept walk's frames, for the caller's head.
const HEAD_ROOM: usize = super::HEAD_ROOM;
/// Walks each walker keeps (a thread's kinds of event, and the places they
/// happen at): with two, 5% of `validate`'s walks on .NET 10 were made
/// again (three stacks from one start took turns), with four 0.03%.
const KEPT: usize = 4;

/// Where a walk starts: equal for two walks from the same place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Start {
    pub(super) generation: u64,
    pub(super) regs: Regs,
    pub(super) stack: (u64, u64),
    pub(super) runtime_thread: u64,
}

impl Start {
    #[inline]
    pub(super) fn new(generation: u64, regs: Regs, stack: &Range<u64>, runtime_thread: u64) -> Start {
        Start { generation, regs, stack: (stack.start, stack.end), runtime_thread }
    }
}

/// One kept walk: where it started, the words it read (those inside the
/// stack: a read outside it fails again from the same start, whose stack
/// bounds are the same), what it found.
struct Kept {
    start: Option<Start>,
    reads: StackReads,
    /// The read that last differed: checked first next time. Two kept walks
    /// from one start (two places a thread throws from at the same depth)
    /// share most of their words, the leaf's end first, and each event
    /// checked the other's kept walk that far before its own.
    differed: usize,
    /// The walk as its caller got it (cut by `trim`, see
    /// [`Replays::walk_and_keep`]), and how many frames it had before.
    walk: Walk,
    found: usize,
    /// Head room, then the walk's frames as its caller got them: a replay
    /// hands the caller this, with no copy.
    words: [u64; HEAD_ROOM + FRAMES],
    /// [`super::frames_hash`] of its frames: the event tally's hash of a
    /// replayed stack, not computed again.
    frames_hash: u64,
    /// Events its caller counted on it and not yet handed on.
    repeats: Repeats,
}

/// Events a caller counts on a kept walk instead of in its own tally, until
/// they are taken ([`Replays::take_repeats`]): an event whose key is the
/// one the caller wrote in the kept walk's head room at its last replay
/// (that head, then the frames) is one more of the same, counted with a
/// plain add on the walker the walk borrowed, with no lock, hash or compare
/// of the key. (The tally's lock, hash and key compare were 0.9% of the CPU
/// of `validate` on .NET 10 and 0.35% on .NET 8, with every walk replayed.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Repeats {
    /// Words of head the caller wrote before the frames (0: none since the
    /// walk was kept).
    pub head: usize,
    /// Events counted here since the last take.
    pub count: u64,
    /// The time of the first of them (the caller's clock).
    pub first_ns: u64,
}

/// Events counted on a kept walk, as they are handed on (taken, or spilled
/// when their walk is replaced): their tally key (the head the caller wrote,
/// then the frames), the frames' hash ([`super::frames_hash`]), how many,
/// and the first one's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted<'k> {
    pub key: &'k [u64],
    pub frames_hash: u64,
    pub count: u64,
    pub first_ns: u64,
}

impl Kept {
    /// Whether every word it read still holds what it held.
    #[inline]
    fn holds(&mut self, memory: &LiveMemory<'_>) -> bool {
        if !self.reads.holds_one(self.differed, memory) {
            return false;
        }
        if self.reads.hold(memory) {
            return true;
        }
        if let Some(i) = (0..self.reads.len).find(|&i| !self.reads.holds_one(i, memory)) {
            self.differed = i;
        }
        false
    }
}

/// The stack words a kept walk read, each once, in address order, as
/// offsets from the stack's start and the words found there.
///
/// Offsets, not addresses: a read is one add to the stack's start, with no
/// bound to clamp it to (the kept reads were inside the stack when kept; the
/// largest offset is checked once against the stack a replay runs on, and
/// the others are smaller). The check was 1.2% of the CPU of `validate` on
/// .NET 10 when each address was clamped into the stack and compared with
/// its clamp (ten instructions a word).
struct StackReads {
    /// Ascending: the last is the largest (see [`StackReads::keep`]).
    offsets: [u32; READS],
    words: [u64; READS],
    len: usize,
}

impl StackReads {
    const fn new() -> StackReads {
        StackReads { offsets: [0; READS], words: [0; READS], len: 0 }
    }

    /// Keeps `reads` ((address, word) pairs, in any order, some twice),
    /// each address once and in order, as offsets from `stack.start`:
    /// `false` (and none kept) if one is outside the stack.
    fn keep(&mut self, reads: &mut [(u64, u64)], stack: &Range<u64>) -> bool {
        self.len = 0;
        // Each word once, in the stack's order (leaf end first, where two
        // walks from one start differ): a walk reads some words twice (a
        // path's check, then the step), and loads in address order are the
        // ones the CPU sees coming.
        reads.sort_unstable_by_key(|&(address, _)| address);
        let mut len = 0;
        for &(address, word) in reads.iter() {
            let Some(offset) = address.checked_sub(stack.start).and_then(|o| u32::try_from(o).ok()) else {
                return false;
            };
            if address.checked_add(8).is_none_or(|end| end > stack.end) || len == READS {
                return false;
            }
            if len > 0 && self.offsets[len - 1] == offset {
                continue;
            }
            self.offsets[len] = offset;
            self.words[len] = word;
            len += 1;
        }
        self.len = len;
        true
    }

    /// Whether read `i`, if there is one, still finds its word.
    #[inline]
    fn holds_one(&self, i: usize, memory: &LiveMemory<'_>) -> bool {
        i >= self.len || memory.stack_word(memory.stack.start + u64::from(self.offsets[i])) == Some(self.words[i])
    }

    /// Whether every read still finds its word: all read and compared, with
    /// no branch until the end (the reads are independent, so their loads
    /// overlap; the loop that stopped at the first difference spent more
    /// time than its loads on `validate`).
    #[inline]
    fn hold(&self, memory: &LiveMemory<'_>) -> bool {
        let (offsets, words) = (&self.offsets[..self.len], &self.words[..self.len]);
        let Some(&largest) = offsets.last() else { return true };
        let stack = &memory.stack;
        if stack.end.checked_sub(stack.start).is_none_or(|size| u64::from(largest) + 8 > size) {
            return false;
        }
        let start = stack.start as *const u8;
        let mut differs = 0u64;
        for (&offset, &word) in offsets.iter().zip(words) {
            // SAFETY: `offset` is at most `largest` (the offsets ascend: only
            // `keep` writes them), so the word lies inside `memory.stack`,
            // the mapping that holds this thread's stack pointer, which the
            // thread runs on (as for `LiveMemory::stack_word`): mapped.
            differs |= unsafe { start.add(offset as usize).cast::<u64>().read_unaligned() } ^ word;
        }
        differs == 0
    }
}

/// A kept walk's parts, borrowed ([`Replays::kept_view`]).
pub(super) struct KeptView<'k> {
    pub(super) start: &'k Start,
    /// Offsets from `start.stack.0`, ascending, inside the stack.
    pub(super) offsets: &'k [u32],
    pub(super) words: &'k [u64],
    pub(super) key: &'k [u64],
    pub(super) frames_hash: u64,
}

/// A walker's kept walks.
pub(super) struct Replays {
    kept: Box<[Kept; KEPT]>,
    /// The words the walk being made reads, as it reads them.
    reads: Box<[(u64, u64); READS]>,
    /// The one the next walk kept replaces.
    next: usize,
    /// The one replayed or kept last: looked at first.
    last: usize,
}

impl Replays {
    pub(super) fn new() -> Replays {
        let empty = || Kept {
            start: None,
            reads: StackReads::new(),
            differed: 0,
            walk: Walk::default(),
            found: 0,
            words: [0; HEAD_ROOM + FRAMES],
            frames_hash: 0,
            repeats: Repeats::default(),
        };
        Replays { kept: Box::new(std::array::from_fn(|_| empty())), reads: Box::new([(0, 0); READS]), next: 0, last: 0 }
    }

    /// A kept walk from `start` whose every read still finds what it
    /// found: which one (for [`Self::replayed`]).
    #[inline]
    pub(super) fn replay(&mut self, start: &Start, memory: &LiveMemory<'_>) -> Option<usize> {
        let last = self.last;
        let i = (0..KEPT).map(|k| (last + k) % KEPT).find(|&i| {
            let kept = &mut self.kept[i];
            kept.start.as_ref() == Some(start) && kept.holds(memory)
        })?;
        self.last = i;
        Some(i)
    }

    /// Kept walk `kept` as its caller got it: the walk, how many frames it
    /// found before `trim`, its frames after `head` words of room (at most
    /// [`HEAD_ROOM`]) the caller may fill (what it wrote there last time is
    /// still there), their hash, and the events counted on it.
    #[inline]
    pub(super) fn replayed(&mut self, kept: usize, head: usize) -> (&Walk, usize, &mut [u64], u64, &mut Repeats) {
        let kept = &mut self.kept[kept];
        let used = HEAD_ROOM - head.min(HEAD_ROOM)..HEAD_ROOM + kept.walk.len;
        (&kept.walk, kept.found, kept.words.get_mut(used).unwrap_or_default(), kept.frames_hash, &mut kept.repeats)
    }

    /// Kept walk `kept` as [`super::express`] copies it into a ticket: where
    /// it starts, its reads, its key (`head` words of the caller's, then
    /// the frames) and the frames' hash.
    pub(super) fn kept_view(&self, kept: usize, head: usize) -> Option<KeptView<'_>> {
        let kept = self.kept.get(kept)?;
        let reads = &kept.reads;
        Some(KeptView {
            start: kept.start.as_ref()?,
            offsets: &reads.offsets[..reads.len],
            words: &reads.words[..reads.len],
            key: kept.words.get(HEAD_ROOM.checked_sub(head)?..HEAD_ROOM + kept.walk.len)?,
            frames_hash: kept.frames_hash,
        })
    }

    /// Hands `take` each kept walk's counted events ([`Counted`]), and
    /// counts them as taken.
    pub(super) fn take_repeats(&mut self, take: &mut impl FnMut(Counted<'_>)) {
        for i in 0..KEPT {
            self.take_repeats_of(i, take);
        }
    }

    /// [`Self::take_repeats`] of kept walk `i` alone.
    fn take_repeats_of(&mut self, i: usize, take: &mut impl FnMut(Counted<'_>)) {
        let kept = &mut self.kept[i];
        if kept.repeats.count > 0 {
            let key = HEAD_ROOM - kept.repeats.head.min(HEAD_ROOM)..HEAD_ROOM + kept.walk.len;
            let Repeats { count, first_ns, .. } = kept.repeats;
            take(Counted { key: &kept.words[key], frames_hash: kept.frames_hash, count, first_ns });
            kept.repeats.count = 0;
        }
    }

    /// Walks from `start` with `walk`, given a memory that notes the words
    /// it reads, into `out`, then lets `trim` cut the walk as the caller
    /// wants it (the leading native frames; the same cut for the same
    /// frames), and keeps the cut walk if it can be replayed, in place of
    /// the kept walk longest unused among those with no counted events, or
    /// of that one if all have some, whose events then go to `spill` first
    /// (as [`Self::take_repeats`] hands them). Returns the cut walk, how
    /// many frames it found before the cut, and the cut frames' hash
    /// ([`super::frames_hash`]).
    pub(super) fn walk_and_keep<'m, 'a>(
        &mut self,
        start: Start,
        memory: &'m LiveMemory<'a>,
        out: &mut [u64],
        walk: impl FnOnce(&Recorded<'m, 'a, '_>, &mut [u64]) -> Walk,
        trim: impl FnOnce(&mut Walk, &mut [u64]),
        spill: &mut impl FnMut(Counted<'_>),
    ) -> (Walk, usize, u64) {
        let recorded = Recorded {
            memory,
            reads: Cell::from_mut(&mut self.reads[..]).as_slice_of_cells(),
            count: Cell::new(0),
            replayable: Cell::new(true),
        };
        let mut result = walk(&recorded, out);
        let read_count = recorded.count.get();
        let replayable = recorded.replayable.get()
            && result.flags & flags::COMPLETE != 0
            && result.flags & (flags::UNKNOWN_CODE | flags::LOST | flags::TRUNCATED | flags::HIJACKED) == 0
            && result.undone_hijack.is_none();
        let found = result.len;
        trim(&mut result, out);
        let hash = super::frames_hash(out.get(..result.len).unwrap_or_default());
        if !replayable || result.len > FRAMES {
            return (result, found, hash);
        }
        // Counted events cost a tally's lock and hash to hand on here; a map
        // published since they were counted leaves their walk unreplayable
        // (its start names the old map) until they are taken, and with only
        // the free ones replaced, 5% of `validate`'s walks on .NET 10 were
        // made again.
        let next = self.next;
        let replaced = (0..KEPT).map(|k| (next + k) % KEPT).find(|&i| self.kept[i].repeats.count == 0).unwrap_or(next);
        self.take_repeats_of(replaced, spill);
        let kept = &mut self.kept[replaced];
        kept.start = None;
        kept.differed = 0;
        if kept.reads.keep(&mut self.reads[..read_count], &memory.stack) {
            let frames = &out[..result.len];
            kept.words[HEAD_ROOM..HEAD_ROOM + frames.len()].copy_from_slice(frames);
            kept.frames_hash = hash;
            kept.walk = result;
            kept.found = found;
            kept.repeats = Repeats::default();
            kept.start = Some(start);
            self.last = replaced;
            self.next = (replaced + 1) % KEPT;
        }
        (result, found, hash)
    }
}

/// The walk's memory, noting every stack word read, and whether anything
/// but those words decided the walk.
pub(super) struct Recorded<'m, 'a, 'r> {
    memory: &'m LiveMemory<'a>,
    reads: &'r [Cell<(u64, u64)>],
    count: Cell<usize>,
    replayable: Cell<bool>,
}

impl Memory for Recorded<'_, '_, '_> {
    fn stack_word(&self, addr: u64) -> Option<u64> {
        let word = self.memory.stack_word(addr)?;
        let n = self.count.get();
        match self.reads.get(n) {
            Some(slot) => {
                slot.set((addr, word));
                self.count.set(n + 1);
            }
            None => self.replayable.set(false),
        }
        Some(word)
    }

    fn code_bytes(&self, region: &ManagedCode, range: Range<u64>) -> Option<&[u8]> {
        self.memory.code_bytes(region, range)
    }

    fn hijacked_return(&self, slot: u64, found: u64) -> Option<u64> {
        // The thread object decides only for the trampoline's address (or
        // while it is unknown): then the walk is not kept, as the answer may
        // differ next time with the same word in the slot.
        let trampoline = self.memory.hijack_trampoline();
        if trampoline == 0 || found == trampoline {
            self.replayable.set(false);
        }
        self.memory.hijacked_return(slot, found)
    }

    fn prefetch(&self, addr: u64) {
        self.memory.prefetch(addr);
    }

    fn leaf_code(&self, range: Range<u64>) -> Option<&[u8]> {
        self.memory.leaf_code(range)
    }
}
