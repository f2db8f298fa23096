//! The sampler thread: one thread of the agent's own, which never runs
//! managed code (Rule 1). It runs the CPU engines (`engine.rs`: `signal`,
//! and `suspend`, which also takes wall samples and snapshots) when each is
//! due, sends what the runtime's callbacks queued (exceptions, allocations,
//! collections), and sends everything to the CLI through its
//! [`Recorder`], in batches, with running totals every second.

use std::collections::HashMap;
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use corsnap_abi::{send_all, FunctionID, NativeThread, ThreadID};
use corsnap_wire::{EventKind, Message, SampleHead};

use crate::engine::{Engine, SignalCpuEngine};
use crate::event_walks::EventWalker;
use crate::events::Subject;
use crate::log;
use crate::native_modules::{NativeModules, SharedNativeModules};
use crate::recorder::Recorder;
use crate::suspend_engine::{SuspendEngine, MAX_THREADS_PER_TICK};
use crate::Shared;

/// Entries any one cache of the sampler may hold. A process that JITs
/// without end (or churns threads) would otherwise grow them without end;
/// a full cache is emptied and counted, and what it held is looked up again.
pub(crate) const CACHE_CAP: usize = 200_000;

/// How often running totals go to the CLI.
const STATS_EVERY: Duration = Duration::from_secs(1);
/// Samples are sent in batches: a send per tick would wake the CLI (and
/// take a CPU from the program) up to a thousand times a second.
const SEND_EVERY: Duration = Duration::from_millis(50);
/// ...or sooner, once this much is waiting.
const SEND_AT_BYTES: usize = 256 * 1024;
/// How long the sampler thread waits, before it sets up its engines, for
/// CoreLib to load, so that it can ask for the dispatch hook first.
const CORELIB_WAIT: Duration = Duration::from_millis(100);
/// How often the events counted on the event walkers' kept walks are taken
/// (as often as samples are sent): each take pulls every pooled walker's
/// slot and counts to the agent's core, and the throwing thread's next event
/// misses them.
const REPEATS_EVERY: Duration = SEND_EVERY;

/// The connection to the CLI. Writes use `MSG_NOSIGNAL`: a CLI that went away
/// must cost us an error, not a `SIGPIPE` that kills the application.
#[derive(Debug)]
pub struct Channel {
    stream: UnixStream,
    pub(crate) pending: Vec<u8>,
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

