//! The messages the agent sends to the `corsnap` command line tool, and the
//! raw recording file that `corsnap report` re-renders.
//!
//! One encoding serves both: a message is a frame `u32 length (LE) | u8 tag |
//! payload`, and a raw recording is a header followed by the same frames the
//! agent sent. Decoding never trusts a length: every read is bounds-checked
//! and a frame larger than [`MAX_FRAME_LEN`] is refused, because the bytes come
//! from another process (or from a file a user hands us).

#![forbid(unsafe_code)]

use std::fmt;
use std::io::{self, Read, Write};

/// Bumped whenever a message changes shape; the CLI refuses other versions.
pub const PROTOCOL_VERSION: u32 = 4;

/// No legitimate frame comes near this: a 8192-frame stack is 64 KiB.
pub const MAX_FRAME_LEN: u32 = 4 * 1024 * 1024;

/// First bytes of a raw recording file.
pub const RAW_MAGIC: &[u8; 8] = b"CORSNAP\0";
/// Version of the raw recording container (independent of the protocol).
pub const RAW_VERSION: u32 = 1;

/// The environment variable that tells a launched agent where the CLI listens.
pub const ENV_SOCKET: &str = "CORSNAP_SOCKET";
/// The pid of the corsnap that launched the program. An agent loaded at
/// start-up by a process that is not that corsnap's child (a process the
/// program started, inheriting the environment) stays out, unless
/// [`ENV_SUBPROCESSES`] is `1`.
pub const ENV_CLI_PID: &str = "CORSNAP_CLI_PID";
/// `1`: the program's own .NET child processes are recorded too (`record
/// --subprocesses`); they connect to the same socket, which stays in place.
pub const ENV_SUBPROCESSES: &str = "CORSNAP_SUBPROCESSES";
/// Sampling rate for a launched agent, in Hz.
pub const ENV_RATE: &str = "CORSNAP_RATE_HZ";
/// Most of the program's wall time, in parts per million, that slow ticks
/// may keep it stopped for (see the agent's pause budget).
pub const ENV_MAX_PAUSE: &str = "CORSNAP_MAX_PAUSE_PPM";
/// The default of [`ENV_MAX_PAUSE`]: 2%.
pub const DEFAULT_MAX_PAUSE_PPM: u32 = 20_000;
/// Path of the agent's own log file; unset means the agent logs nothing.
pub const ENV_LOG: &str = "CORSNAP_AGENT_LOG";
/// For benchmarks only (`bench/run.py`): when `1`, each tick suspends and
/// resumes the runtime and walks nothing, which measures what the runtime's
/// own suspension costs a program. Such a recording has no samples.
pub const ENV_BENCH_SUSPEND_ONLY: &str = "CORSNAP_BENCH_SUSPEND_ONLY";
/// For benchmarks only (`bench/events.py`): `monitor` makes `ExceptionThrown`
/// return at once, `walk` makes it walk the thread's stack and drop it. They
/// measure what the runtime's exception callbacks, and then its synchronous
/// walk, cost by themselves. Such a recording has no exceptions.
pub const ENV_BENCH_EXCEPTIONS: &str = "CORSNAP_BENCH_EXCEPTIONS";
/// For benchmarks only (`bench/events.py`): when `1`, the allocation
/// profile's EventPipe session runs but its events are ignored, which
/// measures what the runtime's delivery of them costs by itself.
pub const ENV_BENCH_ALLOC_SESSION_ONLY: &str = "CORSNAP_BENCH_ALLOC_SESSION_ONLY";

/// Which engine takes CPU samples in a launched agent: `signal` or `suspend`.
pub const ENV_SAMPLER: &str = "CORSNAP_SAMPLER";
/// The signal engine's clock in a launched agent ([`CpuClock::name`];
/// `--cpu-clock`). Absent, it is [`CpuClock::Perf`].
pub const ENV_CPU_CLOCK: &str = "CORSNAP_CPU_CLOCK";
/// Folders a launched agent searches for native debug files (`--symbols`),
/// separated by newlines (a path may hold a `:`).
pub const ENV_SYMBOLS: &str = "CORSNAP_SYMBOLS";

/// How CPU samples are taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SamplerKind {
    /// One thread at a time, interrupted by its own CPU-time timer, its
    /// stack walked by corsnap's unwinder in a signal handler.
    Signal,
    /// The whole runtime suspended each tick, every thread walked with
    /// `DoStackSnapshot`.
    Suspend,
}

impl SamplerKind {
    pub fn name(self) -> &'static str {
        match self {
            SamplerKind::Signal => "signal",
            SamplerKind::Suspend => "suspend",
        }
    }

    pub fn parse(s: &str) -> Option<SamplerKind> {
        match s {
            "signal" => Some(SamplerKind::Signal),
            "suspend" => Some(SamplerKind::Suspend),
            _ => None,
        }
    }
}

/// How a launched agent walks event stacks: `native` or `snapshot`.
pub const ENV_WALKER: &str = "CORSNAP_WALKER";

/// What interrupts a thread for the signal engine's samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CpuClock {
    /// A perf event for each thread that runs long stretches, a POSIX CPU
    /// timer for each that switches often (where perf events cost at every
    /// switch); decided per thread as it runs.
    Auto,
    /// A perf event on every thread's CPU time (where the kernel allows one).
    Perf,
    /// A POSIX CPU-time timer on every thread.
    Timer,
}

impl CpuClock {
    pub fn name(self) -> &'static str {
        match self {
            CpuClock::Auto => "auto",
            CpuClock::Perf => "perf",
            CpuClock::Timer => "timer",
        }
    }

    pub fn parse(s: &str) -> Option<CpuClock> {
        match s {
            "auto" => Some(CpuClock::Auto),
            "perf" => Some(CpuClock::Perf),
            "timer" => Some(CpuClock::Timer),
            _ => None,
        }
    }
}

/// How event stacks (exceptions, allocation ticks, class loads, collections)
/// are walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WalkerKind {
    /// corsnap's own unwinder, on the thread the event happens on, raw
    /// addresses named later (where it can serve; else as `Snapshot`).
    Native,
    /// The runtime's `DoStackSnapshot` of the current thread.
    Snapshot,
}

impl WalkerKind {
    pub fn name(self) -> &'static str {
        match self {
            WalkerKind::Native => "native",
            WalkerKind::Snapshot => "snapshot",
        }
    }

    pub fn parse(s: &str) -> Option<WalkerKind> {
        match s {
            "native" => Some(WalkerKind::Native),
            "snapshot" => Some(WalkerKind::Snapshot),
            _ => None,
        }
    }
}

