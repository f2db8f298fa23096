//! A recording of several processes (`corsnap record --subprocesses`): the
//! program corsnap started and the .NET processes it started in turn. Each
//! process's messages go to a [`ProfileBuilder`] of its own (function,
//! thread and stack ids are only unique within a process), and the
//! profiles are merged at the end with every stack under a root frame
//! naming its process, `process 1234:"app"`, as py-spy does.

use corsnap_wire::Message;

use crate::{Frame, FrameKind, NativeFrames, Profile, ProfileBuilder, RootFrames};

/// The root frame of a process's stacks: `process 1234:"app"`.
pub fn process_frame(pid: u32, name: &str) -> Frame {
    // `;` separates frames in collapsed stacks.
    let name = name.replace(';', "_");
    Frame::new(format!("process {pid}:\"{name}\""), "", FrameKind::Process)
}

/// One builder per process, the first the program corsnap started.
#[derive(Debug)]
pub struct ProcessProfiles {
    native: NativeFrames,
    roots: RootFrames,
    /// (pid, name, builder), in the order the processes were first seen.
    parts: Vec<(u32, String, ProfileBuilder)>,
    /// Which part `apply` feeds (a raw recording's `Process` messages switch it).
    current: usize,
    /// Makes each process's source locator (`--lines`, pprof), if any.
    locators: Option<fn() -> Box<dyn crate::SourceLocator>>,
}

impl ProcessProfiles {
    /// Starts with `main`, the builder of the program corsnap started (it
    /// may have messages already; its pid and name come with the first
    /// `Process` message or [`ProcessProfiles::name_main`]).
    pub fn new(main: ProfileBuilder, native: NativeFrames, roots: RootFrames) -> ProcessProfiles {
        ProcessProfiles { native, roots, parts: vec![(0, String::new(), main)], current: 0, locators: None }
    }

    /// Gives every process's builder, those to come too, a source locator
    /// made by `make` ([`ProfileBuilder::set_source_locator`]).
    pub fn set_source_locators(&mut self, make: fn() -> Box<dyn crate::SourceLocator>) {
        self.locators = Some(make);
        for (_, _, builder) in &mut self.parts {
            builder.set_source_locator(make());
        }
    }

    pub fn name_main(&mut self, pid: u32, name: &str) {
        self.parts[0].0 = pid;
        self.parts[0].1 = name.to_string();
    }

    /// Adds the recording of process `pid`, a child of the main one.
    pub fn insert(&mut self, pid: u32, name: &str, builder: ProfileBuilder) {
        self.parts.push((pid, name.to_string(), builder));
    }

    /// Whether more than the main process was recorded, or named.
    pub fn is_several(&self) -> bool {
        self.parts.len() > 1 || self.parts[0].0 != 0
    }

    /// The builder of process `pid`, made for it (as `name`) the first time.
    pub fn builder(&mut self, pid: u32, name: &str) -> &mut ProfileBuilder {
        let i = self.index(pid, name);
        &mut self.parts[i].2
    }

    fn index(&mut self, pid: u32, name: &str) -> usize {
        if let Some(i) = self.parts.iter().position(|(p, _, _)| *p == pid) {
            return i;
        }
        if self.parts[0].0 == 0 {
            // The first process named is the program corsnap started.
            self.name_main(pid, name);
            return 0;
        }
        let mut builder = ProfileBuilder::new();
        builder.set_native_frames(self.native);
        builder.set_root_frames(self.roots);
        if let Some(make) = self.locators {
            builder.set_source_locator(make());
        }
        self.parts.push((pid, name.to_string(), builder));
        self.parts.len() - 1
    }

    /// Replays a raw recording's message: a `Process` switches the process
    /// the following messages belong to. A recording without any is one
    /// process's, and goes to the main builder.
    pub fn apply(&mut self, msg: &Message) {
        match msg {
            Message::Process { pid, name } => self.current = self.index(*pid, name),
            Message::Recording { .. } => {
                // The header describes the whole recording: every process's
                // builder gets it (those made later get it at `finish`).
                self.parts[0].2.apply(msg)
            }
            _ => self.parts[self.current].2.apply(msg),
        }
    }

