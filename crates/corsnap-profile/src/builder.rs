//! Turns the agent's message stream (live, or replayed from a raw recording)
//! into a [`Profile`]. Live recording and `corsnap report` share this path, so
//! a raw file always renders exactly as the live run would have.

use std::collections::HashMap;

use corsnap_wire::{Message, SamplerStats, Severity};

use crate::names::{is_roslyn_move_next, state_machine_from_callers, StateMachine};
use crate::roots::{classify_native, fold_point, NativeRoot, Start};
use crate::{EventKind, Frame, FrameIdx, FrameKind, GcRecord, Meta, Profile, Sample, SourceLocator, Thread, ThreadIdx};

/// Frame name for a run of unmanaged frames.
pub const NATIVE_FRAME: &str = "[native code]";
/// Frame appended (at the root end) to a stack the agent cut short.
pub const TRUNCATED_FRAME: &str = "[truncated]";
/// The runtime dispatching an exception: on .NET 9 and later its managed
/// `System.Runtime.EH` code (and the native code it calls) on top of the
/// throw's frames, which `DoStackSnapshot` does not show either.
pub const EXCEPTION_DISPATCH_FRAME: &str = "[exception dispatch]";

/// How native frames (from the signal engine's walks) enter the profile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NativeFrames {
    /// Each one, named `module!symbol`.
    #[default]
    Show,
    /// Each run of them as one `[native code]` frame, as the `suspend`
    /// engine shows them.
    Collapse,
}

/// What becomes of the native frames below a thread's first managed frame
/// (the host's start-up, the runtime's thread start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RootFrames {
    /// One `[host start-up]` or `[thread start]` frame ([`crate::roots`]).
    #[default]
    Fold,
    /// Each one, as walked.
    Show,
}

/// What turns IL offsets into source lines, and what it was told.
#[derive(Default)]
struct Lines {
    locator: Option<Box<dyn SourceLocator>>,
    /// `ModuleID` to its assembly.
    modules: HashMap<u64, crate::Assembly>,
    /// `FunctionID` to its module and `MethodDef` token.
    sources: HashMap<u64, (u64, u32)>,
    /// (`FunctionID`, IL offset) to its frame at that line (the method's
    /// frame when the line is not known).
    frames: HashMap<(u64, u32), FrameIdx>,
}

impl std::fmt::Debug for Lines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lines({} modules, {} frames)", self.modules.len(), self.frames.len())
    }
}

#[derive(Debug, Default)]
pub struct ProfileBuilder {
    lines: Lines,
    native_frames: NativeFrames,
    root_frames: RootFrames,
    /// What each named native frame says about a stack's start.
    native_roots: HashMap<u64, NativeRoot>,
    /// `[host start-up]` and `[thread start]`, once interned.
    start_frames: HashMap<Start, FrameIdx>,
    /// Functions of the runtime's managed exception dispatch.
    exception_dispatch: std::collections::HashSet<u64>,
    exception_dispatch_frame: Option<FrameIdx>,
    /// Whether a frame is a Roslyn state machine's `MoveNext` (by
    /// [`FrameIdx`]; `None` until first asked), and its variants by what the
    /// stack showed it to be.
    move_next: Vec<Option<bool>>,
    state_machines: HashMap<(FrameIdx, StateMachine), FrameIdx>,
    profile: Profile,
    functions: HashMap<u64, FrameIdx>,
    /// Runtime `ThreadID` to the thread it currently denotes (ids are reused
    /// after a thread dies, so a new `Thread` message replaces the mapping).
    threads: HashMap<u64, ThreadIdx>,
    /// Samples whose `ThreadID` was never described get this thread.
    unknown_threads: HashMap<u64, ThreadIdx>,
    scratch: Vec<FrameIdx>,
    /// `[native code]` and `[truncated]`, interned when first needed (not
    /// before: a profile without them must not list them).
    native_frame: Option<FrameIdx>,
    truncated_frame: Option<FrameIdx>,
    notices: Vec<(Severity, String)>,
    goodbye: Option<String>,
    saw_hello: bool,
}

