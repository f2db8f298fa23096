//! Files that rotate: `-o` as a pattern, async-profiler's convention.
//! `%p` is the process id, `%t` the window's start (`yyyyMMdd-hhmmss`,
//! local time), `%n{MAX}` the window's number modulo MAX (a ring of MAX
//! files, so disk use stays bounded), `%n` the window's number, `%%` a `%`.
//! Each file is written beside its name and renamed onto it when complete,
//! so a reader never sees half a window. A recording without `--interval`
//! is one window, written to the files `-o` names ([`RecordingFiles`]).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Result};
use corsnap_profile::writers::WriteOptions;
use corsnap_wire::{EventKind, Message};

use super::{Sink, Window};
use crate::output::{OutputFile, OutputFormat, Outputs};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Pid,
    Time,
    Sequence { modulo: Option<u64> },
}

/// A parsed `-o` pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilePattern {
    parts: Vec<Part>,
    text: String,
}

impl FilePattern {
    pub fn parse(text: &str) -> Result<FilePattern> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                literal.push(c);
                continue;
            }
            let part = match chars.next() {
                Some('%') => {
                    literal.push('%');
                    continue;
                }
                Some('p') => Part::Pid,
                Some('t') => Part::Time,
                Some('n') if chars.peek() == Some(&'{') => {
                    chars.next();
                    let digits: String = chars.by_ref().take_while(|&c| c != '}').collect();
                    match digits.parse::<u64>() {
                        Ok(max) if max > 0 => Part::Sequence { modulo: Some(max) },
                        _ => bail!("-o {text}: %n{{{digits}}} needs a number of files above 0, such as %n{{3}}"),
                    }
                }
                Some('n') => Part::Sequence { modulo: None },
                other => bail!(
                    "-o {text}: %{} is not a pattern corsnap knows: use %p (pid), %t (window start), %n{{MAX}} (a \
                     ring of MAX files), %n (window number) or %% (a %)",
                    other.map(String::from).unwrap_or_default()
                ),
            };
            if !literal.is_empty() {
                parts.push(Part::Text(std::mem::take(&mut literal)));
            }
            parts.push(part);
        }
        if !literal.is_empty() {
            parts.push(Part::Text(literal));
        }
        Ok(FilePattern { parts, text: text.to_string() })
    }

    /// Whether each window gets a name of its own (else each window replaces
    /// the last: the file always holds the latest).
    pub fn varies(&self) -> bool {
        self.parts.iter().any(|p| matches!(p, Part::Time | Part::Sequence { .. }))
    }

    /// Whether disk use is bounded: a ring, or a single file.
    pub fn bounded(&self) -> bool {
        !self.parts.iter().any(|p| matches!(p, Part::Time | Part::Sequence { modulo: None }))
    }

    pub fn expand(&self, pid: u32, start_unix_secs: i64, index: u64) -> PathBuf {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Pid => out.push_str(&pid.to_string()),
                Part::Time => {
                    let [y, mo, d, h, mi, s] = corsnap_abi::os::local_time(start_unix_secs);
                    out.push_str(&format!("{y:04}{mo:02}{d:02}-{h:02}{mi:02}{s:02}"));
                }
                Part::Sequence { modulo } => out.push_str(&(modulo.map_or(index, |m| index % m)).to_string()),
            }
        }
        PathBuf::from(out)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// Writes each window to the file its pattern names, in `format`.
#[derive(Debug)]
pub struct FileSink {
    pattern: FilePattern,
    format: OutputFormat,
    options: WriteOptions,
    pid: u32,
    pub written: u64,
    last: Option<PathBuf>,
}

impl FileSink {
    /// Checks that the files can be written (the first one's folder) before
    /// anything runs. `pid`: the recorded process's, when already known.
    pub fn new(pattern: FilePattern, format: OutputFormat, options: WriteOptions, pid: u32) -> Result<FileSink> {
        let first = pattern.expand(pid, 0, 0);
        let folder = first.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if !folder.is_dir() {
            bail!("cannot write {}: there is no folder {}", pattern.as_str(), folder.display());
        }
        // Open a file there and discard it: a folder we may not write to is
        // refused now, not after the first window.
        OutputFile::create(&folder.join(format!(".corsnap-check-{}", std::process::id())))?.discard();
        Ok(FileSink { pattern, format, options, pid, written: 0, last: None })
    }
}

impl Sink for FileSink {
    fn describe(&self) -> String {
        format!("files {}", self.pattern.as_str())
    }

    fn window(&mut self, window: &Window, refused: &[EventKind]) -> Result<()> {
        let pid = if window.profile.meta.pid != 0 { window.profile.meta.pid } else { self.pid };
        let path = self.pattern.expand(pid, (window.start_unix_ns / 1_000_000_000) as i64, window.index);
        // A file per kind the window holds, for formats that hold one.
        Outputs::create(&path, self.format, &window.profile.kinds())?.write(&window.profile, &self.options, refused)?;
        self.written += 1;
        self.last = Some(path);
        Ok(())
    }

