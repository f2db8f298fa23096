//! The `suspend` engine: the seeds' design. It suspends the runtime with
//! `SuspendRuntime` (on Linux `DoStackSnapshot` cannot walk another thread
//! any other way), walks every managed thread into preallocated buffers,
//! resumes, and only then does anything that allocates, locks or talks to
//! the CLI. It takes wall samples, `dump`'s snapshots, and CPU samples when
//! the `signal` engine does not; and it is the referee the signal engine's
//! walks are checked against.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corsnap_abi::{hr, FunctionID, ThreadID, HRESULT};
use corsnap_wire::{EventKind, SampleHead, SamplerStats};

use crate::budget::PauseBudget;
use crate::engine::Engine;
use crate::log;
use crate::recorder::Recorder;
use crate::sampler::CACHE_CAP;
use crate::Shared;

/// Frames kept per stack; deeper stacks keep their leaf end and are marked
/// truncated.
const MAX_FRAMES_PER_STACK: usize = 4096;
/// Frames kept per tick across all threads.
const ARENA_FRAMES: usize = 256 * 1024;
/// Threads walked per tick.
pub(crate) const MAX_THREADS_PER_TICK: usize = 4096;

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
pub(crate) struct StackRecord {
    pub(crate) thread: ThreadID,
    pub(crate) os_tid: u32,
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) truncated: bool,
    pub(crate) status: HRESULT,
    /// The thread's CPU clock, read while it is stopped (0 if not wanted).
    pub(crate) cpu_ns: u64,
}

/// Buffers filled while the runtime is suspended. Sized once, so the walk
/// itself never allocates.
pub(crate) struct TickBuffers {
    pub(crate) threads: Vec<ThreadID>,
    pub(crate) frames: Vec<u64>,
    /// Each frame's instruction pointer, beside it in `frames`.
    pub(crate) ips: Vec<u64>,
    pub(crate) stacks: Vec<StackRecord>,
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

pub(crate) struct SuspendEngine {
    shared: Arc<Shared>,
    pub(crate) buffers: TickBuffers,
    tick_times: TickTimes,
    pause_budget: PauseBudget,
    started: Instant,
    /// Each thread's CPU clock at its previous sample.
    cpu_clock: HashMap<ThreadID, (u32, u64)>,
    rng: u64,
    logged_errors: u32,
    il_offsets: crate::il_offsets::IlOffsets,
    il_scratch: Vec<u32>,
    /// Ticks take CPU samples (the signal engine does not).
    takes_cpu: bool,
    /// Ticks run on a timer: wall samples, or CPU samples.
    on_timer: bool,
    /// [`corsnap_wire::ENV_BENCH_SUSPEND_ONLY`]: ticks suspend and resume
    /// the runtime, and do nothing else.
    suspend_only: bool,
    next_tick: Option<Instant>,
    own_cache_resets: u64,
}

impl SuspendEngine {
    /// `takes_cpu`: no signal engine takes the CPU samples.
    pub(crate) fn new(shared: Arc<Shared>, takes_cpu: bool) -> Self {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let takes_cpu = takes_cpu && shared.records(EventKind::Cpu);
        SuspendEngine {
            started: shared.epoch,
            pause_budget: PauseBudget::new(u64::from(shared.max_pause_ppm), crate::budget::CAPACITY_NS),
            on_timer: shared.records(EventKind::Wall) || takes_cpu,
            takes_cpu,
            shared,
            buffers: TickBuffers::new(),
            tick_times: TickTimes::new(),
            cpu_clock: HashMap::new(),
            rng: (seed as u64) | 1,
            logged_errors: 0,
            il_offsets: crate::il_offsets::IlOffsets::new(),
            il_scratch: Vec::new(),
            suspend_only: std::env::var(corsnap_wire::ENV_BENCH_SUSPEND_ONLY).is_ok_and(|v| v == "1"),
            next_tick: None,
            own_cache_resets: 0,
        }
    }

