//! What corsnap leaves in the temporary directory: nothing, even when it is
//! killed. These run without a .NET runtime (a program that never connects
//! keeps corsnap waiting with its socket open); `TMPDIR` points each run at a
//! scratch directory of its own.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("corsnap-test-leftovers-").tempdir().unwrap()
}

/// `corsnap record -- sleep 30` with `TMPDIR=tmp`: it waits for an agent
/// that never comes.
fn waiting_corsnap(tmp: &Path, out: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_corsnap"))
        .args(["record", "-o"])
        .arg(out)
        .args(["--", "sleep", "30"])
        .env("TMPDIR", tmp)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn socket_dirs(tmp: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(tmp)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("corsnap-"))
        .collect()
}

fn wait_for_socket(tmp: &Path) -> PathBuf {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(dir) = socket_dirs(tmp).into_iter().find(|d| d.join("agent.sock").exists()) {
            return dir;
        }
        assert!(Instant::now() < deadline, "corsnap made no socket in {}", tmp.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills `corsnap` with SIGKILL, and the program it started.
fn kill_hard(mut corsnap: Child) {
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", corsnap.id())).unwrap_or_default();
    corsnap.kill().unwrap();
    corsnap.wait().unwrap();
    for pid in children.split_whitespace() {
        let _ = Command::new("kill").args(["-9", pid]).status();
    }
}

/// Every file and directory under `dir` that anyone may write to.
fn world_writable(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let meta = std::fs::symlink_metadata(entry.path()).unwrap();
        if meta.file_type().is_symlink() {
            continue;
        }
        if meta.mode() & 0o002 != 0 {
            found.push(entry.path());
        }
        if meta.is_dir() {
            found.extend(world_writable(&entry.path()));
        }
    }
    found
}

#[test]
fn the_socket_is_private_while_corsnap_waits_and_gone_when_it_ends() {
    let tmp = scratch();
    let out = tmp.path().join("p.svg");
    let mut corsnap = waiting_corsnap(tmp.path(), &out);
    let dir = wait_for_socket(tmp.path());
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with(&format!("corsnap-{}-", corsnap.id())), "{name} names the corsnap it belongs to");
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    assert_eq!(std::fs::metadata(dir.join("agent.sock")).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(world_writable(tmp.path()), Vec::<PathBuf>::new());
    // An orderly end (SIGTERM) removes the directory.
    assert!(Command::new("kill").args(["-TERM", &corsnap.id().to_string()]).status().unwrap().success());
    corsnap.wait().unwrap();
    assert_eq!(socket_dirs(tmp.path()), Vec::<PathBuf>::new());
}

#[test]
fn a_socket_directory_left_by_a_killed_corsnap_is_removed_by_the_next_run() {
    let tmp = scratch();
    let out = tmp.path().join("p.svg");
    let corsnap = waiting_corsnap(tmp.path(), &out);
    let dir = wait_for_socket(tmp.path());
    kill_hard(corsnap);
    assert!(dir.exists(), "SIGKILL leaves the directory (before the agent connected)");
    // Someone else's directory of the same shape is left alone: not private.
    let foreign = tmp.path().join("corsnap-1-other");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The next run (here one that fails at once: no such program) tidies up.
    let next = Command::new(env!("CARGO_BIN_EXE_corsnap"))
        .args(["record", "-o"])
        .arg(&out)
        .args(["--", "/no/such/program"])
        .env("TMPDIR", tmp.path())
        .output()
        .unwrap();
    assert!(!next.status.success());
    assert!(!dir.exists(), "the stale directory {} is still there", dir.display());
    assert_eq!(socket_dirs(tmp.path()), vec![foreign]);
    assert!(!out.exists());
}
