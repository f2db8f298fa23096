//! `sudo corsnap`: root attaches to (records, dumps, watches) a process of
//! another user, and the agent leaves it as it was. The program runs as
//! `nobody` with a `TMPDIR` of its own, as a service under its own account
//! would; corsnap finds its diagnostics socket there.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use support::{corsnap_bin, parse_collapsed, Runtime, Service};

const NOBODY: u32 = 65534;

fn is_root() -> bool {
    String::from_utf8_lossy(&Command::new("id").arg("-u").output().unwrap().stdout).trim() == "0"
}

/// Whether `nobody` can read `path` (root's home, where the runtimes of
/// `scripts/setup.sh` live, is often 0700).
fn nobody_can_read(path: &Path) -> bool {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "test", "-r"])
        .arg(path)
        .status()
        .unwrap()
        .success()
}

/// `service.cs` running as `nobody`, from a copy in a directory of
/// `nobody`'s own under /tmp (the build tree may be out of its reach), with
/// `TMPDIR` pointing at another.
struct ForeignService {
    service: Service,
    _home: tempfile::TempDir,
    program_tmp: PathBuf,
}

fn start_as_nobody() -> ForeignService {
    let runtime = Runtime::Net10;
    let dotnet = runtime.dotnet();
    assert!(
        nobody_can_read(&dotnet),
        "{} cannot be read by nobody: this test needs a runtime another user can run (.NET 10 from the SDK \
         under /usr/share/dotnet is)",
        dotnet.display()
    );
    let home = tempfile::Builder::new().prefix("corsnap-test-sudo-").tempdir().unwrap();
    let program_dir = home.path().join("app");
    let program_tmp = home.path().join("tmp");
    std::fs::create_dir(&program_dir).unwrap();
    std::fs::create_dir(&program_tmp).unwrap();
    let dll = support::compiled("service", runtime);
    for ext in ["dll", "pdb", "runtimeconfig.json"] {
        let from = dll.with_extension(ext);
        std::fs::copy(&from, program_dir.join(from.file_name().unwrap())).unwrap();
    }
    for dir in [home.path(), &program_dir, &program_tmp] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(dir, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&dotnet)
        .arg(program_dir.join("service.dll"))
        .arg("120")
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", home.path())
        .env("TMPDIR", &program_tmp)
        .env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1");
    let service = Service::start_command(cmd);
    service.wait_heartbeats(3);
    ForeignService { service, _home: home, program_tmp }
}

/// corsnap as root: a copy of the binary alone (as `cargo install` leaves
/// it, so the agent it hands the program is the one it carries, written
/// out for the program's user to read), with a `TMPDIR` of its own (so what
/// it leaves there can be seen).
fn corsnap(tmp: &Path, args: &[&str]) -> Output {
    let bin = tmp.join("bin/corsnap");
    if !bin.exists() {
        std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
        std::fs::copy(corsnap_bin(), &bin).unwrap();
    }
    Command::new(&bin)
        .args(args)
        .env("TMPDIR", tmp)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

fn check(output: &Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{what} failed: {:?}\n{stderr}", output.status);
    stderr
}

#[test]
fn root_records_dumps_and_watches_another_users_process() {
    if !is_root() {
        eprintln!("skipped: needs root (it runs a program as nobody and attaches to it as root)");
        return;
    }
    let foreign = start_as_nobody();
    let mut service = foreign.service;
    let pid = service.pid.to_string();
    // The program's diagnostics socket is in its own TMPDIR, not ours.
    let sockets: Vec<_> = std::fs::read_dir(&foreign.program_tmp).unwrap().flatten().collect();
    assert!(!sockets.is_empty(), "the program made no diagnostics socket in its TMPDIR");
    let tmp = tempfile::Builder::new().prefix("corsnap-test-sudo-cli-").tempdir().unwrap();

    let out = tmp.path().join("p.txt");
    let output =
        corsnap(tmp.path(), &["record", "--pid", &pid, "-d", "1.5", "-f", "collapsed", "-o", out.to_str().unwrap()]);
    check(&output, "corsnap record --pid (as root)");
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    let crunch: u64 = stacks.iter().filter(|s| s.frames.iter().any(|f| f == "Service.Crunch")).map(|s| s.count).sum();
    let all: u64 = stacks.iter().map(|s| s.count).sum();
    // The worker thread spins in Crunch; the main thread only wakes for a
    // heartbeat every 100 ms.
    assert!(crunch * 2 > all, "Service.Crunch {crunch} of {all}:\n{}", support::describe(&stacks));
    service.wait_agent_gone();

    let output = corsnap(tmp.path(), &["dump", "--pid", &pid]);
    check(&output, "corsnap dump --pid (as root)");
    let dump = String::from_utf8_lossy(&output.stdout);
    assert!(dump.contains("Service.WorkLoop"), "{dump}");
    service.wait_agent_gone();

    let output = corsnap(tmp.path(), &["top", "--once", "--interval", "1", "--pid", &pid]);
    check(&output, "corsnap top --once --pid (as root)");
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(table.contains("Service.Crunch"), "{table}");
    service.wait_agent_gone();

    assert!(service.is_alive(), "{}", service.describe());
    // corsnap's socket directories are gone; what is left is the agent,
    // written once, in a directory nobody else may write to or list.
    let mut left: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, vec!["bin".to_string(), "corsnap-agent-0".to_string(), "p.txt".to_string()]);
    let agents = tmp.path().join("corsnap-agent-0");
    assert_eq!(std::fs::metadata(&agents).unwrap().permissions().mode() & 0o777, 0o711);
    assert_eq!(std::fs::read_dir(&agents).unwrap().count(), 1);
}
