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
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use corsnap_abi::{hr, send_all, FunctionID, NativeThread, ThreadID, HRESULT};
use corsnap_wire::{Message, SamplerStats};

use crate::log;
use crate::names::NameResolver;
use crate::Shared;

/// Frames kept per stack; deeper stacks keep their leaf end and are marked
/// truncated.
const MAX_FRAMES_PER_STACK: usize = 4096;
/// Frames kept per tick across all threads.
const ARENA_FRAMES: usize = 256 * 1024;
/// Threads walked per tick.
const MAX_THREADS_PER_TICK: usize = 4096;
/// How often running totals go to the CLI.
const STATS_EVERY: Duration = Duration::from_secs(1);
/// Samples are sent in batches: a send per tick would wake the CLI (and
/// take a CPU from the program) up to a thousand times a second.
const SEND_EVERY: Duration = Duration::from_millis(50);
/// ...or sooner, once this much is waiting.
const SEND_AT_BYTES: usize = 256 * 1024;

#[derive(Debug, Clone, Copy)]
pub struct SamplerConfig {
    pub rate_hz: u32,
}

/// The connection to the CLI. Writes use `MSG_NOSIGNAL`: a CLI that went away
/// must cost us an error, not a `SIGPIPE` that kills the application.
#[derive(Debug)]
pub struct Channel {
    stream: UnixStream,
    pending: Vec<u8>,
}

impl Channel {
    pub fn connect(path: &str) -> io::Result<Channel> {
        let stream = UnixStream::connect(path)?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(Channel { stream, pending: Vec::with_capacity(64 * 1024) })
    }

    pub fn queue(&mut self, msg: &Message) {
        msg.encode_into(&mut self.pending);
    }

    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    pub fn flush(&mut self) -> io::Result<()> {
        let result = send_all(&self.stream, &self.pending);
        self.pending.clear();
        result
    }

    pub fn send(&mut self, msg: &Message) -> io::Result<()> {
        self.queue(msg);
        self.flush()
    }
}

/// Why the sampler should stop, set by whoever stops it.
#[derive(Debug, Default)]
struct StopSignal {
    reason: Mutex<Option<String>>,
    raised: Condvar,
}

impl StopSignal {
    fn raise(&self, reason: &str) {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        r.get_or_insert_with(|| reason.to_string());
        self.raised.notify_all();
    }

