//! Attach, record, detach, dump: end to end against a running C# service
//! under real .NET 10 (and 9 and 8 where marked) and Core 3.1 runtimes.

mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{
    compiled, corsnap_bin, count_ending, count_with, describe, parse_collapsed, scratch, wait_for, Runtime, Service,
};

/// The threads to compare against after a detach. The runtime keeps one
/// thread of its own after the first detach (its profiler-detach thread,
/// named after the diagnostics thread that started it), so the baseline
/// is taken after one attach and detach.
fn baseline_after_one_cycle(service: &Service) -> Vec<String> {
    let out = scratch(&format!("warmup-{}", service.pid)).join("p.txt");
    record_pid(service, "0.2", &[], &out);
    service.wait_agent_gone();
    service.settled_threads()
}

/// `corsnap record --pid` for `seconds` into collapsed stacks at `out`
/// (per-kind files when `extra` asks for several events); the run must succeed.
fn record_pid(service: &Service, seconds: &str, extra: &[&str], out: &Path) {
    let pid = service.pid.to_string();
    let mut args = vec!["record", "--pid", &pid, "-d", seconds, "-f", "collapsed", "-o", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    let output = corsnap(&args);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}

fn corsnap(args: &[&str]) -> std::process::Output {
    Command::new(corsnap_bin()).args(args).output().unwrap()
}

on_each_runtime!(recording_a_running_service_by_pid_finds_its_busy_method_and_leaves_no_trace, record_by_pid);

fn record_by_pid(runtime: Runtime) {
    let mut service = Service::start_on(runtime, &[]);
    let before = baseline_after_one_cycle(&service);
    let dir = scratch(&format!("attach-record-{runtime:?}"));
    let out = dir.join("p.txt");
    record_pid(&service, "1.5", &["--threads"], &out);
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    let crunch = count_with(&stacks, "Service.Crunch");
    assert!(crunch >= 100, "{}", describe(&stacks));
    let on_cruncher: u64 = stacks
        .iter()
        .filter(|s| s.frames[0].starts_with("cruncher tid=") && s.frames.last().unwrap() == "Service.Crunch")
        .map(|s| s.count)
        .sum();
    assert_eq!(on_cruncher, crunch, "the worker's name, given before the attach, is found:\n{}", describe(&stacks));
    service.wait_agent_gone();
    service.wait_heartbeats(3);
    assert!(service.is_alive());
    assert_eq!(service.settled_threads(), before);
}

#[test]
fn attach_and_detach_work_on_core31() {
    let service = Service::start_program(Runtime::Core31, "service", &["120"], &[]);
    let out = scratch("attach-31").join("p.txt");
    record_pid(&service, "1", &[], &out);
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    assert!(count_with(&stacks, "Service.Crunch") >= 50, "{}", describe(&stacks));
    service.wait_agent_gone();
    service.wait_heartbeats(2);
}

#[test]
fn twenty_attach_record_detach_cycles_leave_the_process_as_it_was() {
    let mut service = Service::start(&[]);
    let before = baseline_after_one_cycle(&service);
    let dir = scratch("attach-cycles");
    for cycle in 1..=20 {
        let out = dir.join(format!("p{cycle}.txt"));
        let output = corsnap(&[
            "record",
            "--pid",
            &service.pid.to_string(),
            "-d",
            "0.3",
            "-r",
            "200",
            "-f",
            "collapsed",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(output.status.success(), "cycle {cycle}: {}", String::from_utf8_lossy(&output.stderr));
        let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
        assert!(count_with(&stacks, "Service.Crunch") > 0, "cycle {cycle}:\n{}", describe(&stacks));
        service.wait_agent_gone();
        assert_eq!(service.settled_threads(), before, "cycle {cycle}");
        service.wait_heartbeats(1);
    }
    assert!(service.is_alive());
}

on_each_runtime!(dump_prints_every_managed_thread_leaf_first, dump_leaf_first);

/// The `cruncher` thread runs `WorkLoop`, which calls `Crunch` in a loop. The
/// runtime stops a thread where it can: inside `Crunch`, or (when `Crunch`
/// has no safe point where it was, and its return address is hijacked) just
/// after `Crunch` returns, when the thread truly is in `WorkLoop` alone. Both
/// are right; anything else (`Crunch` below `WorkLoop`, a missing `WorkLoop`)
/// is not leaf-first.
fn assert_cruncher_leaf_first(names: &[&str], text: &str) {
    let top: Vec<&str> = names.iter().copied().take(2).collect();
    let leaf_first = top == ["Service.Crunch", "Service.WorkLoop"]
        || (top.first() == Some(&"Service.WorkLoop") && !names.contains(&"Service.Crunch"));
    assert!(leaf_first, "cruncher's stack is not leaf first: {names:?}\n{text}");
}

fn dump_leaf_first(runtime: Runtime) {
    let service = Service::start_on(runtime, &[]);
    for json in [false, true] {
        let mut args = vec!["dump", "--pid"];
        let pid = service.pid.to_string();
        args.push(&pid);
        if json {
            args.push("--json");
        }
        let started = Instant::now();
        let output = corsnap(&args);
        let elapsed = started.elapsed();
        let text = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        assert!(elapsed < Duration::from_secs(1), "dump took {elapsed:?}");
        if json {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            let cruncher =
                v["threads"].as_array().unwrap().iter().find(|t| t["name"] == "cruncher").expect("cruncher thread");
            let names: Vec<&str> =
                cruncher["frames"].as_array().unwrap().iter().filter_map(|f| f["name"].as_str()).collect();
            assert_cruncher_leaf_first(&names, &text);
        } else {
            let lines: Vec<&str> = text.lines().collect();
            let at = lines
                .iter()
                .position(|l| l.starts_with("Thread ") && l.ends_with("\"cruncher\""))
                .unwrap_or_else(|| panic!("{text}"));
            let names: Vec<&str> = lines[at + 1..]
                .iter()
                .take_while(|l| !l.is_empty())
                .map(|l| l.trim().trim_end_matches(" (service.dll)"))
                .collect();
            assert_cruncher_leaf_first(&names, &text);
            assert!(text.contains("Service.Main (service.dll)"), "{text}");
        }
        service.wait_agent_gone();
    }
}

#[test]
fn a_cli_killed_mid_recording_leaves_the_process_running_and_detached() {
    let mut service = Service::start(&[]);
    let before = baseline_after_one_cycle(&service);
    let dir = scratch("attach-sigkill");
    let log = dir.join("agent.log");
    let mut cli = Command::new(corsnap_bin())
        .args(["record", "--pid", &service.pid.to_string(), "-f", "collapsed", "-o"])
        .arg(dir.join("p.txt"))
        .arg("--agent-log")
        .arg(&log)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Readiness: the agent logs once it samples.
    wait_for(Duration::from_secs(10), || {
        std::fs::read_to_string(&log).unwrap_or_default().contains("started (attached)")
    })
    .expect("agent never started");
    std::thread::sleep(Duration::from_millis(300));
    cli.kill().unwrap();
    cli.wait().unwrap();
    let killed = Instant::now();
    service.wait_agent_gone();
    assert!(killed.elapsed() < Duration::from_secs(3), "detach took {:?}", killed.elapsed());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("detaching: corsnap went away"), "agent log:\n{text}");
    service.wait_heartbeats(3);
    assert!(service.is_alive());
    assert_eq!(service.settled_threads(), before);
}

#[test]
fn recording_stops_and_writes_when_the_process_exits() {
    let dll = compiled("service", Runtime::Net10);
    let mut child = Command::new(Runtime::Net10.dotnet()).arg(&dll).arg("1.5").stdout(Stdio::piped()).spawn().unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut first).unwrap();
    let pid = first.trim().strip_prefix("ready ").unwrap().to_string();
    let dir = scratch("attach-exit");
    let out = dir.join("p.txt");
    let output = corsnap(&["record", "--pid", &pid, "-f", "collapsed", "-o", out.to_str().unwrap()]);
    let _ = child.wait();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("the program exited") || stderr.contains("the process exited"), "{stderr}");
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    assert!(count_with(&stacks, "Service.Crunch") > 0, "{}", describe(&stacks));
}

