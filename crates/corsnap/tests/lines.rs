//! Source lines (`--lines`) end to end: `tests/programs/hotline.cs`, compiled
//! by Roslyn with a portable PDB, spends its time in a loop written on one
//! line, called from one line; the lines are found by their marker comments.
//! With `--lines` its frames carry those lines (both engines, a PDB beside
//! the assembly or embedded in it, live or re-rendered from a raw
//! recording, and in pprof's locations); a PDB from another build gives no
//! lines at all, and says so once.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use support::{corsnap_bin, parse_collapsed, record_collapsed, repo_root, scratch, Runtime, Stack};

const SOURCE: &str = "tests/programs/hotline.cs";

/// The line (1-based) of `hotline.cs` that holds `marker`.
fn marker_line(marker: &str) -> u32 {
    let text = std::fs::read_to_string(repo_root().join(SOURCE)).unwrap();
    let at = text.lines().position(|l| l.contains(marker)).unwrap_or_else(|| panic!("no {marker:?} in {SOURCE}"));
    at as u32 + 1
}

fn hot_line() -> u32 {
    marker_line("// corsnap-test: hot loop")
}

fn call_line() -> u32 {
    marker_line("// corsnap-test: call")
}

/// Compiles `source` with `scripts/build-cs.sh` into `out` (`debug`:
/// `portable` or `embedded`), returning the `.dll`.
fn build(source: &Path, out: &Path, runtime: Runtime, debug: &str) -> PathBuf {
    let arg = match runtime {
        Runtime::Net10 => "10",
        Runtime::Net9 => "9",
        Runtime::Net8 => "8",
        Runtime::Core31 => "3.1",
    };
    let status = Command::new("bash")
        .arg(repo_root().join("scripts/build-cs.sh"))
        .arg(source)
        .arg(out)
        .arg(arg)
        .env("CORSNAP_CSC_DEBUG", debug)
        .status()
        .unwrap();
    assert!(status.success(), "compiling {} failed", source.display());
    out.join("hotline.dll")
}

/// `corsnap record ARGS -- dotnet DLL 1.5`.
fn record_dll(runtime: Runtime, dll: &Path, args: &[&str]) -> Output {
    let output = Command::new(corsnap_bin())
        .arg("record")
        .args(args)
        .arg("--")
        .arg(runtime.dotnet())
        .arg(dll)
        .arg("1.5")
        .env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(output.status.success(), "corsnap record failed: {}", String::from_utf8_lossy(&output.stderr));
    output
}

/// Weight of the stacks whose leaf-most `HotLine.Spin…` frame is named
/// `spin`, and whose frame below it is named `main`; and of all stacks with
/// a `HotLine.Spin…` frame.
fn spin_weights(stacks: &[Stack], spin: &str, main: &str) -> (u64, u64) {
    let mut matching = 0;
    let mut all = 0;
    for s in stacks {
        let Some(at) = s.frames.iter().rposition(|f| f.starts_with("HotLine.Spin")) else { continue };
        all += s.count;
        if s.frames[at] == spin && at > 0 && s.frames[at - 1] == main {
            matching += s.count;
        }
    }
    (matching, all)
}

fn assert_at_lines(stacks: &[Stack], what: &str) {
    let spin = format!("HotLine.Spin (hotline.cs:{})", hot_line());
    let main = format!("HotLine.Main (hotline.cs:{})", call_line());
    let (at_lines, all) = spin_weights(stacks, &spin, &main);
    // The rest: the loop's prolog and epilog, which have no line.
    assert!(
        all > 0 && at_lines as f64 >= 0.9 * all as f64,
        "{what}: {at_lines} of {all} ns of Spin at `{main};{spin}`; stacks:\n{stacks:#?}"
    );
}

fn no_lines(stacks: &[Stack]) -> bool {
    stacks.iter().all(|s| s.frames.iter().all(|f| !f.contains("(hotline.cs:")))
}

fn hot_loop_shows_at_its_line(runtime: Runtime) {
    for engine in ["signal", "suspend"] {
        let (stacks, _) = record_collapsed(runtime, "hotline", "1.5", &["--lines", "--sampler", engine]);
        assert_at_lines(&stacks, engine);
    }
    // Without --lines, one frame per method, as before.
    let (stacks, _) = record_collapsed(runtime, "hotline", "1.5", &[]);
    assert!(no_lines(&stacks), "lines without --lines: {stacks:#?}");
    let (named, all) = spin_weights(&stacks, "HotLine.Spin", "HotLine.Main");
    assert!(named == all && all > 0, "{named} of {all}: {stacks:#?}");
}
on_each_runtime!(hot_loop, hot_loop_shows_at_its_line);