    /// Sleeps until `deadline`; returns the stop reason if raised first.
    fn sleep_until(&self, deadline: Instant) -> Option<String> {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(reason) = r.as_ref() {
                return Some(reason.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            r = self.raised.wait_timeout(r, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// A running sampler thread.
#[derive(Debug)]
pub struct Sampler {
    thread: NativeThread,
    stop: Arc<StopSignal>,
}

impl Sampler {
    pub fn start(shared: Arc<Shared>, channel: Channel, config: SamplerConfig) -> io::Result<Sampler> {
        let stop = Arc::new(StopSignal::default());
        let stop_for_thread = stop.clone();
        let thread = NativeThread::spawn("corsnap-sampler", move || {
            SamplerLoop::new(shared, channel, config).run(&stop_for_thread);
        })?;
        Ok(Sampler { thread, stop })
    }

    /// Stops the thread and waits for it (up to `timeout`: at process exit
    /// the runtime may never let a suspension finish, and the process is
    /// going away regardless).
    pub fn stop(self, reason: &str, timeout: Duration) {
        self.stop.raise(reason);
        if self.thread.join_timeout(timeout).is_err() {
            log::write(format_args!("sampler did not stop within {timeout:?}"));
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
}

/// Buffers filled while the runtime is suspended. Sized once, so the walk
/// itself never allocates.
struct TickBuffers {
    threads: Vec<ThreadID>,
    frames: Vec<u64>,
    stacks: Vec<StackRecord>,
}

impl TickBuffers {
    fn new() -> Self {
        TickBuffers {
            threads: Vec::with_capacity(MAX_THREADS_PER_TICK),
            frames: Vec::with_capacity(ARENA_FRAMES),
            stacks: Vec::with_capacity(MAX_THREADS_PER_TICK),
        }
    }
}

struct SamplerLoop {
    shared: Arc<Shared>,
    channel: Channel,
    interval: Duration,
    buffers: TickBuffers,
    names: NameResolver,
    sent_functions: HashSet<FunctionID>,
    /// What the CLI was last told about each thread: (registry version, OS tid).
    sent_threads: HashMap<ThreadID, (u64, u32)>,
    stats: SamplerStats,
    tick_times: TickTimes,
    started: Instant,
    rng: u64,
    logged_errors: u32,
}

impl SamplerLoop {
    fn new(shared: Arc<Shared>, channel: Channel, config: SamplerConfig) -> Self {
        let names = NameResolver::new(shared.info);
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        SamplerLoop {
            shared,
            channel,
            interval: Duration::from_nanos(1_000_000_000 / u64::from(config.rate_hz.max(1))),
            buffers: TickBuffers::new(),
            names,
            sent_functions: HashSet::new(),
            sent_threads: HashMap::new(),
            stats: SamplerStats::default(),
            tick_times: TickTimes::new(),
            started: Instant::now(),
            rng: (seed as u64) | 1,
            logged_errors: 0,
        }
    }

    fn run(mut self, stop: &StopSignal) {
        self.warm_up();
        let mut next_tick = Instant::now();
        let mut next_stats = Instant::now() + STATS_EVERY;
        let mut next_send = Instant::now();
        let reason = loop {
            next_tick += self.jittered_interval();
            let now = Instant::now();
            if next_tick < now {
                // Behind (a long tick or a descheduled thread): do not burst.
                next_tick = now;
            }
            if let Some(reason) = stop.sleep_until(next_tick) {
                break reason;
            }
            self.tick();
            if Instant::now() >= next_stats {
                next_stats += STATS_EVERY;
                self.queue_stats();
            }
            let now = Instant::now();
            if now >= next_send || self.channel.pending_bytes() >= SEND_AT_BYTES {
                next_send = now + SEND_EVERY;
                if let Err(e) = self.channel.flush() {
                    break format!("corsnap went away ({e})");
                }
            }
        };
        log::write(format_args!("sampler stopping: {reason}; {:?}", self.stats));
        self.queue_stats();
        self.channel.queue(&Message::Goodbye { reason });
        let _ = self.channel.flush();
    }

    fn queue_stats(&mut self) {
        self.tick_times.fill(&mut self.stats);
        self.stats.sampler_cpu_ns = corsnap_abi::thread_cpu_time_ns(corsnap_abi::current_os_tid()).unwrap_or(0);
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
            Some(t) => self.shared.info.do_stack_snapshot(t, &mut |_| false),
            None => self.shared.info.do_stack_snapshot(0, &mut |_| false),
        };
        log::write(format_args!("warm-up snapshot (nothing suspended): {}", hr::describe(status)));
    }

    fn jittered_interval(&mut self) -> Duration {
        // xorshift64: cheap, and good enough to keep ticks from locking step
        // with the program's own periodic work.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let permille = 900 + (self.rng % 201); // 0.9 .. 1.1
        self.interval * permille as u32 / 1000
    }

    fn tick(&mut self) {
        let info = self.shared.info;
        let t0 = Instant::now();
        if info.suspend_runtime().is_err() {
            // A GC or another suspension is under way; never nest.
            self.stats.skipped_ticks += 1;
            return;
        }
        let t1 = Instant::now();
        self.shared.gate.begin_walk();
        self.walk_all_suspended();
        self.shared.gate.end_walk();
        let t2 = Instant::now();
        let resumed = info.resume_runtime();
        let t3 = Instant::now();
        self.shared.gate.wake_waiters();
        if let Err(e) = resumed {
            log::write(format_args!("ResumeRuntime failed: {e}"));
        }

        let ns = |d: Duration| d.as_nanos() as u64;
        self.stats.ticks += 1;
        self.stats.suspend_ns += ns(t1 - t0);
        self.stats.walk_ns += ns(t2 - t1);
        self.stats.resume_ns += ns(t3 - t2);
        self.stats.max_tick_ns = self.stats.max_tick_ns.max(ns(t3 - t0));
        self.tick_times.record(ns(t1 - t0), ns(t2 - t1), ns(t3 - t2));
        self.publish(ns(t1 - self.started));
    }

    /// Runs with every managed thread stopped. No locks, no allocation, no
    /// logging: a stopped thread could be holding whatever we would wait on.
    fn walk_all_suspended(&mut self) {
        let info = self.shared.info;
        let TickBuffers { threads, frames, stacks } = &mut self.buffers;
        frames.clear();
        stacks.clear();
        if info.enum_threads_into(threads).is_err() {
            return;
        }
        for &thread in threads.iter().take(MAX_THREADS_PER_TICK) {
            let os_tid = info.get_thread_info(thread).unwrap_or(0);
            let start = frames.len();
            let mut truncated = false;
            let status = info.do_stack_snapshot(thread, &mut |function| {
                if frames.len() - start >= MAX_FRAMES_PER_STACK || frames.len() == frames.capacity() {
                    truncated = true;
                    return false;
                }
                frames.push(function as u64);
                true
            });
            stacks.push(StackRecord { thread, os_tid, start, end: frames.len(), truncated, status });
        }
    }

    /// After resuming: names, thread identities and samples to the CLI.
    fn publish(&mut self, time_ns: u64) {
        let stacks = std::mem::take(&mut self.buffers.stacks);
        self.describe_threads(&stacks);
        for record in &stacks {
            let harmless = record.status >= 0
                || record.status == hr::E_FAIL // a runtime thread with no managed frames
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
            self.describe_functions(record.start, record.end);
            if record.truncated {
                self.stats.truncated_stacks += 1;
            }
            self.stats.samples += 1;
            let frames = &self.buffers.frames[record.start..record.end];
            corsnap_wire::encode_sample(
                &mut self.channel.pending,
                time_ns,
                record.thread as u64,
                record.truncated,
                frames,
            );
        }
        self.buffers.stacks = stacks;
    }

    fn describe_functions(&mut self, start: usize, end: usize) {
        for i in start..end {
            let function = self.buffers.frames[i] as FunctionID;
            if function == 0 || !self.sent_functions.insert(function) {
                continue;
            }
            let (name, module) = match self.names.resolve(function) {
                Ok(n) => {
                    self.stats.names_resolved += 1;
                    (n.name, n.module)
                }
                Err(e) => {
                    self.stats.name_failures += 1;
                    (format!("[unresolved function 0x{function:x}: {e}]"), String::new())
                }
            };
            self.channel.queue(&Message::Function { function_id: function as u64, name, module });
        }
    }

    fn describe_threads(&mut self, stacks: &[StackRecord]) {
        let mut updates = Vec::new();
        let sent = &self.sent_threads;
        self.shared.threads.with_entries(
            stacks.iter().filter(|r| r.start != r.end).map(|r| r.thread),
            |thread, entry| {
                let record_tid = stacks.iter().find(|r| r.thread == thread).map_or(0, |r| r.os_tid);
                let (version, name, registry_tid) =
                    entry.map_or((0, String::new(), 0), |e| (e.version, e.name.clone(), e.os_tid));
                let os_tid = if record_tid != 0 { record_tid } else { registry_tid };
                if sent.get(&thread) != Some(&(version, os_tid)) {
                    updates.push((thread, version, os_tid, name));
                }
            },
        );
        for (thread, version, os_tid, name) in updates {
            self.sent_threads.insert(thread, (version, os_tid));
            self.channel.queue(&Message::Thread { thread_id: thread as u64, os_tid, name });
        }
    }
}
