//! corsnap's stack walker for Linux x64: one frame at a time, from the
//! registers of an interrupted thread to the root of its stack, into a
//! caller-provided buffer of raw addresses. Names come later, elsewhere.
//!
//! Three kinds of code sit on a .NET thread's stack, and each is unwound by
//! the information made for it:
//!
//! - **native code** (libc, libcoreclr, the host): DWARF CFI from each ELF
//!   module's `.eh_frame`, evaluated by `framehop`, because glibc has no frame
//!   pointers;
//! - **managed code** (JIT'd method bodies, ReadyToRun images): the Windows
//!   x64 `UNWIND_INFO` that CoreCLR's JIT emits on every OS, evaluated by
//!   `pe-unwind-info`, because Tier1 methods are often frameless and a
//!   frame-pointer walk loses their callers;
//! - **signal frames** (the runtime's activation and fault handlers): the
//!   kernel's saved context, found by the return address into glibc's
//!   `__restore_rt`.
//!
//! Code the map does not know (a method the agent has not learned yet, a
//! runtime stub) is stepped over by its return address or the frame-pointer
//! chain, and the walk says so in its flags.
//!
//! This crate is safe code and never allocates while walking: the caller owns
//! the [`CodeMap`] (built beforehand), the [`WalkCache`] and the output
//! buffer, and reads memory through [`Memory`], which is where the bounds of
//! what may be read are enforced. That is what lets corsnap run [`walk`] in a
//! signal handler, and what lets tests run it on recorded stacks.

#![forbid(unsafe_code)]

mod body_rules;
mod frame_rule;
mod framehop_caches;
mod function_pages;
mod hijack;
mod known_addresses;
mod last_walk;
mod leaf_functions;
mod leaf_rules;
mod native_leaves;
mod native_table;
pub mod process;
mod seqlock_table;
#[cfg(test)]
mod stack_words;
mod walk_paths;

use std::ops::Range;
use std::sync::Arc;

use framehop::x86_64::{UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, MustNotAllocateDuringUnwind, Unwinder};
use pe_unwind_info::x86_64::{FunctionTableEntries, Register, UnwindState, XmmRegister};

use frame_rule::FrameRule;
use known_addresses::SharedKnownAddresses;
use known_addresses::{KnownAddress, KnownAddresses};
use last_walk::{LastWalk, WalkTracker};
use leaf_functions::LeafFunctions;
use leaf_rules::LeafRules;
pub use leaf_rules::LearnedStretch;
use native_table::{NativeTable, RowRule};
use walk_paths::{Tracked, WalkPaths};

pub use hijack::{parse_hijack_stub, HijackStub, HIJACK_STUB_START};

/// Section bytes owned by the map (copied out of the process's memory or
/// files before any walk can see them).
pub type Bytes = Arc<[u8]>;

/// Bit 63 of a recorded address: the address is an exact instruction pointer
/// (the interrupted leaf, or the context a signal frame saved), not a return
/// address. User-space addresses never reach it.
pub const EXACT_IP: u64 = 1 << 63;

/// Strips [`EXACT_IP`].
pub fn address_of(frame: u64) -> u64 {
    frame & !EXACT_IP
}

/// The address to look a recorded frame up by: a return address points just
/// past its call, which may be the first byte of the next function.
pub fn lookup_address(frame: u64) -> u64 {
    if frame & EXACT_IP != 0 {
        address_of(frame)
    } else {
        frame.saturating_sub(1)
    }
}

/// What a walk found out about its stack, beside the frames.
pub mod flags {
    /// The walk reached the root of the stack (the thread's entry point).
    pub const COMPLETE: u32 = 1;
    /// The output buffer filled up first; the root end is missing.
    pub const TRUNCATED: u32 = 1 << 1;
    /// The walk stopped early: a read outside the stack, no progress, or
    /// unwind information that could not be applied.
    pub const LOST: u32 = 1 << 2;
    /// Some frame was in code the map does not know (not yet learned, or a
    /// runtime stub); it was stepped over by its return address or the
    /// frame-pointer chain.
    pub const UNKNOWN_CODE: u32 = 1 << 3;
    /// The walk went through a signal frame.
    pub const SIGNAL_FRAME: u32 = 1 << 4;
    /// A managed frame's return address had been replaced by the runtime's
    /// hijack trampoline (a thread the runtime is bringing to a stop); the
    /// real one, which [`Memory::hijacked_return`](super::Memory::hijacked_return)
    /// found in the runtime's thread object, was used in its place.
    pub const HIJACKED: u32 = 1 << 5;
    /// [`walk_until`](super::walk_until) reached the frame it was to stop
    /// at (which is not in the output).
    pub const REACHED: u32 = 1 << 6;
    /// With [`COMPLETE`]: the walk ended where the unwind information says
    /// nothing called the frame (the thread's start, `clone3` or `_start`),
    /// not on a frame a guess or a remembered walk led to: the stack pointer
    /// it ended at is the thread's root.
    pub const END_OF_STACK: u32 = 1 << 7;
}

/// The three registers a walk needs on x64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Regs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

/// How a walk reads memory. Implementations decide what may be read: the
/// signal handler's allows exactly the interrupted thread's stack and the
/// code regions of the map being walked.
pub trait Memory {
    /// The 8 bytes at `addr`, if `addr..addr + 8` lies inside the stack being
    /// walked.
    fn stack_word(&self, addr: u64) -> Option<u64>;
    /// The bytes of `range`, which the walker guarantees lies inside the
    /// `code` range of a [`ManagedCode`] of the map being walked: most
    /// often that of `region`, the one the frame is in (one of the map's
    /// own), which an implementation may check first, in constant time,
    /// before searching the map's regions.
    fn code_bytes(&self, region: &ManagedCode, range: Range<u64>) -> Option<&[u8]>;
    /// A managed frame returns to `found`, read from the stack word at
    /// `slot`, and `found` is not managed code: if the runtime hijacked that
    /// return address (it overwrites it with a trampoline of its own to stop
    /// the thread on its way back, and keeps the original in its thread
    /// object), the original. Without an answer the walk goes on from
    /// `found`, where it would lose the real caller.
    fn hijacked_return(&self, slot: u64, found: u64) -> Option<u64> {
        let _ = (slot, found);
        None
    }
    /// A hint that the memory at `addr` (any address, mapped or not) will
    /// be read soon.
    fn prefetch(&self, addr: u64) {
        let _ = addr;
    }
    /// The bytes of `range`, which starts at the instruction pointer the
    /// walk started from (the interrupted thread's own) and lies inside a
    /// managed function of a region that the map walked lists (its lineage
    /// listed it, and a lineage keeps its regions): to see whether an
    /// epilogue starts there. `None` (the default) leaves the leaf to the
    /// full lookup.
    fn leaf_code(&self, range: Range<u64>) -> Option<&[u8]> {
        let _ = range;
        None
    }
}

/// Scratch space for unwinding: framehop's rule cache and gimli's
/// evaluation storage, and where managed frames met before have their
/// function-table entries; allocated once. One per walking thread (each
/// thread's signal handler has its own).
pub struct WalkCache {
    /// Counts this cache in for [`framehop_caches`], whose pool lives as
    /// long as some walk cache does.
    _framehop: framehop_caches::Share,
    /// The return addresses met before, with their rules (see
    /// [`known_addresses`]): a managed frame met again skips two binary
    /// searches (its region, and its function in a table that for CoreLib's
    /// image is large and cold in the CPU's caches) and its unwind record; a
    /// native frame met again skips the search of the managed regions, of
    /// the modules, and of its module's rows.
    known: KnownAddresses,
    /// The deepest frames of the thread's last complete walk (see
    /// [`last_walk`]).
    last: LastWalk,
    /// The managed functions met lately at the leaf (see [`leaf_functions`]).
    leaves: LeafFunctions,
    /// The paths of walks of one's own stack (see [`walk_paths`]).
    paths: WalkPaths,
    /// The stretch the last walk's leaf was stepped out of by its rule,
    /// when it was looked up in full: for the map's owner to keep.
    learned: Option<LearnedStretch>,
    /// The return addresses the last walk looked up in full, as words for
    /// [`CodeMap::keep_known_address`]: the first
    /// [`LEARNED_ADDRESSES`] of them (a later walk hands on the rest).
    learned_addresses: [[u64; 3]; LEARNED_ADDRESSES],
    learned_address_count: usize,
    /// The last walk's counts for [`Walk::looked_up`] and
    /// [`Walk::from_process_table`].
    looked_up: u32,
    from_process_table: u32,
}

/// Return addresses a walk hands on for the process's table (see
/// [`WalkCache::take_learned_addresses`]).
pub const LEARNED_ADDRESSES: usize = 8;

/// What a walk knows of the frame at hand, managed or native, before
/// stepping out of it: from [`KnownAddresses`], or for a leaf from
/// [`LeafFunctions`].
#[derive(Debug, Clone, Copy)]
struct KnownFrame {
    native: bool,
    /// The frame's region's index in the map walked, when known (a leaf's;
    /// a return address's is looked up only when its rule does not serve).
    region: Option<u32>,
    /// See [`KnownAddress::entry`].
    entry: u32,
    rule: FrameRule,
}

impl WalkCache {
    /// The blocks of memory this cache holds apart from its own struct, as
    /// (address, bytes): for its owner to have their pages mapped before a
    /// signal handler first touches them (see [`CodeMap::table_blocks`]).
    pub fn heap_blocks(&self) -> [(usize, usize); 1] {
        [self.known.block()]
    }

