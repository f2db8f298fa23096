//! The command line end to end, under a real runtime: outputs that are
//! devices and FIFOs, how a recording says it ended, what a killed corsnap
//! leaves, `top` without a terminal.

mod fifo;
mod support;

use fifo::through_fifo;

use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use support::{compiled, corsnap_bin, parse_collapsed, scratch, Runtime};

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn split_args(seconds: &str) -> Vec<std::ffi::OsString> {
    vec![Runtime::Net10.dotnet().into(), compiled("split", Runtime::Net10).into(), seconds.into()]
}

/// `corsnap record <args> -- dotnet split.dll <seconds>`, in its own process
/// group (as a shell runs a foreground job), with an agent log to wait on.
fn spawn_split(args: &[&str], seconds: &str, log: &Path, env: &[(&str, &Path)]) -> Child {
    let mut cmd = Command::new(corsnap_bin());
    cmd.arg("record").args(args).arg("--agent-log").arg(log).arg("--").args(split_args(seconds));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1")
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until the agent log says it started, and returns the program's pid.
fn wait_started(log: &Path) -> u32 {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains("started") {
            return text.split("[pid ").nth(1).unwrap().split(']').next().unwrap().parse().unwrap();
        }
        assert!(started.elapsed() < Duration::from_secs(20), "the agent never started");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_device_and_a_fifo_are_written_in_place() {
    let dir = scratch("cli-device");
    let null = dir.join("null");
    assert!(Command::new("mknod").arg(&null).args(["c", "1", "3"]).status().unwrap().success());
    let output = support::record(Runtime::Net10, "split", &["1"], &["-o", null.to_str().unwrap()], None);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(std::fs::metadata(&null).unwrap().file_type().is_char_device(), "the device was replaced");

    let fifo = dir.join("pipe");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let mut cmd = Command::new(corsnap_bin());
    cmd.args(["record", "-f", "collapsed", "-o", fifo.to_str().unwrap(), "--"]).args(split_args("1"));
    cmd.env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1");
    let (output, text) = through_fifo(&fifo, cmd);
    assert!(output.status.success(), "{}", stderr(&output));
    let stacks = parse_collapsed(&text);
    assert!(support::count_with(&stacks, "Split.Heavy") > 0, "{}", support::describe(&stacks));
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced");
    let mut left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    left.sort();
    assert_eq!(left, ["null", "pipe"], "no temporary file beside them");

    // -o - is standard output.
    let output = support::record(Runtime::Net10, "split", &["1"], &["-f", "collapsed", "-o", "-"], None);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains(";Split.Heavy"), "{stdout}");
    assert!(stderr(&output).contains("wrote standard output"), "{}", stderr(&output));
}

#[test]
fn ctrl_c_says_interrupted_and_a_normal_exit_says_the_program_exited() {
    let dir = scratch("cli-ended");
    let log = dir.join("agent.log");
    let out = dir.join("p.txt");
    let child = spawn_split(&["-f", "collapsed", "-o", out.to_str().unwrap()], "60", &log, &[]);
    wait_started(&log);
    std::thread::sleep(Duration::from_millis(500));
    assert!(Command::new("kill").args(["-INT", "--", &format!("-{}", child.id())]).status().unwrap().success());
    let output = child.wait_with_output().unwrap();
    assert!(stderr(&output).contains("recording ended: interrupted)"), "{}", stderr(&output));

    for _ in 0..3 {
        let output = support::record(Runtime::Net10, "split", &["0.3"], &["-o", out.to_str().unwrap()], None);
        let said = stderr(&output);
        assert!(output.status.success(), "{said}");
        assert!(!said.contains("the agent closed the connection"), "{said}");
        assert!(!said.contains("killed"), "{said}");
    }
}

#[test]
fn a_killed_program_is_named_with_its_signal() {
    let dir = scratch("cli-killed");
    let log = dir.join("agent.log");
    let out = dir.join("p.txt");
    let child = spawn_split(&["-f", "collapsed", "-o", out.to_str().unwrap()], "60", &log, &[]);
    let pid = wait_started(&log);
    std::thread::sleep(Duration::from_millis(500));
    assert!(Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap().success());
    let output = child.wait_with_output().unwrap();
    let said = stderr(&output);
    assert!(said.contains("recording ended: the program was killed by SIGKILL (signal 9))"), "{said}");
    assert_eq!(output.status.code(), Some(137), "{said}");
    assert!(out.exists(), "what was collected is written");
}

#[test]
fn a_corsnap_killed_while_recording_leaves_nothing_in_its_temporary_directory() {
    let dir = scratch("cli-sigkill");
    let tmp = tempfile::Builder::new().prefix("corsnap-test-cli-").tempdir().unwrap();
    let log = dir.join("agent.log");
    let out = dir.join("p.txt");
    let mut child =
        spawn_split(&["-f", "collapsed", "-o", out.to_str().unwrap()], "2", &log, &[("TMPDIR", tmp.path())]);
    let pid = wait_started(&log);
    child.kill().unwrap();
    child.wait().unwrap();
    // The program runs on (its agent detaches) and ends by itself.
    let deadline = Instant::now() + Duration::from_secs(20);
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(Instant::now() < deadline, "the program never ended");
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("corsnap"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(!out.exists(), "no profile from a killed corsnap");
}

#[test]
fn top_without_a_terminal_prints_plain_tables_and_once_prints_one() {
    let dir = scratch("cli-top");
    let output = Command::new(corsnap_bin())
        .args(["top", "--once", "--interval", "2", "--"])
        .args(split_args("10"))
        .env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("event cpu: CPU time"), "the event is named:\n{stdout}\n{}", stderr(&output));
    assert!(stdout.contains("Split.Heavy"), "{stdout}");
    assert_eq!(stdout.matches("event cpu:").count(), 1, "one table:\n{stdout}");
    assert!(stderr(&output).contains("--once"), "{}", stderr(&output));

    // A launched program that ends: its last table is printed, sorted by the
    // whole run, and corsnap passes its exit code on.
    let output = Command::new(corsnap_bin())
        .args(["top", "--interval", "0.5", "--"])
        .args(split_args("1.5"))
        .env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stdout.matches("event cpu:").count() >= 2, "a table each interval:\n{stdout}");
    let last = stdout.rsplit("corsnap top ·").next().unwrap();
    assert!(last.contains("sorted by own, since start") && last.contains("Split.Heavy"), "{last}");
    assert!(stderr(&output).contains("corsnap top: the program exited"), "{}", stderr(&output));
}

