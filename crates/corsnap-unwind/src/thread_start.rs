//! The bottom of a thread's stack, remembered from one walk to the next.
//!
//! Under a thread's first managed frame lie the native frames that started
//! it (`clone3`, `start_thread`, the runtime's thread start: eight frames
//! under a thread-pool worker, half of a typical walk). They do not change
//! while the thread runs managed code, yet each sample walked them through
//! framehop, frame by frame, in memory that at 100 samples a second is cold.
//!
//! So a complete walk leaves them in the thread's walk cache: the frames
//! from the first native frame under the deepest managed one to the root,
//! with each frame's stack pointer. A later walk that arrives at the first
//! of them (same instruction pointer, same stack pointer) checks that the
//! stack still holds every return address of the rest where it was found
//! (one read each, no unwind information), and takes them as they are. A
//! frame at the same place with the same return address, all the way to
//! the root, is the same chain of calls; where any differs, the memo is
//! dropped and the walk goes on as before.

use crate::{flags, Memory, Regs, EXACT_IP};

/// The most frames remembered (a thread's start has about ten).
pub(crate) const START_FRAMES: usize = 24;

/// A thread's remembered start: `frames[..len]`, outermost last, and the
/// stack pointer each was found at. `len == 0`: nothing remembered.
#[derive(Debug, Clone)]
pub(crate) struct ThreadStart {
    generation: u64,
    len: usize,
    frames: [u64; START_FRAMES],
    sps: [u64; START_FRAMES],
}

impl ThreadStart {
    pub(crate) fn new() -> Self {
        ThreadStart { generation: 0, len: 0, frames: [0; START_FRAMES], sps: [0; START_FRAMES] }
    }

    /// Whether a walk at `regs` (a return address) has arrived at the
    /// remembered start, and the rest of it is still on the stack: then its
    /// frames, and the stack pointer of the last.
    pub(crate) fn frames_from<M: Memory>(&mut self, generation: u64, regs: Regs, mem: &M) -> Option<(&[u64], u64)> {
        if self.len == 0 || regs.sp != self.sps[0] || regs.ip != self.frames[0] {
            return None;
        }
        // Each caller's return address lies just below its stack pointer
        // (pushed by the call), where the first walk read it.
        let unchanged = generation == self.generation
            && (1..self.len).all(|i| mem.stack_word(self.sps[i].wrapping_sub(8)) == Some(self.frames[i]));
        if !unchanged {
            self.len = 0;
            return None;
        }
        Some((&self.frames[..self.len], self.sps[self.len - 1]))
    }

    /// The stack pointer of the remembered start's first frame: a walk
    /// that gets there takes the rest as it is.
    pub(crate) fn first_sp(&self) -> Option<u64> {
        (self.len > 0).then_some(self.sps[0])
    }

    fn remember(&mut self, generation: u64, frames: &[u64], sps: &[u64]) {
        if frames.len() != sps.len() || frames.is_empty() || frames.len() > START_FRAMES {
            return;
        }
        self.frames[..frames.len()].copy_from_slice(frames);
        self.sps[..sps.len()].copy_from_slice(sps);
        self.len = frames.len();
        self.generation = generation;
    }
}

/// What one walk learns of its thread's start on the way: the stack
/// pointers of the native frames since the last managed one.
pub(crate) struct StartTracker {
    /// Index in the walk's output of the first native frame since the last
    /// frame that was not native; `None` before any managed frame.
    from: Option<usize>,
    sps: [u64; START_FRAMES],
    len: usize,
}

impl StartTracker {
    pub(crate) fn new() -> Self {
        StartTracker { from: None, sps: [0; START_FRAMES], len: 0 }
    }

    /// The frame just written was native, at `sp`.
    pub(crate) fn native(&mut self, sp: u64) {
        if self.from.is_some() {
            if let Some(slot) = self.sps.get_mut(self.len) {
                *slot = sp;
            }
            self.len += 1;
        }
    }