    /// Hands `prefetch` the lines of this cache every walk reads or writes
    /// first (see [`CodeMap::prefetch_for_walk`]): the deep end of the last
    /// walk, and the counts and learned records a walk starts by clearing.
    pub fn prefetch_for_walk(&self, prefetch: impl Fn(u64)) {
        prefetch(&self.last as *const LastWalk as u64);
        prefetch(&self.learned as *const Option<LearnedStretch> as u64);
        prefetch(&self.learned_address_count as *const usize as u64);
        prefetch(&self.looked_up as *const u32 as u64);
        prefetch(&self.paths as *const WalkPaths as u64);
    }

    pub fn new() -> Self {
        WalkCache {
            _framehop: framehop_caches::Share::new(),
            known: KnownAddresses::new(),
            last: LastWalk::new(),
            leaves: LeafFunctions::new(),
            paths: WalkPaths::new(),
            learned: None,
            learned_addresses: [[0; 3]; LEARNED_ADDRESSES],
            learned_address_count: 0,
            looked_up: 0,
            from_process_table: 0,
        }
    }

    /// Hands each return address the last walk looked up in full (up to
    /// [`LEARNED_ADDRESSES`]) to `f`, as words for
    /// [`CodeMap::keep_known_address`]. No allocation: safe in a signal
    /// handler.
    pub fn take_learned_addresses(&mut self, mut f: impl FnMut([u64; 3])) {
        for words in &self.learned_addresses[..self.learned_address_count] {
            f(*words);
        }
        self.learned_address_count = 0;
    }

    /// A return address looked up in full: kept in the thread's table, and
    /// handed on for the process's.
    fn learn(&mut self, lineage: u64, known: KnownAddress) {
        self.looked_up += 1;
        self.known.remember(lineage, known);
        if let Some(slot) = self.learned_addresses.get_mut(self.learned_address_count) {
            if let Some(words) = known.to_words(lineage) {
                *slot = words;
                self.learned_address_count += 1;
            }
        }
    }

    /// The stretch of code the last walk's leaf was found in, with its rule
    /// (see [`leaf_rules`]), for [`CodeMap::keep_leaf_stretch`].
    pub fn take_learned_stretch(&mut self) -> Option<LearnedStretch> {
        self.learned.take()
    }

    /// Makes walks with this cache remember the paths they take from their
    /// first frame, and take them again as far as the stack still holds
    /// them when a later walk starts at the same address (see
    /// [`walk_paths`]): for walks of the walker's own stack, which start at
    /// one place in its own code.
    pub fn remember_paths(&mut self) {
        self.paths.enable();
    }
}

impl Default for WalkCache {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for WalkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WalkCache")
    }
}

/// An ELF module's executable range and its CFI, ready for the map.
#[derive(Clone)]
pub struct NativeModule {
    pub name: String,
    /// Where its code is mapped (actual addresses).
    pub code: Range<u64>,
    /// Actual address minus the address the file states.
    pub bias: u64,
    module: Module<Bytes>,
    /// Its CFI rows by address, for leaves (see [`native_table`]).
    table: Option<Arc<NativeTable>>,
    /// What the table is compiled from, while it is not yet (see
    /// [`NativeModule::without_table`]).
    table_inputs: Option<TableInputs>,
    /// Its table's granules with their rules in place, for leaves (see
    /// [`native_leaves`]): made apart from the table, so that the agent
    /// can put them where walks read fast.
    leaf_granules: Option<native_leaves::LeafGranules>,
}

/// `.eh_frame`, `.eh_frame_hdr` (start and bytes each) and `.text`: what a
/// module's row table is compiled from.
#[derive(Clone)]
struct TableInputs {
    eh_frame: (u64, Bytes),
    eh_frame_hdr: (u64, Bytes),
    text: Range<u64>,
}

impl std::fmt::Debug for NativeModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NativeModule({} {:#x}..{:#x})", self.name, self.code.start, self.code.end)
    }
}

/// The sections of an ELF module that unwinding needs, with their addresses
/// as the file states them (SVMAs); `bias` turns them into actual addresses.
#[derive(Debug, Clone, Default)]
pub struct ElfSections {
    pub text: Option<Range<u64>>,
    pub eh_frame: Option<(Range<u64>, Bytes)>,
    pub eh_frame_hdr: Option<(Range<u64>, Bytes)>,
    pub got: Option<Range<u64>>,
}

impl NativeModule {
    /// `code`: the executable mapping(s) of the module; `bias`: the load
    /// bias (actual address minus stated address).
    ///
    /// Made without its row table, which takes most of the time
    /// (libcoreclr's: tens of milliseconds): walks step its frames by
    /// framehop alone, which is slower a frame but as right, until
    /// [`NativeModule::with_table`].
    pub fn without_table(name: String, code: Range<u64>, bias: u64, sections: ElfSections) -> NativeModule {
        let table_inputs = match (&sections.text, &sections.eh_frame, &sections.eh_frame_hdr) {
            (Some(text), Some((eh_frame, bytes)), Some((hdr, hdr_bytes))) => Some(TableInputs {
                eh_frame: (eh_frame.start, bytes.clone()),
                eh_frame_hdr: (hdr.start, hdr_bytes.clone()),
                text: text.clone(),
            }),
            _ => None,
        };
        let info = ExplicitModuleSectionInfo {
            base_svma: 0,
            text_svma: sections.text.clone(),
            eh_frame_svma: sections.eh_frame.as_ref().map(|(r, _)| r.clone()),
            eh_frame: sections.eh_frame.map(|(_, d)| d),
            eh_frame_hdr_svma: sections.eh_frame_hdr.as_ref().map(|(r, _)| r.clone()),
            eh_frame_hdr: sections.eh_frame_hdr.map(|(_, d)| d),
            got_svma: sections.got,
            ..Default::default()
        };
        let module = Module::new(name.clone(), code.clone(), bias, info);
        NativeModule { name, code, bias, module, table: None, table_inputs, leaf_granules: None }
    }

    /// The module with its row table compiled (the same module if it has
    /// one, or has nothing to compile it from).
    pub fn with_table(mut self) -> NativeModule {
        if let Some(inputs) = self.table_inputs.take() {
            let (eh_frame, hdr) = (&inputs.eh_frame, &inputs.eh_frame_hdr);
            self.table =
                NativeTable::build((eh_frame.0, &eh_frame.1), (hdr.0, &hdr.1), inputs.text, self.bias).map(Arc::new);
        }
        self
    }

    /// The module with its leaves' granules (see [`native_leaves`]) made
    /// from its row table, if it has one: allocated here, so the caller
    /// chooses where (the agent: on the walks' huge pages).
    pub fn with_leaf_granules(mut self) -> NativeModule {
        if let Some(table) = &self.table {
            let (base, packed) = table.packed_granules();
            if !packed.is_empty() {
                self.leaf_granules = Some(native_leaves::LeafGranules { base, packed });
            }
        }
        self
    }

    /// Whether its row table is still to be compiled.
    pub fn table_pending(&self) -> bool {
        self.table_inputs.is_some()
    }

    /// The size of its row table (see [`native_table`]), in bytes.
    pub fn table_bytes(&self) -> usize {
        self.table.as_ref().map_or(0, |t| t.size()) + self.leaf_granules.as_ref().map_or(0, |g| g.packed.size())
    }
}

/// Where a [`ManagedCode`]'s `UNWIND_INFO` records are read from.
#[derive(Debug, Clone)]
pub enum UnwindBytes {
    /// Copied out of the process: the bytes at RVAs `rva..rva + bytes.len()`.
    Copied { rva: u32, bytes: Bytes },
    /// Inside the region's own `code` range (a ReadyToRun image keeps its
    /// unwind information in the mapped image).
    InCode,
}

/// Managed code with its Windows x64 function table: one JIT'd method body
/// (and its funclets), or one ReadyToRun image.
#[derive(Debug, Clone)]
pub struct ManagedCode {
    /// The range that may be read live (epilogue detection reads the code;
    /// an image's unwind information too).
    pub code: Range<u64>,
    /// The address RVAs are relative to.
    pub base: u64,
    /// `RUNTIME_FUNCTION` records (12 bytes each: begin, end, unwind-info
    /// RVA), sorted by begin.
    pub functions: Bytes,
    pub unwind: UnwindBytes,
    /// Opaque to the walker: tells the resolver what this region is.
    pub tag: u64,
    /// A runtime stub with no unwind information (precode, virtual stub
    /// dispatch, the copied write barrier): a leaf that has pushed at most a
    /// word or two before it jumps on, stepped over by the first of
    /// `[rsp]`, `[rsp+8]`, `[rsp+16]` that is a return address into known
    /// code. The function table is not used.
    pub frameless: bool,
    /// For each entry of `functions`, in order, its body rule and prologue
    /// size in one word, or none (see [`body_rules`]). Empty until
    /// [`ManagedCode::with_body_rules`]: then every frame is unwound in
    /// full.
    pub body_rules: Arc<[u64]>,
    /// For a long `functions` table (an image's), where to search it for
    /// an address (see [`function_pages`]); empty until
    /// [`ManagedCode::with_body_rules`], and for short tables: then the
    /// whole table is searched.
    pub function_pages: Arc<[u32]>,
}

impl ManagedCode {
    /// The region with each function's body rule compiled (see
    /// [`body_rules`]), on the agent's thread. `unwind_in_code`: for a
    /// region whose records lie in its code (an image), the bytes read from
    /// the RVA given, which must hold every record; unused for copied ones.
    pub fn with_body_rules(mut self, unwind_in_code: Option<(u32, &[u8])>) -> ManagedCode {
        // Most regions (a JIT'd body) have none: no allocation for them.
        let pages = function_pages::index(&self.functions);
        if !pages.is_empty() {
            self.function_pages = pages.into();
        }
        let (first, bytes): (u32, &[u8]) = match (&self.unwind, unwind_in_code) {
            (UnwindBytes::Copied { rva, bytes }, _) => (*rva, bytes),
            (UnwindBytes::InCode, Some(span)) => span,
            (UnwindBytes::InCode, None) => return self,
        };
        let rules = body_rules::compile(&self.functions, |rva| {
            bytes.get(rva.checked_sub(first)? as usize..).filter(|b| !b.is_empty())
        });
        self.body_rules = rules.into();
        self
    }