impl ProfileBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set_native_frames(&mut self, mode: NativeFrames) {
        self.native_frames = mode;
    }

    pub fn set_root_frames(&mut self, mode: RootFrames) {
        self.root_frames = mode;
    }

    /// Splits managed frames by source line, found by `locator` from the
    /// IL offsets the agent sent: a method is then one frame per line,
    /// each with its [`Frame::source`]. Without it, IL offsets are ignored.
    pub fn set_source_locator(&mut self, locator: Box<dyn SourceLocator>) {
        self.lines.locator = Some(locator);
    }

    /// Applies one message. Messages that do not shape the profile (notices,
    /// goodbye) are kept for the caller to show.
    pub fn apply(&mut self, msg: &Message) {
        match msg {
            Message::Hello { pid, runtime_version, rate_hz, .. } => {
                self.saw_hello = true;
                let meta = &mut self.profile.meta;
                meta.pid = *pid;
                meta.runtime_version = runtime_version.clone();
                meta.rate_hz = *rate_hz;
            }
            Message::Recording { command, start_unix_ms } => {
                self.profile.meta.command = command.clone();
                self.profile.meta.start_unix_ms = *start_unix_ms;
            }
            Message::Thread { thread_id, os_tid, name } => {
                // A thread sampled before its name reached the agent is named
                // in place: its early samples are not left under `tid=…`. And
                // a thread the agent no longer knows by name (it exited just
                // after its last sample) keeps the name it had.
                let known = self.threads.get(thread_id).copied();
                if let Some(idx) = known.filter(|&i| self.profile.threads[i as usize].os_tid == *os_tid) {
                    if name.is_empty() || self.profile.name_thread(idx, name) {
                        return;
                    }
                }
                let idx = self.profile.intern_thread(Thread { os_tid: *os_tid, name: name.clone() });
                self.threads.insert(*thread_id, idx);
            }
            Message::OsThreadName { os_tid, name } => {
                self.profile.os_thread_names.insert(*os_tid, name.clone());
            }
            Message::Function { function_id, name, module } => {
                let native = function_id & corsnap_wire::NATIVE_FRAME_BIT != 0;
                if native {
                    self.native_roots.insert(*function_id, classify_native(name, module));
                } else if name.starts_with("System.Runtime.EH.") {
                    self.exception_dispatch.insert(*function_id);
                }
                let idx = if native && self.native_frames == NativeFrames::Collapse {
                    self.marker_frame(NATIVE_FRAME, FrameKind::Native)
                } else {
                    let kind = if native { FrameKind::NativeSymbol } else { FrameKind::Managed };
                    self.profile.intern_frame(Frame::new(name.clone(), module.clone(), kind))
                };
                self.functions.insert(*function_id, idx);
            }
            Message::Module { module_id, path, pdb } => {
                self.lines.modules.insert(*module_id, crate::Assembly { path: path.clone(), pdb: pdb.clone() });
            }
            Message::FunctionSource { function_id, module_id, method_token } => {
                self.lines.sources.insert(*function_id, (*module_id, *method_token));
            }
            Message::StateMachine { function_id, kind } => {
                // The metadata told: the stack need not be asked.
                if let Some(&frame) = self.functions.get(function_id) {
                    let variant = self.state_machine_variant(frame, *kind);
                    self.functions.insert(*function_id, variant);
                }
            }
            Message::Sample { time_ns, thread_id, kind, weight, truncated, leaf, frames, il_offsets } => {
                let head = (*kind, *time_ns, *thread_id, *truncated, *weight);
                self.add_sample_with_offsets(head, leaf, frames, il_offsets);
            }
            Message::Gc { time_ns, generation, reason, pause_ns } => self.profile.gcs.push(GcRecord {
                time_ns: *time_ns,
                generation: *generation,
                reason: *reason,
                pause_ns: *pause_ns,
            }),
            Message::Stats(stats) => self.profile.meta.stats = Some(*stats),
            Message::Notice { severity, text } => self.notices.push((*severity, text.clone())),
            Message::Goodbye { reason } => self.goodbye = Some(reason.clone()),
            // Routed by `ProcessProfiles`, never reaches a single builder's profile.
            Message::SnapshotEnd | Message::Process { .. } => {}
        }
    }

    /// A CPU sample: `frames` leaf first, `0` for a run of unmanaged frames.
    pub fn add_sample(&mut self, time_ns: u64, thread_id: u64, truncated: bool, frames: &[u64], weight: u64) {
        self.add_event_sample(EventKind::Cpu, time_ns, thread_id, truncated, "", frames, weight);
    }

    /// A sample of any kind; `leaf`, if not empty, goes above the stack.
    #[allow(clippy::too_many_arguments)]
    pub fn add_event_sample(
        &mut self,
        kind: EventKind,
        time_ns: u64,
        thread_id: u64,
        truncated: bool,
        leaf: &str,
        frames: &[u64],
        weight: u64,
    ) {
        self.add_sample_with_offsets((kind, time_ns, thread_id, truncated, weight), leaf, frames, &[]);
    }

    /// A sample whose frames may come with IL offsets (empty, or one per
    /// frame).
    fn add_sample_with_offsets(
        &mut self,
        (kind, time_ns, thread_id, truncated, weight): (EventKind, u64, u64, bool, u64),
        leaf: &str,
        frames: &[u64],
        il_offsets: &[u32],
    ) {
        let il_offsets = if il_offsets.len() == frames.len() { il_offsets } else { &[] };
        let mut stack = std::mem::take(&mut self.scratch);
        stack.clear();
        if !leaf.is_empty() {
            stack.push(self.synthetic_frame(leaf.to_string(), FrameKind::Subject));
        }
        // The frames below the first managed one, folded (a stack cut short
        // never reached them).
        let thread = self.thread_for(thread_id);
        let fold = match self.root_frames {
            RootFrames::Fold if !truncated => {
                let os_tid = self.profile.threads[thread as usize].os_tid;
                let main_thread = os_tid != 0 && os_tid == self.profile.meta.pid;
                fold_point(frames, main_thread, |id| self.native_roots.get(&id).copied())
            }
            _ => None,
        };
        let kept = fold.map_or(frames, |(keep, _)| &frames[..keep]);
        // A sample in the runtime's exception dispatch: its frames (and the
        // native ones it called) are one frame above the throw's.
        let dispatch = match self.root_frames {
            RootFrames::Fold if !self.exception_dispatch.is_empty() => {
                kept.iter().rposition(|id| self.exception_dispatch.contains(id))
            }
            _ => None,
        };
        // Where `kept` starts in `frames` (and `il_offsets`).
        let first_kept = dispatch.map_or(0, |at| at + 1);
        let kept = match dispatch {
            Some(at) => {
                let idx = match self.exception_dispatch_frame {
                    Some(idx) => idx,
                    None => {
                        let idx = self.synthetic_frame(EXCEPTION_DISPATCH_FRAME.to_string(), FrameKind::Native);
                        self.exception_dispatch_frame = Some(idx);
                        idx
                    }
                };
                stack.push(idx);
                &kept[at + 1..]
            }
            None => kept,
        };
        for (i, &function_id) in kept.iter().enumerate() {
            let idx = match function_id {
                0 => self.marker_frame(NATIVE_FRAME, FrameKind::Native),
                id => match self.functions.get(&id) {
                    Some(&idx) => match il_offsets.get(first_kept + i) {
                        Some(&il) if il != corsnap_wire::NO_IL_OFFSET && self.lines.locator.is_some() => {
                            self.frame_at_line(id, idx, il)
                        }
                        _ => idx,
                    },
                    None => self.synthetic_frame(format!("[unknown function 0x{id:x}]"), FrameKind::Unresolved),
                },
            };
            // A run of unmanaged frames is one `[native code]` frame.
            let native_run = self.native_frame.is_some_and(|n| n == idx && stack.last() == Some(&n));
            if !native_run {
                stack.push(idx);
            }
        }
        if let Some((_, start)) = fold {
            let idx = match self.start_frames.get(&start) {
                Some(&idx) => idx,
                None => {
                    let idx = self.synthetic_frame(start.frame_name().to_string(), FrameKind::Start);
                    self.start_frames.insert(start, idx);
                    idx
                }
            };
            stack.push(idx);
        }
        if truncated {
            stack.push(self.marker_frame(TRUNCATED_FRAME, FrameKind::Truncated));
        }
        self.tell_state_machines(&mut stack);
        let stack_idx = self.profile.intern_stack(&stack);
        self.scratch = stack;
        self.profile.samples.push(Sample { time_ns, thread, stack: stack_idx, weight, kind });
    }

    /// The frame of function `id` (whose frame is `method`) at IL offset
    /// `il`: the method's frame with the line the PDB gives, or the method's
    /// frame as it is when there is none.
    fn frame_at_line(&mut self, id: u64, method: FrameIdx, il: u32) -> FrameIdx {
        if let Some(&idx) = self.lines.frames.get(&(id, il)) {
            return idx;
        }
        let lines = &mut self.lines;
        let source = match (lines.sources.get(&id), lines.locator.as_mut()) {
            (Some(&(module, token)), Some(locator)) => match lines.modules.get(&module) {
                Some(assembly) if !assembly.path.is_empty() => locator.locate(assembly, token, il),
                _ => None,
            },
            _ => None,
        };
        let idx = match source {
            Some(source) => {
                let mut frame = self.profile.frames[method as usize].clone();
                frame.source = Some(source);
                self.profile.intern_frame(frame)
            }
            None => method,
        };
        self.lines.frames.insert((id, il), idx);
        idx
    }

    /// Gives each Roslyn state machine's `MoveNext` in `stack` (leaf first)
    /// that the metadata did not tell of ([`Message::StateMachine`]) what
    /// its callers show it to be: an async method or an iterator
    /// ([`state_machine_from_callers`]).
    fn tell_state_machines(&mut self, stack: &mut [FrameIdx]) {
        for i in 0..stack.len() {
            let frame = stack[i];
            let frames = &self.profile.frames;
            if self.move_next.len() < frames.len() {
                self.move_next.resize(frames.len(), None);
            }
            let is_move_next = *self.move_next[frame as usize].get_or_insert_with(|| {
                let f = &frames[frame as usize];
                f.kind == FrameKind::Managed && f.state_machine.is_none() && is_roslyn_move_next(&f.name)
            });
            if !is_move_next {
                continue;
            }
            let callers = stack[i + 1..].iter().map(|&caller| {
                let caller = &frames[caller as usize];
                (caller.kind == FrameKind::Managed).then_some(caller.name.as_str())
            });
            let Some(kind) = state_machine_from_callers(&frames[frame as usize].name, callers) else { continue };
            stack[i] = self.state_machine_variant(frame, kind);
        }
    }

    /// `frame` (a state machine's `MoveNext`) marked as `kind`.
    fn state_machine_variant(&mut self, frame: FrameIdx, kind: StateMachine) -> FrameIdx {
        if let Some(&variant) = self.state_machines.get(&(frame, kind)) {
            return variant;
        }
        let mut variant = self.profile.frames[frame as usize].clone();
        variant.state_machine = Some(kind);
        let idx = self.profile.intern_frame(variant);
        self.state_machines.insert((frame, kind), idx);
        idx
    }

    /// `[native code]` or `[truncated]`, interned once rather than looked up
    /// (with a fresh `String`) for every frame of every sample.
    fn marker_frame(&mut self, name: &str, kind: FrameKind) -> FrameIdx {
        let cached = if kind == FrameKind::Native { self.native_frame } else { self.truncated_frame };
        if let Some(idx) = cached {
            return idx;
        }
        let idx = self.synthetic_frame(name.to_string(), kind);
        if kind == FrameKind::Native {
            self.native_frame = Some(idx);
        } else {
            self.truncated_frame = Some(idx);
        }
        idx
    }

    /// A frame that is not a managed method: no module.
    fn synthetic_frame(&mut self, name: String, kind: FrameKind) -> FrameIdx {
        self.profile.intern_frame(Frame::new(name, String::new(), kind))
    }

    fn thread_for(&mut self, thread_id: u64) -> ThreadIdx {
        if let Some(&idx) = self.threads.get(&thread_id) {
            return idx;
        }
        if let Some(&idx) = self.unknown_threads.get(&thread_id) {
            return idx;
        }
        let n = self.unknown_threads.len();
        let idx = self.profile.intern_thread(Thread { os_tid: 0, name: format!("thread-{n}") });
        self.unknown_threads.insert(thread_id, idx);
        idx
    }

    pub fn saw_hello(&self) -> bool {
        self.saw_hello
    }

    pub fn sample_count(&self) -> usize {
        self.profile.samples.len()
    }

    pub fn thread_count(&self) -> usize {
        self.profile.threads.len()
    }

    pub fn stats(&self) -> Option<SamplerStats> {
        self.profile.meta.stats
    }

    /// Notices received so far, in order, drained.
    pub fn take_notices(&mut self) -> Vec<(Severity, String)> {
        std::mem::take(&mut self.notices)
    }

    pub fn goodbye(&self) -> Option<&str> {
        self.goodbye.as_deref()
    }

    pub fn meta_mut(&mut self) -> &mut Meta {
        &mut self.profile.meta
    }

    pub fn finish(self) -> Profile {
        self.profile
    }

    /// Takes out the samples and collections from before `before_ns` (the
    /// agent's clock) as a profile of their own, and keeps the rest: a
    /// window of a continuous recording. Every sample leaves exactly once,
    /// in the first window taken after it arrived, so none is lost or
    /// counted twice however late it comes. The names and threads learned
    /// so far stay, for the windows to come.
    pub fn take_window(&mut self, before_ns: u64) -> Profile {
        let (taken, kept): (Vec<Sample>, Vec<Sample>) =
            std::mem::take(&mut self.profile.samples).into_iter().partition(|s| s.time_ns < before_ns);
        self.profile.samples = kept;
        let (gcs, kept_gcs): (Vec<GcRecord>, Vec<GcRecord>) =
            std::mem::take(&mut self.profile.gcs).into_iter().partition(|g| g.time_ns < before_ns);
        self.profile.gcs = kept_gcs;
        self.profile.subset(taken, gcs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu_sample(time_ns: u64, thread_id: u64, truncated: bool, frames: Vec<u64>) -> Message {
        Message::Sample {
            time_ns,
            thread_id,
            kind: EventKind::Cpu,
            weight: 1,
            truncated,
            leaf: String::new(),
            frames,
            il_offsets: Vec::new(),
        }
    }

    #[test]
    fn names_native_runs_and_threads_are_resolved() {
        let mut b = ProfileBuilder::new();
        b.apply(&Message::Thread { thread_id: 10, os_tid: 77, name: "worker".into() });
        b.apply(&Message::Function { function_id: 1, name: "A.Leaf".into(), module: "app.dll".into() });
        b.apply(&Message::Function { function_id: 2, name: "A.Main".into(), module: "app.dll".into() });
        b.apply(&cpu_sample(1, 10, false, vec![1, 0, 2]));
        b.apply(&cpu_sample(2, 10, false, vec![1, 0, 2]));
        b.apply(&cpu_sample(3, 99, true, vec![3]));
        let p = b.finish();
        assert_eq!(p.samples.len(), 3);
        assert_eq!(p.stacks.len(), 2, "identical stacks are interned once");
        let names: Vec<_> = p.stack_names_root_first(p.samples[0].stack).collect();
        assert_eq!(names, ["A.Main", NATIVE_FRAME, "A.Leaf"]);
        assert_eq!(p.threads[p.samples[0].thread as usize].label(), "worker tid=77");
        let names: Vec<_> = p.stack_names_root_first(p.samples[2].stack).collect();
        assert_eq!(names, [TRUNCATED_FRAME, "[unknown function 0x3]"]);
    }

    /// Lines of `app.dll`'s method 0x06000001: IL offset / 0x10 + 40.
    struct FakePdb;

    impl crate::SourceLocator for FakePdb {
        fn locate(&mut self, assembly: &crate::Assembly, token: u32, il: u32) -> Option<crate::SourceLine> {
            (assembly.path == "/app/app.dll" && token == 0x0600_0001 && il < 0x100)
                .then(|| crate::SourceLine { file: "/src/App.cs".into(), line: il / 0x10 + 40 })
        }
    }

    #[test]
    fn with_a_locator_a_method_is_one_frame_per_line() {
        let run = |locator: bool| {
            let mut b = ProfileBuilder::new();
            if locator {
                b.set_source_locator(Box::new(FakePdb));
            }
            b.apply(&Message::Module { module_id: 9, path: "/app/app.dll".into(), pdb: None });
            b.apply(&function(1, "App.Spin", "app.dll"));
            b.apply(&Message::FunctionSource { function_id: 1, module_id: 9, method_token: 0x0600_0001 });
            b.apply(&function(2, "App.Main", "app.dll"));
            let no = corsnap_wire::NO_IL_OFFSET;
            for (time_ns, offsets) in
                [(1, vec![0x12, 0x30]), (2, vec![0x24, 0x30]), (3, vec![no, 0x30]), (4, vec![0x200, 0])]
            {
                b.apply(&Message::Sample {
                    time_ns,
                    thread_id: 1,
                    kind: EventKind::Cpu,
                    weight: 1,
                    truncated: false,
                    leaf: String::new(),
                    frames: vec![1, 2],
                    il_offsets: offsets,
                });
            }
            let p = b.finish();
            let leaves: Vec<Option<u32>> = p
                .samples
                .iter()
                .map(|s| p.frames[p.stacks[s.stack as usize][0] as usize].source.as_ref().map(|l| l.line))
                .collect();
            (leaves, p)
        };
        // Lines 41 and 42; an unknown offset, and one the PDB has no line
        // for, keep the method's own frame; Main has no FunctionSource.
        let (leaves, p) = run(true);
        assert_eq!(leaves, [Some(41), Some(42), None, None]);
        let names: Vec<_> = p.samples.iter().map(|s| p.stacks[s.stack as usize][0]).collect();
        assert_eq!(names[2], names[3], "the method's frame, whatever the offset");
        assert_eq!(p.frames[names[0] as usize].source.as_ref().unwrap().file, "/src/App.cs");
        assert!(p.frames.iter().filter(|f| f.name == "App.Main").all(|f| f.source.is_none()));
        // Without a locator the offsets change nothing.
        let (leaves, p) = run(false);
        assert_eq!(leaves, [None, None, None, None]);
        assert_eq!(p.stacks.len(), 1);
    }

    fn function(function_id: u64, name: &str, module: &str) -> Message {
        Message::Function { function_id, name: name.into(), module: module.into() }
    }

    const N: u64 = corsnap_wire::NATIVE_FRAME_BIT;

    /// A main thread under the host, a worker under its thread start, a
    /// native-only GC thread: frames leaf first.
    fn roots_builder(native: NativeFrames, roots: RootFrames) -> ProfileBuilder {
        let mut b = ProfileBuilder::new();
        b.set_native_frames(native);
        b.set_root_frames(roots);
        for message in [
            function(N | 1, "dotnet+0x6c48", "dotnet"),
            function(N | 2, "libc.so.6!__libc_start_main_alias_2", "libc.so.6"),
            function(N | 3, "libhostfxr.so!hostfxr_main_startupinfo", "libhostfxr.so"),
            function(N | 4, "libcoreclr.so+0x63cf50", "libcoreclr.so"),
            function(N | 5, "libc.so.6!clone3", "libc.so.6"),
            function(N | 6, "libc.so.6!start_thread", "libc.so.6"),
            function(N | 7, "libc.so.6!qsort", "libc.so.6"),
            function(N | 8, "[incomplete stack]", ""),
            function(0x10, "Shop.Program.Main", "Shop.dll"),
            function(0x20, "Shop.Sorter.Compare", "Shop.dll"),
            function(0x30, "System.Threading.Thread.StartCallback", "System.Private.CoreLib.dll"),
        ] {
            b.apply(&message);
        }
        let main = [0x20, N | 7, 0x10, N | 4, N | 4, N | 3, N | 2, N | 1];
        b.add_sample(1, 1, false, &main, 1);
        b.add_sample(2, 2, false, &[0x20, 0x30, N | 4, N | 6, N | 5], 1);
        b.add_sample(3, 3, false, &[N | 4, N | 6, N | 5], 1);
        b.add_sample(4, 1, true, &main[..5], 1);
        b.add_sample(5, 1, false, &[0x20, 0x10, N | 4, N | 8], 1);
        b
    }

    fn stacks(p: &Profile) -> Vec<String> {
        p.samples.iter().map(|s| p.stack_names_root_first(s.stack).collect::<Vec<_>>().join(";")).collect()
    }

    #[test]
    fn frames_below_the_first_managed_one_fold_into_what_they_are() {
        let p = roots_builder(NativeFrames::Show, RootFrames::Fold).finish();
        assert_eq!(
            stacks(&p),
            [
                "[host start-up];Shop.Program.Main;libc.so.6!qsort;Shop.Sorter.Compare",
                "[thread start];System.Threading.Thread.StartCallback;Shop.Sorter.Compare",
                // Nothing managed: a native thread keeps its frames.
                "libc.so.6!clone3;libc.so.6!start_thread;libcoreclr.so+0x63cf50",
                // Cut short, or lost on the way: never folded.
                "[truncated];libcoreclr.so+0x63cf50;libcoreclr.so+0x63cf50;Shop.Program.Main;libc.so.6!qsort;Shop.Sorter.Compare",
                "[incomplete stack];libcoreclr.so+0x63cf50;Shop.Program.Main;Shop.Sorter.Compare",
            ]
        );
        assert_eq!(p.frames.iter().filter(|f| f.kind == FrameKind::Start).count(), 2);

        let collapsed = stacks(&roots_builder(NativeFrames::Collapse, RootFrames::Fold).finish());
        assert_eq!(collapsed[0], "[host start-up];Shop.Program.Main;[native code];Shop.Sorter.Compare");
        assert_eq!(collapsed[1], "[thread start];System.Threading.Thread.StartCallback;Shop.Sorter.Compare");

        let shown = stacks(&roots_builder(NativeFrames::Show, RootFrames::Show).finish());
        assert_eq!(
            shown[0],
            "dotnet+0x6c48;libc.so.6!__libc_start_main_alias_2;libhostfxr.so!hostfxr_main_startupinfo;\
             libcoreclr.so+0x63cf50;libcoreclr.so+0x63cf50;Shop.Program.Main;libc.so.6!qsort;Shop.Sorter.Compare"
        );
    }

    #[test]
    fn the_runtimes_own_walks_fold_by_thread_the_first_being_the_hosts() {
        let mut b = ProfileBuilder::new();
        b.apply(&Message::Hello {
            protocol: 1,
            pid: 77,
            runtime_version: "10.0.0".into(),
            info_version: 14,
            rate_hz: 100,
            attached: false,
        });
        b.apply(&Message::Thread { thread_id: 10, os_tid: 77, name: String::new() });
        b.apply(&Message::Thread { thread_id: 11, os_tid: 78, name: "worker".into() });
        b.apply(&function(0x10, "Shop.Program.Main", "Shop.dll"));
        b.apply(&function(0x20, "Shop.Sorter.Compare", "Shop.dll"));
        b.add_sample(1, 10, false, &[0x20, 0, 0x10, 0], 1);
        b.add_sample(2, 11, false, &[0x20, 0], 1);
        b.add_sample(3, 11, false, &[0x20], 1);
        b.set_root_frames(RootFrames::Show);
        b.add_sample(4, 10, false, &[0x20, 0, 0x10, 0], 1);
        assert_eq!(
            stacks(&b.finish()),
            [
                "[host start-up];Shop.Program.Main;[native code];Shop.Sorter.Compare",
                "[thread start];Shop.Sorter.Compare",
                "Shop.Sorter.Compare",
                "[native code];Shop.Program.Main;[native code];Shop.Sorter.Compare",
            ]
        );
    }

    /// Each sample's stack as shown, root first.
    fn shown_stacks(p: &Profile) -> Vec<String> {
        p.samples
            .iter()
            .map(|s| {
                let frames = p.stacks[s.stack as usize].iter().rev();
                frames.map(|&f| p.frames[f as usize].display_name().into_owned()).collect::<Vec<_>>().join(";")
            })
            .collect()
    }

    #[test]
    fn a_state_machine_is_named_by_what_calls_it() {
        let mut b = ProfileBuilder::new();
        for message in [
            function(0x10, "Shop.Program.Main", "Shop.dll"),
            function(0x20, "Shop.Orders+<HandleAsync>d__4.MoveNext", "Shop.dll"),
            function(0x30, "System.Runtime.CompilerServices.AsyncMethodBuilderCore.Start<TStateMachine>", "c.dll"),
            function(0x40, "Shop.Orders.HandleAsync", "Shop.dll"),
            function(0x50, "Shop.Repo+<Items>d__3.MoveNext", "Shop.dll"),
            function(0x60, "System.Linq.Enumerable.Sum", "System.Linq.dll"),
            function(0x70, "Shop.Program+<>c.<Main>b__0_1", "Shop.dll"),
        ] {
            b.apply(&message);
        }
        b.add_sample(1, 1, false, &[0x20, 0x30, 0x40, 0x10], 1);
        b.add_sample(2, 1, false, &[0x50, 0x60, 0x70, 0x10], 1);
        b.add_sample(3, 1, false, &[0x50, 0x20, 0x30, 0x40, 0x10], 1);
        b.add_sample(4, 1, false, &[0x50], 1);
        let p = b.finish();
        let shown = shown_stacks(&p);
        assert_eq!(
            shown,
            [
                "Shop.Program.Main;Shop.Orders.HandleAsync;\
                 System.Runtime.CompilerServices.AsyncMethodBuilderCore.Start<TStateMachine>;Shop.Orders.HandleAsync [async]",
                "Shop.Program.Main;Shop.Program.Main.lambda#1;System.Linq.Enumerable.Sum;Shop.Repo.Items [iterator]",
                // A foreach in an async method; a stack that says nothing.
                "Shop.Program.Main;Shop.Orders.HandleAsync;\
                 System.Runtime.CompilerServices.AsyncMethodBuilderCore.Start<TStateMachine>;Shop.Orders.HandleAsync [async];\
                 Shop.Repo.Items [iterator]",
                "Shop.Repo.Items [state machine]",
            ]
        );
        // The raw name is the same in every variant.
        let items: Vec<_> = p.frames.iter().filter(|f| f.name == "Shop.Repo+<Items>d__3.MoveNext").collect();
        assert_eq!(items.len(), 2);
    }

    #[test]
    fn a_state_machine_the_metadata_tells_of_is_named_so_whatever_calls_it() {
        let mut b = ProfileBuilder::new();
        for message in [
            function(0x10, "Shop.Program.Main", "Shop.dll"),
            function(0x20, "Shop.Orders+<HandleAsync>d__4.MoveNext", "Shop.dll"),
            Message::StateMachine { function_id: 0x20, kind: StateMachine::Async },
            function(0x50, "Shop.Repo+<Items>d__3.MoveNext", "Shop.dll"),
            Message::StateMachine { function_id: 0x50, kind: StateMachine::Iterator },
        ] {
            b.apply(&message);
        }
        // .NET 10's JIT inlines `AsyncMethodBuilderCore.Start` and the
        // kickoff method (they hold a try/finally): the caller says iterator.
        b.add_sample(1, 1, false, &[0x20, 0x10], 1);
        b.add_sample(2, 1, false, &[0x50], 1);
        let p = b.finish();
        let shown = shown_stacks(&p);
        assert_eq!(shown, ["Shop.Program.Main;Shop.Orders.HandleAsync [async]", "Shop.Repo.Items [iterator]"]);
    }

    #[test]
    fn a_name_that_arrives_late_names_the_earlier_samples_too_and_is_never_lost() {
        let mut b = ProfileBuilder::new();
        b.apply(&Message::Thread { thread_id: 10, os_tid: 77, name: String::new() });
        b.apply(&cpu_sample(1, 10, false, vec![1]));
        b.apply(&Message::Thread { thread_id: 10, os_tid: 77, name: "worker-2".into() });
        b.apply(&cpu_sample(2, 10, false, vec![1]));
        b.apply(&Message::Thread { thread_id: 10, os_tid: 77, name: String::new() });
        b.apply(&cpu_sample(2, 10, false, vec![1]));
        // A renamed thread keeps both names; a reused ThreadID on another OS
        // thread is another thread.
        b.apply(&Message::Thread { thread_id: 10, os_tid: 77, name: "renamed".into() });
        b.apply(&cpu_sample(3, 10, false, vec![1]));
        b.apply(&Message::Thread { thread_id: 10, os_tid: 78, name: String::new() });
        b.apply(&cpu_sample(4, 10, false, vec![1]));
        let p = b.finish();
        let labels: Vec<_> = p.samples.iter().map(|s| p.threads[s.thread as usize].label()).collect();
        assert_eq!(labels, ["worker-2 tid=77", "worker-2 tid=77", "worker-2 tid=77", "renamed tid=77", "tid=78"]);
    }
}
