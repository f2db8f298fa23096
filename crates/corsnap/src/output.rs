//! Where a profile goes: opened (and so checked) before anything runs, written
//! once recording ends.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{Context, Result};
use corsnap_profile::writers::{writer_for, Format, WriteOptions};
use corsnap_profile::{EventKind, Profile};

/// A rendered format, or the raw recording that `corsnap report` re-renders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    Rendered(Format),
    Raw,
}

impl OutputFormat {
    pub fn extension(self) -> &'static str {
        match self {
            OutputFormat::Rendered(f) => f.extension(),
            OutputFormat::Raw => "corsnap",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OutputFormat::Rendered(f) => f.name(),
            OutputFormat::Raw => "raw",
        }
    }

    /// The format a file name's extension says, if it says one.
    pub fn from_path(path: &Path) -> Option<OutputFormat> {
        let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
        let ends = |ext: &str| name.len() > ext.len() && name.ends_with(ext);
        Some(if ends(".svg") {
            OutputFormat::Rendered(Format::Flamegraph)
        } else if ends(".json") {
            OutputFormat::Rendered(Format::Speedscope)
        } else if ends(".txt") || ends(".collapsed") || ends(".folded") {
            OutputFormat::Rendered(Format::Collapsed)
        } else if ends(".pb.gz") || ends(".pprof") || ends(".pb") {
            OutputFormat::Rendered(Format::Pprof)
        } else if ends(".corsnap") {
            OutputFormat::Raw
        } else {
            return None;
        })
    }

    /// The format to write: `--format` if given, else what the output
    /// file's extension says, else a flame graph. A `--format` that the
    /// extension contradicts is refused rather than written under a
    /// misleading name.
    pub fn resolve(explicit: Option<OutputFormat>, output: Option<&Path>) -> Result<OutputFormat> {
        let implied = output.and_then(OutputFormat::from_path);
        match (explicit, implied) {
            (Some(f), Some(g)) if f != g => anyhow::bail!(
                "the output file {} is named like a {} file, but --format {} was given: drop one of them or make \
                 them agree ({} files end in .{})",
                output.map(|p| p.display().to_string()).unwrap_or_default(),
                g.name(),
                f.name(),
                f.name(),
                f.extension()
            ),
            (Some(f), _) | (None, Some(f)) => Ok(f),
            (None, None) => Ok(OutputFormat::Rendered(Format::Flamegraph)),
        }
    }
}

impl FromStr for OutputFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("raw") {
            return Ok(OutputFormat::Raw);
        }
        Format::from_str(s).map(OutputFormat::Rendered).map_err(|e| format!("{e}, raw"))
    }
}

/// An output file. A temporary file beside it is created up front, so a path
/// that cannot be written is refused before the program starts, not after
/// the recording; the profile is written there and renamed into place only
/// when complete, so an interrupted run never leaves an empty or half-written
/// file under the output's name.
#[derive(Debug)]
pub struct OutputFile {
    pub path: PathBuf,
    temp: PathBuf,
    file: Option<File>,
}

impl OutputFile {
    pub fn create(path: &Path) -> Result<OutputFile> {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let temp = path.with_file_name(format!(".{name}.corsnap-{}.tmp", std::process::id()));
        let file = File::create(&temp)
            .with_context(|| format!("cannot write the output file {}: choose another path with -o", path.display()))?;
        Ok(OutputFile { path: path.to_path_buf(), temp, file: Some(file) })
    }

