//! Continuous recording (`corsnap record --interval 15s`): the recording is
//! cut into windows aligned to the wall clock, and each window, a complete
//! profile of its own, is handed to every sink: files that rotate
//! ([`files`]), Grafana Pyroscope's push API ([`pyroscope`]), OTLP profiles
//! ([`otlp`]). py-spy's recorder is the model: the recording loop knows
//! nothing of where windows go, only that each sink takes them one by one.
//!
//! Cutting. The agent stamps each sample with its own clock (nanoseconds
//! since it started); corsnap maps that clock to the wall clock by the
//! earliest arrival it has seen (a sample can arrive late, never early).
//! A window ending at wall time T is cut a moment after T (samples are
//! sent in batches), and takes every sample stamped before T that has
//! arrived by then ([`ProfileBuilder::take_window`]). A sample that arrives
//! later still goes into the next window: each sample is in exactly one
//! window, none is lost or counted twice.

pub mod files;
pub mod otlp;
pub mod pyroscope;
pub mod upload;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};
use corsnap_profile::{Profile, ProfileBuilder};
use corsnap_wire::Message;

/// One window of a continuous recording.
#[derive(Debug)]
pub struct Window {
    /// 0 for the first window of the recording.
    pub index: u64,
    pub start_unix_ns: u64,
    pub duration_ns: u64,
    /// Its samples, with `meta.start_unix_ms` and `meta.duration_ns` set.
    pub profile: Profile,
}

/// Where windows go. Each sink takes every window in order; a sink that
/// sends over the network queues it and returns at once.
pub trait Sink {
    /// What the sink is, for messages (`files /var/log/p-%n{3}.pb.gz`).
    fn describe(&self) -> String;
    /// Takes one window. An error is reported and recording goes on.
    fn window(&mut self, window: &Window) -> Result<()>;
    /// No more windows: finish by `deadline` at the latest, and say what
    /// was done (one line).
    fn finish(&mut self, deadline: Instant) -> String;
}

/// What every window is labelled with, in each backend's words.
#[derive(Debug, Clone, Default)]
pub struct Labels {
    /// `--service`, else the program's name.
    pub service: String,
    /// `--label k=v`, in order.
    pub extra: Vec<(String, String)>,
    pub host: String,
}

impl Labels {
    pub fn new(service: String, extra: Vec<(String, String)>) -> Labels {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string();
        Labels { service, extra, host }
    }
}

/// `k=v` for `--label`: the name must be a Prometheus label name (what
/// Pyroscope, Parca and OTLP backends all accept), the value not empty.
pub fn parse_label(text: &str) -> Result<(String, String), String> {
    let Some((name, value)) = text.split_once('=') else {
        return Err(format!("`{text}` is not a label: write it as name=value (for example env=prod)"));
    };
    let valid_name = !name.is_empty()
        && name.chars().enumerate().all(|(i, c)| c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()))
        && !name.starts_with("__");
    if !valid_name {
        return Err(format!(
            "`{name}` cannot be a label name: use letters, digits and _ (not first a digit, not starting with __)"
        ));
    }
    if value.is_empty() {
        return Err(format!("the label {name} has no value: write it as {name}=value"));
    }
    Ok((name.to_string(), value.to_string()))
}

/// The wall clock in nanoseconds since the Unix epoch.
pub fn unix_now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos() as u64
}

/// The next multiple of `interval` after `after` (both in ns since the
/// Unix epoch): windows end on the wall clock's round times (:00, :15, :30,
/// :45 for 15 s), as Pyroscope's own clients cut theirs.
pub fn next_boundary(after_ns: u64, interval: Duration) -> u64 {
    let step = interval.as_nanos().max(1) as u64;
    (after_ns / step + 1) * step
}

/// How long after a window's end it is cut: samples reach corsnap in
/// batches, a moment after they were taken.
fn grace(interval: Duration) -> Duration {
    (interval / 4).min(Duration::from_millis(400))
}

