//! A client for the .NET runtime's diagnostics IPC ("diagnostic port"), used
//! to attach corsnap's agent to a process that is already running.
//!
//! Every .NET Core 3.0+ runtime on Linux listens on a Unix socket named
//! `$TMPDIR/dotnet-diagnostic-{pid}-{key}-socket`, where `TMPDIR` is the
//! *target's* temporary directory and `key` its start time (so a recycled pid
//! does not find a stale socket by accident). Tools such as `dotnet-trace`
//! talk to it with a small binary protocol; the only command we need is
//! `AttachProfiler`, which makes the runtime load a profiler library and call
//! its `ICorProfilerCallback3::InitializeForAttach`.
//!
//! Attaching fails in many ways that look alike from the outside (no socket,
//! wrong user, old runtime, a profiler already loaded), and the person who
//! hits them usually cannot read the runtime's source, so every error here
//! says what went wrong and what to do about it in plain words.
//!
//! The protocol is little-endian throughout:
//!
//! ```text
//! header  (20 bytes): magic "DOTNET_IPC_V1\0" (14) | u16 total size | u8 command set | u8 command id | u16 reserved
//! attach payload:     u32 attach timeout ms | CLSID (16, in-memory layout)
//!                     | u32 path length in UTF-16 units incl. NUL | UTF-16LE path incl. NUL
//!                     | u32 client data length | client data
//! response (24 bytes): header (command set 0xFF, id 0x00 OK / 0xFF error) | i32 HRESULT
//! ```

use std::ffi::OsStr;
use std::fs;
use std::io::{self, ErrorKind, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{anyhow, bail, Result};
use corsnap_abi::hr;
use corsnap_abi::Guid;

/// The first 14 bytes of every message in either direction.
const MAGIC: &[u8; 14] = b"DOTNET_IPC_V1\0";
/// Magic, size, command set, command id, reserved.
const HEADER_LEN: usize = 20;
/// A response header plus its i32 HRESULT.
const RESPONSE_LEN: usize = HEADER_LEN + 4;
/// The size field is a u16, so no message can be longer.
const MAX_MESSAGE_LEN: usize = u16::MAX as usize;

/// The profiler command set and its `AttachProfiler` command.
const COMMAND_SET_PROFILER: u8 = 0x03;
const COMMAND_ATTACH_PROFILER: u8 = 0x01;
/// Responses use the server command set; the id says OK or error.
const COMMAND_SET_SERVER: u8 = 0xFF;
const SERVER_RESPONSE_OK: u8 = 0x00;
const SERVER_RESPONSE_ERROR: u8 = 0xFF;

/// How much longer than the attach timeout we wait for the runtime's answer:
/// the runtime only starts its own clock once it has read our request, and
/// then still has to write the reply.
const IO_SLACK: Duration = Duration::from_secs(5);

/// `HRESULT_FROM_WIN32(ERROR_MOD_NOT_FOUND)` and
/// `HRESULT_FROM_WIN32(ERROR_BAD_EXE_FORMAT)`: what the runtime's PAL reports
/// when `dlopen` of the profiler library fails.
const HR_MOD_NOT_FOUND: i32 = 0x8007_007E_u32 as i32;
const HR_BAD_EXE_FORMAT: i32 = 0x8007_00C1_u32 as i32;
const HR_ACCESS_DENIED: i32 = 0x8007_0005_u32 as i32;

/// The diagnostics socket of one .NET process, found by [`find_socket`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiagnosticsSocket {
    pub path: PathBuf,
}

impl DiagnosticsSocket {
    /// The pid of the process behind the socket, for messages: taken from a
    /// `/proc/{pid}/root/...` prefix if the socket was found through the
    /// target's own file system view, else from the socket's name.
    fn pid(&self) -> Option<u32> {
        let mut components = self.path.components().map(|c| c.as_os_str());
        if self.path.starts_with("/proc") {
            components.next(); // "/"
            components.next(); // "proc"
            if let Some(pid) = components.next().and_then(|c| c.to_str()).and_then(|s| s.parse().ok()) {
                return Some(pid);
            }
        }
        let name = self.path.file_name()?.to_str()?;
        let rest = name.strip_prefix("dotnet-diagnostic-")?;
        rest.split('-').next()?.parse().ok()
    }

    /// "process 1234", or a neutral phrase when the name is unusual.
    fn describe_process(&self) -> String {
        match self.pid() {
            Some(pid) => format!("process {pid}"),
            None => "the target process".to_string(),
        }
    }
}

/// Finds the diagnostics socket of process `pid`.
///
/// The socket lives in the target's `TMPDIR`, which we read from
/// `/proc/{pid}/environ` (only readable for our own processes, or as root);
/// when that fails we fall back to our own `TMPDIR`, then `/tmp`. The target
/// may also see a different `/tmp` than we do (a container, systemd's
/// `PrivateTmp`), so we look through `/proc/{pid}/root` as well, where the
/// socket carries the pid the process has in its own pid namespace.
///
/// If several sockets match (a crashed earlier process with the same pid left
/// one behind), the one whose key is the process's start time wins, else the
/// newest; one whose key is before the process's start is never its own.
pub fn find_socket(pid: u32) -> Result<DiagnosticsSocket> {
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    match fs::metadata(&proc_dir) {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => bail!("no process with pid {pid}"),
        Err(e) => bail!("cannot look at process {pid} ({}): {e}", proc_dir.display()),
    }

    let environ = fs::read(proc_dir.join("environ")).ok();
    let tmp_dirs = match &environ {
        Some(env) => vec![target_tmpdir(env)],
        None => fallback_tmpdirs(),
    };

    // Our view of the target's temporary directory first (short paths, same
    // pid), then the target's own view of it, which only differs for
    // processes in another mount or pid namespace.
    let mut searches: Vec<(PathBuf, u32)> = tmp_dirs.iter().map(|d| (d.clone(), pid)).collect();
    let ns_pid = fs::read_to_string(proc_dir.join("status")).ok().and_then(|s| parse_ns_pid(&s)).unwrap_or(pid);
    for dir in &tmp_dirs {
        let relative = dir.strip_prefix("/").unwrap_or(dir);
        searches.push((proc_dir.join("root").join(relative), ns_pid));
    }

    let start_key = fs::read_to_string(proc_dir.join("stat")).ok().and_then(|s| parse_start_time(&s));
    let mut dir_errors = Vec::new();
    let mut found = Vec::new();
    for (dir, name_pid) in &searches {
        match list_sockets(dir, *name_pid) {
            Ok(sockets) => found.extend(sockets),
            // Only our own view is worth reporting: the /proc/{pid}/root view
            // is unreadable for other users' processes as a matter of course.
            Err(e) if !dir.starts_with("/proc") && e.kind() != ErrorKind::NotFound => {
                dir_errors.push(format!("could not list {}: {e}", dir.display()))
            }
            Err(_) => {}
        }
    }

    let Some(socket) = choose_socket(found, start_key) else {
        return Err(no_socket_error(pid, &proc_dir, environ.as_deref(), &tmp_dirs, &dir_errors));
    };

    check_owner(pid, socket.uid, corsnap_abi::current_uid())?;
    Ok(DiagnosticsSocket { path: socket.path })
}

