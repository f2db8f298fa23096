//! The CLI's end of the agent connection: a Unix socket in a private
//! directory, accepting only the expected process (of our user, or, for
//! root, of the target's user), and a
//! reader thread that turns the byte stream into messages.

use std::collections::VecDeque;
use std::io::{self, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::Duration;

use anyhow::{Context, Result};
use corsnap_wire::{read_message, Message};

/// Messages handed from the reader thread to the main loop at most at once.
const MAX_BATCH: usize = 4096;

/// A socket the agent connects to, in a directory only we can enter.
#[derive(Debug)]
pub struct Listener {
    dir: tempfile::TempDir,
    path: PathBuf,
    listener: UnixListener,
    /// The user whose process is to connect.
    peer_uid: u32,
    /// The program's child processes connect too (`record --subprocesses`):
    /// the socket stays until corsnap ends.
    shared: bool,
}

/// What the reader thread reports. Messages dominate, and most are small
/// samples; boxing the (large, rare) stats message would cost every decode.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Event {
    Message(Message),
    /// The agent closed the connection (cleanly, or with a read error).
    Closed(Option<io::Error>),
}

/// A connected agent.
#[derive(Debug)]
pub struct AgentConnection {
    /// Batches from the reader thread: one hand-over (and one wake-up of
    /// the main loop) per read from the socket, not one per message. The
    /// agent sends 20 batches a second; at a message apiece, the two threads
    /// would trade the CPU thousands of times a second with the program.
    batches: Receiver<Vec<Event>>,
    unread: VecDeque<Event>,
    stream: UnixStream,
}

/// The socket directories' names: `corsnap-<pid of the CLI>-<random>`, so
/// that one left by a corsnap that was killed can be recognised.
const DIR_PREFIX: &str = "corsnap-";

impl Listener {
    /// A socket for a process of our own user (a program corsnap starts).
    pub fn new() -> Result<Listener> {
        Listener::for_user(corsnap_abi::current_uid())
    }

    /// A socket for process `pid`, which may belong to another user when
    /// corsnap runs as root (`sudo corsnap record --pid`).
    pub fn for_process(pid: u32) -> Result<Listener> {
        use std::os::unix::fs::MetadataExt;
        let owner =
            std::fs::metadata(format!("/proc/{pid}")).with_context(|| format!("looking at process {pid}"))?.uid();
        Listener::for_user(owner)
    }

    /// The socket sits in a fresh directory. For our own user: mode 0700
    /// and a 0600 socket. For another user's process (only root gets that
    /// far: the diagnostics socket refuses anyone else) the directory is
    /// 0711, which lets that process pass through to the socket but list
    /// nothing, and the socket is handed to that user, mode 0600: that user,
    /// and root, may connect; nobody else.
    fn for_user(peer_uid: u32) -> Result<Listener> {
        let own = peer_uid == corsnap_abi::current_uid();
        let dir_mode = if own { 0o700 } else { 0o711 };
        remove_stale_dirs(&std::env::temp_dir());
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .context("creating a private directory for the agent socket")?;
        // Whatever the umask did, only we may enter (and, for another
        // user's process, pass through).
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(dir_mode))?;
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).with_context(|| format!("listening on {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        if !own {
            std::os::unix::fs::chown(&path, Some(peer_uid), None)
                .with_context(|| format!("handing {} to uid {peer_uid}", path.display()))?;
        }
        listener.set_nonblocking(true)?;
        Ok(Listener { dir, path, listener, peer_uid, shared: false })
    }

    /// Keeps the socket after the first connection, for the program's
    /// child processes ([`Listener::accept_descendant`]).
    pub fn share_with_descendants(&mut self) {
        self.shared = true;
    }

    /// A connection from a descendant of process `root` (of the same user),
    /// if one is waiting; any other is hung up on. Never blocks.
    pub fn accept_descendant(&self, root: u32) -> Option<(u32, AgentConnection)> {
        loop {
            let (stream, _) = self.listener.accept().ok()?;
            match corsnap_abi::peer_credentials(&stream) {
                Ok((pid, uid)) if uid == self.peer_uid && descends_from(pid, root) => {
                    return AgentConnection::start(stream).ok().map(|c| (pid, c));
                }
                _ => drop(stream),
            }
        }
    }

    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// Removes the socket and its directory (the listening socket itself
    /// stays open, but can no longer be reached).
    fn remove_files(&self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir(self.dir.path());
    }

    /// Waits for process `pid` (of the user this socket was made for) to connect. `give_up` is
    /// polled while waiting; when it returns a message, that becomes the error.
    pub fn accept_from(&self, pid: u32, mut give_up: impl FnMut() -> Option<String>) -> Result<AgentConnection> {
        let uid = self.peer_uid;
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => match corsnap_abi::peer_credentials(&stream) {
                    Ok((peer_pid, peer_uid)) if peer_uid == uid && peer_pid == pid => {
                        // Connected: nobody else is to connect, so the socket
                        // and its directory go now. A corsnap killed from here
                        // on (even by SIGKILL) leaves nothing behind.
                        if !self.shared {
                            self.remove_files();
                        }
                        return AgentConnection::start(stream);
                    }
                    // Another process (a child of the program inheriting the
                    // profiling environment, or a stranger): not ours to record.
                    _ => drop(stream),
                },
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if let Some(reason) = give_up() {
                        anyhow::bail!(reason);
                    }
                    thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e).context("accepting the agent's connection"),
            }
        }
    }
}