#[test]
fn alloc_alone_on_core31_warns_once_and_writes_no_empty_file() {
    let dir = scratch("cli-alloc-31");
    let out = dir.join("p.txt");
    let output = support::record(
        Runtime::Core31,
        "allocs",
        &["1"],
        &["-f", "collapsed", "-e", "alloc", "-o", out.to_str().unwrap()],
        None,
    );
    let said = stderr(&output);
    assert_eq!(said.matches("warning").count(), 1, "{said}");
    assert!(said.contains("--event alloc needs .NET 5 or later"), "{said}");
    assert!(said.contains("no profile written"), "{said}");
    assert_eq!(output.status.code(), Some(2), "{said}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no file at all");
}

/// `service.dll` copied as `<name>.dll` and started: `dotnet <name>.dll 60`,
/// once it says it is ready. Killed when dropped.
struct Named {
    child: Child,
    pid: u32,
}

impl Named {
    fn start(dir: &Path, name: &str) -> Named {
        use std::io::BufRead;
        let dll = compiled("service", Runtime::Net10);
        std::fs::copy(&dll, dir.join(format!("{name}.dll"))).unwrap();
        std::fs::copy(dll.with_extension("runtimeconfig.json"), dir.join(format!("{name}.runtimeconfig.json")))
            .unwrap();
        let mut child = Command::new(Runtime::Net10.dotnet())
            .arg(dir.join(format!("{name}.dll")))
            .arg("60")
            .env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = lines.next().unwrap().unwrap();
        let pid = ready.strip_prefix("ready ").unwrap().parse().unwrap();
        std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
        Named { child, pid }
    }
}

impl Drop for Named {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn ps_lists_dotnet_processes_and_name_finds_the_one_of_that_name() {
    let dir = scratch("cli-ps");
    let name = format!("svc-cli-{}", std::process::id());
    let one = Named::start(&dir, &name);
    let ps = Command::new(corsnap_bin()).arg("ps").output().unwrap();
    assert!(ps.status.success(), "{}", stderr(&ps));
    let table = String::from_utf8_lossy(&ps.stdout);
    let header = table.lines().next().unwrap();
    for column in ["PID", "NAME", "RUNTIME", "USER", "ATTACH", "COMMAND"] {
        assert!(header.contains(column), "{table}");
    }
    let row = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&one.pid.to_string()))
        .unwrap_or_else(|| panic!("pid {} missing:\n{table}", one.pid));
    let fields: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(fields[1], name, "{row}");
    assert!(fields[2].starts_with("10.0."), "the runtime version: {row}");
    assert_eq!(fields[3], "root", "{row}");
    assert_eq!(fields[4], "yes", "{row}");

    // --name attaches to it.
    let out = dir.join("p.txt");
    let recorded = Command::new(corsnap_bin())
        .args(["record", "-n", &name, "-d", "1s", "-f", "collapsed", "-o", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(recorded.status.success(), "{}", stderr(&recorded));
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    assert!(support::count_with(&stacks, "Service.Crunch") > 0, "{}", support::describe(&stacks));

    // Two of that name: refused, with both pids.
    let two = Named::start(&dir, &name);
    let refused = Command::new(corsnap_bin()).args(["dump", "-n", &name]).output().unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let said = stderr(&refused);
    assert!(said.contains(&format!("2 .NET processes are named {name}")), "{said}");
    assert!(said.contains(&one.pid.to_string()) && said.contains(&two.pid.to_string()), "{said}");
    let missing = Command::new(corsnap_bin()).args(["top", "-n", "no-such-program-name"]).output().unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(stderr(&missing).contains("no .NET process is named no-such-program-name"), "{}", stderr(&missing));
}

#[test]
fn top_without_a_terminal_stopped_by_sigterm_prints_the_whole_run_and_detaches() {
    let dir = scratch("cli-top-term");
    let service = Named::start(&dir, &format!("svc-top-{}", std::process::id()));
    let top = Command::new(corsnap_bin())
        .args(["top", "--interval", "5", "--pid", &service.pid.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert!(Command::new("kill").args(["-TERM", &top.id().to_string()]).status().unwrap().success());
    let output = top.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(stdout.matches("event cpu:").count(), 1, "one table, at the end:\n{stdout}");
    assert!(stdout.contains("sorted by own, since start") && stdout.contains("Service.Crunch"), "{stdout}");
    assert!(stderr(&output).contains("corsnap top: SIGTERM"), "{}", stderr(&output));
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", service.pid)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut mapped = maps.contains("libcorsnap_agent");
    while mapped && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        mapped = std::fs::read_to_string(format!("/proc/{}/maps", service.pid)).unwrap().contains("libcorsnap_agent");
    }
    assert!(!mapped, "the agent left the process");
}
