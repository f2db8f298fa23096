//! Stacks at the moments that matter: exceptions, class loads and garbage
//! collections, walked synchronously on the thread the event happens on.
//!
//! A synchronous walk (`DoStackSnapshot` of the current thread, inside the
//! runtime's callback) needs no seed, no suspension and none of the
//! cross-thread rules. The callback captures the raw stack and the subject
//! (a `ClassID`, valid beyond the callback, unlike the `ObjectID` it came
//! from) and queues them; the sampler thread names and sends them later, so
//! no callback ever holds a lock across a call into the runtime (Rule 3).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use corsnap_abi::{ClassID, CorProfilerInfo, ThreadID};
use corsnap_wire::EventKind;

/// Events waiting beyond this many are dropped (and counted): a program
/// throwing without end must not grow the agent without end.
const MAX_PENDING: usize = 200_000;
/// Frames kept per event stack.
const MAX_EVENT_FRAMES: usize = 1024;

/// `GCAllocationTick`'s event id in the `Microsoft-Windows-DotNETRuntime` provider.
pub const GC_ALLOCATION_TICK: u32 = 10;

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
    /// Layout: u32 AllocationAmount, u32 AllocationKind, u16 ClrInstanceID,
    /// u64 AllocationAmount64, pointer TypeID, NUL-terminated UTF-16
    /// TypeName, then fields corsnap does not read.
    pub fn parse(payload: &[u8]) -> Option<AllocationTick> {
        let amount = payload.get(10..18)?;
        let bytes = u64::from_le_bytes(amount.try_into().ok()?);
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
}

#[derive(Debug)]
pub struct PendingEvent {
    pub kind: EventKind,
    pub time_ns: u64,
    pub thread: ThreadID,
    pub os_tid: u32,
    pub subject: Subject,
    /// Leaf first, as the walk reports them.
    pub frames: Vec<u64>,
    pub truncated: bool,
    pub weight: u64,
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
    frames: Vec<u64>,
    truncated: bool,
}

/// A finished collection, for the list and the profile.
#[derive(Debug)]
pub struct FinishedGc {
    pub time_ns: u64,
    pub generation: u32,
    pub reason: u32,
    pub pause_ns: u64,
}

#[derive(Debug, Default)]
pub struct EventQueue {
    pending: Mutex<Vec<PendingEvent>>,
    gcs: Mutex<Vec<FinishedGc>>,
    gc_in_progress: Mutex<Option<GcInProgress>>,
    /// Seed 001: after an attach a collection may already be under way, so
    /// GC callbacks mean nothing until a `GarbageCollectionStarted` is seen.
    gc_started_seen: AtomicBool,
    pub dropped: AtomicU64,
}

/// Walks the calling thread's own stack, leaf first.
pub fn own_stack(info: &CorProfilerInfo) -> (Vec<u64>, bool) {
    let mut frames = Vec::with_capacity(64);
    let mut truncated = false;
    info.do_stack_snapshot(0, &mut |function| {
        if frames.len() >= MAX_EVENT_FRAMES {
            truncated = true;
            return false;
        }
        frames.push(function as u64);
        true
    });
    (frames, truncated)
}

impl EventQueue {
    pub fn push(&self, event: PendingEvent) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.len() >= MAX_PENDING {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        pending.push(event);
    }

    pub fn take(&self) -> Vec<PendingEvent> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn take_gcs(&self) -> Vec<FinishedGc> {
        std::mem::take(&mut *self.gcs.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// `generations[i]` says whether generation `i` is collected.
    #[allow(clippy::too_many_arguments)]
    pub fn gc_started(
        &self,
        info: &CorProfilerInfo,
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
        let (frames, truncated) = own_stack(info);
        *self.gc_in_progress.lock().unwrap_or_else(|p| p.into_inner()) = Some(GcInProgress {
            started: Instant::now(),
            time_ns,
            generation,
            reason,
            thread,
            os_tid,
            frames,
            truncated,
        });
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
            frames: gc.frames,
            truncated: gc.truncated,
            weight: pause_ns.max(1),
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
    }
}