/// Refuses a socket of another user up front: connecting would fail with a
/// bare "permission denied" (the runtime creates it readable and writable by
/// its owner only). Root may connect to any socket.
fn check_owner(pid: u32, owner: u32, me: u32) -> Result<()> {
    if me != 0 && owner != me {
        bail!(
            "the diagnostics socket of process {pid} belongs to {} (uid {owner}), not to you (uid {me}); \
             run corsnap as that user (for example with sudo -u {}), or as root",
            user_phrase(owner),
            user_name(owner).unwrap_or_else(|| format!("'#{owner}'")),
        );
    }
    Ok(())
}

/// How long an attach waits for the agent of a session that just ended to
/// leave the process.
const AGENT_LEAVING_WAIT: Duration = Duration::from_secs(3);

/// Whether process `pid` has no corsnap agent mapped, now or within `wait`
/// (polled every 20 ms).
fn agent_leaves_within(pid: u32, agent: &Path, wait: Duration) -> bool {
    let deadline = std::time::Instant::now() + wait;
    loop {
        if !agent_is_loaded(pid, agent) {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether process `pid` has corsnap's agent (the library at `agent`, or
/// any `libcorsnap_agent.so`) mapped.
fn agent_is_loaded(pid: u32, agent: &Path) -> bool {
    let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { return false };
    let agent = agent.to_string_lossy();
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .any(|path| path == agent || path.ends_with("/libcorsnap_agent.so"))
}

/// Asks the runtime behind `socket` to load the profiler at `profiler_path`
/// (with corsnap's agent CLSID) and hand it `client_data`.
///
/// `timeout` is passed to the runtime as its attach timeout; we wait
/// `timeout` + 5 s for the answer. The runtime answers only after the
/// agent's `InitializeForAttach` has returned, so `Ok` means the agent is
/// loaded and running.
pub fn attach_profiler(
    socket: &DiagnosticsSocket,
    profiler_path: &Path,
    client_data: &[u8],
    timeout: Duration,
) -> Result<()> {
    let target = socket.describe_process();
    // The runtime receives the path as UTF-16 text and resolves it in the
    // target's own working directory, so it must be absolute and Unicode.
    if profiler_path.to_str().is_none() {
        bail!(
            "the agent library path {} is not valid UTF-8, which the runtime cannot receive; \
             move the library to a plain path (or set CORSNAP_AGENT)",
            profiler_path.display()
        );
    }
    if !profiler_path.is_absolute() {
        bail!(
            "the agent library path {} is relative, and {target} would resolve it against its own \
             working directory; give an absolute path",
            profiler_path.display()
        );
    }

    // A runtime that refuses an attach because a profiler is active has
    // already loaded the library and never lets it go: the agent would
    // stay mapped in the process after every session (measured on .NET 10).
    // So a second corsnap is told here, before any request is sent. An
    // agent still leaving after its session ended (0.3 s after `record
    // --pid` returns, measured under load too) is waited for: sessions run
    // back to back from a script are the common case, not a conflict.
    if let Some(pid) = socket.pid() {
        if !agent_leaves_within(pid, profiler_path, AGENT_LEAVING_WAIT) {
            bail!(
                "corsnap's agent is already loaded in {target}, and did not leave within {} s: another corsnap \
                 session is recording it (or a killed one is still detaching); wait for it to end and try again",
                AGENT_LEAVING_WAIT.as_secs()
            );
        }
    }

    let clsid = Guid::parse(corsnap_wire::AGENT_CLSID);
    let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
    let request = encode_attach_request(&clsid, profiler_path, client_data, timeout_ms);
    if request.len() > MAX_MESSAGE_LEN {
        bail!(
            "the attach request would be {} bytes, more than the diagnostics protocol's limit of {MAX_MESSAGE_LEN}: \
             the agent library path or the session data is too long",
            request.len()
        );
    }

    let path = &socket.path;
    let mut stream = UnixStream::connect(path).map_err(|e| connect_error(&e, path, &target))?;
    let io_timeout = timeout.saturating_add(IO_SLACK);
    stream
        .set_read_timeout(Some(io_timeout))
        .and_then(|()| stream.set_write_timeout(Some(io_timeout)))
        .map_err(|e| anyhow!("could not set a timeout on the diagnostics connection to {target}: {e}"))?;

    stream.write_all(&request).map_err(|e| io_error(&e, "sending the attach request to", &target, io_timeout))?;
    let response =
        read_response(&mut stream).map_err(|e| io_error(&e, "waiting for the answer of", &target, io_timeout))?;
    let hr = decode_response(&response).map_err(|e| {
        anyhow!("{target} answered the attach request with something that is not a diagnostics response: {e}")
    })?;
    if hr < 0 {
        bail!("could not attach to {target}: {}", explain_attach_failure(hr));
    }
    Ok(())
}

/// Builds the complete `AttachProfiler` message: header and payload.
///
/// The size field is only meaningful up to 65535 bytes; [`attach_profiler`]
/// refuses longer requests before sending (the field then saturates). A path
/// that is not valid UTF-8 is sent lossily converted; again
/// [`attach_profiler`] refuses it first.
pub fn encode_attach_request(
    clsid: &Guid,
    profiler_path: &Path,
    client_data: &[u8],
    attach_timeout_ms: u32,
) -> Vec<u8> {
    let path_units: Vec<u16> = profiler_path.to_string_lossy().encode_utf16().chain(std::iter::once(0)).collect();

    let mut payload = Vec::with_capacity(4 + 16 + 4 + path_units.len() * 2 + 4 + client_data.len());
    payload.extend_from_slice(&attach_timeout_ms.to_le_bytes());
    payload.extend_from_slice(&clsid.to_bytes_le());
    payload.extend_from_slice(&len_u32(path_units.len()).to_le_bytes());
    for unit in &path_units {
        payload.extend_from_slice(&unit.to_le_bytes());
    }
    payload.extend_from_slice(&len_u32(client_data.len()).to_le_bytes());
    payload.extend_from_slice(client_data);

    let mut message = encode_header(HEADER_LEN + payload.len(), COMMAND_SET_PROFILER, COMMAND_ATTACH_PROFILER);
    message.extend_from_slice(&payload);
    message
}

/// Checks a server response and returns its HRESULT.
///
/// Both OK (`0xFF, 0x00`) and error (`0xFF, 0xFF`) responses carry an
/// HRESULT and give `Ok(hr)`; the caller decides what a negative one means.
/// `Err` describes a response that is not well formed: shorter than 24
/// bytes, wrong magic, a size field that disagrees with the bytes received,
/// or a command set or id that is not a server response.
pub fn decode_response(bytes: &[u8]) -> Result<i32, String> {
    if bytes.len() < RESPONSE_LEN {
        return Err(format!("{} bytes received, a response has at least {RESPONSE_LEN}", bytes.len()));
    }
    if &bytes[..MAGIC.len()] != MAGIC {
        return Err(format!("it does not start with the DOTNET_IPC_V1 magic (got {:02X?})", &bytes[..MAGIC.len()]));
    }
    let size = usize::from(u16::from_le_bytes([bytes[14], bytes[15]]));
    if size != bytes.len() {
        return Err(format!("its size field says {size} bytes but {} were received", bytes.len()));
    }
    let (command_set, command_id) = (bytes[16], bytes[17]);
    if command_set != COMMAND_SET_SERVER {
        return Err(format!("command set 0x{command_set:02X} is not the server's response set 0xFF"));
    }
    if command_id != SERVER_RESPONSE_OK && command_id != SERVER_RESPONSE_ERROR {
        return Err(format!("response id 0x{command_id:02X} is neither OK (0x00) nor error (0xFF)"));
    }
    Ok(i32::from_le_bytes([bytes[20], bytes[21], bytes[22], bytes[23]]))
}

/// Says in plain words why the runtime refused to attach, with what to do.
/// Always ends with the code itself, for searching and bug reports.
pub fn explain_attach_failure(hr: i32) -> String {
    let what = match hr {
        hr::CORPROF_E_PROFILER_ALREADY_ACTIVE => "another profiler is already loaded in the process, and the runtime \
             allows only one at a time. If it is corsnap from an earlier run, it is still leaving (a run that was \
             killed detaches its agent within a second or two): wait a few seconds and try again. Otherwise find \
             the other profiler (the process's CORECLR_PROFILER variables, or an APM agent) and remove it"
            .to_string(),
        hr::DIAGIPC_E_UNKNOWN_COMMAND => {
            "this runtime is too old to attach a profiler: attach needs .NET Core 3.0 or later; \
             to profile this program, start it under `corsnap record` instead"
                .to_string()
        }
        hr::CORPROF_E_PROFILER_NOT_ATTACHABLE => "the runtime loaded the agent but it declined to be attached \
             (it must implement ICorProfilerCallback3 and accept InitializeForAttach); the agent library is \
             probably from a different corsnap version, so reinstall corsnap"
            .to_string(),
        hr::CORPROF_E_RUNTIME_UNINITIALIZED | hr::CORPROF_E_NOT_YET_AVAILABLE => {
            "the runtime in the process has not finished starting up; wait a moment and try again".to_string()
        }
        hr::DIAGIPC_E_NOT_SUPPORTED => "this runtime does not support attaching a profiler (for example a Mono \
             or NativeAOT build of .NET); start the program under `corsnap record` if it can be profiled at all"
            .to_string(),
        hr::DIAGIPC_E_BAD_ENCODING => "the runtime could not parse the attach request; this runtime version \
             expects a different message layout (please report it as a corsnap bug, with the .NET version)"
            .to_string(),
        hr::DIAGIPC_E_UNKNOWN_MAGIC => "the runtime did not recognise the diagnostics protocol header; it \
             speaks a different protocol version than corsnap (please report it, with the .NET version)"
            .to_string(),
        hr::CLASS_E_CLASSNOTAVAILABLE => format!(
            "the agent library does not provide corsnap's profiler class {}: the library and the corsnap \
             binary come from different builds; reinstall corsnap",
            corsnap_wire::AGENT_CLSID
        ),
        HR_MOD_NOT_FOUND | HR_BAD_EXE_FORMAT | HR_ACCESS_DENIED => "the process could not load the agent \
             library: it must exist at that path as the process sees its file system (a container has its \
             own), be readable by the process's user, and match the process's architecture"
            .to_string(),
        hr::E_OUTOFMEMORY => "the process ran out of memory while loading the agent".to_string(),
        _ if hr < 0 => "the runtime refused to attach the agent, or the agent failed to start inside the \
             process; the agent's own log may say why"
            .to_string(),
        _ => "the runtime reported success".to_string(),
    };
    format!("{what} [{}]", hr::describe(hr))
}

/// A 20-byte header for a message of `total_len` bytes. The size saturates
/// at 65535; callers refuse longer messages.
fn encode_header(total_len: usize, command_set: u8, command_id: u8) -> Vec<u8> {
    let mut header = Vec::with_capacity(total_len.min(MAX_MESSAGE_LEN));
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&u16::try_from(total_len).unwrap_or(u16::MAX).to_le_bytes());
    header.push(command_set);
    header.push(command_id);
    header.extend_from_slice(&0u16.to_le_bytes());
    header
}

fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Reads one response: the header, then as many bytes as its size field
/// says (at least up to the HRESULT). A header that makes no sense is
/// returned as is, for [`decode_response`] to describe.
fn read_response(stream: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; HEADER_LEN];
    let got = read_full(stream, &mut buf)?;
    if got == 0 {
        return Err(io::Error::new(ErrorKind::UnexpectedEof, "the runtime closed the connection without answering"));
    }
    if got < HEADER_LEN || &buf[..MAGIC.len()] != MAGIC {
        buf.truncate(got);
        return Ok(buf);
    }
    let size = usize::from(u16::from_le_bytes([buf[14], buf[15]]));
    if size < RESPONSE_LEN {
        // Too short to hold an HRESULT: do not wait for bytes that will not come.
        return Ok(buf);
    }
    buf.resize(size, 0);
    let got = read_full(stream, &mut buf[HEADER_LEN..])?;
    buf.truncate(HEADER_LEN + got);
    Ok(buf)
}

/// Like `read_exact`, but a clean end of stream is not an error: returns how
/// many bytes arrived.
fn read_full(stream: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match stream.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

fn connect_error(e: &io::Error, path: &Path, target: &str) -> anyhow::Error {
    let path = path.display();
    match e.kind() {
        ErrorKind::NotFound => anyhow!("the diagnostics socket {path} is gone: {target} has probably exited"),
        ErrorKind::ConnectionRefused => anyhow!(
            "nothing answers on the diagnostics socket {path}: {target} has probably exited and left the socket \
             behind, or it is shutting down"
        ),
        ErrorKind::PermissionDenied => anyhow!(
            "permission denied on the diagnostics socket {path}: run corsnap as the user that runs {target} \
             (or as root)"
        ),
        _ => anyhow!("could not connect to the diagnostics socket {path} of {target}: {e}"),
    }
}

fn io_error(e: &io::Error, doing: &str, target: &str, waited: Duration) -> anyhow::Error {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => anyhow!(
            "no answer from {target} after {:.0} s {doing} it: its runtime is not responding (the process may \
             be stopped, for example in a debugger, or hung); try again, or with a longer timeout",
            waited.as_secs_f64()
        ),
        ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof => anyhow!(
            "{target} closed the diagnostics connection while corsnap was {doing} it: the process has probably \
             exited, or crashed while loading the agent"
        ),
        _ => anyhow!("error {doing} {target}: {e}"),
    }
}

/// The target's temporary directory from its environment block, the way the
/// runtime picks it: `TMPDIR` if set and not empty, else `/tmp`.
fn target_tmpdir(environ: &[u8]) -> PathBuf {
    environ
        .split(|&b| b == 0)
        .find_map(|entry| entry.strip_prefix(b"TMPDIR="))
        .filter(|value| !value.is_empty())
        .map(|value| PathBuf::from(OsStr::from_bytes(value)))
        .unwrap_or_else(|| PathBuf::from("/tmp"))
}

/// Where to look when the target's environment is unreadable: our own
/// `TMPDIR` (likely the same, if we were started from the same shell), then
/// `/tmp` (the default).
fn fallback_tmpdirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(own) = std::env::var_os("TMPDIR").filter(|v| !v.is_empty()) {
        dirs.push(PathBuf::from(own));
    }
    let tmp = PathBuf::from("/tmp");
    if !dirs.iter().any(|d| same_dir(d, &tmp)) {
        dirs.push(tmp);
    }
    dirs
}

