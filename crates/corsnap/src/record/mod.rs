//! `corsnap record -- <program>`: run a program with the agent loaded and
//! turn what it sends into a profile.

mod children;
mod describe;
mod launch;
mod process;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use corsnap_profile::processes::ProcessProfiles;
use corsnap_profile::{NativeFrames, ProfileBuilder};
use corsnap_wire::{AttachRequest, Command as AgentCommand, EventKind, Message, SamplerKind, Severity, WalkerKind};

use self::children::ChildRecording;
use self::describe::StatusLine;
pub use self::describe::{describe_gcs, describe_stats, plural};
pub(crate) use self::launch::launch_with_output;
pub use self::launch::{absolute, attach, find_agent, process_command_line, ProgramEndedEarly};
use self::launch::{launch, run_native_aot};
pub(crate) use self::process::Process;
pub use self::process::{signal_name, StopSignals};
use self::process::{wait_for, ProgramExit};
use crate::continuous::files::RecordingFiles;
use crate::continuous::{Labels, Sink, Windows};
use crate::output::OutputFormat;
use crate::session::{Event, Listener};

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
    /// The signal engine's clock.
    pub clock: corsnap_wire::CpuClock,
    /// How event stacks are walked.
    pub walker: WalkerKind,
    /// Folders of native debug files (`--symbols`), absolute.
    pub symbol_dirs: Vec<PathBuf>,
    /// Whether native frames are shown one by one.
    pub native: NativeFrames,
    /// Whether the native frames below a thread's first managed frame fold into one.
    pub roots: corsnap_profile::RootFrames,
    /// Method names as the runtime gives them, not readable.
    pub raw_names: bool,
    /// Frames split by source line, named `Method (File.cs:42)`.
    pub lines: bool,
    /// Flame graph title (empty: the command).
    pub title: String,
    /// Icicle flame graphs.
    pub inverted: bool,
    /// `--interval`: cut the recording into windows sent to sinks.
    pub continuous: Option<ContinuousOptions>,
    /// Record the program's .NET child processes too.
    pub subprocesses: bool,
}

/// What continuous recording (`--interval`) was asked for.
#[derive(Debug, Clone)]
pub struct ContinuousOptions {
    pub interval: Duration,
    /// `--push URL`: Grafana Pyroscope.
    pub push: Option<String>,
    /// `--otlp URL`: OTLP profiles (experimental).
    pub otlp: Option<String>,
    /// `--service` [default: the program's name].
    pub service: Option<String>,
    pub labels: Vec<(String, String)>,
    pub auth: crate::continuous::upload::Auth,
}

/// How long the last window may take to reach its sinks once recording
/// has stopped: one request's time limit, and a little.
const FLUSH_LIMIT: Duration = Duration::from_secs(12);

/// Where the recording goes, checked before anything runs: the files `-o`
/// names, as one window; with `--interval`, windows to the sinks asked for.
fn windows_for(options: &RecordOptions, name: &str) -> Result<Windows> {
    let Some(continuous) = &options.continuous else {
        let path = crate::output::output_path(options.output.as_deref(), || {
            default_output_name(name, options.format).to_string_lossy().into_owned()
        })?;
        let files = RecordingFiles::create(&path, options.format, &options.events, options.write_options())?;
        return Ok(Windows::whole(vec![Box::new(files)]));
    };
    let (service, pid) = match &options.target {
        Target::Launch(_) => (name.to_string(), 0),
        Target::Attach(pid) => (program_name(process_command_line(*pid).split(' ').map(str::to_string)), *pid),
    };
    let service = continuous.service.clone().unwrap_or(service);
    use crate::continuous::{check_interval, files, otlp, pyroscope};
    check_interval(continuous.interval)?;
    if options.format == OutputFormat::Raw {
        anyhow::bail!(
            "-f raw cannot be cut into windows (a raw recording is one stream): with --interval choose pprof, \
             speedscope, collapsed or flamegraph"
        );
    }
    let labels = Labels::new(service, continuous.labels.clone());
    let mut sinks: Vec<Box<dyn Sink>> = Vec::new();
    let remote = continuous.push.is_some() || continuous.otlp.is_some();
    let pattern = match &options.output {
        Some(path) => Some(crate::output::output_path(Some(path), || {
            format!("corsnap-{name}-%t.{}", options.format.extension())
        })?),
        // With a backend and no -o, no files; with neither, files named by
        // window start.
        None if remote => None,
        None => Some(PathBuf::from(format!("corsnap-{name}-%t.{}", options.format.extension()))),
    };
    if let Some(pattern) = pattern {
        let pattern = files::FilePattern::parse(&pattern.to_string_lossy())?;
        if !pattern.varies() {
            eprintln!(
                "corsnap: note: -o {} has no %t or %n: each window replaces the last (add %n{{3}} for a ring of 3                  files)",
                pattern.as_str()
            );
        } else if !pattern.bounded() {
            eprintln!(
                "corsnap: note: -o {} makes a new file every window, without bound: %n{{MAX}} keeps a ring of MAX",
                pattern.as_str()
            );
        }
        sinks.push(Box::new(files::FileSink::new(pattern, options.format, options.write_options(), pid)?));
    }
    if let Some(url) = &continuous.push {
        sinks.push(Box::new(pyroscope::PyroscopeSink::new(
            url,
            &continuous.auth,
            labels.clone(),
            continuous.interval,
        )?));
    }
    if let Some(url) = &continuous.otlp {
        sinks.push(Box::new(otlp::OtlpSink::new(url, &continuous.auth, labels, continuous.interval)?));
    }
    Ok(Windows::every(continuous.interval, sinks))
}

