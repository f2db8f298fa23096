//! `corsnap report`: render a raw recording, through the same
//! [`ProfileBuilder`] the live recording uses.

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use corsnap_profile::processes::ProcessProfiles;
use corsnap_profile::ProfileBuilder;
use corsnap_wire::{read_message, read_raw_header};

use crate::output::{OutputFormat, Outputs};

#[derive(Debug, Clone)]
pub struct ReportOptions {
    pub input: PathBuf,
    pub output: Option<PathBuf>,
    pub format: Option<OutputFormat>,
    pub threads: bool,
    pub title: String,
    pub inverted: bool,
    pub native: corsnap_profile::NativeFrames,
    pub roots: corsnap_profile::RootFrames,
    pub raw_names: bool,
    /// Frames split by source line, named `Method (File.cs:42)`.
    pub lines: bool,
}

pub fn run(options: &ReportOptions) -> Result<()> {
    let format = match OutputFormat::resolve(options.format, options.output.as_deref())? {
        OutputFormat::Rendered(format) => format,
        OutputFormat::Raw => {
            bail!("the input is already a raw recording: choose --format flamegraph, speedscope, collapsed or pprof")
        }
    };
    if options.inverted && format != corsnap_profile::writers::Format::Flamegraph {
        bail!(
            "--inverted draws flame graphs top down, but the output is {}",
            OutputFormat::Rendered(format).description()
        );
    }
    if let Some(note) = options
        .output
        .as_deref()
        .and_then(|o| crate::output::unknown_extension_note(options.format, o, OutputFormat::Rendered(format)))
    {
        eprintln!("corsnap: warning: {note}");
    }
    // Next to the input, named after it: run.corsnap -> run.svg.
    let default_name = || {
        let stem = options.input.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let stem = if stem.is_empty() { "profile".to_string() } else { stem };
        format!("{stem}.{}", format.extension())
    };
    let output = match &options.output {
        Some(output) => crate::output::output_path(Some(output), default_name)?,
        None => options.input.with_file_name(default_name()),
    };
    let file = File::open(&options.input).with_context(|| format!("cannot open {}", options.input.display()))?;
    let mut input = BufReader::new(file);
    read_raw_header(&mut input).with_context(|| format!("reading {}", options.input.display()))?;
    let mut builder = ProfileBuilder::new();
    builder.set_native_frames(options.native);
    builder.set_root_frames(options.roots);
    // A recording of several processes (`record --subprocesses`) names each
    // before its messages; each goes to a builder of its own.
    let mut builder = ProcessProfiles::new(builder, options.native, options.roots);
    if crate::output::reads_pdbs(options.lines, OutputFormat::Rendered(format)) {
        builder.set_source_locators(corsnap::source_lines::PdbLocator::boxed);
    }
    let mut scratch = Vec::new();
    loop {
        match read_message(&mut input, &mut scratch) {
            Ok(Some(msg)) => builder.apply(&msg),
            Ok(None) => break,
            Err(e) => {
                // A recording cut short (the disk filled, the CLI was killed)
                // still renders everything before the damage.
                eprintln!(
                    "corsnap: warning: {} is damaged after {} samples ({e}); rendering what precedes it",
                    options.input.display(),
                    builder.sample_count()
                );
                break;
            }
        }
    }
    let samples = builder.sample_count();
    let profile = builder.finish();
    let kinds = profile.kinds();
    let outputs = Outputs::create(&output, OutputFormat::Rendered(format), &kinds)?;
    let paths = outputs.describe();
    let write_options = corsnap_profile::writers::WriteOptions {
        threads: options.threads,
        title: options.title.clone(),
        inverted: options.inverted,
        raw_names: options.raw_names,
        lines: options.lines,
    };
    outputs.write(&profile, &write_options, &[])?;
    eprintln!("corsnap: wrote {} ({samples} samples)", paths.join(", "));
    Ok(())
}
