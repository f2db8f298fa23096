//! The handler's clock: the CPU's time-stamp counter, converted to
//! `CLOCK_MONOTONIC` by the agent.
//!
//! At 100 samples a second the vDSO's `clock_gettime` is cold at every
//! signal: its code and the kernel's clock page miss the caches and the
//! TLB. Timed in a `SIGPROF` handler that did nothing else, on a thread
//! that only spins (`bench/programs/clock_probe.c`, 100 Hz, these 2-vCPU
//! VMs), one call took a median of 790 ns to 2.1 µs as the host was
//! quiet or busy; reading the counter (`RDTSC`, one instruction that reads
//! no memory) 19 to 34 ns. The handler called it twice a sample: at its
//! entry, and to stamp the record. In corsnap's handler the first call's
//! misses overlapped the misses of the first reads it prefetches, so the
//! gain there is smaller than the probe's figures.
//!
//! So the handler reads only the counter: at its entry, and when it
//! publishes the record (the sample's time, and the handler's own time as a
//! difference of the two). The agent converts when it drains, by a line
//! through pairs of readings of both clocks taken on its own thread: the
//! first pair taken 2 ms apart, the line's slope then taken over all the
//! time since the first pair, and its anchor moved to a fresh pair at most
//! 50 ms old. The counter's rate is constant where the kernel keeps time by
//! it, so the error is the kernel's slewing of `CLOCK_MONOTONIC` over those
//! 50 ms: microseconds at most.
//!
//! The counter stands for the sample's time only where the kernel's own
//! clocksource is `tsc` (invariant, and the same on every CPU). Elsewhere
//! the record keeps `CLOCK_MONOTONIC` read at publishing, as before, and
//! the counter serves the handler's own time alone.

use std::sync::{Mutex, OnceLock};

use super::monotonic_ns;

/// The time-stamp counter. Async-signal-safe: one instruction, no memory.
#[inline(always)]
pub(super) fn counter() -> u64 {
    // SAFETY: RDTSC has no preconditions on x86_64 (this crate's only
    // target), and reads no memory.
    #[allow(unused_unsafe)]
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
}

/// Whether the kernel keeps time by the counter (its clocksource is `tsc`),
/// so that a reading of it is a time on every CPU. Read once; never in the
/// handler.
pub(super) fn counter_is_the_clock() -> bool {
    static IS: OnceLock<bool> = OnceLock::new();
    *IS.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .is_ok_and(|s| s.trim() == "tsc")
    })
}

/// A line from counter readings to `CLOCK_MONOTONIC` nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CounterToNs {
    anchor_counter: u64,
    anchor_ns: u64,
    /// Nanoseconds per count, times 2^32.
    ns_per_count_q32: u64,
}

impl CounterToNs {
    /// `CLOCK_MONOTONIC` when the counter read `counter`.
    pub(super) fn time_ns(&self, counter: u64) -> u64 {
        let counts = counter.wrapping_sub(self.anchor_counter) as i64;
        // Rounded to the nearest nanosecond.
        let ns =
            i128::from(self.anchor_ns) + ((i128::from(counts) * i128::from(self.ns_per_count_q32) + (1 << 31)) >> 32);
        u64::try_from(ns.max(0)).unwrap_or(u64::MAX)
    }

    /// How long `counts` of the counter last, in nanoseconds.
    pub(super) fn duration_ns(&self, counts: u64) -> u64 {
        u64::try_from((u128::from(counts) * u128::from(self.ns_per_count_q32) + (1 << 31)) >> 32).unwrap_or(u64::MAX)
    }

    /// The line through two pairs (counter, nanoseconds), anchored at the
    /// second.
    fn through(first: (u64, u64), last: (u64, u64)) -> CounterToNs {
        let counts = last.0.saturating_sub(first.0).max(1);
        let ns = last.1.saturating_sub(first.1);
        let q32 = (u128::from(ns) << 32) / u128::from(counts);
        CounterToNs {
            anchor_counter: last.0,
            anchor_ns: last.1,
            ns_per_count_q32: u64::try_from(q32).unwrap_or(1 << 32),
        }
    }
}

/// A reading of both clocks at one moment (the counter's, midway).
fn pair() -> (u64, u64) {
    let before = counter();
    let ns = monotonic_ns();
    let after = counter();
    (before + after.wrapping_sub(before) / 2, ns)
}

/// How far apart the first two pairs are taken.
const FIRST_SPAN_NS: u64 = 2_000_000;
/// How old the anchor may grow before a fresh pair replaces it.
const ANCHOR_AGE_NS: u64 = 50_000_000;

struct Fit {
    first: (u64, u64),
    line: CounterToNs,
}

/// The current line (see the module documentation). On the agent's thread,
/// never in the handler: it takes a lock, and the first call spins 2 ms.
pub(super) fn counter_to_ns() -> CounterToNs {
    static FIT: Mutex<Option<Fit>> = Mutex::new(None);
    let mut fit = FIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match fit.as_mut() {
        None => {
            let first = pair();
            while monotonic_ns().saturating_sub(first.1) < FIRST_SPAN_NS {
                std::hint::spin_loop();
            }
            let line = CounterToNs::through(first, pair());
            *fit = Some(Fit { first, line });
            line
        }
        Some(f) => {
            if monotonic_ns().saturating_sub(f.line.anchor_ns) >= ANCHOR_AGE_NS {
                f.line = CounterToNs::through(f.first, pair());
            }
            f.line
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_through_two_pairs_converts_times_and_durations() {
        // 3 counts a nanosecond, anchored at (3000, 1000).
        let line = CounterToNs::through((0, 0), (3000, 1000));
        assert_eq!(line.time_ns(3000), 1000);
        assert_eq!(line.time_ns(6000), 2000);
        assert_eq!(line.time_ns(1500), 500, "before the anchor");
        assert_eq!(line.time_ns(0), 0);
        assert_eq!(line.duration_ns(300), 100);
    }

    #[test]
    fn the_counter_agrees_with_the_monotonic_clock() {
        let line = counter_to_ns();
        let (c, ns) = pair();
        let converted = line.time_ns(c);
        assert!(converted.abs_diff(ns) < 1_000_000, "{converted} against {ns}");
        let start = counter();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let slept = line.duration_ns(counter() - start);
        assert!((19_000_000..200_000_000).contains(&slept), "{slept} ns");
    }
}
