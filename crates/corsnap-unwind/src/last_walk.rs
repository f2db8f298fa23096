//! The deep end of a thread's stack, remembered from one walk to the next.
//!
//! Between two samples a thread seldom leaves the calls it is deep in: the
//! native frames that started it (`clone3`, `start_thread`, the runtime's
//! thread start), the thread pool's dispatch loop, the method that runs the
//! work item, often most of the way to the leaf. Yet each sample walked all
//! of them, frame by frame, each frame's rule found only after the read
//! that gave its return address: a chain of dependent cache misses, at 100
//! samples a second all cold.
//!
//! So a complete walk leaves in the thread's walk cache its frames (up to
//! [`REMEMBERED_FRAMES`] of the deepest, never the leaf or a frame whose
//! address was exact) with each frame's stack pointer. A later walk that
//! arrives at one of them (same address, same stack pointer) checks that
//! the stack still holds every return address of the rest where it was
//! found, and takes them as they are. Those reads are known before any is
//! made (the stack pointers are remembered), so the CPU makes them all at
//! once rather than one after another. A frame at the same place with the
//! same return address, all the way to the root, is the same chain of
//! calls; where any differs, the walk goes on as before, and is remembered
//! in its turn.

use crate::{flags, Memory, Regs, EXACT_IP};

/// The most frames remembered: the deepest of a walk's frames.
pub(crate) const REMEMBERED_FRAMES: usize = 64;

/// A thread's last complete walk: `frames[..len]`, outermost last, and the
/// stack pointer each was found at (ascending). `len == 0`: nothing
/// remembered.
#[derive(Debug, Clone)]
pub(crate) struct LastWalk {
    lineage: u64,
    len: usize,
    frames: [u64; REMEMBERED_FRAMES],
    sps: [u64; REMEMBERED_FRAMES],
    /// The first of the native frames under the deepest managed one (the
    /// thread's start); `len` if none.
    start: usize,
}

impl LastWalk {
    pub(crate) fn new() -> Self {
        LastWalk { lineage: 0, len: 0, frames: [0; REMEMBERED_FRAMES], sps: [0; REMEMBERED_FRAMES], start: 0 }
    }

    /// Whether a walk at `regs` (a return address) has arrived at one of
    /// the remembered frames, and the rest of them is still on the stack:
    /// then the frames from there, and the stack pointer of the last.
    /// `cursor` is the walk's own (0 at its start): frames are met in the
    /// order of their stack pointers, so each walk looks at each remembered
    /// frame once, and checks the rest at most once.
    pub(crate) fn frames_from<M: Memory>(
        &self,
        lineage: u64,
        regs: Regs,
        cursor: &mut usize,
        mem: &M,
    ) -> Option<(&[u64], u64)> {
        if self.len == 0 || lineage != self.lineage {
            return None;
        }
        let mut k = *cursor;
        while k < self.len && self.sps[k] < regs.sp {
            k += 1;
        }
        *cursor = k;
        if k >= self.len || self.sps[k] != regs.sp || self.frames[k] != regs.ip {
            return None;
        }
        // Each caller's return address lies just below its stack pointer
        // (pushed by the call), where the first walk read it.
        let unchanged = (k + 1..self.len).all(|i| mem.stack_word(self.sps[i].wrapping_sub(8)) == Some(self.frames[i]));
        if !unchanged {
            // Checked once a walk: the frames below differ, and would again.
            *cursor = self.len;
            return None;
        }
        Some((&self.frames[k..self.len], self.sps[self.len - 1]))
    }

    /// The stack pointer of the thread's start, as the last walk found it:
    /// a walk that gets there takes the rest as it is.
    pub(crate) fn start_sp(&self) -> Option<u64> {
        (self.start < self.len).then(|| self.sps[self.start])
    }
}

/// What one walk learns of its frames on the way: each frame's stack
/// pointer (the last [`REMEMBERED_FRAMES`]), since its last exact one.
pub(crate) struct WalkTracker {
    /// Index in the walk's output of the first frame after the last exact
    /// one.
    from: usize,
    /// Index of the last frame that was not native code, if any.
    last_managed: Option<usize>,
    /// `sps[i % REMEMBERED_FRAMES]`: frame `i`'s stack pointer.
    sps: [u64; REMEMBERED_FRAMES],
}

impl WalkTracker {
    pub(crate) fn new() -> Self {
        WalkTracker { from: 0, last_managed: None, sps: [0; REMEMBERED_FRAMES] }
    }

    /// Frame `index` of the walk was at `sp`; `native` if it is native code,
    /// `exact` if its address was an exact instruction pointer (a leaf, a
    /// signal's context: never remembered, nor anything before it).
    pub(crate) fn frame(&mut self, index: usize, sp: u64, native: bool, exact: bool) {
        if exact {
            self.from = index + 1;
            self.last_managed = None;
            return;
        }
        self.sps[index % REMEMBERED_FRAMES] = sp;
        if !native {
            self.last_managed = Some(index);
        }
    }

