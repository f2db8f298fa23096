//! ASP.NET Core under load: a minimal-API app served by Kestrel
//! (`tests/programs/webapp.cs`, .NET 10) loaded by `wrk`; corsnap attaches
//! mid-load, records and detaches, and no request fails.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::{
    corsnap_bin, count_with, describe, parse_collapsed, scratch, walk_verification, Runtime, Service, Stack,
};

/// What `wrk` reported: requests completed, responses that were not 2xx or
/// 3xx, socket errors of every kind (connect, read, write, timeout), and
/// requests per second.
#[derive(Debug)]
struct WrkResult {
    requests: u64,
    non_2xx_3xx: u64,
    socket_errors: u64,
    requests_per_second: f64,
}

/// `wrk` with one thread and 8 connections on `url` for `seconds`.
fn start_wrk(url: &str, seconds: u32) -> Child {
    Command::new("wrk")
        .args(["-t1", "-c8", &format!("-d{seconds}s"), "--latency", url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running wrk (scripts/setup.sh installs it)")
}

/// Parses wrk's report; absent error lines mean none.
fn parse_wrk(text: &str) -> WrkResult {
    let number_before = |line: &str, word: &str| -> u64 {
        let words: Vec<&str> = line.split_whitespace().collect();
        let at = words.iter().position(|w| *w == word).unwrap_or_else(|| panic!("no {word:?} in {line:?}"));
        words[at - 1].parse().unwrap_or_else(|_| panic!("no number before {word:?} in {line:?}"))
    };
    let mut requests = None;
    let mut non_2xx_3xx = 0;
    let mut socket_errors = 0;
    let mut requests_per_second = None;
    for line in text.lines().map(str::trim) {
        if line.contains(" requests in ") {
            requests = Some(number_before(line, "requests"));
        } else if let Some(n) = line.strip_prefix("Non-2xx or 3xx responses:") {
            non_2xx_3xx = n.trim().parse().unwrap();
        } else if let Some(errors) = line.strip_prefix("Socket errors:") {
            // "Socket errors: connect 0, read 1, write 0, timeout 0"
            socket_errors =
                errors.split(',').map(|part| part.split_whitespace().last().unwrap().parse::<u64>().unwrap()).sum();
        } else if let Some(rps) = line.strip_prefix("Requests/sec:") {
            requests_per_second = Some(rps.trim().parse().unwrap());
        }
    }
    WrkResult {
        requests: requests.unwrap_or_else(|| panic!("no request count in wrk's report:\n{text}")),
        non_2xx_3xx,
        socket_errors,
        requests_per_second: requests_per_second.unwrap_or_else(|| panic!("no Requests/sec in wrk's report:\n{text}")),
    }
}

#[test]
fn wrk_reports_are_parsed_with_absent_error_lines_as_zero() {
    let clean = "Running 6s test @ http://127.0.0.1:1/work?n=2000\n  1 threads and 8 connections\n  \
                 100760 requests in 6.01s, 20.58MB read\nRequests/sec:  16770.63\nTransfer/sec:      3.43MB\n";
    let r = parse_wrk(clean);
    assert_eq!((r.requests, r.non_2xx_3xx, r.socket_errors), (100760, 0, 0));
    assert_eq!(r.requests_per_second, 16770.63);
    let failing = "  1234 requests in 2.00s, 1.00MB read\n  Socket errors: connect 0, read 3, write 1, timeout 2\n  \
                   Non-2xx or 3xx responses: 7\nRequests/sec:    617.00\n";
    let r = parse_wrk(failing);
    assert_eq!((r.requests, r.non_2xx_3xx, r.socket_errors), (1234, 7, 6));
}

/// The handler, as the signal engine names it.
const HANDLER: &str = "WebApp.Work";

/// Whether a stack runs the handler under Kestrel's frames: root first, a
/// `Microsoft.AspNetCore.Server.Kestrel.*` frame, then only ASP.NET Core's
/// own frames (hosting, routing, middleware) and runtime stubs (the request
/// delegate the minimal API compiles), then the handler.
///
/// Which middleware frames there are depends on the JIT, not on corsnap:
/// measured on one process under `wrk`, both engines (`signal` and
/// `suspend`) showed `HostFilteringMiddleware.Invoke` between Kestrel and
/// the handler at first, then `EndpointRoutingMiddleware.Invoke` and
/// `EndpointMiddleware.Invoke`, then `EndpointMiddleware.Invoke` alone, as
/// re-tiered code inlined more of the pipeline; a loaded CI machine caught
/// a recording with none left. That the frames shown are the real ones is
/// checked sample by sample against `DoStackSnapshot` (walk verification).
fn handler_under_kestrel(stack: &Stack) -> bool {
    let Some(handler) = stack.frames.iter().position(|f| f == HANDLER) else { return false };
    let below = &stack.frames[..handler];
    let Some(kestrel) = below.iter().rposition(|f| f.starts_with("Microsoft.AspNetCore.Server.Kestrel.")) else {
        return false;
    };
    below[kestrel + 1..].iter().all(|f| f.starts_with("Microsoft.AspNetCore.") || f == "[runtime stub]")
}

#[test]
fn a_kestrel_app_under_wrk_load_is_recorded_by_pid_and_left_without_a_failed_request() {
    // Walk verification (CORSNAP_VERIFY_WALKS=1, read by the agent in the
    // app): four times a second every thread's signal-engine walk is
    // compared with DoStackSnapshot's at the same instant.
    let (mut service, port) =
        Service::start_listening(Runtime::Net10, "webapp", &["120", "2000"], &[("CORSNAP_VERIFY_WALKS", "1")]);
    let url = format!("http://127.0.0.1:{port}/work?n=2000");
    let mut wrk = start_wrk(&url, 10);
    // Readiness: the app has served 2000 requests, so the load is under way.
    service.wait_line("loaded ", Duration::from_secs(30));

    let dir = scratch("aspnet-under-load");
    let out = dir.join("p.txt");
    let log = dir.join("agent.log");
    let record = Command::new(corsnap_bin())
        .args(["record", "--pid", &service.pid.to_string(), "-d", "2", "-r", "100", "-f", "collapsed", "-o"])
        .arg(&out)
        .arg("--agent-log")
        .arg(&log)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&record.stderr);
    assert!(record.status.success(), "corsnap record --pid failed: {stderr}\n{}", service.describe());
    service.wait_agent_gone();
    let detached_under_load = wrk.try_wait().unwrap().is_none();
    let leftovers = service.signal_leftovers();

    let wrk_output = wrk.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&wrk_output.stdout);
    assert!(wrk_output.status.success(), "wrk failed: {}\n{report}", String::from_utf8_lossy(&wrk_output.stderr));
    let result = parse_wrk(&report);
    assert!(
        detached_under_load,
        "wrk ended before the agent had gone: the recording and detach did not all run under load\n{report}"
    );
    assert!(leftovers.is_empty(), "left in the process: {leftovers:?}");
    assert_eq!(result.non_2xx_3xx, 0, "failed requests:\n{report}");
    assert_eq!(result.socket_errors, 0, "socket errors (a timeout is a request taking over 2 s):\n{report}");
    assert!(result.requests >= 2000, "{result:?}");
    assert!(service.is_alive(), "{}", service.describe());

    let v = walk_verification(&stderr, "record --pid");
    assert!(v.compared >= 8, "{}", v.line);
    let differing: Vec<String> = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("walk verification, thread"))
        .map(str::to_string)
        .collect();
    assert_eq!(
        v.identical,
        v.compared,
        "the signal engine's walks and DoStackSnapshot's differed: {}\n{}",
        v.line,
        differing.join("\n")
    );

    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    let total: u64 = stacks.iter().map(|s| s.count).sum();
    let handler = count_with(&stacks, HANDLER);
    assert!(
        handler * 10 >= total,
        "the handler has {handler} of {total} ns (under 10%) at {:.0} requests/s:\n{}",
        result.requests_per_second,
        describe(&stacks)
    );
    let placed: u64 = stacks.iter().filter(|s| handler_under_kestrel(s)).map(|s| s.count).sum();
    let misplaced: Vec<String> = stacks
        .iter()
        .filter(|s| s.frames.iter().any(|f| f == HANDLER) && !handler_under_kestrel(s))
        .map(|s| format!("{:10} {}", s.count, s.frames.join(";")))
        .collect();
    assert!(
        placed * 100 >= handler * 95,
        "only {placed} of the handler's {handler} ns are under Kestrel's frames; the others:\n{}",
        misplaced.join("\n")
    );
}