fn same_dir(a: &Path, b: &Path) -> bool {
    let trim = |p: &Path| p.components().collect::<PathBuf>();
    trim(a) == trim(b)
}

/// The pid of the process inside its innermost pid namespace (the last
/// number of the `NSpid:` line of `/proc/{pid}/status`), which is what it
/// calls itself, and so the pid in its socket's name.
fn parse_ns_pid(status: &str) -> Option<u32> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// The process start time (field 22 of `/proc/{pid}/stat`, in clock ticks
/// since boot), which the runtime uses as the key in its socket name. The
/// command name (field 2) may contain spaces and parentheses, so fields are
/// counted from the last `)`.
fn parse_start_time(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first one after the command name.
    after_comm.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// A candidate socket file.
#[derive(Debug)]
struct FoundSocket {
    path: PathBuf,
    key: Option<u64>,
    modified: Option<SystemTime>,
    uid: u32,
    /// Device and inode, to notice the same socket seen through two paths.
    id: (u64, u64),
}

/// Sockets in `dir` named `dotnet-diagnostic-{pid}-{key}-socket`.
fn list_sockets(dir: &Path, pid: u32) -> io::Result<Vec<FoundSocket>> {
    let prefix = format!("dotnet-diagnostic-{pid}-");
    let mut found = Vec::new();
    for entry in fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        let Some(key) = socket_key(&name, &prefix) else { continue };
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.file_type().is_socket() {
            continue;
        }
        found.push(FoundSocket {
            path: entry.path(),
            key,
            modified: meta.modified().ok(),
            uid: meta.uid(),
            id: (meta.dev(), meta.ino()),
        });
    }
    Ok(found)
}

