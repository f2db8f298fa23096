//! The `signal` engine: CPU samples without stopping the world.
//!
//! Every thread of the process (managed or not, the agent's own excepted)
//! gets a timer on its own CPU clock; each 1/rate s of CPU it uses, the
//! kernel interrupts it with `SIGPROF` and corsnap's handler walks its stack
//! into a buffer of its own (`corsnap_abi::signal`). This engine, on the
//! agent's thread, does everything else:
//!
//! - finds threads (a cheap scan of `/proc/self/task`, and at once when the
//!   runtime announces one) and arms their timers, and drops exited ones;
//! - keeps the code map the handler walks with: native modules and their
//!   CFI (rebuilt when the loader's counters change), the stacks' mappings,
//!   and managed code learned from the addresses walks met
//!   ([`crate::code_learning`]), published whole each time it changes;
//! - drains the buffers and turns raw addresses into frame ids: managed
//!   ones into `FunctionID`s (named by the same resolver as the `suspend`
//!   engine's), native ones into `module!symbol` ([`crate::symbols`]).
//!
//! Blocked threads use no CPU, so they are never signalled: a system call
//! that a signal would cut short (a socket read with a timeout) is left
//! alone.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corsnap_abi::signal::{self, SignalSampler, SlotId};
use corsnap_abi::FunctionID;
use corsnap_unwind::process::{parse_maps, stack_ranges};
use corsnap_unwind::{flags, lookup_address, CodeMap, HijackStub, ManagedCode, NativeModule};
use corsnap_wire::{CpuClock, SamplerStats, NATIVE_FRAME_BIT, NO_IL_OFFSET};

use crate::code_learning::{knows_code, CodeLearner, Learned, STUB_TAG};
use crate::log;
use crate::native_modules::SharedNativeModules;
use crate::runtime_layout::RuntimeLayout;
use crate::symbols::Symbolizer;
use crate::Shared;

/// Bytes of each runtime thread object searched for the hijack fields.
const THREAD_OBJECT_SCAN: usize = 2048;

/// What the runtime's constructor fills `m_pvHJRetAddr` and
/// `m_ppvHJRetAddrPtr` with, until the thread's first hijack.
const HIJACK_FIELDS_FILL: u64 = 0xCCCC_CCCC_CCCC_CCCC;

/// Where `Thread::m_pvHJRetAddr` and `m_ppvHJRetAddrPtr` sit in the
/// runtime's thread objects (`objects`, as 8-byte words), which differs by
/// runtime version and build: the only pair of words that every thread not
/// hijacked yet still has at the constructor's fill, while in every other
/// thread the second points into a thread stack (the slot of its last
/// hijack). `None` unless exactly one offset fits and some thread shows it.
fn hijack_fields_offset(objects: &[Vec<u64>], stacks: &[std::ops::Range<u64>]) -> Option<u64> {
    let filled =
        |o: &[u64], i: usize| o.get(i) == Some(&HIJACK_FIELDS_FILL) && o.get(i + 1) == Some(&HIJACK_FIELDS_FILL);
    let hijacked_once = |o: &[u64], i: usize| o.get(i + 1).is_some_and(|p| stacks.iter().any(|s| s.contains(p)));
    let len = objects.iter().map(Vec::len).min()?;
    let fits: Vec<usize> = (1..len.saturating_sub(1))
        .filter(|&i| objects.iter().any(|o| filled(o, i)))
        .filter(|&i| objects.iter().all(|o| filled(o, i) || hijacked_once(o, i)))
        .collect();
    match fits.as_slice() {
        [i] => Some(*i as u64 * 8),
        _ => None,
    }
}

/// How long after its start the engine counts as learning (see
/// [`SignalEngine::learning`]).
const LEARNING_AT_START: Duration = Duration::from_secs(1);

/// How often `/proc/self/task` is read for new and exited threads.
const THREAD_SCAN_EVERY: Duration = Duration::from_millis(100);
/// How often `--cpu-clock auto` looks at each thread's context switches.
const CLOCK_CHECK_EVERY: Duration = Duration::from_secs(1);
/// How soon it first chooses a new thread's clock (an attach to a busy
/// server pays for perf events on every thread until then).
const CLOCK_FIRST_CHOICE_AFTER: Duration = Duration::from_millis(200);
/// A thread that switches this often a second moves to a timer: its perf
/// event would cost it 0.6% of a core in switches alone (at ~2 µs each).
/// ASP.NET Core's socket thread and busy workers switch 4,000 to 27,000
/// times a second. A thread preempted only at the end of its time slices
/// stays well under it, even on a crowded machine (CI's load had pool.cs's
/// workers at 1,600 a second, and at 1,000 they moved to timers, whose tick
/// then aliased with the program's 3/2/1.5 ms phases: shares off by 6
/// points).
const TIMER_ABOVE_SWITCHES_PER_S: f64 = 3000.0;
/// ... and back to its perf event below this.
const PERF_BELOW_SWITCHES_PER_S: f64 = 1000.0;
/// Entries in the address caches before they are emptied.
const CACHE_CAP: usize = 200_000;
/// Resolved stacks kept (each up to a few hundred words).
const STACK_CACHE_CAP: usize = 20_000;
/// Frame ids for what has no name of its own.
pub const UNKNOWN_CODE_KEY: u64 = NATIVE_FRAME_BIT | 1;
pub const INCOMPLETE_KEY: u64 = NATIVE_FRAME_BIT | 2;
pub const STUB_KEY: u64 = NATIVE_FRAME_BIT | 3;
/// `[garbage collection]`: see [`crate::gc_windows`].
pub const GC_KEY: u64 = NATIVE_FRAME_BIT | 4;

/// One sample, resolved to frame ids.
#[derive(Debug, Clone)]
pub struct Sample {
    pub os_tid: u32,
    /// Nanoseconds since the agent's epoch.
    pub time_ns: u64,
    /// CPU nanoseconds it stands for.
    pub weight: u64,
    /// Leaf first: `FunctionID`s, or ids with [`NATIVE_FRAME_BIT`].
    pub frames: Vec<u64>,
    /// One per frame: where in its method's IL a managed frame was
    /// ([`crate::il_offsets`]), else [`corsnap_wire::NO_IL_OFFSET`].
    pub il_offsets: Vec<u32>,
    pub truncated: bool,
}

/// What a frame id is, for the CLI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameName {
    Managed(FunctionID),
    Native { key: u64, name: String, module: String },
}

/// A drained sample, owned.
struct RawOwned {
    weight_ns: u64,
    time_ns: u64,
    handler_ns: u64,
    flags: u32,
    frames: Vec<u64>,
    stack: Option<OwnedStackCopy>,
}

impl RawOwned {
    /// A drained sample kept with its stack copy (and `frames`, `flags` as
    /// walked so far) to be walked again.
    fn new(s: &signal::RawSample<'_>, frames: &[u64], flags: u32, copy: signal::StackCopy<'_>) -> RawOwned {
        RawOwned {
            weight_ns: s.weight_ns,
            time_ns: s.time_ns,
            handler_ns: s.handler_ns,
            flags,
            frames: frames.to_vec(),
            stack: Some((copy.regs, copy.start, copy.words.to_vec(), copy.splice)),
        }
    }
}

/// An agent-side walk flag: the sample came with a stack copy (the handler
/// met unknown code and copied the stack), whatever its walk again found.
const COPIED: u32 = 1 << 31;

/// One sample's time in the handler, and what might have made it long.
#[derive(Debug, Clone, Copy)]
struct HandlerTime {
    ns: u64,
    /// The handler met unknown code and copied the stack.
    copied: bool,
    /// Taken after the first second of sampling.
    settled: bool,
}

impl HandlerTime {
    /// What sets the handler's p99: the median and p99 of all samples and
    /// of those after the first second, and what the slowest 1% were.
    fn describe(times: &[HandlerTime]) -> String {
        let all = HandlerTime::sorted(times.iter());
        let settled = HandlerTime::sorted(times.iter().filter(|t| t.settled));
        let p99 = percentile(&all, 99);
        let slow: Vec<&HandlerTime> = times.iter().filter(|t| t.ns >= p99).collect();
        let copied = HandlerTime::sorted(times.iter().filter(|t| t.copied));
        format!(
            "handler over the last {} samples: median {} ns, p99 {p99} ns; after the first second ({}): median {} ns, \
             p99 {} ns; of the {} at or over the p99, {} met unknown code and copied the stack, {} in the first second; \
             the {} that copied: median {} ns",
            times.len(),
            percentile(&all, 50),
            settled.len(),
            percentile(&settled, 50),
            percentile(&settled, 99),
            slow.len(),
            slow.iter().filter(|t| t.copied).count(),
            slow.iter().filter(|t| !t.settled).count(),
            copied.len(),
            percentile(&copied, 50),
        )
    }

