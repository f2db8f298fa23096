//! The sampler: the seeds' asynchronous walk, adapted to Linux.
//!
//! One thread of the agent's own, which never runs managed code (Rule 1),
//! ticks at the configured rate. Each tick suspends the runtime with
//! `SuspendRuntime` (on Linux `DoStackSnapshot` cannot walk another thread
//! any other way), walks every managed thread into preallocated buffers,
//! resumes, and only then does anything that allocates, locks or talks to the
//! CLI: resolving new function names, reading thread names, encoding and
//! sending samples.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use corsnap_abi::{hr, send_all, FunctionID, NativeThread, ThreadID, HRESULT};
use corsnap_wire::{EventKind, Message, SampleHead, SamplerStats};

use crate::budget::PauseBudget;
use crate::events::Subject;

use crate::event_walks::EventWalker;
use crate::log;
use crate::names::NameResolver;
use crate::signal_engine::{FrameName, SignalEngine};
use crate::Shared;

/// Frames kept per stack; deeper stacks keep their leaf end and are marked
/// truncated.
const MAX_FRAMES_PER_STACK: usize = 4096;
/// Frames kept per tick across all threads.
const ARENA_FRAMES: usize = 256 * 1024;
/// Threads walked per tick.
const MAX_THREADS_PER_TICK: usize = 4096;
/// Entries any one cache of the sampler may hold. A process that JITs
/// without end (or churns threads) would otherwise grow them without end;
/// a full cache is emptied and counted, and what it held is looked up again.
pub(crate) const CACHE_CAP: usize = 200_000;

/// How often running totals go to the CLI.
const STATS_EVERY: Duration = Duration::from_secs(1);
/// How often the signal engine's buffers are drained (and new threads
/// looked for, when the runtime announced some): about every 5 samples of a
/// busy thread, between 10 and 50 ms, so a thread's buffer never fills and
/// the agent's thread wakes no more than it must.
fn signal_drain_every(rate_hz: u32) -> Duration {
    Duration::from_millis((5000 / u64::from(rate_hz.max(1))).clamp(10, 50))
}
/// How often samples are drained while they meet code not learned yet.
const LEARNING_DRAIN_EVERY: Duration = Duration::from_millis(5);
/// How long after a thread is first described its kernel name is looked at
/// again.
const KERNEL_NAME_SETTLE: Duration = Duration::from_secs(1);
/// Samples are sent in batches: a send per tick would wake the CLI (and
/// take a CPU from the program) up to a thousand times a second.
const SEND_EVERY: Duration = Duration::from_millis(50);
/// ...or sooner, once this much is waiting.
const SEND_AT_BYTES: usize = 256 * 1024;

/// The connection to the CLI. Writes use `MSG_NOSIGNAL`: a CLI that went away
/// must cost us an error, not a `SIGPIPE` that kills the application.
#[derive(Debug)]
pub struct Channel {
    stream: UnixStream,
    pending: Vec<u8>,
    /// Sends so far, for the `socket` fault.
    sends: u64,
}

impl Channel {
    /// `shared`: other processes connect to the same socket (`record
    /// --subprocesses`), so it stays where it is.
    pub fn connect(path: &str, shared: bool) -> io::Result<Channel> {
        let stream = UnixStream::connect(path)?;
        // Only the user we run as may steer us, or root (`sudo corsnap
        // record --pid`), who may do anything to this process anyway.
        let (_, peer_uid) = corsnap_abi::peer_credentials(&stream)?;
        if peer_uid != corsnap_abi::current_uid() && peer_uid != 0 {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("socket owned by uid {peer_uid}")));
        }
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        // Connected: the socket (and corsnap's private directory holding
        // it) has served its purpose. corsnap removes them once it accepts;
        // removed here too, a corsnap killed in between leaves nothing.
        let path = std::path::Path::new(path);
        let in_corsnap_dir =
            path.parent().and_then(|d| d.file_name()).is_some_and(|n| n.to_string_lossy().starts_with("corsnap-"));
        if in_corsnap_dir && !shared {
            let _ = std::fs::remove_file(path);
            if let Some(dir) = path.parent() {
                let _ = std::fs::remove_dir(dir);
            }
        }
        Ok(Channel { stream, pending: Vec::with_capacity(64 * 1024), sends: 0 })
    }

    pub fn queue(&mut self, msg: &Message) {
        msg.encode_into(&mut self.pending);
    }

    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    pub fn flush(&mut self) -> io::Result<()> {
        if crate::faults::get().socket {
            self.sends += 1;
            if self.sends > 20 {
                let _ = self.stream.shutdown(std::net::Shutdown::Both);
            }
        }
        let result = send_all(&self.stream, &self.pending);
        self.pending.clear();
        result
    }

    pub fn try_clone_stream(&self) -> io::Result<UnixStream> {
        self.stream.try_clone()
    }

    pub fn send(&mut self, msg: &Message) -> io::Result<()> {
        self.queue(msg);
        self.flush()
    }
}

/// How the other threads steer the sampler: stop it, change its rate, or ask
/// for one snapshot now. Waking it takes this lock, which the sampler never
/// holds while the runtime is suspended.
#[derive(Debug)]
pub struct SamplerSignal {
    rate_hz: AtomicU32,
    state: Mutex<SignalState>,
    raised: Condvar,
}

#[derive(Debug, Default)]
struct SignalState {
    stop: Option<String>,
    snapshot: bool,
    woken: bool,
}

/// Why [`SamplerSignal::wait`] returned.
#[derive(Debug, Default)]
struct Wake {
    stop: Option<String>,
    snapshot: bool,
}

impl SamplerSignal {
    pub fn new(rate_hz: u32) -> Self {
        SamplerSignal {
            rate_hz: AtomicU32::new(rate_hz),
            state: Mutex::new(SignalState::default()),
            raised: Condvar::new(),
        }
    }

