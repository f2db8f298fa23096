//! The process's native libraries as the walkers know them: each read once
//! (its unwind sections copied, its CFI compiled into a row table) and
//! shared by the signal engine and the event walker, which both run on the
//! sampler thread (the event walker reads them there only).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use corsnap_abi::process::LoadedObject;
use corsnap_unwind::process::{native_module_without_table, LoadedElf};
use corsnap_unwind::{parse_hijack_stub, HijackStub, NativeModule, HIJACK_STUB_START};

/// One cache for the sampler thread's walkers (behind a mutex because the
/// event walker, which holds it, may be lent to another thread; see
/// `Shared::event_walker`).
pub(crate) type SharedNativeModules = Arc<Mutex<NativeModules>>;

#[derive(Default)]
pub(crate) struct NativeModules {
    /// By name and load bias (a library unloaded and loaded again elsewhere
    /// is another module); `None`: not one a walker can use.
    cache: HashMap<(String, u64), Option<NativeModule>>,
    /// The objects already searched for the runtime's hijack trampoline.
    searched_for_hijack_stub: HashSet<(String, u64)>,
    /// The trampoline, once found.
    hijack_stub: Option<HijackStub>,
}

impl NativeModules {
    pub(crate) fn shared() -> SharedNativeModules {
        Arc::new(Mutex::new(NativeModules::default()))
    }

    /// The modules of `objects`, each read the first time any walker met it,
    /// with the row tables `tables` asks for compiled, or as they are: a
    /// module read without its table gets it the first time it is asked
    /// for with.
    pub(crate) fn modules_of(&mut self, objects: &[LoadedObject], tables: Tables) -> Vec<NativeModule> {
        let mut scratch = Vec::new();
        objects
            .iter()
            .filter_map(|o| {
                let entry = self.cache.entry((o.name.clone(), o.bias)).or_insert_with(|| {
                    let elf =
                        LoadedElf { name: &o.name, bias: o.bias, segments: &o.segments, eh_frame_hdr: o.eh_frame_hdr };
                    native_module_without_table(&elf, corsnap_abi::process::read_own_memory, &mut scratch)
                });
                if tables.wants(o) && entry.as_ref().is_some_and(NativeModule::table_pending) {
                    // The table on the heap; the granules a leaf reads
                    // first where walks read fast (see `hot_memory`).
                    *entry = entry
                        .take()
                        .map(NativeModule::with_table)
                        .map(|module| corsnap_abi::hot_memory::allocate_hot(|| module.with_leaf_granules()));
                }
                entry.clone()
            })
            .collect()
    }

    /// Whether a row table `tables` asks for among `objects` is still to be
    /// compiled.
    pub(crate) fn tables_pending(&self, objects: &[LoadedObject], tables: Tables) -> bool {
        objects.iter().any(|o| {
            tables.wants(o)
                && self
                    .cache
                    .get(&(o.name.clone(), o.bias))
                    .is_some_and(|m| m.as_ref().is_some_and(NativeModule::table_pending))
        })
    }

    /// The runtime's hijack trampoline among `objects`, searched for once per
    /// object for both walkers (the search reads the runtime's code). A map
    /// that knows it tells a hijacked return address by its value alone;
    /// without it, each step out of managed code into native code asked the
    /// thread object (a `process_vm_readv`), and an event walk doing so
    /// could not be replayed.
    pub(crate) fn hijack_stub(&mut self, objects: &[LoadedObject]) -> Option<HijackStub> {
        for o in objects {
            if self.hijack_stub.is_none() && self.searched_for_hijack_stub.insert((o.name.clone(), o.bias)) {
                self.hijack_stub = find_hijack_stub(o);
                if let Some(stub) = &self.hijack_stub {
                    crate::log::write(format_args!(
                        "the runtime's hijack trampoline: {:#x}..{:#x}",
                        stub.range.start, stub.range.end
                    ));
                }
            }
        }
        self.hijack_stub.clone()
    }
}

/// Which modules' row tables [`NativeModules::modules_of`] compiles. A
/// module without one is walked by framehop from its unwind sections, as
/// right and slower a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tables {
    /// None (the event walker's first map, out before any table).
    None,
    /// Every module: a CPU sample may land in any.
    All,
    /// Those whose frames event stacks hold (see [`on_event_stacks`]).
    EventStacks,
}

impl Tables {
    pub(crate) fn wants(self, object: &LoadedObject) -> bool {
        match self {
            Tables::None => false,
            Tables::All => true,
            Tables::EventStacks => on_event_stacks(object),
        }
    }
}

