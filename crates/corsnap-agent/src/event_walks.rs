//! The `native` event walker's agent side: event stacks (exceptions,
//! allocation ticks, class loads, collections) walked by corsnap's own
//! unwinder on the thread the event happens on
//! (`corsnap_abi::event_walk::walk_own_stack`), as raw addresses; named here,
//! on the sampler thread, the way the signal engine names CPU samples.
//!
//! This keeps its own code map (native modules and their CFI, the stacks,
//! managed code learned from the addresses walks meet) rather than the
//! signal engine's, because events are recorded with or without CPU
//! sampling and with either CPU engine; it uses the same pieces to build it
//! ([`CodeLearner`], [`Symbolizer`], `corsnap_unwind::process`). A walk that
//! met code the map did not know came with a copy of its stack: that code
//! is learned and the copy walked again (`corsnap_abi::signal::rewalk`), as
//! for signal samples; what stays unknown is shown as such, never guessed.
//!
//! The sampler thread keeps the walker in `Shared::event_walker` (a mutex,
//! held a step at a time) and lends it to two other threads, which learn
//! code compiled since and publish a map with it at once: the thread that
//! compiled a method again, before the runtime installs the code, and a
//! throwing thread whose walk met code not known yet (see
//! `Shared::learn_compiled_now`).
//!
//! Where the walker cannot serve (a runtime whose layout corsnap does not
//! know, a thread whose stack the map does not list yet), the event is
//! walked by `DoStackSnapshot` as before.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use corsnap_abi::event_walk::{EventMap, OwnStackCopy};
use corsnap_abi::process::LoadedObject;
use corsnap_abi::signal::{self, SignalSampler};
use corsnap_abi::{CorProfilerInfo, FunctionID};
use corsnap_unwind::process::{parse_maps, stack_ranges};
use corsnap_unwind::{flags, lookup_address, CodeMap, HijackStub, ManagedCode, NativeModule};
use corsnap_wire::NATIVE_FRAME_BIT;

use crate::code_learning::{knows_code, CodeLearner, Learned, STUB_TAG};
use crate::log;
use crate::native_modules::{SharedNativeModules, Tables};
use crate::runtime_layout::RuntimeLayout;
use crate::signal_engine::{FrameName, Funclets, INCOMPLETE_KEY, UNKNOWN_CODE_KEY};
use crate::symbols::Symbolizer;

/// Entries in the address caches before they are emptied.
const CACHE_CAP: usize = 200_000;
/// The .NET host's libraries, which start the runtime and never run
/// managed code below themselves.
const HOST_MODULES: [&str; 2] = ["/libhostfxr.so", "/libhostpolicy.so"];
/// Rounds of learning and walking again for one stack copy.
const REWALK_ROUNDS: usize = 8;
/// Native frames event walks step one by one before the row tables of the
/// modules event stacks pass through are compiled (see [`tables_wanted`]):
/// about 20 ms of compiling at the 0.3 to 0.4 µs a frame the tables save
/// (measured on `alloc`, .NET 8).
pub(crate) const TABLES_AFTER_NATIVE_FRAMES: u64 = 50_000;
/// The same with allocations recorded (see [`tables_wanted`]).
pub(crate) const ALLOC_TABLES_AFTER_NATIVE_FRAMES: u64 = 5_000;

