//! The program's own .NET child processes, recorded with `--subprocesses`:
//! each has its connection and a builder of its own (function and thread
//! ids are only unique within a process).

use std::time::Duration;

use corsnap_profile::ProfileBuilder;
use corsnap_wire::{Command as AgentCommand, Message};

use super::{process_command_line, program_name, RecordOptions};
use crate::session::{AgentConnection, Event};

/// A .NET process the program started, recorded with --subprocesses.
pub(super) struct ChildRecording {
    pub pid: u32,
    pub name: String,
    /// `None` once it has said goodbye or hung up.
    pub connection: Option<AgentConnection>,
    pub builder: ProfileBuilder,
}

impl ChildRecording {
    pub fn new(pid: u32, connection: AgentConnection, options: &RecordOptions) -> ChildRecording {
        let command = process_command_line(pid);
        let name = program_name(command.split(' ').map(str::to_string));
        let mut builder = ProfileBuilder::new();
        builder.set_native_frames(options.native);
        builder.set_root_frames(options.roots);
        if crate::output::reads_pdbs(options.lines, options.format) {
            builder.set_source_locator(corsnap::source_lines::PdbLocator::boxed());
        }
        ChildRecording { pid, name, connection: Some(connection), builder }
    }

    /// Hands what has arrived to `apply` (waiting at most `wait` for the
    /// first of it); forgets the connection at goodbye or hang-up.
    pub fn drain(&mut self, wait: Duration, mut apply: impl FnMut(&Message, &mut ProfileBuilder, u32, &str)) {
        let Some(connection) = self.connection.as_mut() else { return };
        let mut wait = wait;
        while let Some(event) = connection.next_event(wait) {
            wait = Duration::ZERO;
            match event {
                Event::Message(msg) => {
                    apply(&msg, &mut self.builder, self.pid, &self.name);
                    if matches!(msg, Message::Goodbye { .. }) {
                        self.connection = None;
                        return;
                    }
                }
                Event::Closed(_) => {
                    self.connection = None;
                    return;
                }
            }
        }
    }

    pub fn detach(&self) {
        if let Some(connection) = &self.connection {
            let _ = connection.send_command(AgentCommand::Detach);
        }
    }
}
