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
