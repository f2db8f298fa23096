//! The CLI's end of the agent connection: a Unix socket in a private
//! directory, accepting only the expected process of the same user, and a
//! reader thread that turns the byte stream into messages.

use std::io::{self, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::Duration;

use anyhow::{Context, Result};
use corsnap_wire::{read_message, Message};

/// A socket the agent connects to, in a directory only we can enter.
#[derive(Debug)]
pub struct Listener {
    _dir: tempfile::TempDir,
    path: PathBuf,
    listener: UnixListener,
}

/// What the reader thread reports.
#[derive(Debug)]
pub enum Event {
    Message(Message),
    /// The agent closed the connection (cleanly, or with a read error).
    Closed(Option<io::Error>),
}

/// A connected agent.
#[derive(Debug)]
pub struct AgentConnection {
    events: Receiver<Event>,
    stream: UnixStream,
}

impl Listener {
    pub fn new() -> Result<Listener> {
        let dir = tempfile::Builder::new()
            .prefix("corsnap-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .context("creating a private directory for the agent socket")?;
        // Whatever the umask did, only we may enter.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))?;
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).with_context(|| format!("listening on {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        Ok(Listener { _dir: dir, path, listener })
    }

    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// Waits for process `pid` (ours, same user) to connect. `give_up` is
    /// polled while waiting; when it returns a message, that becomes the error.
    pub fn accept_from(&self, pid: u32, mut give_up: impl FnMut() -> Option<String>) -> Result<AgentConnection> {
        let uid = corsnap_abi::current_uid();
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => match corsnap_abi::peer_credentials(&stream) {
                    Ok((peer_pid, peer_uid)) if peer_uid == uid && peer_pid == pid => {
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

impl AgentConnection {
    fn start(stream: UnixStream) -> Result<AgentConnection> {
        stream.set_nonblocking(false)?;
        let reader = stream.try_clone()?;
        let (tx, rx) = mpsc::channel();
        thread::Builder::new().name("agent-reader".into()).spawn(move || {
            let mut input = BufReader::with_capacity(256 * 1024, reader);
            let mut scratch = Vec::new();
            loop {
                match read_message(&mut input, &mut scratch) {
                    Ok(Some(msg)) => {
                        if tx.send(Event::Message(msg)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {
                        let _ = tx.send(Event::Closed(None));
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Event::Closed(Some(e)));
                        return;
                    }
                }
            }
        })?;
        Ok(AgentConnection { events: rx, stream })
    }

    /// The next event, or `None` if nothing arrived within `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        match self.events.recv_timeout(timeout) {
            Ok(e) => Some(e),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Event::Closed(None)),
        }
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
