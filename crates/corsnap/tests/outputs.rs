//! Where profiles go, and what the command line accepts, without a .NET
//! runtime: `corsnap report` renders a synthetic raw recording into devices,
//! FIFOs, standard output, directories and files; `corsnap record` is
//! refused before its program would run.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use corsnap_wire::{EventKind, Message};

mod fifo;
use fifo::through_fifo;

fn corsnap() -> Command {
    Command::new(env!("CARGO_BIN_EXE_corsnap"))
}

/// A scratch directory, removed when dropped (nothing is left in /tmp).
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("corsnap-test-outputs-").tempdir().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A raw recording with `kinds`: one stack `Program.Main;Work.Busy` per kind.
fn raw_recording(dir: &Path, kinds: &[EventKind]) -> PathBuf {
    let mut bytes = Vec::new();
    corsnap_wire::write_raw_header(&mut bytes).unwrap();
    let messages = [
        Message::Recording { command: "dotnet app.dll".into(), start_unix_ms: 1 },
        Message::Hello {
            protocol: corsnap_wire::PROTOCOL_VERSION,
            pid: 42,
            runtime_version: "10.0.12".into(),
            info_version: 14,
            rate_hz: 100,
            attached: false,
        },
        Message::Function { function_id: 1, name: "Program.Main".into(), module: "app.dll".into() },
        Message::Function { function_id: 2, name: "Work.Busy".into(), module: "app.dll".into() },
        Message::Thread { thread_id: 7, os_tid: 4242, name: "main".into() },
    ];
    for m in &messages {
        m.encode_into(&mut bytes);
    }
    for &kind in kinds {
        Message::Sample {
            time_ns: 1000,
            thread_id: 7,
            kind,
            weight: 10_000_000,
            truncated: false,
            leaf: String::new(),
            frames: vec![2, 1],
            il_offsets: Vec::new(),
        }
        .encode_into(&mut bytes);
    }
    let path = dir.join("run.corsnap");
    std::fs::write(&path, bytes).unwrap();
    path
}

fn report(raw: &Path, args: &[&str]) -> Output {
    corsnap().arg("report").arg(raw).args(args).stdin(Stdio::null()).output().unwrap()
}

fn mknod_null(path: &Path) {
    let status = Command::new("mknod").arg(path).args(["c", "1", "3"]).status().unwrap();
    assert!(status.success(), "mknod (the tests run as root)");
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
}

fn is_char_device(path: &Path) -> bool {
    std::fs::metadata(path).unwrap().file_type().is_char_device()
}

fn is_fifo(path: &Path) -> bool {
    std::fs::metadata(path).unwrap().file_type().is_fifo()
}

/// Files in `dir` other than `except`.
fn others(dir: &Path, except: &[&str]) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !except.contains(&n.as_str()))
        .collect();
    names.sort();
    names
}

