//! Getting the agent into a process: starting a program with it loaded,
//! or attaching it to a running one over the diagnostics socket; and
//! finding the agent library.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use corsnap_wire::{AttachRequest, EventKind};

use super::process::{describe_status, exit_code_of, Process, StopSignals};
use super::RecordOptions;
use crate::session::{AgentConnection, Listener};

/// The agent library's file name, looked for next to the `corsnap` binary.
pub const AGENT_FILE_NAME: &str = "libcorsnap_agent.so";

/// Overrides where the agent library is found.
pub const ENV_AGENT_PATH: &str = "CORSNAP_AGENT";

/// A native AOT program has no CLR to load the agent: corsnap says so and
/// becomes the program (`exec`), so its stdio, signals and exit code are
/// its own, and nothing is written.
pub(super) fn run_native_aot(program: &[OsString]) -> Result<ExitCode> {
    use std::os::unix::process::CommandExt;
    let first = &program[0];
    eprintln!("corsnap: {}; running it without profiling", corsnap::native_aot::message(&first.to_string_lossy()));
    let e = Command::new(first).args(&program[1..]).exec();
    Err(e).with_context(|| format!("cannot run {}", first.to_string_lossy()))
}

/// Starts `program` with the agent loaded at start-up and waits for it to
/// connect.
pub(super) fn launch(
    program: &[OsString],
    agent: &Path,
    listener: &Listener,
    options: &RecordOptions,
    interrupted: &StopSignals,
) -> Result<(Process, AgentConnection, String)> {
    launch_with_output(program, agent, listener, options, interrupted, None)
}

/// [`launch`], with the program's stdout and stderr going to `output` when
/// given (`corsnap top` owns the terminal).
pub(crate) fn launch_with_output(
    program: &[OsString],
    agent: &Path,
    listener: &Listener,
    options: &RecordOptions,
    interrupted: &StopSignals,
    output: Option<&Path>,
) -> Result<(Process, AgentConnection, String)> {
    let first = &program[0];
    let mut command = Command::new(first);
    if let Some(path) = output {
        let file = std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?;
        command.stdout(file.try_clone()?).stderr(file);
    }
    command
        .args(&program[1..])
        .env("CORECLR_ENABLE_PROFILING", "1")
        .env("CORECLR_PROFILER", corsnap_wire::AGENT_CLSID)
        .env("CORECLR_PROFILER_PATH", agent)
        .env(corsnap_wire::ENV_SOCKET, listener.socket_path())
        .env(corsnap_wire::ENV_CLI_PID, std::process::id().to_string())
        .env(corsnap_wire::ENV_RATE, options.rate_hz.to_string());
    command.env(corsnap_wire::ENV_EVENTS, EventKind::mask(&options.events).to_string());
    command.env(corsnap_wire::ENV_MAX_PAUSE, options.max_pause_ppm.to_string());
    command.env(corsnap_wire::ENV_SAMPLER, options.sampler.name());
    command.env(corsnap_wire::ENV_WALKER, options.walker.name());
    command.env(corsnap_wire::ENV_CPU_CLOCK, options.clock.name());
    if options.subprocesses {
        command.env(corsnap_wire::ENV_SUBPROCESSES, "1");
    } else {
        // One inherited from a corsnap around this one would let the
        // program's children in.
        command.env_remove(corsnap_wire::ENV_SUBPROCESSES);
    }
    if let Some(log) = &options.agent_log {
        command.env(corsnap_wire::ENV_LOG, absolute(log));
    }
    if !options.symbol_dirs.is_empty() {
        let dirs: Vec<_> = options.symbol_dirs.iter().map(|d| d.to_string_lossy()).collect();
        command.env(corsnap_wire::ENV_SYMBOLS, dirs.join("\n"));
    }
    let mut child = command.spawn().with_context(|| format!("cannot run {}", first.to_string_lossy()))?;
    let command_line = program.iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
    let mut exited = None;
    let pid = child.id();
    let started = Instant::now();
    let mut runtime_seen = false;
    let mut last_look = started;
    let mut warned = false;
    let name = first.to_string_lossy().into_owned();
    // The executable the process runs, and whether it is native AOT: a
    // wrapper (a shell script) may exec one.
    let mut exe: Option<PathBuf> = None;
    let mut native_aot = false;
    let mut reported = false;
    let connection = listener.accept_from(pid, || {
        if interrupted.stopped() {
            return Some("interrupted before the program loaded the agent".to_string());
        }
        // Watch for the runtime: its library in the program's memory, or its
        // diagnostics socket (a single-file program has the runtime linked in).
        // A native AOT program has a diagnostics socket too: what it runs
        // is looked at first, and decides.
        if !runtime_seen && last_look.elapsed() >= Duration::from_millis(50) {
            last_look = Instant::now();
            let now = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
            if now.is_some() && now != exe {
                native_aot = corsnap::native_aot::process_is_native_aot(pid);
                exe = now;
                if native_aot && !reported {
                    reported = true;
                    warned = true;
                    let shown = exe.as_deref().map_or(name.clone(), |e| e.display().to_string());
                    eprintln!("corsnap: {}; it runs on without profiling", corsnap::native_aot::message(&shown));
                }
            }
            runtime_seen = !native_aot && runtime_started(pid);
        }
        match child.try_wait() {
            Ok(Some(status)) => {
                exited = Some(status);
                runtime_seen |= !native_aot && runtime_started(pid);
                Some(if native_aot && !runtime_seen {
                    let shown = exe.as_deref().map_or(name.clone(), |e| e.display().to_string());
                    format!(
                        "{} ({}): nothing was recorded",
                        corsnap::native_aot::message(&shown),
                        describe_status(status)
                    )
                } else if runtime_seen {
                    format!(
                        "{name} started the .NET runtime but exited ({}) before loading the corsnap agent: profiling \
                         may be switched off in its environment (CORECLR_ENABLE_PROFILING=0), the runtime may be older \
                         than .NET Core 3.0, or the agent failed to start (--agent-log FILE says why)",
                        describe_status(status)
                    )
                } else if Path::new(&name).file_name().is_some_and(|n| n == "dotnet") {
                    format!(
                        "the .NET host ({name}) exited ({}) before starting the runtime: see its message above",
                        describe_status(status)
                    )
                } else {
                    format!(
                        "{name} exited ({}) without starting the .NET runtime: corsnap profiles .NET programs \
                         (`corsnap record -- dotnet app.dll`, or a .NET application's own executable)",
                        describe_status(status)
                    )
                })
            }
            _ => {
                if !runtime_seen && !warned && started.elapsed() >= Duration::from_secs(2) {
                    warned = true;
                    eprintln!(
                        "corsnap: warning: {name} has not started the .NET runtime after 2 s; corsnap profiles .NET \
                         programs, and will start recording if it does"
                    );
                }
                None
            }
        }
    });
    match connection {
        Ok(c) => Ok((Process::Child { child, exited: None }, c, command_line)),
        Err(e) => match exited {
            // The program ran, and its exit code is the user's: pass it on.
            Some(status) => Err(ProgramEndedEarly {
                message: format!("{e:#}"),
                code: exit_code_of(status),
                reported: reported && native_aot,
            }
            .into()),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        },
    }
}