    fn finish(&mut self, _deadline: Instant) -> String {
        format!(
            "wrote {} windows to {}{}",
            self.written,
            self.pattern.as_str(),
            self.last.as_ref().map(|p| format!(" (the last: {})", p.display())).unwrap_or_default()
        )
    }
}

/// A recording without `--interval`: its one window, the whole recording,
/// to the files `-o` names (one per event kind for the formats that hold
/// one profile: `x.cpu.svg`, `x.exceptions.svg`). They are opened before
/// anything runs, so an output that cannot be written is refused before the
/// program starts; see [`Outputs`] for temporary files, devices, FIFOs and
/// standard output. With `-f raw` every message is kept as it arrives, for
/// `corsnap report` to render later in any format.
#[derive(Debug)]
pub struct RecordingFiles {
    /// `None` once written (or given up).
    outputs: Option<Outputs>,
    options: WriteOptions,
    /// The raw recording so far, with `-f raw`.
    raw: Option<Vec<u8>>,
    /// The process the raw recording's last message came from, in a
    /// recording of several.
    raw_process: Option<u32>,
    /// What was written, as messages name it.
    written: Vec<String>,
}

impl RecordingFiles {
    pub fn create(path: &Path, format: OutputFormat, kinds: &[EventKind], options: WriteOptions) -> Result<Self> {
        let outputs = Outputs::create(path, format, kinds)?;
        let raw = match format {
            OutputFormat::Raw => {
                let mut buffer = Vec::new();
                corsnap_wire::write_raw_header(&mut buffer)?;
                Some(buffer)
            }
            OutputFormat::Rendered(_) => None,
        };
        Ok(RecordingFiles { outputs: Some(outputs), options, raw, raw_process: None, written: Vec::new() })
    }
}

impl Sink for RecordingFiles {
    fn describe(&self) -> String {
        self.outputs.as_ref().map(|o| o.describe().join(", ")).unwrap_or_default()
    }

    /// A `Process` message goes before each run of messages from one
    /// process, so `corsnap report` gives each its own builder.
    fn message(&mut self, from: Option<(u32, &str)>, msg: &Message) {
        let Some(raw) = &mut self.raw else { return };
        if let Some((pid, name)) = from {
            if self.raw_process != Some(pid) {
                Message::Process { pid, name: name.to_string() }.encode_into(raw);
                self.raw_process = Some(pid);
            }
        }
        msg.encode_into(raw);
    }

    fn window(&mut self, window: &Window, refused: &[EventKind]) -> Result<()> {
        let Some(outputs) = self.outputs.take() else { bail!("a whole recording is one window") };
        let skipped = outputs.skipped(refused);
        self.written = outputs.kept(refused);
        match self.raw.take() {
            Some(raw) => outputs.into_single().write_with(|out| out.write_all(&raw))?,
            None => outputs.write(&window.profile, &self.options, refused)?,
        }
        if !skipped.is_empty() {
            eprintln!("corsnap: not written (nothing could be recorded for it): {}", skipped.join(", "));
        }
        Ok(())
    }

    fn finish(&mut self, _deadline: Instant) -> String {
        match self.outputs.take() {
            // No window came: nothing was recorded, nothing is left behind.
            Some(outputs) => {
                outputs.remove_all();
                String::new()
            }
            None => format!("wrote {}", self.written.join(", ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_expand_as_async_profiler_does() {
        let p = FilePattern::parse("/var/log/p-%p-%n{3}.pb.gz").unwrap();
        assert_eq!(p.expand(42, 0, 0), PathBuf::from("/var/log/p-42-0.pb.gz"));
        assert_eq!(p.expand(42, 0, 4), PathBuf::from("/var/log/p-42-1.pb.gz"));
        assert!(p.varies() && p.bounded());
        let t = FilePattern::parse("run-%t.svg").unwrap();
        let name = t.expand(1, 1_700_000_000, 0).to_string_lossy().into_owned();
        assert_eq!(name.len(), "run-20231114-221320.svg".len(), "{name}");
        assert!(t.varies() && !t.bounded());
        assert_eq!(FilePattern::parse("a%%b-%n").unwrap().expand(1, 0, 7), PathBuf::from("a%b-7"));
        assert!(!FilePattern::parse("plain.svg").unwrap().varies());
        assert!(FilePattern::parse("x-%n{0}").unwrap_err().to_string().contains("above 0"));
        assert!(FilePattern::parse("x-%q").unwrap_err().to_string().contains("%q is not a pattern"));
    }
}
