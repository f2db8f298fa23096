//! The sampler thread's side of the conversation with the CLI: what every
//! engine's samples need sent beside them (each function's name and source
//! once, each thread's identity when it changes) and the samples themselves,
//! batched into the [`Channel`].

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corsnap_abi::{FunctionID, ThreadID};
use corsnap_wire::{EventKind, Message, SampleHead, SamplerStats};

use crate::names::NameResolver;
use crate::sampler::{Channel, CACHE_CAP};
use crate::signal_engine::{FrameName, Sample};
use crate::Shared;

/// How long after a thread is first described its kernel name is looked at
/// again.
const KERNEL_NAME_SETTLE: Duration = Duration::from_secs(1);

pub(crate) struct Recorder {
    pub(crate) shared: Arc<Shared>,
    pub(crate) channel: Channel,
    pub(crate) names: NameResolver,
    sent_functions: HashSet<FunctionID>,
    /// The path last sent for each module.
    sent_modules: HashMap<corsnap_abi::ModuleID, String>,
    /// What the CLI was last told about each thread: (registry version, OS tid).
    sent_threads: HashMap<ThreadID, (u64, u32)>,
    /// The name last sent for each OS thread the signal engine sampled.
    os_thread_names: HashMap<u32, Option<String>>,
    /// The kernel's name last sent for each OS thread, and when it was
    /// first sent (names are looked at again for a while: the runtime names
    /// a thread just after starting it).
    kernel_names: HashMap<u32, (Instant, String)>,
    pub(crate) stats: SamplerStats,
    pub(crate) own_cache_resets: u64,
}

impl Recorder {
    pub(crate) fn new(shared: Arc<Shared>, channel: Channel) -> Self {
        Recorder {
            names: NameResolver::new(shared.clone()),
            shared,
            channel,
            sent_functions: HashSet::new(),
            sent_modules: HashMap::new(),
            sent_threads: HashMap::new(),
            os_thread_names: HashMap::new(),
            kernel_names: HashMap::new(),
            stats: SamplerStats::default(),
            own_cache_resets: 0,
        }
    }

    /// Sends the names an engine (or the event walker) found for its frames.
    pub(crate) fn send_names(&mut self, names: Vec<FrameName>) {
        for name in names {
            match name {
                FrameName::Managed(function) => self.describe_function(function),
                FrameName::Native { key, name, module } => {
                    self.channel.queue(&Message::Function { function_id: key, name, module });
                }
            }
        }
    }

    /// Encodes one sample into the batch going to the CLI.
    pub(crate) fn send_sample(&mut self, head: &SampleHead, leaf: &str, frames: &[u64], il_offsets: &[u32]) {
        corsnap_wire::encode_sample(&mut self.channel.pending, head, leaf, frames, il_offsets);
    }

    /// Sends the frames' names, then samples taken by OS thread id (the
    /// signal engine's). `true` if any sample went out.
    pub(crate) fn send_os_thread_samples(&mut self, names: Vec<FrameName>, samples: &[Sample]) -> bool {
        self.send_names(names);
        if samples.is_empty() {
            return false;
        }
        // Every thread goes by its OS thread id here: a managed thread can
        // be sampled before the runtime has told us which OS thread it is.
        // Its name is the one the program gave it, sent empty until known
        // (the profile fills it in place); the kernel's name for the thread
        // labels it meanwhile, and for good if the program never names it.
        let thread_names = self.shared.threads.names_by_os_tid();
        let now = Instant::now();
        let mut tids: Vec<u32> = samples.iter().map(|s| s.os_tid).collect();
        tids.sort_unstable();
        tids.dedup();
        for tid in tids {
            self.note_kernel_name(tid, now);
            let entry = self.os_thread_names.entry(tid).or_insert(None);
            let name = thread_names.get(&tid).cloned().unwrap_or_default();
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
        for s in samples {
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
            self.send_sample(&head, "", &s.frames, il_offsets);
        }
        self.stats.samples += samples.len() as u64;
        true
    }

    pub(crate) fn describe_function(&mut self, function: FunctionID) {
        if self.sent_functions.len() >= CACHE_CAP {
            self.sent_functions.clear();
            self.own_cache_resets += 1;
        }
        if function == 0 || !self.sent_functions.insert(function) {
            return;
        }
        let (name, module, source, state_machine) = match self.names.resolve(function) {
            Ok(n) => {
                self.stats.names_resolved += 1;
                (n.name, n.module, Some((n.module_id, n.module_path, n.method_token)), n.state_machine)
            }
            Err(e) => {
                self.stats.name_failures += 1;
                (format!("[unresolved function 0x{function:x}: {e}]"), String::new(), None, None)
            }
        };
        self.channel.queue(&Message::Function { function_id: function as u64, name, module });
        if let Some(kind) = state_machine {
            self.channel.queue(&Message::StateMachine { function_id: function as u64, kind });
        }
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
    pub(crate) fn describe_threads(&mut self, threads: &[(ThreadID, u32)]) {
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
}

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

/// The kernel's name for one of our process's threads.
fn os_thread_name(os_tid: u32) -> Option<String> {
    let comm = std::fs::read_to_string(format!("/proc/self/task/{os_tid}/comm")).ok()?;
    let comm = comm.trim_end_matches('\n');
    (!comm.is_empty()).then(|| comm.to_string())
}
