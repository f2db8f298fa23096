//! Files that rotate: `-o` as a pattern, async-profiler's convention.
//! `%p` is the process id, `%t` the window's start (`yyyyMMdd-hhmmss`,
//! local time), `%n{MAX}` the window's number modulo MAX (a ring of MAX
//! files, so disk use stays bounded), `%n` the window's number, `%%` a `%`.
//! Each file is written beside its name and renamed onto it when complete,
//! so a reader never sees half a window.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use corsnap_profile::writers::WriteOptions;

use super::{Sink, Window};
use crate::output::{path_for_kind, OutputFile, OutputFormat};

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
        if format == OutputFormat::Raw {
            bail!(
                "-f raw cannot be cut into windows (a raw recording is one stream): with --interval choose pprof, \
                 speedscope, collapsed or flamegraph"
            );
        }
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

    fn window(&mut self, window: &Window) -> Result<()> {
        let OutputFormat::Rendered(format) = self.format else { unreachable!("refused in FileSink::new") };
        let pid = if window.profile.meta.pid != 0 { window.profile.meta.pid } else { self.pid };
        let path = self.pattern.expand(pid, (window.start_unix_ns / 1_000_000_000) as i64, window.index);
        let kinds = window.profile.kinds();
        if format.holds_many_kinds() || kinds.len() <= 1 {
            OutputFile::create(&path)?.write_profile(&window.profile, format, &self.options)?;
        } else {
            for kind in kinds {
                OutputFile::create(&path_for_kind(&path, kind))?.write_profile(
                    &window.profile.only(kind),
                    format,
                    &self.options,
                )?;
            }
        }
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

use std::time::Instant;

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