#[test]
fn a_device_is_written_in_place_and_stays_a_device() {
    let dir = scratch();
    let raw = raw_recording(dir.path(), &[EventKind::Cpu]);
    let null = dir.path().join("null");
    mknod_null(&null);
    let out = report(&raw, &["-o", null.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(is_char_device(&null), "the device was replaced by a regular file");
    // Several events: each profile goes to the same device, none to null.cpu etc.
    let raw = raw_recording(dir.path(), &[EventKind::Cpu, EventKind::Exceptions]);
    let out = report(&raw, &["-f", "collapsed", "-o", null.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(is_char_device(&null));
    assert_eq!(others(dir.path(), &["null", "run.corsnap"]), Vec::<String>::new(), "nothing else was written");
}

#[test]
fn a_fifo_is_written_in_place_for_its_reader() {
    let dir = scratch();
    let raw = raw_recording(dir.path(), &[EventKind::Cpu]);
    let fifo = dir.path().join("pipe");
    mkfifo(&fifo);
    let mut cmd = corsnap();
    cmd.arg("report").arg(&raw).args(["-f", "collapsed", "-o", fifo.to_str().unwrap()]);
    let (out, text) = through_fifo(&fifo, cmd);
    assert!(out.status.success(), "{}", stderr(&out));

    assert_eq!(text.trim(), "Program.Main;Work.Busy 10000000");
    assert!(is_fifo(&fifo), "the FIFO was replaced by a regular file");
    assert_eq!(others(dir.path(), &["pipe", "run.corsnap"]), Vec::<String>::new());

    // A FIFO takes one profile: several events in a one-profile format are refused.
    let raw = raw_recording(dir.path(), &[EventKind::Cpu, EventKind::Exceptions]);
    let out = report(&raw, &["-f", "collapsed", "-o", fifo.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("can take one profile, but 2 events make one each"), "{}", stderr(&out));
    assert!(is_fifo(&fifo));
}

#[test]
fn dash_is_standard_output_and_dev_stdout_is_written_in_place() {
    let dir = scratch();
    let raw = raw_recording(dir.path(), &[EventKind::Cpu]);
    let out = report(&raw, &["-f", "collapsed", "-o", "-"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "Program.Main;Work.Busy 10000000");
    assert!(stderr(&out).contains("wrote standard output"), "{}", stderr(&out));
    // /dev/stdout on a pipe.
    let out = report(&raw, &["-f", "collapsed", "-o", "/dev/stdout"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "Program.Main;Work.Busy 10000000");
    // /dev/stdout on a regular file: appended to, the file itself kept.
    let file = dir.path().join("stdout.txt");
    std::fs::write(&file, "before\n").unwrap();
    let out = corsnap()
        .arg("report")
        .arg(&raw)
        .args(["-f", "collapsed", "-o", "/dev/stdout"])
        .stdout(std::fs::OpenOptions::new().append(true).open(&file).unwrap())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "before\nProgram.Main;Work.Busy 10000000\n");
    // No temporary file was made in /dev.
    assert!(!others(Path::new("/dev"), &[]).iter().any(|n| n.contains(".corsnap-")));
}

#[test]
fn a_directory_gets_a_default_name_inside_it() {
    let dir = scratch();
    let raw = raw_recording(dir.path(), &[EventKind::Cpu, EventKind::Exceptions]);
    let into = dir.path().join("profiles");
    std::fs::create_dir(&into).unwrap();
    let out = report(&raw, &["-o", into.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(others(&into, &[]), vec!["run.cpu.svg", "run.exceptions.svg"]);
    // A directory that does not exist is named as such.
    let missing = format!("{}/", dir.path().join("nowhere").display());
    let out = report(&raw, &["-o", &missing]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("there is no such directory"), "{}", stderr(&out));
}

#[test]
fn an_output_named_for_one_event_is_not_named_twice() {
    let dir = scratch();
    let raw = raw_recording(dir.path(), &[EventKind::Cpu, EventKind::Exceptions]);
    let out = report(&raw, &["-o", dir.path().join("run.cpu.svg").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(others(dir.path(), &["run.corsnap"]), vec!["run.cpu.svg", "run.exceptions.svg"]);
}

#[test]
fn a_link_to_a_file_keeps_the_link_and_the_file_gets_the_profile() {
    let dir = scratch();
    let raw = raw_recording(dir.path(), &[EventKind::Cpu]);
    let target = dir.path().join("real.txt");
    std::fs::write(&target, "old").unwrap();
    let link = dir.path().join("link.txt");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let out = report(&raw, &["-o", link.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_to_string(&target).unwrap().trim(), "Program.Main;Work.Busy 10000000");
}

#[test]
fn an_extension_corsnap_does_not_know_is_named() {
    let dir = scratch();
    let raw = raw_recording(dir.path(), &[EventKind::Cpu]);
    let out = report(&raw, &["-o", dir.path().join("x.html").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("does not know the extension .html of x.html; writing a flame graph (SVG)"));
    let out = report(&raw, &["-o", dir.path().join("prof").to_str().unwrap()]);
    assert!(stderr(&out).contains("prof has no extension; writing a flame graph (SVG)"), "{}", stderr(&out));
    // Said with -f, nothing to warn about; and -f takes the extensions' names too.
    let out = report(&raw, &["-f", "txt", "-o", dir.path().join("prof2").to_str().unwrap()]);
    assert!(out.status.success() && !stderr(&out).contains("warning"), "{}", stderr(&out));
    assert!(std::fs::read_to_string(dir.path().join("prof2")).unwrap().starts_with("Program.Main;Work.Busy"));
    // A flame graph option for another format is a contradiction.
    let out = report(&raw, &["-f", "json", "--inverted", "-o", dir.path().join("p.json").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--inverted draws flame graphs top down, but the output is a speedscope profile"));
}

/// `corsnap record` with `args`, whose program would leave a marker if it ran.
fn record_refused(args: &[&str]) -> (Output, bool) {
    let dir = scratch();
    let marker = dir.path().join("ran");
    let output = corsnap()
        .arg("record")
        .args(args)
        .args(["--", "sh", "-c"])
        .arg(format!("touch {}", marker.display()))
        .current_dir(dir.path())
        .output()
        .unwrap();
    (output, marker.exists())
}

#[test]
fn record_refuses_bad_outputs_and_contradictions_before_the_program_runs() {
    let dir = scratch();
    let fifo = dir.path().join("pipe");
    mkfifo(&fifo);
    for (args, says) in [
        (vec!["-o", "/nonexistent-dir/"], "there is no such directory"),
        (vec!["-o", "-", "-e", "cpu", "-e", "exceptions"], "standard output (-o -) can take one profile"),
        (vec!["-o", fifo.to_str().unwrap(), "-e", "cpu", "-e", "wall"], "can take one profile"),
        (vec!["--sampler", "suspend", "--cpu-clock", "timer"], "--sampler suspend has none"),
        (vec!["-f", "collapsed", "--inverted"], "--inverted draws flame graphs"),
        (vec!["-d", "0"], "a duration of 0 would record nothing"),
        (vec!["-d", "ten"], "is not a duration"),
        (vec!["--native"], "[possible values: show, collapse]"),
    ] {
        let (output, ran) = record_refused(&args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", stderr(&output));
        assert!(stderr(&output).contains(says), "{args:?} should say {says:?}: {}", stderr(&output));
        assert!(!ran, "{args:?}: the program must not run");
    }
    assert!(is_fifo(&fifo));
}

#[test]
fn a_program_given_without_the_separator_gets_a_hint() {
    for command in ["record", "top"] {
        let output = corsnap().args([command, "-r", "10", "dotnet", "app.dll"]).output().unwrap();
        assert_eq!(output.status.code(), Some(2));
        let said = stderr(&output);
        assert!(said.contains(&format!("goes after `--`: corsnap {command} [OPTIONS] -- dotnet app.dll")), "{said}");
    }
}

#[test]
fn durations_take_units_and_formats_their_extensions() {
    // Parsed, then refused for the contradiction after them: the durations and
    // formats themselves were accepted.
    for duration in ["10", "2.5", "10s", "500ms", "2m", "1m30s"] {
        let (output, _) = record_refused(&["-d", duration, "--sampler", "suspend", "--cpu-clock", "perf"]);
        assert!(stderr(&output).contains("--sampler suspend has none"), "-d {duration}: {}", stderr(&output));
    }
    for format in ["svg", "json", "txt", "pb.gz", "corsnap", "flamegraph"] {
        let (output, _) = record_refused(&["-f", format, "--sampler", "suspend", "--cpu-clock", "perf"]);
        assert!(stderr(&output).contains("--sampler suspend has none"), "-f {format}: {}", stderr(&output));
    }
}

#[test]
fn help_says_what_collapsed_counts_and_lists_top_events() {
    let help = corsnap().args(["record", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout).replace(char::is_whitespace, " ");
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(help.contains("N in CPU nanoseconds for cpu, not a sample count"), "{help}");
    let top = corsnap().args(["top", "--help"]).output().unwrap();
    let top = String::from_utf8_lossy(&top.stdout);
    for event in EventKind::ALL {
        assert!(top.contains(event.name()), "{} missing from top --help:\n{top}", event.name());
    }
}