/// Bit 63 of a frame id marks a native frame (a symbol, or an address with
/// no symbol), named by a `Function` message like managed frames are; no
/// `FunctionID` (a pointer) ever has it.
pub const NATIVE_FRAME_BIT: u64 = 1 << 63;
/// Bit 63 of a thread id marks a thread the runtime does not manage (the GC's,
/// the JIT's, a native thread of the program), identified by its OS tid.
pub const NATIVE_THREAD_BIT: u64 = 1 << 63;

/// The agent's CLSID, as the runtime wants it in `CORECLR_PROFILER`.
pub const AGENT_CLSID: &str = "{6A3B7C2E-9D41-4F8A-B5E2-3C7D1A9F0E64}";

/// Counters the agent keeps about its own sampling, so a user (and the
/// benchmark) can see what profiling cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SamplerStats {
    /// Timer ticks that suspended the runtime and walked.
    pub ticks: u64,
    /// Ticks skipped because the runtime could not be suspended (a GC or
    /// another suspension was in progress).
    pub skipped_ticks: u64,
    /// Thread stacks recorded.
    pub samples: u64,
    /// `DoStackSnapshot` calls that failed with something other than the
    /// harmless "no managed frames" `E_FAIL`.
    pub walk_errors: u64,
    /// Stacks cut short because they had more frames than the buffer holds.
    pub truncated_stacks: u64,
    /// Nanoseconds spent in `SuspendRuntime`, summed over ticks.
    pub suspend_ns: u64,
    /// Nanoseconds spent walking all threads while suspended, summed.
    pub walk_ns: u64,
    /// Nanoseconds spent in `ResumeRuntime`, summed.
    pub resume_ns: u64,
    /// The longest single tick (suspend + walk + resume), in nanoseconds.
    pub max_tick_ns: u64,
    /// Function names resolved (each once).
    pub names_resolved: u64,
    /// Function names that could not be resolved.
    pub name_failures: u64,
    /// Medians over the most recent ticks (up to 4096), in nanoseconds: the
    /// sums above are dominated by rare long ticks on a busy machine.
    pub suspend_p50_ns: u64,
    pub walk_p50_ns: u64,
    pub resume_p50_ns: u64,
    /// 99th percentile of a whole tick over the same window.
    pub tick_p99_ns: u64,
    /// CPU time the sampler thread itself has used.
    pub sampler_cpu_ns: u64,
    /// Times a cache of the agent hit its cap and was emptied (memory stays
    /// bounded; names are looked up and sent again).
    pub cache_resets: u64,
    /// Events (exceptions, allocations…) dropped because too many were
    /// waiting to be sent.
    pub events_dropped: u64,
    /// Ticks that came due while the pause budget was spent, and were
    /// skipped so that slow suspensions cannot stop the program for long.
    pub throttled_ticks: u64,
    /// Which engine took the CPU samples: 0 `suspend`, 1 `signal`.
    pub engine: u64,
    /// Signal engine: samples its handler took.
    pub signal_samples: u64,
    /// Signal engine: signals that could not become samples (a full
    /// buffer, a stack in no known mapping, the agent not ready).
    pub signal_dropped: u64,
    /// Signal engine: stacks whose walk stopped before the thread's root.
    pub incomplete_stacks: u64,
    /// Signal engine: stacks with a frame in code not yet learned (stepped
    /// over by its return address or frame pointer).
    pub unknown_code_stacks: u64,
    /// Signal engine: time from entering the handler to the sample being
    /// stored, median and 99th percentile over recent samples.
    pub handler_p50_ns: u64,
    pub handler_p99_ns: u64,
    /// Signal engine: threads with a CPU timer now.
    pub threads_sampled: u64,
    /// Signal engine: of those, threads a POSIX CPU timer samples now (the
    /// rest have perf events).
    pub threads_on_timers: u64,
    /// Signal engine (`--cpu-clock auto`): times a thread was moved from
    /// one clock to the other.
    pub clock_switches: u64,
    /// Signal engine: samples taken more than a second after sampling
    /// started, and of those, the stacks with a frame in code not yet
    /// learned: whether learning converged.
    pub samples_after_first_second: u64,
    pub unknown_code_stacks_after_first_second: u64,
    /// Signal engine: samples whose handler stored a copy of the stack
    /// (its walk met code not learned yet), walked again by the agent.
    /// Those samples are the handler's dearest.
    pub stack_copies: u64,
    /// Signal engine: samples whose walk met code not learned yet but whose
    /// copy found no room (the agent's thread had not drained the thread's
    /// buffer in time): kept up to that code and marked incomplete.
    pub stack_copies_refused: u64,
}

/// Everything that travels from the agent to the CLI. `Recording` is written
/// only by the CLI, at the head of a raw recording file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// First message of a session.
    Hello {
        protocol: u32,
        pid: u32,
        /// The runtime's version as read from its own files, e.g. `8.0.4`.
        runtime_version: String,
        /// Highest `ICorProfilerInfo` the runtime gave us.
        info_version: u32,
        rate_hz: u32,
        attached: bool,
    },
    /// A managed thread's identity, sent when first seen and whenever its OS
    /// thread or name changes.
    Thread { thread_id: u64, os_tid: u32, name: String },
    /// The kernel's name for an OS thread (`comm`, 15 bytes: `.NET TP Worker`,
    /// `dotnet`), which labels a thread the program never named.
    OsThreadName { os_tid: u32, name: String },
    /// A `FunctionID` resolved to its readable name, sent once per id.
    Function { function_id: u64, name: String, module: String },
    /// Where a managed function's source can be found: its module (named
    /// by a [`Message::Module`] sent before) and its `MethodDef` token, the
    /// key of its sequence points in the assembly's portable PDB. Sent once
    /// per function, after its `Function`, when the runtime tells both.
    FunctionSource { function_id: u64, module_id: u64, method_token: u32 },
    /// A compiler-generated state machine's `MoveNext` and what its type
    /// declares it implements. Sent once per function, after its
    /// `Function`, when the metadata tells; otherwise the CLI tells from
    /// the stack's callers.
    StateMachine { function_id: u64, kind: StateMachine },
    /// A loaded module (assembly) by the runtime's `ModuleID`, the file it
    /// was loaded from (empty for a module loaded from memory; in a
    /// single-file bundle, a path beside the bundle where no file is), and
    /// the PDB its image names, read from the loaded image (so a bundled
    /// assembly, or one rebuilt since, is still checked against the PDB it
    /// was built with). Sent once per module.
    Module { module_id: u64, path: String, pdb: Option<PdbReference> },
    /// One stack of one thread, leaf first; a `0` frame is a run of unmanaged
    /// frames. `leaf`, when not empty, is a frame above the stack (the thrown
    /// exception's or allocated object's type). `il_offsets` is empty, or
    /// has one entry per frame: the IL offset the managed frame's native
    /// address maps to, [`NO_IL_OFFSET`] where none is known (native frames,
    /// prologs, code without a mapping).
    Sample {
        time_ns: u64,
        thread_id: u64,
        kind: EventKind,
        weight: u64,
        truncated: bool,
        leaf: String,
        frames: Vec<u64>,
        il_offsets: Vec<u32>,
    },
    /// The agent's running totals.
    Stats(SamplerStats),
    /// A line for the user (a warning or an explanation of a failure).
    Notice { severity: Severity, text: String },
    /// Last message of a session.
    Goodbye { reason: String },
    /// CLI-side header of a raw recording: what was run and when.
    Recording { command: String, start_unix_ms: u64 },
    /// Everything from a requested snapshot has been sent.
    SnapshotEnd,
    /// One garbage collection: the deepest generation collected, the
    /// runtime's `COR_PRF_GC_REASON`, and how long it took.
    Gc { time_ns: u64, generation: u32, reason: u32, pause_ns: u64 },
    /// CLI-side, in a raw recording of several processes (`record
    /// --subprocesses`): the messages that follow, up to the next `Process`,
    /// came from this process. The first names the program corsnap started.
    Process { pid: u32, name: String },
}

