//! Turns the agent's message stream (live, or replayed from a raw recording)
//! into a [`Profile`]. Live recording and `corsnap report` share this path, so
//! a raw file always renders exactly as the live run would have.

use std::collections::HashMap;

use corsnap_wire::{Message, SamplerStats, Severity};

use crate::{EventKind, Frame, FrameIdx, FrameKind, GcRecord, Meta, Profile, Sample, Thread, ThreadIdx};

/// Frame name for a run of unmanaged frames.
pub const NATIVE_FRAME: &str = "[native code]";
/// Frame appended (at the root end) to a stack the agent cut short.
pub const TRUNCATED_FRAME: &str = "[truncated]";

#[derive(Debug, Default)]
pub struct ProfileBuilder {
    profile: Profile,
    functions: HashMap<u64, FrameIdx>,
    /// Runtime `ThreadID` to the thread it currently denotes (ids are reused
    /// after a thread dies, so a new `Thread` message replaces the mapping).
    threads: HashMap<u64, ThreadIdx>,
    /// Samples whose `ThreadID` was never described get this thread.
    unknown_threads: HashMap<u64, ThreadIdx>,
    scratch: Vec<FrameIdx>,
    notices: Vec<(Severity, String)>,
    goodbye: Option<String>,
    saw_hello: bool,
}