/// `Some(key)` if `name` is `{prefix}{key}-socket` (`Some(None)` if the key
/// is not a number, which the runtime never writes but we do not insist).
fn socket_key(name: &OsStr, prefix: &str) -> Option<Option<u64>> {
    let name = name.to_str()?;
    let key = name.strip_prefix(prefix)?.strip_suffix("-socket")?;
    Some(key.parse().ok())
}

/// The socket of the live process: the one whose key is its start time if
/// any, else the newest. Duplicates (the same file through two paths) keep
/// their first, shortest-to-reach path.
fn choose_socket(found: Vec<FoundSocket>, start_key: Option<u64>) -> Option<FoundSocket> {
    let mut unique: Vec<FoundSocket> = Vec::new();
    for socket in found {
        if !unique.iter().any(|s| s.id == socket.id) {
            unique.push(socket);
        }
    }
    if let Some(key) = start_key {
        if unique.iter().any(|s| s.key == Some(key)) {
            unique.retain(|s| s.key == Some(key));
        }
        // A key is its process's start time, and a pid is held by one
        // process at a time: a key before the live process's start is a
        // socket left by an earlier process that had this pid, and
        // connecting to it would only be refused.
        unique.retain(|s| s.key.is_none_or(|k| k >= key));
    }
    // max_by_key keeps the last maximum; reverse so ties go to the first found.
    unique.into_iter().rev().max_by_key(|s| s.modified)
}