    fn update(&self, f: impl FnOnce(&mut SignalState)) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s);
        s.woken = true;
        self.raised.notify_all();
    }

    pub fn stop(&self, reason: &str) {
        self.update(|s| {
            s.stop.get_or_insert_with(|| reason.to_string());
        });
    }

    /// Sampling rate in Hz; 0 pauses sampling (snapshots still work).
    pub fn set_rate(&self, hz: u32) {
        self.rate_hz.store(hz, Ordering::SeqCst);
        self.wake();
    }

    pub fn rate(&self) -> u32 {
        self.rate_hz.load(Ordering::SeqCst)
    }

    pub fn request_snapshot(&self) {
        self.update(|s| s.snapshot = true);
    }

    /// Wakes the sampler so it sends what other threads posted.
    pub fn wake(&self) {
        self.update(|_| {});
    }

    /// Sleeps until `deadline` (forever if `None`) or until woken.
    fn wait(&self, deadline: Option<Instant>) -> Wake {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if s.stop.is_some() || s.snapshot || s.woken {
                s.woken = false;
                return Wake { stop: s.stop.clone(), snapshot: std::mem::take(&mut s.snapshot) };
            }
            match deadline {
                None => s = self.raised.wait(s).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Wake::default();
                    }
                    s = self.raised.wait_timeout(s, d - now).unwrap_or_else(|p| p.into_inner()).0;
                }
            }
        }
    }
}

/// A running sampler thread.
#[derive(Debug)]
pub struct Sampler {
    thread: NativeThread,
    shared: Arc<Shared>,
}

impl Sampler {
    pub fn start(shared: Arc<Shared>, channel: Channel) -> io::Result<Sampler> {
        let for_thread = shared.clone();
        let thread = NativeThread::spawn("corsnap-sampler", move || SamplerLoop::new(for_thread, channel).run())?;
        Ok(Sampler { thread, shared })
    }

    /// Stops the thread and waits for it: when this returns, no sample is in
    /// progress and none will start (seed 002: a flag alone is not enough).
    /// The wait is bounded at process exit, where the runtime may never let a
    /// suspension finish and the process is going away regardless.
    pub fn stop(self, reason: &str, timeout: Duration) -> bool {
        self.shared.signal.stop(reason);
        match self.thread.join_timeout(timeout) {
            Ok(()) => true,
            Err(_) => {
                log::write(format_args!("sampler did not stop within {timeout:?}"));
                false
            }
        }
    }
}

/// The last [`TickTimes::WINDOW`] ticks' phase durations, for medians.
/// Preallocated; recording a tick never allocates.
struct TickTimes {
    suspend: Vec<u64>,
    walk: Vec<u64>,
    resume: Vec<u64>,
    next: usize,
}

impl TickTimes {
    const WINDOW: usize = 4096;

    fn new() -> Self {
        let v = || Vec::with_capacity(Self::WINDOW);
        TickTimes { suspend: v(), walk: v(), resume: v(), next: 0 }
    }

    fn record(&mut self, suspend: u64, walk: u64, resume: u64) {
        if self.suspend.len() < Self::WINDOW {
            self.suspend.push(suspend);
            self.walk.push(walk);
            self.resume.push(resume);
        } else {
            self.suspend[self.next] = suspend;
            self.walk[self.next] = walk;
            self.resume[self.next] = resume;
        }
        self.next = (self.next + 1) % Self::WINDOW;
    }

    fn fill(&self, stats: &mut SamplerStats) {
        fn percentile(values: impl Iterator<Item = u64>, p: usize) -> u64 {
            let mut v: Vec<u64> = values.collect();
            if v.is_empty() {
                return 0;
            }
            v.sort_unstable();
            v[(v.len() - 1) * p / 100]
        }
        stats.suspend_p50_ns = percentile(self.suspend.iter().copied(), 50);
        stats.walk_p50_ns = percentile(self.walk.iter().copied(), 50);
        stats.resume_p50_ns = percentile(self.resume.iter().copied(), 50);
        let totals = (0..self.suspend.len()).map(|i| self.suspend[i] + self.walk[i] + self.resume[i]);
        stats.tick_p99_ns = percentile(totals, 99);
    }
}

/// One stack captured under suspension: where its frames sit in the arena.
#[derive(Debug, Clone, Copy)]
struct StackRecord {
    thread: ThreadID,
    os_tid: u32,
    start: usize,
    end: usize,
    truncated: bool,
    status: HRESULT,
    /// The thread's CPU clock, read while it is stopped (0 if not wanted).
    cpu_ns: u64,
}

/// Buffers filled while the runtime is suspended. Sized once, so the walk
/// itself never allocates.
struct TickBuffers {
    threads: Vec<ThreadID>,
    frames: Vec<u64>,
    /// Each frame's instruction pointer, beside it in `frames`.
    ips: Vec<u64>,
    stacks: Vec<StackRecord>,
}

impl TickBuffers {
    fn new() -> Self {
        TickBuffers {
            threads: Vec::with_capacity(MAX_THREADS_PER_TICK),
            frames: Vec::with_capacity(if crate::faults::get().buffer { 8 } else { ARENA_FRAMES }),
            ips: Vec::with_capacity(if crate::faults::get().buffer { 8 } else { ARENA_FRAMES }),
            stacks: Vec::with_capacity(MAX_THREADS_PER_TICK),
        }
    }
}

struct SamplerLoop {
    shared: Arc<Shared>,
    channel: Channel,
    buffers: TickBuffers,
    names: NameResolver,
    sent_functions: HashSet<FunctionID>,
    /// The path last sent for each module.
    sent_modules: HashMap<corsnap_abi::ModuleID, String>,
    il_offsets: crate::il_offsets::IlOffsets,
    il_scratch: Vec<u32>,
    /// What the CLI was last told about each thread: (registry version, OS tid).
    sent_threads: HashMap<ThreadID, (u64, u32)>,
    stats: SamplerStats,
    tick_times: TickTimes,
    started: Instant,
    /// Each thread's CPU clock at its previous sample.
    cpu_clock: HashMap<ThreadID, (u32, u64)>,
    rng: u64,
    logged_errors: u32,
    /// Whether callbacks queue events that need sending.
    records_events: bool,
    samples_on_timer: bool,
    /// [`corsnap_wire::ENV_BENCH_SUSPEND_ONLY`]: ticks suspend and resume
    /// the runtime, and do nothing else.
    suspend_only: bool,
    own_cache_resets: u64,
    pause_budget: PauseBudget,
    /// The `signal` engine, when it takes the CPU samples (else the
    /// suspension ticks do).
    signal: Option<SignalEngine>,
    signal_samples: Vec<crate::signal_engine::Sample>,
    signal_rate: u32,
    /// `CORSNAP_VERIFY_WALKS=1`: compare signal-engine walks with
    /// `DoStackSnapshot` at the same instant (tests only).
    verify: Option<WalkVerification>,
    /// The name last sent for each OS thread the signal engine sampled.
    signal_threads: HashMap<u32, Option<String>>,
    /// Names event stacks walked by corsnap's own unwinder (`--walker
    /// native`); `None` when events are walked by `DoStackSnapshot`.
    event_walker: Option<EventWalker>,
    /// Whether each `FunctionID` met at the top of an exception's stack is
    /// the runtime's managed exception dispatch.
    dispatch_functions: HashMap<u64, bool>,
    /// `CORSNAP_VERIFY_EVENT_WALKS=1`: event stacks compared.
    event_verification: WalkVerification,
    /// The kernel's name last sent for each OS thread, and when it was
    /// first sent (names are looked at again for a while: the runtime names
    /// a thread just after starting it).
    kernel_names: HashMap<u32, (Instant, String)>,
}

