//! `corsnap record -- <program>`: run a program with the agent loaded and
//! turn what it sends into a profile.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use corsnap_profile::{NativeFrames, ProfileBuilder};
use corsnap_wire::{AttachRequest, Command as AgentCommand, EventKind, Message, SamplerKind, Severity, WalkerKind};

use crate::output::{OutputFile, OutputFormat, Outputs};
use crate::session::{AgentConnection, Event, Listener};

/// The agent library's file name, looked for next to the `corsnap` binary.
pub const AGENT_FILE_NAME: &str = "libcorsnap_agent.so";
/// Overrides where the agent library is found.
pub const ENV_AGENT_PATH: &str = "CORSNAP_AGENT";

/// What to record: a program corsnap starts, or a running process.
#[derive(Debug, Clone)]
pub enum Target {
    Launch(Vec<OsString>),
    Attach(u32),
}

#[derive(Debug, Clone)]
pub struct RecordOptions {
    pub target: Target,
    pub output: Option<PathBuf>,
    pub format: OutputFormat,
    pub rate_hz: u32,
    pub duration: Option<Duration>,
    pub threads: bool,
    pub agent_log: Option<PathBuf>,
    pub agent_path: Option<PathBuf>,
    /// Print the agent's own cost (per-tick suspend, walk, resume) at the end.
    pub stats: bool,
    /// What to record; each kind becomes its own profile.
    pub events: Vec<EventKind>,
    /// The pause budget, in parts per million of wall time.
    pub max_pause_ppm: u32,
    /// How CPU samples are taken.
    pub sampler: SamplerKind,
    /// The signal engine's clock: POSIX timers instead of perf events.
    pub timers: bool,
    /// How event stacks are walked.
    pub walker: WalkerKind,
    /// Whether native frames are shown one by one.
    pub native: NativeFrames,
    /// Whether the native frames below a thread's first managed frame fold into one.
    pub roots: corsnap_profile::RootFrames,
    /// Method names as the runtime gives them, not readable.
    pub raw_names: bool,
    /// Flame graph title (empty: the command).
    pub title: String,
    /// Icicle flame graphs.
    pub inverted: bool,
}

impl RecordOptions {
    pub fn write_options(&self) -> corsnap_profile::writers::WriteOptions {
        corsnap_profile::writers::WriteOptions {
            threads: self.threads,
            title: self.title.clone(),
            inverted: self.inverted,
            raw_names: self.raw_names,
        }
    }
}

/// The collections, as totals per generation and a list.
pub fn describe_gcs(gcs: &[corsnap_profile::GcRecord]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let ms = |ns: u64| ns as f64 / 1e6;
    let _ = writeln!(
        out,
        "corsnap: {} garbage collections, {:.2} ms paused in all",
        gcs.len(),
        ms(gcs.iter().map(|g| g.pause_ns).sum())
    );
    for generation in 0..=2 {
        let of_gen: Vec<_> = gcs.iter().filter(|g| g.generation == generation).collect();
        if !of_gen.is_empty() {
            let total: u64 = of_gen.iter().map(|g| g.pause_ns).sum();
            let max = of_gen.iter().map(|g| g.pause_ns).max().unwrap_or(0);
            let _ = writeln!(
                out,
                "corsnap:   gen{generation}: {} collections, {:.2} ms total, {:.2} ms longest",
                of_gen.len(),
                ms(total),
                ms(max)
            );
        }
    }
    for (i, g) in gcs.iter().enumerate().take(50) {
        let reason = if g.reason == 1 { "induced" } else { "allocation" };
        let _ = writeln!(
            out,
            "corsnap:   #{:<3} at {:>9.3} s  gen{}  {reason:<10}  {:.3} ms",
            i + 1,
            g.time_ns as f64 / 1e9,
            g.generation,
            ms(g.pause_ns)
        );
    }
    if gcs.len() > 50 {
        let _ = writeln!(out, "corsnap:   ... and {} more", gcs.len() - 50);
    }
    out
}

