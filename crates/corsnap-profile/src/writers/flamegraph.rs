//! Interactive SVG flame graph, drawn by inferno from the collapsed stacks.

use std::collections::BTreeMap;
use std::io::{self, BufWriter, Write};

use inferno::flamegraph::{self, Options};

use super::{collapsed_stacks, ProfileWriter, WriteOptions};
use crate::Profile;

/// What the placeholder SVG says when there is nothing to draw.
const NO_SAMPLES_MESSAGE: &str = "no samples were recorded";
/// Matches inferno's default width so an empty graph looks like its siblings.
const IMAGE_WIDTH: usize = 1200;

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FlamegraphWriter;

impl ProfileWriter for FlamegraphWriter {
    fn write(&self, profile: &Profile, options: &WriteOptions, out: &mut dyn Write) -> io::Result<()> {
        let title = options.title_for(&profile.meta);
        let stacks = collapsed_stacks(profile, options);
        let mut out = BufWriter::new(out);
        // inferno refuses input with no counts (and leaves an error SVG behind),
        // yet a run that caught nothing should still open in a browser.
        if stacks.values().all(|&weight| weight == 0) {
            write_no_samples_svg(&title, &mut out)?;
            return out.flush();
        }

        let shift = weight_shift(&stacks);
        let lines: Vec<String> = stacks.iter().map(|(stack, weight)| format!("{stack} {}", weight >> shift)).collect();
        let total: u64 = stacks.values().map(|&w| w >> shift).fold(0, u64::saturating_add);
        let (count_name, factor) = unit_for(super::single_kind(profile), total);
        let mut inferno_options = Options::default();
        let (title, full) = fit_title(&title);
        inferno_options.title = title;
        if let Some(full) = full {
            // The whole command line, where a reader of the SVG can find it.
            inferno_options.notes = full;
        }
        inferno_options.count_name = count_name.to_string();
        inferno_options.factor = factor * (1u64 << shift) as f64;
        if options.inverted {
            inferno_options.direction = flamegraph::Direction::Inverted;
        }
        inferno_options.image_width = Some(IMAGE_WIDTH);
        // inferno's default colours come from a random generator whose state
        // carries over between graphs; hashing names instead gives the same
        // picture for the same profile every time.
        inferno_options.deterministic = true;
        flamegraph::from_lines(&mut inferno_options, lines.iter().map(String::as_str), &mut out)?;
        out.flush()
    }
}

/// What the tooltips say a frame's weight is, and the factor from weights
/// to it: CPU and pause time in milliseconds (microseconds for short
/// profiles, nanoseconds for tiny ones, so small frames do not read 0),
/// bytes in kilobytes, counts as
/// counts. inferno rounds the scaled value to a whole number.
fn unit_for(kind: Option<crate::EventKind>, total: u64) -> (&'static str, f64) {
    use crate::EventKind;
    match kind {
        Some(EventKind::Cpu | EventKind::Gc) if total >= 10_000_000_000 => ("ms", 1e-6),
        Some(EventKind::Cpu | EventKind::Gc) if total >= 10_000_000 => ("µs", 1e-3),
        Some(EventKind::Cpu | EventKind::Gc) => ("ns", 1.0),
        Some(EventKind::Alloc) => ("KB", 1.0 / 1024.0),
        Some(EventKind::Exceptions) => ("exceptions", 1.0),
        Some(EventKind::ClassLoad) => ("class loads", 1.0),
        Some(EventKind::Wall) | None => ("samples", 1.0),
    }
}

/// The title as it fits across the graph (inferno centres it and lets it
/// run off both edges), and the whole one when it had to be cut.
fn fit_title(title: &str) -> (String, Option<String>) {
    // The title font is 17 px Verdana: about 10 px a character.
    const MAX_CHARS: usize = IMAGE_WIDTH / 10 - 6;
    let chars: Vec<char> = title.chars().collect();
    if chars.len() <= MAX_CHARS {
        return (title.to_string(), None);
    }
    let keep = MAX_CHARS - 1;
    let head: String = chars[..keep * 2 / 3].iter().collect();
    let tail: String = chars[chars.len() - (keep - keep * 2 / 3)..].iter().collect();
    (format!("{head}…{tail}"), Some(title.to_string()))
}

