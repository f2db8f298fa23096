//! What `record` says on stderr: the live status line, and the summaries
//! of collections and of the agent's own cost.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// The collections, as totals per generation and a list.
pub fn describe_gcs(gcs: &[corsnap_profile::GcRecord]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let ms = |ns: u64| ns as f64 / 1e6;
    let _ = writeln!(
        out,
        "corsnap: {} garbage collections, {:.2} ms paused in all",
        gcs.len(),
        ms(gcs.iter().map(|g| g.pause_ns).sum())
    );
    for generation in 0..=2 {
        let of_gen: Vec<_> = gcs.iter().filter(|g| g.generation == generation).collect();
        if !of_gen.is_empty() {
            let total: u64 = of_gen.iter().map(|g| g.pause_ns).sum();
            let max = of_gen.iter().map(|g| g.pause_ns).max().unwrap_or(0);
            let _ = writeln!(
                out,
                "corsnap:   gen{generation}: {} collections, {:.2} ms total, {:.2} ms longest",
                of_gen.len(),
                ms(total),
                ms(max)
            );
        }
    }
    for (i, g) in gcs.iter().enumerate().take(50) {
        let reason = if g.reason == 1 { "induced" } else { "allocation" };
        let _ = writeln!(
            out,
            "corsnap:   #{:<3} at {:>9.3} s  gen{}  {reason:<10}  {:.3} ms",
            i + 1,
            g.time_ns as f64 / 1e9,
            g.generation,
            ms(g.pause_ns)
        );
    }
    if gcs.len() > 50 {
        let _ = writeln!(out, "corsnap:   ... and {} more", gcs.len() - 50);
    }
    out
}

/// One line about what sampling cost inside the program.
pub fn describe_stats(s: &corsnap_wire::SamplerStats) -> String {
    let us = |ns: u64| ns as f64 / 1000.0;
    if s.engine == 1 {
        let suspend = if s.ticks > 0 {
            format!(
                "; wall ticks: {} (median suspend {:.1} µs, walk {:.1} µs)",
                s.ticks,
                us(s.suspend_p50_ns),
                us(s.walk_p50_ns)
            )
        } else {
            String::new()
        };
        return format!(
            "agent (signal engine): {} samples from {} threads now sampled ({} by CPU timers, the rest by perf \
             events; {} clock changes), {} dropped; per sample in the handler median {:.1} µs, p99 {:.1} µs; {} \
             stacks incomplete, {} through code not yet learned ({} of the {} samples after the first second), {} \
             with a stack copy walked again ({} more without room for theirs), {} truncated; agent thread CPU {:.0} ms; {} names ({} unresolved){suspend}",
            s.signal_samples,
            s.threads_sampled,
            s.threads_on_timers,
            s.clock_switches,
            s.signal_dropped,
            us(s.handler_p50_ns),
            us(s.handler_p99_ns),
            s.incomplete_stacks,
            s.unknown_code_stacks,
            s.unknown_code_stacks_after_first_second,
            s.samples_after_first_second,
            s.stack_copies,
            s.stack_copies_refused,
            s.truncated_stacks,
            s.sampler_cpu_ns as f64 / 1e6,
            s.names_resolved,
            s.name_failures,
        );
    }
    let mean = |ns: u64| if s.ticks == 0 { 0.0 } else { us(ns) / s.ticks as f64 };
    format!(
        "agent: {} ticks ({} skipped, {} throttled); per tick median suspend {:.1} µs, walk {:.1} µs, resume {:.1} µs \
         (mean total {:.1} µs, p99 {:.1} µs, max {:.1} µs); sampler CPU {:.0} ms; {} stacks, {} walk errors, \
         {} truncated, {} names ({} unresolved); {} cache resets, {} events dropped",
        s.ticks,
        s.skipped_ticks,
        s.throttled_ticks,
        us(s.suspend_p50_ns),
        us(s.walk_p50_ns),
        us(s.resume_p50_ns),
        mean(s.suspend_ns + s.walk_ns + s.resume_ns),
        us(s.tick_p99_ns),
        us(s.max_tick_ns),
        s.sampler_cpu_ns as f64 / 1e6,
        s.samples,
        s.walk_errors,
        s.truncated_stacks,
        s.names_resolved,
        s.name_failures,
        s.cache_resets,
        s.events_dropped
    )
}

/// `1 thread`, `2 threads`.
pub fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// A live line on stderr while recording, only when stderr is a terminal.
///
/// The program writes to the same terminal, and corsnap cannot see when: so
/// the line gets a row of its own. The terminal's scrolling region is set to
/// every row but the last, the program's output scrolls above, and the line
/// is drawn on the last row; the region is reset when recording ends. On a
/// terminal that does not say its size, the line is drawn in place as a
/// fallback.
pub(super) struct StatusLine {
    enabled: bool,
    last: Option<Instant>,
    shown: bool,
    /// Rows of the terminal when the scrolling region was set.
    rows: Option<u16>,
}

impl StatusLine {
    pub(super) fn new() -> Self {
        StatusLine { enabled: std::io::stderr().is_terminal(), last: None, shown: false, rows: None }
    }

    pub(super) fn show(&mut self, elapsed: Duration, limit: Option<Duration>, samples: usize, threads: usize) {
        if !self.enabled || self.last.is_some_and(|t| t.elapsed() < Duration::from_millis(250)) {
            return;
        }
        self.last = Some(Instant::now());
        let time = match limit {
            Some(d) => format!("{:.1} s of {:.0} s", elapsed.as_secs_f64(), d.as_secs_f64()),
            None => format!("{:.1} s", elapsed.as_secs_f64()),
        };
        let text = format!(
            "corsnap: recording {time}, {}, {} (Ctrl-C to stop)",
            plural(samples, "sample"),
            plural(threads, "thread")
        );
        let mut err = std::io::stderr().lock();
        let rows = corsnap_abi::os::terminal_size(2).map(|(r, _)| r).filter(|&r| r >= 3);
        match rows {
            Some(rows) => {
                if self.rows != Some(rows) {
                    // Make room, then keep the last row for this line: save
                    // the cursor, set the region (which homes the cursor),
                    // put the cursor back.
                    if self.rows.is_none() {
                        let _ = write!(err, "\n\x1b[1A");
                    }
                    let _ = write!(err, "\x1b7\x1b[1;{}r\x1b8", rows - 1);
                    self.rows = Some(rows);
                }
                let _ = write!(err, "\x1b7\x1b[{rows};1H\x1b[2K{text}\x1b8");
            }
            None => {
                let _ = write!(err, "\r\x1b[K{text}");
            }
        }
        self.shown = true;
        let _ = err.flush();
    }

    pub(super) fn clear(&mut self) {
        if !self.shown {
            return;
        }
        let mut err = std::io::stderr().lock();
        match self.rows.take() {
            Some(rows) => {
                let _ = write!(err, "\x1b7\x1b[r\x1b[{rows};1H\x1b[2K\x1b8");
            }
            None => {
                let _ = write!(err, "\r\x1b[K");
            }
        }
        let _ = err.flush();
        self.shown = false;
    }
}
