//! OpenTelemetry profiles over OTLP/HTTP: `POST /v1development/profiles`
//! with an `ExportProfilesServiceRequest` as `application/x-protobuf`,
//! gzipped. **Experimental**, as the signal is (Alpha, package still
//! `v1development`): the messages are opentelemetry-proto 0.33's (protos
//! v1.10.0), and may change under us.
//!
//! Each window is one request: one resource (`service.name`, `host.name`,
//! `process.pid`, the runtime, and `--label`s), one scope (corsnap), and
//! one Profile per event kind, all sharing the request's dictionary. Entry
//! 0 of every dictionary table is the zero value, as the spec requires.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use corsnap_profile::writers::{frame_names, WriteOptions};
use corsnap_profile::{EventKind, FrameIdx, FrameKind, Profile, StackIdx, ThreadIdx};
use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::profiles::v1development as otel;
use opentelemetry_proto::tonic::resource::v1::Resource;
use prost::Message as _;

use super::pyroscope::gzip;
use super::upload::{describe_counts, Auth, Endpoint, Job, Uploader, DEFAULT_QUEUE_BYTES};
use super::{Labels, Sink, Window};

/// OTLP/HTTP's path for profiles.
pub const PROFILES_PATH: &str = "/v1development/profiles";

fn string_value(text: &str) -> Option<AnyValue> {
    Some(AnyValue { value: Some(any_value::Value::StringValue(text.to_string())) })
}

fn key_value(key: &str, value: Option<AnyValue>) -> KeyValue {
    KeyValue { key: key.to_string(), value, ..Default::default() }
}

/// The shared tables of a request, each with its zero entry first.
struct Dictionary {
    dict: otel::ProfilesDictionary,
    strings: HashMap<String, i32>,
    functions: HashMap<FrameIdx, i32>,
    stacks: HashMap<StackIdx, i32>,
    threads: HashMap<ThreadIdx, i32>,
    frame_type: HashMap<&'static str, i32>,
}

impl Dictionary {
    fn new() -> Dictionary {
        let dict = otel::ProfilesDictionary {
            mapping_table: vec![otel::Mapping::default()],
            location_table: vec![otel::Location::default()],
            function_table: vec![otel::Function::default()],
            link_table: vec![otel::Link::default()],
            string_table: vec![String::new()],
            attribute_table: vec![otel::KeyValueAndUnit::default()],
            stack_table: vec![otel::Stack::default()],
        };
        Dictionary {
            dict,
            strings: HashMap::from([(String::new(), 0)]),
            functions: HashMap::new(),
            stacks: HashMap::new(),
            threads: HashMap::new(),
            frame_type: HashMap::new(),
        }
    }

    fn string(&mut self, text: &str) -> i32 {
        if let Some(&i) = self.strings.get(text) {
            return i;
        }
        let i = self.dict.string_table.len() as i32;
        self.dict.string_table.push(text.to_string());
        self.strings.insert(text.to_string(), i);
        i
    }

    fn attribute(&mut self, key: &str, value: &str) -> i32 {
        let key_strindex = self.string(key);
        self.dict.attribute_table.push(otel::KeyValueAndUnit {
            key_strindex,
            value: string_value(value),
            unit_strindex: 0,
        });
        self.dict.attribute_table.len() as i32 - 1
    }

    /// `profile.frame.type` (semantic conventions): `dotnet` for managed
    /// frames, `native` for the rest.
    fn frame_type(&mut self, kind: FrameKind) -> i32 {
        let value = if kind == FrameKind::Managed { "dotnet" } else { "native" };
        if let Some(&i) = self.frame_type.get(value) {
            return i;
        }
        let i = self.attribute("profile.frame.type", value);
        self.frame_type.insert(value, i);
        i
    }