/// Whether an event's stack (walked from the agent's callback or the
/// dispatch hook, on the thread the event happened on) can hold frames of
/// `object`'s code: the runtime's (libcoreclr, its JIT and its GC, where
/// class loads and collections happen), the host's and the thread
/// library's (the bottom of every stack, and the main executable, which is
/// the runtime too in a single-file app), and the agent's own (cut from the
/// stacks, but walked through). Other libraries run no managed code and
/// raise no event: their tables (ICU's and libstdc++'s took 35 of the 70 ms
/// the event walker spent on tables at start-up, on a thread that competes
/// with the program's for two CPUs) are compiled only with CPU samples; a
/// walk that meets one steps it by framehop.
fn on_event_stacks(object: &LoadedObject) -> bool {
    const RUNTIME_AND_HOST: [&str; 8] = [
        "libcoreclr.so",
        "libclrjit.so",
        "libclrgc.so",
        "libclrgcexp.so",
        "libhostfxr.so",
        "libhostpolicy.so",
        "libpthread.so.0",
        "libc.so.6",
    ];
    let file = object.name.rsplit('/').next().unwrap_or(&object.name);
    let own_code = on_event_stacks as *const () as usize as u64;
    object.name.is_empty()
        || RUNTIME_AND_HOST.contains(&file)
        || file.starts_with("ld-linux")
        || object.segments.iter().any(|&(stated, size, executable)| {
            let start = object.bias.wrapping_add(stated);
            executable && (start..start.wrapping_add(size)).contains(&own_code)
        })
}

/// The runtime's hijack trampoline, if `object` is the runtime (libcoreclr,
/// or an executable it is linked into: a single-file app): found by its
/// first bytes in the executable segments, and kept only if its whole shape
/// is the one [`parse_hijack_stub`] knows. Read once per module, on the
/// agent's thread.
///
/// The code is read a chunk at a time into one small buffer and searched
/// with `memchr::memmem`: reading libcoreclr's 4.7 MiB of code into a
/// vector of its own, and comparing at every byte, took a sixth of the
/// agent's start-up (`perf`, .NET 10), most of it faulting in the fresh
/// vector's pages, on a thread that competes with the program's for the
/// CPUs while the program starts its work.
fn find_hijack_stub(object: &corsnap_abi::process::LoadedObject) -> Option<HijackStub> {
    /// Bytes searched per read.
    const CHUNK: usize = 64 << 10;
    /// Bytes read past a chunk, so that a trampoline starting in it is
    /// parsed whole (it is 68 bytes on .NET 8 to 10).
    const TAIL: usize = 1 << 10;
    let runtime_candidate = object.name.is_empty() || object.name.ends_with("/libcoreclr.so");
    if !runtime_candidate {
        return None;
    }
    let finder = memchr::memmem::Finder::new(HIJACK_STUB_START);
    let mut buffer = vec![0u8; CHUNK + TAIL];
    let mut found = None;
    for &(stated, size, executable) in &object.segments {
        if !executable || size == 0 || size > 256 << 20 {
            continue;
        }
        let start = object.bias.wrapping_add(stated);
        let size = size as usize;
        for chunk in (0..size).step_by(CHUNK) {
            let bytes = &mut buffer[..(size - chunk).min(CHUNK + TAIL)];
            if !corsnap_abi::process::read_own_memory(start + chunk as u64, bytes) {
                // A segment that cannot be read is passed over whole.
                break;
            }
            // A match in the tail is the next chunk's to parse.
            for at in finder.find_iter(bytes).take_while(|&at| at < CHUNK) {
                if let Some(stub) = parse_hijack_stub(&bytes[at..], start + (chunk + at) as u64) {
                    if found.is_some() {
                        // Two of them: which one the runtime uses is not known.
                        return None;
                    }
                    found = Some(stub);
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(name: &str, bias: u64) -> LoadedObject {
        LoadedObject { name: name.into(), bias, segments: vec![(0, 0x1000, true)], eh_frame_hdr: None }
    }

    #[test]
    fn event_stacks_hold_the_runtime_the_host_the_thread_library_and_the_agent() {
        let runtime = "/usr/share/dotnet/shared/Microsoft.NETCore.App/10.0.12";
        for name in [
            String::new(),
            format!("{runtime}/libcoreclr.so"),
            format!("{runtime}/libclrjit.so"),
            format!("{runtime}/libhostpolicy.so"),
            "/lib/x86_64-linux-gnu/libc.so.6".into(),
            "/lib64/ld-linux-x86-64.so.2".into(),
        ] {
            assert!(on_event_stacks(&object(&name, 0x1000)), "{name}");
        }
        for name in [
            "/lib/x86_64-linux-gnu/libicuuc.so.72".to_string(),
            "/lib/x86_64-linux-gnu/libstdc++.so.6".into(),
            format!("{runtime}/libSystem.Native.so"),
        ] {
            assert!(!on_event_stacks(&object(&name, 0x1000)), "{name}");
            assert!(Tables::All.wants(&object(&name, 0x1000)) && !Tables::None.wants(&object(&name, 0x1000)));
        }
        // The agent's own library, whatever its file is called.
        let own = on_event_stacks as *const () as usize as u64;
        assert!(on_event_stacks(&object("/opt/tools/profiler.so", own - 0x10)));
    }
}
