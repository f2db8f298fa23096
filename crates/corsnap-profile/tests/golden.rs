//! Renders one hand-built profile in every format and compares the result
//! with the files under `tests/golden/`. After an intended change, run with
//! `UPDATE_GOLDEN=1` to rewrite them, then read the diff before keeping it.

use std::path::PathBuf;

use corsnap_profile::writers::{writer_for, Format, WriteOptions};
use corsnap_profile::{Meta, Profile, ProfileBuilder, RootFrames};
use corsnap_wire::Message;

const MAIN_THREAD: u64 = 0x7f00_0000_1000;
const WORKER_THREAD: u64 = 0x7f00_0000_2000;
const UNNAMED_THREAD: u64 = 0x7f00_0000_3000;

/// `FunctionID`s the sample stacks below refer to; `0` is a native run.
const MAIN: u64 = 0x100;
const LEDGER_POST: u64 = 0x200;
const ENTRY_SETTLE: u64 = 0x300;
const MONITOR_WAIT: u64 = 0x400;
const READ_FIELD: u64 = 0x500;
const WORKER_RUN: u64 = 0x600;
const DISPATCH: u64 = 0x700;
const NATIVE: u64 = 0;
/// Native frames as the signal engine names them.
const QSORT: u64 = corsnap_wire::NATIVE_FRAME_BIT | 0x7f10_0000_4000;
const MSORT: u64 = corsnap_wire::NATIVE_FRAME_BIT | 0x7f10_0000_5000;

const MS: u64 = 1_000_000;

/// Small, but with every shape the writers must get right: three threads
/// (one unnamed), a nested generic name, a native run, a truncated stack,
/// stacks repeated within and across threads, a weight above one, a name
/// containing `;`, samples that arrive out of time order, named native frames
/// between managed ones, and an unnamed thread labelled by the kernel's name.
fn representative_profile() -> Profile {
    let mut builder = ProfileBuilder::new();
    let functions = [
        (MAIN, "Shop.Program.Main", "Shop.dll"),
        (LEDGER_POST, "Shop.Billing.Ledger<TKey>.Post", "Shop.dll"),
        (ENTRY_SETTLE, "Shop.Billing.Ledger<TKey>+Entry.Settle<TValue>", "Shop.dll"),
        (MONITOR_WAIT, "System.Threading.Monitor.Wait", "System.Private.CoreLib.dll"),
        (READ_FIELD, "Shop.Csv.Reader.ReadField(char;int)", "Shop.dll"),
        (WORKER_RUN, "Shop.Worker.Run", "Shop.dll"),
        (DISPATCH, "System.Threading.ThreadPoolWorkQueue.Dispatch", "System.Private.CoreLib.dll"),
    ];
    let mut messages = vec![
        Message::Hello {
            protocol: 1,
            pid: 4242,
            runtime_version: "8.0.4".into(),
            info_version: 12,
            rate_hz: 99,
            attached: false,
        },
        Message::Recording { command: "dotnet Shop.dll --seed 7".into(), start_unix_ms: 1_700_000_000_000 },
        Message::Thread { thread_id: MAIN_THREAD, os_tid: 4242, name: "main".into() },
        Message::Thread { thread_id: WORKER_THREAD, os_tid: 4250, name: "worker-3".into() },
        Message::Thread { thread_id: UNNAMED_THREAD, os_tid: 4251, name: String::new() },
        Message::OsThreadName { os_tid: 4251, name: ".NET TP Worker".into() },
        Message::Function { function_id: QSORT, name: "libc.so.6!qsort".into(), module: "libc.so.6".into() },
        Message::Function { function_id: MSORT, name: "libc.so.6!msort_with_tmp".into(), module: "libc.so.6".into() },
    ];
    messages.extend(functions.iter().map(|&(function_id, name, module)| Message::Function {
        function_id,
        name: name.into(),
        module: module.into(),
    }));
    for message in &messages {
        builder.apply(message);
    }

    let settle_in_main = [ENTRY_SETTLE, LEDGER_POST, MAIN];
    builder.add_sample(10 * MS, MAIN_THREAD, false, &settle_in_main, 1);
    builder.add_sample(10 * MS, WORKER_THREAD, false, &[READ_FIELD, WORKER_RUN, DISPATCH], 1);
    builder.add_sample(10 * MS, UNNAMED_THREAD, false, &[NATIVE, DISPATCH], 1);
    builder.add_sample(20 * MS, MAIN_THREAD, false, &settle_in_main, 1);
    // Cut short by the agent: only the leaf-most frames survive.
    builder.add_sample(20 * MS, WORKER_THREAD, true, &[ENTRY_SETTLE, LEDGER_POST, WORKER_RUN], 1);
    builder.add_sample(20 * MS, UNNAMED_THREAD, false, &[MONITOR_WAIT, DISPATCH], 1);
    builder.add_sample(30 * MS, MAIN_THREAD, false, &[NATIVE, MONITOR_WAIT, MAIN], 1);
    // Arrives after the 40 ms sample but was taken before it.
    builder.add_sample(40 * MS, WORKER_THREAD, false, &[READ_FIELD, WORKER_RUN, DISPATCH], 2);
    builder.add_sample(35 * MS, WORKER_THREAD, false, &[ENTRY_SETTLE, LEDGER_POST, WORKER_RUN, DISPATCH], 1);
    builder.add_sample(40 * MS, MAIN_THREAD, false, &settle_in_main, 1);
    builder.add_sample(40 * MS, UNNAMED_THREAD, false, &[NATIVE, DISPATCH], 1);
    builder.add_sample(50 * MS, MAIN_THREAD, false, &[READ_FIELD, MSORT, QSORT, LEDGER_POST, MAIN], 1);
    builder.finish()
}