/// The process being recorded, and how it ends.
pub(crate) enum Process {
    Child { child: Child, exited: Option<ExitStatus> },
    Attached { pid: u32 },
}

impl Process {
    /// Ends a program corsnap started (SIGTERM) and waits for it: its exit
    /// code. An attached process is left running.
    pub(crate) fn end_and_wait(&mut self) -> ExitCode {
        match self {
            Process::Child { child, exited } => {
                if exited.is_none() && child.try_wait().ok().flatten().is_none() {
                    let _ = corsnap_abi::os::send_signal(child.id(), 15);
                }
                wait_for(child, *exited).into_exit_code()
            }
            Process::Attached { .. } => ExitCode::SUCCESS,
        }
    }

    /// Waits for a program corsnap started that is ending by itself: its
    /// exit code. An attached process is left running.
    pub(crate) fn wait(&mut self) -> ExitCode {
        match self {
            Process::Child { child, exited } => wait_for(child, *exited).into_exit_code(),
            Process::Attached { .. } => ExitCode::SUCCESS,
        }
    }

    /// How a process that has ended ended: "the program exited (exit code
    /// 3)", "the program was killed by SIGKILL (signal 9)".
    fn describe_end(&mut self) -> String {
        match self {
            Process::Child { exited: Some(status), .. } => {
                use std::os::unix::process::ExitStatusExt;
                match status.signal() {
                    Some(signal) => format!("the program was killed by {}", signal_name(signal)),
                    None => format!("the program exited ({})", describe_status(*status)),
                }
            }
            Process::Child { .. } => "the program exited".to_string(),
            Process::Attached { .. } => "the process exited".to_string(),
        }
    }

    /// Whether the process has ended (reaping a child that has).
    fn has_exited(&mut self) -> bool {
        match self {
            Process::Child { child, exited } => {
                if exited.is_none() {
                    *exited = child.try_wait().ok().flatten();
                }
                exited.is_some()
            }
            Process::Attached { pid } => !Path::new(&format!("/proc/{pid}")).exists(),
        }
    }
}

/// The signals that stop a recording: SIGINT (Ctrl-C), SIGTERM (`timeout`,
/// `kill`, a service manager) and SIGHUP (a closed terminal). The first
/// stops recording and the profile is written; another, a second or more
/// later, exits at once (`corsnap_abi::os::install_stop_handlers`).
#[derive(Debug, Clone, Copy)]
pub struct StopSignals;

impl StopSignals {
    pub fn install() -> Result<StopSignals> {
        corsnap_abi::os::install_stop_handlers().context("installing signal handlers")?;
        Ok(StopSignals)
    }

    pub fn stopped(&self) -> bool {
        corsnap_abi::os::stop_requested().is_some()
    }

    /// Why recording stopped, and the signal to pass on to a program corsnap
    /// started (Ctrl-C reaches it from the terminal by itself).
    pub fn reason(&self) -> (&'static str, Option<i32>) {
        match corsnap_abi::os::stop_requested() {
            Some(15) => ("SIGTERM", Some(15)),
            Some(1) => ("SIGHUP", Some(1)),
            _ => ("interrupted", None),
        }
    }
}