    pub fn main(&mut self) -> &mut ProfileBuilder {
        &mut self.parts[0].2
    }

    /// Every builder, main first.
    pub fn builders(&mut self) -> impl Iterator<Item = &mut ProfileBuilder> {
        self.parts.iter_mut().map(|(_, _, b)| b)
    }

    pub fn sample_count(&self) -> usize {
        self.parts.iter().map(|(_, _, b)| b.sample_count()).sum()
    }

    pub fn thread_count(&self) -> usize {
        self.parts.iter().map(|(_, _, b)| b.thread_count()).sum()
    }

    /// The processes recorded besides the main one: (pid, name, samples).
    pub fn children(&self) -> Vec<(u32, String, usize)> {
        self.parts.iter().skip(1).map(|(pid, name, b)| (*pid, name.clone(), b.sample_count())).collect()
    }

    /// One profile: the main process's meta, and, when several processes
    /// were recorded (or the main one named), every stack under its
    /// process's root frame.
    pub fn finish(self) -> Profile {
        let several = self.is_several();
        let mut parts = self.parts.into_iter();
        let (main_pid, main_name, main) = parts.next().expect("the main process is always there");
        let main = main.finish();
        if !several {
            return main;
        }
        let mut merged = Profile::new(main.meta.clone());
        merged.absorb(&main, Some(process_frame(main_pid, &main_name)));
        for (pid, name, builder) in parts {
            merged.absorb(&builder.finish(), Some(process_frame(pid, &name)));
        }
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corsnap_wire::EventKind;

    fn sample(thread_id: u64, frames: Vec<u64>, weight: u64) -> Message {
        Message::Sample {
            time_ns: 1,
            thread_id,
            kind: EventKind::Cpu,
            weight,
            truncated: false,
            leaf: String::new(),
            frames,
            il_offsets: Vec::new(),
        }
    }

    fn function(id: u64, name: &str) -> Message {
        Message::Function { function_id: id, name: name.into(), module: "app.dll".into() }
    }

    fn collapsed(profile: &Profile) -> Vec<(String, u64)> {
        let mut lines: Vec<(String, u64)> = profile
            .samples
            .iter()
            .map(|s| (profile.stack_names_root_first(s.stack).collect::<Vec<_>>().join(";"), s.weight))
            .collect();
        lines.sort();
        lines
    }

    #[test]
    fn the_same_ids_in_two_processes_stay_apart_under_their_roots() {
        let mut p = ProcessProfiles::new(ProfileBuilder::new(), NativeFrames::Show, RootFrames::Show);
        p.apply(&Message::Process { pid: 10, name: "parent".into() });
        p.apply(&function(1, "Parent.Main"));
        p.apply(&Message::Thread { thread_id: 7, os_tid: 10, name: String::new() });
        p.apply(&Message::Process { pid: 11, name: "child".into() });
        // The same FunctionID and thread id, another method and thread.
        p.apply(&function(1, "Child.Burn"));
        p.apply(&Message::Thread { thread_id: 7, os_tid: 11, name: String::new() });
        p.apply(&sample(7, vec![1], 30));
        p.apply(&Message::Process { pid: 10, name: "parent".into() });
        p.apply(&sample(7, vec![1], 5));
        assert_eq!(p.children(), vec![(11, "child".to_string(), 1)]);
        let profile = p.finish();
        assert_eq!(
            collapsed(&profile),
            vec![
                ("process 10:\"parent\";Parent.Main".to_string(), 5),
                ("process 11:\"child\";Child.Burn".to_string(), 30)
            ]
        );
        assert_eq!(profile.threads.len(), 2);
    }

    #[test]
    fn a_recording_of_one_process_has_no_process_root() {
        let mut p = ProcessProfiles::new(ProfileBuilder::new(), NativeFrames::Show, RootFrames::Show);
        p.apply(&function(1, "App.Main"));
        p.apply(&Message::Thread { thread_id: 7, os_tid: 10, name: String::new() });
        p.apply(&sample(7, vec![1], 5));
        assert!(!p.is_several());
        assert_eq!(collapsed(&p.finish()), vec![("App.Main".to_string(), 5)]);
    }
}