    /// The frame just written at `index` was managed code, a stub, or
    /// anything else that is not a plain native frame: a start can only
    /// begin after it.
    pub(crate) fn not_native(&mut self, index: usize) {
        self.from = Some(index + 1);
        self.len = 0;
    }

    /// After a walk: remember its start if the walk reached the root through
    /// nothing but plain native frames after its last managed one.
    pub(crate) fn finish(&self, start: &mut ThreadStart, generation: u64, out: &[u64], walk_flags: u32) {
        let clean = walk_flags & !flags::HIJACKED == flags::COMPLETE;
        let Some(from) = self.from else { return };
        if !clean || self.len == 0 || self.len > START_FRAMES || from + self.len != out.len() {
            return;
        }
        let frames = &out[from..];
        if frames.iter().any(|f| f & EXACT_IP != 0) {
            return;
        }
        start.remember(generation, frames, &self.sps[..self.len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Words(HashMap<u64, u64>);

    impl Memory for Words {
        fn stack_word(&self, addr: u64) -> Option<u64> {
            self.0.get(&addr).copied()
        }
        fn code_bytes(&self, _: &crate::ManagedCode, _: std::ops::Range<u64>) -> Option<&[u8]> {
            None
        }
    }

    const MANAGED: u64 = 0x5000;
    /// A thread's start: three native frames, each return address pushed
    /// just below the frame's stack pointer.
    const START: [(u64, u64); 3] = [(0x1001, 0x7f00), (0x2002, 0x7f40), (0x3003, 0x7f80)];

    fn stack() -> Words {
        Words(START.iter().map(|&(ip, sp)| (sp - 8, ip)).collect())
    }

    /// A walk of one managed frame over the start, as `walk_until` reports it.
    fn remembered(walk_flags: u32) -> ThreadStart {
        let mut tracker = StartTracker::new();
        let mut out = vec![MANAGED];
        tracker.not_native(0);
        for &(ip, sp) in &START {
            out.push(ip);
            tracker.native(sp);
        }
        let mut start = ThreadStart::new();
        tracker.finish(&mut start, 7, &out, walk_flags);
        start
    }

    fn at(i: usize) -> Regs {
        Regs { ip: START[i].0, sp: START[i].1, bp: 0 }
    }

    #[test]
    fn a_start_met_again_where_it_was_is_taken_whole() {
        let mut start = remembered(flags::COMPLETE | flags::HIJACKED);
        let frames: Vec<u64> = START.iter().map(|f| f.0).collect();
        assert_eq!(start.frames_from(7, at(0), &stack()), Some((&frames[..], 0x7f80)));
        // Not at its first frame, or not at the same place: walked as before.
        assert_eq!(start.frames_from(7, at(1), &stack()), None);
        assert_eq!(start.frames_from(7, Regs { sp: 0x7f08, ..at(0) }, &stack()), None);
    }

    #[test]
    fn a_changed_return_address_or_map_drops_the_memo() {
        let mut changed = stack();
        changed.0.insert(START[2].1 - 8, 0x4004);
        let mut start = remembered(flags::COMPLETE);
        assert_eq!(start.frames_from(7, at(0), &changed), None);
        assert_eq!(start.frames_from(7, at(0), &stack()), None, "dropped, not kept for later");
        let mut start = remembered(flags::COMPLETE);
        assert_eq!(start.frames_from(8, at(0), &stack()), None);
    }

    #[test]
    fn only_clean_complete_walks_are_remembered() {
        for walk_flags in [0, flags::COMPLETE | flags::UNKNOWN_CODE, flags::LOST, flags::COMPLETE | flags::SIGNAL_FRAME]
        {
            assert_eq!(remembered(walk_flags).frames_from(7, at(0), &stack()), None, "{walk_flags:#x}");
        }
        // Native frames with no managed frame above them are no start.
        let mut tracker = StartTracker::new();
        for &(_, sp) in &START {
            tracker.native(sp);
        }
        let mut start = ThreadStart::new();
        tracker.finish(&mut start, 7, &START.map(|f| f.0), flags::COMPLETE);
        assert_eq!(start.frames_from(7, at(0), &stack()), None);
    }
}