    /// The body rule of the function at byte `entry` of the table, with its
    /// prologue's size.
    fn body_rule_at(&self, entry: u32) -> Option<(FrameRule, u8)> {
        body_rules::unpack(*self.body_rules.get(entry as usize / 12)?)
    }

    /// The function-table entry covering `addr`, as (begin, end) addresses.
    pub fn function_at(&self, addr: u64) -> Option<Range<u64>> {
        let rva = u32::try_from(addr.checked_sub(self.base)?).ok()?;
        let f = FunctionTableEntries::parse(&self.functions).lookup(rva)?;
        Some(self.base + u64::from(f.begin_address.get())..self.base + u64::from(f.end_address.get()))
    }
}

/// Everything a walk may consult, immutable once built. The agent builds a
/// new one when code or threads appear and publishes it whole.
#[derive(Clone, Default)]
pub struct CodeMap {
    natives: Vec<NativeModule>,
    unwinder: UnwinderX86_64<Bytes, MustNotAllocateDuringUnwind>,
    managed: Vec<ManagedCode>,
    /// The start of each of `managed`'s regions, in the same order: what
    /// the search for a leaf's region reads. A .NET process has thousands
    /// of regions (one per method body), and a search of `managed` itself
    /// read a separate cache line at each of its dozen steps, all cold at
    /// 100 samples a second; eight starts share a line here, and the few
    /// lines every search begins with stay warm.
    managed_starts: Vec<u64>,
    /// Anonymous read-write mappings, where thread stacks live, sorted.
    stacks: Vec<Range<u64>>,
    /// glibc's `__restore_rt`: a return address equal to it marks a signal
    /// frame. 0 if unknown.
    sigreturn: u64,
    /// Unique to this map (0 for an empty default one): what a
    /// [`WalkCache`]'s managed entries were found in.
    generation: u64,
    /// Shared by the maps that followed this one's natives and kept every
    /// managed region it had (adding others): in them every address this
    /// map knew is the same code, so frames a walk remembers by address
    /// (its path, its last walk) stay true, where the cache's managed
    /// entries (which hold region indexes) do not. A map published per
    /// body learned no longer empties them.
    lineage: u64,
    /// Code a walk ends at, as if it were the root: a frame in it is kept
    /// and nothing beyond it is walked (see [`CodeMap::with_roots`]).
    roots: Vec<Range<u64>>,
    /// The runtime's hijack trampoline, stepped over by its prologue rather
    /// than by its (misleading) CFI.
    hijack_stub: Option<HijackStub>,
    /// What every thread's walks learned, for all of them: shared by the
    /// maps built from this one's natives, written through `&self`
    /// ([`CodeMap::keep_learned`]).
    process_learning: Arc<ProcessLearning>,
    /// For each of `natives`, whether any managed region lies inside its
    /// code (the runtime's stubs may be listed as regions): where none
    /// does, an address in the module is native code with no search of the
    /// managed regions.
    natives_with_managed: Vec<bool>,
    /// The start of each of `natives`' code, in the same order: what the
    /// search for a frame's module reads (a module's entry is hundreds of
    /// bytes, so each step of a search of `natives` was a line of its own).
    native_starts: Vec<u64>,
    /// For each of `natives`, in the same order, what a leaf in it is
    /// stepped by before any full lookup (see [`native_leaves`]).
    native_leaves: Vec<native_leaves::NativeLeaves>,
}

/// The memories of the walks that serve every thread of the process (a
/// stretch's or a return address's rule is the code's, not a thread's).
/// Read by every walk; written by any thread but a signal handler, which
/// hands what it learned to the agent. The default (the empty map's) keeps
/// nothing.
#[derive(Default)]
struct ProcessLearning {
    /// The stretches of code samples were lately taken in, with their rules
    /// (see [`leaf_rules`]).
    leaf_rules: LeafRules,
    /// The return addresses walks looked up in full, with their rules (see
    /// [`SharedKnownAddresses`]).
    known_addresses: SharedKnownAddresses,
}

impl CodeMap {
    /// The process's tables this map shares with the maps of its natives
    /// (leaf stretches, return addresses), as (address, bytes). Their memory
    /// is allocated zeroed, so its pages are mapped only when first touched:
    /// by a walk in a signal handler, a page fault, which in this VM took
    /// tens of microseconds. The owner has them mapped beforehand.
    pub fn table_blocks(&self) -> [(usize, usize); 2] {
        [self.process_learning.leaf_rules.block(), self.process_learning.known_addresses.block()]
    }

    /// Hands `prefetch` the lines of this map a walk reads first: its own
    /// fields, the process's tables' heads, and the first steps of the
    /// searches of its regions. A signal handler at 100 Hz finds them all
    /// cold, each a miss of its own when read one after another.
    pub fn prefetch_for_walk(&self, prefetch: impl Fn(u64)) {
        let at = self as *const CodeMap as u64;
        for line in 0..(std::mem::size_of::<CodeMap>() as u64).div_ceil(64) {
            prefetch(at + line * 64);
        }
        prefetch(Arc::as_ptr(&self.process_learning) as u64);
        for starts in [&self.managed_starts, &self.native_starts] {
            let base = starts.as_ptr() as u64;
            let len = starts.len() as u64;
            for probe in [len / 2, len / 4, len * 3 / 4] {
                prefetch(base + probe * 8);
            }
        }
    }
}

impl std::fmt::Debug for CodeMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodeMap")
            .field("natives", &self.natives.len())
            .field("managed", &self.managed.len())
            .field("stacks", &self.stacks.len())
            .finish()
    }
}

impl CodeMap {
    /// Builds a map. Overlapping managed regions keep the later one in
    /// `managed` (the newer knowledge); overlapping native modules the first.
    pub fn new(
        natives: Vec<NativeModule>,
        managed: Vec<ManagedCode>,
        stacks: Vec<Range<u64>>,
        sigreturn: u64,
    ) -> CodeMap {
        let learning = Arc::new(ProcessLearning {
            leaf_rules: LeafRules::new(leaf_rules::LEAF_RULES),
            known_addresses: SharedKnownAddresses::new(known_addresses::SHARED_KNOWN_ADDRESSES),
        });
        CodeMap::assemble(natives, managed, stacks, sigreturn, learning)
    }

    fn assemble(
        mut natives: Vec<NativeModule>,
        mut managed: Vec<ManagedCode>,
        mut stacks: Vec<Range<u64>>,
        sigreturn: u64,
        process_learning: Arc<ProcessLearning>,
    ) -> CodeMap {
        natives.sort_by_key(|m| m.code.start);
        natives.dedup_by(|later, earlier| later.code.start < earlier.code.end);
        let mut unwinder = UnwinderX86_64::new();
        for m in &natives {
            unwinder.add_module(m.module.clone());
        }
        // Stable sort, then keep the last of any overlapping run.
        managed.sort_by_key(|m| m.code.start);
        let mut kept: Vec<ManagedCode> = Vec::with_capacity(managed.len());
        for m in managed {
            if m.code.start >= m.code.end {
                continue;
            }
            while kept.last().is_some_and(|k| k.code.end > m.code.start) {
                kept.pop();
            }
            kept.push(m);
        }
        stacks.sort_by_key(|r| r.start);
        static GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let generation = GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        CodeMap {
            natives,
            unwinder,
            managed_starts: kept.iter().map(|m| m.code.start).collect(),
            managed: kept,
            stacks,
            sigreturn,
            generation,
            lineage: generation,
            roots: Vec::new(),
            hijack_stub: None,
            process_learning,
            natives_with_managed: Vec::new(),
            native_starts: Vec::new(),
            native_leaves: Vec::new(),
        }
        .with_native_index()
    }

    /// Fills [`CodeMap::natives_with_managed`],
    /// [`CodeMap::native_starts`] and [`CodeMap::native_leaves`] for this
    /// map's lists.
    fn with_native_index(mut self) -> CodeMap {
        self.native_starts = self.natives.iter().map(|m| m.code.start).collect();
        let overlaps = self
            .natives
            .iter()
            .map(|m| {
                let i = self.managed_starts.partition_point(|&s| s < m.code.end);
                i.checked_sub(1).and_then(|i| self.managed.get(i)).is_some_and(|r| r.code.end > m.code.start)
            })
            .collect();
        self.natives_with_managed = overlaps;
        // Granules of a module that holds managed code could answer for an
        // address in that code: none.
        self.native_leaves = self
            .natives
            .iter()
            .zip(&self.natives_with_managed)
            .map(|(m, &with_managed)| native_leaves::NativeLeaves {
                end: m.code.end,
                granules: m.leaf_granules.clone().filter(|_| !with_managed).unwrap_or_default(),
            })
            .collect();
        self
    }

    /// Walks end at a frame in `roots` (kept, marked complete) instead of
    /// going on to the thread's real root: for code known never to call
    /// managed code again below itself (the .NET host's start-up), which a
    /// caller that walks often and shows those frames folded anyway can
    /// skip.
    pub fn with_roots(mut self, roots: Vec<Range<u64>>) -> CodeMap {
        self.roots = roots;
        self
    }