/// What a compiler-generated state machine implements: Roslyn names an async
/// method's, an iterator's and an async iterator's alike (`<M>d__4`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StateMachine {
    /// `IAsyncStateMachine`.
    Async = 0,
    /// `IEnumerator`.
    Iterator = 1,
    /// `IAsyncStateMachine` and `IAsyncEnumerator<T>` (seen in metadata by
    /// the non-generic `IAsyncDisposable` beside them).
    AsyncIterator = 2,
}

impl StateMachine {
    pub fn from_u8(value: u8) -> Option<Self> {
        match value {
            0 => Some(StateMachine::Async),
            1 => Some(StateMachine::Iterator),
            2 => Some(StateMachine::AsyncIterator),
            _ => None,
        }
    }

    /// What a type that declares it implements `interfaces`
    /// (namespace-qualified names, non-generic ones at least) is, if a
    /// state machine.
    pub fn from_interfaces<'a>(interfaces: impl IntoIterator<Item = &'a str>) -> Option<Self> {
        let (mut async_machine, mut async_disposable, mut enumerator) = (false, false, false);
        for name in interfaces {
            match name {
                "System.Runtime.CompilerServices.IAsyncStateMachine" => async_machine = true,
                "System.IAsyncDisposable" => async_disposable = true,
                "System.Collections.IEnumerator" => enumerator = true,
                _ => {}
            }
        }
        match (async_machine, async_disposable, enumerator) {
            (true, true, _) => Some(StateMachine::AsyncIterator),
            (true, false, _) => Some(StateMachine::Async),
            (false, _, true) => Some(StateMachine::Iterator),
            _ => None,
        }
    }
}

/// The PDB an assembly was built with, from its CodeView debug directory
/// entry: a portable PDB whose id (its `#Pdb` stream) is `guid` and `stamp`
/// belongs to it, and no other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdbReference {
    /// The GUID's 16 bytes as stored.
    pub guid: [u8; 16],
    /// The debug directory entry's time stamp (the id's last 4 bytes).
    pub stamp: u32,
    /// The PDB's path as the compiler wrote it.
    pub path: String,
}

/// What a sample records; each kind becomes its own profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    /// Timer samples weighted by the CPU time each thread used since its
    /// previous sample (nanoseconds): idle threads vanish.
    Cpu = 0,
    /// Timer samples of every thread, running or not, one per tick.
    Wall = 1,
    /// Every exception thrown, with its type as the leaf (exact counts).
    Exceptions = 2,
    /// Sampled allocations, with the type as the leaf and bytes as the weight.
    Alloc = 3,
    /// Garbage collections, weighted by pause time (nanoseconds).
    Gc = 4,
    /// Every class load, with the class as the leaf.
    ClassLoad = 5,
}

impl EventKind {
    pub const ALL: [EventKind; 6] =
        [EventKind::Cpu, EventKind::Wall, EventKind::Exceptions, EventKind::Alloc, EventKind::Gc, EventKind::ClassLoad];

    pub fn name(self) -> &'static str {
        match self {
            EventKind::Cpu => "cpu",
            EventKind::Wall => "wall",
            EventKind::Exceptions => "exceptions",
            EventKind::Alloc => "alloc",
            EventKind::Gc => "gc",
            EventKind::ClassLoad => "classload",
        }
    }

    /// What a sample's weight counts (pprof's sample type unit).
    pub fn unit(self) -> &'static str {
        match self {
            EventKind::Cpu | EventKind::Gc => "nanoseconds",
            EventKind::Wall => "samples",
            EventKind::Exceptions | EventKind::ClassLoad => "count",
            EventKind::Alloc => "bytes",
        }
    }

    pub fn bit(self) -> u32 {
        1 << self as u32
    }

    fn from_u8(v: u8) -> Option<EventKind> {
        EventKind::ALL.get(v as usize).copied()
    }

    /// A set of kinds as a bit mask, for the environment and attach request.
    pub fn mask(kinds: &[EventKind]) -> u32 {
        kinds.iter().fold(0, |m, k| m | k.bit())
    }

    pub fn from_mask(mask: u32) -> Vec<EventKind> {
        EventKind::ALL.into_iter().filter(|k| mask & k.bit() != 0).collect()
    }
}

impl std::str::FromStr for EventKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        EventKind::ALL.into_iter().find(|k| k.name().eq_ignore_ascii_case(s.trim())).ok_or_else(|| {
            let names: Vec<_> = EventKind::ALL.iter().map(|k| k.name()).collect();
            format!("unknown event {s:?}; expected one of: {}", names.join(", "))
        })
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Environment variable with the events a launched agent records (a mask).
pub const ENV_EVENTS: &str = "CORSNAP_EVENTS";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Info = 0,
    Warning = 1,
    Error = 2,
}

