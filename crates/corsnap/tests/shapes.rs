//! Every shape a .NET app ships in, published with `dotnet publish` from
//! `tests/programs/shapes.cs` and recorded on .NET 10: framework-dependent
//! (`dotnet app.dll` and the apphost), self-contained, single-file (launched
//! and attached with `--pid`), ReadyToRun (tiered, and with
//! `DOTNET_TieredCompilation=0`, where the precompiled code is what runs), and
//! native AOT, which has no CLR to profile: corsnap says so and runs it.
//!
//! The chain Main -> A -> B -> Hot must be whole in 99% of Hot's samples in
//! every shape with a runtime (see `assert_complete` for the samples corsnap
//! itself marks incomplete).

mod support;

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use support::{
    corsnap_bin, describe, managed_frames, parse_collapsed, published, record_command, scratch, Runtime, Service,
    Shape, Stack,
};

const CHAIN: [&str; 4] = ["Shapes.Main", "Shapes.A", "Shapes.B", "Shapes.Hot"];

/// Frames corsnap puts at the root of a sample whose walk it could not
/// finish: what it shows is true, but callers are missing.
const INCOMPLETE: &str = "[incomplete stack]";

/// The managed frames of every sample whose leaf (managed) method is `leaf`,
/// with its weight and whether corsnap marked it incomplete.
fn chains_ending_in<'a>(stacks: &'a [Stack], leaf: &str) -> Vec<(Vec<&'a str>, u64, bool)> {
    stacks
        .iter()
        .filter_map(|s| {
            let managed = managed_frames(&s.frames);
            (managed.last() == Some(&leaf)).then_some((managed, s.count, s.frames.iter().any(|f| f == INCOMPLETE)))
        })
        .collect()
}

/// `leaf`'s samples have exactly the managed frames `expected` in 99% of its
/// weight (`tests/signal.rs`'s rule), leaving out the samples corsnap itself
/// marks `[incomplete stack]` with managed frames missing, which must be no
/// more than 3%. (Those are the signal engine's first sightings of code it
/// has not learned yet whose stack it could not walk again: a sample or two
/// at start-up, more under heavy CPU contention, with any program,
/// `tests/programs/chain.cs` too; counting them as wrong would make these
/// tests about the machine's load rather than the app's shape. A sample not
/// marked that lacks a frame is wrong, and counts.)
fn assert_complete(stacks: &[Stack], leaf: &str, expected: &[&str], what: &str) {
    let chains = chains_ending_in(stacks, leaf);
    let total: u64 = chains.iter().map(|c| c.1).sum();
    let complete: u64 = chains.iter().filter(|c| c.0 == expected).map(|c| c.1).sum();
    let lost: u64 = chains.iter().filter(|c| c.2 && c.0 != expected).map(|c| c.1).sum();
    assert!(total > 0, "{what}: no sample in {leaf}:\n{}", describe(stacks));
    assert!(
        complete * 100 >= (total - lost) * 99,
        "{what}: {:.2}% of {leaf}'s weight (less what is marked incomplete) has the whole chain {expected:?}:\n{}",
        complete as f64 * 100.0 / (total - lost).max(1) as f64,
        describe(stacks)
    );
    assert!(
        lost * 100 <= total * 3,
        "{what}: {:.2}% of {leaf}'s weight is marked {INCOMPLETE} and lacks managed frames:\n{}",
        lost as f64 * 100.0 / total as f64,
        describe(stacks)
    );
}

/// Records `command` (launched) into collapsed stacks at 400 Hz; checks that
/// corsnap exited with `code`, the program's.
fn record_app(what: &str, command: &[&OsStr], env: &[(&str, &str)], code: i32) -> (Vec<Stack>, Output) {
    let dir = scratch(&format!("shapes-{}", what.replace([' ', '=', '/'], "_")));
    let out = dir.join("out.txt");
    let output = record_command(command, &["-f", "collapsed", "-r", "400", "-o", out.to_str().unwrap()], env);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(code), "{what}: corsnap record:\nstderr:\n{stderr}");
    let text = std::fs::read_to_string(&out).unwrap_or_else(|e| panic!("{what}: no output ({e}); stderr:\n{stderr}"));
    (parse_collapsed(&text), output)
}