/// The program corsnap started ended before the agent connected; `code` is
/// its exit code, which corsnap exits with.
#[derive(Debug)]
pub struct ProgramEndedEarly {
    pub message: String,
    pub code: i32,
    /// Already said while it ran (a native AOT program): `record` need not
    /// say it again.
    pub reported: bool,
}

impl std::fmt::Display for ProgramEndedEarly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ProgramEndedEarly {}

/// Whether process `pid` has started the .NET runtime.
fn runtime_started(pid: u32) -> bool {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    maps.contains("libcoreclr.so") || maps.contains("libhostfxr.so") || crate::diagnostics::find_socket(pid).is_ok()
}

/// Attaches the agent to a running process through its diagnostics socket
/// and waits for it to connect back.
pub fn attach(pid: u32, agent: &Path, listener: &Listener, request: &AttachRequest) -> Result<AgentConnection> {
    let socket = crate::diagnostics::find_socket(pid)?;
    let client_data = request.encode();
    let agent_path = agent.to_path_buf();
    // The runtime answers the attach request only after the agent has
    // initialised, and the agent connects to us while initialising, so the
    // request runs on its own thread while this one accepts.
    let request_thread = std::thread::spawn(move || {
        crate::diagnostics::attach_profiler(&socket, &agent_path, &client_data, Duration::from_secs(10))
    });
    let mut answered: Option<Result<()>> = None;
    let mut request_thread = Some(request_thread);
    let connection = listener.accept_from(pid, || {
        if request_thread.as_ref().is_some_and(|t| t.is_finished()) {
            let result = request_thread
                .take()
                .map(|t| t.join().unwrap_or_else(|_| Err(anyhow::anyhow!("attach thread failed"))));
            match result {
                Some(Err(e)) => return Some(format!("{e:#}")),
                Some(Ok(())) => answered = Some(Ok(())),
                None => {}
            }
        }
        if answered.is_some() && !Path::new(&format!("/proc/{pid}")).exists() {
            return Some(format!("process {pid} exited while the agent was loading"));
        }
        None
    })?;
    if let Some(t) = request_thread {
        t.join().unwrap_or_else(|_| Err(anyhow::anyhow!("attach thread failed")))?;
    }
    Ok(connection)
}

/// `/proc/PID/cmdline`, for the recording's header.
pub fn process_command_line(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| format!("pid {pid}"))
}

/// The agent library to load: `--agent` (tests), `$CORSNAP_AGENT`, the
/// one beside the `corsnap` binary (a `cargo build` tree), or else the one
/// this binary carries, written out (`embedded_agent`).
pub fn find_agent(explicit: Option<&Path>) -> Result<PathBuf> {
    let named = explicit.map(Path::to_path_buf).or_else(|| std::env::var_os(ENV_AGENT_PATH).map(PathBuf::from));
    if let Some(candidate) = named {
        if !candidate.is_file() {
            bail!(
                "cannot find the corsnap agent at {} (named by {ENV_AGENT_PATH}): point it at a \
                 libcorsnap_agent.so, or unset it to use the agent inside corsnap",
                candidate.display()
            );
        }
        return Ok(absolute(&candidate));
    }
    let exe = std::env::current_exe().context("locating the corsnap binary")?;
    let beside = exe.parent().map(|d| d.join(AGENT_FILE_NAME)).context("locating the corsnap binary's directory")?;
    if beside.is_file() {
        return Ok(absolute(&beside));
    }
    if crate::embedded_agent::available() {
        return crate::embedded_agent::install();
    }
    bail!(
        "cannot find the corsnap agent at {}: this corsnap was built without its agent inside \
         (CORSNAP_EMBED_AGENT=0); build it with `cargo build --release`, or point {ENV_AGENT_PATH} at \
         libcorsnap_agent.so",
        beside.display()
    )
}

pub fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}