mod tag {
    pub const HELLO: u8 = 1;
    pub const THREAD: u8 = 2;
    pub const FUNCTION: u8 = 3;
    pub const SAMPLE: u8 = 4;
    pub const STATS: u8 = 5;
    pub const NOTICE: u8 = 6;
    pub const GOODBYE: u8 = 7;
    pub const RECORDING: u8 = 8;
    pub const SNAPSHOT_END: u8 = 9;
    pub const GC: u8 = 10;
    pub const OS_THREAD_NAME: u8 = 11;
    pub const PROCESS: u8 = 12;
    /// A sample with an IL offset per frame (protocol 4).
    pub const SAMPLE_IL: u8 = 13;
    pub const FUNCTION_SOURCE: u8 = 14;
    pub const MODULE: u8 = 15;
    pub const STATE_MACHINE: u8 = 16;
}

/// A frame's IL offset when none is known.
pub const NO_IL_OFFSET: u32 = u32::MAX;

/// Why bytes could not be turned into a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The frame ended before a field did.
    Truncated,
    /// The declared frame length is over [`MAX_FRAME_LEN`].
    FrameTooLarge(u32),
    UnknownTag(u8),
    /// A string field is not UTF-8.
    BadUtf8,
    /// A field had a value no encoder produces.
    BadValue(&'static str),
    /// Bytes were left over after the last field.
    TrailingBytes(usize),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Truncated => write!(f, "message ends early"),
            DecodeError::FrameTooLarge(n) => {
                write!(f, "message of {n} bytes is over the {MAX_FRAME_LEN}-byte limit")
            }
            DecodeError::UnknownTag(t) => write!(f, "unknown message type {t}"),
            DecodeError::BadUtf8 => write!(f, "text field is not valid UTF-8"),
            DecodeError::BadValue(what) => write!(f, "invalid value for {what}"),
            DecodeError::TrailingBytes(n) => write!(f, "{n} unexpected bytes after the message"),
        }
    }
}

impl std::error::Error for DecodeError {}

impl From<DecodeError> for io::Error {
    fn from(e: DecodeError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// Appends little-endian fields to a buffer. The agent reuses one buffer, so
/// encoding a sample allocates only when the buffer has to grow.
#[derive(Debug)]
struct Writer<'a> {
    buf: &'a mut Vec<u8>,
}

impl<'a> Writer<'a> {
    fn new(buf: &'a mut Vec<u8>) -> Self {
        Writer { buf }
    }
    fn out(&mut self) -> &mut Vec<u8> {
        self.buf
    }
    fn u8(&mut self, v: u8) {
        self.out().push(v);
    }
    fn u32(&mut self, v: u32) {
        self.out().extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.out().extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        let bytes = s.as_bytes();
        // A string longer than the frame limit would be refused on the other
        // side anyway; cut it at a char boundary instead.
        let mut end = bytes.len().min(MAX_STRING_LEN);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u32(end as u32);
        self.out().extend_from_slice(&bytes[..end]);
    }
}

/// Names and reasons are cut to this many bytes.
pub const MAX_STRING_LEN: usize = 64 * 1024;

impl Message {
    /// Appends this message, framed, to `buf`.
    pub fn encode_into(&self, buf: &mut Vec<u8>) {
        let start = buf.len();
        buf.extend_from_slice(&[0; 4]);
        let mut w = Writer::new(buf);
        match self {
            Message::Hello { protocol, pid, runtime_version, info_version, rate_hz, attached } => {
                w.u8(tag::HELLO);
                w.u32(*protocol);
                w.u32(*pid);
                w.str(runtime_version);
                w.u32(*info_version);
                w.u32(*rate_hz);
                w.u8(u8::from(*attached));
            }
            Message::Thread { thread_id, os_tid, name } => {
                w.u8(tag::THREAD);
                w.u64(*thread_id);
                w.u32(*os_tid);
                w.str(name);
            }
            Message::OsThreadName { os_tid, name } => {
                w.u8(tag::OS_THREAD_NAME);
                w.u32(*os_tid);
                w.str(name);
            }
            Message::Function { function_id, name, module } => {
                w.u8(tag::FUNCTION);
                w.u64(*function_id);
                w.str(name);
                w.str(module);
            }
            Message::FunctionSource { function_id, module_id, method_token } => {
                w.u8(tag::FUNCTION_SOURCE);
                w.u64(*function_id);
                w.u64(*module_id);
                w.u32(*method_token);
            }
            Message::StateMachine { function_id, kind } => {
                w.u8(tag::STATE_MACHINE);
                w.u64(*function_id);
                w.u8(*kind as u8);
            }
            Message::Module { module_id, path, pdb } => {
                w.u8(tag::MODULE);
                w.u64(*module_id);
                w.str(path);
                if let Some(pdb) = pdb {
                    w.u8(1);
                    w.out().extend_from_slice(&pdb.guid);
                    w.u32(pdb.stamp);
                    w.str(&pdb.path);
                } else {
                    w.u8(0);
                }
            }
            Message::Sample { time_ns, thread_id, kind, weight, truncated, leaf, frames, il_offsets } => {
                let head = SampleHead {
                    time_ns: *time_ns,
                    thread_id: *thread_id,
                    kind: *kind,
                    weight: *weight,
                    truncated: *truncated,
                };
                encode_sample_fields(&mut w, &head, leaf, frames, il_offsets);
            }
            Message::Stats(s) => {
                w.u8(tag::STATS);
                for v in stats_fields(s) {
                    w.u64(v);
                }
            }
            Message::Notice { severity, text } => {
                w.u8(tag::NOTICE);
                w.u8(*severity as u8);
                w.str(text);
            }
            Message::Goodbye { reason } => {
                w.u8(tag::GOODBYE);
                w.str(reason);
            }
            Message::Recording { command, start_unix_ms } => {
                w.u8(tag::RECORDING);
                w.str(command);
                w.u64(*start_unix_ms);
            }
            Message::SnapshotEnd => w.u8(tag::SNAPSHOT_END),
            Message::Gc { time_ns, generation, reason, pause_ns } => {
                w.u8(tag::GC);
                w.u64(*time_ns);
                w.u32(*generation);
                w.u32(*reason);
                w.u64(*pause_ns);
            }
            Message::Process { pid, name } => {
                w.u8(tag::PROCESS);
                w.u32(*pid);
                w.str(name);
            }
        }
        finish_frame(buf, start);
    }