/// Whether the event walker should have the row tables of the modules
/// event stacks pass through (`Tables::EventStacks`) by now.
///
/// Compiling them costs the agent's thread 15 to 40 ms of CPU (measured with
/// `perf` on `validate` and `alloc`; about 20 ms taken here), in the
/// program's first moments, where on two cores the program's threads want
/// both. What they save is a cheaper step of each native frame a walk makes
/// one by one. Many programs' walks make few: from the dispatch hook (.NET
/// 9 and later) a throw's walk starts in managed code, and repeated stacks
/// are replayed or follow a remembered path. So, as one rents skis until
/// the rent paid would have bought them, the tables are compiled once the
/// walks have stepped as many native frames as the tables' cost would
/// have paid for ([`TABLES_AFTER_NATIVE_FRAMES`]): never costing more than
/// twice the better choice made in hindsight.
///
/// Allocation ticks rent for a shorter while
/// ([`ALLOC_TABLES_AFTER_NATIVE_FRAMES`]): every tick's walk starts in the
/// agent's EventPipe callback, 16 runtime frames above the allocating code
/// (the allocation helper, the GC's allocator and its tick, EventPipe's
/// dispatch), and steps 8 or so of them one by one, up to a thousand walks
/// a second (`ALLOC_STACK_INTERVAL_NS`): the tables will pay for themselves,
/// and a 2 to 4 s run of `alloc` ended before 50,000 frames bought them.
/// 5,000 frames (about half a second of such walks) keeps the compiling
/// out of the program's first moments. Measured on `alloc` (.NET 8, `perf`
/// of the program's thread, 4 kHz): the agent's share 0.93 to 1.10%
/// against 1.60 to 2.18% (six pairs on a slow stretch of the host); with
/// the tables from the first round, 0.37 to 0.69% against 0.56 to 0.74%
/// (eleven pairs on fast stretches). The elapsed time did not tell the
/// three apart (24 interleaved rounds).
///
/// `CORSNAP_TEST_EVENT_TABLES_AFTER=N` (tests only) sets the count: 0 has
/// the tables compiled from the first round, as before, for the walkers'
/// comparison to cover walks by the tables too.
pub(crate) fn tables_wanted(records_alloc: bool) -> bool {
    static AFTER: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    let after =
        AFTER.get_or_init(|| std::env::var("CORSNAP_TEST_EVENT_TABLES_AFTER").ok().and_then(|v| v.parse().ok()));
    corsnap_abi::event_walk::native_frames_stepped() >= tables_after(*after, records_alloc)
}

/// The native frames after which [`tables_wanted`] says yes: the test
/// override, else the count for what is recorded.
fn tables_after(test_override: Option<u64>, records_alloc: bool) -> u64 {
    test_override.unwrap_or(if records_alloc { ALLOC_TABLES_AFTER_NATIVE_FRAMES } else { TABLES_AFTER_NATIVE_FRAMES })
}

#[derive(Debug, Default, Clone, Copy)]
pub struct EventWalkStats {
    /// Stacks named.
    pub resolved: u64,
    /// Walks that met unknown code and were walked again from their copy.
    pub rewalked: u64,
    /// Stack copies taken in, and their words.
    pub copies: u64,
    pub copied_words: u64,
    /// Stacks that still ended in unknown code or were lost.
    pub incomplete: u64,
    /// Maps published.
    pub published: u64,
    /// Bodies learned when the runtime compiled them.
    pub learned_at_compile: u64,
    /// Of those, bodies learned on another thread than the sampler's: the
    /// one that compiled them again, or one whose event met them (see
    /// `Shared::learn_compiled_now`).
    pub learned_off_the_sampler_thread: u64,
    /// Time those threads spent learning, and publishing the maps that
    /// followed, in microseconds.
    pub learning_off_the_sampler_thread_us: u64,
    pub publishing_off_the_sampler_thread_us: u64,
}

pub struct EventWalker {
    info: CorProfilerInfo,
    events_map: Option<EventMap>,
    loader_counters: (u64, u64),
    natives: Vec<NativeModule>,
    native_modules: SharedNativeModules,
    managed: Vec<ManagedCode>,
    stacks: Vec<std::ops::Range<u64>>,
    map: Arc<CodeMap>,
    map_dirty: bool,
    /// The native modules changed since the map was built (else a new map
    /// keeps its native unwinder, and with it every walk cache's rules).
    natives_dirty: bool,
    /// The runtime's hijack trampoline, once found (see
    /// `NativeModules::hijack_stub`).
    hijack_stub: Option<HijackStub>,
    sigreturn: u64,
    learner: CodeLearner,
    symbols: Symbolizer,
    not_managed: HashSet<u64>,
    frame_ids: HashMap<u64, u64>,
    stack_ids: HashMap<Vec<u64>, Vec<u64>>,
    named: HashSet<u64>,
    pending_names: Vec<FrameName>,
    rewalk_cache: corsnap_unwind::WalkCache,
    pub stats: EventWalkStats,
    /// CoreLib's image, in the map without its body rules until the first
    /// map is out; compiled then, and put in its place.
    image_without_rules: Option<ManagedCode>,
    /// Some native module's row table is still to be compiled (the first
    /// map goes out without them).
    tables_pending: bool,
}