    /// A map with this one's native modules and new managed code and
    /// stacks. The native unwinder is kept whole, and with it the
    /// generation framehop's per-thread rule caches are keyed by: a map
    /// built afresh empties every thread's cache of native unwind rules,
    /// and the engine publishes a map each time it learns code. (Managed
    /// code changed: the map's own generation, which a walk cache's managed
    /// entries are keyed by, is new.)
    pub fn with_same_natives(&self, managed: Vec<ManagedCode>, stacks: Vec<Range<u64>>) -> CodeMap {
        let fresh = CodeMap::assemble(Vec::new(), managed, stacks, self.sigreturn, self.process_learning.clone());
        // Both lists are sorted by address, without overlaps.
        let mut new = fresh.managed.iter().peekable();
        let kept_all = self.managed.iter().all(|old| {
            while new.next_if(|n| n.code.start < old.code.start).is_some() {}
            new.next_if(|n| {
                n.code == old.code
                    && n.base == old.base
                    && n.frameless == old.frameless
                    && Arc::ptr_eq(&n.functions, &old.functions)
            })
            .is_some()
        });
        let lineage = if kept_all { self.lineage } else { fresh.generation };
        CodeMap {
            lineage,
            natives: self.natives.clone(),
            unwinder: self.unwinder.clone(),
            hijack_stub: self.hijack_stub.clone(),
            roots: self.roots.clone(),
            ..fresh
        }
        .with_native_index()
    }

    /// The map, knowing where the runtime's hijack trampoline is.
    pub fn with_hijack_stub(mut self, stub: Option<HijackStub>) -> CodeMap {
        self.hijack_stub = stub;
        self
    }

    /// The hijack trampoline's address (what a hijacked return address
    /// is), if the map knows it.
    pub fn hijack_trampoline(&self) -> Option<u64> {
        self.hijack_stub.as_ref().map(|s| s.range.start)
    }

    pub fn natives(&self) -> &[NativeModule] {
        &self.natives
    }

    pub fn managed(&self) -> &[ManagedCode] {
        &self.managed
    }

    /// The index in `managed` of the region containing `addr`.
    fn managed_index_at(&self, addr: u64) -> Option<usize> {
        let i = self.managed_starts.partition_point(|&start| start <= addr).checked_sub(1)?;
        (addr < self.managed.get(i)?.code.end).then_some(i)
    }

    /// The managed region containing `addr`.
    pub fn managed_at(&self, addr: u64) -> Option<&ManagedCode> {
        let i = self.managed_starts.partition_point(|&start| start <= addr);
        let m = self.managed.get(i.checked_sub(1)?)?;
        (addr < m.code.end).then_some(m)
    }

    /// The index of the native module containing `addr`.
    fn native_index_at(&self, addr: u64) -> Option<usize> {
        let i = self.native_starts.partition_point(|&start| start <= addr).checked_sub(1)?;
        (addr < self.natives.get(i)?.code.end).then_some(i)
    }

    /// Keeps a stretch a walk learned (see [`WalkCache::take_learned_stretch`])
    /// for every walk of this map and of the maps that share its natives.
    /// Safe from any thread, at once with walks and other writers. A signal
    /// handler hands its stretches to the agent instead (see [`leaf_rules`]).
    pub fn keep_leaf_stretch(&self, learned: &LearnedStretch) {
        self.process_learning.leaf_rules.remember(learned);
    }

    /// Keeps a return address a walk looked up in full (see
    /// [`WalkCache::take_learned_addresses`]), as
    /// [`CodeMap::keep_leaf_stretch`] keeps a stretch.
    pub fn keep_known_address(&self, words: [u64; 3]) {
        self.process_learning.known_addresses.remember_words(words);
    }

    /// Keeps all that the last walk with `cache` learned: for walks on
    /// threads that may write the process's tables (not a signal handler).
    pub fn keep_learned(&self, cache: &mut WalkCache) {
        if let Some(learned) = cache.take_learned_stretch() {
            self.keep_leaf_stretch(&learned);
        }
        cache.take_learned_addresses(|words| self.keep_known_address(words));
    }

    /// Whether `addr` lies in a native module that holds no managed region:
    /// native code, known without a search of the managed regions.
    fn in_native_only(&self, addr: u64) -> bool {
        self.native_index_at(addr).is_some_and(|i| self.natives_with_managed.get(i) == Some(&false))
    }

    /// The native module containing `addr`.
    pub fn native_at(&self, addr: u64) -> Option<&NativeModule> {
        self.natives.get(self.native_index_at(addr)?)
    }

    /// Whether `addr` is in code the map knows.
    pub fn is_code(&self, addr: u64) -> bool {
        self.managed_at(addr).is_some() || self.native_at(addr).is_some()
    }

    /// The map's generation: no two maps share one, so what was found in
    /// a map can be kept beside its generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The map's lineage (see the field): equal for maps that know every
    /// address the first of them knew, as the same code.
    pub fn lineage(&self) -> u64 {
        self.lineage
    }

    /// The anonymous mapping containing `sp`: the bounds of a thread's stack.
    pub fn stack_containing(&self, sp: u64) -> Option<Range<u64>> {
        let i = self.stacks.partition_point(|r| r.start <= sp);
        let r = self.stacks.get(i.checked_sub(1)?)?;
        (sp < r.end).then(|| r.clone())
    }
}

/// What [`walk`] produced: `len` frames at the start of the output buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Walk {
    pub len: usize,
    pub flags: u32,
    /// The stack pointer of the last frame reached: how much of the stack
    /// the walk used.
    pub sp: u64,
    /// A hijacked return address the walk put back: the stack slot it
    /// belongs in, and the original (a copy of the stack needs it too).
    pub undone_hijack: Option<(u64, u64)>,
    /// How many frames, from the leaf, were found by unwind information,
    /// counting the first frame in code the map did not know: its callers
    /// are guesses (by return address or frame pointer).
    pub known_frames: usize,
    /// The frame after the last one in unknown code, if the walk got there:
    /// its index in the output and its registers. From it on, every frame
    /// was found by unwind information, so a walk that reaches the same
    /// frame again (the same address and stack pointer) can take the rest
    /// of this walk as it is.
    pub splice: Option<(usize, Regs)>,
    /// The first frame in unknown code, if any: its index in the output and
    /// the registers the walk stood at there (before stepping it). Every
    /// frame before it was found by unwind information; a copy of the stack
    /// from its stack pointer up is enough to walk it again (see
    /// [`walk_from`]).
    pub first_unknown: Option<(usize, Regs)>,
    /// How many frames from the leaf are native code before the first
    /// frame that is not (`None`: every frame is).
    pub entry_frames: Option<usize>,
    /// How many frames, from the leaf, came from a remembered path (see
    /// [`WalkCache::remember_paths`]).
    pub path_frames: usize,
    /// How many frames, at the root's end, came from the last complete
    /// walk's (see [`last_walk`]).
    pub rest_frames: usize,
    /// The leaf was stepped by a stretch kept in the process's table (see
    /// [`leaf_rules`]), not looked up in full.
    pub leaf_by_stretch: bool,
    /// The leaf, in native code, was stepped by its module's granule (see
    /// [`native_leaves`]), not looked up in full.
    pub leaf_by_granule: bool,
    /// Return addresses looked up in full (none of the tables knew them).
    pub looked_up: u32,
    /// Return addresses the thread's table did not hold and the process's
    /// did (see [`known_addresses`]).
    pub from_process_table: u32,
    /// Frames (leaf or return address) none of the tables knew that their
    /// function's compiled body rule stepped (see [`body_rules`]), not the
    /// full lookup.
    pub by_body_rule: u32,
}

/// One unwinding step's outcome.
enum Step {
    Next(Regs),
    /// The stack's root was reached.
    Done,
    /// Nothing could be recovered.
    Lost,
}

/// `ucontext_t` offsets (x86_64 glibc): `uc_mcontext.gregs` starts at 40;
/// `REG_RBP` is 10, `REG_RSP` 15, `REG_RIP` 16.
const UC_GREGS: u64 = 40;
const REG_RBP: u64 = 10;
const REG_RSP: u64 = 15;
const REG_RIP: u64 = 16;

/// Walks from `regs` (an interrupted thread's registers) towards the root,
/// writing one address per frame into `out`, leaf first; the leaf carries
/// [`EXACT_IP`]. Never allocates, never panics on bad input, and reads
/// memory only through `mem`.
pub fn walk<M: Memory>(map: &CodeMap, mem: &M, regs: Regs, cache: &mut WalkCache, out: &mut [u64]) -> Walk {
    walk_until(map, mem, regs, cache, out, None)
}

/// [`walk`], stopping (with [`flags::REACHED`]) before writing the frame
/// whose instruction pointer and stack pointer are `stop`.
///
/// The steps taken only for code the walk cache does not know (a full
/// managed or native lookup, framehop, stubs, unknown code, signal frames,
/// hijacks) are functions of their own, marked cold and never inlined: at
/// 100 samples a second this loop's own code is as cold in the instruction
/// cache as its data, and with those steps inlined it was 14 KB, of which
/// a walk of known frames runs a small part; without them, 8 to 9 KB, the
/// rare steps out of its way. On `taskfaults.cs` (.NET 10, six alternating
/// pairs of 6 s runs) the handler's median fell by 1.1 µs on average, five
/// pairs of six; on `pool.cs`, where walks seldom leave the known frames,
/// by 0.2 µs, within the runs' spread.
pub fn walk_until<M: Memory>(
    map: &CodeMap,
    mem: &M,
    regs: Regs,
    cache: &mut WalkCache,
    out: &mut [u64],
    stop: Option<(u64, u64)>,
) -> Walk {
    walk_from(map, mem, regs, true, cache, out, stop)
}