    /// Sleeps until `deadline` or until woken, leaving a stop or a snapshot
    /// asked for to the sampler loop's [`Self::wait`]: `false` at the
    /// deadline or once a stop is asked for.
    fn wait_woken(&self, deadline: Instant) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if s.stop.is_some() {
                return false;
            }
            if s.woken {
                s.woken = false;
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            s = self.raised.wait_timeout(s, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
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
        let thread = NativeThread::spawn("corsnap-sampler", move || {
            // First: the program may throw from its first milliseconds, and
            // the engines' and the event walker's set-up in `new` takes tens
            // of them; until the hook's first call, throws come from the
            // costlier EventPipe session.
            // CoreLib is loaded a few milliseconds after the agent starts:
            // its load wakes this thread (`module_load_finished`).
            let deadline = Instant::now() + CORELIB_WAIT;
            crate::tend_throw_hook(&for_thread);
            while crate::throw_hook_waits_for_corelib(&for_thread) && for_thread.signal.wait_woken(deadline) {
                crate::tend_throw_hook(&for_thread);
            }
            SamplerLoop::new(for_thread, channel).run()
        })?;
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

struct SamplerLoop {
    shared: Arc<Shared>,
    /// Names, thread identities and samples to the CLI, for every engine.
    recorder: Recorder,
    /// Suspensions: wall samples, snapshots, and CPU samples when the
    /// signal engine does not take them.
    suspend: SuspendEngine,
    /// The `signal` engine, when it takes the CPU samples.
    signal: Option<SignalCpuEngine>,
    /// Whether callbacks queue events that need sending.
    records_events: bool,
    /// `CORSNAP_VERIFY_WALKS=1`: compare signal-engine walks with
    /// `DoStackSnapshot` at the same instant (tests only).
    verify: Option<WalkVerification>,
    /// When the events counted on the event walkers are next taken.
    next_repeats: Instant,
    /// The native modules' cache the walkers share, and the loader's
    /// counters when its row tables were last built for the event walker
    /// (see `publish_events`).
    native_modules: SharedNativeModules,
    tables_built_for: (u64, u64),
    /// Whether each `FunctionID` met at the top of an exception's stack is
    /// the runtime's managed exception dispatch.
    dispatch_functions: HashMap<u64, bool>,
    /// `CORSNAP_VERIFY_EVENT_WALKS=1`: event stacks compared.
    event_verification: WalkVerification,
}

impl SamplerLoop {
    fn new(shared: Arc<Shared>, channel: Channel) -> Self {
        let native_modules = NativeModules::shared();
        let signal = if shared.sampler_kind == corsnap_wire::SamplerKind::Signal && shared.records(EventKind::Cpu) {
            match SignalCpuEngine::start(shared.clone(), native_modules.clone()) {
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
        let records_events = [EventKind::Exceptions, EventKind::Gc, EventKind::ClassLoad, EventKind::Alloc]
            .iter()
            .any(|&k| shared.records(k));
        // Event stacks walked by corsnap's own unwinder (`--walker native`)
        // are named by the event walker kept in `Shared::event_walker`; with
        // none there, by `DoStackSnapshot`.
        if records_events && shared.native_event_walks {
            let compiled = std::mem::take(&mut *shared.jitted_for_events.lock().unwrap_or_else(|p| p.into_inner()));
            match EventWalker::start(shared.info, native_modules.clone(), &compiled) {
                Ok(walker) => {
                    let paths = walker.native_paths();
                    *shared.event_walker.lock().unwrap_or_else(|p| p.into_inner()) = Some(walker);
                    // The tables every event stack's root is named from, read
                    // now and without holding the walker (see
                    // `Symbolizer::preload_roots`).
                    let mut roots = crate::symbols::Symbolizer::default();
                    roots.preload_roots(paths.iter().map(String::as_str));
                    if let Some(walker) = shared.event_walker.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                        walker.adopt_symbols(roots);
                    }
                }
                Err(why) => {
                    let text = format!("{why}; event stacks are walked by DoStackSnapshot instead");
                    log::write(format_args!("{text}"));
                    shared.post(Message::Notice { severity: corsnap_wire::Severity::Warning, text });
                }
            }
        }
        SamplerLoop {
            recorder: Recorder::new(shared.clone(), channel),
            suspend: SuspendEngine::new(shared.clone(), signal.is_none()),
            shared,
            signal,
            records_events,
            next_repeats: Instant::now(),
            native_modules,
            tables_built_for: (0, 0),
            dispatch_functions: HashMap::new(),
            event_verification: WalkVerification::default(),
            verify: std::env::var("CORSNAP_VERIFY_WALKS").is_ok_and(|v| v == "1").then(WalkVerification::default),
        }
    }

    fn run(mut self) {
        // (CoreLib may not have been loaded when the thread started.)
        crate::tend_throw_hook(&self.shared);
        self.suspend.warm_up();
        if self.shared.records(EventKind::Cpu) {
            let engine = self.signal.as_ref().map_or(self.suspend.name(), |s| s.name());
            log::write(format_args!("CPU samples taken by the {engine} engine"));
        }
        let mut next_stats = Instant::now() + STATS_EVERY;
        let mut next_send = Instant::now();
        let mut next_verify = Instant::now() + VERIFY_EVERY;
        if let Some(v) = self.verify.as_mut() {
            v.pending.reserve(MAX_THREADS_PER_TICK);
        }
        let reason = loop {
            let now = Instant::now();
            let mut deadline = self.suspend.next_run(now);
            if let Some(signal) = self.signal.as_mut() {
                deadline = earliest(deadline, signal.next_run(now));
            }
            // Events queued by callbacks are sent at least this often.
            if self.records_events {
                deadline = earliest(deadline, Some(now + SEND_EVERY));
            }
            if self.verify.is_some() && self.signal.is_some() {
                deadline = earliest(deadline, Some(next_verify));
            }
            let wake = self.shared.signal.wait(deadline);
            if let Some(reason) = wake.stop {
                break reason;
            }
            let mut send_now = false;
            if wake.snapshot {
                self.suspend.tick(&mut self.recorder, true);
                self.recorder.channel.queue(&Message::SnapshotEnd);
                send_now = true;
            }
            let engines: [Option<&mut dyn Engine>; 2] =
                [Some(&mut self.suspend), self.signal.as_mut().map(|s| s as &mut dyn Engine)];
            for engine in engines.into_iter().flatten() {
                let now = Instant::now();
                if engine.next_run(now).is_some_and(|due| now >= due) {
                    send_now |= engine.run(&mut self.recorder, now);
                }
            }
            if self.verify.is_some() && self.signal.is_some() && Instant::now() >= next_verify {
                // A round the runtime would not suspend for (a collection
                // under way: gcstop.cs collects without pause) is tried
                // again soon, so that a busy machine's rounds are not lost
                // to the collections' timing.
                let suspended = self.verify_round();
                next_verify = Instant::now() + if suspended { VERIFY_EVERY } else { VERIFY_RETRY };
            }
            self.publish_events(None);
            crate::tend_throw_hook(&self.shared);
            let posted = std::mem::take(&mut *self.shared.outbox.lock().unwrap_or_else(|p| p.into_inner()));
            send_now |= !posted.is_empty();
            for msg in &posted {
                self.recorder.channel.queue(msg);
            }
            let now = Instant::now();
            if now >= next_stats {
                next_stats = now + STATS_EVERY;
                self.queue_stats();
            }
            if send_now || now >= next_send || self.recorder.channel.pending_bytes() >= SEND_AT_BYTES {
                next_send = now + SEND_EVERY;
                if let Err(e) = self.recorder.channel.flush() {
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
            log::write(format_args!(
                "{text}; {} rounds, {} of them not suspended; {} snapshots failed; {} threads without a sample",
                v.rounds, v.suspend_failed, v.snapshot_failed, v.no_sample
            ));
            self.recorder.channel.queue(&Message::Notice { severity: corsnap_wire::Severity::Info, text });
        }
        if let Some(signal) = self.signal.as_mut() {
            signal.stop(&mut self.recorder);
        }
        self.suspend.stop(&mut self.recorder);
        // The last events counted on the event walkers: one lent to a walk
        // now is back within microseconds.
        self.publish_events(Some(Instant::now() + Duration::from_millis(100)));
        // Taken out first: a compiling thread finds no walker after this.
        let walker = self.shared.event_walker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut walker) = walker {
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
            self.recorder.channel.queue(&Message::Notice { severity: corsnap_wire::Severity::Info, text });
        }
        if self.shared.throw_hook.called.load(std::sync::atomic::Ordering::SeqCst) {
            log::write(format_args!("exceptions: from the dispatch hook"));
        }
        log::write(format_args!("sampler stopping: {reason}; {:?}", self.recorder.stats));
        self.queue_stats();
        self.recorder.channel.queue(&Message::Goodbye { reason });
        let _ = self.recorder.channel.flush();
    }

    fn queue_stats(&mut self) {
        let stats = &mut self.recorder.stats;
        // Set here, added to by each engine.
        stats.cache_resets = self.recorder.own_cache_resets + self.recorder.names.cache_resets();
        stats.events_dropped = self.shared.events.dropped.load(std::sync::atomic::Ordering::Relaxed);
        stats.sampler_cpu_ns = corsnap_abi::thread_cpu_time_ns(corsnap_abi::current_os_tid()).unwrap_or(0);
        self.suspend.fill_stats(stats);
        if let Some(engine) = self.signal.as_mut() {
            engine.fill_stats(stats);
        }
        let stats = self.recorder.stats;
        self.recorder.channel.queue(&Message::Stats(stats));
    }

    /// One verification round: with the runtime suspended, every managed
    /// thread is asked for a signal-engine sample (a queued signal its handler
    /// takes while the thread is parked) and walked by `DoStackSnapshot`;
    /// after the resume, the two lists of managed frames are compared. The
    /// suspended part allocates nothing (preallocated buffers) and takes no
    /// lock.
    ///
    /// Returns whether the runtime was suspended.
    fn verify_round(&mut self) -> bool {
        let info = self.shared.info;
        let (Some(signal), Some(verify)) = (self.signal.as_ref(), self.verify.as_mut()) else { return true };
        let engine = &signal.engine;
        verify.rounds += 1;
        if let Err(e) = info.suspend_runtime() {
            if verify.suspend_failed == 0 {
                log::write(format_args!("walk verification: SuspendRuntime failed: {e}"));
            }
            verify.suspend_failed += 1;
            return false;
        }
        self.shared.gate.begin_walk();
        verify.pending.clear();
        if info.enum_threads_into(&mut self.suspend.buffers.threads).is_ok() {
            for &thread in self.suspend.buffers.threads.iter().take(MAX_THREADS_PER_TICK) {
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
        self.suspend.walk_all_suspended(true);
        self.shared.gate.end_walk();
        let resumed = info.resume_runtime();
        self.shared.gate.wake_waiters();
        if let Err(e) = resumed {
            log::write(format_args!("ResumeRuntime failed: {e}"));
        }
        let Some(signal) = self.signal.as_mut() else { return true };
        signal.collect(&mut self.recorder, false);
        let requested = signal.engine.take_requested();
        // What a mismatch's log line says of our whole walk: its frames, how
        // many native, and how it ended.
        let walked: HashMap<u32, String> = requested
            .iter()
            .map(|s| {
                let native = s.frames.iter().filter(|&&f| f & corsnap_wire::NATIVE_FRAME_BIT != 0).count();
                let ending = match s.frames.last() {
                    Some(&crate::signal_engine::INCOMPLETE_KEY) => "incomplete",
                    _ if s.truncated => "truncated",
                    _ => "whole",
                };
                (s.os_tid, format!("{} frames, {native} native, {ending}: {:x?}", s.frames.len(), s.frames))
            })
            .collect();
        let ours: HashMap<u32, Vec<u64>> = requested
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
                self.recorder.names.resolve(f as FunctionID).map_or(true, |n| !n.name.starts_with("System.Runtime.EH."))
            });
        }
        let stacks = std::mem::take(&mut self.suspend.buffers.stacks);
        for record in &stacks {
            let in_time = self.verify.as_ref().is_some_and(|v| v.pending.iter().any(|&(t, _)| t == record.os_tid));
            if !in_time {
                continue;
            }
            let Some(ours) = ours.get(&record.os_tid) else {
                if let Some(v) = self.verify.as_mut() {
                    v.no_sample += 1;
                }
                continue;
            };
            if record.status < 0 || record.truncated {
                if let Some(v) = self.verify.as_mut() {
                    v.snapshot_failed += 1;
                }
                continue;
            }
            let truth: Vec<u64> =
                self.suspend.buffers.frames[record.start..record.end].iter().copied().filter(|&f| f != 0).collect();
            let Some(verify) = self.verify.as_mut() else { break };
            verify.compared += 1;
            if *ours == truth {
                verify.identical += 1;
            } else if verify.logged < 10 {
                verify.logged += 1;
                let mut name = |f: &u64| {
                    self.recorder.names.resolve(*f as FunctionID).map(|n| n.name).unwrap_or_else(|_| format!("{f:#x}"))
                };
                let ours: Vec<String> = ours.iter().map(&mut name).collect();
                let truth: Vec<String> = truth.iter().map(&mut name).collect();
                log::write(format_args!(
                    "walk verification, thread {}: signal walk {:?} but DoStackSnapshot {:?} (our walk: {})",
                    record.os_tid,
                    ours,
                    truth,
                    walked.get(&record.os_tid).map_or("", String::as_str)
                ));
            }
        }
        self.suspend.buffers.stacks = stacks;
        true
    }

    /// Sends what the runtime's callbacks queued: exceptions, class loads,
    /// collections. `last`: until when to wait for an event walker lent to
    /// a walk, whose counted events would otherwise wait for the next take.
    fn publish_events(&mut self, last: Option<Instant>) {
        let shared = self.shared.clone();
        // The row tables of modules loaded since the last round, once
        // walks want them (`event_walks::tables_wanted`), built
        // before the event walker is locked (tens of milliseconds at
        // start-up, when a thread whose event met code not known yet would
        // find the walker held and leave the code to this thread; see
        // `Shared::wake_for_new_stacks`): the walker's refresh finds them
        // built.
        // The loader's objects are read once a round, for this and for the
        // walker's refresh.
        let loaded = self.shared.native_event_walks.then(corsnap_abi::process::loaded_objects);
        let tables = crate::event_walks::tables_wanted(self.shared.records(EventKind::Alloc));
        if let Some((objects, counters)) = &loaded {
            if tables && *counters != self.tables_built_for {
                self.tables_built_for = *counters;
                self.native_modules
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .modules_of(objects, crate::native_modules::Tables::EventStacks);
            }
        }
        // The walker is held for each step on its own, not the whole round:
        // a thread that finds it held leaves the code it would have learned
        // to this thread, and until this thread has learned it every event
        // through that code copies its stack.
        let event_walker = || shared.event_walker.lock().unwrap_or_else(|p| p.into_inner());
        let image = event_walker().as_mut().zip(loaded.as_ref()).and_then(|(walker, loaded)| {
            let now = Instant::now();
            if last.is_some() || now >= self.next_repeats {
                self.next_repeats = now + REPEATS_EVERY;
                self.shared.events.take_repeats(last);
            }
            let announced = self.shared.threads_changed_for_events.swap(false, std::sync::atomic::Ordering::Relaxed);
            let compiled =
                std::mem::take(&mut *self.shared.jitted_for_events.lock().unwrap_or_else(|p| p.into_inner()));
            walker.refresh(announced, &compiled, loaded, tables);
            walker.take_image_without_rules()
        });
        if let Some(image) = image {
            let image = crate::code_learning::with_image_body_rules(image);
            if let Some(walker) = event_walker().as_mut() {
                walker.add_image_with_rules(image);
            }
        }
        let mut events = self.shared.events.take();
        let gcs = self.shared.events.take_gcs();
        if events.is_empty() && gcs.is_empty() {
            return;
        }
        let mut threads: Vec<(ThreadID, u32)> = events.iter().map(|e| (e.thread, e.os_tid)).collect();
        threads.sort_unstable();
        threads.dedup();
        self.recorder.describe_threads(&threads);
        for event in &mut events {
            let Some(raw) = event.raw.take() else { continue };
            let resolved =
                event_walker().as_mut().map(|walker| walker.resolve(&event.frames, raw.flags, raw.copy.as_ref()));
            let Some((mut frames, truncated)) = resolved else {
                // Cannot happen: only a running walker's map produces raw frames.
                event.frames.clear();
                continue;
            };
            self.leave_out_dispatch(&mut frames);
            event.frames = frames;
            event.truncated |= truncated;
            if let Some(referee) = event.referee.take() {
                self.verify_event_walk(event.kind, &event.frames, &referee);
            }
        }
        let names = event_walker().as_mut().map(EventWalker::take_names);
        if let Some(names) = names {
            self.recorder.send_names(names);
        }
        // Walks made only to learn from (the benchmarks' floor) weigh nothing.
        events.retain(|e| e.weight > 0);
        for event in events {
            for &function in &event.frames {
                if function & corsnap_wire::NATIVE_FRAME_BIT == 0 {
                    self.recorder.describe_function(function as FunctionID);
                }
            }
            let leaf = match &event.subject {
                Subject::Class(class) => self.recorder.names.class_name(*class),
                Subject::Text(text) => text.clone(),
                Subject::ExceptionType(number) => self.shared.events.exception_type_name(*number),
                Subject::ClassOr(class, fallback) => {
                    let name = self.recorder.names.class_name(*class);
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
            self.recorder.send_sample(&head, &leaf, &event.frames, &[]);
        }
        for gc in gcs {
            self.recorder.channel.queue(&Message::Gc {
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
                let names = &mut self.recorder.names;
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
            |f: u64| self.recorder.names.resolve(f as FunctionID).map_or_else(|e| format!("{f:#x} ({e})"), |n| n.name);
        let ours: Vec<String> = ours.iter().map(|&f| name(f)).collect();
        let theirs: Vec<String> = theirs.iter().map(|&f| name(f)).collect();
        log::write(format_args!(
            "event walk verification ({kind:?}): native {} but DoStackSnapshot {}",
            ours.join(" <- "),
            theirs.join(" <- ")
        ));
    }
}

/// The earlier of two optional deadlines.
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
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
    /// Why stacks went uncompared, for the agent's log.
    rounds: u64,
    suspend_failed: u64,
    snapshot_failed: u64,
    no_sample: u64,
}

/// How often a verification round runs.
const VERIFY_EVERY: Duration = Duration::from_millis(250);
/// How soon a round the runtime would not suspend for is tried again.
const VERIFY_RETRY: Duration = Duration::from_millis(5);