/// Why there is no socket, from what else we can see of the process.
fn no_socket_error(
    pid: u32,
    proc_dir: &Path,
    environ: Option<&[u8]>,
    tmp_dirs: &[PathBuf],
    dir_errors: &[String],
) -> anyhow::Error {
    let searched = tmp_dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(" or ");
    let mut notes = String::new();
    for e in dir_errors {
        notes.push_str(&format!("; {e}"));
    }
    let tmpdir_note = if environ.is_none() {
        "; corsnap could not read its environment, so if it runs with a different TMPDIR, \
         run corsnap with the same TMPDIR (or as the process's user, or as root)"
    } else {
        ""
    };

    if let Some(setting) = environ.and_then(diagnostics_disabled_by) {
        return anyhow!(
            "process {pid} runs with {setting}, which turns off the diagnostics socket that attaching needs; \
             restart it without that setting"
        );
    }
    if crate::native_aot::process_is_native_aot(pid) {
        return anyhow!(
            "process {pid} is a native AOT program: it has no .NET runtime to attach to (corsnap profiles \
             programs that run on CoreCLR: `dotnet app.dll`, or an app's own executable, self-contained or \
             single-file)"
        );
    }
    let runs_dotnet = fs::read(proc_dir.join("maps"))
        .map(|maps| maps.windows(b"libcoreclr.so".len()).any(|w| w == b"libcoreclr.so"))
        .ok();
    match runs_dotnet {
        Some(true) => anyhow!(
            "process {pid} runs .NET but has no diagnostics socket (looked for dotnet-diagnostic-{pid}-*-socket \
             in {searched}): it was probably started with DOTNET_EnableDiagnostics=0 (or \
             COMPlus_EnableDiagnostics=0); restart it without that setting (if it started only a moment ago, \
             try again){tmpdir_note}{notes}"
        ),
        Some(false) => anyhow!(
            "process {pid} is not a .NET (Core 3.0+) process: no diagnostics socket \
             dotnet-diagnostic-{pid}-*-socket in {searched}, and no .NET runtime (libcoreclr.so) loaded \
             (a single-file .NET app has the runtime built in: then it was probably started with \
             DOTNET_EnableDiagnostics=0){tmpdir_note}{notes}"
        ),
        None => anyhow!(
            "process {pid} is not a .NET (Core 3.0+) process, or not one corsnap may look at: no diagnostics \
             socket dotnet-diagnostic-{pid}-*-socket in {searched}, and its memory map is unreadable for this \
             user; if it belongs to another user, run corsnap as that user{tmpdir_note}{notes}"
        ),
    }
}

/// The environment setting that turned the diagnostics socket off, if any.
/// `DOTNET_` wins over `COMPlus_`, and the runtime reads the value as hex.
fn diagnostics_disabled_by(environ: &[u8]) -> Option<String> {
    const NAMES: [&str; 4] = [
        "DOTNET_EnableDiagnostics",
        "COMPlus_EnableDiagnostics",
        "DOTNET_EnableDiagnostics_IPC",
        "COMPlus_EnableDiagnostics_IPC",
    ];
    let value_of = |name: &str| {
        environ.split(|&b| b == 0).find_map(|entry| {
            let rest = entry.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
            std::str::from_utf8(rest).ok().map(str::to_string)
        })
    };
    // Each pair: the DOTNET_ spelling takes precedence over COMPlus_.
    for pair in NAMES.chunks(2) {
        let chosen = pair.iter().find_map(|name| value_of(name).map(|v| (*name, v)));
        if let Some((name, value)) = chosen {
            if u32::from_str_radix(value.trim(), 16) == Ok(0) {
                return Some(format!("{name}={value}"));
            }
        }
    }
    None
}

/// The login name for `uid` from `/etc/passwd`, if it is there.
pub fn user_name(uid: u32) -> Option<String> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let id: u32 = fields.nth(1)?.parse().ok()?;
        (id == uid && !name.is_empty()).then(|| name.to_string())
    })
}

