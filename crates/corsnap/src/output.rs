//! Where a profile goes: opened (and so checked) before anything runs, written
//! once recording ends.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{Context, Result};
use corsnap_profile::writers::{writer_for, Format, WriteOptions};
use corsnap_profile::Profile;

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
