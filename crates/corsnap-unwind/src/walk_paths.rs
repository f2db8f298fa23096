//! Walks of one's own stack that repeat: the path the last walks from the
//! same place took, remembered and taken again as far as the stack still
//! holds it.
//!
//! An event (an exception thrown, an allocation tick) is walked inside the
//! runtime's callback, from the walker's own registers. Its first frames
//! are corsnap's own and the runtime's plumbing between the event and the
//! managed code it happened in (10 to 20 native frames, the same for every
//! event of a kind), then the code that raised it, then the thread's start;
//! an exception storm walks the same stack thousands of times a second.
//! Frame by frame, each walk paid table lookups in memory that is cold
//! between events: measured with `perf` on `bench/programs/events.cs
//! validate` (.NET 10), the native tables' lookups alone were a third of
//! corsnap's CPU.
//!
//! So a walk from an exact address (one place in the walker's own code)
//! leaves in its cache the path it took, for as long as every step was made
//! by a rule that reads the stack at fixed offsets (a native row's rule, a
//! managed frame's [`FrameRule`]): each frame's address and stack pointer,
//! counted from the first frame's, where each frame's frame pointer came
//! from (the first frame's register, or the stack slot a rule restored it
//! from), and, for a frame found from its frame pointer, the value that
//! pointer had (counted from the first frame's stack pointer too).
//!
//! A later walk from the same address takes the path as far as the stack
//! still holds it: frame by frame, a frame found from its frame pointer must
//! have it at the same place, and its caller's return address must be the
//! one the path had (one read each, no table, no region). Then every step
//! so far was the same step on the same words: a frame at the same place
//! running the same code unwinds the same way. The first frame whose return
//! address differs is where the walk goes on frame by frame, with the
//! registers the path gives it, which are right (its callee's step was
//! checked). Nothing is guessed: a path that does not fit is only walked
//! less far.
//!
//! Only walks whose cache asks for it ([`crate::WalkCache::remember_paths`])
//! keep paths: a signal handler's walks start wherever the thread was, and
//! seldom twice at one address.

use crate::frame_rule::FrameRule;
use crate::native_table::CfiRule;
use crate::{Memory, Regs, EXACT_IP};

/// The most frames a remembered path holds.
const PATH_FRAMES: usize = 64;
/// Paths remembered per cache (kinds of event, stacks they happen on).
const PATHS: usize = 4;
/// [`Path::bases`] of a frame found from its stack pointer.
const FROM_SP: u32 = u32::MAX;

/// Where a frame's frame pointer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BpFrom {
    /// The first frame's register: no frame before it restored it.
    Start,
    /// The stack word this far above the first frame's stack pointer.
    Slot(u32),
}

/// The rule a frame was stepped by, when it is one a path can hold.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Tracked {
    /// A native frame's row, from its module's table.
    Native(CfiRule),
    /// A managed frame's rule, or a native frame's row kept in the walk
    /// cache as the same step ([`CfiRule::as_frame_rule`]).
    Frame(FrameRule),
}

impl Tracked {
    fn bp_based(&self) -> bool {
        match self {
            Tracked::Native(rule) => rule.bp_based(),
            Tracked::Frame(rule) => rule.bp_based(),
        }
    }

    /// Where the caller's frame pointer was read, for the step from `regs`
    /// to `next`.
    fn bp_slot(&self, regs: Regs, next: Regs) -> Option<u64> {
        match self {
            Tracked::Native(rule) => rule.bp_slot(next.sp),
            Tracked::Frame(rule) => rule.bp_slot(regs),
        }
    }
}

/// One path: `frames[..len]` were each stepped by a rule; frame `len` is
/// the one they lead to (its address read from the stack when taken).
#[derive(Debug, Clone)]
struct Path {
    lineage: u64,
    len: usize,
    /// The frames as the walk wrote them (the first an exact address).
    frames: [u64; PATH_FRAMES],
    /// Each frame's stack pointer above the first frame's.
    sps: [u32; PATH_FRAMES + 1],
    /// Where each frame's frame pointer came from.
    bps: [BpFrom; PATH_FRAMES + 1],
    /// For a frame found from its frame pointer, that pointer above the
    /// first frame's stack pointer; else [`FROM_SP`].
    bases: [u32; PATH_FRAMES],
    /// Bit `j`: frame `j` is native code.
    native: u64,
}

impl Path {
    const EMPTY: Path = Path {
        lineage: 0,
        len: 0,
        frames: [0; PATH_FRAMES],
        sps: [0; PATH_FRAMES + 1],
        bps: [BpFrom::Start; PATH_FRAMES + 1],
        bases: [FROM_SP; PATH_FRAMES],
        native: 0,
    };

