//! The signal sampler's unsafe core: per-thread CPU timers, the `SIGPROF`
//! handler that walks the interrupted thread's stack, the buffers it writes
//! to, and the trampoline that lets the agent's library be unloaded safely.
//!
//! - [`handler`]: the handler itself, and its safety argued step by step;
//! - [`slot`] and [`ring`]: what the handler reads and writes for its thread,
//!   and what the agent drains;
//! - [`clocks`]: the CPU timers and perf events that raise the signal;
//! - [`trampoline`]: the page the kernel enters the handler through, which
//!   lets the agent's library be unloaded;
//! - [`sampler`]: the safe interface the agent uses.
//!
//! # Leaving the process
//!
//! # Leaving the process
//!
//! The kernel enters the handler through a small trampoline in a page of its
//! own (not part of the agent's library): it counts itself in, calls the
//! current target, counts itself out and returns. On detach the agent deletes
//! every timer, sets `SIGPROF` to `SIG_IGN` (which discards signals already
//! pending on any thread), restores the previous disposition, points the
//! trampoline at a bare `ret`, and waits for the count to reach zero. After
//! that no instruction of the library can run on a signal: a thread that was
//! entering the trampoline at that moment calls the `ret`. The page stays, is
//! named `corsnap-signal-trampoline`, and is reused by the next attach.

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corsnap_unwind::{CodeMap, ManagedCode, Memory, Regs, WalkCache};

mod clocks;
mod copy_pool;
mod handler;
mod ring;
mod sample_time;
mod sampler;
mod slot;
mod trampoline;
use clocks::*;
use copy_pool::{Block, POOL};
pub use handler::monotonic_ns;
use handler::*;
pub(crate) use handler::{CopyHijack, LiveMemory};
use ring::*;
pub use ring::{rewalk, RawSample, StackCopy};
pub use sampler::{InstallError, SignalSampler, SlotId};
pub use slot::ThreadSlot;
use slot::*;
use trampoline::*;

/// The signal the timers raise. The runtime owns `SIGRTMIN` and several
/// others; `SIGPROF` is free in CoreCLR and is what profilers use.
pub const SAMPLE_SIGNAL: c_int = libc::SIGPROF;
/// Frames kept per sample; deeper stacks keep their leaf end.
pub const MAX_FRAMES: usize = 1024;
/// Each thread's ring holds this many 8-byte words (64 KiB): tens of
/// samples between two drains.
pub const RING_WORDS: usize = 8192;
/// Threads that can be sampled at once.
pub const MAX_SLOTS: usize = 16384;
/// A record in a ring: header, weight, time, time in the handler, words of
/// stack copy, then the frames, then the copy (if any).
const RECORD_HEAD: usize = 5;
/// When a walk met code the map does not know yet, the handler also keeps
/// up to this many words of the stack (and the registers), so the agent can
/// walk the sample again once it has learned that code: two blocks of the
/// copy pool (64 KiB).
const STACK_COPY_WORDS: usize = 8192;
/// The x86-64 System V red zone: the kernel leaves the 128 bytes below the
/// stack pointer alone when it pushes a signal frame.
const RED_ZONE_BYTES: u64 = 128;
/// Bytes a deferred walk's copy reaches past the root frame's stack
/// pointer (as a walk that reached the root copies 64 words past it).
const ROOT_SLACK_BYTES: u64 = 512;
/// Words copied past a splice frame's stack pointer.
const SPLICE_SLACK_WORDS: usize = 16;

/// `si_code` of a signal raised by a POSIX timer.
const SI_TIMER: c_int = -2;
/// `si_code`s of a signal raised by a perf event's overflow (`F_SETSIG`):
/// `POLL_HUP` when its refresh count ran out, `POLL_IN` otherwise.
const POLL_IN: c_int = 1;
const POLL_HUP: c_int = 6;
/// `si_code` of a signal queued with `rt_tgsigqueueinfo`: corsnap's own
/// request for one sample now (walk verification), when from our own pid.
const SI_QUEUE: c_int = -1;
/// `si_pid` for queued signals (`_sifields._rt`).
const SI_PID_OFFSET: usize = 16;
/// Record flag: a sample taken on request ([`SignalSampler::request_sample`]),
/// not by the clock; it carries no weight.
pub const REQUESTED: u32 = 1 << 16;
/// Record flag: the handler did not walk; the record has no frames and a
/// copy of the thread's whole live stack, for the agent to walk.
pub const DEFERRED: u32 = 1 << 17;