impl SamplerLoop {
    fn new(shared: Arc<Shared>, channel: Channel) -> Self {
        let names = NameResolver::new(shared.clone());
        let max_pause_ppm = shared.max_pause_ppm;
        let signal = if shared.sampler_kind == corsnap_wire::SamplerKind::Signal && shared.records(EventKind::Cpu) {
            match SignalEngine::start(shared.clone(), shared.signal.rate()) {
                Ok(engine) => Some(engine),
                Err(why) => {
                    let text = format!("{why}; CPU samples are taken by the suspend engine instead");
                    log::write(format_args!("{text}"));
                    shared.post(Message::Notice { severity: corsnap_wire::Severity::Warning, text });
                    None
                }
            }
        } else {
            None
        };
        // The suspension ticks take wall samples, and CPU samples when the
        // signal engine does not.
        let samples_on_timer = shared.records(EventKind::Wall) || (shared.records(EventKind::Cpu) && signal.is_none());
        let signal_rate = shared.signal.rate();
        let records_events = [EventKind::Exceptions, EventKind::Gc, EventKind::ClassLoad, EventKind::Alloc]
            .iter()
            .any(|&k| shared.records(k));
        let event_walker = if records_events && shared.native_event_walks {
            match EventWalker::start(shared.info) {
                Ok(walker) => Some(walker),
                Err(why) => {
                    let text = format!("{why}; event stacks are walked by DoStackSnapshot instead");
                    log::write(format_args!("{text}"));
                    shared.post(Message::Notice { severity: corsnap_wire::Severity::Warning, text });
                    None
                }
            }
        } else {
            None
        };
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        SamplerLoop {
            started: shared.epoch,
            shared,
            channel,
            buffers: TickBuffers::new(),
            names,
            sent_functions: HashSet::new(),
            sent_modules: HashMap::new(),
            il_offsets: crate::il_offsets::IlOffsets::new(),
            il_scratch: Vec::new(),
            sent_threads: HashMap::new(),
            stats: SamplerStats::default(),
            tick_times: TickTimes::new(),
            cpu_clock: HashMap::new(),
            rng: (seed as u64) | 1,
            logged_errors: 0,
            records_events,
            samples_on_timer,
            suspend_only: std::env::var(corsnap_wire::ENV_BENCH_SUSPEND_ONLY).is_ok_and(|v| v == "1"),
            own_cache_resets: 0,
            pause_budget: PauseBudget::new(u64::from(max_pause_ppm), crate::budget::CAPACITY_NS),
            signal,
            signal_samples: Vec::new(),
            signal_rate,
            signal_threads: HashMap::new(),
            event_walker,
            dispatch_functions: HashMap::new(),
            event_verification: WalkVerification::default(),
            kernel_names: HashMap::new(),
            verify: std::env::var("CORSNAP_VERIFY_WALKS").is_ok_and(|v| v == "1").then(WalkVerification::default),
        }
    }