impl std::fmt::Debug for EventWalker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventWalker({} managed regions)", self.managed.len())
    }
}

impl EventWalker {
    /// Builds and publishes the map event walks read. `Err` says why the
    /// native walker cannot serve this runtime (events then use
    /// `DoStackSnapshot`).
    /// `compiled`: the functions the runtime compiled before the walker
    /// started, learned before its first map is out.
    pub fn start(
        info: CorProfilerInfo,
        native_modules: SharedNativeModules,
        compiled: &[FunctionID],
    ) -> Result<EventWalker, String> {
        let version = crate::runtime_version(&info);
        let layout = RuntimeLayout::detect(&version)?;
        let events_map = EventMap::install().ok_or("another event walker is installed")?;
        let mut walker = EventWalker {
            info,
            events_map: Some(events_map),
            loader_counters: (u64::MAX, u64::MAX),
            natives: Vec::new(),
            native_modules,
            managed: Vec::new(),
            stacks: Vec::new(),
            map: Arc::new(CodeMap::default()),
            map_dirty: true,
            natives_dirty: true,
            hijack_stub: None,
            sigreturn: SignalSampler::sigreturn_trampoline(),
            learner: CodeLearner::new(info, layout),
            symbols: Symbolizer::default(),
            not_managed: HashSet::new(),
            frame_ids: HashMap::new(),
            stack_ids: HashMap::new(),
            named: HashSet::new(),
            pending_names: Vec::new(),
            rewalk_cache: corsnap_unwind::WalkCache::new(),
            stats: EventWalkStats::default(),
            image_without_rules: None,
            tables_pending: false,
        };
        // The native modules' row tables come after the first map is out
        // too (see `refresh`): compiling them took 20 of the 65 ms from the
        // agent's start to the first map here (50 ms now), and under CI's
        // load the program had thrown 921 of its 6,635 events before that
        // map, each walked by DoStackSnapshot instead.
        walker.refresh_modules(&corsnap_abi::process::loaded_objects(), false);
        // CoreLib's precompiled code is under nearly every stack: learned
        // now, it is never met unknown.
        // Its body rules come after the first map is out (see `refresh`).
        if let Some(corelib) = crate::code_learning::corelib_image() {
            walker.add_managed(corelib.clone());
            walker.image_without_rules = Some(corelib);
        }
        // The program's code compiled before now runs from the first
        // event on: unknown to the first map, every event through it would
        // make a copy of its stack (24 KiB each on `validate`) until a
        // round learned it.
        walker.learn_compiled(compiled);
        walker.refresh_stacks();
        walker.publish();
        log::write(format_args!(
            "event walker: {} native modules, {} stacks",
            walker.natives.len(),
            walker.stacks.len()
        ));
        Ok(walker)
    }

    /// Once a round, before events are taken: the loader's modules, the
    /// stacks (when a thread was announced or a walk missed its stack), and
    /// the code of the functions compiled since the last round.
    /// `loaded`: the loader's objects and counters, as
    /// `corsnap_abi::process::loaded_objects` gave them this round.
    /// `tables`: whether the row tables of the modules event stacks pass
    /// through are wanted yet (see [`tables_wanted`]).
    pub fn refresh(
        &mut self,
        threads_announced: bool,
        compiled: &[FunctionID],
        loaded: &(Vec<LoadedObject>, (u64, u64)),
        tables: bool,
    ) {
        // Compiled code first, in a map of its own when the modules' row
        // tables are still to be built: the runtime runs a body as soon as
        // it installs it, and an event that meets it unknown copies its
        // stack, while the first tables take tens of milliseconds (37 ms in
        // one run on .NET 10, with 2,070 events' copies behind it).
        self.learn_compiled(compiled);
        if self.map_dirty && tables && self.tables_pending {
            self.publish();
        }
        self.refresh_modules(loaded, tables);
        if corsnap_abi::event_walk::take_stacks_stale() || threads_announced {
            self.refresh_stacks();
        }
        if self.map_dirty {
            self.publish();
        }
        if let Some(m) = self.events_map.as_mut() {
            m.reclaim();
        }
    }

    /// The paths of the native modules the walker knows, for
    /// [`Symbolizer::preload_roots`].
    pub fn native_paths(&self) -> Vec<String> {
        self.natives.iter().map(|m| m.name.clone()).collect()
    }

