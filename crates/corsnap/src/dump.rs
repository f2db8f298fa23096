//! `corsnap dump --pid PID`: attach, take one snapshot of every managed
//! thread, print it (leaf first, like `py-spy dump`), detach.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use corsnap_profile::{Profile, ProfileBuilder};
use corsnap_wire::{AttachRequest, Command, Message};

use crate::session::{Event, Listener};

#[derive(Debug, Clone)]
pub struct DumpOptions {
    pub pid: u32,
    pub json: bool,
    pub agent_log: Option<PathBuf>,
    pub agent_path: Option<PathBuf>,
}

pub fn run(options: &DumpOptions) -> Result<()> {
    let agent = crate::record::find_agent(options.agent_path.as_deref())?;
    crate::diagnostics::find_socket(options.pid)?;
    let listener = Listener::for_process(options.pid)?;
    let request = AttachRequest {
        sampler: corsnap_wire::SamplerKind::Suspend,
        clock: corsnap_wire::CpuClock::Perf,
        walker: corsnap_wire::WalkerKind::Snapshot,
        symbols: Vec::new(),
        socket: listener.socket_path().to_string_lossy().into_owned(),
        // Sampling stays paused: only the one snapshot is taken.
        rate_hz: 0,
        events: corsnap_wire::EventKind::Wall.bit(),
        max_pause_ppm: corsnap_wire::DEFAULT_MAX_PAUSE_PPM,
        log: options.agent_log.as_ref().map(|p| crate::record::absolute(p).to_string_lossy().into_owned()),
    };
    let mut connection = crate::record::attach(options.pid, &agent, &listener, &request)?;
    connection.send_command(Command::SnapshotNow)?;

    let mut builder = ProfileBuilder::new();
    builder.apply(&Message::Recording { command: crate::record::process_command_line(options.pid), start_unix_ms: 0 });
    let mut got_snapshot = false;
    let mut failure = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && !got_snapshot {
        match connection.next_event(Duration::from_millis(50)) {
            Some(Event::Message(Message::SnapshotEnd)) => got_snapshot = true,
            Some(Event::Message(msg)) => builder.apply(&msg),
            Some(Event::Closed(e)) => {
                failure = Some(e.map_or("the agent closed the connection".to_string(), |e| e.to_string()));
                break;
            }
            None => {}
        }
    }
    // Leave the process as we found it, whatever happened above.
    let _ = connection.send_command(Command::Detach);
    let detach_deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < detach_deadline {
        match connection.next_event(Duration::from_millis(50)) {
            Some(Event::Message(Message::Goodbye { .. })) | Some(Event::Closed(_)) => break,
            Some(Event::Message(msg)) => builder.apply(&msg),
            None => {}
        }
    }
    connection.close();
    if !got_snapshot {
        bail!("no snapshot from process {}: {}", options.pid, failure.unwrap_or_else(|| "timed out".into()));
    }
    let notices = builder.take_notices();
    for (_, text) in notices {
        eprintln!("corsnap: {text}");
    }
    let profile = builder.finish();
    let mut out = std::io::stdout().lock();
    if options.json {
        writeln!(out, "{}", to_json(&profile))?;
    } else {
        write_text(&profile, &mut out)?;
    }
    Ok(())
}

/// The program's name for a thread, else the kernel's (as `record
/// --threads` labels it).
fn display_name(profile: &Profile, thread: &corsnap_profile::Thread) -> String {
    if thread.name.is_empty() {
        profile.os_thread_names.get(&thread.os_tid).cloned().unwrap_or_default()
    } else {
        thread.name.clone()
    }
}

/// Threads in the order of their OS thread ids, each with its stack leaf first.
fn threads_in_order(profile: &Profile) -> Vec<&corsnap_profile::Sample> {
    let mut samples: Vec<_> = profile.samples.iter().collect();
    samples.sort_by_key(|s| profile.threads[s.thread as usize].os_tid);
    samples
}

fn write_text(profile: &Profile, out: &mut impl Write) -> std::io::Result<()> {
    let meta = &profile.meta;
    writeln!(out, "Process {}: {} (.NET {})", meta.pid, meta.command, meta.runtime_version)?;
    for sample in threads_in_order(profile) {
        let thread = &profile.threads[sample.thread as usize];
        let name = display_name(profile, thread);
        let name = if name.is_empty() { String::new() } else { format!(" \"{name}\"") };
        writeln!(out, "\nThread {}{name}", thread.os_tid)?;
        for &frame in &profile.stacks[sample.stack as usize] {
            let f = &profile.frames[frame as usize];
            if f.module.is_empty() {
                writeln!(out, "    {}", f.display_name())?;
            } else {
                writeln!(out, "    {} ({})", f.display_name(), f.module)?;
            }
        }
    }
    Ok(())
}

fn to_json(profile: &Profile) -> String {
    let threads: Vec<_> = threads_in_order(profile)
        .into_iter()
        .map(|s| {
            let t = &profile.threads[s.thread as usize];
            let frames: Vec<_> = profile.stacks[s.stack as usize]
                .iter()
                .map(|&f| {
                    let f = &profile.frames[f as usize];
                    serde_json::json!({ "name": f.name, "display": f.display_name(), "module": f.module })
                })
                .collect();
            serde_json::json!({ "os_tid": t.os_tid, "name": display_name(profile, t), "frames": frames })
        })
        .collect();
    serde_json::json!({
        "pid": profile.meta.pid,
        "command": profile.meta.command,
        "runtime": profile.meta.runtime_version,
        "threads": threads,
    })
    .to_string()
}