/// What a real application's profile is full of: names the C# compiler made
/// up (Roslyn's and Mono's) and the host's and runtime's frames under each
/// thread's first managed frame, with `roots` deciding what becomes of
/// those.
fn generated_names_profile(roots: RootFrames) -> Profile {
    const N: u64 = corsnap_wire::NATIVE_FRAME_BIT;
    let functions: &[(u64, &str, &str)] = &[
        (N | 1, "dotnet+0x6c48", "dotnet"),
        (N | 2, "libc.so.6!__libc_start_main_alias_2", "libc.so.6"),
        (N | 3, "libhostfxr.so!hostfxr_main_startupinfo", "libhostfxr.so"),
        (N | 4, "libhostpolicy.so!corehost_main", "libhostpolicy.so"),
        (N | 5, "libcoreclr.so+0x1ec8db", "libcoreclr.so"),
        (N | 6, "libc.so.6!clone3", "libc.so.6"),
        (N | 7, "libc.so.6!start_thread", "libc.so.6"),
        (N | 8, "libcoreclr.so+0x63cf50", "libcoreclr.so"),
        (N | 9, "libc.so.6!qsort", "libc.so.6"),
        (0x10, "Shop.Program.<Main>", "Shop.dll"),
        (0x11, "Shop.Program.Main", "Shop.dll"),
        (
            0x12,
            "System.Runtime.CompilerServices.AsyncMethodBuilderCore.Start<TStateMachine>",
            "System.Private.CoreLib.dll",
        ),
        (0x13, "Shop.Program+<Main>d__0.MoveNext", "Shop.dll"),
        (0x14, "Shop.OrderService.HandleAsync", "Shop.dll"),
        (0x15, "Shop.OrderService+<HandleAsync>d__4.MoveNext", "Shop.dll"),
        (0x16, "CommandLine.Core.InstanceChooser.<Choose>g__choose|1_1", "CommandLine.dll"),
        (0x17, "CommandLine.Core.InstanceBuilder+<>c__DisplayClass1_0<T>.<Build>b__5", "CommandLine.dll"),
        (0x18, "System.Linq.Enumerable.Sum", "System.Linq.dll"),
        (0x19, "Shop.Repo<T>+<GetItems>d__3<U>.MoveNext", "Shop.dll"),
        (0x1a, "Shop.Program+<Main>c__AnonStorey0.<>m__0", "Shop.dll"),
        (0x1b, "System.Threading.Thread.StartCallback", "System.Private.CoreLib.dll"),
        (0x1c, "Shop.Sorter.<Sort>m__2", "Shop.dll"),
        (0x1d, "Shop.Money.op_Addition", "Shop.dll"),
    ];
    let mut builder = ProfileBuilder::new();
    builder.set_root_frames(roots);
    builder.apply(&Message::Thread { thread_id: MAIN_THREAD, os_tid: 4242, name: "main".into() });
    builder.apply(&Message::Thread { thread_id: WORKER_THREAD, os_tid: 4250, name: "items".into() });
    for &(function_id, name, module) in functions {
        builder.apply(&Message::Function { function_id, name: name.into(), module: module.into() });
    }
    let host = [N | 5, N | 4, N | 3, N | 1, N | 2, N | 1];
    let main = |frames: &[u64]| [frames, &[0x13, 0x12, 0x11, 0x10], &host].concat();
    let thread = |frames: &[u64]| [frames, &[0x1b, N | 8, N | 8, N | 7, N | 6]].concat();
    builder.add_sample(10 * MS, MAIN_THREAD, false, &main(&[0x15, 0x12, 0x14]), 3);
    builder.add_sample(20 * MS, MAIN_THREAD, false, &main(&[0x1d, 0x16]), 2);
    builder.add_sample(30 * MS, MAIN_THREAD, false, &main(&[0x1c, N | 9, 0x17]), 1);
    builder.add_sample(40 * MS, WORKER_THREAD, false, &thread(&[0x19, 0x18, 0x1a]), 4);
    builder.add_sample(50 * MS, WORKER_THREAD, false, &[N | 8, N | 7, N | 6], 1);
    builder.finish()
}

