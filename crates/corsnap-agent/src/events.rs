//! Stacks at the moments that matter: exceptions, class loads and garbage
//! collections, walked synchronously on the thread the event happens on.
//!
//! A synchronous walk (`DoStackSnapshot` of the current thread, inside the
//! runtime's callback) needs no seed, no suspension and none of the
//! cross-thread rules. The callback captures the raw stack and the subject
//! (a `ClassID`, valid beyond the callback, unlike the `ObjectID` it came
//! from) and counts them in a tally of distinct stacks (or, for the rarer
//! events, queues them); the sampler thread names and sends them later, so
//! no callback ever holds a lock across a call into the runtime (Rule 3).

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use corsnap_abi::event_walk::{
    callers_frame, count_on_ticket, frames_hash, replay_own_stack, walk_own_stack, Counted, OwnStackCopy, OwnWalk,
    Replayed,
};
use corsnap_abi::{ClassID, CorProfilerInfo, ThreadID};
use corsnap_unwind::{Regs, Walk};
use corsnap_wire::EventKind;

/// Events waiting beyond this many are dropped (and counted): a program
/// throwing without end must not grow the agent without end.
const MAX_PENDING: usize = 200_000;
/// Frames kept per event stack.
const MAX_EVENT_FRAMES: usize = 1024;
/// Frames a tallied walk keeps on the throwing thread's own stack; deeper
/// stacks spill to the heap.
const INLINE_FRAMES: usize = 128;
/// Words ahead of the frames in a tally key: kind, thread, OS thread, class,
/// and the stack's form ([`TRUNCATED_BIT`], [`RAW_BIT`], walk flags above).
const KEY_HEAD: usize = 5;
/// In a tally key's last head word: the stack was cut short.
const TRUNCATED_BIT: u64 = 1;
/// In a tally key's last head word: the frames are raw addresses from the
/// native walker (its walk flags from bit 8 on), not `FunctionID`s.
const RAW_BIT: u64 = 2;
/// In a tally key's last head word: the subject word is an exception type
/// name's number ([`EventQueue::exception_type`]), not a `ClassID`.
const NAMED_BIT: u64 = 4;
/// Distinct exception type names kept per tally shard; past them a throw's
/// type reads as [`TOO_MANY_TYPES`].
const MAX_EXCEPTION_TYPES: usize = 65_536;
/// An exception type's number: its shard above these bits, its place in the
/// shard's names below.
const TYPE_SHARD_SHIFT: u32 = 24;
const TOO_MANY_TYPES: &str = "[exception type beyond the first 65,536]";
// The native walker hands its frames after room for the key's head.
const _: () = assert!(KEY_HEAD <= corsnap_abi::event_walk::HEAD_ROOM);
/// Tally shards, dealt to threads in turn ([`own_tally_shard`]), so threads
/// throwing at once meet on a lock only when there are more of them.
const TALLY_SHARDS: usize = 8;

/// `GCAllocationTick`'s event id in the `Microsoft-Windows-DotNETRuntime` provider.
pub const GC_ALLOCATION_TICK: u32 = 10;
/// The runtime provider's `ExceptionThrown_V1`: one per throw.
pub const EXCEPTION_THROWN_V1: u32 = 80;

/// The parts of a `GCAllocationTick_V2..V4` payload corsnap uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationTick {
    /// Bytes allocated since the previous tick (about 100 KB).
    pub bytes: u64,
    /// The allocated type's `TypeHandle`, which is its `ClassID`.
    pub class: ClassID,
    /// The runtime's short name for it (`Node`, `System.Byte[]`).
    pub type_name: String,
}

impl AllocationTick {
    /// Just the bytes, which every tick adds to the next recorded one.
    pub fn bytes(payload: &[u8]) -> Option<u64> {
        Some(u64::from_le_bytes(payload.get(10..18)?.try_into().ok()?))
    }

    /// Layout: u32 AllocationAmount, u32 AllocationKind, u16 ClrInstanceID,
    /// u64 AllocationAmount64, pointer TypeID, NUL-terminated UTF-16
    /// TypeName, then fields corsnap does not read.
    pub fn parse(payload: &[u8]) -> Option<AllocationTick> {
        let bytes = AllocationTick::bytes(payload)?;
        let class = u64::from_le_bytes(payload.get(18..26)?.try_into().ok()?) as ClassID;
        let name_bytes = payload.get(26..)?;
        let units: Vec<u16> = name_bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .take_while(|&u| u != 0)
            .take(4096)
            .collect();
        let type_name = String::from_utf16_lossy(&units);
        let type_name = if type_name.is_empty() { "[unknown type]".into() } else { type_name };
        Some(AllocationTick { bytes, class, type_name })
    }
}

/// Turns EventPipe's instruction pointers (leaf first) into `FunctionID`s,
/// with each run of unmanaged code as one 0, as `DoStackSnapshot` reports it.
pub fn functions_of_ips(info: &CorProfilerInfo, ips: &[usize]) -> (Vec<u64>, bool) {
    let mut frames = Vec::with_capacity(ips.len().min(MAX_EVENT_FRAMES));
    for &ip in ips.iter().take(MAX_EVENT_FRAMES) {
        let function = info.get_function_from_ip(ip).unwrap_or(0) as u64;
        if function == 0 && frames.last() == Some(&0) {
            continue;
        }
        frames.push(function);
    }
    (frames, ips.len() > MAX_EVENT_FRAMES)
}

