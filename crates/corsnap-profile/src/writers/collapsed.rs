//! Folded stacks, one `root;...;leaf count` line per distinct stack: the
//! input inferno and flamegraph.pl read.

use std::io::{self, BufWriter, Write};

use super::{collapsed_stacks, ProfileWriter, WriteOptions};
use crate::Profile;

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CollapsedWriter;

impl ProfileWriter for CollapsedWriter {
    fn write(&self, profile: &Profile, options: &WriteOptions, out: &mut dyn Write) -> io::Result<()> {
        let mut out = BufWriter::new(out);
        for (stack, weight) in collapsed_stacks(profile, options) {
            writeln!(out, "{stack} {weight}")?;
        }
        out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writers::EMPTY_STACK_FRAME;
    use crate::{Frame, FrameKind, Meta, Sample, Thread};

    fn render(profile: &Profile, options: &WriteOptions) -> String {
        let mut text = Vec::new();
        CollapsedWriter.write(profile, options, &mut text).unwrap();
        String::from_utf8(text).unwrap()
    }

    fn managed(name: &str) -> Frame {
        Frame::new(name, "", FrameKind::Managed)
    }

    #[test]
    fn separators_in_names_do_not_split_frames_or_lines() {
        let mut profile = Profile::new(Meta::default());
        let leaf = profile.intern_frame(managed("Parse(a;b)\nnext"));
        let root = profile.intern_frame(managed("Main"));
        let stack = profile.intern_stack(&[leaf, root]);
        let thread = profile.intern_thread(Thread { os_tid: 9, name: "io;pool\r\n".to_string() });
        profile.samples.push(Sample { time_ns: 0, thread, stack, weight: 4, kind: crate::EventKind::Cpu });

        assert_eq!(render(&profile, &WriteOptions::default()), "Main;Parse(a:b) next 4\n");
        let threads = WriteOptions { threads: true, ..WriteOptions::default() };
        assert_eq!(render(&profile, &threads), "io:pool   tid=9;Main;Parse(a:b) next 4\n");
        assert_eq!(profile.frames[leaf as usize].name, "Parse(a;b)\nnext", "only the output is rewritten");
    }

    #[test]
    fn a_stack_without_frames_keeps_its_weight() {
        let mut profile = Profile::new(Meta::default());
        let stack = profile.intern_stack(&[]);
        let thread = profile.intern_thread(Thread { os_tid: 9, name: String::new() });
        profile.samples.push(Sample { time_ns: 0, thread, stack, weight: 2, kind: crate::EventKind::Cpu });

        assert_eq!(render(&profile, &WriteOptions::default()), format!("{EMPTY_STACK_FRAME} 2\n"));
        let threads = WriteOptions { threads: true, ..WriteOptions::default() };
        assert_eq!(render(&profile, &threads), "tid=9 2\n");
    }

    #[test]
    fn empty_profile_writes_nothing() {
        assert_eq!(render(&Profile::new(Meta::default()), &WriteOptions::default()), "");
    }
}