    /// After a walk: remember its deepest frames if it reached the root
    /// with nothing unknown on the way (a return address it undid from a
    /// hijack is remembered as the real one: the stack's differs until the
    /// runtime puts it back, and then it matches).
    pub(crate) fn finish(&self, last: &mut LastWalk, lineage: u64, out: &[u64], walk_flags: u32) {
        let clean = walk_flags & !flags::HIJACKED == flags::COMPLETE;
        let from = self.from.max(out.len().saturating_sub(REMEMBERED_FRAMES));
        if !clean || from >= out.len() {
            return;
        }
        let frames = &out[from..];
        if frames.iter().any(|f| f & EXACT_IP != 0) {
            return;
        }
        let n = frames.len();
        last.frames[..n].copy_from_slice(frames);
        for (i, sp) in last.sps[..n].iter_mut().enumerate() {
            *sp = self.sps[(from + i) % REMEMBERED_FRAMES];
        }
        last.start = self.last_managed.map_or(0, |m| (m + 1).saturating_sub(from)).min(n);
        last.len = n;
        last.lineage = lineage;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::stack_words::StackWords as Words;

    const LEAF: u64 = 0x5000 | EXACT_IP;
    /// Two managed frames over a thread's start of three native frames,
    /// each return address pushed just below the frame's stack pointer.
    const FRAMES: [(u64, u64, bool); 5] = [
        (0x6006, 0x7e00, false),
        (0x6106, 0x7e80, false),
        (0x1001, 0x7f00, true),
        (0x2002, 0x7f40, true),
        (0x3003, 0x7f80, true),
    ];

    fn stack() -> Words {
        Words(FRAMES.iter().map(|&(ip, sp, _)| (sp - 8, ip)).collect())
    }

    /// A walk of a leaf over `FRAMES`, as `walk_until` reports it.
    fn remembered(walk_flags: u32) -> LastWalk {
        let mut tracker = WalkTracker::new();
        let mut out = vec![LEAF];
        tracker.frame(0, 0x7d00, false, true);
        for (i, &(ip, sp, native)) in FRAMES.iter().enumerate() {
            out.push(ip);
            tracker.frame(i + 1, sp, native, false);
        }
        let mut last = LastWalk::new();
        tracker.finish(&mut last, 7, &out, walk_flags);
        last
    }

    fn at(i: usize) -> Regs {
        Regs { ip: FRAMES[i].0, sp: FRAMES[i].1, bp: 0 }
    }

    fn all_from(i: usize) -> Vec<u64> {
        FRAMES[i..].iter().map(|f| f.0).collect()
    }

    #[test]
    fn a_remembered_frame_met_again_where_it_was_gives_the_rest() {
        let last = remembered(flags::COMPLETE | flags::HIJACKED);
        for i in 0..FRAMES.len() {
            let mut cursor = 0;
            let rest = all_from(i);
            assert_eq!(last.frames_from(7, at(i), &mut cursor, &stack()), Some((&rest[..], 0x7f80)), "{i}");
        }
        assert_eq!(last.start_sp(), Some(0x7f00), "the thread's start: the first native frame under the managed ones");
        // Not at a remembered place: walked as before.
        let mut cursor = 0;
        assert_eq!(last.frames_from(7, Regs { sp: 0x7f08, ..at(2) }, &mut cursor, &stack()), None);
        assert_eq!(last.frames_from(7, Regs { ip: 0x9999, ..at(3) }, &mut cursor, &stack()), None);
    }

    #[test]
    fn a_changed_return_address_or_map_gives_nothing() {
        let mut changed = stack();
        changed.0.insert(FRAMES[3].1 - 8, 0x4004);
        let last = remembered(flags::COMPLETE);
        let mut cursor = 0;
        assert_eq!(last.frames_from(7, at(1), &mut cursor, &changed), None);
        assert_eq!(last.frames_from(7, at(2), &mut cursor, &changed), None, "checked once a walk");
        let mut cursor = 0;
        assert_eq!(
            last.frames_from(7, at(4), &mut cursor, &changed),
            Some((&all_from(4)[..], 0x7f80)),
            "below the change"
        );
        let mut cursor = 0;
        assert_eq!(last.frames_from(8, at(0), &mut cursor, &stack()), None, "another lineage of maps");
    }

    #[test]
    fn only_clean_complete_walks_are_remembered() {
        for walk_flags in [0, flags::COMPLETE | flags::UNKNOWN_CODE, flags::LOST, flags::COMPLETE | flags::SIGNAL_FRAME]
        {
            let mut cursor = 0;
            assert_eq!(remembered(walk_flags).frames_from(7, at(0), &mut cursor, &stack()), None, "{walk_flags:#x}");
        }
    }
}