    /// Writes the file's contents with `write`, then puts it in place.
    pub fn write_with(mut self, write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
        let path = self.path.clone();
        let file = self.file.take().expect("an output file is written once");
        let mut out = BufWriter::new(file);
        write(&mut out).and_then(|()| out.flush()).with_context(|| format!("writing {}", path.display()))?;
        drop(out);
        std::fs::rename(&self.temp, &self.path).with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    pub fn write_profile(self, profile: &Profile, format: Format, options: &WriteOptions) -> Result<()> {
        self.write_with(|out| writer_for(format).write(profile, options, out))
    }

    /// Removes the temporary file: nothing will be written.
    pub fn discard(mut self) {
        self.file = None;
        let _ = std::fs::remove_file(&self.temp);
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        // Dropped unwritten (an error on the way): leave nothing behind.
        if self.file.is_some() {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// Where each event kind's profile goes: one file for formats that hold
/// several profiles (raw, pprof), else one file per kind (`p.svg` becomes
/// `p.cpu.svg`, `p.exceptions.svg` when both are recorded). All are created
/// before recording starts.
#[derive(Debug)]
pub struct Outputs {
    pub format: OutputFormat,
    files: Vec<(Option<EventKind>, OutputFile)>,
}

impl Outputs {
    pub fn create(path: &Path, format: OutputFormat, kinds: &[EventKind]) -> Result<Outputs> {
        let mut files = Vec::new();
        let per_kind = matches!(format, OutputFormat::Rendered(f) if !f.holds_many_kinds()) && kinds.len() > 1;
        if per_kind {
            for &kind in kinds {
                match OutputFile::create(&path_for_kind(path, kind)) {
                    Ok(f) => files.push((Some(kind), f)),
                    Err(e) => return Err(e),
                }
            }
        } else {
            files.push((None, OutputFile::create(path)?));
        }
        Ok(Outputs { format, files })
    }

    pub fn paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|(_, f)| f.path.clone()).collect()
    }

    /// Deletes the temporary files: nothing was recorded into them.
    pub fn remove_all(self) {
        for (_, f) in self.files {
            f.discard();
        }
    }

    /// The one file of a raw recording.
    pub fn into_single(mut self) -> OutputFile {
        self.files.swap_remove(0).1
    }

    /// Writes each file: a kind's profile, or (for a single file) the whole
    /// profile, or its only kind for single-profile formats.
    pub fn write(self, profile: &Profile, options: &WriteOptions) -> Result<()> {
        let OutputFormat::Rendered(format) = self.format else {
            anyhow::bail!("raw recordings are written as they arrive");
        };
        for (kind, file) in self.files {
            match kind {
                Some(kind) => file.write_profile(&profile.only(kind), format, options)?,
                None if format.holds_many_kinds() => file.write_profile(profile, format, options)?,
                None => {
                    let kinds = profile.kinds();
                    let only = if kinds.len() == 1 { profile.only(kinds[0]) } else { profile.clone() };
                    file.write_profile(&only, format, options)?
                }
            }
        }
        Ok(())
    }
}

/// `p.svg` → `p.cpu.svg`; `run.speedscope.json` → `run.cpu.speedscope.json`.
pub fn path_for_kind(path: &Path, kind: EventKind) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let new_name = match name.find('.') {
        Some(dot) if dot > 0 => format!("{}.{}{}", &name[..dot], kind.name(), &name[dot..]),
        _ => format!("{name}.{}", kind.name()),
    };
    path.with_file_name(new_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_goes_before_the_first_extension() {
        assert_eq!(path_for_kind(Path::new("/tmp/p.svg"), EventKind::Cpu), PathBuf::from("/tmp/p.cpu.svg"));
        assert_eq!(
            path_for_kind(Path::new("run.speedscope.json"), EventKind::Exceptions),
            PathBuf::from("run.exceptions.speedscope.json")
        );
        assert_eq!(path_for_kind(Path::new("out"), EventKind::Gc), PathBuf::from("out.gc"));
    }

    #[test]
    fn the_extension_chooses_the_format_and_a_contradiction_is_refused() {
        let f = |p: &str| OutputFormat::from_path(Path::new(p));
        assert_eq!(f("p.json"), Some(OutputFormat::Rendered(Format::Speedscope)));
        assert_eq!(f("p.speedscope.json"), Some(OutputFormat::Rendered(Format::Speedscope)));
        assert_eq!(f("p.SVG"), Some(OutputFormat::Rendered(Format::Flamegraph)));
        assert_eq!(f("p.txt"), Some(OutputFormat::Rendered(Format::Collapsed)));
        assert_eq!(f("p.pb.gz"), Some(OutputFormat::Rendered(Format::Pprof)));
        assert_eq!(f("run.corsnap"), Some(OutputFormat::Raw));
        assert_eq!(f("profile"), None);
        let resolve = |explicit: Option<&str>, path: Option<&str>| {
            OutputFormat::resolve(explicit.map(|e| e.parse().unwrap()), path.map(Path::new))
        };
        assert_eq!(resolve(None, Some("p.json")).unwrap(), OutputFormat::Rendered(Format::Speedscope));
        assert_eq!(resolve(None, None).unwrap(), OutputFormat::Rendered(Format::Flamegraph));
        assert_eq!(resolve(Some("collapsed"), Some("p.out")).unwrap(), OutputFormat::Rendered(Format::Collapsed));
        let err = resolve(Some("flamegraph"), Some("p.json")).unwrap_err().to_string();
        assert!(err.contains("named like a speedscope file") && err.contains("--format flamegraph"), "{err}");
    }
}
