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
const FRAMES: usize = 128;
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
    pub(super) fn new(generation: u64, regs: Regs, stack: &Range<u64>, runtime_thread: u64) -> Start {
        Start { generation, regs, stack: (stack.start, stack.end), runtime_thread }
    }
}

/// One kept walk: where it started, the words it read (those inside the
/// stack: a read outside it fails again from the same start, whose stack
/// bounds are the same), what it found.
struct Kept {
    start: Option<Start>,
    reads: [(u64, u64); READS],
    read_count: usize,
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
}

impl Kept {
    /// Whether every word it read still holds what it held.
    fn holds(&mut self, memory: &LiveMemory<'_>) -> bool {
        let reads = &self.reads[..self.read_count];
        let same = |&(address, word): &(u64, u64)| memory.stack_word(address) == Some(word);
        if reads.get(self.differed).is_some_and(|read| !same(read)) {
            return false;
        }
        // All of them at once, with no branch a word: on `validate` the
        // loop that stopped at the first difference spent more time than
        // its loads (a bounds check, a branch and spilled registers each).
        if memory.stack_words_hold(reads) {
            return true;
        }
        if let Some(i) = reads.iter().position(|read| !same(read)) {
            self.differed = i;
        }
        false
    }
}

/// A walker's kept walks.
pub(super) struct Replays {
    kept: Box<[Kept; KEPT]>,
    /// The one the next walk kept replaces.
    next: usize,
    /// The one replayed or kept last: looked at first.
    last: usize,
}

impl Replays {
    pub(super) fn new() -> Replays {
        let empty = || Kept {
            start: None,
            reads: [(0, 0); READS],
            read_count: 0,
            differed: 0,
            walk: Walk::default(),
            found: 0,
            words: [0; HEAD_ROOM + FRAMES],
            frames_hash: 0,
        };
        Replays { kept: Box::new(std::array::from_fn(|_| empty())), next: 0, last: 0 }
    }

    /// A kept walk from `start` whose every read still finds what it
    /// found: which one (for [`Self::replayed`]).
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
    /// [`HEAD_ROOM`]) the caller may fill, and their hash.
    pub(super) fn replayed(&mut self, kept: usize, head: usize) -> (&Walk, usize, &mut [u64], u64) {
        let kept = &mut self.kept[kept];
        let used = HEAD_ROOM - head.min(HEAD_ROOM)..HEAD_ROOM + kept.walk.len;
        (&kept.walk, kept.found, kept.words.get_mut(used).unwrap_or_default(), kept.frames_hash)
    }

    /// Walks from `start` with `walk`, given a memory that notes the words
    /// it reads, into `out`, then lets `trim` cut the walk as the caller
    /// wants it (the leading native frames; the same cut for the same
    /// frames), and keeps the cut walk if it can be replayed. Returns the
    /// cut walk, how many frames it found before the cut, and the cut
    /// frames' hash ([`super::frames_hash`]).
    pub(super) fn walk_and_keep<'m, 'a>(
        &mut self,
        start: Start,
        memory: &'m LiveMemory<'a>,
        out: &mut [u64],
        walk: impl FnOnce(&Recorded<'m, 'a, '_>, &mut [u64]) -> Walk,
        trim: impl FnOnce(&mut Walk, &mut [u64]),
    ) -> (Walk, usize, u64) {
        let kept = &mut self.kept[self.next];
        kept.start = None;
        let recorded = Recorded {
            memory,
            reads: Cell::from_mut(&mut kept.reads[..]).as_slice_of_cells(),
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
        kept.differed = 0;
        if replayable && result.len <= FRAMES {
            // Each word once, in the stack's order (leaf end first, where
            // two walks from one start differ): a walk reads some words twice
            // (a path's check, then the step), and loads in address order
            // are the ones the CPU sees coming.
            let reads = &mut kept.reads[..read_count];
            reads.sort_unstable_by_key(|&(address, _)| address);
            let mut distinct = 0;
            for i in 0..reads.len() {
                if distinct == 0 || reads[distinct - 1].0 != reads[i].0 {
                    reads[distinct] = reads[i];
                    distinct += 1;
                }
            }
            kept.read_count = distinct;
            let frames = &out[..result.len];
            kept.words[HEAD_ROOM..HEAD_ROOM + frames.len()].copy_from_slice(frames);
            kept.frames_hash = hash;
            kept.walk = result;
            kept.found = found;
            kept.start = Some(start);
            self.last = self.next;
            self.next = (self.next + 1) % KEPT;
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