    /// A frame's location (one per function, same index in both tables).
    fn location(&mut self, profile: &Profile, names: &[std::borrow::Cow<'_, str>], frame: FrameIdx) -> i32 {
        if let Some(&i) = self.functions.get(&frame) {
            return i;
        }
        let f = &profile.frames[frame as usize];
        let function = otel::Function {
            name_strindex: self.string(&names[frame as usize]),
            system_name_strindex: self.string(&f.name),
            filename_strindex: self.string(&f.module),
            start_line: 0,
        };
        self.dict.function_table.push(function);
        let function_index = self.dict.function_table.len() as i32 - 1;
        let attribute = self.frame_type(f.kind);
        self.dict.location_table.push(otel::Location {
            mapping_index: 0,
            address: 0,
            lines: vec![otel::Line { function_index, line: 0, column: 0 }],
            attribute_indices: vec![attribute],
        });
        let i = self.dict.location_table.len() as i32 - 1;
        self.functions.insert(frame, i);
        i
    }

    fn stack(&mut self, profile: &Profile, names: &[std::borrow::Cow<'_, str>], stack: StackIdx) -> i32 {
        if let Some(&i) = self.stacks.get(&stack) {
            return i;
        }
        // Leaf first, as corsnap keeps them and OTLP wants them.
        let location_indices =
            profile.stacks[stack as usize].iter().map(|&f| self.location(profile, names, f)).collect();
        self.dict.stack_table.push(otel::Stack { location_indices });
        let i = self.dict.stack_table.len() as i32 - 1;
        self.stacks.insert(stack, i);
        i
    }

    fn thread(&mut self, profile: &Profile, thread: ThreadIdx) -> i32 {
        if let Some(&i) = self.threads.get(&thread) {
            return i;
        }
        let i = self.attribute("thread.name", &profile.thread_label(thread));
        self.threads.insert(thread, i);
        i
    }
}

/// The request for one window.
pub fn export_request(window: &Window, labels: &Labels, options: &WriteOptions) -> ExportProfilesServiceRequest {
    let profile = &window.profile;
    let names = frame_names(profile, options);
    let mut dict = Dictionary::new();
    let mut profiles = Vec::new();
    for kind in profile.kinds() {
        let mut merged: std::collections::BTreeMap<(StackIdx, ThreadIdx), u64> = std::collections::BTreeMap::new();
        for s in profile.samples.iter().filter(|s| s.kind == kind) {
            *merged.entry((s.stack, s.thread)).or_default() += s.weight;
        }
        let samples = merged
            .into_iter()
            .map(|((stack, thread), weight)| otel::Sample {
                stack_index: dict.stack(profile, &names, stack),
                attribute_indices: vec![dict.thread(profile, thread)],
                link_index: 0,
                values: vec![i64::try_from(weight).unwrap_or(i64::MAX)],
                timestamps_unix_nano: Vec::new(),
            })
            .collect();
        let sample_type =
            Some(otel::ValueType { type_strindex: dict.string(kind.name()), unit_strindex: dict.string(kind.unit()) });
        let (period_type, period) = match (kind, profile.meta.rate_hz) {
            (EventKind::Cpu, rate) if rate > 0 => (sample_type, 1_000_000_000 / i64::from(rate)),
            _ => (None, 0),
        };
        profiles.push(otel::Profile {
            sample_type,
            samples,
            time_unix_nano: window.start_unix_ns,
            duration_nano: window.duration_ns,
            period_type,
            period,
            profile_id: profile_id(),
            ..Default::default()
        });
    }
    let mut attributes = vec![
        key_value("service.name", string_value(&labels.service)),
        key_value("process.runtime.name", string_value(".NET")),
        key_value("telemetry.sdk.name", string_value("corsnap")),
        key_value("telemetry.sdk.version", string_value(env!("CARGO_PKG_VERSION"))),
    ];
    if !labels.host.is_empty() {
        attributes.push(key_value("host.name", string_value(&labels.host)));
    }
    if profile.meta.pid != 0 {
        attributes.push(key_value(
            "process.pid",
            Some(AnyValue { value: Some(any_value::Value::IntValue(profile.meta.pid.into())) }),
        ));
    }
    if !profile.meta.runtime_version.is_empty() {
        attributes.push(key_value("process.runtime.version", string_value(&profile.meta.runtime_version)));
    }
    for (k, v) in &labels.extra {
        attributes.retain(|a| a.key != *k);
        attributes.push(key_value(k, string_value(v)));
    }
    ExportProfilesServiceRequest {
        resource_profiles: vec![otel::ResourceProfiles {
            resource: Some(Resource { attributes, ..Default::default() }),
            scope_profiles: vec![otel::ScopeProfiles {
                scope: Some(InstrumentationScope {
                    name: "corsnap".to_string(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    ..Default::default()
                }),
                profiles,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
        dictionary: Some(dict.dict),
    }
}

fn profile_id() -> Vec<u8> {
    let mut id = fastrand::u128(..).to_le_bytes().to_vec();
    // All zeros means "no id".
    id[0] |= 1;
    id
}

/// Sends each window as OTLP profiles.
#[derive(Debug)]
pub struct OtlpSink {
    uploader: Uploader,
    labels: Labels,
    options: WriteOptions,
}

impl OtlpSink {
    pub fn new(url: &str, auth: &Auth, labels: Labels, period: Duration) -> Result<OtlpSink> {
        let endpoint = Endpoint::new(url, PROFILES_PATH, auth, "--otlp")?;
        let name = format!("OTLP to {}", endpoint.url);
        let uploader =
            Uploader::start(name, endpoint, "application/x-protobuf", Some("gzip"), period, DEFAULT_QUEUE_BYTES);
        Ok(OtlpSink { uploader, labels, options: WriteOptions::default() })
    }
}

impl Sink for OtlpSink {
    fn describe(&self) -> String {
        format!("{} (experimental)", self.uploader.name())
    }

    fn window(&mut self, window: &Window) -> Result<()> {
        if window.profile.samples.is_empty() {
            return Ok(());
        }
        let body = gzip(&export_request(window, &self.labels, &self.options).encode_to_vec());
        self.uploader.send(Job::new(body, window.index));
        Ok(())
    }

    fn finish(&mut self, deadline: Instant) -> String {
        let counts = self.uploader.finish(deadline);
        format!("{}: {}", self.uploader.name(), describe_counts(&counts))
    }
}
