//! Grafana Pyroscope's push API: `POST /push.v1.PusherService/Push` with a
//! `push.v1.PushRequest` (grafana/pyroscope `api/push/v1/push.proto`) as
//! `application/proto`. Each window is one request: one series per event
//! kind (`__name__` its profile family), each with one sample holding the
//! window's gzipped pprof (the bytes `-f pprof` writes; the body is not
//! compressed again). Pyroscope rejects a pprof of more than 16,000 samples
//! or 4 MiB by default, so a window over either is first made to fit
//! ([`corsnap_profile::limits`]) and the user told once.

use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::Result;
use corsnap_profile::writers::{encode_pprof, WriteOptions};
use corsnap_profile::{EventKind, Profile};
use prost::Message as _;

use super::upload::{describe_counts, Auth, Endpoint, Job, Uploader, DEFAULT_QUEUE_BYTES};
use super::{Labels, Sink, Window};

/// The push API's path.
pub const PUSH_PATH: &str = "/push.v1.PusherService/Push";
/// Pyroscope's default `max_profile_size_samples`.
pub const MAX_SAMPLES: usize = 16_000;
/// Pyroscope's default `max_profile_size_bytes` (of the uncompressed pprof).
pub const MAX_BYTES: usize = 4 << 20;
/// Pyroscope's default `max_label_names_per_series`.
pub const MAX_LABELS: usize = 30;

/// The messages of `push.v1` and `types.v1` that a push uses, from the
/// published .proto (field numbers as there).
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PushRequest {
        #[prost(message, repeated, tag = "1")]
        pub series: Vec<RawProfileSeries>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RawProfileSeries {
        #[prost(message, repeated, tag = "1")]
        pub labels: Vec<LabelPair>,
        #[prost(message, repeated, tag = "2")]
        pub samples: Vec<RawSample>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LabelPair {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub value: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RawSample {
        #[prost(bytes = "vec", tag = "1")]
        pub raw_profile: Vec<u8>,
        #[prost(string, tag = "2")]
        pub id: String,
    }
}

/// The profile family Pyroscope files an event kind under (`__name__`).
pub fn family(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Cpu => "process_cpu",
        EventKind::Wall => "wall",
        EventKind::Alloc => "memory",
        EventKind::Exceptions => "exceptions",
        EventKind::Gc => "gc",
        EventKind::ClassLoad => "classload",
    }
}

/// The labels of a kind's series, `__name__` first.
pub fn series_labels(kind: EventKind, labels: &Labels, meta: &corsnap_profile::Meta) -> Vec<proto::LabelPair> {
    let pair = |name: &str, value: &str| proto::LabelPair { name: name.to_string(), value: value.to_string() };
    let mut out = vec![pair("__name__", family(kind)), pair("service_name", &labels.service)];
    if !labels.host.is_empty() {
        out.push(pair("hostname", &labels.host));
    }
    if meta.pid != 0 {
        out.push(pair("pid", &meta.pid.to_string()));
    }
    out.push(pair("process_runtime_name", ".NET"));
    if !meta.runtime_version.is_empty() {
        out.push(pair("process_runtime_version", &meta.runtime_version));
    }
    out.push(pair("profiler", "corsnap"));
    out.push(pair("profiler_version", env!("CARGO_PKG_VERSION")));
    for (k, v) in &labels.extra {
        // A user's label overrides an automatic one of the same name.
        out.retain(|p| p.name != *k);
        out.push(pair(k, v));
    }
    out
}

/// The labels corsnap adds by itself besides `__name__` and `service_name`.
pub const AUTOMATIC_LABELS: usize = 6;

/// A kind's profile as the gzipped pprof Pyroscope takes, made to fit its
/// limits; what was done to make it fit, if anything.
pub fn fitted_pprof(profile: &Profile, options: &WriteOptions) -> (Vec<u8>, Option<String>) {
    let mut limit = MAX_SAMPLES;
    let mut note = None;
    loop {
        let (fitted, trimmed) = corsnap_profile::limits::fit_samples(profile, limit);
        let raw = encode_pprof(&fitted, options);
        if let Some(t) = &trimmed {
            note = Some(t.describe(limit));
        }
        if raw.len() <= MAX_BYTES || limit <= 16 {
            if raw.len() > MAX_BYTES {
                note = Some(format!("{} KiB even at {limit} samples", raw.len() / 1024));
            }
            return (gzip(&raw), note);
        }
        // Long names make a big file: fewer stacks until it fits.
        limit = limit * MAX_BYTES / raw.len() * 9 / 10;
        note = Some(format!("{} KiB of pprof, over the limit of 4 MiB", raw.len() / 1024));
    }
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    // Writing to a Vec cannot fail.
    let _ = encoder.write_all(data);
    encoder.finish().unwrap_or_default()
}

/// A random UUID (version 4) for each pushed profile.
pub fn uuid() -> String {
    let hi = fastrand::u64(..);
    let lo = fastrand::u64(..);
    let hi = (hi & !0xf000) | 0x4000;
    let lo = (lo & !(0xc << 60)) | (0x8 << 60);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xffff,
        hi & 0xffff,
        lo >> 48,
        lo & 0xffff_ffff_ffff
    )
}