    fn run(mut self) {
        self.warm_up();
        let mut next_tick: Option<Instant> = None;
        let mut next_stats = Instant::now() + STATS_EVERY;
        let mut next_send = Instant::now();
        let mut next_drain = Instant::now() + LEARNING_DRAIN_EVERY;
        let mut next_verify = Instant::now() + VERIFY_EVERY;
        if let Some(v) = self.verify.as_mut() {
            v.pending.reserve(MAX_THREADS_PER_TICK);
        }
        let reason = loop {
            // Without a timer profile (cpu or wall) there is nothing to tick
            // for; snapshots still work.
            let rate = if self.samples_on_timer { self.shared.signal.rate() } else { 0 };
            if rate == 0 {
                next_tick = None;
            } else if next_tick.is_none() {
                next_tick = Some(Instant::now() + self.jittered_interval(rate));
            }
            // Events queued by callbacks are sent at least this often.
            let drain_by = Instant::now() + SEND_EVERY;
            let mut deadline =
                if self.records_events { Some(next_tick.map_or(drain_by, |t| t.min(drain_by))) } else { next_tick };
            if self.signal.is_some() {
                deadline = Some(deadline.map_or(next_drain, |d| d.min(next_drain)));
            }
            let wake = self.shared.signal.wait(deadline);
            if let Some(reason) = wake.stop {
                break reason;
            }
            let mut send_now = false;
            if wake.snapshot {
                self.tick(true);
                self.channel.queue(&Message::SnapshotEnd);
                send_now = true;
            }
            if let Some(due) = next_tick {
                let now = Instant::now();
                if now >= due {
                    // The first samples go out at once: the user is waiting.
                    send_now |= self.stats.samples == 0;
                    if self.pause_budget.allows(now.duration_since(self.started).as_nanos() as u64) {
                        self.tick(false);
                    } else {
                        self.stats.throttled_ticks += 1;
                    }
                    // Behind (a long tick, a descheduled thread): do not burst.
                    next_tick = Some((due + self.jittered_interval(rate)).max(now));
                }
            }
            if self.signal.is_some() {
                let now = Instant::now();
                let announced = self.shared.threads_changed.swap(false, std::sync::atomic::Ordering::Relaxed);
                if now >= next_drain || announced {
                    let first = self.stats.samples == 0;
                    // The first samples go out at once: the user is waiting.
                    send_now |= self.collect_signal_samples(announced) && first;
                    // Samples in code not learned yet carry stack copies, which
                    // fill a thread's ring in a few samples: while the program
                    // compiles, drain often.
                    let learning = self.signal.as_ref().is_some_and(|e| e.learning());
                    let every = signal_drain_every(self.shared.signal.rate());
                    next_drain = now + if learning { every.min(LEARNING_DRAIN_EVERY) } else { every };
                }
            }
            if self.verify.is_some() && self.signal.is_some() && Instant::now() >= next_verify {
                next_verify = Instant::now() + VERIFY_EVERY;
                self.verify_round();
            }
            self.publish_events();
            let posted = std::mem::take(&mut *self.shared.outbox.lock().unwrap_or_else(|p| p.into_inner()));
            send_now |= !posted.is_empty();
            for msg in &posted {
                self.channel.queue(msg);
            }
            let now = Instant::now();
            if now >= next_stats {
                next_stats = now + STATS_EVERY;
                self.queue_stats();
            }
            if send_now || now >= next_send || self.channel.pending_bytes() >= SEND_AT_BYTES {
                next_send = now + SEND_EVERY;
                if let Err(e) = self.channel.flush() {
                    break format!("corsnap went away ({e})");
                }
            }
        };
        if let Some(v) = &self.verify {
            let text = format!(
                "walk verification: {} stacks compared with DoStackSnapshot at the same instant, {} with the same \
                 managed frames, {} not compared (the sample came after the resume)",
                v.compared, v.identical, v.late
            );
            log::write(format_args!("{text}"));
            self.channel.queue(&Message::Notice { severity: corsnap_wire::Severity::Info, text });
        }
        if self.signal.is_some() {
            self.collect_signal_samples(false);
            if let Some(engine) = self.signal.as_mut() {
                engine.stop();
            }
            self.publish_signal_samples();
        }
        self.publish_events();
        if let Some(walker) = self.event_walker.as_mut() {
            walker.stop();
        }
        if self.shared.verify_event_walks {
            let v = &self.event_verification;
            let text = format!(
                "event walk verification: {} stacks compared with DoStackSnapshot of the same event, {} with the same \
                 managed frames",
                v.compared, v.identical
            );
            log::write(format_args!("{text}"));
            self.channel.queue(&Message::Notice { severity: corsnap_wire::Severity::Info, text });
        }
        log::write(format_args!("sampler stopping: {reason}; {:?}", self.stats));
        self.queue_stats();
        self.channel.queue(&Message::Goodbye { reason });
        let _ = self.channel.flush();
    }

    fn queue_stats(&mut self) {
        self.tick_times.fill(&mut self.stats);
        self.stats.cache_resets = self.own_cache_resets + self.names.cache_resets() + self.il_offsets.cache_resets;
        self.stats.events_dropped = self.shared.events.dropped.load(std::sync::atomic::Ordering::Relaxed);
        self.stats.sampler_cpu_ns = corsnap_abi::thread_cpu_time_ns(corsnap_abi::current_os_tid()).unwrap_or(0);
        if let Some(engine) = self.signal.as_mut() {
            engine.fill_stats(&mut self.stats);
        }
        self.channel.queue(&Message::Stats(self.stats));
    }

    /// Seed 004: the first time a thread of ours enters `DoStackSnapshot` the
    /// runtime initialises per-thread state, which can deadlock if a target
    /// is suspended and holds the lock it needs. So make that first call with
    /// nothing suspended. On Linux a walk of another running thread answers
    /// `E_NOTIMPL`, but it has still passed through that initialisation.
    fn warm_up(&mut self) {
        let target = self.shared.info.enum_threads().ok().and_then(|t| t.first().copied());
        let status = match target {
            Some(t) => self.shared.info.do_stack_snapshot(t, &mut |_, _| false),
            None => self.shared.info.do_stack_snapshot(0, &mut |_, _| false),
        };
        log::write(format_args!("warm-up snapshot (nothing suspended): {}", hr::describe(status)));
    }

    fn jittered_interval(&mut self, rate_hz: u32) -> Duration {
        let interval = Duration::from_nanos(1_000_000_000 / u64::from(rate_hz.clamp(1, crate::MAX_RATE_HZ)));
        // xorshift64: cheap, and good enough to keep ticks from locking step
        // with the program's own periodic work.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let permille = 900 + (self.rng % 201); // 0.9 .. 1.1
        interval * permille as u32 / 1000
    }

    fn tick(&mut self, snapshot: bool) {
        let info = self.shared.info;
        let t0 = Instant::now();
        if info.suspend_runtime().is_err() {
            // A GC or another suspension is under way; never nest.
            self.stats.skipped_ticks += 1;
            return;
        }
        let t1 = Instant::now();
        if !self.suspend_only {
            self.shared.gate.begin_walk();
            self.walk_all_suspended(snapshot);
            self.shared.gate.end_walk();
        }
        let t2 = Instant::now();
        let resumed = info.resume_runtime();
        let t3 = Instant::now();
        self.shared.gate.wake_waiters();
        if let Err(e) = resumed {
            log::write(format_args!("ResumeRuntime failed: {e}"));
        }

        let ns = |d: Duration| d.as_nanos() as u64;
        // Charged until the threads are released. A slow `ResumeRuntime` is
        // this thread losing its CPU to the threads it has just woken (8 busy
        // threads on 2 cores: 2 to 15 ms), while the program runs.
        self.pause_budget.spend(ns(t2 - t0));
        self.stats.ticks += 1;
        self.stats.suspend_ns += ns(t1 - t0);
        self.stats.walk_ns += ns(t2 - t1);
        self.stats.resume_ns += ns(t3 - t2);
        self.stats.max_tick_ns = self.stats.max_tick_ns.max(ns(t3 - t0));
        self.tick_times.record(ns(t1 - t0), ns(t2 - t1), ns(t3 - t2));
        self.publish(ns(t1 - self.started), snapshot);
    }

