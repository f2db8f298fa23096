//! Fitting a profile under a backend's limits. Grafana Pyroscope rejects a
//! pprof of more than 16,000 samples outright (its default
//! `max_profile_size_samples`), so a window with more distinct stacks than
//! that must be made smaller before it is sent, and the user told how.
//!
//! Two steps, each only if still needed, each losing as little as it can:
//! 1. the threads are merged: every sample of a stack counts once for the
//!    process (the `thread` label is what multiplies samples);
//! 2. the long tail is trimmed: the heaviest stacks are kept as they are,
//!    and the lightest are added up into one `[trimmed: N stacks]` frame
//!    per event kind, so every total stays exact.

use std::collections::HashMap;

use crate::{EventKind, Frame, FrameKind, Profile, Sample, StackIdx, Thread};

/// The thread every sample is given when threads are merged.
pub const ALL_THREADS: &str = "all threads";

/// What [`fit_samples`] did to a profile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trimmed {
    /// The distinct samples (stack, thread, kind) the profile had.
    pub distinct_before: usize,
    /// Whether the threads were merged into one.
    pub threads_merged: bool,
    /// How many stacks were folded into `[trimmed: …]` frames.
    pub stacks_trimmed: usize,
    /// The share of the total weight those stacks had, in parts per million.
    pub weight_trimmed_ppm: u64,
}

impl Trimmed {
    /// `12,400 distinct stacks: threads merged, 310 lightest stacks (0.8% of
    /// the weight) folded into [trimmed]`.
    pub fn describe(&self, limit: usize) -> String {
        let mut what = Vec::new();
        if self.threads_merged {
            what.push("threads merged".to_string());
        }
        if self.stacks_trimmed > 0 {
            what.push(format!(
                "the {} lightest stacks ({:.2}% of the weight) folded into one [trimmed] frame",
                self.stacks_trimmed,
                self.weight_trimmed_ppm as f64 / 10_000.0
            ));
        }
        format!("{} distinct samples, over the limit of {limit}: {}", self.distinct_before, what.join(", "))
    }
}

/// The number of samples a pprof of `profile` holds: one per distinct
/// (stack, thread, kind), as the pprof writer merges them.
pub fn distinct_samples(profile: &Profile) -> usize {
    let mut seen = std::collections::HashSet::new();
    for s in &profile.samples {
        seen.insert((s.stack, s.thread, s.kind));
    }
    seen.len()
}

