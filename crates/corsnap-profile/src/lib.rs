//! corsnap's profile model: frames, stacks and threads interned once, samples
//! pointing at them. Every writer reads a [`Profile`]; nothing here knows
//! about the command line.

#![forbid(unsafe_code)]

mod builder;
pub mod limits;
pub mod names;
pub mod processes;
pub mod roots;
pub mod writers;

pub use builder::{NativeFrames, ProfileBuilder, RootFrames};
pub use names::StateMachine;

use std::collections::HashMap;

pub use corsnap_wire::EventKind;

/// Index into [`Profile::frames`].
pub type FrameIdx = u32;
/// Index into [`Profile::stacks`].
pub type StackIdx = u32;
/// Index into [`Profile::threads`].
pub type ThreadIdx = u32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// A managed method with a resolved name.
    Managed,
    /// A run of unmanaged frames the runtime skipped over (`[native code]`).
    Native,
    /// One native function (`libc.so.6!qsort`), or an address in a module
    /// without a symbol there (`libcoreclr.so+0x1a2b3c`).
    NativeSymbol,
    /// A `FunctionID` whose name the agent never sent.
    Unresolved,
    /// Marks a stack the agent cut short at its buffer size.
    Truncated,
    /// The native frames below a thread's first managed frame, folded into
    /// one (`[host start-up]`, `[thread start]`).
    Start,
    /// What an event was about, above the stack: an exception's or
    /// allocation's type, a loaded class, a collection.
    Subject,
    /// The process a stack came from, at the root of every stack of a
    /// recording of several (`record --subprocesses`): `process 1234:"app"`.
    Process,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The name as the agent sent it (`Shop.Billing.Ledger<TKey>+Entry.Settle<TValue>`,
    /// `Shop.Orders+<HandleAsync>d__4.MoveNext`); [`Frame::display_name`] is
    /// what a person reads.
    pub name: String,
    /// The module file it lives in (`app.dll`), empty when unknown.
    pub module: String,
    pub kind: FrameKind,
    /// What the stack showed a Roslyn state machine's `MoveNext` to be
    /// (the same method can be interned once per answer).
    pub state_machine: Option<StateMachine>,
    /// The source line the sampled code was compiled from, when the
    /// assembly's PDB says (a method is interned once per line).
    pub source: Option<SourceLine>,
}

/// A position in a source file, from a portable PDB's sequence points.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SourceLine {
    /// The document's path as the compiler recorded it.
    pub file: String,
    pub line: u32,
}

/// Finds the source line of an IL offset of a method, through the PDB of the
/// assembly it is in. The command line implements it (reading PDBs is no
/// business of the profile model, nor of the profiled process).
pub trait SourceLocator {
    /// The line `il_offset` of the method with `MethodDef` token
    /// `method_token`, in `assembly`, was compiled from; `None` when the
    /// assembly has no matching PDB or the PDB no line for it.
    fn locate(&mut self, assembly: &Assembly, method_token: u32, il_offset: u32) -> Option<SourceLine>;
}

/// A loaded assembly, as the agent described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assembly {
    /// The path it was loaded from.
    pub path: String,
    /// The PDB its loaded image names.
    pub pdb: Option<corsnap_wire::PdbReference>,
}

impl Frame {
    pub fn new(name: impl Into<String>, module: impl Into<String>, kind: FrameKind) -> Frame {
        Frame { name: name.into(), module: module.into(), kind, state_machine: None, source: None }
    }

    /// `name (File.cs:42)`: a frame's name with its line, the source file
    /// shown by its file name alone (py-spy's notation).
    pub fn name_with_line(name: &str, source: &SourceLine) -> String {
        let file = source.file.rsplit(['/', '\\']).next().unwrap_or(&source.file);
        format!("{name} ({file}:{})", source.line)
    }