/// The number the program printed after `word ` on stdout.
fn printed(output: &Output, word: &str) -> i64 {
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(word)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `{word} N` line in the program's output:\n{stdout}"))
}

fn os(p: &Path) -> &OsStr {
    p.as_os_str()
}

#[test]
fn framework_dependent_app_by_dotnet_and_by_its_apphost() {
    let app = published("shapes", Shape::FrameworkDependent);
    let dotnet = Runtime::Net10.dotnet();
    // `dotnet app.dll`, with an exit code of its own passed through.
    let (stacks, output) =
        record_app("framework-dependent dotnet", &[os(&dotnet), os(&app.dll), "2".as_ref(), "3".as_ref()], &[], 3);
    assert_complete(&stacks, "Shapes.Hot", &CHAIN, "framework-dependent, dotnet app.dll");
    // The control for the ReadyToRun test: JIT'd code counts its methods.
    let jitted = printed(&output, "jitted");
    assert!(jitted >= 3, "the JIT compiled {jitted} methods while the chain ran");
    // The apphost finds the installed runtime as a user's would.
    let root = dotnet.parent().unwrap().to_str().unwrap().to_string();
    let (stacks, _) =
        record_app("framework-dependent apphost", &[os(&app.exe), "2".as_ref()], &[("DOTNET_ROOT", &root)], 0);
    assert_complete(&stacks, "Shapes.Hot", &CHAIN, "framework-dependent, apphost");
}

#[test]
fn self_contained_app() {
    let app = published("shapes", Shape::SelfContained);
    assert!(app.dir.join("libcoreclr.so").is_file(), "a self-contained app carries its runtime");
    let (stacks, output) = record_app("self-contained", &[os(&app.exe), "2".as_ref()], &[], 0);
    assert_complete(&stacks, "Shapes.Hot", &CHAIN, "self-contained");
    assert!(String::from_utf8_lossy(&output.stdout).contains("done "));
    // Its runtime is named by version, not by the app's folder.
    let mut cmd = Command::new(&app.exe);
    cmd.args(["serve", "60"]);
    let mut service = Service::start_command(cmd);
    service.wait_heartbeats(1);
    let output = Command::new(corsnap_bin()).args(["dump", "--pid", &service.pid.to_string()]).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}\n{}", String::from_utf8_lossy(&output.stderr), service.describe());
    assert!(stdout.lines().next().is_some_and(|l| l.contains("(.NET 10.")), "{stdout}");
    assert!(stdout.contains("Shapes.Main"), "{stdout}");
    service.wait_agent_gone();
}

#[test]
fn single_file_app() {
    let app = published("shapes", Shape::SingleFile);
    assert!(!app.dir.join("libcoreclr.so").exists() && !app.dll.exists(), "a single-file app is one file");
    let (stacks, _) = record_app("single-file", &[os(&app.exe), "2".as_ref(), "5".as_ref()], &[], 5);
    assert_complete(&stacks, "Shapes.Hot", &CHAIN, "single-file");
}