/// Whether process `pid` is `root`'s child, grandchild, and so on.
fn descends_from(pid: u32, root: u32) -> bool {
    let mut current = pid;
    for _ in 0..64 {
        let Some(parent) = parent_of(current) else { return false };
        if parent == root {
            return true;
        }
        if parent <= 1 {
            return false;
        }
        current = parent;
    }
    false
}

/// The parent pid of `pid`, from `/proc/PID/stat` (after the command name,
/// which may hold spaces and parentheses: the last `)` ends it).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Removes the socket directories in `tmp` that a corsnap of this user left
/// when it was killed before its agent connected: named after a pid that is
/// no longer a corsnap, private, and holding nothing but the socket.
pub fn remove_stale_dirs(tmp: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    let uid = corsnap_abi::current_uid();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(DIR_PREFIX).and_then(|rest| rest.split('-').next()) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else { continue };
        let private = matches!(meta.mode() & 0o777, 0o700 | 0o711);
        if !meta.is_dir() || meta.uid() != uid || !private || pid == std::process::id() {
            continue;
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() == "corsnap" {
            continue; // still running
        }
        let contents: Vec<_> =
            std::fs::read_dir(entry.path()).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
        if contents.iter().all(|n| n == "agent.sock") {
            let _ = std::fs::remove_file(entry.path().join("agent.sock"));
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

impl AgentConnection {
    fn start(stream: UnixStream) -> Result<AgentConnection> {
        stream.set_nonblocking(false)?;
        let reader = stream.try_clone()?;
        let (tx, rx) = mpsc::channel::<Vec<Event>>();
        thread::Builder::new().name("agent-reader".into()).spawn(move || {
            let mut input = BufReader::with_capacity(256 * 1024, reader);
            let mut scratch = Vec::new();
            let mut batch = Vec::new();
            loop {
                let end = match read_message(&mut input, &mut scratch) {
                    Ok(Some(msg)) => {
                        batch.push(Event::Message(msg));
                        None
                    }
                    Ok(None) => Some(Event::Closed(None)),
                    Err(e) => Some(Event::Closed(Some(e))),
                };
                let ended = end.is_some();
                batch.extend(end);
                // Hand over what has arrived once the buffer is drained (the
                // next read would block), at the end, or every so many
                // messages: a sender that never lets the buffer drain (an
                // exception storm) must not make the main loop wait.
                if !ended && !input.buffer().is_empty() && batch.len() < MAX_BATCH {
                    continue;
                }
                let delivered = tx.send(std::mem::take(&mut batch)).is_ok();
                if ended || !delivered {
                    return;
                }
            }
        })?;
        Ok(AgentConnection { batches: rx, unread: VecDeque::new(), stream })
    }

    /// The next event, or `None` if nothing arrived within `timeout`.
    pub fn next_event(&mut self, timeout: Duration) -> Option<Event> {
        if self.unread.is_empty() {
            match self.batches.recv_timeout(timeout) {
                Ok(batch) => self.unread.extend(batch),
                Err(RecvTimeoutError::Timeout) => return None,
                Err(RecvTimeoutError::Disconnected) => return Some(Event::Closed(None)),
            }
        }
        self.unread.pop_front()
    }

    /// Sends a control command to the agent.
    pub fn send_command(&self, command: corsnap_wire::Command) -> io::Result<()> {
        use std::io::Write;
        let mut buf = Vec::new();
        command.encode_into(&mut buf);
        (&self.stream).write_all(&buf)
    }

    /// Hangs up: the agent notices and detaches itself.
    pub fn close(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_process_descends_from_its_ancestors_only() {
        let me = std::process::id();
        let parent = parent_of(me).unwrap();
        assert!(descends_from(me, parent));
        assert!(!descends_from(parent, me));
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        assert!(descends_from(child.id(), me) && descends_from(child.id(), parent));
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn a_socket_for_our_own_user_is_ours_alone() {
        let listener = Listener::new().unwrap();
        let dir = std::fs::metadata(listener.socket_path().parent().unwrap()).unwrap();
        let socket = std::fs::metadata(listener.socket_path()).unwrap();
        assert_eq!(dir.mode() & 0o777, 0o700);
        assert_eq!((socket.mode() & 0o777, socket.uid()), (0o600, corsnap_abi::current_uid()));
    }

    #[test]
    fn a_socket_for_another_users_process_is_that_users_alone() {
        if corsnap_abi::current_uid() != 0 {
            eprintln!("skipped: only root makes a socket for another user's process");
            return;
        }
        let listener = Listener::for_user(65534).unwrap();
        let dir = std::fs::metadata(listener.socket_path().parent().unwrap()).unwrap();
        let socket = std::fs::metadata(listener.socket_path()).unwrap();
        // Others may pass through the directory (not list it), and only
        // that user (and root) may connect to the socket.
        assert_eq!((dir.mode() & 0o777, dir.uid()), (0o711, 0));
        assert_eq!((socket.mode() & 0o777, socket.uid()), (0o600, 65534));
    }
}