fn render(profile: &Profile, format: Format, options: &WriteOptions) -> String {
    String::from_utf8(render_bytes(profile, format, options))
        .unwrap_or_else(|e| panic!("{format} output is not UTF-8: {e}"))
}

/// For binary formats (pprof is gzip-compressed protobuf).
fn render_bytes(profile: &Profile, format: Format, options: &WriteOptions) -> Vec<u8> {
    let mut out = Vec::new();
    writer_for(format).write(profile, options, &mut out).unwrap_or_else(|e| panic!("{format} writer failed: {e}"));
    out
}

fn with_threads() -> WriteOptions {
    WriteOptions { threads: true, ..WriteOptions::default() }
}

/// The exporter string carries the crate version, which should not make a
/// release bump rewrite the golden files.
fn without_version(speedscope: &str) -> String {
    speedscope.replace(concat!("\"corsnap ", env!("CARGO_PKG_VERSION"), "\""), "\"corsnap VERSION\"")
}

fn check_golden(file_name: &str, actual: &str) {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "tests", "golden", file_name].iter().collect();
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|value| value == "1") {
        std::fs::write(&path, actual).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {} ({e}); run with UPDATE_GOLDEN=1 to create it", path.display()));
    if expected == actual {
        return;
    }
    // SVG and JSON files are too long for assert_eq's dump to be readable;
    // the first difference is what a person needs to see.
    let first_difference =
        expected.bytes().zip(actual.bytes()).position(|(e, a)| e != a).unwrap_or(expected.len().min(actual.len()));
    let around = |text: &str| {
        let start = char_boundary_at_or_before(text, first_difference.saturating_sub(80));
        let end = char_boundary_at_or_before(text, (first_difference + 80).min(text.len()));
        text[start..end].to_string()
    };
    panic!(
        "{} differs from the output at byte {first_difference}\n--- expected ---\n{}\n--- actual ---\n{}\n\
         (rerun with UPDATE_GOLDEN=1 if the change is intended)",
        path.display(),
        around(&expected),
        around(actual),
    );
}

/// `str::floor_char_boundary` is not stable yet.
fn char_boundary_at_or_before(text: &str, mut index: usize) -> usize {
    while !text.is_char_boundary(index) {
        index -= 1;
    }
    index
}