    /// One verification round: with the runtime suspended, every managed
    /// thread is asked for a signal-engine sample (a queued signal its handler
    /// takes while the thread is parked) and walked by `DoStackSnapshot`;
    /// after the resume, the two lists of managed frames are compared. The
    /// suspended part allocates nothing (preallocated buffers) and takes no
    /// lock.
    fn verify_round(&mut self) {
        let info = self.shared.info;
        let (Some(engine), Some(verify)) = (self.signal.as_ref(), self.verify.as_mut()) else { return };
        if info.suspend_runtime().is_err() {
            return;
        }
        self.shared.gate.begin_walk();
        verify.pending.clear();
        if info.enum_threads_into(&mut self.buffers.threads).is_ok() {
            for &thread in self.buffers.threads.iter().take(MAX_THREADS_PER_TICK) {
                let os_tid = info.get_thread_info(thread).unwrap_or(0);
                if let Some(before) = engine.request_sample(os_tid) {
                    verify.pending.push((os_tid, before));
                }
            }
        }
        // The handlers run on the parked threads; wait for their samples.
        let deadline = Instant::now() + Duration::from_millis(100);
        while Instant::now() < deadline && verify.pending.iter().any(|&(t, b)| engine.requested_samples_stored(t) <= b)
        {
            std::thread::sleep(Duration::from_micros(200));
        }
        // Only a sample stored before the resume was taken at the instant
        // DoStackSnapshot sees; one whose handler has not run yet (a loaded
        // machine may not schedule it within the wait) would walk the
        // thread after it moved on, and is left out of the comparison.
        let asked = verify.pending.len();
        verify.pending.retain(|&(t, b)| engine.requested_samples_stored(t) > b);
        verify.late += (asked - verify.pending.len()) as u64;
        self.walk_all_suspended(true);
        self.shared.gate.end_walk();
        let resumed = info.resume_runtime();
        self.shared.gate.wake_waiters();
        if let Err(e) = resumed {
            log::write(format_args!("ResumeRuntime failed: {e}"));
        }
        self.collect_signal_samples(false);
        let Some(engine) = self.signal.as_mut() else { return };
        let ours: HashMap<u32, Vec<u64>> = engine
            .take_requested()
            .into_iter()
            .map(|s| (s.os_tid, s.frames.into_iter().filter(|f| f & corsnap_wire::NATIVE_FRAME_BIT == 0).collect()))
            .collect();
        // The runtime's own managed exception dispatch (`System.Runtime.EH`,
        // .NET 9 and later; native code in libcoreclr before) is shown as one
        // `[exception dispatch]` frame, like native code, and DoStackSnapshot
        // never reports it: the comparison is of the methods the profile
        // shows as methods.
        let mut ours = ours;
        for frames in ours.values_mut() {
            frames.retain(|&f| {
                self.names.resolve(f as FunctionID).map_or(true, |n| !n.name.starts_with("System.Runtime.EH."))
            });
        }
        let stacks = std::mem::take(&mut self.buffers.stacks);
        for record in &stacks {
            let in_time = self.verify.as_ref().is_some_and(|v| v.pending.iter().any(|&(t, _)| t == record.os_tid));
            if !in_time {
                continue;
            }
            let Some(ours) = ours.get(&record.os_tid) else { continue };
            if record.status < 0 || record.truncated {
                continue;
            }
            let truth: Vec<u64> =
                self.buffers.frames[record.start..record.end].iter().copied().filter(|&f| f != 0).collect();
            let Some(verify) = self.verify.as_mut() else { break };
            verify.compared += 1;
            if *ours == truth {
                verify.identical += 1;
            } else if verify.logged < 10 {
                verify.logged += 1;
                let mut name = |f: &u64| {
                    self.names.resolve(*f as FunctionID).map(|n| n.name).unwrap_or_else(|_| format!("{f:#x}"))
                };
                let ours: Vec<String> = ours.iter().map(&mut name).collect();
                let truth: Vec<String> = truth.iter().map(&mut name).collect();
                log::write(format_args!(
                    "walk verification, thread {}: signal walk {:?} but DoStackSnapshot {:?}",
                    record.os_tid, ours, truth
                ));
            }
        }
        self.buffers.stacks = stacks;
    }

    /// Runs with every managed thread stopped. No locks, no allocation, no
    /// logging: a stopped thread could be holding whatever we would wait on.
    fn walk_all_suspended(&mut self, snapshot: bool) {
        let info = self.shared.info;
        // A stopped thread's CPU clock is cheap to read (a running one's
        // makes the kernel lock the runqueue of the CPU it runs on), and
        // reading it here ends the interval exactly at the sample. A system
        // call: no lock of the process's, no allocation.
        let read_cpu = self.shared.records(EventKind::Cpu) && self.signal.is_none();
        // A CPU profile drops a thread that used no CPU since its previous
        // sample, so its stack need not be walked: the pause then grows
        // with the busy threads, not with every thread the program has.
        let walk_idle = snapshot || self.shared.records(EventKind::Wall);
        let cpu_clock = &self.cpu_clock;
        let TickBuffers { threads, frames, ips, stacks } = &mut self.buffers;
        frames.clear();
        ips.clear();
        stacks.clear();
        if info.enum_threads_into(threads).is_err() {
            return;
        }
        for &thread in threads.iter().take(MAX_THREADS_PER_TICK) {
            let os_tid = info.get_thread_info(thread).unwrap_or(0);
            let cpu_ns = if read_cpu { corsnap_abi::thread_cpu_time_ns(os_tid).unwrap_or(0) } else { 0 };
            let start = frames.len();
            let idle = cpu_ns != 0 && cpu_clock.get(&thread) == Some(&(os_tid, cpu_ns));
            if idle && !walk_idle {
                stacks.push(StackRecord { thread, os_tid, start, end: start, truncated: false, status: 0, cpu_ns });
                continue;
            }
            let mut truncated = false;
            let status = info.do_stack_snapshot(thread, &mut |function, ip| {
                if frames.len() - start >= MAX_FRAMES_PER_STACK
                    || frames.len() == frames.capacity()
                    || ips.len() == ips.capacity()
                {
                    truncated = true;
                    return false;
                }
                frames.push(function as u64);
                ips.push(ip as u64);
                true
            });
            stacks.push(StackRecord { thread, os_tid, start, end: frames.len(), truncated, status, cpu_ns });
        }
    }