/// Perf event fds up to this number can be mapped to slots in the handler.
const MAX_PERF_FD: usize = 65536;

// siginfo_t for timer signals (kernel `__sifields._timer`): si_code at 8,
// si_overrun at 20, si_value at 24; 128 bytes in all.
const _: () = assert!(std::mem::size_of::<libc::siginfo_t>() == 128);
const SI_CODE_OFFSET: usize = 8;
const SI_OVERRUN_OFFSET: usize = 20;
const SI_VALUE_OFFSET: usize = 24;
// For SIGPOLL-style signals (`__sifields._sigpoll`): si_band (a long) at 16,
// si_fd at 24.
const SI_FD_OFFSET: usize = 24;

/// What every signal reads first, before its slot: which slot is the
/// thread's (by its timer's value, or its perf event's fd), and the map.
/// One 2 MiB-aligned block, asked for as a huge page when the sampler is
/// installed (see `hot_memory`): in `.bss` these were pages of their own,
/// each a TLB miss at 100 samples a second, one after another (the fd's
/// slot index, then the slot). The switch and the hijack's two words share
/// the map pointer's line: they were `.bss` pages of their own, read at
/// every signal (the switch) or at a walk's managed-to-native step.
#[repr(C, align(2097152))]
struct HandlerStatics {
    map: AtomicPtr<CodeMap>,
    enabled: AtomicBool,
    copy_first: AtomicBool,
    hijack_fields: AtomicU64,
    hijack_trampoline: AtomicU64,
    slots: [AtomicPtr<ThreadSlot>; MAX_SLOTS],
    perf_fds: [std::sync::atomic::AtomicU32; MAX_PERF_FD],
}

static HANDLER_STATICS: HandlerStatics = HandlerStatics {
    map: AtomicPtr::new(null_mut()),
    enabled: AtomicBool::new(false),
    copy_first: AtomicBool::new(false),
    hijack_fields: AtomicU64::new(0),
    hijack_trampoline: AtomicU64::new(0),
    slots: [const { AtomicPtr::new(null_mut()) }; MAX_SLOTS],
    perf_fds: [const { std::sync::atomic::AtomicU32::new(0) }; MAX_PERF_FD],
};
const _: () = assert!(std::mem::size_of::<HandlerStatics>() == 2 << 20);

/// The slots of the threads being sampled, indexed by the value each
/// thread's timer carries.
static SLOTS: &[AtomicPtr<ThreadSlot>; MAX_SLOTS] = &HANDLER_STATICS.slots;
/// Slot index + 1 of the thread whose perf event has each fd (0: none).
static PERF_FDS: &[std::sync::atomic::AtomicU32; MAX_PERF_FD] = &HANDLER_STATICS.perf_fds;
/// The code map walks read; replaced whole, freed only when no handler runs.
static MAP: &AtomicPtr<CodeMap> = &HANDLER_STATICS.map;

