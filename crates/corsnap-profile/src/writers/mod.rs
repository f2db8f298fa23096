//! Every output format, behind one trait.

mod collapsed;
mod flamegraph;
mod pprof;
pub use pprof::{decode_pprof, encode_pprof, PprofSummary};
mod speedscope;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;

use crate::{Meta, Profile, StackIdx, ThreadIdx};

use collapsed::CollapsedWriter;
use flamegraph::FlamegraphWriter;
use speedscope::SpeedscopeWriter;

/// Stands in for a stack with no frames at all in formats that need at least
/// one frame per line, so the sample's weight still shows up in the totals.
pub const EMPTY_STACK_FRAME: &str = "[no frames]";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Flamegraph,
    Speedscope,
    Collapsed,
    /// gzip-compressed pprof protobuf, every event kind as its own sample type.
    Pprof,
}

impl Format {
    /// File extension without the leading dot.
    pub fn extension(self) -> &'static str {
        match self {
            Format::Flamegraph => "svg",
            Format::Speedscope => "speedscope.json",
            Format::Collapsed => "txt",
            Format::Pprof => "pb.gz",
        }
    }

    /// Whether one file holds every event kind (pprof's sample types); the
    /// others hold one profile, so each kind gets a file of its own.
    pub fn holds_many_kinds(self) -> bool {
        matches!(self, Format::Pprof)
    }

    /// The name the command line accepts.
    pub fn name(self) -> &'static str {
        match self {
            Format::Flamegraph => "flamegraph",
            Format::Speedscope => "speedscope",
            Format::Collapsed => "collapsed",
            Format::Pprof => "pprof",
        }
    }

    pub fn all() -> &'static [Format] {
        &[Format::Flamegraph, Format::Speedscope, Format::Collapsed, Format::Pprof]
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let wanted = text.trim();
        Format::all().iter().copied().find(|format| format.name().eq_ignore_ascii_case(wanted)).ok_or_else(|| {
            let valid: Vec<&str> = Format::all().iter().map(|format| format.name()).collect();
            format!("unknown output format {text:?}; expected one of: {}", valid.join(", "))
        })
    }
}

#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    /// Put the thread (`Thread::label()`, e.g. "worker-3 tid=1234") as the root frame of every stack.
    pub threads: bool,
    /// Title for formats that show one (flame graph title, speedscope name). Empty = a default built from meta.command.
    pub title: String,
    /// Flame graphs drawn from the top down (icicle), roots at the top.
    pub inverted: bool,
    /// Frame names as the runtime gave them (`Shop.Orders+<HandleAsync>d__4.MoveNext`),
    /// not their readable form (`Shop.Orders.HandleAsync [async]`).
    pub raw_names: bool,
    /// Frames with a known source line read `Method (File.cs:42)`
    /// ([`crate::Frame::name_with_line`]); pprof puts the line in its
    /// locations instead.
    pub lines: bool,
}

impl WriteOptions {
    /// The title to show: the caller's, or one naming the profiled command.
    pub fn title_for(&self, meta: &Meta) -> String {
        if !self.title.is_empty() {
            self.title.clone()
        } else if meta.command.is_empty() {
            "corsnap profile".to_string()
        } else {
            format!("corsnap: {}", meta.command)
        }
    }
}

/// What a profile's weights count, for the tools that show a unit: the one
/// kind of its samples, if there is just one.
pub(crate) fn single_kind(profile: &Profile) -> Option<crate::EventKind> {
    let kinds = profile.kinds();
    (kinds.len() == 1).then(|| kinds[0])
}

pub trait ProfileWriter {
    fn write(&self, profile: &Profile, options: &WriteOptions, out: &mut dyn std::io::Write) -> std::io::Result<()>;
}

pub fn writer_for(format: Format) -> Box<dyn ProfileWriter> {
    match format {
        Format::Flamegraph => Box::new(FlamegraphWriter),
        Format::Speedscope => Box::new(SpeedscopeWriter),
        Format::Collapsed => Box::new(CollapsedWriter),
        Format::Pprof => Box::new(pprof::PprofWriter),
    }
}