/// [`walk_until`], or, when not `from_leaf`, from a frame in the middle of
/// a stack: `regs.ip` is then a return address (a caller's frame), not an
/// exact instruction pointer, so its first frame is written without
/// [`EXACT_IP`] and looked up as the call before it, and the walk takes no
/// remembered path and leaves no last walk behind (both are of walks from a
/// leaf).
#[inline(always)]
pub fn walk_from<M: Memory>(
    map: &CodeMap,
    mem: &M,
    regs: Regs,
    from_leaf: bool,
    cache: &mut WalkCache,
    out: &mut [u64],
    stop: Option<(u64, u64)>,
) -> Walk {
    let mut len = 0;
    let mut flags = 0;
    cache.learned = None;
    cache.learned_address_count = 0;
    cache.looked_up = 0;
    cache.from_process_table = 0;
    let mut leaf_by_stretch = false;
    let mut leaf_by_granule = false;
    let mut by_body_rule = 0;
    let mut regs = regs;
    // The leaf, and a context a signal frame saved, are exact instruction
    // pointers: the thread was stopped there, not in a call.
    let mut exact = from_leaf;
    let mut undone_hijack = None;
    let mut known_frames = usize::MAX;
    let mut splice = None;
    let mut first_unknown = None;
    let mut tracker = WalkTracker::new();
    let mut cursor = 0;
    let mut rest_frames = 0;
    let mut entry_frames = None;
    // As far as the path a walk from the same place took still holds (see
    // [`walk_paths`]); only walks of one's own stack start there twice.
    let mut path_frames = 0;
    // Remembered paths and last walks are of walks from a leaf.
    let stop_or_caller = stop.is_some() || !from_leaf;
    if !stop_or_caller {
        if let Some(taken) = cache.paths.begin(map.lineage, regs, mem, out) {
            for j in 0..taken.frames {
                let (native, sp) = cache.paths.taken_frame(j).unwrap_or((false, 0));
                tracker.frame(j, sp, native, j == 0);
                if !native {
                    entry_frames.get_or_insert(j);
                }
            }
            len = taken.frames;
            path_frames = len;
            regs = taken.regs;
            exact = false;
        }
    } else {
        cache.paths.stop();
    }
    // A walk that took a remembered path repeats one made a moment ago
    // (an event storm): what it reads next is in the cache already.
    if path_frames == 0 {
        prefetch_frame_chain(map, mem, cache, regs);
    }
    let trampoline = map.hijack_trampoline();
    loop {
        if regs.ip == 0 {
            flags |= flags::COMPLETE;
            break;
        }
        if stop == Some((regs.ip, regs.sp)) {
            flags |= flags::REACHED;
            break;
        }
        // The rest of the stack, as the last complete walk found it, when
        // the stack still holds it (see [`last_walk`]). Not in a walk that
        // is to stop at a given frame: that frame may lie inside it.
        if stop.is_none() && !exact {
            if let Some((rest, root_sp)) = cache.last.frames_from(map.lineage, regs, &mut cursor, mem) {
                if let Some(room) = out.get_mut(len..len + rest.len()) {
                    room.copy_from_slice(rest);
                    len += rest.len();
                    regs.sp = root_sp;
                    flags |= flags::COMPLETE;
                    rest_frames = rest.len();
                    break;
                }
            }
        }
        // A return address that is the hijack trampoline's first byte, and
        // was not put back (the memory could not say what it replaced): the
        // real caller is unknown, and the code before the trampoline, whose
        // row a lookup would find, is no caller at all. The walk stops
        // rather than invent one.
        if !exact && trampoline == Some(regs.ip) {
            flags |= flags::LOST;
            break;
        }
        let Some(slot) = out.get_mut(len) else {
            flags |= flags::TRUNCATED;
            break;
        };
        *slot = if exact { regs.ip | EXACT_IP } else { regs.ip };
        len += 1;
        if !map.roots.is_empty() && map.roots.iter().any(|r| r.contains(&regs.ip)) {
            tracker.frame(len - 1, regs.sp, true, exact);
            flags |= flags::COMPLETE;
            break;
        }
        if !exact && map.sigreturn != 0 && regs.ip == map.sigreturn {
            // The handler's frame returned into the kernel's signal
            // trampoline: the saved context (`ucontext_t`) starts right where
            // the return address was popped from.
            tracker.frame(len - 1, regs.sp, false, false);
            entry_frames.get_or_insert(len - 1);
            cache.paths.stop();
            match signal_context(mem, regs.sp) {
                Some(next) => {
                    flags |= flags::SIGNAL_FRAME;
                    regs = next;
                    exact = true;
                    continue;
                }
                None => {
                    flags |= flags::LOST;
                    break;
                }
            }
        }
        let lookup = if exact { regs.ip } else { regs.ip - 1 };
        let mut unknown = false;
        let mut native_frame = false;
        // An exact address in a stretch of code met lately: its rule, with
        // no region, function, record or row looked up (see [`leaf_rules`]).
        let by_leaf_rule = if exact && len == 1 {
            // Else, native code: its module's granule (see [`native_leaves`]).
            leaf_rule_step(map, mem, regs).inspect(|_| leaf_by_stretch = true).or_else(|| {
                let (next, rule) = native_leaves::native_leaf_step(map, mem, regs, cache)?;
                leaf_by_granule = true;
                Some((next, true, rule))
            })
        } else {
            None
        };
        let hit = if by_leaf_rule.is_some() {
            None
        } else {
            // A return address not in the thread's table may be in the
            // process's, learned by another thread: copied into the
            // thread's, where the next walk finds it first.
            let shared = |cache: &mut WalkCache| {
                let k = map.process_learning.known_addresses.find(map.lineage, lookup)?;
                cache.from_process_table += 1;
                cache.known.remember(map.lineage, k);
                Some(k)
            };
            match cache.known.find(map.lineage, lookup) {
                Some(k) => Some(KnownFrame { native: k.native, region: None, entry: k.entry, rule: k.rule }),
                None if exact => cache.leaves.find(map.generation, lookup).map(|(region, entry)| KnownFrame {
                    native: false,
                    region: Some(region),
                    entry,
                    rule: FrameRule::default(),
                }),
                None => {
                    shared(cache).map(|k| KnownFrame { native: k.native, region: None, entry: k.entry, rule: k.rule })
                }
            }
        };
        // A return address met before: its rule reads the caller from the
        // stack, with no region, table or record touched. For a native frame
        // that is its row's rule, kept when the row was first looked up: at
        // 100 samples a second the module's table is cold, and its lookup
        // was three misses one after the other (page index, row starts, row
        // rules), each on a page of its own.
        let by_rule = match hit {
            Some(h) if !exact => h.rule.apply(mem, regs),
            _ => None,
        };
        let native_hit = hit.is_some_and(|h| h.native);
        // A return address met before at a thread's root (its row leaves
        // the return address undefined): the walk ends, with no row or
        // module looked up.
        let outermost = !exact && native_hit && hit.is_some_and(|h| h.rule.is_outermost());
        let mut end_of_stack = outermost;
        // A return address no table knew, in native code: its module's
        // granule, as for a leaf (see [`native_leaves`]).
        let by_granule = match (hit, &by_leaf_rule) {
            (None, None) if !exact => native_leaves::native_return_step(map, mem, regs, lookup),
            _ => None,
        };
        let region_index = match hit {
            _ if by_rule.is_some() || by_leaf_rule.is_some() || outermost || by_granule.is_some() => None,
            Some(h) if !native_hit => h.region.map(|r| r as usize).or_else(|| map.managed_index_at(lookup)),
            Some(_) => None,
            // In a module of native code alone, the search of the managed
            // regions (several cold reads at 100 samples a second) is not
            // made: for a leaf (an exact address is seldom in the walk
            // cache), or a return address met for the first time.
            None if map.in_native_only(lookup) => None,
            None => map.managed_index_at(lookup),
        };
        let region = region_index.and_then(|i| map.managed.get(i));
        // The rule this frame was stepped by, if a remembered path can hold
        // it (see [`walk_paths`]).
        let mut tracked = None;
        let hijacks_before = flags & flags::HIJACKED;
        let step = if outermost {
            native_frame = true;
            Step::Done
        } else if let Some((next, native, rule)) = by_leaf_rule {
            // The same step at the same address next time: a path holds it
            // (an event walk's first frame is its own code, whose stretch
            // another thread's walk may have kept before this one's first).
            tracked = Some(Tracked::Frame(rule));
            if native {
                native_frame = true;
                Step::Next(next)
            } else {
                managed_caller(map, mem, cache, regs, next, &mut flags, &mut undone_hijack)
            }
        } else if let Some((next, module, rule)) = by_granule {
            native_frame = true;
            let kept = RowRule::Step(rule).kept().unwrap_or(FrameRule::UNSUITABLE);
            cache.learn(map.lineage, KnownAddress::new(lookup, module as u32, kept, true));
            tracked = Some(Tracked::Native(rule));
            Step::Next(next)
        } else if let Some(next) = by_rule {
            tracked = hit.map(|h| Tracked::Frame(h.rule));
            if native_hit {
                native_frame = true;
                Step::Next(next)
            } else {
                managed_caller(map, mem, cache, regs, next, &mut flags, &mut undone_hijack)
            }
        } else if let Some(region) = region.filter(|r| r.frameless) {
            stub_step(map, mem, regs, exact, region, len == 1, cache)
        } else if let Some(region) = region {
            let mut entry = hit.map(|h| h.entry);
            let mut rule = hit.map_or(FrameRule::default(), |h| h.rule);
            let untried = rule.is_untried();
            // A frame in its function's body: the rule compiled for it (see
            // [`body_rules`]), with no record or code read.
            let by_body = if untried && (!exact || len == 1) {
                body_rule_step(region, mem, regs, exact, &mut entry)
            } else {
                None
            };
            let step = if let Some((next, body_rule, body)) = by_body {
                by_body_rule += 1;
                if exact {
                    cache.learned = Some(LearnedStretch::new(map.lineage, regs.ip, body, false, body_rule));
                } else {
                    rule = body_rule;
                }
                Some(Step::Next(next))
            } else {
                let step = managed_step(region, mem, regs, exact, &mut entry, &mut rule);
                if let (true, 1, Some(entry), Some(Step::Next(next))) = (exact, len, entry, &step) {
                    if let Some((body, rule)) =
                        body_rule(region, mem, entry).filter(|(_, r)| r.apply(mem, regs) == Some(*next))
                    {
                        cache.learned = Some(LearnedStretch::new(map.lineage, regs.ip, body, false, rule));
                    }
                }
                step
            };
            if let (Some(entry), Some(i)) = (entry, region_index) {
                if exact {
                    // An exact address is seldom met again; its function is.
                    if let (None, Some(function)) = (hit, function_range(region, entry)) {
                        cache.leaves.remember(map.generation, function, i as u32, entry);
                    }
                } else if hit.is_none_or(|h| h.rule != rule) {
                    cache.learn(map.lineage, KnownAddress::new(lookup, entry, rule, false));
                }
            }
            // A rule derived just now gave this very step (else it is not
            // kept); one known before, that did not serve here, is not it.
            if !exact && untried && rule.is_known() {
                tracked = Some(Tracked::Frame(rule));
            }
            match step {
                Some(Step::Next(next)) => managed_caller(map, mem, cache, regs, next, &mut flags, &mut undone_hijack),
                Some(step) => step,
                None => {
                    unknown = true;
                    let step = unknown_step(map, mem, regs, exact);
                    hijack_undone(map, mem, cache, regs, step, &mut flags, &mut undone_hijack)
                }
            }
        } else if let Some(h) = hit.filter(|_| native_hit) {
            native_frame = true;
            let module = map.natives.get(h.entry as usize).filter(|m| m.code.contains(&lookup));
            let (step, rule) = native_frame_step(map, module, mem, regs, exact, len == 1, cache);
            end_of_stack |= matches!(rule, Some(RowRule::EndOfStack));
            if let Some(kept) = rule.filter(|_| !exact && !h.rule.is_known()).and_then(|r| r.kept()) {
                cache.learn(map.lineage, KnownAddress::new(lookup, h.entry, kept, true));
            }
            tracked = rule.and_then(|r| r.step_rule()).map(Tracked::Native);
            step
        } else if let Some(stub) = map.hijack_stub.as_ref().filter(|s| s.range.contains(&lookup)) {
            hijack_stub_step(map, mem, regs, exact, stub)
        } else if let Some(index) = map.native_index_at(lookup) {
            let module = map.natives.get(index);
            native_frame = true;
            let (step, rule) = native_frame_step(map, module, mem, regs, exact, len == 1, cache);
            end_of_stack |= matches!(rule, Some(RowRule::EndOfStack));
            // For a native frame, `entry` is its module; the rule is its
            // row's. A return address only: an exact address is seldom met
            // again (its row is kept in the leaf stretches), and would take
            // the place of one that is.
            if !exact {
                let rule_kept = rule.and_then(|r| r.kept()).unwrap_or(FrameRule::UNSUITABLE);
                cache.learn(map.lineage, KnownAddress::new(lookup, index as u32, rule_kept, true));
            }
            tracked = rule.and_then(|r| r.step_rule()).map(Tracked::Native);
            step
        } else {
            unknown = true;
            let step = unknown_step(map, mem, regs, exact);
            hijack_undone(map, mem, cache, regs, step, &mut flags, &mut undone_hijack)
        };
        if unknown {
            flags |= flags::UNKNOWN_CODE;
            known_frames = known_frames.min(len);
            first_unknown.get_or_insert((len - 1, regs));
        }
        tracker.frame(len - 1, regs.sp, native_frame, exact);
        if !native_frame {
            entry_frames.get_or_insert(len - 1);
        }
        if flags & flags::HIJACKED != hijacks_before {
            // Its caller's address came from the runtime's thread object,
            // not from the stack: no path can hold that step.
            tracked = None;
        }
        match step {
            // The stack grows down: every caller's frame is above its callee's.
            Step::Next(next) if next.sp > regs.sp => {
                cache.paths.step(len - 1, regs, next, tracked, native_frame);
                if unknown {
                    splice = Some((len, next));
                }
                regs = next;
                exact = false;
            }
            Step::Next(_) | Step::Lost => {
                flags |= flags::LOST;
                break;
            }
            Step::Done => {
                flags |= flags::COMPLETE;
                if end_of_stack {
                    flags |= flags::END_OF_STACK;
                }
                break;
            }
        }
    }
    if !stop_or_caller && rest_frames == 0 {
        tracker.finish(&mut cache.last, map.lineage, &out[..len], flags);
    }
    if !stop_or_caller {
        cache.paths.finish(map.lineage, &out[..len]);
    }
    let splice = splice.filter(|&(i, _)| i < len);
    let first_unknown = first_unknown.filter(|&(i, _)| i < len);
    Walk {
        len,
        flags,
        sp: regs.sp,
        undone_hijack,
        known_frames: known_frames.min(len),
        splice,
        first_unknown,
        entry_frames,
        path_frames,
        rest_frames,
        leaf_by_stretch,
        leaf_by_granule,
        looked_up: cache.looked_up,
        from_process_table: cache.from_process_table,
        by_body_rule,
    }
}