    /// The name a person reads: a managed method the compiler generated as
    /// the method the user wrote ([`names::readable_name`]); every other
    /// name as it is.
    pub fn display_name(&self) -> std::borrow::Cow<'_, str> {
        match self.kind {
            FrameKind::Managed => names::readable_name(&self.name, self.state_machine),
            _ => std::borrow::Cow::Borrowed(&self.name),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Thread {
    pub os_tid: u32,
    /// Empty when the program never named the thread.
    pub name: String,
}

impl Thread {
    /// `worker-3 tid=1234`, or `tid=1234` for an unnamed thread.
    pub fn label(&self) -> String {
        if self.name.is_empty() {
            format!("tid={}", self.os_tid)
        } else {
            format!("{} tid={}", self.name, self.os_tid)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Nanoseconds since the agent started sampling.
    pub time_ns: u64,
    pub thread: ThreadIdx,
    pub stack: StackIdx,
    /// How much this sample counts, in [`EventKind::unit`]s of its kind.
    pub weight: u64,
    pub kind: EventKind,
}

/// One garbage collection, as the agent reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcRecord {
    pub time_ns: u64,
    pub generation: u32,
    /// `COR_PRF_GC_REASON`: 0 other, 1 induced.
    pub reason: u32,
    pub pause_ns: u64,
}

/// What the recording was, for writers that show it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meta {
    /// The command that was profiled, as the user typed it.
    pub command: String,
    pub pid: u32,
    pub runtime_version: String,
    pub rate_hz: u32,
    pub start_unix_ms: u64,
    /// How long the profile covers, when known (a continuous recording's
    /// window); 0 lets writers take the span of its samples.
    pub duration_ns: u64,
    pub stats: Option<corsnap_wire::SamplerStats>,
}

#[derive(Debug, Clone, Default)]
pub struct Profile {
    pub meta: Meta,
    pub frames: Vec<Frame>,
    /// Each stack is a list of frames, **leaf first** (as the runtime reports them).
    pub stacks: Vec<Vec<FrameIdx>>,
    pub threads: Vec<Thread>,
    pub samples: Vec<Sample>,
    pub gcs: Vec<GcRecord>,
    /// The kernel's names for OS threads, for threads the program never
    /// named.
    pub os_thread_names: HashMap<u32, String>,
    frame_index: HashMap<Frame, FrameIdx>,
    stack_index: HashMap<Vec<FrameIdx>, StackIdx>,
    thread_index: HashMap<Thread, ThreadIdx>,
}

impl Profile {
    pub fn new(meta: Meta) -> Self {
        Profile { meta, ..Default::default() }
    }

    pub fn intern_frame(&mut self, frame: Frame) -> FrameIdx {
        if let Some(&i) = self.frame_index.get(&frame) {
            return i;
        }
        let i = self.frames.len() as FrameIdx;
        self.frames.push(frame.clone());
        self.frame_index.insert(frame, i);
        i
    }

    /// `frames` leaf first.
    pub fn intern_stack(&mut self, frames: &[FrameIdx]) -> StackIdx {
        if let Some(&i) = self.stack_index.get(frames) {
            return i;
        }
        let i = self.stacks.len() as StackIdx;
        self.stacks.push(frames.to_vec());
        self.stack_index.insert(frames.to_vec(), i);
        i
    }

    /// Gives an unnamed thread the name it was given later, so that all its
    /// samples carry it. `false` (nothing changed) if it already has a name
    /// or another thread is known by the new one.
    pub fn name_thread(&mut self, idx: ThreadIdx, name: &str) -> bool {
        let Some(old) = self.threads.get(idx as usize).cloned() else { return false };
        let named = Thread { os_tid: old.os_tid, name: name.to_string() };
        if !old.name.is_empty() || name.is_empty() || self.thread_index.contains_key(&named) {
            return false;
        }
        self.thread_index.remove(&old);
        self.thread_index.insert(named.clone(), idx);
        self.threads[idx as usize] = named;
        true
    }

    pub fn intern_thread(&mut self, thread: Thread) -> ThreadIdx {
        if let Some(&i) = self.thread_index.get(&thread) {
            return i;
        }
        let i = self.threads.len() as ThreadIdx;
        self.threads.push(thread.clone());
        self.thread_index.insert(thread, i);
        i
    }

    /// The event kinds that have samples, in [`EventKind::ALL`] order.
    pub fn kinds(&self) -> Vec<EventKind> {
        let mut kinds: Vec<EventKind> = self.samples.iter().map(|s| s.kind).collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }

    /// The same profile with only the samples of `kind`: what the
    /// single-profile formats (collapsed, flame graph, speedscope) write.
    pub fn only(&self, kind: EventKind) -> Profile {
        let mut p = self.clone();
        p.samples.retain(|s| s.kind == kind);
        p
    }

    /// A profile of `samples` and `gcs` (which point into this profile's
    /// tables) holding only the frames, stacks and threads they use: a
    /// window of a continuous recording, as small as what it shows.
    pub fn subset(&self, samples: impl IntoIterator<Item = Sample>, gcs: Vec<GcRecord>) -> Profile {
        let mut out = Profile::new(self.meta.clone());
        out.gcs = gcs;
        let mut frame_map: HashMap<FrameIdx, FrameIdx> = HashMap::new();
        let mut stack_map: HashMap<StackIdx, StackIdx> = HashMap::new();
        let mut thread_map: HashMap<ThreadIdx, ThreadIdx> = HashMap::new();
        let mut scratch = Vec::new();
        for sample in samples {
            let stack = match stack_map.get(&sample.stack) {
                Some(&s) => s,
                None => {
                    scratch.clear();
                    for &f in &self.stacks[sample.stack as usize] {
                        let mapped =
                            *frame_map.entry(f).or_insert_with(|| out.intern_frame(self.frames[f as usize].clone()));
                        scratch.push(mapped);
                    }
                    let s = out.intern_stack(&scratch);
                    stack_map.insert(sample.stack, s);
                    s
                }
            };
            let thread = *thread_map.entry(sample.thread).or_insert_with(|| {
                let thread = self.threads[sample.thread as usize].clone();
                if let Some(kernel) = self.os_thread_names.get(&thread.os_tid) {
                    out.os_thread_names.insert(thread.os_tid, kernel.clone());
                }
                out.intern_thread(thread)
            });
            out.samples.push(Sample { stack, thread, ..sample });
        }
        out
    }

    /// Total weight of all samples.
    pub fn total_weight(&self) -> u64 {
        self.samples.iter().map(|s| s.weight).sum()
    }

    /// A thread's label: its name, or else the kernel's name for its OS
    /// thread, then its OS thread id (`worker-3 tid=1234`, `dotnet tid=1200`).
    pub fn thread_label(&self, idx: ThreadIdx) -> String {
        let thread = &self.threads[idx as usize];
        match self.os_thread_names.get(&thread.os_tid) {
            Some(kernel) if thread.name.is_empty() && !kernel.is_empty() => format!("{kernel} tid={}", thread.os_tid),
            _ => thread.label(),
        }
    }

    /// Adds `other`'s samples (and the threads, frames and collections they
    /// use) to this profile, each stack under `root` when given.
    pub fn absorb(&mut self, other: &Profile, root: Option<Frame>) {
        let root = root.map(|f| self.intern_frame(f));
        let mut frames: HashMap<FrameIdx, FrameIdx> = HashMap::new();
        let mut stacks: HashMap<StackIdx, StackIdx> = HashMap::new();
        let mut threads: HashMap<ThreadIdx, ThreadIdx> = HashMap::new();
        for sample in &other.samples {
            let stack = match stacks.get(&sample.stack) {
                Some(&s) => s,
                None => {
                    let mut mapped: Vec<FrameIdx> = other.stacks[sample.stack as usize]
                        .iter()
                        .map(|&f| {
                            *frames.entry(f).or_insert_with(|| self.intern_frame(other.frames[f as usize].clone()))
                        })
                        .collect();
                    mapped.extend(root);
                    let s = self.intern_stack(&mapped);
                    stacks.insert(sample.stack, s);
                    s
                }
            };
            let thread = *threads
                .entry(sample.thread)
                .or_insert_with(|| self.intern_thread(other.threads[sample.thread as usize].clone()));
            self.samples.push(Sample { stack, thread, ..*sample });
        }
        self.gcs.extend_from_slice(&other.gcs);
        for (tid, name) in &other.os_thread_names {
            self.os_thread_names.entry(*tid).or_insert_with(|| name.clone());
        }
    }

    /// Frame names of a stack, root first: the order flame graphs draw.
    pub fn stack_names_root_first(&self, stack: StackIdx) -> impl Iterator<Item = &str> {
        self.stacks[stack as usize].iter().rev().map(|&f| self.frames[f as usize].name.as_str())
    }
}