pub fn run(options: &RecordOptions) -> Result<ExitCode> {
    let invoked = Instant::now();
    if let Target::Launch(program) = &options.target {
        if let Some(first) = program.first() {
            if corsnap::native_aot::program_file(first).is_some_and(|f| corsnap::native_aot::is_native_aot(&f)) {
                return run_native_aot(program);
            }
        }
    }
    let agent = find_agent(options.agent_path.as_deref())?;
    let name = match &options.target {
        Target::Launch(program) => {
            program.first().context("no program given: corsnap record -- dotnet app.dll")?;
            program_name(program.iter().map(|a| a.to_string_lossy().into_owned()))
        }
        Target::Attach(pid) => {
            let command = process_command_line(*pid);
            format!("{}-pid{pid}", program_name(command.split(' ').map(str::to_string)))
        }
    };
    let output_path = crate::output::output_path(options.output.as_deref(), || {
        default_output_name(&name, options.format).to_string_lossy().into_owned()
    })?;
    if let Target::Attach(pid) = options.target {
        // Find the diagnostics socket before creating anything: a wrong pid
        // should cost nothing.
        crate::diagnostics::find_socket(pid)?;
    }
    let outputs = Outputs::create(&output_path, options.format, &options.events)?;
    // On any error from here on, dropping `outputs` removes its temporary
    // files: nothing is left under the output's name.
    let listener = Listener::new()?;
    let interrupted = StopSignals::install()?;
    let (mut process, mut connection, command_line) = match &options.target {
        Target::Launch(program) => match launch(program, &agent, &listener, options, &interrupted) {
            Ok(launched) => launched,
            Err(e) => {
                if let Some(early) = e.downcast_ref::<ProgramEndedEarly>() {
                    if !early.reported {
                        eprintln!("corsnap: error: {early}");
                    }
                    outputs.remove_all();
                    return Ok(ProgramExit(early.code).into_exit_code());
                }
                return Err(e);
            }
        },
        Target::Attach(pid) => {
            let request = AttachRequest {
                socket: listener.socket_path().to_string_lossy().into_owned(),
                rate_hz: options.rate_hz,
                events: EventKind::mask(&options.events),
                max_pause_ppm: options.max_pause_ppm,
                log: options.agent_log.as_deref().map(|p| absolute(p).to_string_lossy().into_owned()),
                sampler: options.sampler,
                timers: options.timers,
                walker: options.walker,
            };
            let connection = attach(*pid, &agent, &listener, &request)?;
            (Process::Attached { pid: *pid }, connection, process_command_line(*pid))
        }
    };
    let started = Instant::now();

    let mut builder = ProfileBuilder::new();
    builder.set_native_frames(options.native);
    builder.set_root_frames(options.roots);
    let recording = Message::Recording { command: command_line, start_unix_ms: unix_ms() };
    builder.apply(&recording);
    let mut raw = match options.format {
        OutputFormat::Raw => Some(RawRecorder::new(&recording)?),
        OutputFormat::Rendered(_) => None,
    };
    let mut status = StatusLine::new();
    let mut agent_failed: Option<String> = None;
    // Events the agent said it cannot record here (`--event alloc` on .NET
    // Core 3.1): they get no file.
    let mut refused: Vec<EventKind> = Vec::new();
    let mut on_message = |msg: &Message, builder: &mut ProfileBuilder, status: &mut StatusLine| {
        if let Some(raw) = raw.as_mut() {
            raw.record(msg);
        }
        builder.apply(msg);
        for (severity, text) in builder.take_notices() {
            status.clear();
            match severity {
                Severity::Error => {
                    eprintln!("corsnap: error: {text}");
                    agent_failed = Some(text);
                }
                Severity::Warning => {
                    if let Some(kind) = refused_event(&text) {
                        refused.push(kind);
                    }
                    eprintln!("corsnap: warning: {text}")
                }
                Severity::Info => eprintln!("corsnap: {text}"),
            }
        }
    };

    let mut agent_gone = false;
    let mut first_sample: Option<Duration> = None;
    let stop_reason = loop {
        if let Some(event) = connection.next_event(Duration::from_millis(100)) {
            match event {
                Event::Message(msg) => {
                    if first_sample.is_none() && matches!(msg, Message::Sample { .. }) {
                        first_sample = Some(invoked.elapsed());
                    }
                    on_message(&msg, &mut builder, &mut status);
                    if let Message::Goodbye { reason } = &msg {
                        agent_gone = true;
                        // Ctrl-C reaches the program too, whose runtime then
                        // shuts down and says goodbye: the user interrupted.
                        if interrupted.stopped() {
                            break interrupted.reason().0.to_string();
                        }
                        break reason.clone();
                    }
                }
                Event::Closed(e) => {
                    agent_gone = true;
                    if interrupted.stopped() {
                        // The program often ends first on the same signal
                        // (`timeout` signals the whole group; .NET stops on
                        // SIGTERM): the signal is why recording stopped.
                        break interrupted.reason().0.to_string();
                    }
                    // A program that exits closes the connection a moment
                    // before its exit is visible.
                    let closed = Instant::now();
                    while e.is_none()
                        && !process.has_exited()
                        && !interrupted.stopped()
                        && closed.elapsed() < Duration::from_secs(1)
                    {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    if interrupted.stopped() {
                        break interrupted.reason().0.to_string();
                    }
                    break match e {
                        None if process.has_exited() => process.describe_end(),
                        None => "the agent closed the connection".to_string(),
                        Some(e) => format!("the connection to the agent failed: {e}"),
                    };
                }
            }
        }
        if interrupted.stopped() {
            let (why, forward) = interrupted.reason();
            if let (Some(signal), Process::Child { child, exited: None }) = (forward, &process) {
                // corsnap stands in for the program: it gets the signal too.
                let _ = corsnap_abi::os::send_signal(child.id(), signal);
            }
            break why.to_string();
        }
        if options.duration.is_some_and(|d| started.elapsed() >= d) {
            break "duration reached".to_string();
        }
        if matches!(process, Process::Attached { .. }) && process.has_exited() {
            // Drain what the agent sent before the process died.
            while let Some(Event::Message(msg)) = connection.next_event(Duration::from_millis(200)) {
                on_message(&msg, &mut builder, &mut status);
            }
            agent_gone = true;
            break "the process exited".to_string();
        }
        status.show(started.elapsed(), options.duration, builder.sample_count(), builder.thread_count());
    };
    let stopped_at = invoked.elapsed();
    if !agent_gone {
        // Ask the agent to leave, and take what it sends on its way out.
        let _ = connection.send_command(AgentCommand::Detach);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            match connection.next_event(Duration::from_millis(100)) {
                Some(Event::Message(msg)) => {
                    let bye = matches!(msg, Message::Goodbye { .. });
                    on_message(&msg, &mut builder, &mut status);
                    if bye {
                        break;
                    }
                }
                Some(Event::Closed(_)) => break,
                None => {}
            }
        }
    }
    let goodbye_at = invoked.elapsed();
    connection.close();
    status.clear();

    if !builder.saw_hello() {
        outputs.remove_all();
        let why = agent_failed.unwrap_or_else(|| format!("the agent stopped before sampling ({stop_reason})"));
        eprintln!("corsnap: nothing was recorded: {why}");
        return Ok(match &mut process {
            Process::Child { child, exited } => wait_for(child, *exited).max_failure(),
            Process::Attached { .. } => ExitCode::from(2),
        });
    }

    if !options.events.is_empty() && options.events.iter().all(|k| refused.contains(k)) {
        // The agent has said why (one warning); an empty file would only
        // hide it.
        outputs.remove_all();
        eprintln!("corsnap: no profile written: nothing that was asked for can be recorded in this runtime");
        return Ok(match &mut process {
            Process::Child { child, exited } => wait_for(child, *exited).max_failure(),
            Process::Attached { .. } => ExitCode::from(2),
        });
    }
    let samples = builder.sample_count();
    let threads = builder.thread_count();
    let agent_stats = builder.stats();
    let paths = outputs.kept(&refused);
    let skipped = outputs.skipped(&refused);
    let profile = builder.finish();
    match raw {
        Some(raw) => raw.finish(outputs.into_single())?,
        None => outputs.write(&profile, &options.write_options(), &refused)?,
    }
    if !skipped.is_empty() {
        eprintln!("corsnap: not written (nothing could be recorded for it): {}", skipped.join(", "));
    }
    eprintln!(
        "corsnap: wrote {} ({} from {}; recording ended: {stop_reason})",
        paths.join(", "),
        plural(samples, "sample"),
        plural(threads, "thread")
    );
    if options.events.contains(&EventKind::Gc) {
        eprint!("{}", describe_gcs(&profile.gcs));
    }
    if let Some(stats) = agent_stats.filter(|s| s.throttled_ticks > 0) {
        eprintln!(
            "corsnap: note: {} of {} ticks were skipped because the runtime was slow to stop (some phases of a \
             program are, start-up above all) and pauses are kept under {}% of the time; those moments are \
             sampled less. --max-pause raises the limit.",
            stats.throttled_ticks,
            stats.throttled_ticks + stats.ticks,
            f64::from(options.max_pause_ppm) / 10_000.0
        );
    }
    if let (true, Some(stats)) = (options.stats, agent_stats) {
        eprintln!("corsnap: {}", describe_stats(&stats));
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        eprintln!(
            "corsnap: timing: first sample {}; recording stopped at {:.1} ms; agent gone from the connection {:.1} ms \
             later",
            first_sample.map_or("none".to_string(), |d| format!("{:.1} ms after start", ms(d))),
            ms(stopped_at),
            ms(goodbye_at) - ms(stopped_at)
        );
    }
    if samples == 0 {
        eprintln!(
            "corsnap: warning: no samples were recorded (did the program run long enough at {} Hz?)",
            options.rate_hz
        );
    }
    match &mut process {
        Process::Child { child, exited } => {
            if exited.is_none() && !interrupted.stopped() && options.duration.is_some() {
                eprintln!("corsnap: recording stopped; waiting for the program to exit");
            }
            let status = exited.or_else(|| child.wait().ok());
            if let Some(signal) = status.and_then(|s| std::os::unix::process::ExitStatusExt::signal(&s)) {
                // Unless the user stopped it (Ctrl-C, or a signal corsnap passed on).
                if !interrupted.stopped() && !stop_reason.contains("killed by") {
                    eprintln!("corsnap: the program was killed by {}", signal_name(signal));
                }
            }
            Ok(wait_for(child, status).into_exit_code())
        }
        Process::Attached { .. } => Ok(ExitCode::SUCCESS),
    }
}