/// Asks for [`HANDLER_STATICS`] on a huge page, and has it mapped now, on
/// the agent's thread before a signal (a page fault in the handler would
/// zero 2 MiB). Only where the loader honoured its alignment (glibc 2.35
/// and later do, for a library's segments); where the kernel gives no huge
/// page it is 2 MiB of small ones.
fn map_handler_statics() {
    let at = &HANDLER_STATICS as *const HandlerStatics as usize;
    let len = std::mem::size_of::<HandlerStatics>();
    if !at.is_multiple_of(2 << 20) {
        // Mapped page by page as before: populated whole, it would be 2 MiB
        // of small pages.
        return;
    }
    // SAFETY: the range is exactly this static (its size is its alignment);
    // MADV_HUGEPAGE changes no contents.
    unsafe { libc::madvise(at as *mut c_void, len, libc::MADV_HUGEPAGE) };
    crate::process::populate(at, len);
}
/// Samples are taken only while this is set.
static ENABLED: &AtomicBool = &HANDLER_STATICS.enabled;
/// The handler copies the stack and leaves the walk to the agent
/// ([`DEFERRED`]) whenever the live stack fits the copy pool's free blocks.
static COPY_FIRST: &AtomicBool = &HANDLER_STATICS.copy_first;
/// Counters for signals that could not become samples.
static NOT_READY: AtomicU64 = AtomicU64::new(0);
/// Where the runtime's thread object keeps a hijacked return address: the
/// byte offset of `Thread::m_pvHJRetAddr`, which `m_ppvHJRetAddrPtr` (the
/// stack slot it came from) follows. 0 while unknown.
static HIJACK_FIELDS: &AtomicU64 = &HANDLER_STATICS.hijack_fields;
/// The runtime's hijack trampoline, once a hijack has been seen, for maps
/// that did not find it in libcoreclr (a return address never equal to it
/// is never a hijacked one). 0 while unknown.
static HIJACK_TRAMPOLINE: &AtomicU64 = &HANDLER_STATICS.hijack_trampoline;
/// Native return addresses of managed frames already found not to be the
/// trampoline, so the thread object is read once per address, not once per
/// sample. Filled first come, first kept; 0 is an empty entry.
static NOT_HIJACKS: [AtomicU64; 64] = [const { AtomicU64::new(0) }; 64];
static HIJACKS_UNDONE: AtomicU64 = AtomicU64::new(0);
static FOREIGN: AtomicU64 = AtomicU64::new(0);
static NO_SLOT: AtomicU64 = AtomicU64::new(0);
static PANICKED: AtomicU64 = AtomicU64::new(0);

/// Counters of signals that did not become samples, process-wide.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SignalCounters {
    /// Arrived before the agent was ready or after it stopped.
    pub not_ready: u64,
    /// `SIGPROF`s not raised by our timers (sent by someone else).
    pub foreign: u64,
    /// For a slot that no longer (or never) belonged to the thread.
    pub no_slot: u64,
    /// A dependency panicked inside the handler (sampling then stops).
    pub panicked: u64,
    /// Return addresses the runtime had hijacked, put back in walks.
    pub hijacks_undone: u64,
}

pub fn counters() -> SignalCounters {
    SignalCounters {
        not_ready: NOT_READY.load(Ordering::Relaxed),
        foreign: FOREIGN.load(Ordering::Relaxed),
        no_slot: NO_SLOT.load(Ordering::Relaxed),
        panicked: PANICKED.load(Ordering::Relaxed),
        hijacks_undone: HIJACKS_UNDONE.load(Ordering::Relaxed),
    }
}

/// Tells the handler where the runtime's thread object keeps a hijacked
/// return address (see [`HIJACK_FIELDS`]); the agent finds it.
pub fn set_hijack_fields_offset(offset: u64) {
    HIJACK_FIELDS.store(offset, Ordering::Relaxed);
}

