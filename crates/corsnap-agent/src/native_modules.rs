//! The process's native libraries as the walkers know them: each read once
//! (its unwind sections copied, its CFI compiled into a row table) and
//! shared by the signal engine and the event walker, which both run on the
//! sampler thread (the event walker reads them there only).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use corsnap_abi::process::LoadedObject;
use corsnap_unwind::process::{native_module_without_table, LoadedElf};
use corsnap_unwind::NativeModule;

/// One cache for the sampler thread's walkers (behind a mutex because the
/// event walker, which holds it, may be lent to another thread; see
/// `Shared::event_walker`).
pub(crate) type SharedNativeModules = Arc<Mutex<NativeModules>>;

#[derive(Default)]
pub(crate) struct NativeModules {
    /// By name and load bias (a library unloaded and loaded again elsewhere
    /// is another module); `None`: not one a walker can use.
    cache: HashMap<(String, u64), Option<NativeModule>>,
}

impl NativeModules {
    pub(crate) fn shared() -> SharedNativeModules {
        Arc::new(Mutex::new(NativeModules::default()))
    }

    /// The modules of `objects`, each read the first time any walker met it,
    /// with their row tables compiled (`tables`), or as they are: a module
    /// read without its table gets it the first time it is asked for with.
    pub(crate) fn modules_of(&mut self, objects: &[LoadedObject], tables: bool) -> Vec<NativeModule> {
        objects
            .iter()
            .filter_map(|o| {
                let entry = self.cache.entry((o.name.clone(), o.bias)).or_insert_with(|| {
                    let elf =
                        LoadedElf { name: &o.name, bias: o.bias, segments: &o.segments, eh_frame_hdr: o.eh_frame_hdr };
                    native_module_without_table(&elf, corsnap_abi::process::read_own_bytes)
                });
                if tables && entry.as_ref().is_some_and(NativeModule::table_pending) {
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
}
