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

/// An output file, created up front so a path that cannot be written is
/// refused before the program starts, not after the recording.
#[derive(Debug)]
pub struct OutputFile {
    pub path: PathBuf,
    file: File,
}

impl OutputFile {
    pub fn create(path: &Path) -> Result<OutputFile> {
        let file = File::create(path)
            .with_context(|| format!("cannot write the output file {}: choose another path with -o", path.display()))?;
        Ok(OutputFile { path: path.to_path_buf(), file })
    }

    pub fn into_writer(self) -> BufWriter<File> {
        BufWriter::new(self.file)
    }

    pub fn write_profile(self, profile: &Profile, format: Format, threads: bool) -> Result<()> {
        let path = self.path.clone();
        let mut out = self.into_writer();
        let options = WriteOptions { threads, title: String::new() };
        writer_for(format).write(profile, &options, &mut out).with_context(|| format!("writing {}", path.display()))?;
        out.flush().with_context(|| format!("writing {}", path.display()))?;
        Ok(())
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
                    Err(e) => {
                        for (_, f) in &files {
                            let _ = std::fs::remove_file(&f.path);
                        }
                        return Err(e);
                    }
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

    /// Deletes the files: nothing was recorded into them.
    pub fn remove_all(&self) {
        for (_, f) in &self.files {
            let _ = std::fs::remove_file(&f.path);
        }
    }

    /// The one file of a raw recording.
    pub fn into_single(mut self) -> OutputFile {
        self.files.swap_remove(0).1
    }

    /// Writes each file: a kind's profile, or (for a single file) the whole
    /// profile, or its only kind for single-profile formats.
    pub fn write(self, profile: &Profile, threads: bool) -> Result<()> {
        let OutputFormat::Rendered(format) = self.format else {
            anyhow::bail!("raw recordings are written as they arrive");
        };
        for (kind, file) in self.files {
            match kind {
                Some(kind) => file.write_profile(&profile.only(kind), format, threads)?,
                None if format.holds_many_kinds() => file.write_profile(profile, format, threads)?,
                None => {
                    let kinds = profile.kinds();
                    let only = if kinds.len() == 1 { profile.only(kinds[0]) } else { profile.clone() };
                    file.write_profile(&only, format, threads)?
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
}