    /// Seed 004: the first time a thread of ours enters `DoStackSnapshot` the
    /// runtime initialises per-thread state, which can deadlock if a target
    /// is suspended and holds the lock it needs. So make that first call with
    /// nothing suspended. On Linux a walk of another running thread answers
    /// `E_NOTIMPL`, but it has still passed through that initialisation.
    pub(crate) fn warm_up(&mut self) {
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

    /// One suspension: every managed thread walked with `DoStackSnapshot`,
    /// then, after the resume, its samples sent.
    pub(crate) fn tick(&mut self, recorder: &mut Recorder, snapshot: bool) {
        let info = self.shared.info;
        let t0 = Instant::now();
        if info.suspend_runtime().is_err() {
            // A GC or another suspension is under way; never nest.
            recorder.stats.skipped_ticks += 1;
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
        recorder.stats.ticks += 1;
        recorder.stats.suspend_ns += ns(t1 - t0);
        recorder.stats.walk_ns += ns(t2 - t1);
        recorder.stats.resume_ns += ns(t3 - t2);
        recorder.stats.max_tick_ns = recorder.stats.max_tick_ns.max(ns(t3 - t0));
        self.tick_times.record(ns(t1 - t0), ns(t2 - t1), ns(t3 - t2));
        self.publish(recorder, ns(t1 - self.started), snapshot);
    }

    /// Runs with every managed thread stopped. No locks, no allocation, no
    /// logging: a stopped thread could be holding whatever we would wait on.
    pub(crate) fn walk_all_suspended(&mut self, snapshot: bool) {
        let info = self.shared.info;
        // A stopped thread's CPU clock is cheap to read (a running one's
        // makes the kernel lock the runqueue of the CPU it runs on), and
        // reading it here ends the interval exactly at the sample. A system
        // call: no lock of the process's, no allocation.
        let read_cpu = self.takes_cpu;
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
    fn publish(&mut self, recorder: &mut Recorder, time_ns: u64, snapshot: bool) {
        let stacks = std::mem::take(&mut self.buffers.stacks);
        let walked: Vec<(ThreadID, u32)> =
            stacks.iter().filter(|r| r.start != r.end).map(|r| (r.thread, r.os_tid)).collect();
        recorder.describe_threads(&walked);
        let cpu = self.takes_cpu && !snapshot;
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
                recorder.stats.walk_errors += 1;
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
                recorder.describe_function(function);
            }
            if record.truncated {
                recorder.stats.truncated_stacks += 1;
            }
            recorder.stats.samples += 1;
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
                    recorder.send_sample(&head, "", frames, il_offsets);
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
}

impl Engine for SuspendEngine {
    fn name(&self) -> &'static str {
        "suspend"
    }

    fn next_run(&mut self, now: Instant) -> Option<Instant> {
        // Without a timer profile (cpu or wall) there is nothing to tick
        // for; snapshots still work.
        let rate = if self.on_timer { self.shared.signal.rate() } else { 0 };
        if rate == 0 {
            self.next_tick = None;
        } else if self.next_tick.is_none() {
            self.next_tick = Some(now + self.jittered_interval(rate));
        }
        self.next_tick
    }

    fn run(&mut self, recorder: &mut Recorder, now: Instant) -> bool {
        let Some(due) = self.next_tick.filter(|&due| now >= due) else { return false };
        // The first samples go out at once: the user is waiting.
        let first = recorder.stats.samples == 0;
        if self.pause_budget.allows(now.duration_since(self.started).as_nanos() as u64) {
            self.tick(recorder, false);
        } else {
            recorder.stats.throttled_ticks += 1;
        }
        // Behind (a long tick, a descheduled thread): do not burst.
        let rate = self.shared.signal.rate();
        self.next_tick = Some((due + self.jittered_interval(rate)).max(now));
        first
    }

    fn fill_stats(&mut self, stats: &mut SamplerStats) {
        self.tick_times.fill(stats);
        stats.cache_resets += self.own_cache_resets + self.il_offsets.cache_resets;
    }

    fn stop(&mut self, _recorder: &mut Recorder) {}
}