/// What an event was about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    Class(ClassID),
    Text(String),
    /// A class, named by its metadata where it has a definition of its own,
    /// else by the runtime's name for it (arrays, generic instances).
    ClassOr(ClassID, String),
    /// An exception type by the runtime's name for it, numbered by
    /// [`EventQueue::exception_type`] (exceptions from EventPipe, which
    /// names the type but has no `ClassID`).
    ExceptionType(u32),
}

impl Subject {
    /// The tally key's subject word and form bits, for a subject a tally
    /// can count without allocating.
    fn tally_word(&self) -> Option<(u64, u64)> {
        match *self {
            Subject::Class(class) => Some((class as u64, 0)),
            Subject::ExceptionType(number) => Some((u64::from(number), NAMED_BIT)),
            Subject::Text(_) | Subject::ClassOr(..) => None,
        }
    }
}

/// The exception type's name that opens an `ExceptionThrown_V1` payload:
/// its UTF-16LE bytes before the NUL that ends it, at most
/// [`TYPE_NAME_BYTES`]. Left in the payload as they are: decoded into a
/// zeroed buffer at every throw, the buffer's zeroing alone was 0.2% of the
/// CPU of `validate` on .NET 10; a thread mostly throws the type it threw
/// last, which [`EventQueue::exception_type`] knows by its bytes.
fn exception_type_name(payload: &[u8]) -> &[u8] {
    let units = payload.len().min(TYPE_NAME_BYTES) / 2;
    let len = payload.chunks_exact(2).take(units).position(|unit| unit == [0, 0]).unwrap_or(units);
    &payload[..2 * len]
}

/// The longest exception type name taken from a payload, in bytes.
const TYPE_NAME_BYTES: usize = 512;

/// The runtime's event name for a type (`Ns.Box`1[System.Int32]`,
/// `Ns.Box`1[System.Int32[]]`) in the form corsnap names generics in
/// (`Ns.Box<System.Int32>`, `Ns.Box<System.Int32[]>`).
fn readable_type_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    // For each open bracket: whether it opened type arguments.
    let mut opened_arguments = Vec::new();
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '`' if chars.peek().is_some_and(char::is_ascii_digit) => {
                while chars.peek().is_some_and(char::is_ascii_digit) {
                    chars.next();
                }
                if chars.peek() == Some(&'[') {
                    chars.next();
                    out.push('<');
                    opened_arguments.push(true);
                }
            }
            '[' => {
                out.push('[');
                opened_arguments.push(false);
            }
            ']' => out.push(if opened_arguments.pop() == Some(true) { '>' } else { ']' }),
            ',' if opened_arguments.last() == Some(&true) => out.push_str(", "),
            c => out.push(c),
        }
    }
    out
}

/// Exception type names from EventPipe, numbered: a throw's tally key holds
/// the number, so counting a throw allocates only for a type never seen.
/// One table per tally shard, picked by thread as the tally's are, so
/// threads throwing at once rarely meet on its lock either (a type thrown on
/// threads of two shards is numbered in each).
#[derive(Debug, Default)]
#[repr(align(128))]
struct ExceptionTypes(Mutex<TypeNumbers>);

/// The type a thread numbered last, and the queue that numbered it: in a
/// storm a thread throws one type again and again, and each throw took the
/// shard's lock and hashed the name (2.5% of the CPU of `validate` on .NET
/// 10 under `perf`, more than its stack's walk). A copy of the name and a
/// number: no destructor, which would pin the agent's library after a
/// detach.
struct LastType {
    queue: u64,
    len: usize,
    name: [u8; LAST_TYPE_BYTES],
    number: u32,
}

/// The longest name [`LastType`] keeps, in UTF-16 bytes (longer ones are
/// looked up each time).
const LAST_TYPE_BYTES: usize = 256;

thread_local! {
    static LAST_TYPE: std::cell::RefCell<LastType> =
        const { std::cell::RefCell::new(LastType { queue: 0, len: 0, name: [0; LAST_TYPE_BYTES], number: 0 }) };
}

/// An [`EventQueue`]'s own number, never another's: what a thread keeps of
/// one queue ([`LastType`]) is never taken for a later one's, wherever that
/// one is allocated.
#[derive(Debug)]
struct QueueId(u64);