impl RecordOptions {
    pub fn write_options(&self) -> corsnap_profile::writers::WriteOptions {
        corsnap_profile::writers::WriteOptions {
            threads: self.threads,
            title: self.title.clone(),
            inverted: self.inverted,
            raw_names: self.raw_names,
            lines: self.lines,
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
    if let Target::Attach(pid) = options.target {
        // Find the diagnostics socket before creating anything: a wrong pid
        // should cost nothing.
        crate::diagnostics::find_socket(pid)?;
    }
    let mut windows = windows_for(options, &name)?;
    // On any error from here on, dropping `windows` removes the temporary
    // files of its sinks: nothing is left under the output's name.
    let mut listener = match options.target {
        Target::Attach(pid) => Listener::for_process(pid)?,
        Target::Launch(_) => Listener::new()?,
    };
    if options.subprocesses {
        listener.share_with_descendants();
    }
    let interrupted = StopSignals::install()?;
    let (mut process, mut connection, command_line) = match &options.target {
        Target::Launch(program) => match launch(program, &agent, &listener, options, &interrupted) {
            Ok(launched) => launched,
            Err(e) => {
                if let Some(early) = e.downcast_ref::<ProgramEndedEarly>() {
                    if !early.reported {
                        eprintln!("corsnap: error: {early}");
                    }
                    windows.abandon();
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
                clock: options.clock,
                walker: options.walker,
                symbols: options.symbol_dirs.iter().map(|d| d.to_string_lossy().into_owned()).collect(),
            };
            let connection = attach(*pid, &agent, &listener, &request)?;
            (Process::Attached { pid: *pid }, connection, process_command_line(*pid))
        }
    };
    let started = Instant::now();
    let main_pid = match &process {
        Process::Child { child, .. } => child.id(),
        Process::Attached { pid } => *pid,
    };
    // With --subprocesses: the program's .NET child processes, each with
    // its connection and its own builder.
    let mut children: Vec<ChildRecording> = Vec::new();
    // The first window starts now, when sampling does.
    windows.restart_clock();
    if let Some(interval) = windows.interval() {
        eprintln!("corsnap: recording windows of {} s to {}", interval.as_secs_f64(), windows.describe().join(", "));
    }

    let mut builder = ProfileBuilder::new();
    builder.set_native_frames(options.native);
    builder.set_root_frames(options.roots);
    if crate::output::reads_pdbs(options.lines, options.format) {
        builder.set_source_locator(corsnap::source_lines::PdbLocator::boxed());
    }
    let mut status = StatusLine::new();
    let mut agent_failed: Option<String> = None;
    // `child`: the message came from a child process (--subprocesses), not
    // from the program corsnap started.
    let subprocesses = options.subprocesses;
    let mut on_message = |msg: &Message,
                          builder: &mut ProfileBuilder,
                          windows: &mut Windows,
                          status: &mut StatusLine,
                          child: Option<(u32, &str)>| {
        // With several processes, each message says whose it is (a raw
        // recording marks every change of process).
        let from = match child {
            Some(c) => Some(c),
            None if subprocesses => Some((main_pid, name.as_str())),
            None => None,
        };
        windows.message(from, msg);
        builder.apply(msg);
        for (severity, text) in builder.take_notices() {
            status.clear();
            if let Some((pid, child_name)) = child {
                // A child's trouble is its own: said, and the recording goes on.
                eprintln!("corsnap: process {pid} ({child_name}): {text}");
                continue;
            }
            match severity {
                Severity::Error => {
                    eprintln!("corsnap: error: {text}");
                    agent_failed = Some(text);
                }
                Severity::Warning => {
                    // `--event alloc` on .NET Core 3.1: no file for it.
                    if let Some(kind) = refused_event(&text) {
                        windows.refuse(kind);
                    }
                    eprintln!("corsnap: warning: {text}")
                }
                Severity::Info => eprintln!("corsnap: {text}"),
            }
        }
    };
    // The recording's header belongs to no one process: it comes first,
    // before any process is named.
    let recording = Message::Recording { command: command_line, start_unix_ms: unix_ms() };
    windows.message(None, &recording);
    builder.apply(&recording);

    let mut agent_gone = false;
    let mut first_sample: Option<Duration> = None;
    let stop_reason = loop {
        if subprocesses {
            while let Some((pid, connection)) = listener.accept_descendant(main_pid) {
                children.push(ChildRecording::new(pid, connection, options));
            }
            for c in children.iter_mut() {
                c.drain(Duration::ZERO, |msg, builder, pid, name| {
                    on_message(msg, builder, &mut windows, &mut status, Some((pid, name)))
                });
            }
        }
        if let Some(event) = connection.next_event(Duration::from_millis(100)) {
            match event {
                Event::Message(msg) => {
                    if first_sample.is_none() && matches!(msg, Message::Sample { .. }) {
                        first_sample = Some(invoked.elapsed());
                    }
                    on_message(&msg, &mut builder, &mut windows, &mut status, None);
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
                on_message(&msg, &mut builder, &mut windows, &mut status, None);
            }
            agent_gone = true;
            break "the process exited".to_string();
        }
        windows.tick(&mut builder);
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
                    on_message(&msg, &mut builder, &mut windows, &mut status, None);
                    if bye {
                        break;
                    }
                }
                Some(Event::Closed(_)) => break,
                None => {}
            }
        }
    }
    // The children still recording are asked to leave too (their programs
    // run on), and what they send on the way out is kept.
    for c in children.iter_mut().filter(|c| c.connection.is_some()) {
        c.detach();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while children.iter().any(|c| c.connection.is_some()) && Instant::now() < deadline {
        for c in children.iter_mut() {
            c.drain(Duration::from_millis(10), |msg, builder, pid, name| {
                on_message(msg, builder, &mut windows, &mut status, Some((pid, name)))
            });
        }
    }
    for c in children.iter_mut() {
        if let Some(connection) = c.connection.take() {
            connection.close();
        }
    }
    let goodbye_at = invoked.elapsed();
    connection.close();
    status.clear();

    if !builder.saw_hello() {
        windows.abandon();
        let why = agent_failed.unwrap_or_else(|| format!("the agent stopped before sampling ({stop_reason})"));
        eprintln!("corsnap: nothing was recorded: {why}");
        return Ok(match &mut process {
            Process::Child { child, exited } => wait_for(child, *exited).max_failure(),
            Process::Attached { .. } => ExitCode::from(2),
        });
    }

    if !options.events.is_empty() && options.events.iter().all(|k| windows.refused().contains(k)) {
        // The agent has said why (one warning); an empty file would only
        // hide it.
        windows.abandon();
        eprintln!("corsnap: no profile written: nothing that was asked for can be recorded in this runtime");
        return Ok(match &mut process {
            Process::Child { child, exited } => wait_for(child, *exited).max_failure(),
            Process::Attached { .. } => ExitCode::from(2),
        });
    }
    let threads = builder.thread_count() + children.iter().map(|c| c.builder.thread_count()).sum::<usize>();
    let agent_stats = builder.stats();
    let processes = children.len() + 1;
    let finished = windows.finish(builder, FLUSH_LIMIT, |builder| {
        if !subprocesses {
            return builder.finish();
        }
        let mut all = ProcessProfiles::new(builder, options.native, options.roots);
        all.name_main(main_pid, &name);
        for c in children {
            all.insert(c.pid, &c.name, c.builder);
        }
        all.finish()
    })?;
    let from_processes = if subprocesses { format!(" in {processes} processes") } else { String::new() };
    let totals = format!(
        "{} from {}{from_processes}; recording ended: {stop_reason}",
        plural(windows.samples as usize, "sample"),
        plural(threads, "thread")
    );
    if windows.interval().is_none() {
        eprintln!("corsnap: {} ({totals})", finished.lines.join("; "));
    } else {
        for line in &finished.lines {
            eprintln!("corsnap: {line}");
        }
        eprintln!("corsnap: {} ({totals})", plural(windows.windows as usize, "window"));
    }
    if options.events.contains(&EventKind::Gc) && windows.interval().is_none() {
        eprint!("{}", describe_gcs(&finished.gcs));
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
    if windows.samples == 0 {
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

/// The event a notice of the agent says it cannot record (it starts
/// `--event alloc needs ...`), if any.
fn refused_event(notice: &str) -> Option<EventKind> {
    let rest = notice.strip_prefix("--event ")?;
    let word = rest.split(' ').next()?;
    EventKind::ALL.into_iter().find(|k| k.name() == word)
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