    /// Symbol tables read elsewhere ([`Symbolizer::preload_roots`]) without
    /// holding the walker: reading them while it is held, as naming the
    /// first event's frames did, kept the compiling thread from learning
    /// its new code for as long (see `Shared::learn_compiled_now`).
    pub fn adopt_symbols(&mut self, tables: Symbolizer) {
        self.symbols.adopt(tables);
    }

    /// CoreLib's image, whose functions' compiled rules are still to be
    /// made, once the first maps are out: 10 to 20 ms, which the first
    /// events need not wait, made by the caller without holding the walker
    /// and handed back ([`Self::add_image_with_rules`]).
    pub fn take_image_without_rules(&mut self) -> Option<ManagedCode> {
        if self.map_dirty {
            return None;
        }
        self.image_without_rules.take()
    }

    /// The image [`Self::take_image_without_rules`] gave, with its rules:
    /// in the next round's map.
    pub fn add_image_with_rules(&mut self, image: ManagedCode) {
        self.add_managed(image);
    }

    /// On another thread than the sampler's (see `Shared::learn_compiled_now`):
    /// learns `compiled` and publishes a map with it.
    pub fn learn_compiled_now(&mut self, compiled: &[FunctionID]) {
        let started = std::time::Instant::now();
        let before = self.stats.learned_at_compile;
        self.learn_compiled(compiled);
        self.stats.learned_off_the_sampler_thread += self.stats.learned_at_compile - before;
        self.stats.learning_off_the_sampler_thread_us += started.elapsed().as_micros() as u64;
        if self.map_dirty {
            let started = std::time::Instant::now();
            self.publish();
            self.stats.publishing_off_the_sampler_thread_us += started.elapsed().as_micros() as u64;
        }
    }

    /// Learns the bodies of `compiled` (functions the runtime just
    /// compiled) before an event's walk meets them unknown.
    fn learn_compiled(&mut self, compiled: &[FunctionID]) {
        let (map, managed) = (&self.map, &self.managed);
        let learned = self.learner.learn_compiled(compiled, |a| knows_code(map, managed, a));
        for code in learned {
            self.add_managed(code);
            self.stats.learned_at_compile += 1;
        }
    }

    /// Turns an event's raw frames (leaf first, as the walk left them) into
    /// frame ids: `FunctionID`s, or native ids named by [`Self::take_names`].
    /// A stack copy is learned from and walked again first. Returns the ids
    /// and whether the stack was truncated.
    pub fn resolve(&mut self, raw: &[u64], walk_flags: u32, copy: Option<&OwnStackCopy>) -> (Vec<u64>, bool) {
        let (raw, walk_flags) = match copy {
            Some(copy) => {
                self.stats.copies += 1;
                self.stats.copied_words += copy.words.len() as u64;
                self.walk_again(raw, walk_flags, copy)
            }
            None => (raw.to_vec(), walk_flags),
        };
        self.stats.resolved += 1;
        let mut frames = match self.stack_ids.get(&raw) {
            Some(known) => known.clone(),
            None => {
                let frames = self.name_frames(&raw);
                if self.stack_ids.len() >= CACHE_CAP / 10 {
                    self.stack_ids.clear();
                }
                self.stack_ids.insert(raw.clone(), frames.clone());
                frames
            }
        };
        if walk_flags & flags::LOST != 0 {
            self.stats.incomplete += 1;
            self.note_name(FrameName::Native {
                key: INCOMPLETE_KEY,
                name: "[incomplete stack]".into(),
                module: String::new(),
            });
            frames.push(INCOMPLETE_KEY);
        }
        (frames, walk_flags & flags::TRUNCATED != 0)
    }

    /// Names the CLI has not heard yet.
    pub fn take_names(&mut self) -> Vec<FrameName> {
        std::mem::take(&mut self.pending_names)
    }

    /// Stops walks from reading the map and waits for those running.
    pub fn stop(&mut self) {
        if let Some(m) = self.events_map.take() {
            if !m.uninstall(Duration::from_secs(2)) {
                log::write(format_args!("event walks still running after 2 s; their map is left allocated"));
            }
        }
        log::write(format_args!(
            "event walker stopped: {:?}; {:?}; {} JIT bodies, {} stubs, {} images learned",
            self.stats,
            corsnap_abi::event_walk::counters(),
            self.learner.jit_bodies_learned,
            self.learner.stubs_learned,
            self.learner.images_learned
        ));
    }