    /// How many of the path's frames a walk from `start` takes, and the
    /// registers of the frame it goes on from.
    fn matched<M: Memory>(&self, start: Regs, mem: &M) -> (usize, Regs) {
        let above = |offset: u32| start.sp.wrapping_add(u64::from(offset));
        let bp_of = |j: usize| match self.bps[j] {
            BpFrom::Start => Some(start.bp),
            BpFrom::Slot(offset) => mem.stack_word(above(offset)),
        };
        let mut at = (0, start);
        for j in 0..self.len {
            // Frame j is the path's frame j (same place, same code); its
            // step is the path's step if its base is where it was.
            if self.bases[j] != FROM_SP && at.1.bp != above(self.bases[j]) {
                return at;
            }
            let sp = above(self.sps[j + 1]);
            let (Some(ip), Some(bp)) = (mem.stack_word(sp.wrapping_sub(8)), bp_of(j + 1)) else { return at };
            at = (j + 1, Regs { ip, sp, bp });
            if j + 1 < self.len && ip != self.frames[j + 1] {
                return at;
            }
        }
        at
    }
}

/// What a walk took from a remembered path.
pub(crate) struct Taken {
    /// Frames taken (written at the start of the output).
    pub(crate) frames: usize,
    /// The registers of the frame the walk goes on from.
    pub(crate) regs: Regs,
}

/// The paths a cache remembers, and the one the walk in progress makes.
/// Allocated only when asked for ([`WalkPaths::enable`]).
pub(crate) struct WalkPaths {
    state: Option<Box<PathState>>,
}

struct PathState {
    paths: [Path; PATHS],
    /// The next path to replace.
    next: usize,
    /// The walk in progress: its path so far, and whether it still tracks.
    building: Path,
    tracking: bool,
    start_sp: u64,
    /// The path the walk took frames from, and how many.
    taken: Option<(usize, usize)>,
}

impl WalkPaths {
    pub(crate) fn new() -> Self {
        WalkPaths { state: None }
    }

    pub(crate) fn enable(&mut self) {
        if self.state.is_none() {
            self.state = Some(Box::new(PathState {
                paths: [const { Path::EMPTY }; PATHS],
                next: 0,
                building: Path::EMPTY,
                tracking: false,
                start_sp: 0,
                taken: None,
            }));
        }
    }

    /// A walk starts at `regs` (an exact address): takes what a remembered
    /// path from there gives (its frames written to `out`), and starts
    /// tracking this walk's path.
    pub(crate) fn begin<M: Memory>(&mut self, lineage: u64, regs: Regs, mem: &M, out: &mut [u64]) -> Option<Taken> {
        let s = self.state.as_deref_mut()?;
        s.tracking = true;
        s.start_sp = regs.sp;
        s.taken = None;
        s.building.len = 0;
        s.building.native = 0;
        s.building.sps[0] = 0;
        s.building.bps[0] = BpFrom::Start;
        let first = regs.ip | EXACT_IP;
        let mut best: Option<(usize, usize, Regs)> = None;
        for i in (0..PATHS).map(|k| (s.next + PATHS - 1 - k) % PATHS) {
            let path = &s.paths[i];
            if path.len == 0 || path.lineage != lineage || path.frames[0] != first {
                continue;
            }
            let (m, at) = path.matched(regs, mem);
            if best.is_none_or(|b| m > b.1) {
                best = Some((i, m, at));
            }
            if m == path.len {
                break;
            }
        }
        let (i, m, at) = best.filter(|b| b.1 > 0)?;
        let room = out.get_mut(..m)?;
        let path = &s.paths[i];
        room.copy_from_slice(&path.frames[..m]);
        let b = &mut s.building;
        b.sps[..=m].copy_from_slice(&path.sps[..=m]);
        b.bps[..=m].copy_from_slice(&path.bps[..=m]);
        b.bases[..m].copy_from_slice(&path.bases[..m]);
        b.native = path.native & low_bits(m);
        b.len = m;
        s.taken = Some((i, m));
        Some(Taken { frames: m, regs: at })
    }

    /// Whether frame `j` of the walk in progress, taken from a path, is
    /// native code, and its stack pointer.
    pub(crate) fn taken_frame(&self, j: usize) -> Option<(bool, u64)> {
        let s = self.state.as_deref()?;
        let b = &s.building;
        (j < b.len).then(|| (b.native >> j & 1 != 0, s.start_sp.wrapping_add(u64::from(b.sps[j]))))
    }