/// Every frame's name as the output shows it, by [`crate::FrameIdx`]: its
/// readable form ([`crate::Frame::display_name`]), or the raw name with
/// [`WriteOptions::raw_names`].
pub fn frame_names<'a>(profile: &'a Profile, options: &WriteOptions) -> Vec<Cow<'a, str>> {
    profile
        .frames
        .iter()
        .map(|frame| {
            let name = if options.raw_names { Cow::Borrowed(frame.name.as_str()) } else { frame.display_name() };
            match &frame.source {
                Some(source) if options.lines => Cow::Owned(crate::Frame::name_with_line(&name, source)),
                _ => name,
            }
        })
        .collect()
}

/// The profile folded to one entry per distinct stack, root first, frames
/// joined by `;` (thread label first with `options.threads`), with the summed
/// weight. Sorted by stack so every run of the same profile prints the same.
///
/// Shared by the collapsed and flame graph writers so the two always agree.
pub(crate) fn collapsed_stacks(profile: &Profile, options: &WriteOptions) -> BTreeMap<String, u64> {
    // Summing on indices first keeps the string building proportional to the
    // number of distinct stacks, not the number of samples.
    let mut weight_by_stack: HashMap<(Option<ThreadIdx>, StackIdx), u64> = HashMap::new();
    for sample in &profile.samples {
        let thread = options.threads.then_some(sample.thread);
        // Saturating: a damaged or hostile raw recording can carry any weight.
        let sum = weight_by_stack.entry((thread, sample.stack)).or_default();
        *sum = sum.saturating_add(sample.weight);
    }

    let names = frame_names(profile, options);
    let mut folded = BTreeMap::new();
    let mut line = String::new();
    for ((thread, stack), weight) in weight_by_stack {
        line.clear();
        if let Some(thread) = thread {
            push_collapsed_frame(&mut line, &profile.thread_label(thread));
        }
        for &frame in profile.stacks[stack as usize].iter().rev() {
            push_collapsed_frame(&mut line, &names[frame as usize]);
        }
        if line.is_empty() {
            line.push_str(EMPTY_STACK_FRAME);
        }
        // Distinct stacks can collide once names are sanitised; they then
        // share one line, as they would if a reader had folded them itself.
        let sum = folded.entry(line.clone()).or_default();
        *sum = u64::saturating_add(*sum, weight);
    }
    folded
}

/// Appends one frame to a collapsed stack. `;` separates frames and a newline
/// ends the line, so a name containing either would corrupt the line; only
/// the output is changed, the profile keeps the real name.
fn push_collapsed_frame(line: &mut String, name: &str) {
    if !line.is_empty() {
        line.push(';');
    }
    line.extend(name.chars().map(|c| match c {
        ';' => ':',
        '\n' | '\r' => ' ',
        other => other,
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_names_round_trip() {
        for &format in Format::all() {
            assert_eq!(format.name().parse::<Format>(), Ok(format));
            assert_eq!(format.to_string().to_uppercase().parse::<Format>(), Ok(format));
        }
    }

    #[test]
    fn unknown_format_lists_the_valid_ones() {
        let error = "pdf".parse::<Format>().unwrap_err();
        assert!(error.contains("\"pdf\""), "{error}");
        for &format in Format::all() {
            assert!(error.contains(format.name()), "{error} should mention {}", format.name());
        }
    }

    #[test]
    fn extensions_are_distinct() {
        let mut extensions: Vec<_> = Format::all().iter().map(|format| format.extension()).collect();
        extensions.sort_unstable();
        extensions.dedup();
        assert_eq!(extensions.len(), Format::all().len());
    }

    #[test]
    fn default_title_names_the_command() {
        let mut meta = Meta::default();
        let options = WriteOptions::default();
        assert_eq!(options.title_for(&meta), "corsnap profile");
        meta.command = "dotnet run".to_string();
        assert_eq!(options.title_for(&meta), "corsnap: dotnet run");
        let options = WriteOptions { title: "mine".to_string(), ..Default::default() };
        assert_eq!(options.title_for(&meta), "mine");
    }
}