    /// The times of `times`, sorted.
    fn sorted<'a>(times: impl Iterator<Item = &'a HandlerTime>) -> Vec<u64> {
        let mut ns: Vec<u64> = times.map(|t| t.ns).collect();
        ns.sort_unstable();
        ns
    }
}

/// The `p`th percentile of `sorted` (0 when empty).
fn percentile(sorted: &[u64], p: usize) -> u64 {
    sorted.get(sorted.len().saturating_sub(1) * p / 100).copied().unwrap_or(0)
}

/// A `signal::StackCopy` taken out of its ring: registers, words, splice.
type OwnedStackCopy = (corsnap_unwind::Regs, u64, Vec<u64>, Option<(usize, u64)>);

/// A thread being sampled.
#[derive(Debug)]
struct Sampled {
    slot: SlotId,
    /// The runtime's object for this thread, as its handler was last told.
    runtime_thread: u64,
    /// Its context switches when last looked at, and when (`--cpu-clock
    /// auto`); whether its clock has been chosen once.
    switches: Option<(u64, Instant)>,
    clock_chosen: bool,
}

pub struct SignalEngine {
    shared: Arc<Shared>,
    sampler: Option<SignalSampler>,
    interval_ns: u64,
    enabled: bool,
    threads: HashMap<u32, Sampled>,
    /// Native frame keys without a symbol (`libcoreclr.so+0x…`).
    anonymous: HashSet<u64>,
    /// Native frame keys of libc's thread start.
    thread_start: HashSet<u64>,
    /// Native frame keys of the collector's functions, by their symbols.
    collector: HashSet<u64>,
    /// Per thread: whether the runtime named it as a GC thread, and how
    /// many times that was asked.
    gc_threads: HashMap<u32, (bool, u32)>,
    /// Threads that could not be given a timer (gone before it was made).
    refused: HashSet<u32>,
    own_tids: HashSet<u32>,
    next_scan: Instant,
    /// `--cpu-clock auto`: each thread's clock follows how often it blocks.
    clock_per_thread: bool,
    next_clock_check: Instant,
    clock_switches: u64,
    loader_counters: (u64, u64),
    natives: Vec<NativeModule>,
    native_modules: SharedNativeModules,
    managed: Vec<ManagedCode>,
    stacks: Vec<std::ops::Range<u64>>,
    map: Arc<CodeMap>,
    map_dirty: bool,
    sigreturn: u64,
    /// The runtime's hijack trampoline, once found.
    hijack_stub: Option<HijackStub>,
    /// The native modules changed since the map was last built.
    natives_changed: bool,
    learner: CodeLearner,
    symbols: Symbolizer,
    /// Address (as looked up) to frame id.
    frame_ids: HashMap<u64, u64>,
    /// Raw stacks seen before, resolved.
    /// Raw stacks seen before, resolved: frame ids and IL offsets.
    stack_ids: HashMap<Vec<u64>, (Vec<u64>, Vec<u32>)>,
    il_offsets: crate::il_offsets::IlOffsets,
    /// Frame ids whose names the CLI has not been sent yet.
    pending_names: Vec<FrameName>,
    named: HashSet<u64>,
    /// Addresses in no known code that the runtime does not manage either.
    not_managed: HashSet<u64>,
    mono_epoch_ns: u64,
    /// `CORSNAP_DEBUG_WALKS`: log every 50th raw walk with what each
    /// address is (every walk when set to `all`).
    debug_walks: bool,
    debug_every_walk: bool,
    scratch: Vec<u64>,
    /// The handler's time of the last 4096 samples, and what they were.
    handler_times: Vec<HandlerTime>,
    handler_next: usize,
    /// Samples of threads that exited, drained before their slots went.
    leftovers: Vec<Sample>,
    rewalk_cache: corsnap_unwind::WalkCache,
    /// Samples taken on request (walk verification), kept apart.
    requested: Vec<Sample>,
    /// Walks again of samples from their stack copy (a sample may take
    /// several rounds).
    pub rewalked: u64,
    /// Samples whose walk the handler left to the agent.
    pub deferred_walks: u64,
    /// Of those, walks that ended at their thread's start.
    deferred_at_root: u64,
    /// The agent's time in those walks.
    deferred_walking: Duration,
    /// The agent's time draining its rings (those walks included).
    draining: Duration,
    /// Samples that came with a stack copy.
    stack_copies: u64,
    /// Samples that met code not known yet, with no room for their copy.
    stack_copies_refused: u64,
    /// Bodies learned as the runtime finished compiling them, and the time
    /// that took.
    learned_at_compile: u64,
    learning_at_compile: Duration,
    rewalked_before_collect: u64,
    /// CoreLib's image, in the map without its body rules until the first
    /// map is out; compiled then, and put in its place.
    image_without_rules: Option<ManagedCode>,
    started: Instant,
    /// `CLOCK_MONOTONIC` (the samples' clock) one second after the engine
    /// started: learning should be over by then (issue 15: after the first
    /// second, at most 5% of samples meet code not learned yet).
    settled_ns: u64,
    pub samples: u64,
    pub incomplete: u64,
    pub unknown_code: u64,
    samples_after_first_second: u64,
    unknown_code_after_first_second: u64,
    pub truncated: u64,
    resets: u64,
}

impl std::fmt::Debug for SignalEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SignalEngine({} threads)", self.threads.len())
    }
}

impl SignalEngine {
    /// Installs the handler and arms timers on every thread. `Err` says why
    /// the engine cannot run here (the caller falls back to `suspend`).
    pub fn start(
        shared: Arc<Shared>,
        rate_hz: u32,
        native_modules: SharedNativeModules,
    ) -> Result<SignalEngine, String> {
        // Before anything is installed: without a layout it can trust, the
        // engine could only produce wrong stacks.
        let version = crate::runtime_version(&shared.info);
        let layout = RuntimeLayout::detect(&version)?;
        log::write(format_args!(
            "runtime {version}: code headers {:?}, code map {} (from {})",
            layout.header,
            match &layout.code_map {
                Some(m) => format!("by the runtime's nibble map v{}", m.nibble_version),
                None => "by a verified scan".to_string(),
            },
            layout.source
        ));
        let clock_per_thread = shared.cpu_clock == CpuClock::Auto;
        let sampler = SignalSampler::install(shared.cpu_clock != CpuClock::Timer).map_err(|e| match e {
            signal::InstallError::SignalInUse => {
                "the program has its own SIGPROF handler, which corsnap will not replace".to_string()
            }
            signal::InstallError::Os(e) => format!("cannot install the sampling signal handler: {e}"),
        })?;
        let mono_epoch_ns = signal::monotonic_ns().saturating_sub(shared.now_ns());
        let symbols = Symbolizer::with_search_dirs(&shared.symbol_dirs);
        let learner = CodeLearner::new(shared.info, layout);
        let mut engine = SignalEngine {
            shared,
            sampler: Some(sampler),
            interval_ns: interval_ns(rate_hz.max(1)),
            enabled: rate_hz > 0,
            threads: HashMap::new(),
            anonymous: HashSet::new(),
            thread_start: HashSet::new(),
            collector: HashSet::new(),
            gc_threads: HashMap::new(),
            refused: HashSet::new(),
            own_tids: HashSet::new(),
            next_scan: Instant::now(),
            clock_per_thread,
            next_clock_check: Instant::now() + CLOCK_FIRST_CHOICE_AFTER,
            clock_switches: 0,
            loader_counters: (u64::MAX, u64::MAX),
            natives: Vec::new(),
            native_modules,
            managed: Vec::new(),
            stacks: Vec::new(),
            map: Arc::new(CodeMap::default()),
            map_dirty: true,
            sigreturn: SignalSampler::sigreturn_trampoline(),
            hijack_stub: None,
            natives_changed: true,
            learner,
            symbols,
            frame_ids: HashMap::new(),
            stack_ids: HashMap::new(),
            il_offsets: crate::il_offsets::IlOffsets::new(),
            pending_names: Vec::new(),
            named: HashSet::new(),
            not_managed: HashSet::new(),
            mono_epoch_ns,
            debug_walks: std::env::var_os("CORSNAP_DEBUG_WALKS").is_some(),
            debug_every_walk: std::env::var_os("CORSNAP_DEBUG_WALKS").is_some_and(|v| v == "all"),
            scratch: Vec::with_capacity(signal::MAX_FRAMES),
            handler_times: Vec::with_capacity(4096),
            handler_next: 0,
            leftovers: Vec::new(),
            rewalk_cache: corsnap_unwind::WalkCache::new(),
            requested: Vec::new(),
            rewalked: 0,
            stack_copies: 0,
            deferred_walks: 0,
            deferred_at_root: 0,
            deferred_walking: Duration::ZERO,
            draining: Duration::ZERO,
            stack_copies_refused: 0,
            learned_at_compile: 0,
            learning_at_compile: Duration::ZERO,
            rewalked_before_collect: 0,
            image_without_rules: None,
            started: Instant::now(),
            settled_ns: signal::monotonic_ns() + 1_000_000_000,
            samples: 0,
            incomplete: 0,
            unknown_code: 0,
            samples_after_first_second: 0,
            unknown_code_after_first_second: 0,
            truncated: 0,
            resets: 0,
        };
        engine.own_tids.insert(corsnap_abi::current_os_tid());
        engine.refresh_modules();
        // CoreLib's precompiled code is under nearly every stack, and first
        // met under the deepest ones (the JIT at start-up), deeper than a
        // stack copy reaches: learned now, it is never met unknown.
        // Its body rules are compiled after the first map is out (see
        // `collect`): they take 10 to 20 ms, which sampling need not wait.
        if let Some(corelib) = crate::code_learning::corelib_image() {
            engine.learner.images_learned += 1;
            engine.add_managed(corelib.clone());
            engine.image_without_rules = Some(corelib);
        }
        engine.scan_threads();
        if let Some(s) = &engine.sampler {
            s.set_copy_first(std::env::var_os("CORSNAP_WALK_IN_HANDLER").is_none());
            s.set_enabled(engine.enabled);
        }
        // With sampling on: the tables every sample's root names need, read
        // while the program starts rather than once its threads are busy.
        engine.symbols.preload_roots(engine.natives.iter().map(|m| m.name.as_str()));
        log::write(format_args!(
            "signal engine: {} native modules, {} threads, signal trampoline {}",
            engine.natives.len(),
            engine.threads.len(),
            if engine.sigreturn != 0 { "known" } else { "unknown" }
        ));
        Ok(engine)
    }

