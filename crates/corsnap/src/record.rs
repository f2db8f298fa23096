//! `corsnap record -- <program>`: run a program with the agent loaded and
//! turn what it sends into a profile.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use corsnap_profile::ProfileBuilder;
use corsnap_wire::{Message, Severity};

use crate::output::{OutputFile, OutputFormat};
use crate::session::{Event, Listener};

/// The agent library's file name, looked for next to the `corsnap` binary.
pub const AGENT_FILE_NAME: &str = "libcorsnap_agent.so";
/// Overrides where the agent library is found.
pub const ENV_AGENT_PATH: &str = "CORSNAP_AGENT";

#[derive(Debug, Clone)]
pub struct RecordOptions {
    pub program: Vec<OsString>,
    pub output: Option<PathBuf>,
    pub format: OutputFormat,
    pub rate_hz: u32,
    pub duration: Option<Duration>,
    pub threads: bool,
    pub agent_log: Option<PathBuf>,
    pub agent_path: Option<PathBuf>,
    /// Print the agent's own cost (per-tick suspend, walk, resume) at the end.
    pub stats: bool,
}

pub fn run(options: &RecordOptions) -> Result<ExitCode> {
    let agent = find_agent(options.agent_path.as_deref())?;
    let program = options.program.first().context("no program given: corsnap record -- dotnet app.dll")?;
    let output_path = options.output.clone().unwrap_or_else(|| default_output_name(program, options.format));
    let output = OutputFile::create(&output_path)?;
    let listener = Listener::new()?;

    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        // The program gets the terminal's Ctrl-C too; we only stop recording.
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)).context("installing the Ctrl-C handler")?;
    }

    let mut command = Command::new(program);
    command
        .args(&options.program[1..])
        .env("CORECLR_ENABLE_PROFILING", "1")
        .env("CORECLR_PROFILER", corsnap_wire::AGENT_CLSID)
        .env("CORECLR_PROFILER_PATH", &agent)
        .env(corsnap_wire::ENV_SOCKET, listener.socket_path())
        .env(corsnap_wire::ENV_RATE, options.rate_hz.to_string());
    if let Some(log) = &options.agent_log {
        command.env(corsnap_wire::ENV_LOG, absolute(log));
    }
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_file(&output_path);
            bail!("cannot run {}: {e}", program.to_string_lossy());
        }
    };
    let command_line = options.program.iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
    let started = Instant::now();

    let mut exited: Option<ExitStatus> = None;
    let connection = listener.accept_from(child.id(), || {
        if interrupted.load(Ordering::SeqCst) {
            return Some("interrupted before the program loaded the agent".to_string());
        }
        match child.try_wait() {
            Ok(Some(status)) => {
                exited = Some(status);
                Some(format!(
                    "{} exited ({}) without loading the corsnap agent. corsnap profiles .NET programs on \
                     .NET Core 3.0 or later (e.g. `corsnap record -- dotnet app.dll`); if this is one, check that \
                     nothing in its environment turns profiling off (CORECLR_ENABLE_PROFILING=0) and that \
                     {} is readable",
                    program.to_string_lossy(),
                    describe_status(status),
                    agent.display()
                ))
            }
            _ => None,
        }
    });
    let connection = match connection {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_file(&output_path);
            if exited.is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
            return Err(e);
        }
    };

    let mut builder = ProfileBuilder::new();
    let recording = Message::Recording { command: command_line, start_unix_ms: unix_ms() };
    builder.apply(&recording);
    let mut raw = match options.format {
        OutputFormat::Raw => Some(RawRecorder::new(output.path.clone(), &recording)?),
        OutputFormat::Rendered(_) => None,
    };
    let mut status = StatusLine::new();
    let mut agent_failed: Option<String> = None;

    let stop_reason = loop {
        if let Some(event) = connection.next_event(Duration::from_millis(100)) {
            match event {
                Event::Message(msg) => {
                    if let Some(raw) = raw.as_mut() {
                        raw.record(&msg)?;
                    }
                    builder.apply(&msg);
                    for (severity, text) in builder.take_notices() {
                        status.clear();
                        match severity {
                            Severity::Error => {
                                eprintln!("corsnap: error: {text}");
                                agent_failed = Some(text);
                            }
                            Severity::Warning => eprintln!("corsnap: warning: {text}"),
                            Severity::Info => eprintln!("corsnap: {text}"),
                        }
                    }
                    if let Message::Goodbye { reason } = &msg {
                        break reason.clone();
                    }
                }
                Event::Closed(None) => break "the program exited".to_string(),
                Event::Closed(Some(e)) => break format!("the connection to the agent failed: {e}"),
            }
        }
        if exited.is_none() {
            exited = child.try_wait().ok().flatten();
        }
        if interrupted.load(Ordering::SeqCst) {
            break "interrupted".to_string();
        }
        if options.duration.is_some_and(|d| started.elapsed() >= d) {
            break "duration reached".to_string();
        }
        status.show(started.elapsed(), builder.sample_count(), builder.thread_count());
    };
    connection.close();
    status.clear();

    if !builder.saw_hello() {
        let _ = std::fs::remove_file(&output.path);
        let why = agent_failed.unwrap_or_else(|| format!("the agent stopped before sampling ({stop_reason})"));
        let code = wait_for(&mut child, exited);
        eprintln!("corsnap: nothing was recorded: {why}");
        return Ok(code.max_failure());
    }

    let samples = builder.sample_count();
    let threads = builder.thread_count();
    let agent_stats = builder.stats();
    match (options.format, raw) {
        (OutputFormat::Raw, Some(raw)) => raw.finish(output)?,
        (OutputFormat::Rendered(format), _) => output.write_profile(&builder.finish(), format, options.threads)?,
        (OutputFormat::Raw, None) => unreachable!("raw output always has a recorder"),
    }
    eprintln!(
        "corsnap: wrote {} ({samples} samples from {threads} threads; recording ended: {stop_reason})",
        output_path.display()
    );
    if let (true, Some(stats)) = (options.stats, agent_stats) {
        eprintln!("corsnap: {}", describe_stats(&stats));
    }
    if samples == 0 {
        eprintln!(
            "corsnap: warning: no samples were recorded (did the program run long enough at {} Hz?)",
            options.rate_hz
        );
    }
    if exited.is_none() && !interrupted.load(Ordering::SeqCst) && options.duration.is_some() {
        eprintln!("corsnap: recording stopped; waiting for the program to exit");
    }
    Ok(wait_for(&mut child, exited).into_exit_code())
}