/// How many frames [`prefetch_frame_chain`] looks ahead.
const PREFETCH_FRAMES: usize = 32;

/// At 100 samples a second a walk finds the stack and the walk cache cold,
/// and a frame's two misses come one after the other: its cache entry (by
/// its return address), then the stack word the entry's rule points at. The
/// frame-pointer chain (which the JIT's frames and many native ones keep)
/// gives the return addresses ahead of the walk for one miss a frame, and
/// their cache entries are prefetched on the way, all at once. Where the
/// chain is not a chain (a frame pointer used as a plain register), it
/// stops at the first link that is not inside the stack and above the last.
/// Only hints: what the walk reads, it reads and checks itself.
fn prefetch_frame_chain<M: Memory>(map: &CodeMap, mem: &M, cache: &WalkCache, regs: Regs) {
    mem.prefetch(cache.known.line_of(regs.ip));
    mem.prefetch(map.process_learning.leaf_rules.line_of(regs.ip));
    // The chain's links are read one after the other, each a miss of its
    // own: none past where the walk will take the thread's remembered
    // start whole.
    let end = cache.last.start_sp().unwrap_or(u64::MAX);
    let (mut bp, mut below) = (regs.bp, regs.sp);
    for _ in 0..PREFETCH_FRAMES {
        if bp < below || bp >= end {
            break;
        }
        let (Some(next), Some(ra)) = (mem.stack_word(bp), mem.stack_word(bp.wrapping_add(8))) else { break };
        mem.prefetch(cache.known.line_of(ra.wrapping_sub(1)));
        below = bp.wrapping_add(16);
        bp = next;
    }
}

/// The step out of a managed frame to `next`, its caller. Managed code
/// returns into native code only at a few transitions (the thread's entry,
/// callbacks from native code); a hijacked return is one of them to the eye,
/// and is undone. A caller met before as managed code (in the walk cache)
/// is not searched for again.
fn managed_caller<M: Memory>(
    map: &CodeMap,
    mem: &M,
    cache: &WalkCache,
    regs: Regs,
    mut next: Regs,
    flags: &mut u32,
    undone_hijack: &mut Option<(u64, u64)>,
) -> Step {
    let caller = next.ip.wrapping_sub(1);
    let known_managed = cache.known.find(map.lineage, caller).is_some_and(|k| !k.native);
    if next.sp > regs.sp && !known_managed && map.managed_at(caller).is_none() {
        if let Some(real) = mem.hijacked_return(next.sp - 8, next.ip) {
            *flags |= flags::HIJACKED;
            *undone_hijack = Some((next.sp - 8, real));
            next.ip = real;
        }
    }
    Step::Next(next)
}

/// A step over unknown code (a managed function the map does not list
/// yet, stepped over by its frame pointer or return address): if it lands
/// on the hijack trampoline, the runtime hijacked that frame's return
/// address, and it is put back as for a managed frame's step. Only for the
/// trampoline known from libcoreclr's code: learning it from a guess about
/// unknown code could take a stale hijack for a live one.
#[cold]
#[inline(never)]
fn hijack_undone<M: Memory>(
    map: &CodeMap,
    mem: &M,
    cache: &WalkCache,
    regs: Regs,
    step: Step,
    flags: &mut u32,
    undone_hijack: &mut Option<(u64, u64)>,
) -> Step {
    match step {
        Step::Next(next) if map.hijack_trampoline() == Some(next.ip) => {
            managed_caller(map, mem, cache, regs, next, flags, undone_hijack)
        }
        step => step,
    }
}

#[cold]
#[inline(never)]
fn signal_context<M: Memory>(mem: &M, uc: u64) -> Option<Regs> {
    let greg = |r: u64| mem.stack_word(uc.checked_add(UC_GREGS + 8 * r)?);
    Some(Regs { ip: greg(REG_RIP)?, sp: greg(REG_RSP)?, bp: greg(REG_RBP)? })
}

/// A native frame's step: by its row in the module's table when the row has
/// a rule (a few reads of one array, and the same rule framehop would make
/// of that row), else by framehop.
/// `leaf`: the walk's first frame, whose row is kept with its rule for the
/// next samples (see [`leaf_rules`]).
#[cold]
#[inline(never)]
fn native_frame_step<M: Memory>(
    map: &CodeMap,
    module: Option<&NativeModule>,
    mem: &M,
    regs: Regs,
    exact: bool,
    leaf: bool,
    cache: &mut WalkCache,
) -> (Step, Option<RowRule>) {
    let lookup = if exact { regs.ip } else { regs.ip.wrapping_sub(1) };
    match module.and_then(|m| m.table.as_ref()).and_then(|t| t.row_at(lookup)) {
        Some((RowRule::Step(rule), row)) => {
            let next = rule.caller(mem, regs);
            if let (true, Some(next), Some(kept)) = (leaf && exact, next, rule.as_frame_rule()) {
                if kept.apply(mem, regs) == Some(next) {
                    cache.learned = Some(LearnedStretch::new(map.lineage, regs.ip, row, true, kept));
                }
            }
            (next.map_or(Step::Lost, Step::Next), Some(RowRule::Step(rule)))
        }
        // The CFI says nothing called this frame: the thread's root.
        Some((RowRule::EndOfStack, _)) => (Step::Done, Some(RowRule::EndOfStack)),
        None => (native_step(map, mem, regs, exact), None),
    }
}