/// inferno adds all counts up in a `usize`, which weights from a damaged or
/// hostile raw recording can overflow (found by fuzz/fuzz_targets/raw_recording.rs).
/// Returns how many times to halve every weight so the total fits: the
/// picture keeps its proportions, and real profiles (totals far below 2^64)
/// are drawn unchanged.
fn weight_shift(stacks: &BTreeMap<String, u64>) -> u32 {
    let total: u128 = stacks.values().map(|&weight| u128::from(weight)).sum();
    let mut shift = 0;
    while total >> shift > usize::MAX as u128 {
        shift += 1;
    }
    shift
}

fn write_no_samples_svg(title: &str, out: &mut dyn Write) -> io::Result<()> {
    let title = escape_xml(title);
    let width = IMAGE_WIDTH;
    writeln!(out, r#"<?xml version="1.0" standalone="no"?>"#)?;
    writeln!(
        out,
        r#"<svg version="1.1" width="{width}" height="90" viewBox="0 0 {width} 90" xmlns="http://www.w3.org/2000/svg">"#
    )?;
    writeln!(out, r##"<rect x="0" y="0" width="100%" height="100%" fill="#eeeeee"/>"##)?;
    writeln!(out, r#"<text x="50%" y="30" text-anchor="middle" font-family="Verdana" font-size="17">{title}</text>"#)?;
    writeln!(
        out,
        r#"<text x="50%" y="65" text-anchor="middle" font-family="Verdana" font-size="14">{NO_SAMPLES_MESSAGE}</text>"#
    )?;
    writeln!(out, "</svg>")
}

fn escape_xml(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&apos;"),
            other => escaped.push(other),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Meta;

    fn render(profile: &Profile, options: &WriteOptions) -> String {
        let mut svg = Vec::new();
        FlamegraphWriter.write(profile, options, &mut svg).unwrap();
        String::from_utf8(svg).unwrap()
    }

    #[test]
    fn long_titles_are_cut_in_the_middle_to_fit_and_kept_whole_in_the_notes() {
        let long = format!("corsnap: dotnet app.dll {}", "--option value ".repeat(20));
        let (fitted, full) = fit_title(&long);
        assert!(fitted.chars().count() <= IMAGE_WIDTH / 10 - 6, "{fitted}");
        assert!(fitted.starts_with("corsnap: dotnet app.dll") && fitted.contains('…'), "{fitted}");
        assert_eq!(full.as_deref(), Some(long.as_str()));
        assert_eq!(fit_title("corsnap: dotnet app.dll"), ("corsnap: dotnet app.dll".to_string(), None));
    }

    #[test]
    fn cpu_weights_read_in_time_and_bytes_in_kilobytes() {
        use crate::EventKind;
        assert_eq!(unit_for(Some(EventKind::Cpu), 3_000_000_000), ("µs", 1e-3));
        assert_eq!(unit_for(Some(EventKind::Cpu), 16), ("ns", 1.0));
        assert_eq!(unit_for(Some(EventKind::Cpu), 30_000_000_000), ("ms", 1e-6));
        assert_eq!(unit_for(Some(EventKind::Alloc), 1 << 30).0, "KB");
        assert_eq!(unit_for(None, 5).0, "samples");
    }

    #[test]
    fn empty_profile_still_gives_an_svg() {
        let profile = Profile::new(Meta { command: "dotnet <app>.dll".to_string(), ..Meta::default() });
        let svg = render(&profile, &WriteOptions::default());
        assert!(svg.contains("<svg"), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"), "{svg}");
        assert!(svg.contains(NO_SAMPLES_MESSAGE), "{svg}");
        assert!(svg.contains("corsnap: dotnet &lt;app&gt;.dll"), "title must be escaped: {svg}");
    }
}