    /// After resuming: names, thread identities and samples to the CLI.
    /// A snapshot (for `corsnap dump`) is a wall-clock sample of every thread.
    fn publish(&mut self, time_ns: u64, snapshot: bool) {
        let stacks = std::mem::take(&mut self.buffers.stacks);
        let walked: Vec<(ThreadID, u32)> =
            stacks.iter().filter(|r| r.start != r.end).map(|r| (r.thread, r.os_tid)).collect();
        self.describe_threads(&walked);
        let cpu = self.shared.records(EventKind::Cpu) && !snapshot && self.signal.is_none();
        let wall = self.shared.records(EventKind::Wall) || snapshot;
        // A sample stands for at most two intervals of CPU. After ticks the
        // pause budget skipped (or a sampler that fell behind), one stack
        // would otherwise carry the whole gap, up to a second of CPU on a
        // single sample in a short profile: a gap is left unsampled instead,
        // as a sampler that lags does, and the CLI reports the skipped ticks.
        let max_cpu_weight = 2_000_000_000 / u64::from(self.shared.signal.rate().max(1));
        for record in &stacks {
            let harmless = record.status >= 0
                || record.status == hr::E_FAIL // a runtime thread with no managed frames
                // A thread unwinding an exception through native code: the
                // runtime cannot start an unseeded walk there.
                || record.status == hr::CORPROF_E_STACKSNAPSHOT_UNMANAGED_CTX
                || (record.status == hr::CORPROF_E_STACKSNAPSHOT_ABORTED && record.truncated);
            if !harmless {
                self.stats.walk_errors += 1;
                if self.logged_errors < 20 {
                    self.logged_errors += 1;
                    log::write(format_args!(
                        "DoStackSnapshot(thread 0x{:x}) = {}",
                        record.thread,
                        hr::describe(record.status)
                    ));
                }
            }
            if record.start == record.end {
                continue;
            }
            let cpu_weight = if cpu { self.cpu_since_last_sample(record, max_cpu_weight) } else { 0 };
            if cpu_weight == 0 && !wall {
                // Idle since its last sample: not part of a CPU profile.
                continue;
            }
            for i in record.start..record.end {
                let function = self.buffers.frames[i] as FunctionID;
                self.describe_function(function);
            }
            if record.truncated {
                self.stats.truncated_stacks += 1;
            }
            self.stats.samples += 1;
            self.suspend_il_offsets(record.start..record.end);
            let frames = &self.buffers.frames[record.start..record.end];
            let il_offsets = &self.il_scratch[..];
            for (kind, weight) in [(EventKind::Cpu, cpu_weight), (EventKind::Wall, u64::from(wall))] {
                if weight > 0 {
                    let head = SampleHead {
                        time_ns,
                        thread_id: record.thread as u64,
                        kind,
                        weight,
                        truncated: record.truncated,
                    };
                    corsnap_wire::encode_sample(&mut self.channel.pending, &head, "", frames, il_offsets);
                }
            }
        }
        self.buffers.stacks = stacks;
    }

    /// The IL offsets of a suspended walk's frames (`range` of the arena)
    /// into `il_scratch`, left empty when none is known. The leaf frame's
    /// instruction pointer is where its thread stands; the others' are
    /// return addresses, looked up one byte back, in the call.
    fn suspend_il_offsets(&mut self, range: std::ops::Range<usize>) {
        self.il_scratch.clear();
        let mut any = false;
        for (i, at) in range.clone().enumerate() {
            let (function, ip) = (self.buffers.frames[at], self.buffers.ips[at]);
            let address = if i == 0 { ip } else { ip.saturating_sub(1) };
            let offset = self.il_offsets.il_offset(&self.shared.info, function as FunctionID, None, address);
            any |= offset != corsnap_wire::NO_IL_OFFSET;
            self.il_scratch.push(offset);
        }
        if !any {
            self.il_scratch.clear();
        }
    }

    /// Tells the CLI the kernel's name for `tid` (`comm`), which labels the
    /// thread when the program never named it, and again if it changed
    /// soon after.
    fn note_kernel_name(&mut self, tid: u32, now: Instant) {
        if tid == 0 {
            return;
        }
        if self.kernel_names.len() >= CACHE_CAP {
            self.kernel_names.clear();
            self.own_cache_resets += 1;
        }
        let fresh = match self.kernel_names.get(&tid) {
            None => true,
            Some((first, _)) => now.duration_since(*first) < KERNEL_NAME_SETTLE,
        };
        if !fresh {
            return;
        }
        let Some(name) = os_thread_name(tid) else { return };
        let first = self.kernel_names.get(&tid).map_or(now, |e| e.0);
        if self.kernel_names.get(&tid).is_some_and(|e| e.1 == name) {
            return;
        }
        self.kernel_names.insert(tid, (first, name.clone()));
        self.channel.queue(&Message::OsThreadName { os_tid: tid, name });
    }

    /// Drains the signal engine and sends what it took. `true` if any sample
    /// went out.
    fn collect_signal_samples(&mut self, announced: bool) -> bool {
        let Some(engine) = self.signal.as_mut() else { return false };
        let rate = self.shared.signal.rate();
        if rate != self.signal_rate {
            self.signal_rate = rate;
            engine.set_rate(rate);
        }
        if announced {
            engine.thread_announced();
        }
        engine.collect(&mut self.signal_samples);
        self.publish_signal_samples()
    }