    /// Frame `j` of the walk in progress, at `regs`, was stepped to `next`
    /// by `tracked` (`None`: by anything a path cannot hold, which ends the
    /// path there).
    pub(crate) fn step(&mut self, j: usize, regs: Regs, next: Regs, tracked: Option<Tracked>, native: bool) {
        let Some(s) = self.state.as_deref_mut() else { return };
        if !s.tracking {
            return;
        }
        let start_sp = s.start_sp;
        let offset = |addr: u64| u32::try_from(addr.checked_sub(start_sp)?).ok().filter(|&o| o != FROM_SP);
        let b = &mut s.building;
        let recorded = (|| {
            let t = tracked?;
            if j != b.len || j >= PATH_FRAMES {
                return None;
            }
            let base = if t.bp_based() { offset(regs.bp)? } else { FROM_SP };
            let sp = offset(next.sp)?;
            let bp = match t.bp_slot(regs, next) {
                Some(slot) => BpFrom::Slot(offset(slot)?),
                None => b.bps[j],
            };
            b.bases[j] = base;
            b.sps[j + 1] = sp;
            b.bps[j + 1] = bp;
            b.native |= u64::from(native) << j;
            b.len = j + 1;
            Some(())
        })();
        if recorded.is_none() {
            s.tracking = false;
        }
    }

    /// The walk in progress went through a frame no path can hold (a signal
    /// frame): its path ends there.
    pub(crate) fn stop(&mut self) {
        if let Some(s) = self.state.as_deref_mut() {
            s.tracking = false;
        }
    }

    /// The walk ended with `out` its frames: its path is remembered, unless
    /// it is the one it took whole.
    pub(crate) fn finish(&mut self, lineage: u64, out: &[u64]) {
        let Some(s) = self.state.as_deref_mut() else { return };
        s.tracking = false;
        let len = s.building.len;
        if len == 0 || len > out.len() {
            return;
        }
        if let Some((i, m)) = s.taken {
            if m == len && s.paths[i].len == len {
                return;
            }
        }
        let slot = s.next;
        s.next = (s.next + 1) % PATHS;
        let b = &s.building;
        let path = &mut s.paths[slot];
        path.frames[..len].copy_from_slice(&out[..len]);
        path.sps[..=len].copy_from_slice(&b.sps[..=len]);
        path.bps[..=len].copy_from_slice(&b.bps[..=len]);
        path.bases[..len].copy_from_slice(&b.bases[..len]);
        path.native = b.native;
        path.lineage = lineage;
        path.len = len;
    }
}