/// The push request for one window.
pub fn push_request(window: &Window, labels: &Labels, options: &WriteOptions) -> (Vec<u8>, Vec<String>) {
    let mut notes = Vec::new();
    let mut series = Vec::new();
    for kind in window.profile.kinds() {
        let (raw_profile, note) = fitted_pprof(&window.profile.only(kind), options);
        if let Some(note) = note {
            notes.push(format!("{}: {note}", kind.name()));
        }
        series.push(proto::RawProfileSeries {
            labels: series_labels(kind, labels, &window.profile.meta),
            samples: vec![proto::RawSample { raw_profile, id: uuid() }],
        });
    }
    (proto::PushRequest { series }.encode_to_vec(), notes)
}

/// Pushes each window to Pyroscope.
#[derive(Debug)]
pub struct PyroscopeSink {
    uploader: Uploader,
    labels: Labels,
    options: WriteOptions,
    /// Whether trimming has been reported (once is enough).
    trim_reported: bool,
    empty_windows: u64,
}

impl PyroscopeSink {
    pub fn new(url: &str, auth: &Auth, labels: Labels, period: Duration) -> Result<PyroscopeSink> {
        if labels.extra.len() + 2 + AUTOMATIC_LABELS > MAX_LABELS {
            anyhow::bail!(
                "--label: {} labels, but Pyroscope takes at most {MAX_LABELS} per series and corsnap adds {}",
                labels.extra.len(),
                2 + AUTOMATIC_LABELS
            );
        }
        let endpoint = Endpoint::new(url, PUSH_PATH, auth, "--push")?;
        let name = format!("push to {}", endpoint.url);
        let uploader = Uploader::start(name, endpoint, "application/proto", None, period, DEFAULT_QUEUE_BYTES);
        // Thread labels stay in the pprof (a per-sample label Pyroscope
        // keeps); function names as a person reads them.
        let options = WriteOptions::default();
        Ok(PyroscopeSink { uploader, labels, options, trim_reported: false, empty_windows: 0 })
    }
}

impl Sink for PyroscopeSink {
    fn describe(&self) -> String {
        self.uploader.name().to_string()
    }

    fn window(&mut self, window: &Window) -> Result<()> {
        if window.profile.samples.is_empty() {
            // Nothing to say; Pyroscope shows a gap either way.
            self.empty_windows += 1;
            return Ok(());
        }
        let (body, notes) = push_request(window, &self.labels, &self.options);
        if !notes.is_empty() && !self.trim_reported {
            self.trim_reported = true;
            eprintln!(
                "corsnap: note: window {} was made to fit Pyroscope's limits ({MAX_SAMPLES} samples, 4 MiB): {} \
                 (said once; later windows are fitted the same way)",
                window.index,
                notes.join("; ")
            );
        }
        self.uploader.send(Job::new(body, window.index));
        Ok(())
    }

    fn finish(&mut self, deadline: Instant) -> String {
        let counts = self.uploader.finish(deadline);
        let empty = if self.empty_windows > 0 {
            format!(", {} windows without samples not sent", self.empty_windows)
        } else {
            String::new()
        };
        format!("{}: {}{empty}", self.uploader.name(), describe_counts(&counts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_over_pyroscopes_sample_limit_is_trimmed_to_fit_with_its_total_kept() {
        use corsnap_profile::{Frame, FrameKind, Meta, Sample, Thread};
        let mut p = Profile::new(Meta { rate_hz: 100, ..Default::default() });
        let thread = p.intern_thread(Thread { os_tid: 7, name: "worker".into() });
        let main = p.intern_frame(Frame::new("App.Main", "app.dll", FrameKind::Managed));
        for i in 0..20_000u64 {
            let f = p.intern_frame(Frame::new(format!("App.Generated{i}"), "app.dll", FrameKind::Managed));
            let stack = p.intern_stack(&[f, main]);
            p.samples.push(Sample { time_ns: i, thread, stack, weight: 10_000_000 + i, kind: EventKind::Cpu });
        }
        let (gzipped, note) = fitted_pprof(&p, &WriteOptions::default());
        let summary = corsnap_profile::writers::decode_pprof(&gzipped).unwrap();
        assert!(summary.values.len() <= MAX_SAMPLES, "{} samples", summary.values.len());
        assert_eq!(summary.total(0) as u64, p.total_weight());
        assert!(summary.function_names.iter().any(|n| n.starts_with("[trimmed: ")), "no [trimmed] frame");
        assert!(note.unwrap().contains("lightest stacks"));
    }

    #[test]
    fn uuids_are_version_4() {
        let id = uuid();
        assert_eq!(id.len(), 36, "{id}");
        assert_eq!(&id[14..15], "4", "{id}");
        assert!("89ab".contains(&id[19..20]), "{id}");
    }

    #[test]
    fn series_carry_the_family_service_and_automatic_labels() {
        let labels = Labels { service: "orders".into(), extra: vec![("env".into(), "prod".into())], host: "h1".into() };
        let meta = corsnap_profile::Meta { pid: 42, runtime_version: "10.0.1".into(), ..Default::default() };
        let got = series_labels(EventKind::Cpu, &labels, &meta);
        let find = |n: &str| got.iter().find(|p| p.name == n).map(|p| p.value.as_str());
        assert_eq!(got[0].name, "__name__");
        assert_eq!(find("__name__"), Some("process_cpu"));
        assert_eq!(find("service_name"), Some("orders"));
        assert_eq!(find("hostname"), Some("h1"));
        assert_eq!(find("pid"), Some("42"));
        assert_eq!(find("process_runtime_version"), Some("10.0.1"));
        assert_eq!(find("env"), Some("prod"));
        assert_eq!(got.len(), 2 + AUTOMATIC_LABELS + 1);
    }
}
