//! A program that starts a child .NET process (`spawner.cs` starting
//! `spawned.cs`, which inherits corsnap's environment): without
//! `--subprocesses` the child runs as if corsnap were not there; with it,
//! both are recorded, each under a root frame naming its process.

mod support;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use support::{compiled, corsnap_bin, parse_collapsed, scratch, Runtime, Stack};

const SECONDS: &str = "2";

fn corsnap(args: &[&str], program: bool) -> Output {
    let runtime = Runtime::Net10;
    let mut cmd = Command::new(corsnap_bin());
    cmd.args(args);
    if program {
        cmd.arg("--")
            .arg(runtime.dotnet())
            .arg(compiled("spawner", runtime))
            .arg(compiled("spawned", runtime))
            .arg(SECONDS);
    }
    cmd.env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1");
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let output = cmd.output().unwrap();
    assert!(
        output.status.success(),
        "corsnap {args:?} failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The value after `key` on the program's line that starts with `prefix`
/// (`spawned 1234 agent-mapped no`, `spawner cpu-ms 2003`).
fn said(stdout: &str, prefix: &str, key: &str) -> String {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(prefix) && l.contains(key))
        .unwrap_or_else(|| panic!("no `{prefix} ... {key}` line in\n{stdout}"));
    let words: Vec<&str> = line.split(' ').collect();
    let at = words.iter().position(|w| *w == key).unwrap();
    words[at + 1].to_string()
}

fn weight_with(stacks: &[Stack], frame: &str) -> u64 {
    stacks.iter().filter(|s| s.frames.iter().any(|f| f == frame)).map(|s| s.count).sum()
}

#[test]
fn without_subprocesses_a_child_runs_as_if_corsnap_were_not_there() {
    let dir = scratch("subprocesses-without");
    let out = dir.join("p.txt");
    let log = dir.join("agent.log");
    let output = corsnap(
        &["record", "-f", "collapsed", "-o", out.to_str().unwrap(), "--agent-log", log.to_str().unwrap()],
        true,
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The child looked at its own memory map once its Main ran.
    assert_eq!(said(&stdout, "spawned", "agent-mapped"), "no", "{stdout}");
    let child_pid = stdout.lines().find(|l| l.starts_with("spawned ")).unwrap().split(' ').nth(1).unwrap();
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    assert!(weight_with(&stacks, "Spawner.Burn") > 0, "{}", support::describe(&stacks));
    assert!(
        !stacks.iter().any(|s| s.frames.iter().any(|f| f.starts_with("Spawned.") || f.starts_with("process "))),
        "the child was recorded:\n{}",
        support::describe(&stacks)
    );
    // The agent the child inherited declined at once (its log is the
    // parent's file), and never connected.
    let log = std::fs::read_to_string(&log).unwrap();
    let of_child: Vec<&str> = log.lines().filter(|l| l.contains(&format!("[pid {child_pid}]"))).collect();
    assert!(
        of_child.len() == 1 && of_child[0].contains("not the program corsnap"),
        "the child's agent did more than decline:\n{log}"
    );
    // And corsnap said nothing about it.
    assert!(!stderr.contains(child_pid) && !stderr.contains("spawned"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

/// The share of the child in a profile whose stacks start with their
/// processes, checked against the CPU time each program measured itself.
fn check_processes(stacks: &[Stack], stdout: &str) {
    let child_pid = stdout.lines().find(|l| l.starts_with("spawned ")).unwrap().split(' ').nth(1).unwrap();
    let mut by_root: HashMap<&str, u64> = HashMap::new();
    for s in stacks {
        *by_root.entry(s.frames[0].as_str()).or_default() += s.count;
    }
    let child_root = format!("process {child_pid}:\"spawned\"");
    let parent_root = by_root
        .keys()
        .find(|r| r.starts_with("process ") && r.ends_with(":\"spawner\""))
        .unwrap_or_else(|| panic!("no root frame for the spawner: {by_root:?}"))
        .to_string();
    assert_eq!(by_root.len(), 2, "every stack under one of the two processes: {by_root:?}");
    // Each Burn is under its own process, and only there.
    for s in stacks {
        if s.frames.iter().any(|f| f == "Spawned.Burn") {
            assert_eq!(s.frames[0], child_root, "{:?}", s.frames);
        }
        if s.frames.iter().any(|f| f == "Spawner.Burn") {
            assert_eq!(s.frames[0], parent_root, "{:?}", s.frames);
        }
    }
    let child = by_root[child_root.as_str()] as f64;
    let parent = by_root[parent_root.as_str()] as f64;
    let child_cpu: f64 = said(stdout, "spawned", "cpu-ms").parse().unwrap();
    let parent_cpu: f64 = said(stdout, "spawner", "cpu-ms").parse().unwrap();
    let share = child / (child + parent);
    let measured = child_cpu / (child_cpu + parent_cpu);
    // Both measure CPU time; the profile misses each process's first
    // moments (before its agent connects) and the parent's last ones.
    assert!(
        (share - measured).abs() < 0.12,
        "the child has {:.1}% of the profile, {:.1}% of the CPU time the programs measured ({child_cpu} ms and \
         {parent_cpu} ms)",
        share * 100.0,
        measured * 100.0
    );
}

#[test]
fn with_subprocesses_each_process_is_recorded_under_its_root_frame() {
    let dir = scratch("subprocesses-with");
    let out = dir.join("p.txt");
    let output = corsnap(&["record", "--subprocesses", "-f", "collapsed", "-o", out.to_str().unwrap()], true);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(said(&stdout, "spawned", "agent-mapped"), "yes", "{stdout}");
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    check_processes(&stacks, &stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("in 2 processes"), "{stderr}");
}

#[test]
fn a_raw_recording_of_subprocesses_keeps_them_in_every_format() {
    let dir = scratch("subprocesses-raw");
    let raw = dir.join("run.corsnap");
    let output = corsnap(&["record", "--subprocesses", "-o", raw.to_str().unwrap()], true);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let report = |name: &str| {
        let path = dir.join(name);
        corsnap(&["report", raw.to_str().unwrap(), "-o", path.to_str().unwrap()], false);
        path
    };
    let stacks = parse_collapsed(&std::fs::read_to_string(report("p.txt")).unwrap());
    check_processes(&stacks, &stdout);
    let child_pid = stdout.lines().find(|l| l.starts_with("spawned ")).unwrap().split(' ').nth(1).unwrap();
    let child_root = format!("process {child_pid}:\"spawned\"");
    let speedscope = std::fs::read_to_string(report("p.json")).unwrap();
    assert!(speedscope.contains(&child_root.replace('"', "\\\"")), "speedscope lacks {child_root}");
    let svg = std::fs::read_to_string(report("p.svg")).unwrap();
    assert!(svg.contains(&child_root.replace('"', "&quot;")), "flame graph lacks {child_root}");
    let pprof = gunzip(&report("p.pb.gz"));
    assert!(String::from_utf8_lossy(&pprof).contains(&child_root), "pprof lacks {child_root}");
}

fn gunzip(path: &Path) -> Vec<u8> {
    let output = Command::new("gzip").arg("-dc").arg(path).output().unwrap();
    assert!(output.status.success());
    output.stdout
}

#[test]
fn subprocesses_is_for_a_program_corsnap_starts() {
    let output = Command::new(corsnap_bin()).args(["record", "--subprocesses", "--pid", "1"]).output().unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--subprocesses") && stderr.contains("--pid"), "{stderr}");
}