    /// Decodes one frame's body (the bytes after the length prefix).
    pub fn decode(body: &[u8]) -> Result<Message, DecodeError> {
        let mut r = Reader { rest: body };
        let msg = match r.u8()? {
            tag::HELLO => Message::Hello {
                protocol: r.u32()?,
                pid: r.u32()?,
                runtime_version: r.string()?,
                info_version: r.u32()?,
                rate_hz: r.u32()?,
                attached: r.bool()?,
            },
            tag::THREAD => Message::Thread { thread_id: r.u64()?, os_tid: r.u32()?, name: r.string()? },
            tag::FUNCTION => Message::Function { function_id: r.u64()?, name: r.string()?, module: r.string()? },
            tag::OS_THREAD_NAME => Message::OsThreadName { os_tid: r.u32()?, name: r.string()? },
            tag::FUNCTION_SOURCE => {
                Message::FunctionSource { function_id: r.u64()?, module_id: r.u64()?, method_token: r.u32()? }
            }
            tag::STATE_MACHINE => Message::StateMachine {
                function_id: r.u64()?,
                kind: StateMachine::from_u8(r.u8()?).ok_or(DecodeError::BadValue("state machine"))?,
            },
            tag::MODULE => {
                let module_id = r.u64()?;
                let path = r.string()?;
                let pdb = match r.bool()? {
                    true => {
                        let mut guid = [0u8; 16];
                        guid.copy_from_slice(r.take(16)?);
                        Some(PdbReference { guid, stamp: r.u32()?, path: r.string()? })
                    }
                    false => None,
                };
                Message::Module { module_id, path, pdb }
            }
            sample_tag @ (tag::SAMPLE | tag::SAMPLE_IL) => {
                let time_ns = r.u64()?;
                let thread_id = r.u64()?;
                let kind = EventKind::from_u8(r.u8()?).ok_or(DecodeError::BadValue("event kind"))?;
                let weight = r.u64()?;
                let truncated = r.bool()?;
                let leaf = r.string()?;
                let count = r.u32()? as usize;
                if count > r.rest.len() / 8 {
                    return Err(DecodeError::Truncated);
                }
                let mut frames = Vec::with_capacity(count);
                for _ in 0..count {
                    frames.push(r.u64()?);
                }
                let mut il_offsets = Vec::new();
                if sample_tag == tag::SAMPLE_IL {
                    if count > r.rest.len() / 4 {
                        return Err(DecodeError::Truncated);
                    }
                    il_offsets.reserve_exact(count);
                    for _ in 0..count {
                        il_offsets.push(r.u32()?);
                    }
                }
                Message::Sample { time_ns, thread_id, kind, weight, truncated, leaf, frames, il_offsets }
            }
            tag::STATS => {
                // Older agents and recordings send fewer fields; the missing
                // ones read as zero.
                let mut v = [0u64; STATS_FIELDS];
                let present = (r.rest.len() / 8).min(STATS_FIELDS);
                if present < 18 {
                    return Err(DecodeError::Truncated);
                }
                for slot in &mut v[..present] {
                    *slot = r.u64()?;
                }
                Message::Stats(stats_from_fields(v))
            }
            tag::NOTICE => {
                let severity = match r.u8()? {
                    0 => Severity::Info,
                    1 => Severity::Warning,
                    2 => Severity::Error,
                    _ => return Err(DecodeError::BadValue("severity")),
                };
                Message::Notice { severity, text: r.string()? }
            }
            tag::GOODBYE => Message::Goodbye { reason: r.string()? },
            tag::RECORDING => Message::Recording { command: r.string()?, start_unix_ms: r.u64()? },
            tag::PROCESS => Message::Process { pid: r.u32()?, name: r.string()? },
            tag::SNAPSHOT_END => Message::SnapshotEnd,
            tag::GC => Message::Gc { time_ns: r.u64()?, generation: r.u32()?, reason: r.u32()?, pause_ns: r.u64()? },
            other => return Err(DecodeError::UnknownTag(other)),
        };
        if !r.rest.is_empty() {
            return Err(DecodeError::TrailingBytes(r.rest.len()));
        }
        Ok(msg)
    }
}

/// The fixed fields of a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleHead {
    pub time_ns: u64,
    pub thread_id: u64,
    pub kind: EventKind,
    pub weight: u64,
    pub truncated: bool,
}

/// Encodes a sample straight from borrowed parts, so the sampler never
/// builds a `Message` (and a `Vec`) per stack. `il_offsets` is empty, or
/// one per frame (see [`Message::Sample`]).
pub fn encode_sample(buf: &mut Vec<u8>, head: &SampleHead, leaf: &str, frames: &[u64], il_offsets: &[u32]) {
    let start = buf.len();
    buf.extend_from_slice(&[0; 4]);
    let mut w = Writer::new(buf);
    encode_sample_fields(&mut w, head, leaf, frames, il_offsets);
    finish_frame(buf, start);
}

fn encode_sample_fields(w: &mut Writer<'_>, head: &SampleHead, leaf: &str, frames: &[u64], il_offsets: &[u32]) {
    // Without offsets the sample keeps protocol 2's form.
    let with_offsets = !il_offsets.is_empty() && il_offsets.len() == frames.len();
    w.u8(if with_offsets { tag::SAMPLE_IL } else { tag::SAMPLE });
    w.u64(head.time_ns);
    w.u64(head.thread_id);
    w.u8(head.kind as u8);
    w.u64(head.weight);
    w.u8(u8::from(head.truncated));
    w.str(leaf);
    w.u32(frames.len() as u32);
    for f in frames {
        w.u64(*f);
    }
    if with_offsets {
        for o in il_offsets {
            w.u32(*o);
        }
    }
}