    fn publish_signal_samples(&mut self) -> bool {
        let Some(engine) = self.signal.as_mut() else { return false };
        for name in engine.take_names() {
            match name {
                FrameName::Managed(function) => self.describe_function(function),
                FrameName::Native { key, name, module } => {
                    self.channel.queue(&Message::Function { function_id: key, name, module });
                }
            }
        }
        let samples = std::mem::take(&mut self.signal_samples);
        if samples.is_empty() {
            return false;
        }
        // Every thread goes by its OS thread id here: a managed thread can
        // be sampled before the runtime has told us which OS thread it is.
        // Its name is the one the program gave it, sent empty until known
        // (the profile fills it in place); the kernel's name for the thread
        // labels it meanwhile, and for good if the program never names it.
        let names = self.shared.threads.names_by_os_tid();
        let now = Instant::now();
        let mut tids: Vec<u32> = samples.iter().map(|s| s.os_tid).collect();
        tids.sort_unstable();
        tids.dedup();
        for tid in tids {
            self.note_kernel_name(tid, now);
            let entry = self.signal_threads.entry(tid).or_insert(None);
            let name = names.get(&tid).cloned().unwrap_or_default();
            // A leaving thread (the runtime forgot it first) keeps its name.
            if name.is_empty() && entry.is_some() {
                continue;
            }
            if entry.as_ref() != Some(&name) {
                *entry = Some(name.clone());
                let key = corsnap_wire::NATIVE_THREAD_BIT | u64::from(tid);
                self.channel.queue(&Message::Thread { thread_id: key, os_tid: tid, name });
            }
        }
        for s in &samples {
            let thread_id = corsnap_wire::NATIVE_THREAD_BIT | u64::from(s.os_tid);
            let head = SampleHead {
                time_ns: s.time_ns,
                thread_id,
                kind: EventKind::Cpu,
                weight: s.weight,
                truncated: s.truncated,
            };
            let known = s.il_offsets.iter().any(|&o| o != corsnap_wire::NO_IL_OFFSET);
            let il_offsets = if known { &s.il_offsets[..] } else { &[] };
            corsnap_wire::encode_sample(&mut self.channel.pending, &head, "", &s.frames, il_offsets);
        }
        self.stats.samples += samples.len() as u64;
        true
    }

    /// CPU time `thread` used since its previous sample, from its CPU clock
    /// (on first sight, its CPU time so far), but no more than `max_ns`.
    fn cpu_since_last_sample(&mut self, record: &StackRecord, max_ns: u64) -> u64 {
        let (thread, os_tid, now) = (record.thread, record.os_tid, record.cpu_ns);
        if now == 0 {
            return 0;
        }
        if self.cpu_clock.len() >= CACHE_CAP {
            self.cpu_clock.clear();
            self.own_cache_resets += 1;
        }
        match self.cpu_clock.insert(thread, (os_tid, now)) {
            Some((tid, before)) if tid == os_tid => now.saturating_sub(before).min(max_ns),
            _ => now.min(max_ns),
        }
    }

    /// Sends what the runtime's callbacks queued: exceptions, class loads,
    /// collections.
    fn publish_events(&mut self) {
        if let Some(walker) = self.event_walker.as_mut() {
            let announced = self.shared.threads_changed_for_events.swap(false, std::sync::atomic::Ordering::Relaxed);
            walker.refresh(announced);
        }
        let mut events = self.shared.events.take();
        let gcs = self.shared.events.take_gcs();
        if events.is_empty() && gcs.is_empty() {
            return;
        }
        let mut threads: Vec<(ThreadID, u32)> = events.iter().map(|e| (e.thread, e.os_tid)).collect();
        threads.sort_unstable();
        threads.dedup();
        self.describe_threads(&threads);
        for event in &mut events {
            let Some(raw) = event.raw.take() else { continue };
            let Some(walker) = self.event_walker.as_mut() else {
                // Cannot happen: only a running walker's map produces raw frames.
                event.frames.clear();
                continue;
            };
            let (mut frames, truncated) = walker.resolve(&event.frames, raw.flags, raw.copy.as_ref());
            self.leave_out_dispatch(&mut frames);
            event.frames = frames;
            event.truncated |= truncated;
            if let Some(referee) = event.referee.take() {
                self.verify_event_walk(event.kind, &event.frames, &referee);
            }
        }
        if let Some(walker) = self.event_walker.as_mut() {
            for name in walker.take_names() {
                match name {
                    FrameName::Managed(function) => self.describe_function(function),
                    FrameName::Native { key, name, module } => {
                        self.channel.queue(&Message::Function { function_id: key, name, module });
                    }
                }
            }
        }
        // Walks made only to learn from (the benchmarks' floor) weigh nothing.
        events.retain(|e| e.weight > 0);
        for event in events {
            for &function in &event.frames {
                if function & corsnap_wire::NATIVE_FRAME_BIT == 0 {
                    self.describe_function(function as FunctionID);
                }
            }
            let leaf = match &event.subject {
                Subject::Class(class) => self.names.class_name(*class),
                Subject::Text(text) => text.clone(),
                Subject::ClassOr(class, fallback) => {
                    let name = self.names.class_name(*class);
                    if name.starts_with('[') {
                        fallback.clone()
                    } else {
                        name
                    }
                }
            };
            let head = SampleHead {
                time_ns: event.time_ns,
                thread_id: event.thread as u64,
                kind: event.kind,
                weight: event.weight,
                truncated: event.truncated,
            };
            corsnap_wire::encode_sample(&mut self.channel.pending, &head, &leaf, &event.frames, &[]);
        }
        for gc in gcs {
            self.channel.queue(&Message::Gc {
                time_ns: gc.time_ns,
                generation: gc.generation,
                reason: gc.reason,
                pause_ns: gc.pause_ns,
            });
        }
    }

    /// On .NET 9 and later an exception is dispatched by managed code
    /// (`System.Runtime.EH`, calling into the runtime and so to us): its
    /// frames, and the runtime's native ones around them, sit above the
    /// frame that threw. `DoStackSnapshot` starts at that frame, and so
    /// does an exception's stack (and an allocation's made by the dispatch,
    /// which `DoStackSnapshot` also charges to that frame).
    fn leave_out_dispatch(&mut self, frames: &mut Vec<u64>) {
        let mut leading = 0;
        for &key in frames.iter() {
            let dispatch = key & corsnap_wire::NATIVE_FRAME_BIT != 0 || {
                if self.dispatch_functions.len() >= CACHE_CAP {
                    self.dispatch_functions.clear();
                }
                let names = &mut self.names;
                *self.dispatch_functions.entry(key).or_insert_with(|| {
                    names.resolve(key as FunctionID).is_ok_and(|n| n.name.starts_with("System.Runtime.EH."))
                })
            };
            if !dispatch {
                break;
            }
            leading += 1;
        }
        // A stack of dispatch alone (nothing threw from managed code) stays.
        if leading < frames.len() {
            frames.drain(..leading);
        }
    }