    /// Sampling rate in Hz; 0 pauses.
    pub fn set_rate(&mut self, hz: u32) {
        self.enabled = hz > 0;
        if let Some(s) = &self.sampler {
            if hz > 0 {
                self.interval_ns = interval_ns(hz);
                s.set_interval(self.interval_ns);
            }
            s.set_enabled(self.enabled);
        }
    }

    /// Looks for threads now (the runtime announced one).
    pub fn thread_announced(&mut self) {
        self.next_scan = Instant::now();
    }

    /// One round on the agent's thread: threads, modules, map, and the
    /// samples taken since the last round.
    /// Whether the engine is in its first second, when it knows no managed
    /// code yet, or the last round met code it had to learn: more samples
    /// with stack copies (which take room in their ring) are likely to follow
    /// while the program compiles, so the next round should come sooner.
    pub fn learning(&self) -> bool {
        self.started.elapsed() < LEARNING_AT_START || self.rewalked != self.rewalked_before_collect
    }

    pub fn collect(&mut self, out: &mut Vec<Sample>) {
        self.rewalked_before_collect = self.rewalked;
        if self.sampler.is_none() {
            out.append(&mut self.leftovers);
            return;
        }
        if Instant::now() >= self.next_scan {
            if !self.sampler.as_ref().is_some_and(|s| s.handler_in_place()) {
                self.handler_replaced();
                return;
            }
            self.refresh_modules();
            self.scan_threads();
        }
        if self.clock_per_thread && Instant::now() >= self.next_clock_check {
            self.choose_clocks();
        }
        self.learn_compiled();
        self.drain(out);
        out.append(&mut self.leftovers);
        if self.map_dirty {
            self.publish();
        } else if let Some(image) = self.image_without_rules.take() {
            let started = Instant::now();
            let image = crate::code_learning::with_image_body_rules(image);
            log::write(format_args!(
                "CoreLib's image: {} functions, {} with a compiled body rule, in {:?}",
                image.functions.len() / 12,
                image.body_rules.iter().filter(|&&w| w != 0).count(),
                started.elapsed()
            ));
            self.add_managed(image);
        }
        if let Some(s) = self.sampler.as_mut() {
            s.reclaim();
        }
    }

    /// The program installed its own `SIGPROF` handler over ours: our
    /// signals would now reach it, so they stop at once (its handler is left
    /// in place), and the user is told.
    fn handler_replaced(&mut self) {
        if let Some(sampler) = self.sampler.take() {
            let mut rest = Vec::new();
            self.drain_all(&sampler, &mut rest);
            self.leftovers.extend(rest);
            let text = "the program installed its own SIGPROF handler; corsnap stopped its CPU sampling so that \
                        handler gets no signals of corsnap's (samples so far are kept)"
                .to_string();
            log::write(format_args!("{text}"));
            self.shared.post(corsnap_wire::Message::Notice { severity: corsnap_wire::Severity::Warning, text });
            if !sampler.abandon(Duration::from_secs(2)) {
                log::write(format_args!("signal handlers still running after 2 s"));
            }
        }
    }

    /// Asks thread `tid` for one sample now (walk verification); the
    /// number of samples its slot had stored before, to wait on.
    pub fn request_sample(&self, tid: u32) -> Option<u64> {
        let sampler = self.sampler.as_ref()?;
        let slot = self.threads.get(&tid)?.slot;
        let before = sampler.requested_samples_of(slot);
        sampler.request_sample(slot).then_some(before)
    }

    /// Samples stored so far for thread `tid` on request (a timer's sample
    /// landing meanwhile is not the one asked for).
    pub fn requested_samples_stored(&self, tid: u32) -> u64 {
        match (self.sampler.as_ref(), self.threads.get(&tid)) {
            (Some(sampler), Some(t)) => sampler.requested_samples_of(t.slot),
            _ => 0,
        }
    }

    /// The samples taken on request since the last call, resolved.
    pub fn take_requested(&mut self) -> Vec<Sample> {
        std::mem::take(&mut self.requested)
    }

    /// Names the CLI has not heard yet.
    pub fn take_names(&mut self) -> Vec<FrameName> {
        std::mem::take(&mut self.pending_names)
    }