impl Default for QueueId {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        QueueId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

#[derive(Debug, Default)]
struct TypeNumbers {
    /// By the name's UTF-16LE bytes.
    numbers: HashMap<Box<[u8]>, u32, foldhash::fast::FixedState>,
    names: Vec<String>,
}

#[derive(Debug)]
pub struct PendingEvent {
    pub kind: EventKind,
    pub time_ns: u64,
    pub thread: ThreadID,
    pub os_tid: u32,
    pub subject: Subject,
    /// Leaf first, as the walk reports them: `FunctionID`s (0 for a run of
    /// native code), or with `raw`, the native walker's raw addresses.
    pub frames: Vec<u64>,
    pub truncated: bool,
    pub weight: u64,
    pub raw: Option<RawWalk>,
    /// `CORSNAP_VERIFY_EVENT_WALKS=1` (tests only): the same event's stack
    /// by `DoStackSnapshot`, to compare with the native walk's.
    pub referee: Option<Vec<u64>>,
}

/// How the native walker left an event's frames: raw addresses, to be
/// named on the sampler thread ([`crate::event_walks::EventWalker`]).
#[derive(Debug, Clone)]
pub struct RawWalk {
    /// `corsnap_unwind::flags` of the walk.
    pub flags: u32,
    /// The stack, when the walk met code not known yet.
    pub copy: Option<OwnStackCopy>,
}

/// A stack captured for a queued (not tallied) event.
#[derive(Debug)]
pub struct Captured {
    pub frames: Vec<u64>,
    pub truncated: bool,
    pub raw: Option<RawWalk>,
}

/// Walks the calling thread's stack for a queued event: with corsnap's own
/// unwinder when `native` and it can serve (from `caller`'s frame if given,
/// see `walk_own_stack`), else `DoStackSnapshot`.
pub fn capture_own_stack(
    queue: &EventQueue,
    info: &CorProfilerInfo,
    native: bool,
    thread: ThreadID,
    caller: Option<Regs>,
) -> Captured {
    if native {
        let walked = walk_own_stack(thread as u64, 0, caller, queue.spill(), |own| Captured {
            frames: own.words.to_vec(),
            truncated: own.walk.flags & corsnap_unwind::flags::TRUNCATED != 0,
            raw: Some(RawWalk { flags: own.walk.flags, copy: own.copy }),
        });
        if let Ok(captured) = walked {
            return captured;
        }
    }
    let (frames, truncated) = own_stack(info);
    Captured { frames, truncated, raw: None }
}

/// A collection in progress, between `GarbageCollectionStarted` and
/// `GarbageCollectionFinished`.
#[derive(Debug)]
struct GcInProgress {
    started: Instant,
    time_ns: u64,
    generation: u32,
    reason: u32,
    thread: ThreadID,
    os_tid: u32,
    stack: Captured,
}

/// A finished collection, for the list and the profile.
#[derive(Debug)]
pub struct FinishedGc {
    pub time_ns: u64,
    pub generation: u32,
    pub reason: u32,
    pub pause_ns: u64,
}

/// One distinct event stack and how often it happened since the sampler
/// last took the tally.
#[derive(Debug)]
struct Tallied {
    kind: EventKind,
    count: u64,
    first_ns: u64,
}

/// A tallied stack: its key, the key's hash ([`key_hash`]) and its count.
#[derive(Debug)]
struct TallyEntry {
    hash: u64,
    key: Box<[u64]>,
    tallied: Tallied,
}

/// Tally keys are 30 to 60 words, met at every event. Their hash is the
/// head's words and the frames' hash ([`frames_hash`]), which a replayed
/// walk brings with it (remembered with the kept walk), so an event from a
/// place seen before hashes six words, not the whole key: hashing every
/// key in full, four lanes at a time, was 0.07% of the CPU of an exception
/// storm (`validate`, .NET 8, under `perf`), a fifth of the tally's 0.35%.
/// hashbrown's table takes the hash as given.
type TallyShard = hashbrown::HashTable<TallyEntry>;

/// A tally key's hash: its head, then [`frames_hash`] of its frames.
fn key_hash(key: &[u64], frames_hash: u64) -> u64 {
    use std::hash::BuildHasher;
    let head = key.get(..KEY_HEAD).unwrap_or(key);
    foldhash::fast::FixedState::default().hash_one((head, frames_hash))
}

/// A tally shard on cache lines of its own: each thread locks its own shard
/// at every event, and shards side by side passed their shared line between
/// the cores of threads throwing at once.
#[derive(Debug, Default)]
#[repr(align(128))]
struct PaddedShard(Mutex<TallyShard>);

impl std::ops::Deref for PaddedShard {
    type Target = Mutex<TallyShard>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

#[derive(Debug, Default)]
pub struct EventQueue {
    /// Exceptions and class loads, counted per distinct (kind, thread,
    /// class, stack): an exception storm from one site costs the throwing
    /// thread a lookup, not an allocation and a queued message per throw.
    /// The counts stay exact.
    tally: [PaddedShard; TALLY_SHARDS],
    pending: Mutex<Vec<PendingEvent>>,
    gcs: Mutex<Vec<FinishedGc>>,
    gc_in_progress: Mutex<Option<GcInProgress>>,
    /// Seed 001: after an attach a collection may already be under way, so
    /// GC callbacks mean nothing until a `GarbageCollectionStarted` is seen.
    gc_started_seen: AtomicBool,
    exception_types: [ExceptionTypes; TALLY_SHARDS],
    id: QueueId,
    pub dropped: AtomicU64,
}

/// Walks the calling thread's own stack as a tallied event would, and
/// keeps nothing: what the walk costs by itself, for the benchmarks' floor.
/// A native walk that met code not known yet still hands its copy to the
/// sampler thread (with no weight: it is learned from, not recorded), as the
/// floor would otherwise walk unknown code, and copy stacks, for ever.
pub fn walk_own_stack_only(
    queue: &EventQueue,
    info: &CorProfilerInfo,
    native: bool,
    thread: ThreadID,
    caller: Option<Regs>,
) {
    if native {
        let walked = walk_own_stack(thread as u64, 0, caller, queue.spill(), |own| {
            if own.copy.is_some() {
                queue.push(PendingEvent {
                    kind: EventKind::Exceptions,
                    time_ns: 0,
                    thread,
                    os_tid: 0,
                    subject: Subject::Text(String::new()),
                    frames: own.words.to_vec(),
                    truncated: false,
                    weight: 0,
                    raw: Some(RawWalk { flags: own.walk.flags, copy: own.copy }),
                    referee: None,
                });
            }
        });
        if walked.is_ok() {
            return;
        }
    }
    OwnStack::walk(info);
}

/// Walks the calling thread's own stack, leaf first.
pub fn own_stack(info: &CorProfilerInfo) -> (Vec<u64>, bool) {
    let stack = OwnStack::walk(info);
    let mut frames = Vec::with_capacity(stack.len);
    frames.extend_from_slice(stack.inline_frames());
    frames.extend_from_slice(&stack.spill);
    (frames, stack.truncated)
}

/// A walk of the calling thread's stack, leaf first, that allocates only
/// when the stack is deeper than [`INLINE_FRAMES`]. The frames sit after
/// room for a tally key's head, so the key is built in place.
struct OwnStack {
    words: [u64; KEY_HEAD + INLINE_FRAMES],
    len: usize,
    spill: Vec<u64>,
    truncated: bool,
}

impl OwnStack {
    fn walk(info: &CorProfilerInfo) -> OwnStack {
        let mut stack = OwnStack { words: [0; KEY_HEAD + INLINE_FRAMES], len: 0, spill: Vec::new(), truncated: false };
        info.do_stack_snapshot(0, &mut |function, _ip| {
            if stack.len >= MAX_EVENT_FRAMES {
                stack.truncated = true;
                return false;
            }
            if stack.len < INLINE_FRAMES {
                stack.words[KEY_HEAD + stack.len] = function as u64;
            } else {
                stack.spill.push(function as u64);
            }
            stack.len += 1;
            true
        });
        stack
    }