fn assert_fails_with(args: &[&str], expected: &[&str]) {
    let output = corsnap(args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "should fail: {args:?}");
    for e in expected {
        assert!(
            stderr.contains(e),
            "expected {e:?} in:\n{stderr}\n(status {:?}, stdout {})",
            output.status,
            String::from_utf8_lossy(&output.stdout)
        );
    }
}

#[test]
fn attach_errors_say_what_is_wrong() {
    let dir = scratch("attach-errors");
    let out = dir.join("p.svg");
    let out = out.to_str().unwrap();
    assert_fails_with(&["record", "--pid", "4000000", "-o", out], &["no process with pid 4000000"]);
    assert!(!Path::new(out).exists());

    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    assert_fails_with(&["dump", "--pid", &sleeper.id().to_string()], &["not a .NET"]);
    let _ = sleeper.kill();
    let _ = sleeper.wait();

    let no_diag = Service::start(&[("DOTNET_EnableDiagnostics", "0")]);
    assert_fails_with(&["record", "--pid", &no_diag.pid.to_string(), "-o", out], &["DOTNET_EnableDiagnostics=0"]);
    drop(no_diag);

    // A process already profiled (here by corsnap at start-up) cannot take a
    // second profiler; that it is corsnap is seen before the runtime is
    // asked (the runtime's own refusal, "another profiler", would leave the
    // agent loaded for good).
    let launched_log = dir.join("launched.log");
    let dll = compiled("service", Runtime::Net10);
    let mut launched = Command::new(corsnap_bin())
        .args(["record", "-f", "collapsed", "-o"])
        .arg(dir.join("launched.txt"))
        .arg("--agent-log")
        .arg(&launched_log)
        .arg("--")
        .arg(Runtime::Net10.dotnet())
        .arg(&dll)
        .arg("20")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Readiness: the program's own "ready <pid>" line, passed through by corsnap.
    let mut ready = String::new();
    BufReader::new(launched.stdout.as_mut().unwrap()).read_line(&mut ready).unwrap();
    let pid: u32 = ready.trim().strip_prefix("ready ").unwrap_or_else(|| panic!("{ready:?}")).parse().unwrap();
    assert_fails_with(&["record", "--pid", &pid.to_string(), "-o", out], &["corsnap's agent is already loaded"]);
    let _ = Command::new("kill").arg(pid.to_string()).status();
    let _ = launched.wait();
}