/// "user alice", or "another user" when the name is unknown.
fn user_phrase(uid: u32) -> String {
    match user_name(uid) {
        Some(name) => format!("user {name}"),
        None => "another user".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::thread;

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    fn response(command_id: u8, hr: i32) -> Vec<u8> {
        let mut r = encode_header(RESPONSE_LEN, COMMAND_SET_SERVER, command_id);
        r.extend_from_slice(&hr.to_le_bytes());
        r
    }

    #[test]
    fn encode_attach_request_matches_the_documented_layout() {
        let clsid = Guid::parse("{01234567-89AB-CDEF-0123-456789ABCDEF}");
        let request = encode_attach_request(&clsid, Path::new("/a/é.so"), b"xyz", 5000);

        let mut expected = Vec::new();
        expected.extend_from_slice(b"DOTNET_IPC_V1\0");
        let total: u16 = 20 + 4 + 16 + 4 + 8 * 2 + 4 + 3;
        expected.extend_from_slice(&total.to_le_bytes());
        expected.extend_from_slice(&[0x03, 0x01, 0x00, 0x00]);
        expected.extend_from_slice(&5000u32.to_le_bytes());
        expected.extend_from_slice(&[
            0x67, 0x45, 0x23, 0x01, 0xAB, 0x89, 0xEF, 0xCD, 0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF,
        ]);
        // "/a/é.so" is 7 UTF-16 units, plus the NUL.
        expected.extend_from_slice(&8u32.to_le_bytes());
        expected.extend_from_slice(&[b'/', 0, b'a', 0, b'/', 0, 0xE9, 0, b'.', 0, b's', 0, b'o', 0, 0, 0]);
        expected.extend_from_slice(&3u32.to_le_bytes());
        expected.extend_from_slice(b"xyz");
        assert_eq!(request, expected);

        assert_eq!(&request[..14], MAGIC);
        assert_eq!(usize::from(u16::from_le_bytes([request[14], request[15]])), request.len());
        assert_eq!((request[16], request[17]), (COMMAND_SET_PROFILER, COMMAND_ATTACH_PROFILER));
        assert_eq!(u32_at(&request, 20), 5000);
        assert_eq!(request[24..40], clsid.to_bytes_le());
    }

    #[test]
    fn encode_attach_request_with_empty_client_data() {
        let clsid = Guid::parse(corsnap_wire::AGENT_CLSID);
        let request = encode_attach_request(&clsid, Path::new("/x"), &[], 0);
        assert_eq!(request.len(), 20 + 4 + 16 + 4 + 3 * 2 + 4);
        assert_eq!(u32_at(&request, 40), 3);
        assert_eq!(u32_at(&request, request.len() - 4), 0);
    }

    #[test]
    fn decode_response_accepts_ok_and_error() {
        assert_eq!(decode_response(&response(SERVER_RESPONSE_OK, 0)), Ok(0));
        let already = hr::CORPROF_E_PROFILER_ALREADY_ACTIVE;
        assert_eq!(decode_response(&response(SERVER_RESPONSE_ERROR, already)), Ok(already));
        assert_eq!(already as u32, 0x8013_136A);
    }

    #[test]
    fn decode_response_rejects_malformed_input() {
        let good = response(SERVER_RESPONSE_ERROR, hr::E_FAIL);
        assert!(decode_response(&[]).unwrap_err().contains("0 bytes"));
        assert!(decode_response(&good[..23]).is_err());

        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        assert!(decode_response(&bad_magic).unwrap_err().contains("magic"));

        let mut bad_size = good.clone();
        bad_size[14] = 30;
        assert!(decode_response(&bad_size).unwrap_err().contains("size"));
        let mut longer = good.clone();
        longer.push(0);
        assert!(decode_response(&longer).unwrap_err().contains("size"));

        let mut bad_set = good.clone();
        bad_set[16] = 0x03;
        assert!(decode_response(&bad_set).unwrap_err().contains("command set"));
        let mut bad_id = good;
        bad_id[17] = 0x01;
        assert!(decode_response(&bad_id).is_err());
    }

    /// Plays the runtime: reads one request, hands it back for inspection,
    /// and answers with `hr`.
    fn fake_runtime(listener: UnixListener, hr_to_send: i32) -> thread::JoinHandle<Vec<u8>> {
        thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut header = [0u8; HEADER_LEN];
            conn.read_exact(&mut header).unwrap();
            let size = usize::from(u16::from_le_bytes([header[14], header[15]]));
            let mut request = header.to_vec();
            request.resize(size, 0);
            conn.read_exact(&mut request[HEADER_LEN..]).unwrap();
            let id = if hr_to_send < 0 { SERVER_RESPONSE_ERROR } else { SERVER_RESPONSE_OK };
            conn.write_all(&response(id, hr_to_send)).unwrap();
            request
        })
    }

    #[test]
    fn attach_reports_another_profiler() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dotnet-diagnostic-4242-1234-socket");
        let listener = UnixListener::bind(&path).unwrap();
        let server = fake_runtime(listener, hr::CORPROF_E_PROFILER_ALREADY_ACTIVE);

        let agent = dir.path().join("libcorsnap_agent.so");
        let socket = DiagnosticsSocket { path };
        let err = attach_profiler(&socket, &agent, b"session", Duration::from_secs(3)).unwrap_err().to_string();
        assert!(err.contains("another profiler"), "{err}");
        assert!(err.contains("process 4242"), "{err}");
        assert!(err.contains("0x8013136A"), "{err}");

        let request = server.join().unwrap();
        assert_eq!(request, encode_attach_request(&Guid::parse(corsnap_wire::AGENT_CLSID), &agent, b"session", 3000));
        assert_eq!((request[16], request[17]), (0x03, 0x01));
        assert_eq!(u32_at(&request, 20), 3000);
        assert_eq!(request[24..40], Guid::parse(corsnap_wire::AGENT_CLSID).to_bytes_le());
        let units = u32_at(&request, 40) as usize;
        let text: Vec<u16> = request[44..44 + units * 2].chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        assert_eq!(text.last(), Some(&0));
        assert_eq!(String::from_utf16(&text[..units - 1]).unwrap(), agent.to_str().unwrap());
        let data_at = 44 + units * 2;
        assert_eq!(u32_at(&request, data_at), 7);
        assert_eq!(&request[data_at + 4..], b"session");
    }

    #[test]
    fn attach_succeeds_on_ok() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dotnet-diagnostic-4243-1-socket");
        let server = fake_runtime(UnixListener::bind(&path).unwrap(), hr::S_OK);
        let agent = dir.path().join("libcorsnap_agent.so");
        attach_profiler(&DiagnosticsSocket { path }, &agent, &[], Duration::from_secs(3)).unwrap();
        server.join().unwrap();
    }

    #[test]
    fn attach_explains_a_stale_socket_and_a_silent_close() {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("libcorsnap_agent.so");

        let path = dir.path().join("dotnet-diagnostic-4244-1-socket");
        drop(UnixListener::bind(&path).unwrap()); // the file stays, nobody listens
        let err = attach_profiler(&DiagnosticsSocket { path }, &agent, &[], Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("exited"), "{err}");

        let path = dir.path().join("dotnet-diagnostic-4245-1-socket");
        let listener = UnixListener::bind(&path).unwrap();
        let server = thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut header = [0u8; HEADER_LEN];
            conn.read_exact(&mut header).unwrap();
        });
        let err = attach_profiler(&DiagnosticsSocket { path }, &agent, &[], Duration::from_secs(1)).unwrap_err();
        server.join().unwrap();
        assert!(err.to_string().contains("closed the diagnostics connection"), "{err}");
    }

    #[test]
    fn attach_refuses_a_relative_agent_path() {
        let socket = DiagnosticsSocket { path: PathBuf::from("/nonexistent/dotnet-diagnostic-1-1-socket") };
        let err = attach_profiler(&socket, Path::new("agent.so"), &[], Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("absolute"), "{err}");
    }

    #[test]
    fn find_socket_on_a_missing_process() {
        let err = find_socket(4_000_000).unwrap_err().to_string();
        assert!(err.contains("no process with pid 4000000"), "{err}");
    }

    #[test]
    fn find_socket_on_a_process_without_dotnet() {
        // The test binary itself: no runtime, and (almost surely) no socket.
        let err = find_socket(std::process::id()).unwrap_err().to_string();
        assert!(err.contains("not a .NET"), "{err}");
    }

    #[test]
    fn sockets_of_other_users_are_refused_unless_root() {
        check_owner(1, 1000, 1000).unwrap();
        check_owner(1, 1000, 0).unwrap();
        let err = check_owner(12, 0, 1000).unwrap_err().to_string();
        assert!(err.contains("the diagnostics socket of process 12 belongs to user root (uid 0)"), "{err}");
        assert!(err.contains("run corsnap as that user"), "{err}");
    }

    /// A child process we can point at: `sleep` with a chosen environment.
    struct Sleeper(std::process::Child);

    impl Sleeper {
        fn start(env: &[(&str, &Path)]) -> Sleeper {
            let mut command = std::process::Command::new("sleep");
            command.arg("30");
            for (k, v) in env {
                command.env(k, v);
            }
            Sleeper(command.spawn().unwrap())
        }

        /// Waits until the child runs `sleep` with its new environment: the
        /// kernel renames the process before it sets up the environment
        /// block, which reads as empty in between.
        fn wait_for_exec(&self) {
            let pid = self.0.id();
            loop {
                let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
                let environ = fs::read(format!("/proc/{pid}/environ")).unwrap();
                if stat.contains("(sleep)") && !environ.is_empty() {
                    return;
                }
                thread::sleep(Duration::from_millis(5));
            }
        }
    }

    impl Drop for Sleeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn find_socket_looks_in_the_targets_tmpdir() {
        let dir = tempfile::tempdir().unwrap();
        let child = Sleeper::start(&[("TMPDIR", dir.path())]);
        let pid = child.0.id();
        child.wait_for_exec();
        let stat_key = parse_start_time(&fs::read_to_string(format!("/proc/{pid}/stat")).unwrap()).unwrap();
        let stale = dir.path().join(format!("dotnet-diagnostic-{pid}-1-socket"));
        let live = dir.path().join(format!("dotnet-diagnostic-{pid}-{stat_key}-socket"));
        let _live = UnixListener::bind(&live).unwrap();
        thread::sleep(Duration::from_millis(20));
        let _stale = UnixListener::bind(&stale).unwrap();
        assert_eq!(find_socket(pid).unwrap(), DiagnosticsSocket { path: live });
    }

    #[test]
    fn a_socket_left_by_an_earlier_process_with_the_same_pid_is_not_the_targets() {
        let dir = tempfile::tempdir().unwrap();
        let child = Sleeper::start(&[("TMPDIR", dir.path())]);
        let pid = child.0.id();
        child.wait_for_exec();
        let stat_key = parse_start_time(&fs::read_to_string(format!("/proc/{pid}/stat")).unwrap()).unwrap();
        let _stale =
            UnixListener::bind(dir.path().join(format!("dotnet-diagnostic-{pid}-{}-socket", stat_key - 1))).unwrap();
        let err = find_socket(pid).unwrap_err().to_string();
        assert!(err.contains("not a .NET"), "{err}");
    }

    #[test]
    fn find_socket_names_the_setting_that_disabled_diagnostics() {
        let child = Sleeper::start(&[("DOTNET_EnableDiagnostics", Path::new("0"))]);
        let pid = child.0.id();
        child.wait_for_exec();
        let err = find_socket(pid).unwrap_err().to_string();
        assert!(err.contains(&format!("process {pid} runs with DOTNET_EnableDiagnostics=0")), "{err}");
        assert!(err.contains("restart it without that setting"), "{err}");
    }

    #[test]
    fn sockets_are_matched_by_name_and_the_live_one_chosen() {
        let dir = tempfile::tempdir().unwrap();
        let _old = UnixListener::bind(dir.path().join("dotnet-diagnostic-77-100-socket")).unwrap();
        thread::sleep(Duration::from_millis(20));
        let _new = UnixListener::bind(dir.path().join("dotnet-diagnostic-77-200-socket")).unwrap();
        // Not ours: another pid with the same prefix digits, and a plain file.
        let _other = UnixListener::bind(dir.path().join("dotnet-diagnostic-778-300-socket")).unwrap();
        fs::write(dir.path().join("dotnet-diagnostic-77-400-socket"), b"").unwrap();

        let names = |found: &[FoundSocket]| {
            let mut n: Vec<String> =
                found.iter().map(|s| s.path.file_name().unwrap().to_string_lossy().into_owned()).collect();
            n.sort();
            n
        };
        let found = list_sockets(dir.path(), 77).unwrap();
        assert_eq!(names(&found), ["dotnet-diagnostic-77-100-socket", "dotnet-diagnostic-77-200-socket"]);

        let newest = choose_socket(list_sockets(dir.path(), 77).unwrap(), None).unwrap();
        assert!(newest.path.ends_with("dotnet-diagnostic-77-200-socket"));
        let by_key = choose_socket(list_sockets(dir.path(), 77).unwrap(), Some(100)).unwrap();
        assert!(by_key.path.ends_with("dotnet-diagnostic-77-100-socket"));
        // A process that started after both sockets were made owns neither.
        assert!(choose_socket(list_sockets(dir.path(), 77).unwrap(), Some(999)).is_none());
        // A start time matching none, but before a key, keeps the fallback
        // to the newest that may be its own.
        let unknown_key = choose_socket(list_sockets(dir.path(), 77).unwrap(), Some(150)).unwrap();
        assert!(unknown_key.path.ends_with("dotnet-diagnostic-77-200-socket"));
        assert!(choose_socket(Vec::new(), None).is_none());

        // The same directory seen twice yields each socket once.
        let mut twice = list_sockets(dir.path(), 77).unwrap();
        twice.extend(list_sockets(dir.path(), 77).unwrap());
        let chosen = choose_socket(twice, Some(100)).unwrap();
        assert!(chosen.path.ends_with("dotnet-diagnostic-77-100-socket"));
    }

    #[test]
    fn proc_files_are_parsed() {
        let stat = "1234 (my (weird) app) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 9 0 987654 123 45";
        assert_eq!(parse_start_time(stat), Some(987_654));
        assert_eq!(parse_start_time("garbage"), None);

        assert_eq!(parse_ns_pid("Name:\tx\nNSpid:\t4321\t7\nPPid:\t1\n"), Some(7));
        assert_eq!(parse_ns_pid("NSpid:\t4321\n"), Some(4321));
        assert_eq!(parse_ns_pid("Name:\tx\n"), None);

        assert_eq!(target_tmpdir(b"A=1\0TMPDIR=/run/t\0B=2\0"), PathBuf::from("/run/t"));
        assert_eq!(target_tmpdir(b"A=1\0MYTMPDIR=/x\0"), PathBuf::from("/tmp"));
        assert_eq!(target_tmpdir(b"TMPDIR=\0"), PathBuf::from("/tmp"));

        assert_eq!(
            diagnostics_disabled_by(b"X=1\0DOTNET_EnableDiagnostics=0\0"),
            Some("DOTNET_EnableDiagnostics=0".to_string())
        );
        assert_eq!(
            diagnostics_disabled_by(b"COMPlus_EnableDiagnostics=0\0"),
            Some("COMPlus_EnableDiagnostics=0".to_string())
        );
        assert_eq!(diagnostics_disabled_by(b"DOTNET_EnableDiagnostics=1\0COMPlus_EnableDiagnostics=0\0"), None);
        assert_eq!(diagnostics_disabled_by(b"DOTNET_EnableDiagnostics=1\0"), None);
        assert_eq!(
            diagnostics_disabled_by(b"DOTNET_EnableDiagnostics_IPC=0\0"),
            Some("DOTNET_EnableDiagnostics_IPC=0".to_string())
        );
    }

    #[test]
    fn socket_pid_comes_from_the_name_or_the_proc_prefix() {
        let plain = DiagnosticsSocket { path: PathBuf::from("/tmp/dotnet-diagnostic-42-99-socket") };
        assert_eq!(plain.pid(), Some(42));
        let through_proc =
            DiagnosticsSocket { path: PathBuf::from("/proc/5000/root/tmp/dotnet-diagnostic-7-99-socket") };
        assert_eq!(through_proc.pid(), Some(5000));
        let odd = DiagnosticsSocket { path: PathBuf::from("/tmp/custom.sock") };
        assert_eq!(odd.describe_process(), "the target process");
    }

    #[test]
    fn failures_are_explained_with_their_code() {
        let cases = [
            (hr::CORPROF_E_PROFILER_ALREADY_ACTIVE, "another profiler"),
            (hr::DIAGIPC_E_UNKNOWN_COMMAND, ".NET Core 3.0 or later"),
            (hr::CORPROF_E_PROFILER_NOT_ATTACHABLE, "declined to be attached"),
            (hr::CORPROF_E_RUNTIME_UNINITIALIZED, "starting up"),
            (hr::CORPROF_E_NOT_YET_AVAILABLE, "starting up"),
            (hr::DIAGIPC_E_NOT_SUPPORTED, "does not support"),
            (HR_MOD_NOT_FOUND, "could not load the agent"),
            (hr::E_FAIL, "refused"),
            (0x8013_9999_u32 as i32, "refused"),
        ];
        for (code, words) in cases {
            let text = explain_attach_failure(code);
            assert!(text.contains(words), "{text}");
            assert!(text.contains(&format!("0x{:08X}", code as u32)), "{text}");
        }
        assert!(explain_attach_failure(hr::DIAGIPC_E_UNKNOWN_COMMAND).contains("DS_IPC_E_UNKNOWN_COMMAND"));
    }
}
