//! Readable names and folded roots under a real runtime: a recording keeps
//! the runtime's names, `report` shows the method a lambda was written in and
//! each thread's start as one frame, and `--raw-names --roots show` gives
//! back everything as walked.

mod support;

use std::process::Command;

use corsnap_profile::names::readable_name;
use support::{corsnap_bin, describe, parse_collapsed, record, scratch, Runtime, Stack};

/// `corsnap report` of `raw` into collapsed stacks, with `args`.
fn report(raw: &std::path::Path, name: &str, args: &[&str]) -> Vec<Stack> {
    let out = raw.with_file_name(name);
    let output = Command::new(corsnap_bin())
        .arg("report")
        .arg(raw)
        .args(["-f", "collapsed", "--threads", "-o"])
        .arg(&out)
        .args(args)
        .output()
        .expect("running corsnap report");
    assert!(output.status.success(), "corsnap report failed: {}", String::from_utf8_lossy(&output.stderr));
    parse_collapsed(&std::fs::read_to_string(&out).unwrap())
}

fn weight(stacks: &[&Stack]) -> u64 {
    stacks.iter().map(|s| s.count).sum()
}

#[test]
fn a_lambda_reads_as_its_method_and_every_thread_starts_with_one_frame() {
    // allocthreads: the "allocator" thread runs a lambda that captures a
    // local (`Allocators+<>c__DisplayClass…_0.<Main>b__0`); the main thread
    // runs Main.
    let dir = scratch("names-allocthreads");
    let raw = dir.join("run.corsnap");
    let output = record(Runtime::Net10, "allocthreads", &["1.5"], &["-o", raw.to_str().unwrap()], None);
    assert!(output.status.success(), "corsnap record failed: {}", String::from_utf8_lossy(&output.stderr));

    let stacks = report(&raw, "readable.txt", &[]);
    let all: Vec<&Stack> = stacks.iter().collect();
    let of = |thread: &str, method: &str| -> Vec<&Stack> {
        all.iter()
            .copied()
            .filter(|s| s.frames[0].starts_with(thread) && s.frames.iter().any(|f| f == method))
            .collect()
    };
    let text = of("allocator tid=", "Allocators.Bytes");
    let text_total = weight(&text);
    let lambda_under_thread_start: Vec<&Stack> = text
        .iter()
        .copied()
        .filter(|s| s.frames[1] == "[thread start]" && s.frames.iter().any(|f| f == "Allocators.Main.lambda#0"))
        .collect();
    assert!(
        text_total > 0 && weight(&lambda_under_thread_start) * 100 >= text_total * 90,
        "Bytes under [thread start] and Main.lambda#0: {} of {text_total}:\n{}",
        weight(&lambda_under_thread_start),
        describe(&stacks)
    );
    let main = of("", "Allocators.Text");
    let main_total = weight(&main);
    let main_under_host: Vec<&Stack> =
        main.iter().copied().filter(|s| s.frames[1] == "[host start-up]" && s.frames[2] == "Allocators.Main").collect();
    assert!(
        main_total > 0 && weight(&main_under_host) * 100 >= main_total * 90,
        "Text under [host start-up];Allocators.Main: {} of {main_total}:\n{}",
        weight(&main_under_host),
        describe(&stacks)
    );
    for s in &stacks {
        for f in &s.frames {
            assert!(!f.contains("DisplayClass") && !f.contains("__libc_start"), "{f} in {:?}", s.frames);
        }
    }

    // The recording kept everything.
    let raw_stacks = report(&raw, "raw.txt", &["--raw-names", "--roots", "show"]);
    let frames = || raw_stacks.iter().flat_map(|s| s.frames.iter());
    let lambda = |f: &String| f != "Allocators.Main.lambda#0" && readable_name(f, None) == "Allocators.Main.lambda#0";
    assert!(frames().any(lambda), "{}", describe(&raw_stacks));
    assert!(frames().any(|f| f.contains("__libc_start")), "{}", describe(&raw_stacks));
    assert!(frames().any(|f| f.contains("start_thread")), "{}", describe(&raw_stacks));
    assert!(!frames().any(|f| f.starts_with("[host start-up]") || f.starts_with("[thread start]")));
    let total = |stacks: &[Stack]| stacks.iter().map(|s| s.count).sum::<u64>();
    assert_eq!(total(&stacks), total(&raw_stacks), "the same samples either way");
}
