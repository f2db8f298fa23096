//! The ring each thread's handler writes its samples into, the records'
//! layout (frames, and a stack copy when the walk met unknown code), and
//! the agent's walk again of a sample from its copy.

use super::*;

/// A single-producer, single-consumer ring of words. The producer is the
/// signal handler on one thread; the consumer is the agent's thread.
pub(super) struct Ring {
    pub(super) words: Box<[AtomicU64]>,
    /// Words ever written (producer); published with release.
    pub(super) head: AtomicUsize,
    /// Words ever consumed (consumer).
    pub(super) tail: AtomicUsize,
    /// Records are stamped with the time-stamp counter, not
    /// `CLOCK_MONOTONIC` (see [`sample_time`](super::sample_time)).
    pub(super) counter_time: bool,
}

impl Ring {
    pub(super) fn new(counter_time: bool) -> Ring {
        Ring {
            words: (0..RING_WORDS).map(|_| AtomicU64::new(0)).collect(),
            head: AtomicUsize::new(0),
            tail: AtomicUsize::new(0),
            counter_time,
        }
    }

    /// Appends one record, or returns false if it does not fit. With
    /// `copy`, the registers and `copy.1` words of stack from `regs.sp` go
    /// after the frames, if there is room for them (else they are left out).
    /// `copy`: see [`StackToCopy`]. Words 2 and 3 of `head` are ignored:
    /// the time-stamp counter is read once, just before the record is
    /// published, for the sample's time (or `CLOCK_MONOTONIC`, see
    /// [`sample_time`](super::sample_time)) and for the counts since
    /// `entered` (the counter at the handler's entry), so that the
    /// handler's time counts what storing it cost (the frames, and a copy's
    /// words). [`ThreadSlot::drain`] converts both to nanoseconds.
    pub(super) fn push(
        &self,
        mut head: [u64; RECORD_HEAD],
        frames: &[u64],
        copy: Option<StackToCopy<'_>>,
        entered: u64,
    ) -> bool {
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
            Some(c) if free >= base + COPY_HEAD => POOL.take(c.words),
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
            match &pooled {
                // A deep copy that found no two adjacent blocks free keeps
                // what one holds.
                Some(b) => c.words = c.words.min(b.capacity()),
                None if free < base + COPY_HEAD + c.words + RING_WORDS / 4 => c.words = c.words.min(c.min_words),
                None => {}
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
            let mut hijack = c.hijack;
            match &pooled {
                Some(b) => c.memory.copy_into(c.regs.sp, c.words, &mut hijack, b),
                None => {
                    for i in 0..c.words {
                        let w = c.memory.copied_word(c.regs.sp, i, &mut hijack);
                        self.words[(h + n) % RING_WORDS].store(w, Ordering::Relaxed);
                        n += 1;
                    }
                }
            }
        }
        self.publish(h, n, entered);
        true
    }

    /// Appends a record with no frames whose copy of the stack from `start`
    /// is in `block` (taken for `copy.words`, which it holds whole): a walk
    /// left to the agent. Gives the block back and returns false when the ring
    /// has no room for the record's head.
    pub(super) fn push_deferred(
        &self,
        mut head: [u64; RECORD_HEAD],
        start: u64,
        copy: StackToCopy<'_>,
        block: Block,
        entered: u64,
    ) -> bool {
        let h = self.head.load(Ordering::Relaxed);
        let t = self.tail.load(Ordering::Acquire);
        if RING_WORDS - (h - t) < RECORD_HEAD + COPY_HEAD {
            POOL.release(block.index, copy.words);
            return false;
        }
        head[4] = COPY_HEAD as u64 | (copy.words as u64) << 32 | (block.index as u64 + 1) << 48;
        let regs = copy.regs;
        // For a deferred copy, the splice's stack pointer word holds where
        // the copy starts.
        for (i, w) in head.into_iter().chain([regs.ip, regs.sp, regs.bp, u64::MAX, start]).enumerate() {
            self.words[(h + i) % RING_WORDS].store(w, Ordering::Relaxed);
        }
        let mut hijack = copy.hijack;
        copy.memory.copy_into(start, copy.words, &mut hijack, &block);
        self.publish(h, RECORD_HEAD + COPY_HEAD, entered);
        true
    }