/// A native AOT program has no CLR to load the agent: corsnap says so and
/// becomes the program (`exec`), so its stdio, signals and exit code are
/// its own, and nothing is written.
fn run_native_aot(program: &[OsString]) -> Result<ExitCode> {
    use std::os::unix::process::CommandExt;
    let first = &program[0];
    eprintln!("corsnap: {}; running it without profiling", corsnap::native_aot::message(&first.to_string_lossy()));
    let e = Command::new(first).args(&program[1..]).exec();
    Err(e).with_context(|| format!("cannot run {}", first.to_string_lossy()))
}

/// Starts `program` with the agent loaded at start-up and waits for it to
/// connect.
fn launch(
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
        .env(corsnap_wire::ENV_RATE, options.rate_hz.to_string());
    command.env(corsnap_wire::ENV_EVENTS, EventKind::mask(&options.events).to_string());
    command.env(corsnap_wire::ENV_MAX_PAUSE, options.max_pause_ppm.to_string());
    command.env(corsnap_wire::ENV_SAMPLER, options.sampler.name());
    command.env(corsnap_wire::ENV_WALKER, options.walker.name());
    if options.timers {
        command.env(corsnap_wire::ENV_NO_PERF_EVENTS, "1");
    }
    if let Some(log) = &options.agent_log {
        command.env(corsnap_wire::ENV_LOG, absolute(log));
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

/// The event a notice of the agent says it cannot record (it starts
/// `--event alloc needs ...`), if any.
fn refused_event(notice: &str) -> Option<EventKind> {
    let rest = notice.strip_prefix("--event ")?;
    let word = rest.split(' ').next()?;
    EventKind::ALL.into_iter().find(|k| k.name() == word)
}

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

/// One line about what sampling cost inside the program.
pub fn describe_stats(s: &corsnap_wire::SamplerStats) -> String {
    let us = |ns: u64| ns as f64 / 1000.0;
    if s.engine == 1 {
        let suspend = if s.ticks > 0 {
            format!(
                "; wall ticks: {} (median suspend {:.1} µs, walk {:.1} µs)",
                s.ticks,
                us(s.suspend_p50_ns),
                us(s.walk_p50_ns)
            )
        } else {
            String::new()
        };
        return format!(
            "agent (signal engine): {} samples from {} threads now sampled, {} dropped; per sample in the handler \
             median {:.1} µs, p99 {:.1} µs; {} stacks incomplete, {} through code not yet learned, {} truncated; \
             agent thread CPU {:.0} ms; {} names ({} unresolved){suspend}",
            s.signal_samples,
            s.threads_sampled,
            s.signal_dropped,
            us(s.handler_p50_ns),
            us(s.handler_p99_ns),
            s.incomplete_stacks,
            s.unknown_code_stacks,
            s.truncated_stacks,
            s.sampler_cpu_ns as f64 / 1e6,
            s.names_resolved,
            s.name_failures,
        );
    }
    let mean = |ns: u64| if s.ticks == 0 { 0.0 } else { us(ns) / s.ticks as f64 };
    format!(
        "agent: {} ticks ({} skipped, {} throttled); per tick median suspend {:.1} µs, walk {:.1} µs, resume {:.1} µs \
         (mean total {:.1} µs, p99 {:.1} µs, max {:.1} µs); sampler CPU {:.0} ms; {} stacks, {} walk errors, \
         {} truncated, {} names ({} unresolved); {} cache resets, {} events dropped",
        s.ticks,
        s.skipped_ticks,
        s.throttled_ticks,
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
        s.name_failures,
        s.cache_resets,
        s.events_dropped
    )
}

/// `1 thread`, `2 threads`.
pub fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
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
        (None, Some(sig)) => format!("killed by {}", signal_name(sig)),
        _ => "unknown status".to_string(),
    }
}

