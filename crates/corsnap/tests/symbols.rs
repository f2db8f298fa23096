//! `--symbols DIR`: native frames of a stripped library named from the debug
//! files in a folder the user names, at launch and at attach; a debug file
//! of another build (its build id differs) names nothing; a folder that is
//! not there is refused before the program runs.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::{corsnap_bin, describe, parse_collapsed, record, repo_root, scratch, Runtime, Service, Stack};

/// The library built from `tests/programs/nativesyms.c`, stripped, with its
/// debug file in `syms/` and the debug file of a different build in
/// `other/`.
struct NativeLibrary {
    library: PathBuf,
    syms: PathBuf,
    other: PathBuf,
}

fn run(program: &str, args: &[&str]) {
    let status = Command::new(program).args(args).status().unwrap_or_else(|e| panic!("running {program}: {e}"));
    assert!(status.success(), "{program} {args:?} failed");
}

fn build_library(dir: &Path) -> NativeLibrary {
    let source = repo_root().join("tests/programs/nativesyms.c");
    let source = source.to_str().unwrap();
    let library = dir.join("lib/libnativesyms.so");
    let syms = dir.join("syms");
    let other = dir.join("other");
    for d in [library.parent().unwrap(), &syms, &other] {
        std::fs::create_dir_all(d).unwrap();
    }
    let build = |out: &Path, variant: &str| {
        let define = format!("-DVARIANT={variant}");
        run("cc", &["-O1", "-g", "-shared", "-fPIC", "-Wl,--build-id", &define, "-o", out.to_str().unwrap(), source]);
    };
    // Another build: different code, so a different build id.
    let other_build = dir.join("other-build.so");
    build(&other_build, "2");
    run(
        "objcopy",
        &["--only-keep-debug", other_build.to_str().unwrap(), other.join("libnativesyms.so.dbg").to_str().unwrap()],
    );
    build(&library, "1");
    run(
        "objcopy",
        &["--only-keep-debug", library.to_str().unwrap(), syms.join("libnativesyms.so.dbg").to_str().unwrap()],
    );
    run("strip", &["--strip-all", library.to_str().unwrap()]);
    NativeLibrary { library, syms, other }
}

/// The weight of stacks through `NativeSpin.Spin`, and of those whose leaf is
/// the library's hidden function by name.
fn spin_weights(stacks: &[Stack]) -> (u64, u64) {
    let spin: Vec<&Stack> = stacks.iter().filter(|s| s.frames.iter().any(|f| f == "NativeSpin.Spin")).collect();
    let named = spin
        .iter()
        .filter(|s| s.frames.last().is_some_and(|f| f == "libnativesyms.so!corsnap_hidden_spin"))
        .map(|s| s.count)
        .sum();
    (spin.iter().map(|s| s.count).sum(), named)
}

fn launch(lib: &NativeLibrary, dir: &Path, name: &str, extra: &[&str]) -> Vec<Stack> {
    let out = dir.join(format!("{name}.txt"));
    let mut args = vec!["-f", "collapsed", "-o", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    let output = record(Runtime::Net10, "nativesyms", &[lib.library.to_str().unwrap(), "2"], &args, None);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    parse_collapsed(&std::fs::read_to_string(&out).unwrap())
}

#[test]
fn a_stripped_librarys_frames_are_named_from_the_debug_files_in_the_symbols_folder() {
    let dir = scratch("symbols-launch");
    let lib = build_library(&dir);

    let plain = launch(&lib, &dir, "plain", &[]);
    let (spin, named) = spin_weights(&plain);
    assert!(spin > 0, "{}", describe(&plain));
    assert_eq!(named, 0, "without its debug file the hidden function has no name:\n{}", describe(&plain));

    let with_symbols = launch(&lib, &dir, "symbols", &["--symbols", lib.syms.to_str().unwrap()]);
    let (spin, named) = spin_weights(&with_symbols);
    assert!(
        named as f64 >= 0.8 * spin as f64,
        "the hidden function is named in {named} of {spin} ns through Spin:\n{}",
        describe(&with_symbols)
    );

    let other = launch(&lib, &dir, "other", &["--symbols", lib.other.to_str().unwrap()]);
    let (spin, named) = spin_weights(&other);
    assert!(spin > 0, "{}", describe(&other));
    assert_eq!(named, 0, "another build's debug file names nothing:\n{}", describe(&other));
}

#[test]
fn a_symbols_folder_that_is_not_there_is_refused_before_the_program_runs() {
    let dir = scratch("symbols-missing");
    let marker = dir.join("ran");
    let output = Command::new(corsnap_bin())
        .args(["record", "--symbols", "/nonexistent/corsnap-symbols", "-o"])
        .arg(dir.join("p.svg"))
        .args(["--", "touch"])
        .arg(&marker)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--symbols /nonexistent/corsnap-symbols: not a folder"), "{stderr}");
    assert!(!marker.exists(), "the program ran");
}

#[test]
fn an_attached_recording_names_frames_from_the_symbols_folder() {
    let dir = scratch("symbols-attach");
    let lib = build_library(&dir);
    let service = Service::start_program(Runtime::Net10, "nativesyms", &[lib.library.to_str().unwrap(), "serve"], &[]);
    let out = dir.join("p.txt");
    let pid = service.pid.to_string();
    let output = Command::new(corsnap_bin())
        .args(["record", "--pid", &pid, "-d", "1.5", "-f", "collapsed", "--symbols"])
        .arg(&lib.syms)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    let (spin, named) = spin_weights(&stacks);
    assert!(
        spin > 0 && named as f64 >= 0.8 * spin as f64,
        "the hidden function is named in {named} of {spin} ns through Spin:\n{}",
        describe(&stacks)
    );
    service.wait_agent_gone();
}