    fn name_frames(&mut self, raw: &[u64]) -> Vec<u64> {
        let mut frames = Vec::with_capacity(raw.len());
        let mut funclets = Funclets::default();
        for &frame in raw {
            let address = lookup_address(frame);
            let key = self.frame_id(address);
            // The runtime's own frames (native, stubs) above the first
            // managed one are how the event reached us, not where it
            // happened.
            if frames.is_empty() && key & NATIVE_FRAME_BIT != 0 {
                continue;
            }
            if (key == UNKNOWN_CODE_KEY || crate::code_learning::is_stub_key(key & !NATIVE_FRAME_BIT))
                && frames.last() == Some(&key)
            {
                continue;
            }
            funclets.note(&self.map, address, frames.len(), key);
            frames.push(key);
        }

        // Event stacks carry no IL offsets: the same frames go from a
        // stand-in of the right length.
        let mut no_offsets = vec![0; frames.len()];
        funclets.fold(&mut frames, &mut no_offsets);
        frames
    }

    /// Learns the code a walk did not know and walks its stack copy again,
    /// until nothing new turns up; the leading native frames are left out
    /// again, as the first walk did.
    fn walk_again(&mut self, raw: &[u64], walk_flags: u32, copy: &OwnStackCopy) -> (Vec<u64>, u32) {
        let (mut frames, mut walk_flags) = (raw.to_vec(), walk_flags);
        for round in 0..REWALK_ROUNDS {
            let mut learned = false;
            for &frame in &frames {
                let addr = lookup_address(frame);
                if self.map.is_code(addr) || self.not_managed.contains(&addr) {
                    continue;
                }
                match self.learner.learn(addr) {
                    Learned::Code(code) => {
                        self.add_managed(code);
                        learned = true;
                    }
                    Learned::FunctionOnly(_) => {}
                    Learned::NotManaged => {
                        if self.not_managed.insert(addr) && std::env::var_os("CORSNAP_DEBUG_EVENT_WALKS").is_some() {
                            let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
                            let line = parse_maps(&maps).into_iter().find(|m| m.range.contains(&addr));
                            log::write(format_args!("event walk: {addr:#x} is no managed code: {line:?}"));
                        }
                    }
                }
            }
            if round > 0 && !learned {
                break;
            }
            if self.map_dirty {
                self.publish();
            }
            let mut out = vec![0u64; signal::MAX_FRAMES];
            let (copy_view, cache) = (copy.as_stack_copy(), &mut self.rewalk_cache);
            let walk = if copy.from_leaf {
                let walk = signal::rewalk(&self.map, &copy_view, (raw, walk_flags), cache, &mut out);
                out.truncate(walk.len);
                let leading = out.iter().take_while(|&&f| self.map.native_at(lookup_address(f)).is_some()).count();
                out.drain(..leading);
                frames = out;
                walk
            } else {
                // The frames before the copy's stand; the walk goes on from
                // the first one in unknown code.
                let before = copy.from_frame.min(raw.len());
                let walk = signal::rewalk(&self.map, &copy_view, (&raw[before..], walk_flags), cache, &mut out);
                out.truncate(walk.len);
                frames = raw[..before].iter().copied().chain(out).collect();
                walk
            };
            walk_flags = walk.flags;
            self.stats.rewalked += 1;
            if walk.flags & flags::UNKNOWN_CODE == 0 {
                break;
            }
        }
        (frames, walk_flags)
    }

    fn frame_id(&mut self, addr: u64) -> u64 {
        if let Some(&id) = self.frame_ids.get(&addr) {
            return id;
        }
        if self.frame_ids.len() >= CACHE_CAP {
            self.frame_ids.clear();
            self.stack_ids.clear();
            self.named.clear();
        }
        let id = self.identify(addr);
        self.frame_ids.insert(addr, id);
        id
    }