pub fn hijack_fields_offset() -> u64 {
    HIJACK_FIELDS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use corsnap_unwind::process::{native_module, parse_maps, stack_ranges, LoadedElf};
    use corsnap_unwind::{address_of, flags, NativeModule};

    /// A copy of a stack carries the original return address in place of a
    /// hijack that the walk did not meet, and nothing else is changed: not
    /// a slot below the copy, nor one that no longer holds the trampoline.
    #[test]
    fn a_hijack_the_walk_did_not_meet_is_found_for_the_copy() {
        const OFFSET: u64 = 0x118;
        let trampoline = 0x7000_1000u64;
        let original = 0x7000_5678u64;
        let stub = corsnap_unwind::HijackStub {
            range: trampoline..trampoline + 0x42,
            call_return: trampoline + 0x20,
            return_slot: 0x40,
            saved_bp: 0x38,
        };
        let map = CodeMap::new(Vec::new(), Vec::new(), Vec::new(), 0).with_hijack_stub(Some(stub));
        let mut stack = vec![0u64; 64];
        stack[40] = trampoline;
        let start = stack.as_ptr() as u64;
        let slot = start + 40 * 8;
        // The runtime's thread object: m_pvHJRetAddr, then m_ppvHJRetAddrPtr.
        let mut thread = vec![0u64; 64];
        thread[OFFSET as usize / 8] = original;
        thread[OFFSET as usize / 8 + 1] = slot;
        let runtime_thread = thread.as_ptr() as u64;
        let memory = LiveMemory { stack: start..start + 64 * 8, map: &map, runtime_thread };
        let before = HIJACK_FIELDS.swap(OFFSET, Ordering::Relaxed);
        assert_eq!(memory.hijack_in_stack(start), Some((slot, original)));
        // A copy word by word puts the original back where the trampoline
        // is (looked up when the copy meets it), and nothing else changes.
        let mut hijack = CopyHijack::new(None, &memory);
        let copied: Vec<u64> = (0..64).map(|i| memory.copied_word(start, i, &mut hijack)).collect();
        let mut expected = stack.clone();
        expected[40] = original;
        assert_eq!(copied, expected);
        // An event walk's copy of its own stack, all at once, is the same;
        // and the words past the stack's end are 0, as word by word.
        let mut at_once = CopyHijack::new(None, &memory);
        assert_eq!(memory.copy_own_stack(start, 64, &mut at_once), expected);
        let mut past_end = CopyHijack::new(None, &memory);
        let long = memory.copy_own_stack(start + 8, 70, &mut past_end);
        let mut by_word = CopyHijack::new(None, &memory);
        assert_eq!(long, (0..70).map(|i| memory.copied_word(start + 8, i, &mut by_word)).collect::<Vec<_>>());
        assert_eq!((long[39], long[63..].iter().all(|&w| w == 0)), (original, true));
        // A copy that starts above the slot never meets it.
        let mut above = CopyHijack::new(None, &memory);
        assert!((0..20).all(|i| memory.copied_word(slot + 8, i, &mut above) == stack[41 + i]));
        assert!(matches!(above, CopyHijack::NotLooked { .. }), "no look at the thread object");
        // The walk's own undone hijack is used as it is.
        let mut walked = CopyHijack::new(Some((slot, original)), &memory);
        assert_eq!(memory.copied_word(start, 40, &mut walked), original);
        // The slot lies below the copy's first word: not the copy's.
        assert_eq!(memory.hijack_in_stack(slot + 8), None);
        // The hijack was undone (the slot holds the original again).
        stack[40] = original;
        assert_eq!(memory.hijack_in_stack(start), None);
        // A thread the agent does not know.
        stack[40] = trampoline;
        let unknown = LiveMemory { runtime_thread: 0, ..memory };
        assert_eq!(unknown.hijack_in_stack(start), None);
        HIJACK_FIELDS.store(before, Ordering::Relaxed);
        std::hint::black_box((&stack, &thread));
    }

    /// Every native frame the row tables have a rule for unwinds as
    /// framehop unwinds it, as a leaf and as a return address, and as the
    /// packed granules step it wherever they do: addresses all through this
    /// process's libraries (libc, libm, the loader, this test's own code),
    /// on a stack whose every word differs, so that a wrong offset reads a
    /// wrong value.
    #[test]
    fn native_frames_unwind_by_the_row_tables_as_by_framehop() {
        struct Distinct;
        impl corsnap_unwind::Memory for Distinct {
            fn stack_word(&self, addr: u64) -> Option<u64> {
                (0x10_0000..0x30_0000).contains(&addr).then(|| addr.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 8)
            }
            fn code_bytes(&self, _: &corsnap_unwind::ManagedCode, _: std::ops::Range<u64>) -> Option<&[u8]> {
                None
            }
        }
        let started = Instant::now();
        let map = own_code_map();
        let bytes = corsnap_unwind::native_table_bytes(&map);
        eprintln!("row tables: {bytes} bytes, built with the map in {:?}", started.elapsed());
        let (objects, _) = crate::process::loaded_objects();
        let (mut compared, mut ends, mut by_granule, mut wrong) = (0u64, 0u64, 0u64, Vec::new());
        for o in &objects {
            for &(start, len, _) in o.segments.iter().filter(|s| s.2) {
                for address in (o.bias.wrapping_add(start)..o.bias.wrapping_add(start + len)).step_by(37) {
                    for exact in [true, false] {
                        // A return address is looked up one byte back, in the call.
                        let ip = if exact { address } else { address + 1 };
                        let regs = Regs { ip, sp: 0x18_0000, bp: 0x20_0000 };
                        let Some((table, framehop)) =
                            corsnap_unwind::native_frame_both_ways(&map, &Distinct, regs, exact)
                        else {
                            continue;
                        };
                        compared += 1;
                        ends += u64::from(table.is_some_and(|t| t.ip == 0));
                        let same = match framehop {
                            // framehop's end of the stack: a return address of 0.
                            Some(f) if f.ip == 0 => table.is_some_and(|t| t.ip == 0),
                            f => table == f,
                        };
                        if !same && wrong.len() < 10 {
                            wrong.push((o.name.clone(), address - o.bias, exact, table, framehop));
                        }
                        if let Some(granule) = corsnap_unwind::native_frame_by_granule(&map, &Distinct, regs, exact) {
                            by_granule += 1;
                            if Some(granule) != table && wrong.len() < 10 {
                                wrong.push((o.name.clone(), address - o.bias, exact, Some(granule), table));
                            }
                        }
                    }
                }
            }
        }
        eprintln!(
            "{compared} frames compared, {ends} of them at a row that ends the stack, {by_granule} stepped by granules too"
        );
        assert!(compared > 20_000, "only {compared} frames had a rule");
        assert!(by_granule * 10 > compared * 8, "only {by_granule} of {compared} frames stepped by granules");
        assert!(wrong.is_empty(), "{wrong:#x?}");
    }

    fn own_code_map() -> CodeMap {
        let (objects, _) = crate::process::loaded_objects();
        let natives = objects
            .iter()
            .filter_map(|o| {
                let elf =
                    LoadedElf { name: &o.name, bias: o.bias, segments: &o.segments, eh_frame_hdr: o.eh_frame_hdr };
                native_module(&elf, crate::process::read_own_memory).map(NativeModule::with_leaf_granules)
            })
            .collect();
        let maps = parse_maps(&std::fs::read_to_string("/proc/self/maps").unwrap());
        CodeMap::new(natives, Vec::new(), stack_ranges(&maps), SignalSampler::sigreturn_trampoline())
    }

    #[inline(never)]
    fn spin_leaf(stop: &AtomicBool) -> u64 {
        let mut x = 1u64;
        while !stop.load(Ordering::Relaxed) {
            for i in 0..1000u64 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
            }
        }
        x
    }

    #[inline(never)]
    fn spin_middle(stop: &AtomicBool) -> u64 {
        std::hint::black_box(spin_leaf(stop)) + 1
    }

    /// The whole path on this test process: install, a timer on a busy
    /// thread, walks in the handler, drain, and a clean uninstall.
    #[test]
    fn a_busy_thread_is_sampled_with_complete_native_stacks_and_uninstall_leaves_nothing() {
        let use_perf = std::env::var_os("CORSNAP_NO_PERF_EVENTS").is_none();
        let mut sampler = SignalSampler::install(use_perf).expect("SIGPROF is free in the test process");
        let stop = Arc::new(AtomicBool::new(false));
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let s = stop.clone();
        let worker = std::thread::spawn(move || {
            tid_tx.send(crate::current_os_tid()).unwrap();
            spin_middle(&s)
        });
        let tid = tid_rx.recv().unwrap();
        sampler.publish(Arc::new(own_code_map()));
        let slot = sampler.add_thread(tid, 1_000_000, 0).unwrap();
        sampler.set_enabled(true);
        let started = Instant::now();
        let mut samples = Vec::new();
        let mut handler_ns: Vec<u64> = Vec::new();
        let mut scratch = Vec::new();
        while samples.len() < 50 && started.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
            sampler.slot(slot).unwrap().drain(&mut scratch, |s| {
                handler_ns.push(s.handler_ns);
                samples.push((s.flags, s.weight_ns, s.frames.to_vec()))
            });
        }
        assert!(samples.len() >= 50, "only {} samples", samples.len());
        handler_ns.sort_unstable();
        eprintln!(
            "handler: median {} ns, p90 {} ns, {} frames",
            handler_ns[handler_ns.len() / 2],
            handler_ns[handler_ns.len() * 9 / 10],
            samples[samples.len() / 2].2.len()
        );
        let (perf, timers, refusal) = sampler.perf_status();
        eprintln!("sampled by perf events: {perf}, by timers: {timers} ({refusal:?})");
        // Weights are CPU nanoseconds: around the 1 ms interval (perf events),
        // or whole scheduler ticks of it (timers, checked only at a tick).
        let mean = samples.iter().map(|s| s.1).sum::<u64>() / samples.len() as u64;
        assert!((400_000..=5_000_000).contains(&mean), "mean weight {mean} ns");
        let middle = spin_middle as fn(&AtomicBool) -> u64 as usize as u64;
        let in_middle = |f: &u64| (middle..middle + 512).contains(&address_of(*f));
        let complete = samples.iter().filter(|(fl, _, _)| fl & flags::COMPLETE != 0).count();
        let through_middle = samples.iter().filter(|(_, _, fr)| fr.iter().any(in_middle)).count();
        assert!(complete * 100 >= samples.len() * 95, "{complete} of {} complete", samples.len());
        assert!(
            through_middle * 100 >= samples.len() * 95,
            "{through_middle} of {} through spin_middle",
            samples.len()
        );
        // Moved to a timer and back (`--cpu-clock auto`), the thread goes on
        // being sampled, by one clock at a time.
        if perf == 1 {
            for (timer, expected) in [(true, (0, 1)), (false, (1, 0))] {
                assert!(sampler.set_thread_clock(slot, timer).unwrap());
                assert!(!sampler.set_thread_clock(slot, timer).unwrap(), "already on that clock");
                assert_eq!(sampler.clocks_in_use(), expected);
                sampler.slot(slot).unwrap().drain(&mut scratch, |_| {});
                let mut more = 0;
                let started = Instant::now();
                while more < 20 && started.elapsed() < Duration::from_secs(20) {
                    std::thread::sleep(Duration::from_millis(20));
                    sampler.slot(slot).unwrap().drain(&mut scratch, |s| {
                        assert_ne!(s.weight_ns, 0);
                        more += 1;
                    });
                }
                assert!(more >= 20, "only {more} samples after moving to timer={timer}");
            }
        }
        // The worker keeps running through the uninstall and after it: with
        // SIGPROF back to its default action, any late signal of ours (a
        // timer, a perf event kept alive by its mapping) would kill this
        // test process.
        assert!(sampler.uninstall(Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, Ordering::SeqCst);
        worker.join().unwrap();
        // SAFETY: querying into a zeroed struct.
        let mut now: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        unsafe { libc::sigaction(SAMPLE_SIGNAL, null_mut(), &mut now) };
        assert_eq!(now.sa_sigaction, libc::SIG_DFL, "the previous disposition is back");
        // A second install finds the same trampoline page.
        let again = SignalSampler::install(use_perf).unwrap();
        assert_eq!(std::fs::read_to_string("/proc/self/maps").unwrap().matches(TRAMPOLINE_NAME).count(), 2);
        assert!(again.uninstall(Duration::from_secs(5)));
    }
}