/// One line about what sampling cost inside the program.
pub fn describe_stats(s: &corsnap_wire::SamplerStats) -> String {
    let us = |ns: u64| ns as f64 / 1000.0;
    let mean = |ns: u64| if s.ticks == 0 { 0.0 } else { us(ns) / s.ticks as f64 };
    format!(
        "agent: {} ticks ({} skipped); per tick median suspend {:.1} µs, walk {:.1} µs, resume {:.1} µs \
         (mean total {:.1} µs, p99 {:.1} µs, max {:.1} µs); sampler CPU {:.0} ms; {} stacks, {} walk errors, \
         {} truncated, {} names ({} unresolved)",
        s.ticks,
        s.skipped_ticks,
        us(s.suspend_p50_ns),
        us(s.walk_p50_ns),
        us(s.resume_p50_ns),
        mean(s.suspend_ns + s.walk_ns + s.resume_ns),
        us(s.tick_p99_ns),
        us(s.max_tick_ns),
        s.sampler_cpu_ns as f64 / 1e6,
        s.samples,
        s.walk_errors,
        s.truncated_stacks,
        s.names_resolved,
        s.name_failures
    )
}

/// The program's exit, passed through as ours.
#[derive(Debug, Clone, Copy)]
struct ProgramExit(i32);

impl ProgramExit {
    fn into_exit_code(self) -> ExitCode {
        ExitCode::from(self.0.clamp(0, 255) as u8)
    }
    /// Like `into_exit_code`, but never success: nothing was recorded.
    fn max_failure(self) -> ExitCode {
        if self.0 == 0 {
            ExitCode::from(2)
        } else {
            self.into_exit_code()
        }
    }
}

fn wait_for(child: &mut Child, already: Option<ExitStatus>) -> ProgramExit {
    let status = already.or_else(|| child.wait().ok());
    ProgramExit(status.map_or(1, exit_code_of))
}

fn exit_code_of(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn describe_status(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "unknown status".to_string(),
    }
}

fn find_agent(explicit: Option<&Path>) -> Result<PathBuf> {
    let candidate = match explicit {
        Some(p) => p.to_path_buf(),
        None => match std::env::var_os(ENV_AGENT_PATH) {
            Some(p) => PathBuf::from(p),
            None => {
                let exe = std::env::current_exe().context("locating the corsnap binary")?;
                exe.parent().map(|d| d.join(AGENT_FILE_NAME)).context("locating the corsnap binary's directory")?
            }
        },
    };
    if !candidate.is_file() {
        bail!(
            "cannot find the corsnap agent at {}: build it with `cargo build --release` (it is installed next to \
             the corsnap binary), or point {ENV_AGENT_PATH} at libcorsnap_agent.so",
            candidate.display()
        );
    }
    Ok(absolute(&candidate))
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// `corsnap-app-20261122-204501.svg`: the program's name (the `.dll` for
/// `dotnet app.dll`) and the local start time.
fn default_output_name(program: &OsString, format: OutputFormat) -> PathBuf {
    let name =
        Path::new(program).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "program".into());
    PathBuf::from(format!("corsnap-{name}-{}.{}", unix_ms() / 1000, format.extension()))
}

/// A live line on stderr while recording, only when stderr is a terminal.
struct StatusLine {
    enabled: bool,
    last: Option<Instant>,
    shown: bool,
}

impl StatusLine {
    fn new() -> Self {
        StatusLine { enabled: std::io::stderr().is_terminal(), last: None, shown: false }
    }

    fn show(&mut self, elapsed: Duration, samples: usize, threads: usize) {
        if !self.enabled || self.last.is_some_and(|t| t.elapsed() < Duration::from_millis(250)) {
            return;
        }
        self.last = Some(Instant::now());
        self.shown = true;
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r\x1b[Kcorsnap: recording {:.1}s, {samples} samples, {threads} threads (Ctrl-C to stop)",
            elapsed.as_secs_f64()
        );
        let _ = err.flush();
    }

    fn clear(&mut self) {
        if self.shown {
            let _ = write!(std::io::stderr(), "\r\x1b[K");
            self.shown = false;
        }
    }
}

/// Saves every message as it arrives, so `corsnap report` can render the
/// recording later in any format.
struct RawRecorder {
    path: PathBuf,
    buffer: Vec<u8>,
}

impl RawRecorder {
    fn new(path: PathBuf, recording: &Message) -> Result<Self> {
        let mut buffer = Vec::new();
        corsnap_wire::write_raw_header(&mut buffer)?;
        recording.encode_into(&mut buffer);
        Ok(RawRecorder { path, buffer })
    }

    fn record(&mut self, msg: &Message) -> Result<()> {
        msg.encode_into(&mut self.buffer);
        Ok(())
    }

    fn finish(self, output: OutputFile) -> Result<()> {
        let mut out = output.into_writer();
        out.write_all(&self.buffer)
            .and_then(|()| out.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}
