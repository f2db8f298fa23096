//! Continuous recording (`--interval`) end to end under real .NET 10: a C#
//! service busy in `Service.Crunch`, recorded in windows that go to a
//! receiver in this file (a tiny_http server standing in for Pyroscope and
//! an OTLP collector) and to a ring of files. The receiver decodes what
//! arrives by the published protobuf definitions, written out here from
//! the .proto files (pprof's profile.proto, Pyroscope's push.proto) or
//! taken from opentelemetry-proto (OTLP profiles), not from corsnap's code.

mod support;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use prost::Message as _;

use support::{compiled, corsnap_bin, scratch, Runtime};

/// pprof's `perftools.profiles` messages (github.com/google/pprof
/// proto/profile.proto), the fields these tests read.
mod pprof {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
    }
}

/// Grafana Pyroscope's `push.v1` messages (api/push/v1/push.proto and
/// types/v1/types.proto).
mod push {
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

use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;

/// One request as the receiver got it.
#[derive(Debug)]
struct Received {
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// The status the receiver answered.
    status: u16,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// An HTTP server on a free loopback port that answers each request with
/// the status `answer` gives (by request number, from 0) and passes every
/// request on.
struct Receiver {
    url: String,
    requests: mpsc::Receiver<Received>,
    server: std::sync::Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Receiver {
    fn start(answer: impl Fn(usize) -> u16 + Send + 'static) -> Receiver {
        let server = std::sync::Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let url = format!("http://{}", server.server_addr().to_ip().unwrap());
        let (tx, requests) = mpsc::channel();
        let thread_server = server.clone();
        let thread = std::thread::spawn(move || {
            for (n, mut request) in thread_server.incoming_requests().enumerate() {
                let mut body = Vec::new();
                request.as_reader().read_to_end(&mut body).unwrap();
                let status = answer(n);
                let received = Received {
                    path: request.url().to_string(),
                    headers: request
                        .headers()
                        .iter()
                        .map(|h| (h.field.as_str().to_string(), h.value.as_str().to_string()))
                        .collect(),
                    body,
                    status,
                };
                let _ = request.respond(tiny_http::Response::from_string("").with_status_code(status));
                if tx.send(received).is_err() {
                    break;
                }
            }
        });
        Receiver { url, requests, server, thread: Some(thread) }
    }

    /// The next request, waiting up to `limit`.
    fn next(&self, limit: Duration) -> Option<Received> {
        self.requests.recv_timeout(limit).ok()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn gunzip(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data).read_to_end(&mut out).expect("gzip");
    out
}

/// What a window's pprof says: its time, duration, and function names.
struct Window {
    start_ns: i64,
    duration_ns: i64,
    functions: Vec<String>,
    total: i64,
    sample_type: String,
}

fn decode_pprof(gzipped: &[u8]) -> Window {
    let p = pprof::Profile::decode(gunzip(gzipped).as_slice()).expect("a pprof Profile");
    let s = |i: i64| p.string_table[i as usize].clone();
    Window {
        start_ns: p.time_nanos,
        duration_ns: p.duration_nanos,
        functions: p.function.iter().map(|f| s(f.name)).collect(),
        total: p.sample.iter().map(|x| x.value.iter().sum::<i64>()).sum(),
        sample_type: p.sample_type.first().map(|t| s(t.r#type)).unwrap_or_default(),
    }
}

/// Starts `corsnap record <args> -- dotnet service.dll <seconds>`.
fn start_recording(args: &[&str], seconds: &str) -> Child {
    let dll = compiled("service", Runtime::Net10);
    Command::new(corsnap_bin())
        .arg("record")
        .args(args)
        .arg("--")
        .arg(Runtime::Net10.dotnet())
        .arg(dll)
        .arg(seconds)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn finish(child: Child) -> (std::process::ExitStatus, String, String) {
    let out = child.wait_with_output().unwrap();
    (out.status, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Checks that windows follow each other without gap or overlap, and that
/// every boundary but the first window's start is on the interval's grid.
fn assert_consecutive_and_aligned(windows: &[(i64, i64)], interval_ns: i64) {
    for pair in windows.windows(2) {
        assert_eq!(pair[0].0 + pair[0].1, pair[1].0, "windows must follow each other: {windows:?}");
    }
    for &(start, _) in &windows[1..] {
        // Millisecond resolution: pprof's start is kept in ms.
        assert_eq!(start % interval_ns, 0, "window start {start} is not on the {interval_ns} ns grid: {windows:?}");
    }
}

#[test]
fn windows_pushed_to_pyroscope_and_otlp_are_labelled_consecutive_and_show_the_hot_method() {
    let pyroscope = Receiver::start(|_| 200);
    let otlp = Receiver::start(|_| 200);
    let token = scratch("continuous-push").join("token");
    std::fs::write(&token, "s3cret-token\n").unwrap();
    let child = start_recording(
        &[
            "--interval",
            "2s",
            "--push",
            &pyroscope.url,
            "--otlp",
            &otlp.url,
            "--service",
            "orders",
            "--label",
            "env=test",
            "--tenant",
            "team-a",
            "--token-file",
            token.to_str().unwrap(),
        ],
        "60",
    );
    // Readiness: three windows of each have arrived.
    let mut pushes = Vec::new();
    let mut exports = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while pushes.len() < 3 && Instant::now() < deadline {
        pushes.extend(pyroscope.next(Duration::from_millis(200)));
    }
    while exports.len() < 3 && Instant::now() < deadline {
        exports.extend(otlp.next(Duration::from_millis(200)));
    }
    assert!(pushes.len() >= 3 && exports.len() >= 3, "{} pushes, {} OTLP exports", pushes.len(), exports.len());
    // SIGTERM: corsnap passes it on, flushes the last window and exits.
    let pid = child.id().to_string();
    let signalled = Instant::now();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let (status, _, stderr) = finish(child);
    assert!(signalled.elapsed() < Duration::from_secs(20), "stopping took {:?}", signalled.elapsed());
    while let Some(r) = pyroscope.next(Duration::from_millis(100)) {
        pushes.push(r);
    }
    while let Some(r) = otlp.next(Duration::from_millis(100)) {
        exports.push(r);
    }
    assert!(!stderr.contains("s3cret"), "a secret was printed: {stderr}");
    assert!(stderr.contains("windows sent"), "{stderr}");
    let _ = status;

    // Pyroscope.
    let mut windows = Vec::new();
    let mut hot_windows = 0;
    for push in &pushes {
        assert_eq!(push.path, "/push.v1.PusherService/Push");
        assert_eq!(push.header("Content-Type"), Some("application/proto"));
        assert_eq!(push.header("Authorization"), Some("Bearer s3cret-token"));
        assert_eq!(push.header("X-Scope-OrgID"), Some("team-a"));
        let request = push::PushRequest::decode(push.body.as_slice()).expect("a PushRequest");
        assert_eq!(request.series.len(), 1, "one series per event kind (cpu only)");
        let series = &request.series[0];
        let label = |name: &str| series.labels.iter().find(|l| l.name == name).map(|l| l.value.as_str());
        assert_eq!(label("__name__"), Some("process_cpu"));
        assert_eq!(label("service_name"), Some("orders"));
        assert_eq!(label("env"), Some("test"));
        assert!(label("hostname").is_some_and(|h| !h.is_empty()));
        assert!(label("pid").is_some_and(|p| p.parse::<u32>().is_ok()));
        assert!(label("process_runtime_version").is_some_and(|v| v.starts_with("10.")), "{:?}", series.labels);
        assert_eq!(series.samples.len(), 1);
        assert_eq!(series.samples[0].id.len(), 36, "a UUID per profile");
        let w = decode_pprof(&series.samples[0].raw_profile);
        assert_eq!(w.sample_type, "cpu");
        assert!(w.total > 0);
        if w.functions.iter().any(|f| f == "Service.Crunch") {
            hot_windows += 1;
        }
        windows.push((w.start_ns, w.duration_ns));
    }
    assert!(hot_windows >= pushes.len() - 1, "Service.Crunch in {hot_windows} of {} windows", pushes.len());
    // Windows without samples are not pushed, so only a run of windows
    // that all had samples is consecutive; the service is busy throughout.
    assert_consecutive_and_aligned(&windows, 2_000_000_000);
    for &(_, duration) in &windows[1..windows.len() - 1] {
        assert_eq!(duration, 2_000_000_000, "{windows:?}");
    }

    // OTLP.
    let mut otlp_windows = Vec::new();
    for export in &exports {
        assert_eq!(export.path, "/v1development/profiles");
        assert_eq!(export.header("Content-Type"), Some("application/x-protobuf"));
        assert_eq!(export.header("Content-Encoding"), Some("gzip"));
        let request = ExportProfilesServiceRequest::decode(gunzip(&export.body).as_slice())
            .expect("an ExportProfilesServiceRequest");
        let dict = request.dictionary.as_ref().expect("a dictionary");
        assert_eq!(dict.string_table[0], "", "entry 0 of the string table is empty");
        assert_eq!(dict.stack_table[0].location_indices.len(), 0, "entry 0 of the stack table is the zero value");
        let resource = request.resource_profiles[0].resource.as_ref().unwrap();
        let attribute =
            |key: &str| resource.attributes.iter().find(|a| a.key == key).and_then(|a| a.value.as_ref()?.value.clone());
        assert_eq!(attribute("service.name"), Some(AnyValue::StringValue("orders".into())));
        assert_eq!(attribute("env"), Some(AnyValue::StringValue("test".into())));
        assert!(matches!(attribute("process.pid"), Some(AnyValue::IntValue(p)) if p > 0));
        let scope = &request.resource_profiles[0].scope_profiles[0];
        assert_eq!(scope.profiles.len(), 1);
        let profile = &scope.profiles[0];
        let sample_type = profile.sample_type.as_ref().unwrap();
        assert_eq!(dict.string_table[sample_type.type_strindex as usize], "cpu");
        // The hot method, through sample -> stack -> location -> function.
        let names: Vec<&str> = profile
            .samples
            .iter()
            .flat_map(|s| &dict.stack_table[s.stack_index as usize].location_indices)
            .flat_map(|&l| &dict.location_table[l as usize].lines)
            .map(|line| {
                dict.string_table[dict.function_table[line.function_index as usize].name_strindex as usize].as_str()
            })
            .collect();
        otlp_windows.push((
            profile.time_unix_nano as i64,
            profile.duration_nano as i64,
            names.contains(&"Service.Crunch"),
        ));
    }
    let times: Vec<(i64, i64)> = otlp_windows.iter().map(|w| (w.0 / 1_000_000 * 1_000_000, w.1)).collect();
    let hot = otlp_windows.iter().filter(|w| w.2).count();
    assert!(hot >= otlp_windows.len() - 1, "Service.Crunch in {hot} of {} OTLP windows", otlp_windows.len());
    for pair in otlp_windows.windows(2) {
        assert_eq!(pair[0].0 + pair[0].1, pair[1].0, "OTLP windows must follow each other: {times:?}");
    }
    for w in &otlp_windows[1..] {
        assert_eq!(w.0 % 2_000_000_000, 0, "{times:?}");
    }
}

#[test]
fn a_failing_backend_is_retried_and_the_program_never_notices() {
    // Pyroscope answers 503 to the first four requests, then accepts; the
    // OTLP endpoint is a port nobody listens on.
    let pyroscope = Receiver::start(|n| if n < 4 { 503 } else { 200 });
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let started = Instant::now();
    let child = start_recording(&["--interval", "2s", "--push", &pyroscope.url, "--otlp", &dead], "7");
    let (status, stdout, stderr) = finish(child);
    // The program ran its course, its output whole, its exit code ours.
    assert!(status.success(), "{stderr}");
    let heartbeats = stdout.lines().filter(|l| l.starts_with("heartbeat ")).count();
    assert!(heartbeats >= 50, "{heartbeats} heartbeats:\n{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("done ")), "{stdout}");
    // corsnap ended within the flush deadline after the program did.
    assert!(started.elapsed() < Duration::from_secs(7 + 30), "{:?}", started.elapsed());
    let mut received = Vec::new();
    while let Some(r) = pyroscope.next(Duration::from_millis(100)) {
        received.push(r);
    }
    let refused = received.iter().filter(|r| r.status == 503).count();
    let accepted: Vec<_> = received.iter().filter(|r| r.status == 200).collect();
    assert_eq!(refused, 4, "{stderr}");
    assert!(!accepted.is_empty(), "nothing got through after the 503s: {stderr}");
    // A retry is the same window again: its profile's id repeats.
    let ids: Vec<String> = received
        .iter()
        .map(|r| push::PushRequest::decode(r.body.as_slice()).unwrap().series[0].samples[0].id.clone())
        .collect();
    assert!(ids[0] == ids[1], "the first window was not retried: {ids:?}");
    // Reported, not flooded: one warning as each backend starts failing.
    let warnings = stderr.lines().filter(|l| l.contains("warning")).count();
    assert!(warnings <= 3, "{stderr}");
    assert!(stderr.contains("working again"), "{stderr}");
    assert!(stderr.contains("retries"), "{stderr}");
}

#[test]
fn a_ring_of_three_files_keeps_the_latest_windows() {
    let dir = scratch("continuous-ring");
    let pattern = dir.join("p-%p-%n{3}.pb.gz");
    let child = start_recording(&["--interval", "1s", "-d", "5.5", "-o", pattern.to_str().unwrap()], "7");
    let (status, _, stderr) = finish(child);
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("windows"), "{stderr}");
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names.len(), 3, "a ring of 3 files: {names:?}\n{stderr}");
    let mut windows = Vec::new();
    for (i, name) in names.iter().enumerate() {
        assert!(name.starts_with("p-") && name.ends_with(&format!("-{i}.pb.gz")), "{names:?}");
        let w = decode_pprof(&std::fs::read(dir.join(name)).unwrap());
        windows.push((w.start_ns, w.duration_ns, w.functions.iter().any(|f| f == "Service.Crunch")));
    }
    // Six or seven windows were written into three files: the files hold
    // the latest three, which follow each other.
    windows.sort();
    let spans: Vec<(i64, i64)> = windows.iter().map(|w| (w.0, w.1)).collect();
    for pair in spans.windows(2) {
        assert_eq!(pair[0].0 + pair[0].1, pair[1].0, "{spans:?}");
    }
    assert!(windows.iter().filter(|w| w.2).count() >= 2, "Service.Crunch missing: {windows:?}");
}

#[test]
fn attached_to_a_running_service_windows_go_to_pyroscope_and_the_service_runs_on() {
    let pyroscope = Receiver::start(|_| 200);
    let mut service = support::Service::start(&[]);
    let pid = service.pid.to_string();
    let out = Command::new(corsnap_bin())
        .args(["record", "--pid", &pid, "--interval", "1s", "-d", "3.5", "--push", &pyroscope.url])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let mut windows = Vec::new();
    while let Some(r) = pyroscope.next(Duration::from_millis(100)) {
        let request = push::PushRequest::decode(r.body.as_slice()).unwrap();
        let series = &request.series[0];
        let label = |name: &str| series.labels.iter().find(|l| l.name == name).map(|l| l.value.clone());
        // The service's name by default: the program's, not corsnap's.
        assert_eq!(label("service_name").as_deref(), Some("service"), "{:?}", series.labels);
        assert_eq!(label("pid"), Some(pid.clone()));
        let w = decode_pprof(&series.samples[0].raw_profile);
        windows.push((w.start_ns, w.duration_ns, w.functions.iter().any(|f| f == "Service.Crunch")));
    }
    assert!(windows.len() >= 3, "{windows:?}\n{stderr}");
    let spans: Vec<(i64, i64)> = windows.iter().map(|w| (w.0, w.1)).collect();
    assert_consecutive_and_aligned(&spans, 1_000_000_000);
    assert!(windows.iter().filter(|w| w.2).count() >= windows.len() - 1, "{windows:?}");
    // The service kept running through it and after.
    assert!(service.is_alive(), "{}", service.describe());
    service.wait_heartbeats(3);
}
