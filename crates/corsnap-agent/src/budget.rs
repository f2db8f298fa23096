//! A ceiling on the share of wall time the program spends stopped for us.
//!
//! A tick stops every managed thread until the slowest one reaches a safe
//! point. Usually that takes ~0.1 ms, but some phases of a program are hard
//! to stop: just after start-up, .NET 8 runs hot methods as PGO-instrumented
//! code that spends much of its time inside native counting helpers, where
//! a thread cannot be hijacked, and `SuspendRuntime` re-pings every
//! millisecond until each thread happens to be somewhere it can stop. Such
//! ticks take 5 to 30 ms, and at 100 Hz they can keep the whole program
//! stopped a third of the time.
//!
//! So the sampler spends from a token bucket: pause time accrues at a fixed
//! share of elapsed time, each tick spends the pause it cost beyond an
//! ordinary tick, and a tick
//! that comes due while the bucket is in debt is skipped (and counted, and
//! reported by the CLI). Skipped ticks are left unsampled, as when a sampler
//! falls behind: a `cpu` sample carries at most two intervals of CPU, so no
//! single stack stands in for a whole gap.

/// A tick is charged only for the pause beyond this: what an ordinary tick
/// costs is the price of the rate the user chose, and is never throttled.
/// A suspension that needed the runtime to re-ping a thread (every 1 ms)
/// is past it.
pub const SLOW_TICK_NS: u64 = 1_000_000;
/// How much pause may be spent at once from a full bucket (one slow tick
/// fits; a run of them does not), and the most the bucket may owe. A single
/// huge tick (a collection that takes the thread store just before our
/// `SuspendRuntime` does is waited out inside it) then silences sampling
/// for at most capacity / share, a second at 2%, not for minutes.
pub const CAPACITY_NS: u64 = 20_000_000;

#[derive(Debug, Clone)]
pub struct PauseBudget {
    share_ppm: u64,
    capacity_ns: i64,
    balance_ns: i64,
    refilled_at_ns: Option<u64>,
}

impl PauseBudget {
    pub fn new(share_ppm: u64, capacity_ns: u64) -> Self {
        let capacity_ns = capacity_ns.min(i64::MAX as u64) as i64;
        PauseBudget { share_ppm, capacity_ns, balance_ns: capacity_ns, refilled_at_ns: None }
    }

    /// Whether a tick due at `now_ns` (any monotonic clock) may run.
    pub fn allows(&mut self, now_ns: u64) -> bool {
        self.refill(now_ns);
        self.balance_ns >= 0
    }

    /// Charges a tick that kept the program stopped for `pause_ns`: only
    /// what it took beyond an ordinary tick.
    pub fn spend(&mut self, pause_ns: u64) {
        let excess = pause_ns.saturating_sub(SLOW_TICK_NS);
        self.balance_ns = self.balance_ns.saturating_sub(excess.min(i64::MAX as u64) as i64).max(-self.capacity_ns);
    }

    fn refill(&mut self, now_ns: u64) {
        if let Some(before) = self.refilled_at_ns {
            let earned = now_ns.saturating_sub(before).saturating_mul(self.share_ppm) / 1_000_000;
            self.balance_ns = self.balance_ns.saturating_add(earned.min(i64::MAX as u64) as i64).min(self.capacity_ns);
        }
        self.refilled_at_ns = Some(now_ns.max(self.refilled_at_ns.unwrap_or(0)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const SHARE_PPM: u64 = corsnap_wire::DEFAULT_MAX_PAUSE_PPM as u64;

    /// Runs ticks every `interval` for `duration`, each costing `cost(i)`;
    /// returns (ticks run, ticks skipped, total pause).
    fn simulate(budget: &mut PauseBudget, interval: u64, duration: u64, cost: impl Fn(u64) -> u64) -> (u64, u64, u64) {
        let (mut run, mut skipped, mut paused) = (0, 0, 0);
        let mut now = 0;
        let mut i = 0;
        while now < duration {
            if budget.allows(now) {
                let c = cost(i);
                budget.spend(c);
                paused += c;
                now += c;
                run += 1;
            } else {
                skipped += 1;
            }
            now += interval;
            i += 1;
        }
        (run, skipped, paused)
    }

    #[test]
    fn cheap_ticks_are_never_skipped() {
        let mut b = PauseBudget::new(SHARE_PPM, CAPACITY_NS);
        // 1000 Hz at 0.9 ms a tick stops the program half the time, but
        // that is the rate asked for.
        let (run, skipped, _) = simulate(&mut b, MS, 60_000 * MS, |_| 900_000);
        assert_eq!(skipped, 0);
        assert!(run > 31_000);
    }

    #[test]
    fn slow_phases_are_held_to_the_share() {
        let mut b = PauseBudget::new(SHARE_PPM, CAPACITY_NS);
        let duration = 10_000 * MS;
        let (run, skipped, paused) = simulate(&mut b, 10 * MS, duration, |_| 15 * MS);
        assert!(skipped > 0);
        // Beyond what ordinary ticks cost: the whole bucket, plus 2% of the
        // time, plus the one tick that overdraws it.
        let excess = paused - run * SLOW_TICK_NS;
        assert!(excess <= CAPACITY_NS + duration / 50 + 15 * MS, "excess pause {excess}");
        assert!(paused < duration / 25, "paused {paused} of {duration}");
    }

    #[test]
    fn one_slow_tick_does_not_stop_sampling() {
        let mut b = PauseBudget::new(SHARE_PPM, CAPACITY_NS);
        let (run, skipped, _) = simulate(&mut b, 10 * MS, 1000 * MS, |i| if i == 3 { 15 * MS } else { 100_000 });
        assert_eq!(skipped, 0);
        assert!(run >= 98);
    }

    #[test]
    fn a_huge_tick_silences_sampling_for_a_second_at_most() {
        let mut b = PauseBudget::new(SHARE_PPM, CAPACITY_NS);
        assert!(b.allows(0));
        b.spend(500 * MS);
        assert!(!b.allows(900 * MS));
        assert!(b.allows(1000 * MS));
    }

    #[test]
    fn the_clock_going_backwards_earns_nothing() {
        let mut b = PauseBudget::new(SHARE_PPM, 10 * MS);
        assert!(b.allows(1000 * MS));
        b.spend(30 * MS + SLOW_TICK_NS);
        assert!(!b.allows(500 * MS));
        assert!(!b.allows(1000 * MS));
        assert!(b.allows(2000 * MS));
    }
}
