//! Short versions of the torture suite (the long soak is bench/torture.py):
//! the seeds' ways for a profiler to deadlock or crash its host, provoked at
//! 1000 Hz under the real .NET 8 runtime. Each run must finish with the
//! program's own output and exit code before a deadline that catches a
//! deadlock, and says what it survived.

mod support;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use support::{compiled, corsnap_bin, count_with, describe, parse_collapsed, scratch, Runtime, Service};

/// Waits for `child` at most `limit`; a run that takes longer is killed and
/// reported as the deadlock it most likely is.
fn wait_with_deadline(mut child: Child, limit: Duration, what: &str) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} did not finish within {limit:?} (deadlock?)\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `survived threads=.. gcs=..` from the program, as numbers.
fn survived(stdout: &str) -> std::collections::HashMap<String, u64> {
    let line =
        stdout.lines().find(|l| l.starts_with("survived ")).unwrap_or_else(|| panic!("no survival line in:\n{stdout}"));
    line["survived ".len()..]
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
        .collect()
}

/// `test`: the calling test's scratch directory name, its own (two tests
/// run the same storm, in parallel).
fn storm_under_corsnap(
    test: &str,
    kind: &str,
    seconds: &str,
    events: &[&str],
) -> (std::collections::HashMap<String, u64>, String, std::path::PathBuf) {
    let dir = scratch(&format!("torture-{test}"));
    let dll = compiled("storm", Runtime::Net10);
    let mut cmd = Command::new(corsnap_bin());
    cmd.args(["record", "--stats", "-r", "1000", "-f", "collapsed", "-o"]).arg(dir.join("p.txt"));
    for e in events {
        cmd.args(["-e", e]);
    }
    cmd.arg("--").arg(Runtime::Net10.dotnet()).arg(&dll).arg(kind).arg(seconds);
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let out = wait_with_deadline(child, Duration::from_secs(90), &format!("storm {kind}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    let counts = survived(&stdout);
    let agent = stderr.lines().find(|l| l.contains("agent:")).unwrap_or("").to_string();
    eprintln!("storm {kind}: survived {counts:?}; {agent}");
    (counts, stderr, dir)
}

#[test]
fn thread_churn_while_sampling_at_1000_hz() {
    let (counts, _, dir) = storm_under_corsnap("churn", "churn", "3", &["cpu"]);
    assert!(counts["threads"] >= 1000, "{counts:?}");
    let stacks = parse_collapsed(&std::fs::read_to_string(dir.join("p.txt")).unwrap());
    assert!(count_with(&stacks, "Storm.Churn") > 0, "{}", describe(&stacks));
}

#[test]
fn thread_churn_stacks_incomplete_at_most_1_percent() {
    let (_, stderr, _) = storm_under_corsnap("churn-incomplete", "churn", "3", &["cpu"]);
    // A thread caught half-created or half-gone can stop a walk early; that
    // must stay rare.
    let number_before = |marker: &str| -> u64 {
        let at = stderr.find(marker).unwrap_or_else(|| panic!("no {marker:?} in {stderr}"));
        stderr[..at].trim_end().rsplit(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    let (samples, incomplete) = (number_before(" samples from"), number_before(" stacks incomplete"));
    assert!(incomplete * 100 <= samples, "{incomplete} incomplete stacks in {samples}");
}

#[test]
fn gc_storm_while_sampling_and_naming_at_1000_hz() {
    let (counts, stderr, dir) = storm_under_corsnap("gc", "gc", "3", &["cpu", "gc"]);
    assert!(counts["gcs"] >= 100 && counts["jitted"] >= 100, "{counts:?}");
    let gcs = parse_collapsed(&std::fs::read_to_string(dir.join("p.gc.txt")).unwrap());
    assert!(gcs.len() > 1, "{}", describe(&gcs));
    let cpu = parse_collapsed(&std::fs::read_to_string(dir.join("p.cpu.txt")).unwrap());
    assert!(count_with(&cpu, "Storm.Allocate") > 0, "{}", describe(&cpu));
    assert!(stderr.contains("(0 unresolved)"), "every name resolved: {stderr}");
}

#[test]
fn exceptions_on_many_threads_are_all_recorded_while_sampling() {
    let (counts, _, dir) = storm_under_corsnap("exceptions", "exceptions", "3", &["cpu", "exceptions"]);
    let exceptions = parse_collapsed(&std::fs::read_to_string(dir.join("p.exceptions.txt")).unwrap());
    let recorded: u64 = exceptions.iter().map(|s| s.count).sum();
    assert_eq!(recorded, counts["exceptions"], "every exception, exactly");
    assert!(count_with(&exceptions, "Storm.Fail") == recorded, "{}", describe(&exceptions));
}

#[test]
fn a_program_killed_in_the_middle_of_sampling_still_gets_its_profile_written() {
    let dir = scratch("torture-killed");
    let log = dir.join("agent.log");
    let dll = compiled("storm", Runtime::Net10);
    let mut cli = Command::new(corsnap_bin())
        .args(["record", "-r", "1000", "-f", "collapsed", "-o"])
        .arg(dir.join("p.txt"))
        .arg("--agent-log")
        .arg(&log)
        .arg("--")
        .arg(Runtime::Net10.dotnet())
        .arg(&dll)
        .args(["gc", "30"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Readiness: the program says its storms have started (under load its
    // start-up alone took longer than a fixed wait, and it was killed before
    // it had allocated anything); then it storms for a while under sampling.
    let stdout = cli.stdout.take().unwrap();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("ready ") {
                let _ = ready_tx.send(());
            }
        }
    });
    ready_rx.recv_timeout(Duration::from_secs(60)).expect("the program never said it was storming");
    std::thread::sleep(Duration::from_millis(800));
    let pid: u32 = std::fs::read_to_string(&log)
        .unwrap()
        .split("[pid ")
        .nth(1)
        .unwrap()
        .split(']')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    let out = wait_with_deadline(cli, Duration::from_secs(20), "corsnap after its program was killed");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "the program's fate passes through: {stderr}");
    let stacks = parse_collapsed(&std::fs::read_to_string(dir.join("p.txt")).unwrap());
    assert!(count_with(&stacks, "Storm.Allocate") > 0, "samples before the kill are kept:\n{}", describe(&stacks));
}

/// `storm.dll all`: every storm at once, with a heartbeat.
fn storm_service() -> Service {
    Service::start_program(Runtime::Net10, "storm", &["all", "120"], &[])
}

#[test]
fn attach_and_detach_in_a_loop_under_thread_churn_and_gc_storm() {
    let mut service = storm_service();
    let dir = scratch("torture-attach-loop");
    let cycles = 10;
    for cycle in 1..=cycles {
        // Kept so that an agent that stays says why (seen once in CI).
        let agent_log = dir.join(format!("agent{cycle}.log"));
        let child = Command::new(corsnap_bin())
            .args([
                "record",
                "--pid",
                &service.pid.to_string(),
                "-d",
                "0.3",
                "-r",
                "1000",
                "-e",
                "cpu",
                "-e",
                "exceptions",
                "-e",
                "gc",
                "-f",
                "collapsed",
                "-o",
            ])
            .arg(dir.join(format!("p{cycle}.txt")))
            .arg("--agent-log")
            .arg(&agent_log)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_with_deadline(child, Duration::from_secs(30), &format!("attach cycle {cycle}"));
        if !out.status.success() {
            panic!("cycle {cycle}: {}\n{}", String::from_utf8_lossy(&out.stderr), service.describe());
        }
        service.wait_agent_gone_logged(Some(&agent_log));
        let left = service.signal_leftovers();
        assert!(left.is_empty(), "cycle {cycle} left behind: {left:?}");
        service.wait_heartbeats(1);
        assert!(service.is_alive(), "the storm service died");
    }
    eprintln!("attach loop: survived {cycles} attach/record/detach cycles under churn and GC storm");
}

#[test]
fn a_cli_killed_while_attaching_or_detaching_leaves_the_process_running() {
    let mut service = storm_service();
    let dir = scratch("torture-kill-cli");
    // Kill points from before the attach request to the middle of the detach.
    for (i, delay_ms) in [0u64, 5, 20, 50, 120, 250, 320, 340, 400].iter().enumerate() {
        let mut cli = Command::new(corsnap_bin())
            .args(["record", "--pid", &service.pid.to_string(), "-d", "0.3", "-r", "1000", "-f", "collapsed", "-o"])
            .arg(dir.join(format!("p{i}.txt")))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(*delay_ms));
        let _ = cli.kill();
        let _ = cli.wait();
        service.wait_agent_gone();
        service.wait_heartbeats(1);
        assert!(service.is_alive(), "the storm service died");
    }
    // And the process still takes a new attach.
    let out = Command::new(corsnap_bin())
        .args(["record", "--pid", &service.pid.to_string(), "-d", "0.3", "-f", "collapsed", "-o"])
        .arg(dir.join("last.txt"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    service.wait_agent_gone();
}