    pub fn fill_stats(&mut self, stats: &mut SamplerStats) {
        let mut dropped = 0;
        if let Some(s) = &self.sampler {
            for t in self.threads.values() {
                if let Some(slot) = s.slot(t.slot) {
                    dropped += slot.dropped_full.load(std::sync::atomic::Ordering::Relaxed)
                        + slot.unknown_stack.load(std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        let c = signal::counters();
        stats.engine = 1;
        stats.signal_samples = self.samples;
        stats.signal_dropped = dropped + c.not_ready + c.no_slot;
        stats.incomplete_stacks = self.incomplete;
        stats.unknown_code_stacks = self.unknown_code;
        stats.samples_after_first_second = self.samples_after_first_second;
        stats.unknown_code_stacks_after_first_second = self.unknown_code_after_first_second;
        stats.stack_copies = self.stack_copies;
        stats.stack_copies_refused = self.stack_copies_refused;
        stats.truncated_stacks = self.truncated;
        stats.threads_sampled = self.threads.len() as u64;
        if let Some(s) = &self.sampler {
            stats.threads_on_timers = s.clocks_in_use().1 as u64;
        }
        stats.clock_switches = self.clock_switches;
        stats.cache_resets += self.resets;
        let times = HandlerTime::sorted(self.handler_times.iter());
        stats.handler_p50_ns = percentile(&times, 50);
        stats.handler_p99_ns = percentile(&times, 99);
    }

    /// Takes the handler out of the process (see `SignalSampler::uninstall`).
    pub fn stop(&mut self) {
        if let Some(sampler) = self.sampler.take() {
            // What the walks of the threads still running cost (see
            // `ThreadSlot::walk_counts`).
            let (mut walks, mut counts) = (0, [0u64; 7]);
            for t in self.threads.values() {
                if let Some(slot) = sampler.slot(t.slot) {
                    walks += slot.samples.load(std::sync::atomic::Ordering::Relaxed);
                    for (sum, c) in counts.iter_mut().zip(&slot.walk_counts) {
                        *sum += c.load(std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            let per_walk = |n: u64| n as f64 / walks.max(1) as f64;
            let (blocks, bytes) = corsnap_abi::hot_memory::in_use();
            log::write(format_args!(
                "memory the walks read: {blocks} blocks, {} KiB, on huge pages {} KiB",
                bytes / 1024,
                corsnap_abi::hot_memory::huge_page_bytes() / 1024
            ));
            log::write(format_args!(
                "signal walks of the threads running at the end: {walks}; leaves stepped by a kept stretch: \
                 {:.0}%, by their native module's granule: {:.0}%; return addresses a walk looked up (in no \
                 table): {:.2}, and took from the process's table: {:.2}; frames a walk stepped by a compiled \
                 body rule: {:.2}; frames a walk stepped one by one: {:.1}, and took from the thread's last \
                 complete walk: {:.1}",
                100.0 * per_walk(counts[0]),
                100.0 * per_walk(counts[6]),
                per_walk(counts[1]),
                per_walk(counts[2]),
                per_walk(counts[3]),
                per_walk(counts[4]),
                per_walk(counts[5])
            ));
            let mut rest = Vec::new();
            self.drain_all(&sampler, &mut rest);
            if !sampler.uninstall(Duration::from_secs(2)) {
                log::write(format_args!("signal handlers still running after 2 s; their buffers are left allocated"));
            }
            let c = signal::counters();
            log::write(format_args!("signal handler at the end: {}", HandlerTime::describe(&self.handler_times)));
            log::write(format_args!(
                "signal engine stopped: {} samples ({} walked by the agent from a copy of the whole stack, in {:?}, of \
                 {:?} draining, {} of them to the thread's start; {} walked again from their stack copy, in {} walks); {} JIT bodies ({} as \
                 they were compiled, in {:?}, {} found by the runtime's code map, {} at the start it gave, {} map answers \
                 refused), {} stubs and {} images learned; {c:?}",
                self.samples,
                self.deferred_walks,
                self.deferred_walking,
                self.draining,
                self.deferred_at_root,
                self.stack_copies,
                self.rewalked,
                self.learner.jit_bodies_learned,
                self.learned_at_compile,
                self.learning_at_compile,
                self.learner.found_by_map,
                self.learner.found_at_start,
                self.learner.map_misses,
                self.learner.stubs_learned,
                self.learner.images_learned
            ));
        }
    }

    fn drain_all(&mut self, sampler: &SignalSampler, out: &mut Vec<Sample>) {
        let started = Instant::now();
        let slots: Vec<(u32, SlotId)> = self.threads.iter().map(|(&tid, t)| (tid, t.slot)).collect();
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut walked = vec![0u64; signal::MAX_FRAMES];
        for (tid, slot) in slots {
            let Some(slot) = sampler.slot(slot) else { continue };
            // What the handler's walks learned, for every thread's walks.
            slot.keep_learned(&self.map);
            // Most samples are walked (copy-first) or resolved straight from
            // the ring; the few whose walk met code not known yet are kept,
            // with their stack copy, to be walked again after the rest.
            let mut again: Vec<RawOwned> = Vec::new();
            slot.drain(&mut scratch, |s| {
                let (frames, flags) = match s.stack {
                    Some(copy) if s.flags & signal::DEFERRED != 0 => {
                        let walk = self.walk_deferred(slot, &copy, &mut walked);
                        let kept = s.flags & (signal::REQUESTED | signal::DEFERRED);
                        let frames = &walked[..walk.len];
                        if walk.flags & flags::UNKNOWN_CODE != 0 {
                            again.push(RawOwned::new(&s, frames, walk.flags | kept, copy));
                            return;
                        }
                        (frames, walk.flags | kept)
                    }
                    Some(copy) => {
                        again.push(RawOwned::new(&s, s.frames, s.flags, copy));
                        return;
                    }
                    None => {
                        // A walk through unknown code always builds a copy;
                        // with none, the ring had no room for it.
                        if s.flags & flags::UNKNOWN_CODE != 0 {
                            self.stack_copies_refused += 1;
                        }
                        (s.frames, s.flags)
                    }
                };
                self.deliver(tid, s.weight_ns, s.time_ns, s.handler_ns, flags, frames, out);
            });
            for mut r in again {
                let kept = r.flags & (signal::REQUESTED | signal::DEFERRED);
                if let Some((regs, start, words, splice)) = r.stack.take() {
                    self.walk_again(&mut r, signal::StackCopy { regs, start, words: &words, splice, from_leaf: true });
                }
                r.flags |= COPIED | kept;
                self.deliver(tid, r.weight_ns, r.time_ns, r.handler_ns, r.flags, &r.frames, out);
            }
        }
        self.scratch = scratch;
        self.draining += started.elapsed();
    }

    /// Walks a sample whose handler copied the stack and left the walk to
    /// us (copy-first), into `walked`; and tells the thread's slot where
    /// the walk found the thread's root, so that its next copies end there.
    fn walk_deferred(
        &mut self,
        slot: &signal::ThreadSlot,
        copy: &signal::StackCopy<'_>,
        walked: &mut [u64],
    ) -> corsnap_unwind::Walk {
        let started = Instant::now();
        let walk = signal::rewalk(&self.map, copy, (&[], 0), &mut self.rewalk_cache, walked);
        self.deferred_walking += started.elapsed();
        self.deferred_walks += 1;
        // A root is learned only from a walk that ended where the unwind
        // information says the thread starts, through no guess and no
        // signal frame (another stack). A walk that ended complete anywhere
        // else (a runtime stub's return address guessed from a word that
        // pointed into code, a zero return address) once set copies' end
        // in the middle of a thread's stack, and walks of the copies that
        // followed were lost before their managed frames.
        let at_root = flags::COMPLETE | flags::END_OF_STACK;
        let guessed = flags::UNKNOWN_CODE | flags::SIGNAL_FRAME;
        if walk.flags & (at_root | guessed) == at_root {
            self.deferred_at_root += 1;
            slot.note_stack_root(walk.sp);
        } else if walk.flags & flags::COMPLETE == 0 {
            slot.forget_stack_root();
            if self.debug_walks {
                log::write(format_args!(
                    "deferred walk not complete: flags {:#x}, {} frames, regs {:x?}, copy of {} words from {:#x}",
                    walk.flags,
                    walk.len,
                    copy.regs,
                    copy.words.len(),
                    copy.start
                ));
            }
        }
        walk
    }

    /// A walked sample into the profile, or among the samples asked for by
    /// walk verification (not part of the profile).
    #[allow(clippy::too_many_arguments)]
    fn deliver(
        &mut self,
        tid: u32,
        weight_ns: u64,
        time_ns: u64,
        handler_ns: u64,
        flags: u32,
        frames: &[u64],
        out: &mut Vec<Sample>,
    ) {
        let requested = flags & signal::REQUESTED != 0;
        let weight_ns = if requested { 0 } else { weight_ns };
        if let Some(sample) = self.resolve(tid, weight_ns, time_ns, handler_ns, flags, frames) {
            if requested {
                self.samples -= 1;
                self.requested.push(sample);
            } else {
                out.push(sample);
            }
        }
    }

    /// Learns what the runtime compiled since the last round, between two
    /// drains, and gives the handlers a map with it.
    pub fn learn_compiled_now(&mut self) {
        if self.sampler.is_none() {
            return;
        }
        self.learn_compiled();
        if self.map_dirty {
            self.publish();
        }
    }

    /// Learns the code of the functions the runtime compiled since the last
    /// round, before a sample lands in it: a sample in a body not learned
    /// yet needs a stack copy and a second walk.
    fn learn_compiled(&mut self) {
        let compiled = std::mem::take(&mut *self.shared.jitted.lock().unwrap_or_else(|p| p.into_inner()));
        if compiled.is_empty() && !self.learner.waiting_for_code() {
            return;
        }
        let started = Instant::now();
        let (map, managed) = (&self.map, &self.managed);
        let learned = self.learner.learn_compiled(&compiled, |a| knows_code(map, managed, a));
        for code in learned {
            self.add_managed(code);
            self.learned_at_compile += 1;
        }
        self.learning_at_compile += started.elapsed();
    }

    /// A sample whose walk met code not known yet: learn that code, and walk
    /// the sample's copy of its stack again with what was learned, until
    /// nothing new turns up.
    fn walk_again(&mut self, raw: &mut RawOwned, copy: signal::StackCopy<'_>) {
        // The walk stepped over code the handler's map did not know; it may
        // be known by now (learned from an earlier sample), or be learned
        // from this one's addresses.
        let original = (raw.frames.clone(), raw.flags);
        self.stack_copies += 1;
        if self.debug_walks {
            let unknown: Vec<String> = raw
                .frames
                .iter()
                .map(|&f| lookup_address(f))
                .filter(|&a| !self.map.is_code(a))
                .map(|a| format!("{a:#x}{}", if self.not_managed.contains(&a) { "(not managed)" } else { "" }))
                .collect();
            log::write(format_args!(
                "walked again from its copy of {} words (flags {:#x}, {:x?}), drained {} µs after: unknown {}",
                copy.words.len(),
                raw.flags,
                raw.frames,
                signal::monotonic_ns().saturating_sub(raw.time_ns) / 1000,
                unknown.join(" ")
            ));
        }
        for round in 0..8 {
            let mut learned = false;
            for &frame in &raw.frames {
                let addr = lookup_address(frame);
                if knows_code(&self.map, &self.managed, addr) || self.not_managed.contains(&addr) {
                    continue;
                }
                match self.learner.learn(addr) {
                    Learned::Code(code) => {
                        if self.debug_walks {
                            log::write(format_args!(
                                "learned from a copy: {addr:#x} in {} {:#x}..{:#x}",
                                if code.frameless { "stub code" } else { "managed code" },
                                code.code.start,
                                code.code.end
                            ));
                        }
                        self.add_managed(code);
                        learned = true;
                    }
                    Learned::FunctionOnly(_) => {}
                    Learned::NotManaged => {
                        self.not_managed.insert(addr);
                    }
                }
            }
            if round > 0 && !learned {
                break;
            }
            if self.map_dirty || learned {
                self.publish();
            }
            let mut out = vec![0u64; signal::MAX_FRAMES];
            let walk = signal::rewalk(&self.map, &copy, (&original.0, original.1), &mut self.rewalk_cache, &mut out);
            out.truncate(walk.len);
            raw.frames = out;
            raw.flags = walk.flags;
            self.rewalked += 1;
            if self.debug_walks {
                log::write(format_args!(
                    "walk again, round {round}: flags {:#x}, {} frames, splice {:?}",
                    walk.flags, walk.len, copy.splice
                ));
            }
            if walk.flags & flags::UNKNOWN_CODE == 0 {
                break;
            }
        }
    }

    fn drain(&mut self, out: &mut Vec<Sample>) {
        if let Some(sampler) = self.sampler.take() {
            self.drain_all(&sampler, out);
            self.sampler = Some(sampler);
        }
    }

    fn resolve(
        &mut self,
        tid: u32,
        intervals: u64,
        time_ns: u64,
        handler_ns: u64,
        walk_flags: u32,
        raw: &[u64],
    ) -> Option<Sample> {
        if raw.is_empty() {
            return None;
        }
        self.samples += 1;
        let time =
            HandlerTime { ns: handler_ns, copied: walk_flags & COPIED != 0, settled: time_ns >= self.settled_ns };
        if self.handler_times.len() < 4096 {
            self.handler_times.push(time);
        } else {
            self.handler_times[self.handler_next] = time;
            self.handler_next = (self.handler_next + 1) % 4096;
        }
        let unknown_code = walk_flags & flags::UNKNOWN_CODE != 0;
        self.unknown_code += u64::from(unknown_code);
        if time_ns >= self.settled_ns {
            self.samples_after_first_second += 1;
            self.unknown_code_after_first_second += u64::from(unknown_code);
        }
        let truncated = walk_flags & flags::TRUNCATED != 0;
        if truncated {
            self.truncated += 1;
        }
        let mut frames = Vec::with_capacity(raw.len() + 1);
        let mut il_offsets = Vec::with_capacity(raw.len() + 1);
        if self.debug_walks
            && (self.debug_every_walk
                || self.samples.is_multiple_of(50)
                || walk_flags & (flags::UNKNOWN_CODE | flags::LOST | signal::REQUESTED) != 0)
        {
            let desc: Vec<String> = raw
                .iter()
                .map(|&f| {
                    let a = lookup_address(f);
                    let what = if let Some(m) = self.map.managed_at(a) {
                        format!("M{:#x}", m.tag)
                    } else if let Some(n) = self.map.native_at(a) {
                        n.name.rsplit('/').next().unwrap_or("").to_string()
                    } else {
                        "?".into()
                    };
                    format!("{f:#x}({what})")
                })
                .collect();
            let waited_us = signal::monotonic_ns().saturating_sub(time_ns) / 1000;
            log::write(format_args!(
                "walk flags {walk_flags:#x}, thread {tid}, handler {handler_ns} ns, drained {waited_us} µs after: {}",
                desc.join(" ")
            ));
            for &f in raw.iter().take(1) {
                let a = lookup_address(f);
                if self.map.managed_at(a).is_none() && self.map.native_at(a).is_none() {
                    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
                    let line = corsnap_unwind::process::parse_maps(&maps).into_iter().find(|m| m.range.contains(&a));
                    let code = corsnap_abi::process::read_own_bytes(a & !0xf, 48);
                    log::write(format_args!("unknown leaf {a:#x} in {line:?}: {:02x?}", code));
                }
            }
            // Where a managed frame's caller is unknown code: the function's
            // unwind record and code, to see why.
            let lost_tail = (walk_flags & flags::LOST != 0).then(|| [*raw.last().unwrap_or(&0), 1]);
            for pair in raw.windows(2).chain(lost_tail.as_ref().map(|t| &t[..])) {
                let (a, b) = (lookup_address(pair[0]), lookup_address(pair[1]));
                let (Some(m), true) =
                    (self.map.managed_at(a), self.map.managed_at(b).is_none() && self.map.native_at(b).is_none())
                else {
                    continue;
                };
                let Some(f) = m.function_at(a) else { continue };
                let rva = (f.start - m.base) as usize;
                let entry = m
                    .functions
                    .chunks_exact(12)
                    .find(|c| u32::from_le_bytes(c[0..4].try_into().unwrap()) as usize == rva);
                let unwind_rva = entry.map(|c| u32::from_le_bytes(c[8..12].try_into().unwrap()));
                let unwind = match (&m.unwind, unwind_rva) {
                    (corsnap_unwind::UnwindBytes::Copied { rva: first, bytes }, Some(u)) => {
                        bytes.get((u - first) as usize..).map(|b| b[..b.len().min(40)].to_vec())
                    }
                    (_, Some(u)) => corsnap_abi::process::read_own_bytes(m.base + u64::from(u), 40),
                    _ => None,
                };
                let code = corsnap_abi::process::read_own_bytes(f.start, (f.end - f.start).min(4096) as usize);
                log::write(format_args!(
                    "unwound badly: ip {:#x} = fn {:#x}+{:#x} (len {:#x}), exact {}, unwind {:02x?}, code {}",
                    a,
                    f.start,
                    a - f.start,
                    f.end - f.start,
                    pair[0] & corsnap_unwind::EXACT_IP != 0,
                    unwind,
                    code.map(|c| c.iter().map(|b| format!("{b:02x}")).collect::<String>()).unwrap_or_default()
                ));
            }
        }
        // Threads repeat their stacks: a stack seen before is one lookup.
        if let Some((known, offsets)) = self.stack_ids.get(raw) {
            frames.extend_from_slice(known);
            il_offsets.extend_from_slice(offsets);
        } else {
            // The method a catch or finally block belongs to, at the index
            // its frame takes in `frames`.
            let mut funclets = Funclets::default();
            for &frame in raw {
                let address = lookup_address(frame);
                let key = self.frame_id(address);
                // A run of frames in one unnamed place reads as one frame.
                if (key == UNKNOWN_CODE_KEY || crate::code_learning::is_stub_key(key & !NATIVE_FRAME_BIT))
                    && frames.last() == Some(&key)
                {
                    continue;
                }
                funclets.note(&self.map, address, frames.len(), key);
                frames.push(key);
                let managed = key & NATIVE_FRAME_BIT == 0;
                il_offsets.push(if managed {
                    let body = self.body_start(address);
                    self.il_offsets.il_offset(&self.shared.info, key as FunctionID, body, address)
                } else {
                    NO_IL_OFFSET
                });
            }
            funclets.fold(&mut frames, &mut il_offsets);
            if self.stack_ids.len() >= STACK_CACHE_CAP {
                self.stack_ids.clear();
                self.resets += 1;
            }
            self.stack_ids.insert(raw.to_vec(), (frames.clone(), il_offsets.clone()));
        }
        if self.in_gc(tid, time_ns, &frames) {
            let above = self.mark_gc(&mut frames);
            let native_above = frames.len() - (il_offsets.len() - above);
            il_offsets.splice(..above, std::iter::repeat_n(NO_IL_OFFSET, native_above));
        }
        if walk_flags & flags::LOST != 0 {
            self.incomplete += 1;
            self.note_name(FrameName::Native {
                key: INCOMPLETE_KEY,
                name: "[incomplete stack]".into(),
                module: String::new(),
            });
            frames.push(INCOMPLETE_KEY);
            il_offsets.push(NO_IL_OFFSET);
        }
        Some(Sample {
            os_tid: tid,
            time_ns: time_ns.saturating_sub(self.mono_epoch_ns),
            weight: intervals,
            frames,
            il_offsets,
            truncated,
        })
    }

    /// The frame id of the code at `addr` (a lookup address: inside the
    /// instruction or call it stands for).
    fn frame_id(&mut self, addr: u64) -> u64 {
        if let Some(&id) = self.frame_ids.get(&addr) {
            return id;
        }
        if self.frame_ids.len() >= CACHE_CAP {
            self.frame_ids.clear();
            self.stack_ids.clear();
            self.named.clear();
            self.resets += 1;
        }
        let id = self.identify(addr);
        self.frame_ids.insert(addr, id);
        id
    }

    fn identify(&mut self, addr: u64) -> u64 {
        if let Some(region) = self.map.managed_at(addr) {
            let tag = region.tag;
            return self.tagged(tag, addr);
        }
        if let Some(module) = self.map.native_at(addr) {
            let (path, bias) = (module.name.clone(), module.bias);
            let n = self.symbols.name(&path, bias, addr);
            let key = n.key;
            if n.name.contains("+0x") {
                self.anonymous.insert(key);
            } else if n.name.ends_with("!clone3") || n.name.ends_with("!start_thread") || n.name.ends_with("!clone") {
                self.thread_start.insert(key);
            } else if n.name.contains("gc_heap::") || n.name.contains("GCHeap::") {
                // Where the runtime has symbols, the collector's own frames.
                self.collector.insert(key);
            }
            self.note_name(FrameName::Native { key, name: n.name, module: n.module });
            return key;
        }
        if self.not_managed.contains(&addr) {
            return self.unknown_code();
        }
        // Code the map does not know: a method not learned yet, or a stub.
        // Learned earlier in this round, not yet in the published map.
        if let Some(code) = self.managed.iter().rev().find(|m| m.code.contains(&addr)) {
            let tag = code.tag;
            return self.tagged(tag, addr);
        }
        match self.learner.learn(addr) {
            Learned::Code(code) => {
                let tag = code.tag;
                self.add_managed(code);
                self.tagged(tag, addr)
            }
            Learned::FunctionOnly(f) => self.managed(f),
            Learned::NotManaged => {
                if self.not_managed.len() >= CACHE_CAP {
                    self.not_managed.clear();
                }
                self.not_managed.insert(addr);
                self.unknown_code()
            }
        }
    }

    fn managed(&mut self, function: FunctionID) -> u64 {
        self.note_name(FrameName::Managed(function));
        function as u64
    }

    /// Whether a sample of `tid` at `time` (monotonic), with `frames` (leaf
    /// first), was taken in a garbage collection: on the collecting thread
    /// between the runtime's start and end callbacks, on one of the
    /// runtime's GC threads (by its name; native frames only), or in the
    /// collector's code by its symbols where the runtime has them.
    fn in_gc(&mut self, tid: u32, time: u64, frames: &[u64]) -> bool {
        if frames.iter().any(|k| self.collector.contains(k)) {
            return true;
        }
        if frames.iter().any(|&k| k & NATIVE_FRAME_BIT == 0) {
            return self.shared.gc_windows.collecting(tid, time);
        }
        let checks = self.gc_threads.entry(tid).or_insert((false, 0));
        // Read the name again now and then: a thread is named after it starts.
        if !checks.0 && checks.1.is_multiple_of(64) {
            let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default();
            checks.0 = crate::gc_windows::is_gc_thread_name(&comm);
        }
        checks.1 += 1;
        checks.0 || self.shared.gc_windows.collecting(tid, time)
    }

    /// Puts `[garbage collection]` right above the sample's managed frames
    /// (at the root of a GC thread's), in place of the runtime's anonymous
    /// frames above them; frames with names stay, above it. Returns how many
    /// (native) frames it replaced: those before the first managed one.
    fn mark_gc(&mut self, frames: &mut Vec<u64>) -> usize {
        let managed = frames.iter().position(|&k| k & NATIVE_FRAME_BIT == 0);
        let above = managed.unwrap_or(frames.len());
        // A GC thread's own start (libc's `clone3`, `start_thread`) would
        // read as called by the collection: it goes, with the anonymous.
        let thread_start = |k: &u64| managed.is_none() && self.thread_start.contains(k);
        let mut marked: Vec<u64> =
            frames[..above].iter().copied().filter(|k| !self.anonymous.contains(k) && !thread_start(k)).collect();
        marked.push(GC_KEY);
        marked.extend_from_slice(&frames[above..]);
        *frames = marked;
        self.note_name(FrameName::Native { key: GC_KEY, name: "[garbage collection]".into(), module: String::new() });
        above
    }

    /// Where the JIT'd body holding `address` starts, when it is a learned
    /// body (an image's code is one region for all its methods: `None`).
    fn body_start(&self, address: u64) -> Option<u64> {
        let in_map = self.map.managed_at(address).map(|r| (r.tag, r.code.start));
        let (tag, start) = in_map
            .or_else(|| self.managed.iter().rev().find(|m| m.code.contains(&address)).map(|m| (m.tag, m.code.start)))?;
        (tag >= crate::code_learning::TAG_LIMIT).then_some(start)
    }

    /// The frame of an address in a region of the code map, by its tag.
    fn tagged(&mut self, tag: u64, addr: u64) -> u64 {
        match tag {
            // An image: ask the runtime which method (once per address).
            0 => match self.shared.info.get_function_from_ip(addr as usize) {
                Ok(f) => self.managed(f),
                Err(_) => self.unknown_code(),
            },
            STUB_TAG => self.stub(STUB_KEY, "[runtime stub]"),
            t if t < crate::code_learning::TAG_LIMIT => {
                let (key, name) = crate::code_learning::stub_name(t);
                self.stub(NATIVE_FRAME_BIT | key, name)
            }
            f => self.managed(f as FunctionID),
        }
    }

    fn stub(&mut self, key: u64, name: &str) -> u64 {
        self.note_name(FrameName::Native { key, name: name.into(), module: String::new() });
        key
    }

    fn unknown_code(&mut self) -> u64 {
        self.note_name(FrameName::Native {
            key: UNKNOWN_CODE_KEY,
            name: "[unknown code]".into(),
            module: String::new(),
        });
        UNKNOWN_CODE_KEY
    }

    fn note_name(&mut self, name: FrameName) {
        let key = match &name {
            FrameName::Managed(f) => *f as u64,
            FrameName::Native { key, .. } => *key,
        };
        if self.named.insert(key) {
            self.pending_names.push(name);
        }
    }

    fn add_managed(&mut self, code: ManagedCode) {
        // A newer body at the same place replaces the old one.
        self.managed.retain(|m| m.code.end <= code.code.start || m.code.start >= code.code.end);
        self.managed.push(code);
        self.map_dirty = true;
        // Addresses cached as unknown may be in it now, and the stacks made
        // of them (a body learned as it was compiled usually changes none).
        let cached = self.frame_ids.len();
        self.frame_ids.retain(|_, id| *id != UNKNOWN_CODE_KEY);
        if self.frame_ids.len() != cached {
            self.stack_ids.clear();
        }
    }

    /// Rebuilds the native part of the map if the loader's set changed.
    fn refresh_modules(&mut self) {
        let (objects, counters) = corsnap_abi::process::loaded_objects();
        if counters == self.loader_counters {
            return;
        }
        self.loader_counters = counters;
        let started = Instant::now();
        let mut native_modules = self.native_modules.lock().unwrap_or_else(|p| p.into_inner());
        if self.hijack_stub.is_none() {
            self.hijack_stub = native_modules.hijack_stub(&objects);
        }
        let natives = native_modules.modules_of(&objects, crate::native_modules::Tables::All);
        drop(native_modules);
        log::write(format_args!(
            "native modules: {} (read in {:?}; row tables {} KiB)",
            natives.len(),
            started.elapsed(),
            natives.iter().map(corsnap_unwind::NativeModule::table_bytes).sum::<usize>() / 1024
        ));
        self.natives = natives;
        self.natives_changed = true;
        self.map_dirty = true;
    }

    /// New threads get a timer (after the map knows their stacks); exited
    /// ones are drained and dropped.
    fn scan_threads(&mut self) {
        self.next_scan = Instant::now() + THREAD_SCAN_EVERY;
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return };
        let live: HashSet<u32> = dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()).collect();
        let gone: Vec<u32> = self.threads.keys().filter(|t| !live.contains(t)).copied().collect();
        if !gone.is_empty() {
            let mut out = Vec::new();
            self.drain(&mut out);
            // Samples of threads that exited since the last drain are still
            // wanted; they go out with the next round.
            self.leftovers.extend(out);
            if let Some(sampler) = self.sampler.as_mut() {
                for tid in gone {
                    if let Some(t) = self.threads.remove(&tid) {
                        sampler.remove_exited_thread(t.slot);
                    }
                }
            }
        }
        self.refused.retain(|t| live.contains(t));
        let new: Vec<u32> = live
            .iter()
            .filter(|t| !self.threads.contains_key(t) && !self.own_tids.contains(t) && !self.refused.contains(t))
            .copied()
            .collect();
        if new.is_empty() {
            self.update_runtime_threads();
            return;
        }
        // Their stacks must be in the map before a signal can arrive.
        self.refresh_stacks();
        self.publish();
        // The hijack fields' offset is found from the threads' stacks, now
        // in the map: before the new threads' first samples, which a
        // collection under way may find hijacked.
        let by_tid = self.update_runtime_threads();
        let Some(sampler) = self.sampler.as_mut() else { return };
        for tid in new {
            if is_agent_thread(tid) {
                self.own_tids.insert(tid);
                continue;
            }
            // Its runtime thread object (where a hijacked return address is
            // kept) goes in with its slot, before its first sample: set at
            // the next round, as it was, a thread hijacked by a collection
            // in between lost its callers (gcstop.cs on .NET Core 3.1, with
            // the agent's thread slow to come round on a crowded machine).
            let runtime_thread = by_tid.get(&tid).copied().unwrap_or(0) as u64;
            match sampler.add_thread(tid, self.interval_ns, runtime_thread) {
                Ok(slot) => {
                    // The first look at its switches is its baseline, so its
                    // clock can be chosen at the next check.
                    let switches =
                        if self.clock_per_thread { context_switches(tid).map(|c| (c, Instant::now())) } else { None };
                    self.threads.insert(tid, Sampled { slot, runtime_thread, switches, clock_chosen: false });
                }
                Err(_) => {
                    self.refused.insert(tid);
                }
            }
        }
    }

    /// `--cpu-clock auto`: a perf event costs its thread about 2 µs at
    /// every context switch (the kernel schedules the event out and in and
    /// reprograms its timer), a POSIX CPU timer nothing until it fires. So a
    /// thread that switches often moves to a timer, and one that runs long
    /// stretches keeps its perf event (exact, and not bound to the
    /// scheduler tick). Under ASP.NET Core on two cores, the socket thread
    /// blocks ~20,000 times a second and wakes the thread-pool workers, which
    /// it preempts ~20,000 times a second each: both kinds of switch count.
    /// A busy thread on a crowded machine is preempted only at the end of
    /// its time slice (a few milliseconds), well under the line, and keeps
    /// its exact clock. Hysteresis keeps a thread near the line from
    /// flapping.
    fn choose_clocks(&mut self) {
        let now = Instant::now();
        self.next_clock_check = now + CLOCK_FIRST_CHOICE_AFTER;
        let Some(sampler) = self.sampler.as_mut() else { return };
        for (&tid, sampled) in self.threads.iter_mut() {
            // A new thread's clock is chosen soon (until then it may pay for
            // a perf event at every switch), then looked at again each
            // CLOCK_CHECK_EVERY.
            let wait = if sampled.clock_chosen { CLOCK_CHECK_EVERY } else { CLOCK_FIRST_CHOICE_AFTER };
            if sampled.switches.is_some_and(|(_, at)| now.duration_since(at) < wait) {
                continue;
            }
            let Some(count) = context_switches(tid) else { continue };
            let Some((before, at)) = sampled.switches.replace((count, now)) else { continue };
            sampled.clock_chosen = true;
            let secs = now.duration_since(at).as_secs_f64();
            let per_second = count.saturating_sub(before) as f64 / secs;
            let timer = if per_second >= TIMER_ABOVE_SWITCHES_PER_S {
                true
            } else if per_second < PERF_BELOW_SWITCHES_PER_S {
                false
            } else {
                continue;
            };
            match sampler.set_thread_clock(sampled.slot, timer) {
                Ok(true) => {
                    self.clock_switches += 1;
                    let name = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default();
                    log::write(format_args!(
                        "clock: thread {tid} ({}) switches {per_second:.0} times a second: now sampled by {}",
                        name.trim_end(),
                        if timer { "a CPU timer" } else { "its perf event" }
                    ));
                }
                Ok(false) => {}
                Err(e) => log::write(format_args!("thread {tid}: could not change its clock: {e}")),
            }
        }
    }

    /// Tells each thread's handler which runtime thread object is its own
    /// (a hijacked return address is kept there), and finds where in that
    /// object it is kept, once.
    /// Returns the runtime's threads by OS tid, as read for it.
    fn update_runtime_threads(&mut self) -> HashMap<u32, corsnap_abi::ThreadID> {
        let by_tid = self.shared.threads.by_os_tid();
        let Some(sampler) = self.sampler.as_ref() else { return by_tid };
        for (tid, sampled) in self.threads.iter_mut() {
            let thread = by_tid.get(tid).copied().unwrap_or(0) as u64;
            if thread != sampled.runtime_thread {
                sampled.runtime_thread = thread;
                sampler.set_runtime_thread(sampled.slot, thread);
                if self.debug_walks {
                    log::write(format_args!("thread {tid}: runtime thread {thread:#x}"));
                }
            }
        }
        if signal::hijack_fields_offset() == 0 {
            let objects: Vec<Vec<u64>> = by_tid
                .values()
                .filter_map(|&t| corsnap_abi::process::read_own_bytes(t as u64, THREAD_OBJECT_SCAN))
                .map(|bytes| {
                    bytes.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().unwrap_or([0; 8]))).collect()
                })
                .collect();
            if let Some(offset) = hijack_fields_offset(&objects, &self.stacks) {
                log::write(format_args!("hijacked return addresses: at offset {offset:#x} of the thread object"));
                signal::set_hijack_fields_offset(offset);
            }
        }
        by_tid
    }

    fn refresh_stacks(&mut self) {
        if let Ok(text) = std::fs::read_to_string("/proc/self/maps") {
            self.stacks = stack_ranges(&parse_maps(&text));
            self.map_dirty = true;
        }
    }

    fn publish(&mut self) {
        // Read at every sample (see `hot_memory`).
        let map = corsnap_abi::hot_memory::allocate_hot(|| {
            Arc::new(if self.natives_changed {
                self.natives_changed = false;
                CodeMap::new(self.natives.clone(), self.managed.clone(), self.stacks.clone(), self.sigreturn)
                    .with_hijack_stub(self.hijack_stub.clone())
            } else {
                self.map.with_same_natives(self.managed.clone(), self.stacks.clone())
            })
        });
        self.managed = map.managed().to_vec();
        self.map = map;
        // While draining, the sampler is out of its place: the handler gets
        // the map at the end of the round.
        match self.sampler.as_mut() {
            Some(s) => {
                s.publish(self.map.clone());
                self.map_dirty = false;
            }
            None => self.map_dirty = true,
        }
    }
}

fn interval_ns(hz: u32) -> u64 {
    1_000_000_000 / u64::from(hz.clamp(1, crate::MAX_RATE_HZ))
}

/// The agent's own threads are named `corsnap-…`.
fn is_agent_thread(tid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).is_ok_and(|n| n.starts_with("corsnap-"))
}

/// What a managed frame's address says of a funclet (a catch, filter or
/// finally block) there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FuncletKind {
    /// In a JIT'd method's funclet: a function-table entry of its body
    /// other than the first, which is the method's own code.
    Funclet,
    /// In a ReadyToRun image, whose table lists bodies and funclets alike
    /// (only the runtime knows which entry begins a method): the image's
    /// start and the entry's, for [`image_funclets`].
    ImageEntry {
        region: u64,
        entry: u64,
    },
    No,
}

fn funclet_kind(map: &CodeMap, address: u64) -> FuncletKind {
    let Some(region) = map.managed_at(address) else { return FuncletKind::No };
    let Some(function) = region.function_at(address) else { return FuncletKind::No };
    match region.tag {
        0 => FuncletKind::ImageEntry { region: region.code.start, entry: function.start },
        t if t >= crate::code_learning::TAG_LIMIT && function.start != region.code.start => FuncletKind::Funclet,
        _ => FuncletKind::No,
    }
}

/// The funclets of a stack being named, frame by frame.
#[derive(Debug, Default)]
pub(crate) struct Funclets {
    /// (index in the named frames, the method's frame key).
    found: Vec<(usize, u64)>,
    /// Frames in ReadyToRun images, for [`image_funclets`].
    image_entries: Vec<(usize, u64, u64)>,
}

impl Funclets {
    /// Notes the frame of `address`, whose key `key` is about to take
    /// index `at` among the named frames.
    pub(crate) fn note(&mut self, map: &CodeMap, address: u64, at: usize, key: u64) {
        match funclet_kind(map, address) {
            FuncletKind::Funclet => self.found.push((at, key)),
            // Only a named method: unknown code has one key for all.
            FuncletKind::ImageEntry { region, entry } if key & NATIVE_FRAME_BIT == 0 => {
                self.image_entries.push((at, region, entry))
            }
            FuncletKind::ImageEntry { .. } | FuncletKind::No => {}
        }
    }

    /// Folds each funclet into its method (see [`fold_funclets`]).
    pub(crate) fn fold(mut self, frames: &mut Vec<u64>, il_offsets: &mut Vec<u32>) {
        image_funclets(frames, &self.image_entries, &mut self.found);
        fold_funclets(frames, il_offsets, &self.found);
    }
}

/// The funclets among a stack's frames in ReadyToRun images
/// (`entries`: index in `frames`, image, function-table entry), added to
/// `funclets` in order. A funclet's frame always lies above a frame of its
/// own method in the same code (the body that called it, as a `finally`
/// on the way out of a `try` is called, or whose exception it handles),
/// and the JIT lays a method's funclets out after its body, so their
/// entries come later in the table: a frame whose method's next frame down
/// is in the same image but an earlier entry is in a funclet. (A recursive
/// call from a body is in the same entry as its caller; one from a funclet
/// is in an earlier entry than the funclet.) Without this, Kestrel's
/// `TryParseRequest`, whose `finally` calls `AdvanceTo`, showed twice
/// where `DoStackSnapshot` shows it once.
fn image_funclets(frames: &[u64], entries: &[(usize, u64, u64)], funclets: &mut Vec<(usize, u64)>) {
    let mut found = false;
    for (n, &(at, region, entry)) in entries.iter().enumerate() {
        let Some(&method) = frames.get(at) else { continue };
        let Some(down) = frames[at + 1..].iter().position(|&k| k == method).map(|i| at + 1 + i) else { continue };
        let below = entries[n + 1..].iter().find(|e| e.0 == down);
        if below.is_some_and(|&(_, r, e)| r == region && e < entry) {
            funclets.push((at, method));
            found = true;
        }
    }
    if found {
        funclets.sort_unstable();
    }
}

/// A funclet (catch, filter, finally) runs on top of the frames of the
/// exception it handles: the throw, the runtime's dispatch, then, further
/// down, the frame of the method it belongs to. `DoStackSnapshot` (and the
/// program's own idea of where it is) shows it as that method, under that
/// method's caller: so the frames between a funclet and its method's own
/// frame, and that frame, go. A funclet whose method's frame is not found
/// keeps its stack as it is. `funclets`: (index in `frames`, leaf first; the
/// method's frame key), in order.
/// `il_offsets`, one per frame, lose the same frames.
fn fold_funclets(frames: &mut Vec<u64>, il_offsets: &mut Vec<u32>, funclets: &[(usize, u64)]) {
    // From the root end, so earlier indices stay valid.
    for &(at, method) in funclets.iter().rev() {
        if at >= frames.len() || frames[at] != method {
            continue;
        }
        if let Some(parent) = frames[at + 1..].iter().position(|&k| k == method) {
            frames.drain(at + 1..=at + 1 + parent);
            if il_offsets.len() > at + 1 + parent {
                il_offsets.drain(at + 1..=at + 1 + parent);
            }
        }
    }
}

#[cfg(test)]
mod funclet_tests {
    use super::fold_funclets;

    #[test]
    fn a_catch_block_shows_as_its_method_under_that_methods_caller() {
        // Leaf first: catch block of Parse (10), the runtime's dispatch (1, 2),
        // the throw (20, 21), Parse's own frame (10), its caller (30).
        let mut frames = vec![10, 1, 2, 20, 21, 10, 30];
        let mut offsets = vec![7, 0, 0, 1, 2, 3, 4];
        fold_funclets(&mut frames, &mut offsets, &[(0, 10)]);
        assert_eq!(frames, [10, 30]);
        assert_eq!(offsets, [7, 4], "the catch block's IL offset, its caller's");
        // Its method's frame not among them: left as it is.
        let mut frames = vec![10, 1, 2, 20];
        fold_funclets(&mut frames, &mut Vec::new(), &[(0, 10)]);
        assert_eq!(frames, [10, 1, 2, 20]);
        // Nested: a finally inside a catch, each folded.
        let mut frames = vec![40, 1, 41, 40, 10, 2, 10, 30];
        fold_funclets(&mut frames, &mut Vec::new(), &[(0, 40), (4, 10)]);
        assert_eq!(frames, [40, 10, 30]);
    }

    #[test]
    fn a_finally_in_a_ready_to_run_image_is_found_by_its_methods_frame_below() {
        use super::image_funclets;
        const IMAGE: u64 = 0x7000_0000;
        // Leaf first: AdvanceTo (20), called from TryParseRequest's finally
        // (10, entry 0x900), called from its body (10, entry 0x800), then
        // its caller (30).
        let frames = [20, 10, 10, 30];
        let entries = [(0, IMAGE, 0x100), (1, IMAGE, 0x900), (2, IMAGE, 0x800), (3, IMAGE, 0x200)];
        let mut funclets = Vec::new();
        image_funclets(&frames, &entries, &mut funclets);
        assert_eq!(funclets, [(1, 10)]);
        let mut frames = frames.to_vec();
        fold_funclets(&mut frames, &mut Vec::new(), &funclets);
        assert_eq!(frames, [20, 10, 30], "shown once, under its caller");
        // A recursion from the body: the same entry, two frames.
        let mut funclets = Vec::new();
        image_funclets(&[10, 10, 30], &[(0, IMAGE, 0x800), (1, IMAGE, 0x800), (2, IMAGE, 0x200)], &mut funclets);
        assert!(funclets.is_empty());
        // A recursion from a funclet: the inner body's frame is in an
        // earlier entry than the funclet below it, and stays.
        let mut funclets = Vec::new();
        image_funclets(
            &[10, 10, 10, 30],
            &[(0, IMAGE, 0x800), (1, IMAGE, 0x900), (2, IMAGE, 0x800), (3, IMAGE, 0x200)],
            &mut funclets,
        );
        assert_eq!(funclets, [(1, 10)]);
        // The same method in another image, or in JIT'd code: not paired.
        let mut funclets = Vec::new();
        image_funclets(&[10, 10], &[(0, IMAGE, 0x900), (1, IMAGE + 0x10_0000, 0x800)], &mut funclets);
        image_funclets(&[10, 10], &[(0, IMAGE, 0x900)], &mut funclets);
        assert!(funclets.is_empty());
    }
}

/// The thread's context switches so far, voluntary (it blocked) and not
/// (it was preempted), from `/proc/self/task/{tid}/status` (always kept,
/// unlike `schedstat`, which a kernel may build without).
fn context_switches(tid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
    parse_context_switches(&status)
}

fn parse_context_switches(status: &str) -> Option<u64> {
    let count = |key: &str| -> Option<u64> { status.lines().find_map(|l| l.strip_prefix(key))?.trim().parse().ok() };
    Some(count("voluntary_ctxt_switches:")? + count("nonvoluntary_ctxt_switches:")?)
}

#[cfg(test)]
mod clock_tests {
    use super::parse_context_switches;

    #[test]
    fn context_switches_of_both_kinds_are_read_from_the_status_file() {
        let status = "Name:\tdotnet\nvoluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t56\n";
        assert_eq!(parse_context_switches(status), Some(1290));
        assert_eq!(parse_context_switches("Name:\tx\n"), None);
    }
}