fn finish_frame(buf: &mut [u8], start: usize) {
    let len = (buf.len() - start - 4) as u32;
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

const STATS_FIELDS: usize = 33;

fn stats_fields(s: &SamplerStats) -> [u64; STATS_FIELDS] {
    [
        s.ticks,
        s.skipped_ticks,
        s.samples,
        s.walk_errors,
        s.truncated_stacks,
        s.suspend_ns,
        s.walk_ns,
        s.resume_ns,
        s.max_tick_ns,
        s.names_resolved,
        s.name_failures,
        s.suspend_p50_ns,
        s.walk_p50_ns,
        s.resume_p50_ns,
        s.tick_p99_ns,
        s.sampler_cpu_ns,
        s.cache_resets,
        s.events_dropped,
        s.throttled_ticks,
        s.engine,
        s.signal_samples,
        s.signal_dropped,
        s.incomplete_stacks,
        s.unknown_code_stacks,
        s.handler_p50_ns,
        s.handler_p99_ns,
        s.threads_sampled,
        s.threads_on_timers,
        s.clock_switches,
        s.samples_after_first_second,
        s.unknown_code_stacks_after_first_second,
        s.stack_copies,
        s.stack_copies_refused,
    ]
}

fn stats_from_fields(v: [u64; STATS_FIELDS]) -> SamplerStats {
    SamplerStats {
        ticks: v[0],
        skipped_ticks: v[1],
        samples: v[2],
        walk_errors: v[3],
        truncated_stacks: v[4],
        suspend_ns: v[5],
        walk_ns: v[6],
        resume_ns: v[7],
        max_tick_ns: v[8],
        names_resolved: v[9],
        name_failures: v[10],
        suspend_p50_ns: v[11],
        walk_p50_ns: v[12],
        resume_p50_ns: v[13],
        tick_p99_ns: v[14],
        sampler_cpu_ns: v[15],
        cache_resets: v[16],
        events_dropped: v[17],
        throttled_ticks: v[18],
        engine: v[19],
        signal_samples: v[20],
        signal_dropped: v[21],
        incomplete_stacks: v[22],
        unknown_code_stacks: v[23],
        handler_p50_ns: v[24],
        handler_p99_ns: v[25],
        threads_sampled: v[26],
        threads_on_timers: v[27],
        clock_switches: v[28],
        samples_after_first_second: v[29],
        unknown_code_stacks_after_first_second: v[30],
        stack_copies: v[31],
        stack_copies_refused: v[32],
    }
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.rest.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError::BadValue("flag")),
        }
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.u32()? as usize;
        // `Writer::str` never writes more, so a longer string would not
        // survive a decode/encode round trip (the fuzz target's property).
        if n > MAX_STRING_LEN {
            return Err(DecodeError::BadValue("string length"));
        }
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::BadUtf8)
    }
}

/// What the CLI asks of the agent over the same socket (the seed's control
/// commands). Frames are tiny; anything over [`MAX_COMMAND_LEN`] is refused
/// before it is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Stop sampling and take the agent out of the process.
    Detach,
    /// Change the sampling rate; 0 pauses sampling.
    SetRate(u32),
    /// Start (true) or stop (false) watching exceptions.
    Exceptions(bool),
    /// Force a full garbage collection.
    ForceGc,
    /// Walk every thread once, now, and send the stacks followed by
    /// [`Message::SnapshotEnd`].
    SnapshotNow,
}

/// Longest command frame body.
pub const MAX_COMMAND_LEN: u32 = 16;

impl Command {
    pub fn encode_into(&self, buf: &mut Vec<u8>) {
        let start = buf.len();
        buf.extend_from_slice(&[0; 4]);
        match *self {
            Command::Detach => buf.push(0x41),
            Command::SetRate(hz) => {
                buf.push(0x42);
                buf.extend_from_slice(&hz.to_le_bytes());
            }
            Command::Exceptions(on) => buf.extend_from_slice(&[0x43, u8::from(on)]),
            Command::ForceGc => buf.push(0x44),
            Command::SnapshotNow => buf.push(0x45),
        }
        finish_frame(buf, start);
    }

    pub fn decode(body: &[u8]) -> Result<Command, DecodeError> {
        let mut r = Reader { rest: body };
        let cmd = match r.u8()? {
            0x41 => Command::Detach,
            0x42 => Command::SetRate(r.u32()?),
            0x43 => Command::Exceptions(r.bool()?),
            0x44 => Command::ForceGc,
            0x45 => Command::SnapshotNow,
            other => return Err(DecodeError::UnknownTag(other)),
        };
        if !r.rest.is_empty() {
            return Err(DecodeError::TrailingBytes(r.rest.len()));
        }
        Ok(cmd)
    }
}

/// Reads one command frame. `Ok(None)` is a clean end of stream. A frame
/// that decodes badly is `Ok(Some(Err(..)))`: the stream is still in step and
/// the reader may go on; an oversized frame is an `Err`, since the rest of the
/// stream can no longer be trusted.
pub fn read_command(input: &mut impl Read) -> io::Result<Option<Result<Command, DecodeError>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match input.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "stream ends inside a command")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_COMMAND_LEN {
        return Err(DecodeError::FrameTooLarge(len).into());
    }
    let mut body = [0u8; MAX_COMMAND_LEN as usize];
    input.read_exact(&mut body[..len as usize])?;
    Ok(Some(Command::decode(&body[..len as usize])))
}

/// What `corsnap record --pid` hands the agent through the runtime's
/// `AttachProfiler` call: where to connect and how to sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachRequest {
    pub socket: String,
    pub rate_hz: u32,
    /// [`EventKind::mask`] of what to record.
    pub events: u32,
    /// See [`ENV_MAX_PAUSE`]; absent from a request, it is the default.
    pub max_pause_ppm: u32,
    pub log: Option<String>,
    /// How to take CPU samples; a request without it means `suspend` (what
    /// agents before the signal engine did).
    pub sampler: SamplerKind,
    /// The signal engine's clock; a request without it means `perf` (what
    /// agents before the choice per thread did).
    pub clock: CpuClock,
    /// How event stacks are walked; a request without it means `snapshot`
    /// (what agents before the native walker did).
    pub walker: WalkerKind,
    /// Folders to search for native debug files (`--symbols`), absolute.
    pub symbols: Vec<String>,
}

const ATTACH_MAGIC: &str = "corsnap-attach-v1";

impl AttachRequest {
    pub fn encode(&self) -> Vec<u8> {
        let mut s = format!(
            "{ATTACH_MAGIC}\nsocket={}\nrate={}\nevents={}\npause={}\n",
            self.socket, self.rate_hz, self.events, self.max_pause_ppm
        );
        if self.sampler != SamplerKind::Suspend {
            s.push_str(&format!("sampler={}\n", self.sampler.name()));
        }
        if self.clock != CpuClock::Perf {
            s.push_str(&format!("clock={}\n", self.clock.name()));
        }
        if self.walker != WalkerKind::Snapshot {
            s.push_str(&format!("walker={}\n", self.walker.name()));
        }
        if let Some(log) = &self.log {
            s.push_str(&format!("log={log}\n"));
        }
        for dir in &self.symbols {
            s.push_str(&format!("symbols={dir}\n"));
        }
        s.into_bytes()
    }