    /// `CORSNAP_VERIFY_EVENT_WALKS=1`: the managed frames of an event's
    /// native walk (named) against `DoStackSnapshot`'s of the same event.
    fn verify_event_walk(&mut self, kind: EventKind, native: &[u64], referee: &[u64]) {
        let managed = |frames: &[u64]| -> Vec<u64> {
            frames.iter().copied().filter(|&f| f != 0 && f & corsnap_wire::NATIVE_FRAME_BIT == 0).collect()
        };
        let (ours, theirs) = (managed(native), managed(referee));
        let check = &mut self.event_verification;
        check.compared += 1;
        if ours == theirs {
            check.identical += 1;
            return;
        }
        if check.logged >= 20 {
            return;
        }
        check.logged += 1;
        let mut name =
            |f: u64| self.names.resolve(f as FunctionID).map_or_else(|e| format!("{f:#x} ({e})"), |n| n.name);
        let ours: Vec<String> = ours.iter().map(|&f| name(f)).collect();
        let theirs: Vec<String> = theirs.iter().map(|&f| name(f)).collect();
        log::write(format_args!(
            "event walk verification ({kind:?}): native {} but DoStackSnapshot {}",
            ours.join(" <- "),
            theirs.join(" <- ")
        ));
    }

    fn describe_function(&mut self, function: FunctionID) {
        if self.sent_functions.len() >= CACHE_CAP {
            self.sent_functions.clear();
            self.own_cache_resets += 1;
        }
        if function == 0 || !self.sent_functions.insert(function) {
            return;
        }
        let (name, module, source) = match self.names.resolve(function) {
            Ok(n) => {
                self.stats.names_resolved += 1;
                (n.name, n.module, Some((n.module_id, n.module_path, n.method_token)))
            }
            Err(e) => {
                self.stats.name_failures += 1;
                (format!("[unresolved function 0x{function:x}: {e}]"), String::new(), None)
            }
        };
        self.channel.queue(&Message::Function { function_id: function as u64, name, module });
        // Where its lines are: the CLI reads the module's PDB.
        if let Some((module_id, path, method_token)) = source.filter(|s| s.0 != 0 && s.2 != 0) {
            if self.sent_modules.get(&module_id) != Some(&path) {
                if self.sent_modules.len() >= CACHE_CAP {
                    self.sent_modules.clear();
                    self.own_cache_resets += 1;
                }
                self.sent_modules.insert(module_id, path.clone());
                let path = bundled_beside_host(path);
                // The PDB the image names, read from where the runtime mapped it.
                let base = self.shared.info.get_module_info(module_id).map_or(0, |(base, _)| base);
                let pdb = crate::pdb_reference::pdb_reference(base);
                self.channel.queue(&Message::Module { module_id: module_id as u64, path, pdb });
            }
            self.channel.queue(&Message::FunctionSource {
                function_id: function as u64,
                module_id: module_id as u64,
                method_token,
            });
        }
    }

    /// Tells the CLI about threads it has not heard of, or whose identity
    /// changed; `threads` pairs each `ThreadID` with its OS thread id as seen
    /// now (0 if unknown).
    fn describe_threads(&mut self, threads: &[(ThreadID, u32)]) {
        if self.sent_threads.len() >= CACHE_CAP {
            self.sent_threads.clear();
            self.own_cache_resets += 1;
        }
        let mut updates = Vec::new();
        let sent = &self.sent_threads;
        let seen: HashMap<ThreadID, u32> = threads.iter().copied().collect();
        self.shared.threads.with_entries(threads.iter().map(|&(t, _)| t), |thread, entry| {
            if entry.is_none() && sent.contains_key(&thread) {
                // Walked, then gone before we got here (`ThreadDestroyed`
                // removed it after the resume): what was said still holds.
                return;
            }
            let seen_tid = seen.get(&thread).copied().unwrap_or(0);
            let (version, name, registry_tid) =
                entry.map_or((0, String::new(), 0), |e| (e.version, e.name.clone(), e.os_tid));
            let os_tid = if seen_tid != 0 { seen_tid } else { registry_tid };
            if sent.get(&thread) != Some(&(version, os_tid)) {
                updates.push((thread, version, os_tid, name));
            }
        });
        let now = Instant::now();
        for (thread, version, os_tid, name) in updates {
            // Names given before we attached were never announced to us, and
            // some threads are never named by the program; the kernel's name
            // for the thread (which the runtime sets, 15 bytes of it) labels
            // them.
            self.note_kernel_name(os_tid, now);
            self.sent_threads.insert(thread, (version, os_tid));
            self.channel.queue(&Message::Thread { thread_id: thread as u64, os_tid, name });
        }
    }
}

/// Counts of the signal engine's walks compared with `DoStackSnapshot`.
#[derive(Debug, Default)]
struct WalkVerification {
    compared: u64,
    identical: u64,
    /// Threads asked for a sample in the current round: (OS tid, samples
    /// stored before); after the wait, those whose sample came in time.
    /// Preallocated: filled while the runtime is suspended.
    pending: Vec<(u32, u64)>,
    /// Threads whose requested sample had not come when the runtime was
    /// resumed: not compared.
    late: u64,
    logged: u32,
}

/// How often a verification round runs.
const VERIFY_EVERY: Duration = Duration::from_millis(250);

/// The kernel's name for one of our process's threads.
/// A single-file bundle's assemblies are loaded by bare file name
/// (`Sarif.dll`): the path they would have beside the bundle, where a PDB
/// shipped with it lies.
fn bundled_beside_host(path: String) -> String {
    if path.is_empty() || path.starts_with('/') {
        return path;
    }
    match std::fs::read_link("/proc/self/exe") {
        Ok(host) => host.with_file_name(&path).to_string_lossy().into_owned(),
        Err(_) => path,
    }
}

fn os_thread_name(os_tid: u32) -> Option<String> {
    let comm = std::fs::read_to_string(format!("/proc/self/task/{os_tid}/comm")).ok()?;
    let comm = comm.trim_end_matches('\n');
    (!comm.is_empty()).then(|| comm.to_string())
}