impl ProfileBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one message. Messages that do not shape the profile (notices,
    /// goodbye) are kept for the caller to show.
    pub fn apply(&mut self, msg: &Message) {
        match msg {
            Message::Hello { pid, runtime_version, rate_hz, .. } => {
                self.saw_hello = true;
                let meta = &mut self.profile.meta;
                meta.pid = *pid;
                meta.runtime_version = runtime_version.clone();
                meta.rate_hz = *rate_hz;
            }
            Message::Recording { command, start_unix_ms } => {
                self.profile.meta.command = command.clone();
                self.profile.meta.start_unix_ms = *start_unix_ms;
            }
            Message::Thread { thread_id, os_tid, name } => {
                let idx = self.profile.intern_thread(Thread { os_tid: *os_tid, name: name.clone() });
                self.threads.insert(*thread_id, idx);
            }
            Message::Function { function_id, name, module } => {
                let idx = self.profile.intern_frame(Frame {
                    name: name.clone(),
                    module: module.clone(),
                    kind: FrameKind::Managed,
                });
                self.functions.insert(*function_id, idx);
            }
            Message::Sample { time_ns, thread_id, kind, weight, truncated, leaf, frames } => {
                self.add_event_sample(*kind, *time_ns, *thread_id, *truncated, leaf, frames, *weight);
            }
            Message::Gc { time_ns, generation, reason, pause_ns } => self.profile.gcs.push(GcRecord {
                time_ns: *time_ns,
                generation: *generation,
                reason: *reason,
                pause_ns: *pause_ns,
            }),
            Message::Stats(stats) => self.profile.meta.stats = Some(*stats),
            Message::Notice { severity, text } => self.notices.push((*severity, text.clone())),
            Message::Goodbye { reason } => self.goodbye = Some(reason.clone()),
            Message::SnapshotEnd => {}
        }
    }

    /// A CPU sample: `frames` leaf first, `0` for a run of unmanaged frames.
    pub fn add_sample(&mut self, time_ns: u64, thread_id: u64, truncated: bool, frames: &[u64], weight: u64) {
        self.add_event_sample(EventKind::Cpu, time_ns, thread_id, truncated, "", frames, weight);
    }

    /// A sample of any kind; `leaf`, if not empty, goes above the stack.
    #[allow(clippy::too_many_arguments)]
    pub fn add_event_sample(
        &mut self,
        kind: EventKind,
        time_ns: u64,
        thread_id: u64,
        truncated: bool,
        leaf: &str,
        frames: &[u64],
        weight: u64,
    ) {
        let mut stack = std::mem::take(&mut self.scratch);
        stack.clear();
        if !leaf.is_empty() {
            stack.push(self.profile.intern_frame(Frame {
                name: leaf.to_string(),
                module: String::new(),
                kind: FrameKind::Subject,
            }));
        }
        for &function_id in frames {
            let idx = match function_id {
                0 => self.profile.intern_frame(Frame {
                    name: NATIVE_FRAME.to_string(),
                    module: String::new(),
                    kind: FrameKind::Native,
                }),
                id => match self.functions.get(&id) {
                    Some(&idx) => idx,
                    None => self.profile.intern_frame(Frame {
                        name: format!("[unknown function 0x{id:x}]"),
                        module: String::new(),
                        kind: FrameKind::Unresolved,
                    }),
                },
            };
            stack.push(idx);
        }
        if truncated {
            stack.push(self.profile.intern_frame(Frame {
                name: TRUNCATED_FRAME.to_string(),
                module: String::new(),
                kind: FrameKind::Truncated,
            }));
        }
        let stack_idx = self.profile.intern_stack(&stack);
        self.scratch = stack;
        let thread = self.thread_for(thread_id);
        self.profile.samples.push(Sample { time_ns, thread, stack: stack_idx, weight, kind });
    }

    fn thread_for(&mut self, thread_id: u64) -> ThreadIdx {
        if let Some(&idx) = self.threads.get(&thread_id) {
            return idx;
        }
        if let Some(&idx) = self.unknown_threads.get(&thread_id) {
            return idx;
        }
        let n = self.unknown_threads.len();
        let idx = self.profile.intern_thread(Thread { os_tid: 0, name: format!("thread-{n}") });
        self.unknown_threads.insert(thread_id, idx);
        idx
    }

    pub fn saw_hello(&self) -> bool {
        self.saw_hello
    }

    pub fn sample_count(&self) -> usize {
        self.profile.samples.len()
    }

    pub fn thread_count(&self) -> usize {
        self.profile.threads.len()
    }

    pub fn stats(&self) -> Option<SamplerStats> {
        self.profile.meta.stats
    }

    /// Notices received so far, in order, drained.
    pub fn take_notices(&mut self) -> Vec<(Severity, String)> {
        std::mem::take(&mut self.notices)
    }

    pub fn goodbye(&self) -> Option<&str> {
        self.goodbye.as_deref()
    }

    pub fn meta_mut(&mut self) -> &mut Meta {
        &mut self.profile.meta
    }

    pub fn finish(self) -> Profile {
        self.profile
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_native_runs_and_threads_are_resolved() {
        let mut b = ProfileBuilder::new();
        b.apply(&Message::Thread { thread_id: 10, os_tid: 77, name: "worker".into() });
        b.apply(&Message::Function { function_id: 1, name: "A.Leaf".into(), module: "app.dll".into() });
        b.apply(&Message::Function { function_id: 2, name: "A.Main".into(), module: "app.dll".into() });
        b.apply(&Message::Sample {
            time_ns: 1,
            thread_id: 10,
            kind: EventKind::Cpu,
            weight: 1,
            truncated: false,
            leaf: String::new(),
            frames: vec![1, 0, 2],
        });
        b.apply(&Message::Sample {
            time_ns: 2,
            thread_id: 10,
            kind: EventKind::Cpu,
            weight: 1,
            truncated: false,
            leaf: String::new(),
            frames: vec![1, 0, 2],
        });
        b.apply(&Message::Sample {
            time_ns: 3,
            thread_id: 99,
            kind: EventKind::Cpu,
            weight: 1,
            truncated: true,
            leaf: String::new(),
            frames: vec![3],
        });
        let p = b.finish();
        assert_eq!(p.samples.len(), 3);
        assert_eq!(p.stacks.len(), 2, "identical stacks are interned once");
        let names: Vec<_> = p.stack_names_root_first(p.samples[0].stack).collect();
        assert_eq!(names, ["A.Main", NATIVE_FRAME, "A.Leaf"]);
        assert_eq!(p.threads[p.samples[0].thread as usize].label(), "worker tid=77");
        let names: Vec<_> = p.stack_names_root_first(p.samples[2].stack).collect();
        assert_eq!(names, [TRUNCATED_FRAME, "[unknown function 0x3]"]);
    }
}
