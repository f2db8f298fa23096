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

    /// What the format is, in words.
    pub fn description(self) -> &'static str {
        match self {
            OutputFormat::Rendered(Format::Flamegraph) => "a flame graph (SVG)",
            OutputFormat::Rendered(Format::Speedscope) => "a speedscope profile (JSON)",
            OutputFormat::Rendered(Format::Collapsed) => "collapsed stacks (text)",
            OutputFormat::Rendered(Format::Pprof) => "a pprof profile (gzipped protobuf)",
            OutputFormat::Raw => "a raw recording",
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
        let word = s.trim().to_ascii_lowercase();
        let name = match word.as_str() {
            "raw" | "corsnap" => return Ok(OutputFormat::Raw),
            // The formats' file extensions name them too: `-f svg`.
            "svg" | "flame" => "flamegraph",
            "json" => "speedscope",
            "txt" | "folded" => "collapsed",
            "pb" | "pb.gz" => "pprof",
            other => other,
        };
        Format::from_str(name).map(OutputFormat::Rendered).map_err(|e| format!("{e}, raw"))
    }
}

/// How an output is written.
#[derive(Debug)]
enum Sink {
    /// A regular file, or a new one: written to a temporary file beside it,
    /// created up front (so a path that cannot be written is refused before
    /// the program starts, not after the recording), and renamed onto
    /// `target` only when complete, so an interrupted run never leaves an
    /// empty or half-written file under the output's name.
    Replace { target: PathBuf, temp: PathBuf, file: Option<File> },
    /// Anything else that exists (a device such as `/dev/null`, a FIFO, a
    /// terminal, `/dev/stdout`): written where it stands. Renaming onto it
    /// would replace the device or pipe with a regular file. A FIFO is
    /// opened only when the profile is written (opening it waits for a
    /// reader); anything else now.
    InPlace { file: Option<File>, append: bool },
    /// `-o -`: corsnap's standard output.
    Stdout,
}

/// An output file (or device, or stdout), checked when created and written
/// once.
#[derive(Debug)]
pub struct OutputFile {
    pub path: PathBuf,
    sink: Sink,
    /// Whether `write_with` has been called (the temporary file, if any, is
    /// in place or removed).
    done: bool,
}

/// What is found at an output path before anything is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    /// `-`: standard output.
    Stdout,
    /// Nothing: a new file.
    New,
    /// A regular file (or a link to one), replaced when the profile is complete.
    Regular,
    /// A directory: the output gets a default name inside it.
    Directory,
    /// A FIFO (or something that behaves like one, such as a pipe behind
    /// `/dev/stdout`).
    Fifo,
    /// A character or block device: `/dev/null`, a terminal.
    Device { null: bool },
}

impl PathKind {
    pub fn of(path: &Path) -> Result<PathKind> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        if path.as_os_str() == "-" {
            return Ok(PathKind::Stdout);
        }
        match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => Ok(PathKind::Directory),
            Ok(m) if m.is_file() => Ok(PathKind::Regular),
            Ok(m) if m.file_type().is_fifo() => Ok(PathKind::Fifo),
            // /dev/null is character device 1:3 on Linux.
            Ok(m) if m.file_type().is_char_device() || m.file_type().is_block_device() => {
                Ok(PathKind::Device { null: m.rdev() == 0x103 })
            }
            Ok(_) => anyhow::bail!(
                "cannot write the output file {}: it is neither a file nor a device (a socket?); choose another path \
                 with -o",
                path.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if path.as_os_str().to_string_lossy().ends_with('/') {
                    anyhow::bail!("cannot write the output file {}: there is no such directory", path.display());
                }
                Ok(PathKind::New)
            }
            Err(e) => Err(e).with_context(|| format!("cannot write the output file {}", path.display())),
        }
    }

    /// Whether the output is written where it stands (and so cannot take
    /// several files' worth of profiles).
    pub fn in_place(self) -> bool {
        matches!(self, PathKind::Stdout | PathKind::Fifo | PathKind::Device { .. })
    }
}

/// Whether this user may write to the (existing) file at `path`, by its
/// mode bits.
fn may_write(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(path) else { return false };
    let uid = corsnap_abi::current_uid();
    if uid == 0 {
        return true;
    }
    let mode = meta.mode();
    if meta.uid() == uid {
        return mode & 0o200 != 0;
    }
    // Group membership is not looked up: the group or other bit will do.
    mode & 0o022 != 0
}

/// Whether a path is reached through the kernel's own file systems
/// (`/dev/stdout` is a link to `/proc/self/fd/1`): such a path names an open
/// file, not a place in a directory, and is written in place even when it
/// is a regular file.
fn names_an_open_file(path: &Path) -> bool {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let kernel = |p: &Path| {
        p.starts_with("/proc")
            || p.starts_with("/dev/fd")
            || p == Path::new("/dev/stdout")
            || p == Path::new("/dev/stderr")
    };
    // `/dev/stdout` and the like are links into /proc; a file under
    // /dev/shm is a file like any other.
    kernel(&absolute) || std::fs::read_link(&absolute).is_ok_and(|target| kernel(&target))
}