/// `SIGKILL (signal 9)`.
pub fn signal_name(signal: i32) -> String {
    let name = match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        5 => "SIGTRAP",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        10 => "SIGUSR1",
        11 => "SIGSEGV",
        12 => "SIGUSR2",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        24 => "SIGXCPU",
        25 => "SIGXFSZ",
        27 => "SIGPROF",
        31 => "SIGSYS",
        _ => return format!("signal {signal}"),
    };
    format!("{name} (signal {signal})")
}

pub fn find_agent(explicit: Option<&Path>) -> Result<PathBuf> {
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

pub fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// `corsnap-Sarif.Multitool-2026-11-23_10-56-47.svg`: the program's name and
/// the local start time.
fn default_output_name(name: &str, format: OutputFormat) -> PathBuf {
    PathBuf::from(format!("corsnap-{name}-{}.{}", corsnap_abi::os::local_timestamp(), format.extension()))
}

/// What to call a program in a file name: for `dotnet app.dll`, `app`; else
/// the executable's whole file name (`Sarif.Multitool`), with `.dll` or
/// `.exe` taken off.
pub fn program_name(mut words: impl Iterator<Item = String>) -> String {
    let first = words.next().unwrap_or_default();
    let base = |w: &str| Path::new(w).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut name = base(&first);
    if name == "dotnet" {
        if let Some(dll) = words.find(|w| w.ends_with(".dll")) {
            name = base(&dll);
        }
    }
    for ext in [".dll", ".exe"] {
        if let Some(stripped) = name.strip_suffix(ext) {
            name = stripped.to_string();
        }
    }
    let name: String = name.chars().map(|c| if c.is_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect();
    if name.is_empty() {
        "program".to_string()
    } else {
        name
    }
}

/// A live line on stderr while recording, only when stderr is a terminal.
///
/// The program writes to the same terminal, and corsnap cannot see when: so
/// the line gets a row of its own. The terminal's scrolling region is set to
/// every row but the last, the program's output scrolls above, and the line
/// is drawn on the last row; the region is reset when recording ends. On a
/// terminal that does not say its size, the line is drawn in place as a
/// fallback.
struct StatusLine {
    enabled: bool,
    last: Option<Instant>,
    shown: bool,
    /// Rows of the terminal when the scrolling region was set.
    rows: Option<u16>,
}

impl StatusLine {
    fn new() -> Self {
        StatusLine { enabled: std::io::stderr().is_terminal(), last: None, shown: false, rows: None }
    }

    fn show(&mut self, elapsed: Duration, limit: Option<Duration>, samples: usize, threads: usize) {
        if !self.enabled || self.last.is_some_and(|t| t.elapsed() < Duration::from_millis(250)) {
            return;
        }
        self.last = Some(Instant::now());
        let time = match limit {
            Some(d) => format!("{:.1} s of {:.0} s", elapsed.as_secs_f64(), d.as_secs_f64()),
            None => format!("{:.1} s", elapsed.as_secs_f64()),
        };
        let text = format!(
            "corsnap: recording {time}, {}, {} (Ctrl-C to stop)",
            plural(samples, "sample"),
            plural(threads, "thread")
        );
        let mut err = std::io::stderr().lock();
        let rows = corsnap_abi::os::terminal_size(2).map(|(r, _)| r).filter(|&r| r >= 3);
        match rows {
            Some(rows) => {
                if self.rows != Some(rows) {
                    // Make room, then keep the last row for this line: save
                    // the cursor, set the region (which homes the cursor),
                    // put the cursor back.
                    if self.rows.is_none() {
                        let _ = write!(err, "\n\x1b[1A");
                    }
                    let _ = write!(err, "\x1b7\x1b[1;{}r\x1b8", rows - 1);
                    self.rows = Some(rows);
                }
                let _ = write!(err, "\x1b7\x1b[{rows};1H\x1b[2K{text}\x1b8");
            }
            None => {
                let _ = write!(err, "\r\x1b[K{text}");
            }
        }
        self.shown = true;
        let _ = err.flush();
    }

    fn clear(&mut self) {
        if !self.shown {
            return;
        }
        let mut err = std::io::stderr().lock();
        match self.rows.take() {
            Some(rows) => {
                let _ = write!(err, "\x1b7\x1b[r\x1b[{rows};1H\x1b[2K\x1b8");
            }
            None => {
                let _ = write!(err, "\r\x1b[K");
            }
        }
        let _ = err.flush();
        self.shown = false;
    }
}

/// Saves every message as it arrives, so `corsnap report` can render the
/// recording later in any format.
struct RawRecorder {
    buffer: Vec<u8>,
}

impl RawRecorder {
    fn new(recording: &Message) -> Result<Self> {
        let mut buffer = Vec::new();
        corsnap_wire::write_raw_header(&mut buffer)?;
        recording.encode_into(&mut buffer);
        Ok(RawRecorder { buffer })
    }

    fn record(&mut self, msg: &Message) {
        msg.encode_into(&mut self.buffer);
    }

    fn finish(self, output: OutputFile) -> Result<()> {
        output.write_with(|out| out.write_all(&self.buffer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(words: &[&str]) -> String {
        program_name(words.iter().map(|w| w.to_string()))
    }

    #[test]
    fn default_names_keep_the_whole_program_name() {
        assert_eq!(name(&["/opt/sarif/Sarif.Multitool", "analyze"]), "Sarif.Multitool");
        assert_eq!(name(&["/usr/bin/dotnet", "bin/Shop.Api.dll", "--port", "80"]), "Shop.Api");
        assert_eq!(name(&["dotnet", "exec", "app.dll"]), "app");
        assert_eq!(name(&["./My App.exe"]), "My_App");
        assert_eq!(name(&[]), "program");
        let path =
            default_output_name("Shop.Api", OutputFormat::Rendered(corsnap_profile::writers::Format::Flamegraph));
        let file = path.to_string_lossy();
        assert!(file.starts_with("corsnap-Shop.Api-20") && file.ends_with(".svg") && file.len() == 40, "{file}");
    }

    #[test]
    fn plurals_read_right() {
        assert_eq!(plural(1, "thread"), "1 thread");
        assert_eq!(plural(3, "thread"), "3 threads");
        assert_eq!(plural(0, "sample"), "0 samples");
    }
}