/// The walk's first frame stepped by the rule of a stretch of code met
/// lately that holds its address: a native row, or a managed function's
/// body when no epilogue starts at the address. With whether it is native,
/// and the rule.
fn leaf_rule_step<M: Memory>(map: &CodeMap, mem: &M, regs: Regs) -> Option<(Regs, bool, FrameRule)> {
    let stretch = map.process_learning.leaf_rules.find(map.lineage, regs.ip)?;
    if !stretch.native && !stretch.rule.holds_in_epilogue() {
        let code = mem.leaf_code(regs.ip..stretch.end.min(regs.ip.saturating_add(8)))?;
        if leaf_rules::may_begin_epilogue(code) {
            return None;
        }
    }
    Some((stretch.rule.apply(mem, regs)?, stretch.native, stretch.rule))
}

/// A managed frame stepped by its function's compiled body rule (see
/// [`body_rules`]): the caller, the rule and the body, where the region has
/// rules, the function's has one and the address lies in its body (for a
/// leaf, `exact`, at code that begins no epilogue). `entry` as for
/// [`managed_step`]: set when found, for the full lookup if this declines.
#[cold]
#[inline(never)]
fn body_rule_step<M: Memory>(
    region: &ManagedCode,
    mem: &M,
    regs: Regs,
    exact: bool,
    entry: &mut Option<u32>,
) -> Option<(Regs, FrameRule, Range<u64>)> {
    if region.body_rules.is_empty() {
        return None;
    }
    let lookup = if exact { regs.ip } else { regs.ip - 1 };
    let lookup_rva = u32::try_from(lookup.checked_sub(region.base)?).ok()?;
    let at = match *entry {
        Some(at) => at,
        None => u32::try_from(function_pages::entry_of(&region.functions, &region.function_pages, lookup_rva)?).ok()?,
    };
    *entry = Some(at);
    let function = function_range(region, at)?;
    if !function.contains(&lookup) {
        return None;
    }
    let (rule, prologue) = region.body_rule_at(at)?;
    let body = function.start.checked_add(u64::from(prologue))?..function.end;
    // As the full lookup reads it: a call as the function's last
    // instruction returns to its end, and is unwound from just before.
    let address = if regs.ip < function.end { regs.ip } else { lookup };
    if address < body.start {
        return None;
    }
    if exact && !rule.holds_in_epilogue() {
        let code = mem.leaf_code(regs.ip..function.end.min(regs.ip.saturating_add(8)))?;
        if leaf_rules::may_begin_epilogue(code) {
            return None;
        }
    }
    Some((rule.apply(mem, regs)?, rule, body))
}

/// The body of the function whose `RUNTIME_FUNCTION` is at byte `entry` of
/// `region`'s table (from the end of its prologue to its end), and the rule
/// that steps out of it there, where its record is of the plain shape
/// [`FrameRule`] describes.
#[cold]
#[inline(never)]
fn body_rule<M: Memory>(region: &ManagedCode, mem: &M, entry: u32) -> Option<(Range<u64>, FrameRule)> {
    let function = function_range(region, entry)?;
    let info = unwind_info(region, mem, table_rva(&region.functions, entry as usize + 8)?)?;
    if large_frame::uses_large_frame(info) {
        return None;
    }
    let prologue = *info.get(1)?;
    let rule = FrameRule::derive(info, u32::from(prologue))?;
    Some((function.start.checked_add(u64::from(prologue))?..function.end, rule))
}

/// The `UNWIND_INFO` record at `rva` of `region` (to the end of the bytes
/// that hold it, for a copied one).
fn unwind_info<'a, M: Memory>(region: &'a ManagedCode, mem: &'a M, rva: u32) -> Option<&'a [u8]> {
    match &region.unwind {
        UnwindBytes::Copied { rva: first, bytes } => {
            let slice = bytes.get(rva.checked_sub(*first)? as usize..)?;
            (!slice.is_empty()).then_some(slice)
        }
        UnwindBytes::InCode => {
            let start = region.base.checked_add(u64::from(rva))?;
            let header = mem.code_bytes(region, start..start.checked_add(4)?)?;
            let len = unwind_info_len([header[0], header[1], header[2], header[3]]);
            mem.code_bytes(region, start..start + len as u64)
        }
    }
}

/// For tests: a native frame at `regs` (a leaf when `exact`, else a return
/// address) unwound by its module's row table and by framehop, when the
/// table has a rule for it.
#[doc(hidden)]
pub fn native_frame_both_ways<M: Memory>(
    map: &CodeMap,
    mem: &M,
    regs: Regs,
    exact: bool,
) -> Option<(Option<Regs>, Option<Regs>)> {
    // framehop's cache pool lives while a share of it does.
    let _pool = framehop_caches::Share::new();
    let lookup = if exact { regs.ip } else { regs.ip.wrapping_sub(1) };
    let (row, _) = map.native_at(lookup)?.table.as_ref()?.row_at(lookup)?;
    // Nothing to compare while every cache of framehop's pool is lent out
    // (another test holds them all: `caches_are_lent_once_each_...`); a
    // walk would lose the frame then, by design.
    let mut rules = framehop_caches::borrow()?;
    let framehop = match native_step_with(map, mem, regs, exact, &mut rules) {
        Step::Next(next) => Some(next),
        Step::Done => Some(Regs { ip: 0, ..regs }),
        Step::Lost => None,
    };
    drop(rules);
    let table = match row {
        RowRule::Step(rule) => rule.caller(mem, regs),
        // The end of the stack, as framehop's is given above.
        RowRule::EndOfStack => Some(Regs { ip: 0, ..regs }),
    };
    Some((table, framehop))
}

/// For tests: a native frame at `regs` (a leaf when `exact`, else a return
/// address) stepped by its module's granule (see [`native_leaves`]), when
/// the granule has a rule there.
#[doc(hidden)]
pub fn native_frame_by_granule<M: Memory>(map: &CodeMap, mem: &M, regs: Regs, exact: bool) -> Option<Regs> {
    if exact {
        native_leaves::native_leaf_step(map, mem, regs, &mut WalkCache::new()).map(|(next, _)| next)
    } else {
        native_leaves::native_return_step(map, mem, regs, regs.ip.wrapping_sub(1)).map(|(next, _, _)| next)
    }
}

/// The size of the native modules' row tables, in bytes.
pub fn native_table_bytes(map: &CodeMap) -> usize {
    map.natives.iter().map(NativeModule::table_bytes).sum()
}

#[cold]
#[inline(never)]
fn native_step<M: Memory>(map: &CodeMap, mem: &M, regs: Regs, exact: bool) -> Step {
    // A return address of 0 ends the stack, cache or not.
    if !exact && FrameAddress::from_return_address(regs.ip).is_none() {
        return Step::Done;
    }
    // With every cache of the pool in use, the frame is lost (counted as
    // such): it takes more walks through framehop at once than the pool
    // holds.
    let Some(mut rules) = framehop_caches::borrow() else { return Step::Lost };
    native_step_with(map, mem, regs, exact, &mut rules)
}

/// [`native_step`] with a cache of framehop's pool.
fn native_step_with<M: Memory>(
    map: &CodeMap,
    mem: &M,
    regs: Regs,
    exact: bool,
    rules: &mut framehop::x86_64::CacheX86_64<framehop::MustNotAllocateDuringUnwind>,
) -> Step {
    let address = if exact {
        FrameAddress::from_instruction_pointer(regs.ip)
    } else {
        match FrameAddress::from_return_address(regs.ip) {
            Some(a) => a,
            None => return Step::Done,
        }
    };
    let mut fregs = UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp);
    let mut read = |addr: u64| mem.stack_word(addr).ok_or(());
    match map.unwinder.unwind_frame(address, &mut fregs, rules, &mut read) {
        Ok(Some(ra)) => Step::Next(Regs { ip: ra, sp: fregs.sp(), bp: fregs.bp() }),
        Ok(None) => Step::Done,
        Err(_) => Step::Lost,
    }
}

/// The registers pe-unwind-info asks for; only RSP and RBP matter for
/// finding return addresses (the JIT frames on RBP or not at all).
struct PeState<'a, M> {
    sp: u64,
    bp: u64,
    mem: &'a M,
}

impl<M: Memory> UnwindState for PeState<'_, M> {
    fn read_register(&mut self, register: Register) -> u64 {
        match register {
            Register::RSP => self.sp,
            Register::RBP => self.bp,
            _ => 0,
        }
    }

    fn read_stack(&mut self, addr: u64) -> Option<u64> {
        self.mem.stack_word(addr)
    }

    fn write_register(&mut self, register: Register, value: u64) {
        match register {
            Register::RSP => self.sp = value,
            Register::RBP => self.bp = value,
            _ => {}
        }
    }

    fn write_xmm_register(&mut self, _register: XmmRegister, _value: u128) {}
}

/// One step through a managed frame by its `UNWIND_INFO`. `None` when the
/// region has no function-table entry for the address (a gap in an image).
/// `int3`s: what pe-unwind-info is shown in place of code that must not be
/// read as an epilogue. Functions longer than this (there are few) come back
/// as not unwindable in that case rather than wrong.
static NOT_AN_EPILOGUE: [u8; 65536] = [0xcc; 65536];