impl OutputFile {
    pub fn create(path: &Path) -> Result<OutputFile> {
        let cannot = || format!("cannot write the output file {}: choose another path with -o", path.display());
        let sink = match PathKind::of(path)? {
            PathKind::Stdout => Sink::Stdout,
            PathKind::Directory => anyhow::bail!("cannot write the output file {}: it is a directory", path.display()),
            PathKind::Fifo => {
                // Not opened now: opening a FIFO to write waits for a
                // reader, and opening and closing it would hand a reader
                // that is already waiting an empty stream. Its mode says
                // whether we may write to it.
                if !may_write(path) {
                    anyhow::bail!("cannot write the output file {}: permission denied", path.display());
                }
                Sink::InPlace { file: None, append: false }
            }
            PathKind::Device { .. } => Sink::InPlace {
                file: Some(std::fs::OpenOptions::new().write(true).open(path).with_context(cannot)?),
                append: false,
            },
            PathKind::Regular if names_an_open_file(path) => Sink::InPlace {
                file: Some(std::fs::OpenOptions::new().append(true).open(path).with_context(cannot)?),
                append: true,
            },
            kind @ (PathKind::Regular | PathKind::New) => {
                // A link is followed: the file it points to is replaced and
                // the link stays.
                let target = if kind == PathKind::Regular {
                    std::fs::canonicalize(path).with_context(cannot)?
                } else {
                    path.to_path_buf()
                };
                let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let temp = target.with_file_name(format!(".{name}.corsnap-{}.tmp", std::process::id()));
                let file = File::create(&temp).with_context(cannot)?;
                Sink::Replace { target, temp, file: Some(file) }
            }
        };
        Ok(OutputFile { path: path.to_path_buf(), sink, done: false })
    }

    /// How the output is named in messages.
    pub fn describe(&self) -> String {
        match self.sink {
            Sink::Stdout => "standard output".to_string(),
            _ => self.path.display().to_string(),
        }
    }

    /// Writes the file's contents with `write`, then puts it in place.
    pub fn write_with(mut self, write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
        self.done = true;
        let path = self.path.clone();
        let writing = || format!("writing {}", path.display());
        match &mut self.sink {
            Sink::Replace { target, temp, file } => {
                let file = file.take().expect("an output file is written once");
                let mut out = BufWriter::new(file);
                if let Err(e) = write(&mut out).and_then(|()| out.flush()) {
                    drop(out);
                    let _ = std::fs::remove_file(&*temp);
                    return Err(e).with_context(writing);
                }
                drop(out);
                std::fs::rename(&*temp, &*target).with_context(writing)?;
            }
            Sink::InPlace { file, append } => {
                let file = match file.take() {
                    Some(f) => f,
                    None => {
                        std::fs::OpenOptions::new().write(true).append(*append).open(&path).with_context(writing)?
                    }
                };
                let mut out = BufWriter::new(file);
                write(&mut out).and_then(|()| out.flush()).with_context(writing)?;
            }
            Sink::Stdout => {
                let stdout = std::io::stdout();
                let mut out = BufWriter::new(stdout.lock());
                write(&mut out).and_then(|()| out.flush()).context("writing the profile to standard output")?;
            }
        }
        Ok(())
    }

    pub fn write_profile(self, profile: &Profile, format: Format, options: &WriteOptions) -> Result<()> {
        self.write_with(|out| writer_for(format).write(profile, options, out))
    }

    /// Removes the temporary file: nothing will be written.
    pub fn discard(mut self) {
        self.remove_temp();
    }

    fn remove_temp(&mut self) {
        if let Sink::Replace { temp, file, .. } = &mut self.sink {
            if file.take().is_some() {
                let _ = std::fs::remove_file(&*temp);
            }
        }
        self.done = true;
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        // Dropped unwritten (an error on the way): leave nothing behind.
        if !self.done {
            self.remove_temp();
        }
    }
}

/// The output path for `explicit` (`-o`): a directory gets `default_name`
/// inside it; no `-o` at all gets `default_name` in the current directory.
pub fn output_path(explicit: Option<&Path>, default_name: impl FnOnce() -> String) -> Result<PathBuf> {
    match explicit {
        None => Ok(PathBuf::from(default_name())),
        Some(path) => match PathKind::of(path)? {
            PathKind::Directory => Ok(path.join(default_name())),
            _ => Ok(path.to_path_buf()),
        },
    }
}