#[test]
fn collapsed_matches_golden() {
    let profile = representative_profile();
    check_golden("collapsed.txt", &render(&profile, Format::Collapsed, &WriteOptions::default()));
    check_golden("collapsed-threads.txt", &render(&profile, Format::Collapsed, &with_threads()));
}

#[test]
fn flamegraph_matches_golden() {
    let profile = representative_profile();
    let svg = render(&profile, Format::Flamegraph, &WriteOptions::default());
    assert_eq!(svg, render(&profile, Format::Flamegraph, &WriteOptions::default()), "flame graph must be repeatable");
    check_golden("flamegraph.svg", &svg);
    check_golden("flamegraph-threads.svg", &render(&profile, Format::Flamegraph, &with_threads()));
}

#[test]
fn empty_flamegraph_matches_golden() {
    let profile = Profile::new(Meta { command: "dotnet Idle.dll".into(), ..Meta::default() });
    check_golden("flamegraph-empty.svg", &render(&profile, Format::Flamegraph, &WriteOptions::default()));
}

#[test]
fn speedscope_matches_golden() {
    let profile = representative_profile();
    let options = WriteOptions { title: "checkout under load".into(), ..WriteOptions::default() };
    check_golden("speedscope.json", &without_version(&render(&profile, Format::Speedscope, &options)));
}

#[test]
fn speedscope_profiles_pair_every_sample_with_a_weight() {
    let profile = representative_profile();
    let json = render(&profile, Format::Speedscope, &WriteOptions::default());
    let document: serde_json::Value = serde_json::from_str(&json).expect("speedscope output is JSON");
    let frame_count = document["shared"]["frames"].as_array().expect("shared frames").len();
    let profiles = document["profiles"].as_array().expect("profiles");
    assert_eq!(profiles.len(), profile.threads.len());
    let mut total_weight = 0;
    for thread_profile in profiles {
        let samples = thread_profile["samples"].as_array().expect("samples");
        let weights = thread_profile["weights"].as_array().expect("weights");
        assert_eq!(samples.len(), weights.len(), "{}", thread_profile["name"]);
        let weight: u64 = weights.iter().map(|w| w.as_u64().expect("integer weight")).sum();
        assert_eq!(thread_profile["endValue"].as_u64(), Some(weight));
        total_weight += weight;
        for frame in samples.iter().flat_map(|stack| stack.as_array().expect("stack")) {
            assert!(frame.as_u64().expect("frame index") < frame_count as u64);
        }
    }
    assert_eq!(total_weight, profile.total_weight());
}

#[test]
fn every_format_renders_an_empty_profile() {
    let profile = Profile::new(Meta::default());
    for &format in Format::all() {
        assert!(!render_bytes(&profile, format, &WriteOptions::default()).is_empty() || format == Format::Collapsed);
    }
    assert_eq!(render(&profile, Format::Collapsed, &with_threads()), "");
}

/// pprof's content is checked by the writer's own tests, which can decode
/// it; here, that it is gzip and that the same profile gives the same bytes.
#[test]
fn pprof_is_repeatable_gzip() {
    let profile = representative_profile();
    for options in [WriteOptions::default(), with_threads()] {
        let bytes = render_bytes(&profile, Format::Pprof, &options);
        assert_eq!(bytes[..2], [0x1f, 0x8b], "gzip magic");
        assert_eq!(bytes, render_bytes(&profile, Format::Pprof, &options), "pprof must be repeatable");
    }
}

#[test]
fn generated_names_and_roots_match_golden() {
    let profile = generated_names_profile(RootFrames::Fold);
    check_golden("names-collapsed.txt", &render(&profile, Format::Collapsed, &WriteOptions::default()));
    let options = WriteOptions { title: "names".into(), ..WriteOptions::default() };
    check_golden("names-speedscope.json", &without_version(&render(&profile, Format::Speedscope, &options)));
    let raw = WriteOptions { raw_names: true, ..WriteOptions::default() };
    let shown = generated_names_profile(RootFrames::Show);
    check_golden("names-collapsed-raw.txt", &render(&shown, Format::Collapsed, &raw));
}
