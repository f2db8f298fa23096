//! Only the process owner reaches corsnap's socket and files, and nothing
//! from another user is accepted. The cross-user checks need root (to act as
//! `nobody`); CI runs as root.

mod support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{compiled, corsnap_bin, scratch, Runtime};

fn is_root() -> bool {
    String::from_utf8_lossy(&Command::new("id").arg("-u").output().unwrap().stdout).trim() == "0"
}

fn wait_for_file_containing(path: &std::path::Path, text: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let content = std::fs::read_to_string(path).unwrap_or_default();
        if content.contains(text) {
            return content;
        }
        assert!(Instant::now() < deadline, "{} never said {text:?}:\n{content}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_agent_socket_its_directory_and_the_agent_log_are_private() {
    let dir = scratch("security-private");
    let log = dir.join("agent.log");
    let mut cli = Command::new(corsnap_bin())
        .args(["record", "-f", "collapsed", "-o"])
        .arg(dir.join("p.txt"))
        .arg("--agent-log")
        .arg(&log)
        .arg("--")
        .arg(Runtime::Net10.dotnet())
        .arg(compiled("threads", Runtime::Net10))
        .arg("3")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let content = wait_for_file_containing(&log, "started");
    let pid = content.split("[pid ").nth(1).unwrap().split(']').next().unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let socket = environ
        .split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"CORSNAP_SOCKET="))
        .map(|v| std::path::PathBuf::from(String::from_utf8_lossy(v).into_owned()))
        .expect("the program was given the socket");
    // Once the agent is connected, the socket and its directory are gone:
    // nobody else can reach them, and a corsnap killed now leaves nothing.
    // (Their modes while corsnap waits, 0600 in 0700, are checked by
    // tests/leftovers.rs.)
    // (The agent writes its log as it connects; corsnap removes them right
    // after it accepts the connection.)
    let gone = |p: &std::path::Path| {
        let deadline = Instant::now() + Duration::from_secs(5);
        while p.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        !p.exists()
    };
    assert!(gone(&socket), "the socket is removed once the agent has connected");
    assert!(gone(socket.parent().unwrap()), "and so is its directory");
    let log_meta = std::fs::metadata(&log).unwrap();
    assert_eq!(log_meta.permissions().mode() & 0o777, 0o600, "agent log");
    let me = std::fs::metadata("/proc/self").unwrap().uid();
    assert_eq!(log_meta.uid(), me);

    if is_root() {
        // Another user cannot even reach the socket to talk to the CLI.
        let probe = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c"])
            .arg(format!(
                "import socket\ns=socket.socket(socket.AF_UNIX)\ntry:\n  s.connect({:?})\n  print('connected')\nexcept OSError as e:\n  print('refused', e.errno)",
                socket.to_str().unwrap()
            ))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&probe.stdout);
        assert!(said.starts_with("refused"), "another user reached the socket: {said}");
    }
    let status = cli.wait().unwrap();
    assert!(status.success());
}

#[test]
fn an_agent_refuses_a_socket_that_belongs_to_another_user() {
    if !is_root() {
        eprintln!("needs root to act as another user; CI runs as root");
        return;
    }
    // Under /tmp, where `nobody` can reach it (the build tree may not be),
    // in a directory of `nobody`'s own (root, running the program, reaches
    // it all the same): never a world-writable one. Removed at the end.
    let nobodys = tempfile::Builder::new().prefix("corsnap-test-security-").tempdir().unwrap();
    let dir = nobodys.path().to_path_buf();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    let socket = dir.join("impostor.sock");
    let log = dir.join("agent.log");
    // A listener run by `nobody` that reports how many bytes it was sent.
    let mut impostor = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c"])
        .arg(format!(
            "import socket,os,sys\ns=socket.socket(socket.AF_UNIX)\ns.bind({path:?})\nos.chmod({path:?},0o777)\ns.listen(1)\nprint('listening',flush=True)\ns.settimeout(20)\ntry:\n  c,_=s.accept()\n  c.settimeout(5)\n  n=0\n  while True:\n    b=c.recv(65536)\n    if not b: break\n    n+=len(b)\n  print('received',n,flush=True)\nexcept Exception as e:\n  print('no connection',e,flush=True)",
            path = socket.to_str().unwrap()
        ))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(impostor.stdout.as_mut().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "listening");
    let agent = corsnap_bin().parent().unwrap().join("libcorsnap_agent.so");
    let program = Command::new(Runtime::Net10.dotnet())
        .arg(compiled("threads", Runtime::Net10))
        .arg("1")
        .env("CORECLR_ENABLE_PROFILING", "1")
        .env("CORECLR_PROFILER", "{6A3B7C2E-9D41-4F8A-B5E2-3C7D1A9F0E64}")
        .env("CORECLR_PROFILER_PATH", &agent)
        .env("CORSNAP_SOCKET", &socket)
        .env("CORSNAP_AGENT_LOG", &log)
        .output()
        .unwrap();
    assert!(program.status.success(), "the program runs on without the agent");
    assert!(String::from_utf8_lossy(&program.stdout).starts_with("done "));
    let out = impostor.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("received 0") || said.contains("no connection"), "the agent sent something: {said}");
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains("socket owned by uid 65534"), "{log}");
}