on_each_runtime!(event_profiles_work_after_an_attach, events_after_attach);

fn events_after_attach(runtime: Runtime) {
    let service = Service::start_on(runtime, &[]);
    let dir = scratch(&format!("attach-events-{runtime:?}"));
    let out = dir.join("p.txt");
    record_pid(&service, "1.5", &["-e", "cpu", "-e", "exceptions"], &out);
    let exceptions = parse_collapsed(&std::fs::read_to_string(dir.join("p.exceptions.txt")).unwrap());
    let beats = count_ending(&exceptions, &["Service.Beat", "System.InvalidOperationException"]);
    // One per 100 ms heartbeat during 1.5 s.
    assert!((10..=16).contains(&beats), "{beats} exceptions:\n{}", describe(&exceptions));
    let cpu = parse_collapsed(&std::fs::read_to_string(dir.join("p.cpu.txt")).unwrap());
    assert!(count_with(&cpu, "Service.Crunch") > 0, "{}", describe(&cpu));
    service.wait_agent_gone();
}

#[test]
fn sessions_run_back_to_back_wait_for_the_last_agent_to_leave() {
    // The agent leaves ~0.3 s after `record --pid` returns: a script's next
    // session, started at once, used to be refused as a second one.
    let service = Service::start(&[]);
    let pid = service.pid.to_string();
    let dir = scratch("attach-back-to-back");
    for round in 0..3 {
        let out = dir.join(format!("p{round}.txt"));
        let record = corsnap(&["record", "--pid", &pid, "-d", "0.5", "-f", "collapsed", "-o", out.to_str().unwrap()]);
        assert!(record.status.success(), "round {round}: {}", String::from_utf8_lossy(&record.stderr));
    }
    let dump = corsnap(&["dump", "--pid", &pid]);
    assert!(dump.status.success(), "{}", String::from_utf8_lossy(&dump.stderr));
    service.wait_agent_gone();
}

#[test]
fn a_second_session_is_refused_before_the_runtime_loads_the_agent_again() {
    // The runtime refuses a second profiler only after loading its library,
    // and never unloads it: the agent stayed mapped after both sessions.
    let service = Service::start(&[]);
    let pid = service.pid.to_string();
    let out = scratch("attach-second").join("p.txt");
    // Longer than the 3 s a new session waits for an earlier one's agent to
    // leave: this one is still recording then.
    let mut first = Command::new(corsnap_bin())
        .args(["record", "--pid", &pid, "-d", "8", "-f", "collapsed", "-o", out.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Readiness: the first session's agent is in the process.
    wait_for(Duration::from_secs(10), || service.agent_mapped()).expect("the first session's agent loads");
    let second = corsnap(&["dump", "--pid", &pid]);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success());
    assert!(stderr.contains("corsnap's agent is already loaded in process"), "{stderr}");
    assert!(first.wait().unwrap().success());
    service.wait_agent_gone();
    // And the process takes a session again afterwards.
    let again = corsnap(&["dump", "--pid", &pid]);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    service.wait_agent_gone();
}