/// A note for an output whose name says no format corsnap knows (`-o prof`,
/// `-o x.html`) when `--format` was not given: the file holds the default
/// format all the same, and the user should know.
pub fn unknown_extension_note(explicit: Option<OutputFormat>, output: &Path, chosen: OutputFormat) -> Option<String> {
    if explicit.is_some() || OutputFormat::from_path(output).is_some() {
        return None;
    }
    if PathKind::of(output).map_or(true, |k| k.in_place() || k == PathKind::Directory) {
        return None;
    }
    let name = output.file_name()?.to_string_lossy().into_owned();
    let what = match name.rfind('.') {
        Some(dot) if dot > 0 => format!("corsnap does not know the extension .{} of {name}", &name[dot + 1..]),
        _ => format!("{name} has no extension"),
    };
    Some(format!(
        "{what}; writing {} there ({} files end in .{}; or choose a format with -f)",
        chosen.description(),
        chosen.name(),
        chosen.extension()
    ))
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
            match PathKind::of(path)? {
                // Each profile in turn, to the same device: `-o /dev/null`
                // (or a terminal) takes them all.
                PathKind::Device { .. } => {
                    for &kind in kinds {
                        files.push((Some(kind), OutputFile::create(path)?));
                    }
                }
                PathKind::Stdout | PathKind::Fifo => anyhow::bail!(
                    "{} can take one profile, but {} events make one each in the {} format: record one event, or \
                     choose -f pprof or -f raw, which hold them all in one file",
                    if path.as_os_str() == "-" {
                        "standard output (-o -)".to_string()
                    } else {
                        path.display().to_string()
                    },
                    kinds.len(),
                    format.name()
                ),
                _ => {
                    for &kind in kinds {
                        files.push((Some(kind), OutputFile::create(&path_for_kind(path, kind))?));
                    }
                }
            }
        } else {
            files.push((None, OutputFile::create(path)?));
        }
        Ok(Outputs { format, files })
    }

    /// The outputs, as messages name them (each once).
    pub fn describe(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for (_, f) in &self.files {
            let name = f.describe();
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
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
    /// profile, or its only kind for single-profile formats. A kind left out
    /// by `skip` (one the runtime refused to record) gets no file.
    pub fn write(self, profile: &Profile, options: &WriteOptions, skip: &[EventKind]) -> Result<()> {
        let OutputFormat::Rendered(format) = self.format else {
            anyhow::bail!("raw recordings are written as they arrive");
        };
        for (kind, file) in self.files {
            match kind {
                Some(kind) if skip.contains(&kind) => file.discard(),
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

    /// The outputs that `skip` leaves out, as messages name them.
    pub fn skipped(&self, skip: &[EventKind]) -> Vec<String> {
        self.files.iter().filter(|(k, _)| k.is_some_and(|k| skip.contains(&k))).map(|(_, f)| f.describe()).collect()
    }

    /// The outputs that `skip` leaves in, as messages name them (each once).
    pub fn kept(&self, skip: &[EventKind]) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for (kind, f) in &self.files {
            let name = f.describe();
            if !kind.is_some_and(|k| skip.contains(&k)) && !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }
}

/// `p.svg` → `p.cpu.svg`; `run.speedscope.json` → `run.cpu.speedscope.json`.
/// A name that already names an event kind has it replaced: `run.cpu.svg`
/// → `run.exceptions.svg`, never `run.cpu.cpu.svg`.
pub fn path_for_kind(path: &Path, kind: EventKind) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let parts: Vec<&str> = name.split('.').collect();
    if parts.len() >= 3 {
        let middle = &parts[1..parts.len() - 1];
        if let Some(i) = middle.iter().position(|p| EventKind::ALL.iter().any(|k| k.name() == *p)) {
            let mut parts: Vec<&str> = parts.clone();
            parts[i + 1] = kind.name();
            return path.with_file_name(parts.join("."));
        }
    }
    let new_name = match name.find('.') {
        Some(dot) if dot > 0 => format!("{}.{}{}", &name[..dot], kind.name(), &name[dot..]),
        _ => format!("{name}.{}", kind.name()),
    };
    path.with_file_name(new_name)
}

/// Whether a recording in `format` reads PDBs: with `--lines`, and for
/// pprof, whose locations carry lines either way. A raw recording keeps
/// the IL offsets and reads none (`report` does).
pub fn reads_pdbs(lines: bool, format: OutputFormat) -> bool {
    match format {
        OutputFormat::Raw => false,
        OutputFormat::Rendered(f) => lines || f == Format::Pprof,
    }
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
        // A name that names a kind already has it replaced.
        assert_eq!(path_for_kind(Path::new("run.cpu.svg"), EventKind::Cpu), PathBuf::from("run.cpu.svg"));
        assert_eq!(path_for_kind(Path::new("run.cpu.svg"), EventKind::Alloc), PathBuf::from("run.alloc.svg"));
        assert_eq!(path_for_kind(Path::new("cpu.svg"), EventKind::Wall), PathBuf::from("cpu.wall.svg"));
    }

    #[test]
    fn only_the_kernels_names_for_open_files_are_written_in_place_as_files() {
        assert!(names_an_open_file(Path::new("/dev/stdout")));
        assert!(names_an_open_file(Path::new("/proc/self/fd/1")));
        assert!(names_an_open_file(Path::new("/dev/fd/2")));
        assert!(!names_an_open_file(Path::new("/dev/shm/profile.svg")));
        assert!(!names_an_open_file(Path::new("profile.svg")));
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