/// `profile` with at most `max` distinct samples, and what was done to it
/// (`None`: it fitted as it was).
pub fn fit_samples(profile: &Profile, max: usize) -> (Profile, Option<Trimmed>) {
    let distinct_before = distinct_samples(profile);
    if distinct_before <= max {
        return (profile.clone(), None);
    }
    let mut trimmed = Trimmed { distinct_before, threads_merged: true, ..Trimmed::default() };
    // 1. One thread for all.
    let mut merged = profile.subset(std::iter::empty(), profile.gcs.clone());
    let all = merged.intern_thread(Thread { os_tid: 0, name: ALL_THREADS.to_string() });
    let mut by_stack: HashMap<(StackIdx, EventKind), u64> = HashMap::new();
    for s in &profile.samples {
        *by_stack.entry((s.stack, s.kind)).or_default() += s.weight;
    }
    let kinds = profile.kinds();
    if by_stack.len() > max {
        // 2. The heaviest stacks stay; the rest become one frame per kind
        // (room is kept for those frames).
        let keep = max.saturating_sub(kinds.len()).max(1);
        let mut ranked: Vec<((StackIdx, EventKind), u64)> = by_stack.into_iter().collect();
        // Heaviest first; ties by stack so the choice is deterministic.
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: u64 = ranked.iter().map(|r| r.1).sum::<u64>().max(1);
        let tail = ranked.split_off(keep.min(ranked.len()));
        trimmed.stacks_trimmed = tail.len();
        let tail_weight: u64 = tail.iter().map(|r| r.1).sum();
        trimmed.weight_trimmed_ppm = (u128::from(tail_weight) * 1_000_000 / u128::from(total)) as u64;
        let mut tail_by_kind: HashMap<EventKind, (u64, usize)> = HashMap::new();
        for ((_, kind), weight) in tail {
            let entry = tail_by_kind.entry(kind).or_default();
            entry.0 += weight;
            entry.1 += 1;
        }
        let mut samples: Vec<Sample> = Vec::with_capacity(ranked.len() + tail_by_kind.len());
        for ((stack, kind), weight) in ranked {
            samples.push(Sample { time_ns: 0, thread: 0, stack, weight, kind });
        }
        let kept = profile.subset(samples, Vec::new());
        let mut out = merged;
        for s in &kept.samples {
            let frames: Vec<_> = kept.stacks[s.stack as usize]
                .iter()
                .map(|&f| out.intern_frame(kept.frames[f as usize].clone()))
                .collect();
            let stack = out.intern_stack(&frames);
            out.samples.push(Sample { thread: all, stack, ..*s });
        }
        let mut tail_kinds: Vec<_> = tail_by_kind.into_iter().collect();
        tail_kinds.sort_by_key(|(k, _)| *k);
        for (kind, (weight, stacks)) in tail_kinds {
            let frame = out.intern_frame(Frame::new(format!("[trimmed: {stacks} stacks]"), "", FrameKind::Native));
            let stack = out.intern_stack(&[frame]);
            out.samples.push(Sample { time_ns: 0, thread: all, stack, weight, kind });
        }
        return (out, Some(trimmed));
    }
    let mut ranked: Vec<((StackIdx, EventKind), u64)> = by_stack.into_iter().collect();
    ranked.sort_by_key(|r| r.0);
    let samples =
        ranked.into_iter().map(|((stack, kind), weight)| Sample { time_ns: 0, thread: 0, stack, weight, kind });
    let kept = profile.subset(samples, Vec::new());
    for s in &kept.samples {
        let frames: Vec<_> = kept.stacks[s.stack as usize]
            .iter()
            .map(|&f| merged.intern_frame(kept.frames[f as usize].clone()))
            .collect();
        let stack = merged.intern_stack(&frames);
        merged.samples.push(Sample { thread: all, stack, ..*s });
    }
    (merged, Some(trimmed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Meta;

    /// `stacks` distinct one-frame stacks on each of `threads` threads,
    /// stack `i` weighing `i + 1`.
    fn wide(stacks: u32, threads: u32) -> Profile {
        let mut p = Profile::new(Meta::default());
        for t in 0..threads {
            let thread = p.intern_thread(Thread { os_tid: 100 + t, name: String::new() });
            for i in 0..stacks {
                let f = p.intern_frame(Frame::new(format!("M{i}"), "app.dll", FrameKind::Managed));
                let stack = p.intern_stack(&[f]);
                p.samples.push(Sample { time_ns: 0, thread, stack, weight: u64::from(i) + 1, kind: EventKind::Cpu });
            }
        }
        p
    }

    #[test]
    fn a_profile_within_the_limit_is_left_alone() {
        let p = wide(10, 2);
        let (fitted, trimmed) = fit_samples(&p, 20);
        assert!(trimmed.is_none());
        assert_eq!(fitted.samples.len(), 20);
    }

    #[test]
    fn merging_threads_is_tried_first_and_keeps_every_stack() {
        let p = wide(10, 3);
        let (fitted, trimmed) = fit_samples(&p, 10);
        let trimmed = trimmed.unwrap();
        assert!(trimmed.threads_merged && trimmed.stacks_trimmed == 0, "{trimmed:?}");
        assert_eq!(distinct_samples(&fitted), 10);
        assert_eq!(fitted.total_weight(), p.total_weight());
        assert_eq!(fitted.threads.len(), 1);
    }

    #[test]
    fn the_long_tail_is_folded_and_the_total_kept() {
        let p = wide(1000, 2);
        let (fitted, trimmed) = fit_samples(&p, 100);
        let trimmed = trimmed.unwrap();
        assert_eq!(trimmed.stacks_trimmed, 901);
        assert!(distinct_samples(&fitted) <= 100);
        assert_eq!(fitted.total_weight(), p.total_weight());
        // The heaviest stack is still there by name.
        assert!(fitted.frames.iter().any(|f| f.name == "M999"));
        assert!(fitted.frames.iter().any(|f| f.name == "[trimmed: 901 stacks]"));
        assert!(trimmed.describe(100).contains("901 lightest stacks"), "{}", trimmed.describe(100));
    }
}