/// The shortest interval: below a second a window holds too few samples to
/// say anything, and backends are built for 10 s and more.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

pub fn check_interval(interval: Duration) -> Result<()> {
    if interval < MIN_INTERVAL {
        bail!(
            "--interval {} ms is too short: windows of less than a second hold too few samples; Pyroscope's own \
             clients use 10 to 15 s",
            interval.as_millis()
        );
    }
    Ok(())
}

/// The windows of a continuous recording, and the sinks they go to.
pub struct Continuous {
    interval: Duration,
    sinks: Vec<Box<dyn Sink>>,
    /// The agent's clock's zero on the wall clock, in ns since the Unix
    /// epoch: the earliest (arrival - stamp) seen.
    agent_epoch_unix_ns: Option<u64>,
    index: u64,
    window_start_ns: u64,
    window_end_ns: u64,
    /// Windows cut, and the samples they held.
    pub windows: u64,
    pub samples: u64,
}

impl std::fmt::Debug for Continuous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Continuous").field("interval", &self.interval).field("index", &self.index).finish()
    }
}

impl Continuous {
    pub fn new(interval: Duration, sinks: Vec<Box<dyn Sink>>) -> Continuous {
        let now = unix_now_ns();
        Continuous {
            interval,
            sinks,
            agent_epoch_unix_ns: None,
            index: 0,
            window_start_ns: now,
            window_end_ns: next_boundary(now, interval),
            windows: 0,
            samples: 0,
        }
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Starts the first window now (sampling starts now).
    pub fn restart_clock(&mut self) {
        // In whole milliseconds, as pprof's start is kept: a window's start
        // plus its duration is then exactly the next one's start.
        let now = unix_now_ns() / 1_000_000 * 1_000_000;
        self.window_start_ns = now;
        self.window_end_ns = next_boundary(now, self.interval);
    }

    /// Nothing was recorded: the sinks stop at once, sending nothing.
    pub fn abandon(&mut self) {
        let now = Instant::now();
        for sink in &mut self.sinks {
            sink.finish(now);
        }
    }

    /// Where windows go, for messages.
    pub fn describe(&self) -> Vec<String> {
        self.sinks.iter().map(|s| s.describe()).collect()
    }

    /// Learns the agent's clock from a message as it arrives.
    pub fn observe(&mut self, msg: &Message) {
        let stamp = match msg {
            Message::Hello { .. } => 0,
            Message::Sample { time_ns, .. } | Message::Gc { time_ns, .. } => *time_ns,
            _ => return,
        };
        let epoch = unix_now_ns().saturating_sub(stamp);
        self.agent_epoch_unix_ns = Some(self.agent_epoch_unix_ns.map_or(epoch, |e| e.min(epoch)));
    }

    /// Cuts the windows that are due (called often by the recording loop).
    pub fn tick(&mut self, builder: &mut ProfileBuilder) {
        while unix_now_ns() >= self.window_end_ns + grace(self.interval).as_nanos() as u64 {
            let end = self.window_end_ns;
            self.cut(builder, end);
        }
    }

    /// The last window, up to now, and every sink finished within `limit`.
    pub fn finish(&mut self, builder: &mut ProfileBuilder, limit: Duration) -> Vec<String> {
        let now = (unix_now_ns() / 1_000_000 * 1_000_000).max(self.window_start_ns);
        self.window_end_ns = now;
        self.cut_at(builder, now, u64::MAX);
        let deadline = Instant::now() + limit;
        self.sinks.iter_mut().map(|s| s.finish(deadline)).collect()
    }

    fn cut(&mut self, builder: &mut ProfileBuilder, end_ns: u64) {
        let before = match self.agent_epoch_unix_ns {
            Some(epoch) => end_ns.saturating_sub(epoch),
            // Nothing has arrived yet: there is nothing to take.
            None => 0,
        };
        self.cut_at(builder, end_ns, before);
    }

    fn cut_at(&mut self, builder: &mut ProfileBuilder, end_ns: u64, before_agent_ns: u64) {
        let mut profile = builder.take_window(before_agent_ns);
        let duration_ns = end_ns.saturating_sub(self.window_start_ns);
        profile.meta.start_unix_ms = self.window_start_ns / 1_000_000;
        profile.meta.duration_ns = duration_ns;
        let window = Window { index: self.index, start_unix_ns: self.window_start_ns, duration_ns, profile };
        self.samples += window.profile.samples.len() as u64;
        self.windows += 1;
        for sink in &mut self.sinks {
            if let Err(e) = sink.window(&window) {
                eprintln!("corsnap: error: window {} to {}: {e:#}", window.index, sink.describe());
            }
        }
        self.index += 1;
        self.window_start_ns = end_ns;
        self.window_end_ns = next_boundary(end_ns, self.interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_end_on_round_times() {
        let s = 1_000_000_000u64;
        assert_eq!(next_boundary(1_700_000_007 * s, Duration::from_secs(15)), 1_700_000_010 * s);
        assert_eq!(next_boundary(1_700_000_010 * s, Duration::from_secs(15)), 1_700_000_025 * s);
        assert_eq!(next_boundary(1_700_000_010 * s + 1, Duration::from_secs(3)), 1_700_000_013 * s);
    }

    #[test]
    fn labels_are_checked() {
        assert_eq!(parse_label("env=prod").unwrap(), ("env".to_string(), "prod".to_string()));
        assert_eq!(parse_label("k8s_pod=a=b").unwrap(), ("k8s_pod".to_string(), "a=b".to_string()));
        assert!(parse_label("env").unwrap_err().contains("name=value"));
        assert!(parse_label("1env=x").is_err());
        assert!(parse_label("my.label=x").is_err());
        assert!(parse_label("__name__=x").is_err());
        assert!(parse_label("env=").unwrap_err().contains("no value"));
    }

    struct Collect(std::rc::Rc<std::cell::RefCell<Vec<(u64, u64, usize)>>>);
    impl Sink for Collect {
        fn describe(&self) -> String {
            "test".into()
        }
        fn window(&mut self, w: &Window) -> Result<()> {
            self.0.borrow_mut().push((w.start_unix_ns, w.duration_ns, w.profile.samples.len()));
            Ok(())
        }
        fn finish(&mut self, _: Instant) -> String {
            String::new()
        }
    }

    #[test]
    fn every_sample_is_in_exactly_one_window_and_windows_follow_each_other() {
        let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let mut c = Continuous::new(Duration::from_secs(1), vec![Box::new(Collect(seen.clone()))]);
        let mut b = ProfileBuilder::new();
        let start = c.window_start_ns;
        c.agent_epoch_unix_ns = Some(start);
        // 30 samples over 3 s of agent time, one every 100 ms.
        for i in 0..30u64 {
            b.add_sample(i * 100_000_000, 1, false, &[], 1);
        }
        let first_end = c.window_end_ns;
        c.cut(&mut b, first_end);
        let second_end = c.window_end_ns;
        c.cut(&mut b, second_end);
        // A late sample of the first window lands in the next one.
        b.add_sample(1, 1, false, &[], 1);
        c.finish(&mut b, Duration::from_secs(1));
        let seen = seen.borrow();
        assert_eq!(seen.len(), 3);
        assert_eq!(seen.iter().map(|w| w.2).sum::<usize>(), 31);
        assert_eq!(seen[0].0, start);
        for pair in seen.windows(2) {
            assert_eq!(pair[0].0 + pair[0].1, pair[1].0, "windows are consecutive: {seen:?}");
        }
        assert_eq!(seen[1].1, 1_000_000_000);
        assert_eq!(seen[1].2, 10);
    }
}