    fn inline_frames(&self) -> &[u64] {
        &self.words[KEY_HEAD..KEY_HEAD + self.len.min(INLINE_FRAMES)]
    }

    /// Calls `use_key` with the tally key: `head`, then the frames.
    fn with_key(&mut self, head: [u64; KEY_HEAD], use_key: impl FnOnce(&[u64])) {
        if self.spill.is_empty() {
            self.words[..KEY_HEAD].copy_from_slice(&head);
            use_key(&self.words[..KEY_HEAD + self.len]);
        } else {
            let mut words = Vec::with_capacity(KEY_HEAD + self.len);
            words.extend_from_slice(&head);
            words.extend_from_slice(self.inline_frames());
            words.extend_from_slice(&self.spill);
            use_key(&words);
        }
    }
}

/// A tally key's subject, from its subject word and [`NAMED_BIT`].
fn subject_of(word: u64, named: u64) -> Subject {
    if named != 0 {
        Subject::ExceptionType(word as u32)
    } else {
        Subject::Class(word as ClassID)
    }
}

/// The calling thread's tally shard: dealt in turn at its first event, so
/// the first eight threads that count events each have their own. Picked
/// by a hash of the thread, as before, two threads shared one with a chance
/// of one in eight: in one such `validate` run on .NET 10, the tally's lock, passed
/// between the two workers' cores at every throw, was 2.7% of the CPU,
/// against 0.5% in the runs before and after. No destructor: one would
/// pin the agent's library after a detach.
fn own_tally_shard() -> usize {
    thread_local! {
        static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    SHARD
        .try_with(|shard| {
            if shard.get() == usize::MAX {
                shard.set(NEXT.fetch_add(1, Ordering::Relaxed) % TALLY_SHARDS);
            }
            shard.get()
        })
        .unwrap_or(0)
}

/// A shard by a hash of `thread`, for the exception types' tables (looked
/// up only when a thread throws another type than its last).
fn tally_shard(thread: ThreadID) -> usize {
    // ThreadIDs are addresses of the runtime's Thread objects.
    ((thread as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 61) as usize % TALLY_SHARDS
}

/// A counted event's key head: what, on which thread, its subject, and how
/// its stack was walked (the frames follow it in the key).
#[inline]
fn key_head(kind: EventKind, thread: ThreadID, os_tid: u32, (word, named): (u64, u64), walk: &Walk) -> [u64; KEY_HEAD] {
    let truncated = walk.flags & corsnap_unwind::flags::TRUNCATED != 0;
    let form = (truncated as u64 * TRUNCATED_BIT) | RAW_BIT | named | (u64::from(walk.flags) << 8);
    [kind as u64, thread as u64, os_tid as u64, word, form]
}

impl EventQueue {
    /// Counts an event whose subject is a class (an exception's type, a
    /// loaded class), with the calling thread's stack: walked by corsnap's
    /// own unwinder when `native` and it can serve (no allocation, no call
    /// into the runtime, for a stack whose code is known; from `caller`'s
    /// frame if given, see `walk_own_stack`), else by `DoStackSnapshot`.
    ///
    /// `false` (and nothing counted) for a subject a tally cannot hold
    /// ([`Subject::Text`], [`Subject::ClassOr`]).
    #[allow(clippy::too_many_arguments)]
    pub fn count_event(
        &self,
        info: &CorProfilerInfo,
        native: bool,
        kind: EventKind,
        thread: ThreadID,
        os_tid: u32,
        subject: &Subject,
        caller: Option<Regs>,
        now_ns: impl Fn() -> u64,
    ) -> bool {
        let Some((word, named)) = subject.tally_word() else { return false };
        if native && self.count_natively(kind, thread, os_tid, (word, named), caller, &now_ns) {
            return true;
        }
        let mut stack = OwnStack::walk(info);
        let head = [kind as u64, thread as u64, os_tid as u64, word, (stack.truncated as u64 * TRUNCATED_BIT) | named];
        stack.with_key(head, |key| self.tally(now_ns, key));
        true
    }

    /// The number of the exception type an `ExceptionThrown_V1` payload
    /// names ([`exception_type_name`]), thrown on `thread`.
    pub fn exception_type(&self, thread: ThreadID, payload: &[u8]) -> u32 {
        let queue = self.id.0;
        // The type this thread threw last, if the payload opens with its
        // name and the NUL after it: one comparison, where finding the
        // name's end first went through it two bytes at a time (0.2% of the
        // CPU of `validate` on .NET 10).
        let last = LAST_TYPE.try_with(|last| {
            let last = last.try_borrow().ok()?;
            let name = last.name.get(..last.len)?;
            (last.queue == queue
                && payload.get(..name.len()) == Some(name)
                && payload.get(name.len()..name.len() + 2) == Some(&[0, 0][..]))
            .then_some(last.number)
        });
        if let Ok(Some(number)) = last {
            return number;
        }
        let name = exception_type_name(payload);
        let number = self.number_type(thread, name);
        if name.len() <= LAST_TYPE_BYTES {
            let _ = LAST_TYPE.try_with(|last| {
                if let Ok(mut last) = last.try_borrow_mut() {
                    last.name[..name.len()].copy_from_slice(name);
                    last.len = name.len();
                    last.number = number;
                    last.queue = queue;
                }
            });
        }
        number
    }

    /// [`Self::exception_type`] from the shard's table.
    fn number_type(&self, thread: ThreadID, name: &[u8]) -> u32 {
        let shard = tally_shard(thread);
        let mut types = self.exception_types[shard].0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&number) = types.numbers.get(name) {
            return number;
        }
        let number = ((shard as u32) << TYPE_SHARD_SHIFT) | types.names.len() as u32;
        if types.names.len() >= MAX_EXCEPTION_TYPES {
            return number;
        }
        let units: Vec<u16> = name.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        types.names.push(readable_type_name(&String::from_utf16_lossy(&units)));
        types.numbers.insert(name.into(), number);
        number
    }

    /// The name numbered by [`Self::exception_type`].
    pub fn exception_type_name(&self, number: u32) -> String {
        let Some(shard) = self.exception_types.get((number >> TYPE_SHARD_SHIFT) as usize) else {
            return TOO_MANY_TYPES.to_string();
        };
        let types = shard.0.lock().unwrap_or_else(|p| p.into_inner());
        let place = (number & ((1 << TYPE_SHARD_SHIFT) - 1)) as usize;
        types.names.get(place).cloned().unwrap_or_else(|| TOO_MANY_TYPES.to_string())
    }

    /// [`Self::count_natively`]'s express lane, for events from `caller`'s
    /// frame: one more of the same, on a ticket of the thread's own
    /// (`corsnap_abi::event_walk::count_on_ticket`), or on the walk its
    /// walker kept (`replay_own_stack`: the walk replays, and the key its
    /// last replay counted is this event's). `false`, with nothing counted,
    /// for anything else, which a walk then takes.
    #[inline(always)]
    pub fn count_repeated(
        &self,
        kind: EventKind,
        thread: ThreadID,
        os_tid: u32,
        subject: &Subject,
        caller: Regs,
        now_ns: impl Fn() -> u64,
    ) -> bool {
        let Some(tally_word) = subject.tally_word() else { return false };
        self.count_repeated_word(kind, thread, os_tid, tally_word, caller, now_ns)
    }

    /// [`Self::count_repeated`] of a subject's tally word.
    #[inline(always)]
    fn count_repeated_word(
        &self,
        kind: EventKind,
        thread: ThreadID,
        os_tid: u32,
        (word, named): (u64, u64),
        caller: Regs,
        now_ns: impl Fn() -> u64,
    ) -> bool {
        // The key's head but its last word (how the stack was walked: the
        // ticket's walk decides it).
        let opens = [kind as u64, thread as u64, os_tid as u64, word];
        if count_on_ticket(thread as u64, caller, &opens, &now_ns) {
            return true;
        }
        replay_own_stack(thread as u64, KEY_HEAD, caller, |Replayed { words, walk, repeats }| {
            let head = key_head(kind, thread, os_tid, (word, named), walk);
            let differs = words.iter().zip(&head).fold(0, |differs, (word, new)| differs | (word ^ new));
            if repeats.head != KEY_HEAD || differs != 0 {
                return false;
            }
            if repeats.count == 0 {
                repeats.first_ns = now_ns();
            }
            repeats.count += 1;
            true
        })
    }

    /// The native walker's half of [`Self::count_event`]; `false` if it
    /// cannot serve (no map yet, a stack the map does not list yet).
    #[inline(never)]
    #[link_section = ".text.hot.corsnap_throw"]
    fn count_natively(
        &self,
        kind: EventKind,
        thread: ThreadID,
        os_tid: u32,
        (word, named): (u64, u64),
        caller: Option<Regs>,
        now_ns: impl Fn() -> u64,
    ) -> bool {
        // Where the walk starts: the frame the event came from (the
        // dispatch hook's), else this function's own, as this call returns
        // to it: the same start for every event through the same calls, so
        // a ticket serves them (a `match`, not a closure: the call must be
        // this function's own).
        let caller = match caller {
            Some(caller) => caller,
            None => callers_frame(),
        };
        if self.count_repeated_word(kind, thread, os_tid, (word, named), caller, &now_ns) {
            return true;
        }
        walk_own_stack(thread as u64, KEY_HEAD, Some(caller), self.spill(), |own| {
            let OwnWalk { words, walk, copy, hash, repeats } = own;
            let truncated = walk.flags & corsnap_unwind::flags::TRUNCATED != 0;
            if copy.is_some() {
                // Met code not known yet: its frames past that code are
                // guesses until the sampler thread has learned it and walked
                // the copy again, so this one goes by itself, counted once.
                self.push(PendingEvent {
                    kind,
                    time_ns: now_ns(),
                    thread,
                    os_tid,
                    subject: subject_of(word, named),
                    frames: words[KEY_HEAD..].to_vec(),
                    truncated,
                    weight: 1,
                    raw: Some(RawWalk { flags: walk.flags, copy }),
                    referee: None,
                });
                return;
            }
            let head = key_head(kind, thread, os_tid, (word, named), walk);
            if let Some(repeats) = repeats {
                // A replayed walk: an event with the key its last replay
                // tallied (that head is still in place) is counted on the
                // walk, and taken into the tally within a tick
                // ([`Self::take_repeats`]).
                // Compared word by word: `==` on slices and arrays calls
                // memcmp, 0.2% of the CPU of `validate` on .NET 10.
                let differs = words.iter().zip(&head).fold(0, |differs, (word, new)| differs | (word ^ new));
                if repeats.head == KEY_HEAD && differs == 0 {
                    if repeats.count == 0 {
                        repeats.first_ns = now_ns();
                    }
                    repeats.count += 1;
                    return;
                }
                if repeats.count > 0 {
                    // Another key now: what the old one counted goes first.
                    self.tally_hashed(words, hash, repeats.count, || repeats.first_ns);
                    repeats.count = 0;
                }
                repeats.head = KEY_HEAD;
            }
            words[..KEY_HEAD].copy_from_slice(&head);
            self.tally_hashed(words, hash, 1, now_ns);
        })
        .is_ok()
    }

    /// Takes into the tally the events counted on the event walkers' kept
    /// walks ([`corsnap_abi::event_walk::Repeats`]); with a `deadline`,
    /// waiting that long at most for a walker lent to a walk (the last take,
    /// before the walkers are collected).
    pub fn take_repeats(&self, deadline: Option<Instant>) {
        corsnap_abi::event_walk::take_repeats(deadline, self.spill());
    }

    /// Where events counted on a kept walk go when they are taken or the
    /// walk is replaced: into the tally.
    fn spill(&self) -> impl FnMut(Counted<'_>) + '_ {
        |c| self.tally_hashed(c.key, c.frames_hash, c.count, || c.first_ns)
    }

    /// Counts one more occurrence of `key` (a [`KEY_HEAD`] head, then the
    /// frames); the time is taken only for a stack not seen since the last
    /// [`EventQueue::take`].
    fn tally(&self, now_ns: impl FnOnce() -> u64, key: &[u64]) {
        self.tally_hashed(key, frames_hash(key.get(KEY_HEAD..).unwrap_or_default()), 1, now_ns);
    }

    /// Counts `count` more occurrences of `key`, with [`frames_hash`] of the
    /// key's frames already known (a replayed walk's is remembered with it):
    /// the key is hashed by its head and that, not word by word.
    fn tally_hashed(&self, key: &[u64], frames_hash: u64, count: u64, first_ns: impl FnOnce() -> u64) {
        let Some(&kind) = key.first().and_then(|&kind| EventKind::ALL.get(kind as usize)) else { return };
        let hash = key_hash(key, frames_hash);
        let mut shard = self.tally[own_tally_shard()].lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = shard.find_mut(hash, |entry| entry.hash == hash && *entry.key == *key) {
            entry.tallied.count += count;
            return;
        }
        if shard.len() >= MAX_PENDING / TALLY_SHARDS {
            self.dropped.fetch_add(count, Ordering::Relaxed);
            return;
        }
        let entry = TallyEntry { hash, key: key.into(), tallied: Tallied { kind, count, first_ns: first_ns() } };
        shard.insert_unique(hash, entry, |entry| entry.hash);
    }

    pub fn push(&self, event: PendingEvent) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.len() >= MAX_PENDING {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        pending.push(event);
    }

    /// Everything queued or tallied since the last call, tallies as one
    /// event each, weighted by their count.
    pub fn take(&self) -> Vec<PendingEvent> {
        let mut events = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        for shard in &self.tally {
            let tallied = std::mem::take(&mut *shard.lock().unwrap_or_else(|p| p.into_inner()));
            events.extend(tallied.into_iter().map(|TallyEntry { key, tallied: t, .. }| PendingEvent {
                kind: t.kind,
                time_ns: t.first_ns,
                thread: key[1] as ThreadID,
                os_tid: key[2] as u32,
                subject: subject_of(key[3], key[4] & NAMED_BIT),
                frames: key[KEY_HEAD..].to_vec(),
                truncated: key[4] & TRUNCATED_BIT != 0,
                weight: t.count,
                raw: (key[4] & RAW_BIT != 0).then(|| RawWalk { flags: (key[4] >> 8) as u32, copy: None }),
                referee: None,
            }));
        }
        events.sort_by_key(|e| e.time_ns);
        events
    }

    pub fn take_gcs(&self) -> Vec<FinishedGc> {
        std::mem::take(&mut *self.gcs.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// `generations[i]` says whether generation `i` is collected.
    #[allow(clippy::too_many_arguments)]
    pub fn gc_started(
        &self,
        info: &CorProfilerInfo,
        native: bool,
        time_ns: u64,
        generations: &[bool],
        reason: u32,
        thread: ThreadID,
        os_tid: u32,
    ) {
        self.gc_started_seen.store(true, Ordering::SeqCst);
        // .NET 8 reports five "generations" (0, 1, 2, large and pinned
        // object heaps); the last two are collected only with generation 2.
        let generation = generations.iter().take(3).rposition(|&c| c).unwrap_or(2) as u32;
        // The thread that starts a blocking collection is the one that
        // triggered it; its stack says why (a background GC's thread has no
        // managed frames and yields an empty stack).
        let stack = capture_own_stack(self, info, native, thread, None);
        *self.gc_in_progress.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(GcInProgress { started: Instant::now(), time_ns, generation, reason, thread, os_tid, stack });
    }

    pub fn gc_finished(&self) {
        if !self.gc_started_seen.load(Ordering::SeqCst) {
            return;
        }
        let Some(gc) = self.gc_in_progress.lock().unwrap_or_else(|p| p.into_inner()).take() else { return };
        let pause_ns = gc.started.elapsed().as_nanos() as u64;
        let reason = if gc.reason == 1 { "induced" } else { "allocation" };
        self.push(PendingEvent {
            kind: EventKind::Gc,
            time_ns: gc.time_ns,
            thread: gc.thread,
            os_tid: gc.os_tid,
            subject: Subject::Text(format!("[gen{} GC, {reason}]", gc.generation)),
            frames: gc.stack.frames,
            truncated: gc.stack.truncated,
            weight: pause_ns.max(1),
            raw: gc.stack.raw,
            referee: None,
        });
        self.gcs.lock().unwrap_or_else(|p| p.into_inner()).push(FinishedGc {
            time_ns: gc.time_ns,
            generation: gc.generation,
            reason: gc.reason,
            pause_ns,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_tick_payloads_are_read_and_bad_ones_refused() {
        let mut payload = Vec::new();
        payload.extend_from_slice(&100_000u32.to_le_bytes());
        payload.extend_from_slice(&0u32.to_le_bytes());
        payload.extend_from_slice(&7u16.to_le_bytes());
        payload.extend_from_slice(&102_400u64.to_le_bytes());
        payload.extend_from_slice(&0xdead_beefu64.to_le_bytes());
        for u in "System.Byte[]".encode_utf16().chain([0]) {
            payload.extend_from_slice(&u.to_le_bytes());
        }
        payload.extend_from_slice(&[1, 2, 3, 4]);
        let tick = AllocationTick::parse(&payload).unwrap();
        assert_eq!(tick, AllocationTick { bytes: 102_400, class: 0xdead_beef, type_name: "System.Byte[]".into() });
        assert_eq!(AllocationTick::parse(&payload[..12]), None);
        assert_eq!(AllocationTick::parse(&payload[..26]).unwrap().type_name, "[unknown type]");
        assert_eq!(AllocationTick::bytes(&payload), Some(102_400));
        assert_eq!(AllocationTick::bytes(&payload[..17]), None);
    }

    fn key(kind: EventKind, thread: u64, class: u64, frames: &[u64]) -> Vec<u64> {
        let mut key = vec![kind as u64, thread, 7, class, 0];
        key.extend_from_slice(frames);
        key
    }

    #[test]
    fn repeated_event_stacks_are_counted_exactly_and_taken_once() {
        let queue = EventQueue::default();
        for i in 0..1000u64 {
            queue.tally(|| 100 + i, &key(EventKind::Exceptions, 0x10, 0xc1, &[3, 2, 1]));
        }
        for i in 0..500u64 {
            queue.tally(|| 50 + i, &key(EventKind::Exceptions, 0x20, 0xc2, &[4, 2, 1]));
        }
        // The same stack and type on another thread, and as another kind of event.
        queue.tally(|| 7, &key(EventKind::Exceptions, 0x20, 0xc1, &[3, 2, 1]));
        queue.tally(|| 8, &key(EventKind::ClassLoad, 0x10, 0xc1, &[3, 2, 1]));
        let events = queue.take();
        let summary: Vec<(EventKind, ThreadID, u32, Vec<u64>, u64, u64)> = events
            .iter()
            .map(|e| {
                let Subject::Class(class) = e.subject else { panic!("{:?}", e.subject) };
                (e.kind, e.thread, e.os_tid, e.frames.clone(), class as u64, e.weight)
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (EventKind::Exceptions, 0x20, 7, vec![3, 2, 1], 0xc1, 1),
                (EventKind::ClassLoad, 0x10, 7, vec![3, 2, 1], 0xc1, 1),
                (EventKind::Exceptions, 0x20, 7, vec![4, 2, 1], 0xc2, 500),
                (EventKind::Exceptions, 0x10, 7, vec![3, 2, 1], 0xc1, 1000),
            ],
            "ordered by first occurrence"
        );
        assert!(queue.take().is_empty());
    }

    #[test]
    fn generic_exception_types_read_as_corsnap_names_generics() {
        for (event, readable) in [
            ("System.InvalidOperationException", "System.InvalidOperationException"),
            ("Ns.Box`1[System.Int32]", "Ns.Box<System.Int32>"),
            ("Ns.Pair`2[System.String,System.Int32[]]", "Ns.Pair<System.String, System.Int32[]>"),
            (
                "Ns.Box`1[System.Collections.Generic.List`1[System.Int32]]",
                "Ns.Box<System.Collections.Generic.List<System.Int32>>",
            ),
            ("System.Int32[,]", "System.Int32[,]"),
        ] {
            assert_eq!(readable_type_name(event), readable, "{event}");
        }
    }

    #[test]
    fn exception_types_from_event_pipe_are_numbered_once_and_taken_as_their_names() {
        let utf16 = |s: &str| s.encode_utf16().flat_map(u16::to_le_bytes).collect::<Vec<u8>>();
        let mut payload = utf16("System.InvalidOperationException");
        payload.extend_from_slice(&[0, 0]);
        payload.extend_from_slice(&utf16("message"));
        assert_eq!(exception_type_name(&payload), utf16("System.InvalidOperationException").as_slice());
        assert!(exception_type_name(&payload[..1]).is_empty());
        // A name with no NUL is taken to the payload's end, and at most
        // TYPE_NAME_BYTES of it.
        assert_eq!(exception_type_name(&utf16("Ab")), utf16("Ab").as_slice());
        assert_eq!(exception_type_name(&utf16(&"x".repeat(300))).len(), TYPE_NAME_BYTES);
        let queue = EventQueue::default();
        let first = queue.exception_type(0x10, &utf16("System.InvalidOperationException"));
        let second = queue.exception_type(0x10, &utf16("EventShapes.ShapeException"));
        assert_ne!(first, second);
        assert_eq!(queue.exception_type(0x10, &utf16("System.InvalidOperationException")), first);
        assert_eq!(queue.exception_type(0x10, &utf16("System.InvalidOperationException")), first, "kept by the thread");
        // A payload: the name, its NUL, the message. Kept by the thread,
        // and not taken for a longer name it begins.
        assert_eq!(queue.exception_type(0x10, &payload), first);
        assert_eq!(queue.exception_type(0x10, &payload), first);
        let mut longer = utf16("System.InvalidOperationExceptionX");
        longer.extend_from_slice(&[0, 0]);
        let third = queue.exception_type(0x10, &longer);
        assert_ne!(third, first);
        assert_eq!(queue.exception_type(0x10, &payload), first);
        assert_eq!(queue.exception_type(0x10, &longer), third);
        assert_eq!(queue.exception_type_name(second), "EventShapes.ShapeException");
        // What this thread kept of one queue is not taken for another's
        // (a later session's), which numbers its own types.
        let later = EventQueue::default();
        let other = later.exception_type(0x10, &utf16("EventShapes.ShapeException"));
        assert_eq!(later.exception_type(0x10, &utf16("System.InvalidOperationException")), other + 1);
        assert_eq!(later.exception_type_name(other + 1), "System.InvalidOperationException");
        // A tally of a named type is taken back as that type, apart from a
        // class with the same number.
        let named = [EventKind::Exceptions as u64, 0x10, 7, u64::from(second), NAMED_BIT, 3, 2, 1];
        queue.tally(|| 1, &named);
        queue.tally(|| 2, &key(EventKind::Exceptions, 0x10, u64::from(second), &[3, 2, 1]));
        let events = queue.take();
        assert_eq!(events[0].subject, Subject::ExceptionType(second));
        assert_eq!(events[1].subject, Subject::Class(second as ClassID));
    }

    #[test]
    fn native_walks_are_tallied_with_their_walk_flags_and_taken_as_raw_frames() {
        let queue = EventQueue::default();
        let form = RAW_BIT | u64::from(corsnap_unwind::flags::COMPLETE | corsnap_unwind::flags::UNKNOWN_CODE) << 8;
        let raw_key = [EventKind::Exceptions as u64, 0x10, 7, 0xc1, form, 0xaaa, 0xbbb];
        for _ in 0..3 {
            queue.tally(|| 1, &raw_key);
        }
        // The same class and thread walked by DoStackSnapshot: another stack.
        queue.tally(|| 2, &key(EventKind::Exceptions, 0x10, 0xc1, &[0xaaa, 0xbbb]));
        let events = queue.take();
        assert_eq!(events.len(), 2);
        let native = &events[0];
        assert_eq!((native.weight, native.frames.as_slice(), native.truncated), (3, &[0xaaa, 0xbbb][..], false));
        let raw = native.raw.as_ref().expect("raw frames");
        assert_eq!(raw.flags, corsnap_unwind::flags::COMPLETE | corsnap_unwind::flags::UNKNOWN_CODE);
        assert!(raw.copy.is_none());
        assert!(events[1].raw.is_none() && events[1].weight == 1);
    }

    #[test]
    fn the_tally_is_bounded_and_counts_what_it_drops() {
        let queue = EventQueue::default();
        let thread = 0x30;
        let per_shard = MAX_PENDING / TALLY_SHARDS;
        for i in 0..per_shard as u64 + 10 {
            queue.tally(|| i, &key(EventKind::Exceptions, thread as u64, 1, &[i]));
        }
        // A stack already tallied is still counted when the shard is full.
        queue.tally(|| 0, &key(EventKind::Exceptions, thread as u64, 1, &[0]));
        assert_eq!(queue.dropped.load(Ordering::Relaxed), 10);
        let events = queue.take();
        assert_eq!(events.len(), per_shard);
        assert_eq!(events.iter().map(|e| e.weight).sum::<u64>(), per_shard as u64 + 1);
    }
}