    /// As the signal engine's: the map's managed regions by tag, native
    /// modules by symbol, else learned now.
    fn identify(&mut self, addr: u64) -> u64 {
        if let Some(region) = self.map.managed_at(addr) {
            let tag = region.tag;
            return self.tagged(tag, addr);
        }
        if let Some(module) = self.map.native_at(addr) {
            let (path, bias) = (module.name.clone(), module.bias);
            let n = self.symbols.name(&path, bias, addr);
            let key = n.key;
            self.note_name(FrameName::Native { key, name: n.name, module: n.module });
            return key;
        }
        if self.not_managed.contains(&addr) {
            return self.unknown_code();
        }
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

    fn tagged(&mut self, tag: u64, addr: u64) -> u64 {
        match tag {
            0 => match self.info.get_function_from_ip(addr as usize) {
                Ok(f) => self.managed(f),
                Err(_) => self.unknown_code(),
            },
            STUB_TAG => self.stub(crate::signal_engine::STUB_KEY, "[runtime stub]"),
            t if t < crate::code_learning::TAG_LIMIT => {
                let (key, name) = crate::code_learning::stub_name(t);
                self.stub(NATIVE_FRAME_BIT | key, name)
            }
            f => self.managed(f as FunctionID),
        }
    }

    fn managed(&mut self, function: FunctionID) -> u64 {
        function as u64
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
        self.managed.retain(|m| m.code.end <= code.code.start || m.code.start >= code.code.end);
        self.managed.push(code);
        self.map_dirty = true;
        self.frame_ids.retain(|_, id| *id != UNKNOWN_CODE_KEY);
        self.stack_ids.clear();
    }

    /// The loader's modules, when they changed, or when their row tables
    /// are wanted (`tables`: those of the modules event stacks pass
    /// through, `Tables::EventStacks`) and some are still to be compiled.
    fn refresh_modules(&mut self, (objects, counters): &(Vec<LoadedObject>, (u64, u64)), tables: bool) {
        let counters = *counters;
        if counters == self.loader_counters && !(tables && self.tables_pending) {
            return;
        }
        self.loader_counters = counters;
        let mut native_modules = self.native_modules.lock().unwrap_or_else(|p| p.into_inner());
        if self.hijack_stub.is_none() {
            self.hijack_stub = native_modules.hijack_stub(objects);
        }
        let tables = if tables { Tables::EventStacks } else { Tables::None };
        let natives = native_modules.modules_of(objects, tables);
        self.tables_pending = native_modules.tables_pending(objects, Tables::EventStacks);
        drop(native_modules);
        self.natives = natives;
        self.map_dirty = true;
        self.natives_dirty = true;
    }

    fn refresh_stacks(&mut self) {
        if let Ok(text) = std::fs::read_to_string("/proc/self/maps") {
            self.stacks = stack_ranges(&parse_maps(&text));
            self.map_dirty = true;
        }
    }

    fn publish(&mut self) {
        self.stats.published += 1;
        // The .NET host's libraries only start the runtime: a walk ends in
        // them, not several frames further down in the executable and libc's
        // start-up (frames a profile folds into `[host start-up]`).
        let roots = self
            .natives
            .iter()
            .filter(|m| HOST_MODULES.iter().any(|h| m.name.ends_with(h)))
            .map(|m| m.code.clone())
            .collect();
        // Read at every event (see `hot_memory`).
        let map = corsnap_abi::hot_memory::allocate_hot(|| {
            Arc::new(if self.natives_dirty {
                CodeMap::new(self.natives.clone(), self.managed.clone(), self.stacks.clone(), self.sigreturn)
                    .with_roots(roots)
                    .with_hijack_stub(self.hijack_stub.clone())
            } else {
                self.map.with_same_natives(self.managed.clone(), self.stacks.clone())
            })
        });
        self.natives_dirty = false;
        self.managed = map.managed().to_vec();
        self.map = map;
        if let Some(m) = self.events_map.as_mut() {
            m.publish(self.map.clone());
        }
        self.map_dirty = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_buy_the_tables_sooner_and_the_test_override_wins() {
        assert_eq!(tables_after(None, false), TABLES_AFTER_NATIVE_FRAMES);
        assert_eq!(tables_after(None, true), ALLOC_TABLES_AFTER_NATIVE_FRAMES);
        assert_eq!(tables_after(Some(0), true), 0);
        assert_eq!(tables_after(Some(7), false), 7);
    }
}