    /// Parses client data; `None` for anything that is not ours or is
    /// malformed (the agent then declines the attach).
    pub fn decode(data: &[u8]) -> Option<AttachRequest> {
        if data.len() > 8192 {
            return None;
        }
        let text = std::str::from_utf8(data).ok()?;
        // Split on '\n' only, as `encode` joins: `lines()` would also eat a
        // '\r' before it, so a path ending in '\r' changed in a round trip
        // (found by fuzz/fuzz_targets/control_command.rs).
        let mut lines = text.split_terminator('\n');
        if lines.next()? != ATTACH_MAGIC {
            return None;
        }
        let (mut socket, mut rate, mut log, mut events) = (None, None, None, None);
        let mut max_pause_ppm = DEFAULT_MAX_PAUSE_PPM;
        let mut sampler = SamplerKind::Suspend;
        let mut clock = CpuClock::Perf;
        let mut walker = WalkerKind::Snapshot;
        let mut symbols = Vec::new();
        for line in lines {
            match line.split_once('=')? {
                ("socket", v) if !v.is_empty() => socket = Some(v.to_string()),
                ("rate", v) => rate = Some(v.parse().ok()?),
                ("events", v) => events = Some(v.parse().ok()?),
                ("pause", v) => max_pause_ppm = v.parse().ok()?,
                ("log", v) => log = Some(v.to_string()),
                ("sampler", v) => sampler = SamplerKind::parse(v)?,
                ("clock", v) => clock = CpuClock::parse(v)?,
                ("walker", v) => walker = WalkerKind::parse(v)?,
                ("symbols", v) if !v.is_empty() => symbols.push(v.to_string()),
                _ => return None,
            }
        }
        Some(AttachRequest {
            socket: socket?,
            rate_hz: rate?,
            events: events?,
            max_pause_ppm,
            log,
            sampler,
            clock,
            walker,
            symbols,
        })
    }
}

/// Reads one framed message. `Ok(None)` is a clean end of stream (EOF exactly
/// between frames).
pub fn read_message(input: &mut impl Read, scratch: &mut Vec<u8>) -> io::Result<Option<Message>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match input.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "stream ends inside a message")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME_LEN {
        return Err(DecodeError::FrameTooLarge(len).into());
    }
    scratch.clear();
    scratch.resize(len as usize, 0);
    input.read_exact(scratch)?;
    Ok(Some(Message::decode(scratch)?))
}

/// Writes one framed message.
pub fn write_message(out: &mut impl Write, msg: &Message) -> io::Result<()> {
    let mut buf = Vec::new();
    msg.encode_into(&mut buf);
    out.write_all(&buf)
}

/// Writes the header of a raw recording file.
pub fn write_raw_header(out: &mut impl Write) -> io::Result<()> {
    out.write_all(RAW_MAGIC)?;
    out.write_all(&RAW_VERSION.to_le_bytes())
}