/// Whether `code` (at address `at`) starts with a relative `jmp` whose target
/// lies inside the function `begin..end`, excluding its first byte (a jump
/// there is a recursive tail call).
fn jumps_within(code: &[u8], at: u64, begin: u64, end: u64) -> bool {
    let target = match code {
        [0xeb, d, ..] => (at + 2).wrapping_add_signed(i64::from(*d as i8)),
        [0xe9, a, b, c, d, ..] => (at + 5).wrapping_add_signed(i64::from(i32::from_le_bytes([*a, *b, *c, *d]))),
        _ => return false,
    };
    target > begin && target < end
}

/// `entry`: the byte offset of the frame's `RUNTIME_FUNCTION` in the
/// region's table, if known (a [`WalkCache`] hit); set when found. `rule`:
/// for a return address whose rule was not tried yet, derived from the
/// record and kept if it gives the caller this full unwind gives.
#[cold]
#[inline(never)]
fn managed_step<M: Memory>(
    region: &ManagedCode,
    mem: &M,
    regs: Regs,
    exact: bool,
    entry: &mut Option<u32>,
    rule: &mut FrameRule,
) -> Option<Step> {
    let lookup = if exact { regs.ip } else { regs.ip - 1 };
    let lookup_rva = u32::try_from(lookup.checked_sub(region.base)?).ok()?;
    // pe-unwind-info pops a return address when the table has no entry:
    // only ask it about addresses that have one. It is handed a table of
    // that one entry: it looks the address up again itself, and a search of
    // a large image's table (CoreLib's) is cache misses all the way down.
    let at = match *entry {
        Some(at) => at as usize,
        None => function_pages::entry_of(&region.functions, &region.function_pages, lookup_rva)?,
    };
    *entry = u32::try_from(at).ok();
    let entries = FunctionTableEntries::parse(region.functions.get(at..at + 12)?);
    let function = entries.lookup(lookup_rva)?;
    // A call as a function's last instruction returns to the first byte
    // after it; unwind as from inside the function then.
    let ip_rva = u32::try_from(regs.ip - region.base).ok()?;
    let rva = if ip_rva < function.end_address.get() { ip_rva } else { lookup_rva };
    // pe-unwind-info asks for two kinds of bytes: the code from the
    // address to the function's end (to recognise an epilogue), and unwind
    // records. Both are handed out exactly, so nothing outside a function or
    // a record is ever read.
    let function_end = region.base + u64::from(function.end_address.get());
    let memory_at_rva = |r: u32| -> Option<&[u8]> {
        if r == rva {
            let start = region.base + u64::from(r);
            let code = mem.code_bytes(region, start..function_end.max(start))?;
            // pe-unwind-info takes any `jmp rel` at the address for the end
            // of an epilogue, so a frame whose return address is a jump back
            // into its own loop (`call; jmp loop`, common in JIT code) would
            // be unwound as if about to return: its caller lost. Windows'
            // rule, which CoreCLR's unwinder follows: a jump to inside the
            // function (past its first byte) is not an epilogue. Such a
            // frame gets bytes that are no epilogue instruction instead.
            if jumps_within(code, start, region.base + u64::from(function.begin_address.get()), function_end) {
                return NOT_AN_EPILOGUE.get(..code.len());
            }
            return Some(code);
        }
        unwind_info(region, mem, r)
    };
    if let Some(info) = memory_at_rva(function.unwind_info_address.get()) {
        if large_frame::uses_large_frame(info) {
            let at = region.base + u64::from(rva);
            let code = mem.code_bytes(region, at..function_end.max(at)).unwrap_or(&[]);
            let offset = u64::from(rva - function.begin_address.get());
            return Some(large_frame::step(info, mem, regs, offset, code));
        }
    }
    let mut state = PeState { sp: regs.sp, bp: regs.bp, mem };
    let step = match entries.unwind_frame(&mut state, memory_at_rva, rva) {
        Some(ra) => Step::Next(Regs { ip: ra, sp: state.sp, bp: state.bp }),
        None => Step::Lost,
    };
    if !exact && rule.is_untried() {
        let derived = memory_at_rva(function.unwind_info_address.get())
            .and_then(|info| FrameRule::derive(info, rva.checked_sub(function.begin_address.get())?));
        *rule = match (derived, &step) {
            (Some(derived), Step::Next(next)) if derived.apply(mem, regs) == Some(*next) => derived,
            _ => FrameRule::UNSUITABLE,
        };
    }
    Some(step)
}

/// The addresses of the function whose `RUNTIME_FUNCTION` is at byte `entry`
/// of `region`'s table.
fn function_range(region: &ManagedCode, entry: u32) -> Option<Range<u64>> {
    let at = entry as usize;
    let (begin, end) = (table_rva(&region.functions, at)?, table_rva(&region.functions, at + 4)?);
    Some(region.base + u64::from(begin)..region.base + u64::from(end))
}

/// The little-endian RVA at byte `at` of a function table.
fn table_rva(table: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(table.get(at..at + 4)?.try_into().ok()?))
}

/// The size of an `UNWIND_INFO` record from its 4-byte header: the codes
/// (an even count of 2-byte slots), then a chained `RUNTIME_FUNCTION` or an
/// exception handler's RVA. Handler data after that RVA is never read.
pub fn unwind_info_len(header: [u8; 4]) -> usize {
    const UNW_FLAG_EHANDLER: u8 = 1;
    const UNW_FLAG_UHANDLER: u8 = 2;
    const UNW_FLAG_CHAININFO: u8 = 4;
    let flags = header[0] >> 3;
    let codes = (usize::from(header[2]) + 1) & !1;
    let trailer = if flags & UNW_FLAG_CHAININFO != 0 {
        12
    } else if flags & (UNW_FLAG_EHANDLER | UNW_FLAG_UHANDLER) != 0 {
        4
    } else {
        0
    };
    4 + 2 * codes + trailer
}

/// Code the map does not know. At the leaf, a stub or a frameless method
/// that has pushed nothing has its return address on top of the stack; trust
/// it when it points into known code. Otherwise follow the frame pointer.
#[cold]
#[inline(never)]
fn unknown_step<M: Memory>(map: &CodeMap, mem: &M, regs: Regs, exact: bool) -> Step {
    if exact {
        if let Some(ra) = mem.stack_word(regs.sp) {
            if map.is_code(ra) {
                return Step::Next(Regs { ip: ra, sp: regs.sp + 8, bp: regs.bp });
            }
        }
    }
    frame_pointer_step(mem, regs)
}

/// Out of the hijack trampoline, from the return site of its call (the only
/// place its slot surely holds the real return address, which is into
/// managed code: only managed methods are hijacked, and the worker fills
/// the slot first thing).
#[cold]
#[inline(never)]
fn hijack_stub_step<M: Memory>(map: &CodeMap, mem: &M, regs: Regs, exact: bool, stub: &HijackStub) -> Step {
    if exact || regs.ip != stub.call_return {
        return Step::Lost;
    }
    let (Some(ip), Some(bp)) = (mem.stack_word(regs.sp + stub.return_slot), mem.stack_word(regs.sp + stub.saved_bp))
    else {
        return Step::Lost;
    };
    // Into managed code, or into code not known yet (a method body not
    // learned yet, which the walk then treats as unknown code); never into
    // a native module.
    if ip == 0 || (map.managed_at(ip).is_none() && map.native_at(ip).is_some()) {
        return Step::Lost;
    }
    Step::Next(Regs { ip, sp: regs.sp + stub.return_slot + 8, bp })
}

/// A runtime stub ([`ManagedCode::frameless`]): at the leaf, the return
/// address is on top of the stack, or just under a word or two the stub
/// pushed; a stub met as a caller (it called out, which stubs do only on
/// their slow paths) goes on by the frame pointer.
///
/// A stub's instruction has the same words pushed above it whenever it
/// runs, so a leaf's step, where a return address was found, is kept as a
/// stretch of that one instruction (see [`leaf_rules`]): samples fall again
/// and again on the same few instructions of precode and dispatch stubs
/// (on `pool.cs`, 35 of 1,900 samples on one), and each was about 4 µs of
/// searches (the region, then every word's code lookup).
#[cold]
#[inline(never)]
fn stub_step<M: Memory>(
    map: &CodeMap,
    mem: &M,
    regs: Regs,
    exact: bool,
    region: &ManagedCode,
    leaf: bool,
    cache: &mut WalkCache,
) -> Step {
    if exact {
        for offset in [0u64, 8, 16] {
            if let Some(ra) = mem.stack_word(regs.sp + offset) {
                if map.is_code(ra) && !region.code.contains(&ra) {
                    if leaf {
                        let rule = FrameRule::known(false, offset as i32, None);
                        let at = regs.ip..regs.ip + 1;
                        cache.learned = Some(LearnedStretch::new(map.lineage, regs.ip, at, false, rule));
                    }
                    return Step::Next(Regs { ip: ra, sp: regs.sp + offset + 8, bp: regs.bp });
                }
            }
        }
        // Into code not learned yet: the word on top, as any leaf stub.
        if let Some(ra) = mem.stack_word(regs.sp) {
            return Step::Next(Regs { ip: ra, sp: regs.sp + 8, bp: regs.bp });
        }
        return Step::Lost;
    }
    frame_pointer_step(mem, regs)
}

fn frame_pointer_step<M: Memory>(mem: &M, regs: Regs) -> Step {
    if regs.bp < regs.sp || !regs.bp.is_multiple_of(8) {
        return Step::Lost;
    }
    match (mem.stack_word(regs.bp), mem.stack_word(regs.bp + 8)) {
        (Some(bp), Some(ra)) => Step::Next(Regs { ip: ra, sp: regs.bp + 16, bp }),
        _ => Step::Lost,
    }
}

mod large_frame;

#[cfg(test)]
mod tests;