#[test]
fn single_file_app_attached_by_pid_and_left_as_it_was() {
    let app = published("shapes", Shape::SingleFile);
    let mut cmd = Command::new(&app.exe);
    cmd.args(["serve", "120"]).env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1");
    let mut service = Service::start_command(cmd);
    service.wait_heartbeats(2);
    let dir = scratch("shapes-single-file-attach");
    let out = dir.join("out.txt");
    let pid = service.pid.to_string();
    let output = Command::new(corsnap_bin())
        .args(["record", "--pid", &pid, "-d", "2", "-r", "400", "-f", "collapsed", "-o", out.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "corsnap record --pid: {stderr}\n{}", service.describe());
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    assert_complete(&stacks, "Shapes.Hot", &CHAIN, "single-file, attached");
    service.wait_agent_gone();
    service.wait_heartbeats(2);
    assert!(service.is_alive(), "{}", service.describe());
    assert!(service.signal_leftovers().is_empty(), "left behind: {:?}", service.signal_leftovers());
}

#[test]
fn ready_to_run_app_tiered_and_with_its_precompiled_code_only() {
    let app = published("shapes", Shape::ReadyToRun);
    // Tiered: the precompiled code first, then Tier1 bodies the JIT makes of
    // the hot methods; the chain stays whole across the switch.
    let (stacks, output) = record_app("ready-to-run tiered", &[os(&app.exe), "2".as_ref()], &[], 0);
    assert_complete(&stacks, "Shapes.Hot", &CHAIN, "ReadyToRun, tiered");
    eprintln!("ReadyToRun, tiered: the JIT compiled {} methods while the chain ran", printed(&output, "jitted"));
    // TieredCompilation=0: ReadyToRun code is never replaced, and the JIT
    // compiled nothing while the chain ran (the program counts it), so every
    // sample of the chain is in precompiled code, unwound by the image's own
    // unwind table.
    let (stacks, output) = record_app(
        "ready-to-run TieredCompilation=0",
        &[os(&app.exe), "2".as_ref()],
        &[("DOTNET_TieredCompilation", "0")],
        0,
    );
    assert_eq!(printed(&output, "jitted"), 0, "the JIT compiled methods: the ReadyToRun code was not used");
    assert_complete(&stacks, "Shapes.Hot", &CHAIN, "ReadyToRun, TieredCompilation=0");
}

/// What `corsnap record -o <dir>/out.svg -- <command>` did with a native
/// AOT program: its stdout, exit code and corsnap's stderr; `dir` must stay
/// empty.
fn record_native_aot(what: &str, command: &[&OsStr]) -> (String, Option<i32>, String) {
    let dir = scratch(&format!("shapes-{what}"));
    let out = dir.join("out.svg");
    let started = Instant::now();
    let output = record_command(command, &["-o", out.to_str().unwrap()], &[]);
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "{what}: files left: {left:?}");
    assert!(started.elapsed() < Duration::from_secs(20), "{what}: took {:?}", started.elapsed());
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn native_aot_app_is_run_unprofiled_with_one_line_saying_why() {
    let app = published("shapes", Shape::NativeAot);
    assert!(!app.dll.exists(), "a native AOT app has no assembly");
    // Recognised before it starts: one line, then the program as it is.
    let (stdout, code, stderr) = record_native_aot("native-aot", &[os(&app.exe), "1".as_ref(), "7".as_ref()]);
    assert_eq!(code, Some(7), "corsnap exits with the program's code; stderr:\n{stderr}");
    assert!(stdout.contains("jitted 0\n") && stdout.contains("done "), "the program's stdout: {stdout}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(
        lines[0].contains("is a native AOT program: it has no .NET runtime to profile; running it without profiling"),
        "{stderr}"
    );
    // Behind a wrapper that execs it: recognised while corsnap waits for
    // the runtime, said once, and the exit code passed on.
    let script = format!("exec '{}' 1 6", app.exe.display());
    let (stdout, code, stderr) =
        record_native_aot("native-aot-wrapped", &["sh".as_ref(), "-c".as_ref(), script.as_ref()]);
    assert_eq!(code, Some(6), "stderr:\n{stderr}");
    assert!(stdout.contains("done "), "the program's stdout: {stdout}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(lines[0].contains("is a native AOT program: it has no .NET runtime to profile"), "{stderr}");
}

#[test]
fn native_aot_process_is_refused_by_pid_with_the_reason() {
    let app = published("shapes", Shape::NativeAot);
    let mut cmd = Command::new(&app.exe);
    cmd.args(["serve", "60"]);
    let mut service = Service::start_command(cmd);
    service.wait_heartbeats(1);
    let output = Command::new(corsnap_bin())
        .args(["record", "--pid", &service.pid.to_string(), "-d", "1", "-o", "/tmp/corsnap-never-written.svg"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(&format!("process {} is a native AOT program", service.pid)), "{stderr}");
    assert!(!Path::new("/tmp/corsnap-never-written.svg").exists());
    service.wait_heartbeats(2);
    assert!(service.is_alive(), "{}", service.describe());
}
