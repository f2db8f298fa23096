//! The process being recorded and how it ends: a program corsnap started
//! (whose exit code becomes corsnap's) or one it attached to, and the
//! signals that stop a recording.

use std::path::Path;
use std::process::{Child, ExitCode, ExitStatus};

use anyhow::{Context, Result};

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
    pub(super) fn describe_end(&mut self) -> String {
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
    pub(super) fn has_exited(&mut self) -> bool {
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

/// The program's exit, passed through as ours.
#[derive(Debug, Clone, Copy)]
pub(super) struct ProgramExit(pub(super) i32);

impl ProgramExit {
    pub(super) fn into_exit_code(self) -> ExitCode {
        ExitCode::from(self.0.clamp(0, 255) as u8)
    }
    /// Like `into_exit_code`, but never success: nothing was recorded.
    pub(super) fn max_failure(self) -> ExitCode {
        if self.0 == 0 {
            ExitCode::from(2)
        } else {
            self.into_exit_code()
        }
    }
}

pub(super) fn wait_for(child: &mut Child, already: Option<ExitStatus>) -> ProgramExit {
    let status = already.or_else(|| child.wait().ok());
    ProgramExit(status.map_or(1, exit_code_of))
}

pub(super) fn exit_code_of(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

pub(super) fn describe_status(status: ExitStatus) -> String {
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