fn low_bits(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    use crate::stack_words::StackWords as Words;

    const START: Regs = Regs { ip: 0x1000, sp: 0x7000, bp: 0x1111 };
    const EXACT: u64 = 0x1000 | EXACT_IP;

    /// A stack of four frames over the first: three native frames found
    /// from the stack pointer (the third saves the frame pointer at 0x70f0),
    /// then a managed frame found from that frame pointer (0x7180), whose
    /// caller returns to 0xc00c.
    fn stack() -> Words {
        Words(HashMap::from([
            (0x7040 - 8, 0x2002),
            (0x70a0 - 8, 0x3003),
            (0x70f0, 0x7180),
            (0x7100 - 8, 0x9009),
            (0x7188, 0xc00c),
            (0x7180, 0x7300),
        ]))
    }

    fn native(cfa_offset: i32, bp_at: Option<i32>) -> Option<Tracked> {
        Some(Tracked::Native(CfiRule::for_tests(false, cfa_offset, bp_at)))
    }

    fn managed() -> Option<Tracked> {
        // push rbp; mov rbp, rsp: the return address at rbp + 8, the
        // caller's frame pointer at rbp.
        let info = [1, 4, 2, 0x05, 4, 0x03, 1, 0x50];
        Some(Tracked::Frame(FrameRule::derive(&info, 8).expect("a rule")))
    }

    /// The frames, as a walk finds them: (address written, registers).
    const WALK: [(u64, Regs); 5] = [
        (EXACT, START),
        (0x2002, Regs { ip: 0x2002, sp: 0x7040, bp: 0x1111 }),
        (0x3003, Regs { ip: 0x3003, sp: 0x70a0, bp: 0x1111 }),
        (0x9009, Regs { ip: 0x9009, sp: 0x7100, bp: 0x7180 }),
        (0xc00c, Regs { ip: 0xc00c, sp: 0x7190, bp: 0x7300 }),
    ];

    /// Walks `WALK` through `paths` as `walk_until` would.
    fn walk(paths: &mut WalkPaths) {
        let mut out = vec![0; 8];
        let taken = paths.begin(7, START, &stack(), &mut out).map_or(0, |t| t.frames);
        let steps = [native(0x40, None), native(0x60, None), native(0x60, Some(-0x10)), managed()];
        for j in taken..4 {
            out[j] = WALK[j].0;
            paths.step(j, WALK[j].1, WALK[j + 1].1, steps[j], j < 3);
        }
        out[4] = WALK[4].0;
        paths.finish(7, &out[..5]);
    }

    fn enabled() -> WalkPaths {
        let mut paths = WalkPaths::new();
        paths.enable();
        paths
    }

    #[test]
    fn a_path_met_again_is_taken_with_the_registers_it_leads_to() {
        let mut paths = enabled();
        walk(&mut paths);
        let mut out = vec![0; 8];
        let taken = paths.begin(7, START, &stack(), &mut out).expect("taken");
        assert_eq!(taken.frames, 4);
        assert_eq!(&out[..4], &[EXACT, 0x2002, 0x3003, 0x9009]);
        assert_eq!(taken.regs, WALK[4].1);
        assert_eq!(paths.taken_frame(1), Some((true, 0x7040)));
        assert_eq!(paths.taken_frame(3), Some((false, 0x7100)));
        // The same stack deeper down: everything moves with it.
        let on_stack = |v: u64| (0x7000..0x8000).contains(&v);
        let deeper =
            Words(stack().0.into_iter().map(|(a, v)| (a + 0x1000, if on_stack(v) { v + 0x1000 } else { v })).collect());
        let start = Regs { sp: START.sp + 0x1000, ..START };
        let taken = paths.begin(7, start, &deeper, &mut out).expect("taken");
        assert_eq!(taken.regs, Regs { ip: 0xc00c, sp: 0x8190, bp: 0x8300 });
    }

    #[test]
    fn a_different_return_address_is_where_the_walk_goes_on() {
        let mut paths = enabled();
        walk(&mut paths);
        let mut changed = stack();
        changed.0.insert(0x70a0 - 8, 0x4004);
        let mut out = vec![0; 8];
        let taken = paths.begin(7, START, &changed, &mut out).expect("taken in part");
        assert_eq!(taken.frames, 2);
        assert_eq!(&out[..2], &[EXACT, 0x2002]);
        assert_eq!(taken.regs, Regs { ip: 0x4004, sp: 0x70a0, bp: 0x1111 });
    }

    #[test]
    fn a_frame_pointer_elsewhere_stops_the_path_at_its_frame() {
        let mut paths = enabled();
        walk(&mut paths);
        let mut moved = stack();
        moved.0.insert(0x70f0, 0x7280);
        let mut out = vec![0; 8];
        let taken = paths.begin(7, START, &moved, &mut out).expect("taken in part");
        assert_eq!(taken.frames, 3, "up to the frame whose base moved");
        assert_eq!(taken.regs, Regs { ip: 0x9009, sp: 0x7100, bp: 0x7280 });
    }

    #[test]
    fn a_step_no_path_can_hold_ends_the_path() {
        let mut paths = enabled();
        let mut out = vec![0; 8];
        paths.begin(7, START, &stack(), &mut out);
        paths.step(0, WALK[0].1, WALK[1].1, native(0x40, None), true);
        paths.step(1, WALK[1].1, WALK[2].1, None, true);
        paths.step(2, WALK[2].1, WALK[3].1, native(0x60, Some(-0x10)), true);
        paths.finish(7, &[EXACT, 0x2002, 0x3003, 0x9009]);
        let taken = paths.begin(7, START, &stack(), &mut out).expect("taken");
        assert_eq!(taken.frames, 1);
        assert_eq!(taken.regs, WALK[1].1);
    }

    #[test]
    fn nothing_is_kept_unless_asked_or_from_another_place_or_map() {
        let mut paths = WalkPaths::new();
        walk(&mut paths);
        paths.enable();
        let mut out = vec![0; 8];
        assert!(paths.begin(7, START, &stack(), &mut out).is_none(), "not asked for when walked");
        walk(&mut paths);
        assert!(paths.begin(8, START, &stack(), &mut out).is_none(), "another lineage of maps");
        assert!(paths.begin(7, Regs { ip: 0x1001, ..START }, &stack(), &mut out).is_none(), "another place");
        assert!(paths.begin(7, START, &stack(), &mut out).is_some());
    }
}
