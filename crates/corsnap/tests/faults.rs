//! Fault injection (`CORSNAP_FAULTS`, test-only): a failing callback, failing
//! name lookups, a breaking control socket and a full sample buffer. The
//! program must carry on with its own output and exit code, and the samples
//! that could be taken must be kept.

mod support;

use std::process::Command;

use support::{compiled, corsnap_bin, count_with, describe, parse_collapsed, scratch, Runtime};

fn run_with_fault(fault: &str, program_seconds: &str) -> (String, String, Vec<support::Stack>, std::path::PathBuf) {
    let dir = scratch(&format!("fault-{fault}"));
    let out = dir.join("p.txt");
    let log = dir.join("agent.log");
    let output = Command::new(corsnap_bin())
        // Every tick is taken (no pause budget): the counts below are about
        // the faults, not about how hard the runtime is to stop.
        .args(["record", "--stats", "--threads", "--max-pause", "100", "-e", "wall", "-f", "collapsed", "-o"])
        .arg(&out)
        .arg("--agent-log")
        .arg(&log)
        .arg("--")
        .arg(Runtime::Net10.dotnet())
        .arg(compiled("threads", Runtime::Net10))
        .arg(program_seconds)
        .env("CORSNAP_FAULTS", fault)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(0), "fault {fault}: the program must finish normally\n{stderr}");
    assert!(stdout.starts_with("done "), "fault {fault}: the program's output is intact: {stdout:?}");
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap_or_default());
    (stderr, std::fs::read_to_string(&log).unwrap_or_default(), stacks, dir)
}

#[test]
fn a_panicking_callback_stops_at_the_ffi_boundary() {
    let (_, log, stacks, _) = run_with_fault("callback", "1");
    assert!(
        log.contains("panic (caught at the FFI boundary)") && log.contains("injected fault: ThreadCreated fails"),
        "{log}"
    );
    assert!(count_with(&stacks, "Workers.Alpha") > 0, "{}", describe(&stacks));
}

#[test]
fn failing_name_lookups_leave_the_samples_in_place() {
    let (stderr, _, stacks, _) = run_with_fault("names", "1");
    let unresolved: u64 =
        stacks.iter().filter(|s| s.frames.iter().any(|f| f.starts_with("[unresolved function"))).map(|s| s.count).sum();
    assert!(unresolved > 0, "{}", describe(&stacks));
    assert!(!stderr.contains("(0 unresolved)"), "the failures are counted: {stderr}");
    let total: u64 = stacks.iter().map(|s| s.count).sum();
    assert!(total >= 200, "samples are still taken: {total}");
}

#[test]
fn a_broken_control_socket_ends_the_recording_and_the_agent_leaves() {
    let (stderr, log, stacks, _) = run_with_fault("socket", "3");
    assert!(log.contains("detaching: "), "the agent detaches when its connection breaks:\n{log}");
    assert!(log.contains("detached"), "{log}");
    assert!(!stacks.is_empty(), "what arrived before the break is written: {stderr}");
}

#[test]
fn a_full_sample_buffer_truncates_stacks_and_counts_it() {
    let (stderr, _, stacks, _) = run_with_fault("buffer", "1");
    assert!(count_with(&stacks, "[truncated]") > 0, "{}", describe(&stacks));
    assert!(!stderr.contains(" 0 truncated"), "{stderr}");
    assert!(count_with(&stacks, "Workers.Alpha") > 0, "{}", describe(&stacks));
}