#[test]
fn hot_loop_shows_at_its_line_on_core31() {
    let (stacks, _) = record_collapsed(Runtime::Core31, "hotline", "1.5", &["--lines"]);
    assert_at_lines(&stacks, "3.1");
}

fn embedded_pdb_gives_lines(runtime: Runtime) {
    let dir = scratch(&format!("lines-embedded-{runtime:?}"));
    let dll = build(&repo_root().join(SOURCE), &dir.join("bin"), runtime, "embedded");
    assert!(!dll.with_extension("pdb").exists(), "csc -debug:embedded wrote a PDB beside the assembly");
    let out = dir.join("out.txt");
    record_dll(runtime, &dll, &["-f", "collapsed", "-o", out.to_str().unwrap(), "--lines"]);
    assert_at_lines(&parse_collapsed(&std::fs::read_to_string(&out).unwrap()), "embedded PDB");
}
on_each_runtime!(embedded, embedded_pdb_gives_lines);

fn a_pdb_from_another_build_gives_no_lines(runtime: Runtime) {
    let dir = scratch(&format!("lines-mismatch-{runtime:?}"));
    let old = build(&repo_root().join(SOURCE), &dir.join("old"), runtime, "portable");
    // The same program one line further down: the old PDB's lines would
    // all be one off.
    let source = dir.join("src/hotline.cs");
    std::fs::create_dir_all(source.parent().unwrap()).unwrap();
    let text = std::fs::read_to_string(repo_root().join(SOURCE)).unwrap();
    std::fs::write(&source, format!("// one line more\n{text}")).unwrap();
    let new = build(&source, &dir.join("new"), runtime, "portable");
    std::fs::copy(old.with_extension("pdb"), new.with_extension("pdb")).unwrap();
    let out = dir.join("out.txt");
    let output = record_dll(runtime, &new, &["-f", "collapsed", "-o", out.to_str().unwrap(), "--lines"]);
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    assert!(no_lines(&stacks), "a mismatched PDB gave lines: {stacks:#?}");
    assert!(stacks.iter().any(|s| s.frames.iter().any(|f| f == "HotLine.Spin")), "{stacks:#?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let said = stderr.lines().filter(|l| l.contains("hotline.pdb") && l.contains("another build")).count();
    assert_eq!(said, 1, "the mismatch is said once:\n{stderr}");
    assert!(stderr.contains(new.to_str().unwrap()), "names the assembly:\n{stderr}");
}
on_each_runtime!(mismatch, a_pdb_from_another_build_gives_no_lines);

/// A raw recording keeps the IL offsets: `report --lines` puts the lines on,
/// and pprof gets them in its locations without `--lines`.
fn raw_recordings_render_lines_later(runtime: Runtime) {
    let dir = scratch(&format!("lines-raw-{runtime:?}"));
    let raw = dir.join("run.corsnap");
    record_dll(runtime, &support::compiled("hotline", runtime), &["-o", raw.to_str().unwrap()]);
    let report = |args: &[&str]| {
        let output = Command::new(corsnap_bin()).arg("report").arg(&raw).args(args).output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    };
    let collapsed = dir.join("out.txt");
    report(&["-f", "collapsed", "--lines", "-o", collapsed.to_str().unwrap()]);
    assert_at_lines(&parse_collapsed(&std::fs::read_to_string(&collapsed).unwrap()), "report --lines");
    report(&["-f", "collapsed", "-o", collapsed.to_str().unwrap()]);
    assert!(no_lines(&parse_collapsed(&std::fs::read_to_string(&collapsed).unwrap())));

    let pprof = dir.join("out.pb.gz");
    report(&["-o", pprof.to_str().unwrap()]);
    let summary = corsnap_profile::writers::decode_pprof(&std::fs::read(&pprof).unwrap()).unwrap();
    let spin: Vec<_> = summary.lines.iter().filter(|(name, _, _)| name == "HotLine.Spin").collect();
    assert!(
        spin.iter().any(|(_, file, line)| file.ends_with("hotline.cs") && *line == i64::from(hot_line())),
        "pprof locations of Spin: {spin:?}"
    );
    assert!(summary.function_names.iter().all(|n| !n.contains("(hotline.cs:")), "{:?}", summary.function_names);
}
on_each_runtime!(raw, raw_recordings_render_lines_later);

/// The PDB reading on its own, on Roslyn's output: the assembly's debug
/// directory, the embedded PDB, the id check, and IL offsets to lines.
mod pdb {
    use super::*;
    use corsnap::source_lines::{inflate_embedded_pdb, read_debug_directory, AssemblyLines, Mismatch, PdbLocator};
    use corsnap_profile::Assembly;

    /// `HotLine.Spin`, the first method Roslyn emits (its `MethodDef` row 1).
    const SPIN: u32 = 0x0600_0001;

    /// Every line Spin's IL offsets map to.
    fn spin_lines(lines: &AssemblyLines) -> Vec<u32> {
        let mut found: Vec<u32> = (0..64).filter_map(|il| lines.line(SPIN, il)).map(|l| l.line).collect();
        found.dedup();
        found
    }

    #[test]
    fn a_pdb_beside_maps_il_offsets_to_lines() {
        let dll = support::compiled("hotline", Runtime::Net10);
        let image = std::fs::read(&dll).unwrap();
        let debug = read_debug_directory(&image).unwrap();
        assert!(debug.embedded.is_none());
        assert!(debug.pdb_path.ends_with("hotline.pdb"), "{debug:?}");
        let pdb = std::fs::read(dll.with_extension("pdb")).unwrap();
        let lines = AssemblyLines::from_pdb(&pdb, debug.pdb_id).unwrap();
        let found = spin_lines(&lines);
        // The method's lines, the loop's among them; no hidden sequence
        // point (line 0xFEEFEE) shows.
        assert!(found.contains(&hot_line()), "{found:?}");
        assert!(found.iter().all(|&l| l >= hot_line() - 4 && l <= hot_line() + 2), "{found:?}");
        let file = lines.line(SPIN, 0).unwrap().file;
        assert!(file.ends_with("hotline.cs"), "{file}");
        // Not a method token, or a method past the table: nothing.
        assert_eq!(lines.line(0x0200_0001, 0), None);
        assert_eq!(lines.line(0x0600_0fff, 0), None);
    }

    #[test]
    fn the_id_must_match() {
        let dll = support::compiled("hotline", Runtime::Net10);
        let debug = read_debug_directory(&std::fs::read(&dll).unwrap()).unwrap();
        let pdb = std::fs::read(dll.with_extension("pdb")).unwrap();
        let (guid, stamp) = debug.pdb_id.unwrap();
        let mut other = guid;
        other[0] ^= 1;
        assert!(matches!(AssemblyLines::from_pdb(&pdb, Some((other, stamp))), Err(Mismatch::Id { .. })));
        assert!(matches!(AssemblyLines::from_pdb(&pdb, Some((guid, stamp + 1))), Err(Mismatch::Id { .. })));
        assert!(matches!(AssemblyLines::from_pdb(&pdb, None), Err(Mismatch::NoId)));
        assert_eq!(corsnap::source_lines::portable_pdb_id(&pdb), Some((guid, stamp)), "the PDB's own id");
        assert!(matches!(AssemblyLines::from_pdb(b"Microsoft C/C++ MSF 7.00\r\n", None), Err(Mismatch::NotPortable)));
        // The id the loaded image named wins over the file's: a file
        // rebuilt since the recording gives no lines.
        let assembly = Assembly {
            path: dll.to_string_lossy().into_owned(),
            pdb: Some(corsnap_wire::PdbReference { guid: other, stamp, path: String::new() }),
        };
        let err = PdbLocator::load(&assembly).unwrap_err();
        assert!(err.contains("another build") && err.contains("hotline.dll"), "{err}");
        let assembly = Assembly { pdb: None, ..assembly };
        assert!(PdbLocator::load(&assembly).unwrap().is_some());
        // No assembly, no PDB: no news.
        let nothing = Assembly { path: "/nonexistent/app.dll".into(), pdb: None };
        assert!(PdbLocator::load(&nothing).unwrap().is_none());
    }

    #[test]
    fn an_embedded_pdb_inflates_and_maps_like_one_beside() {
        let dir = scratch("lines-pdb-embedded");
        let dll = build(&repo_root().join(SOURCE), &dir, Runtime::Net10, "embedded");
        let debug = read_debug_directory(&std::fs::read(&dll).unwrap()).unwrap();
        let entry = debug.embedded.clone().expect("an EmbeddedPortablePdb entry");
        let pdb = inflate_embedded_pdb(&entry).unwrap();
        let lines = AssemblyLines::from_pdb(&pdb, debug.pdb_id).unwrap();
        assert!(spin_lines(&lines).contains(&hot_line()));
        // A lying size or a broken stream is refused, not trusted.
        let mut lying = entry.clone();
        lying[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(inflate_embedded_pdb(&lying).is_err());
        let mut short = entry.clone();
        short.truncate(entry.len() / 2);
        assert!(inflate_embedded_pdb(&short).is_err());
        assert!(inflate_embedded_pdb(b"MPDX\0\0\0\0").is_err());
    }
}