    /// Stamps the record of `n` words at `h` with the time and the
    /// handler's time since `entered`, and publishes it.
    fn publish(&self, h: usize, n: usize, entered: u64) {
        let stored = sample_time::counter();
        let time = if self.counter_time { stored } else { monotonic_ns() };
        self.words[(h + 2) % RING_WORDS].store(time, Ordering::Relaxed);
        self.words[(h + 3) % RING_WORDS].store(stored.wrapping_sub(entered), Ordering::Relaxed);
        self.head.store(h + n, Ordering::Release);
    }
}

/// What a sample that met unknown code keeps of its stack.
pub(super) struct StackToCopy<'a> {
    pub(super) regs: Regs,
    /// Stack words to copy, from `regs.sp` up: as deep as the walk went.
    pub(super) words: usize,
    /// Enough words to reach a little past the splice frame: what is copied
    /// when the ring is short of room for `words`.
    pub(super) min_words: usize,
    pub(super) memory: &'a LiveMemory<'a>,
    /// A hijacked return address to put back in the copy.
    pub(super) hijack: CopyHijack,
    /// See `corsnap_unwind::Walk::known_frames`.
    pub(super) known_frames: usize,
    /// See `corsnap_unwind::Walk::splice`: (index, stack pointer).
    pub(super) splice: Option<(usize, u64)>,
}

/// Words before the copied stack: the registers, then the splice frame's
/// index (`u64::MAX` for none) and stack pointer.
pub(super) const COPY_HEAD: usize = 5;

/// What a record's header and word 4 say of its extent (see [`Ring::push`]).
pub(super) struct RecordExtent {
    pub(super) frames: usize,
    /// Words after the frames in the ring: the copy's head, and its words
    /// when they are not pooled.
    pub(super) copied: usize,
    /// The pooled copy: (block, words).
    pub(super) pooled: Option<(usize, usize)>,
}

impl RecordExtent {
    /// The record's words in the ring.
    pub(super) fn words(&self) -> usize {
        RECORD_HEAD + self.frames + self.copied
    }
}

impl Ring {
    /// The extent of the record that starts at word `t`.
    pub(super) fn record_at(&self, t: usize) -> RecordExtent {
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
    /// `CLOCK_MONOTONIC` nanoseconds when it was stored, at the handler's
    /// end.
    pub time_ns: u64,
    /// `corsnap_unwind::flags`.
    pub flags: u32,
    /// Nanoseconds from entering the handler to storing the sample (the
    /// frames and any copy written, before the record is published).
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
    /// The address `words` start at: `regs.sp`, or below it for a
    /// deferred walk's copy, which keeps the red zone too.
    pub start: u64,
    /// The words from `start` up.
    pub words: &'a [u64],
    /// The frame after the last one in unknown code when the sample was
    /// taken: its index among the sample's frames and its stack pointer.
    /// The copy reaches a little past it, no further: a walk that gets
    /// there again takes the sample's frames from it on as they are.
    pub splice: Option<(usize, u64)>,
    /// Whether `regs` are the leaf's; else a caller's frame's (`ip` a
    /// return address), and the frames before it are not the copy's to
    /// walk (an event's copy from its first frame in unknown code).
    pub from_leaf: bool,
}

/// Walks a sample again from its stack copy, with `map` (which may know more
/// code now than when the sample was taken). Code bytes are read live, as in
/// the handler: only inside managed regions of `map`, which are mapped.
/// `original` is the sample's walk (its frames and flags): when the copy
/// names a splice frame and the new walk reaches it, the original's frames
/// from there on complete the new walk.
/// A copy that is not `from_leaf` starts at a caller's frame, and
/// `original` holds the sample's frames from that frame on.
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
            let offset = addr.checked_sub(self.copy.start)?;
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
    let stop = splice.map(|(_, ip, sp)| (ip, sp));
    let mut walk = corsnap_unwind::walk_from(map, &memory, copy.regs, copy.from_leaf, cache, out, stop);
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