/// Checks the header of a raw recording file, naming the problem if it is not one.
pub fn read_raw_header(input: &mut impl Read) -> io::Result<()> {
    let mut head = [0u8; 12];
    input
        .read_exact(&mut head)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not a corsnap raw recording (file too short)"))?;
    if &head[..8] != RAW_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a corsnap raw recording (wrong magic bytes); record one with `corsnap record --format raw`",
        ));
    }
    let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
    if version != RAW_VERSION {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("raw recording version {version} is not supported (this corsnap reads version {RAW_VERSION})"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_machine_is_told_by_the_interfaces_its_type_declares() {
        let machine = |names: &[&str]| StateMachine::from_interfaces(names.iter().copied());
        // What Roslyn declares for each (generic interfaces are TypeSpecs, left out).
        assert_eq!(machine(&["System.Runtime.CompilerServices.IAsyncStateMachine"]), Some(StateMachine::Async));
        assert_eq!(machine(&["System.Collections.IEnumerator", "System.IDisposable"]), Some(StateMachine::Iterator));
        assert_eq!(
            machine(&[
                "System.IAsyncDisposable",
                "System.Threading.Tasks.Sources.IValueTaskSource",
                "System.Runtime.CompilerServices.IAsyncStateMachine",
            ]),
            Some(StateMachine::AsyncIterator)
        );
        assert_eq!(machine(&["System.IDisposable"]), None);
        assert_eq!(machine(&[]), None);
    }

    fn all_messages() -> Vec<Message> {
        vec![
            Message::Hello {
                protocol: PROTOCOL_VERSION,
                pid: 42,
                runtime_version: "8.0.4".into(),
                info_version: 14,
                rate_hz: 100,
                attached: false,
            },
            Message::Thread { thread_id: 0x7f00_0000_1000, os_tid: 1234, name: "worker-1".into() },
            Message::Function { function_id: 7, name: "Shop.Ledger<T>.Settle".into(), module: "app.dll".into() },
            Message::Sample {
                time_ns: 99,
                thread_id: 1,
                kind: EventKind::Exceptions,
                weight: 1,
                truncated: true,
                leaf: "System.InvalidOperationException".into(),
                frames: vec![7, 0, 8],
                il_offsets: Vec::new(),
            },
            Message::Sample {
                time_ns: 100,
                thread_id: 1,
                kind: EventKind::Cpu,
                weight: 3,
                truncated: false,
                leaf: String::new(),
                frames: vec![7, NATIVE_FRAME_BIT | 5, 8],
                il_offsets: vec![0x1c, NO_IL_OFFSET, 0],
            },
            Message::FunctionSource { function_id: 7, module_id: 0x7f00_1234, method_token: 0x0600_0002 },
            Message::StateMachine { function_id: 7, kind: StateMachine::AsyncIterator },
            Message::Module { module_id: 0x7f00_1234, path: "/app/app.dll".into(), pdb: None },
            Message::Module {
                module_id: 0x7f00_1240,
                path: "/app/lib.dll".into(),
                pdb: Some(PdbReference { guid: [7; 16], stamp: 0xfeed_beef, path: "/src/obj/lib.pdb".into() }),
            },
            Message::Stats(SamplerStats { ticks: 3, max_tick_ns: 9, ..Default::default() }),
            Message::Notice { severity: Severity::Warning, text: "héllo".into() },
            Message::Goodbye { reason: "shutdown".into() },
            Message::Recording { command: "dotnet app.dll".into(), start_unix_ms: 5 },
            Message::Process { pid: 4242, name: "child".into() },
            Message::SnapshotEnd,
            Message::Gc { time_ns: 3, generation: 2, reason: 1, pause_ns: 12345 },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        let mut buf = Vec::new();
        for m in all_messages() {
            m.encode_into(&mut buf);
        }
        let mut input = &buf[..];
        let mut scratch = Vec::new();
        for m in all_messages() {
            assert_eq!(read_message(&mut input, &mut scratch).unwrap(), Some(m));
        }
        assert_eq!(read_message(&mut input, &mut scratch).unwrap(), None);
    }

    #[test]
    fn stats_from_an_older_agent_read_with_the_new_fields_zero() {
        let stats = SamplerStats { ticks: 3, events_dropped: 4, throttled_ticks: 5, ..Default::default() };
        let mut buf = Vec::new();
        Message::Stats(stats).encode_into(&mut buf);
        let body = &buf[4..];
        // Version 2 agents (and raw recordings) sent 18 fields, and those
        // before the signal engine 19.
        let older = &body[..body.len() - 15 * 8];
        assert_eq!(
            Message::decode(older),
            Ok(Message::Stats(SamplerStats { throttled_ticks: 0, ..stats })),
            "the 18 fields of an older agent"
        );
        let before_signal = &body[..body.len() - 14 * 8];
        assert_eq!(Message::decode(before_signal), Ok(Message::Stats(stats)), "19 fields");
        assert!(Message::decode(&body[..body.len() - 16 * 8]).is_err(), "fewer than 18 is broken");
    }

    #[test]
    fn encode_sample_matches_message_encoding() {
        let mut a = Vec::new();
        let head = SampleHead { time_ns: 1, thread_id: 2, kind: EventKind::Cpu, weight: 5, truncated: false };
        encode_sample(&mut a, &head, "", &[3, 4], &[]);
        let mut b = Vec::new();
        Message::Sample {
            time_ns: 1,
            thread_id: 2,
            kind: EventKind::Cpu,
            weight: 5,
            truncated: false,
            leaf: String::new(),
            frames: vec![3, 4],
            il_offsets: Vec::new(),
        }
        .encode_into(&mut b);
        assert_eq!(a, b);
        let (mut c, mut d) = (Vec::new(), Vec::new());
        encode_sample(&mut c, &head, "", &[3, 4], &[9, NO_IL_OFFSET]);
        Message::Sample {
            time_ns: 1,
            thread_id: 2,
            kind: EventKind::Cpu,
            weight: 5,
            truncated: false,
            leaf: String::new(),
            frames: vec![3, 4],
            il_offsets: vec![9, NO_IL_OFFSET],
        }
        .encode_into(&mut d);
        assert_eq!(c, d);
    }

    #[test]
    fn hostile_input_is_refused_not_trusted() {
        // A sample that claims four billion frames.
        let mut body = vec![tag::SAMPLE];
        body.extend_from_slice(&[0; 16 + 1 + 8 + 1 + 4]);
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Message::decode(&body), Err(DecodeError::Truncated));
        let mut bad_kind = vec![tag::SAMPLE];
        bad_kind.extend_from_slice(&[0; 16]);
        bad_kind.push(99);
        assert_eq!(Message::decode(&bad_kind), Err(DecodeError::BadValue("event kind")));
        assert_eq!(Message::decode(&[200]), Err(DecodeError::UnknownTag(200)));
        assert_eq!(Message::decode(&[]), Err(DecodeError::Truncated));
        let huge = (MAX_FRAME_LEN + 1).to_le_bytes();
        let err = read_message(&mut &huge[..], &mut Vec::new()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let mut partial = &[1u8, 0][..];
        assert!(read_message(&mut partial, &mut Vec::new()).is_err());
    }

    #[test]
    fn commands_round_trip_and_bad_ones_are_refused() {
        let all =
            [Command::Detach, Command::SetRate(250), Command::Exceptions(true), Command::ForceGc, Command::SnapshotNow];
        let mut buf = Vec::new();
        for c in all {
            c.encode_into(&mut buf);
        }
        let mut input = &buf[..];
        for c in all {
            assert_eq!(read_command(&mut input).unwrap(), Some(Ok(c)));
        }
        assert_eq!(read_command(&mut input).unwrap(), None);
        let mut unknown = &[1u8, 0, 0, 0, 0x99][..];
        assert_eq!(read_command(&mut unknown).unwrap(), Some(Err(DecodeError::UnknownTag(0x99))));
        let mut huge = &[0xff, 0xff, 0xff, 0x7f][..];
        assert!(read_command(&mut huge).is_err());
    }

    #[test]
    fn attach_requests_round_trip_and_strangers_are_declined() {
        let req = AttachRequest {
            socket: "/tmp/x/agent.sock".into(),
            rate_hz: 100,
            events: 5,
            max_pause_ppm: 35_000,
            log: Some("/tmp/a.log".into()),
            sampler: SamplerKind::Signal,
            clock: CpuClock::Timer,
            walker: WalkerKind::Native,
            symbols: vec!["/opt/symbols".into(), "/with:colon".into()],
        };
        assert_eq!(AttachRequest::decode(&req.encode()), Some(req.clone()));
        let snapshot = AttachRequest { walker: WalkerKind::Snapshot, ..req.clone() };
        assert_eq!(AttachRequest::decode(&snapshot.encode()), Some(snapshot));
        for clock in [CpuClock::Auto, CpuClock::Perf] {
            let other = AttachRequest { clock, ..req.clone() };
            assert_eq!(AttachRequest::decode(&other.encode()), Some(other));
        }
        let suspend = AttachRequest { sampler: SamplerKind::Suspend, ..req };
        assert_eq!(AttachRequest::decode(&suspend.encode()), Some(suspend));
        let without_pause = AttachRequest::decode(b"corsnap-attach-v1\nsocket=/s\nrate=5\nevents=1\n").unwrap();
        assert_eq!(without_pause.max_pause_ppm, DEFAULT_MAX_PAUSE_PPM);
        assert_eq!(without_pause.sampler, SamplerKind::Suspend, "an older CLI's request means the suspend engine");
        assert_eq!(without_pause.walker, WalkerKind::Snapshot, "an older CLI's request means DoStackSnapshot");
        assert_eq!(AttachRequest::decode(b"corsnap-attach-v1\nsocket=/s\nrate=5\nevents=1\nsampler=x\n"), None);
        assert_eq!(AttachRequest::decode(b"attach1;detach"), None);
        assert_eq!(AttachRequest::decode(b"corsnap-attach-v1\nrate=x\nsocket=/s\n"), None);
        assert_eq!(AttachRequest::decode(b"corsnap-attach-v1\nrate=5\n"), None);
        assert_eq!(AttachRequest::decode(b"corsnap-attach-v1\nsocket=/s\nrate=5\n"), None, "events are required");
    }

    #[test]
    fn raw_header_is_checked() {
        let mut buf = Vec::new();
        write_raw_header(&mut buf).unwrap();
        read_raw_header(&mut &buf[..]).unwrap();
        let err = read_raw_header(&mut &b"PK\x03\x04 not ours"[..]).unwrap_err();
        assert!(err.to_string().contains("not a corsnap raw recording"));
    }
}
