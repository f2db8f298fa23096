//! Readable names and folded roots under a real runtime: a recording keeps
//! the runtime's names, `report` shows the method a lambda was written in and
//! each thread's start as one frame, and `--raw-names --roots show` gives
//! back everything as walked.

mod support;

use std::process::Command;

use corsnap_profile::names::readable_name;
use support::{corsnap_bin, describe, parse_collapsed, record, repo_root, scratch, Runtime, Stack};

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
    // No generated name anywhere, and no host frame left in a stack with a
    // managed frame (the runtime's start-up before any managed code, a
    // stack without one, keeps its frames).
    for s in &stacks {
        let managed = s.frames.iter().any(|f| f.starts_with("Allocators.") || f.starts_with("System."));
        for f in &s.frames {
            assert!(!f.contains("DisplayClass"), "{f} in {:?}", s.frames);
            assert!(!managed || !f.contains("__libc_start"), "{f} in {:?}", s.frames);
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

#[test]
fn async_methods_iterators_lambdas_and_local_functions_read_as_written() {
    // tests/names.cs, next to this file, compiled by Roslyn for .NET 10.
    let dir = scratch("names-generated");
    let root = repo_root();
    let status = Command::new("bash")
        .arg(root.join("scripts/build-cs.sh"))
        .arg(root.join("crates/corsnap/tests/names.cs"))
        .arg(&dir)
        .arg("10")
        .status()
        .expect("running scripts/build-cs.sh");
    assert!(status.success(), "compiling names.cs failed");
    let raw = dir.join("run.corsnap");
    let output = Command::new(corsnap_bin())
        .args(["record", "-r", "400", "-o"])
        .arg(&raw)
        .arg("--")
        .arg(Runtime::Net10.dotnet())
        .arg(dir.join("names.dll"))
        .arg("2")
        .env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1")
        // Without profile-guided devirtualization the JIT does not inline an
        // iterator's MoveNext into its caller (`Enumerable.Sum`), which
        // would leave no frame to name.
        .env("DOTNET_TieredPGO", "0")
        .output()
        .expect("running corsnap record");
    assert!(output.status.success(), "corsnap record failed: {}", String::from_utf8_lossy(&output.stderr));
    assert!(String::from_utf8_lossy(&output.stdout).contains("done"));

    let stacks = report(&raw, "readable.txt", &[]);
    // The weight of samples whose frame right under Work.Spin is `caller`.
    let under_spin = |caller: &dyn Fn(&str) -> bool| -> u64 {
        stacks
            .iter()
            .filter(|s| s.frames.windows(2).any(|w| caller(&w[0]) && w[1] == "Names.Work.Spin"))
            .map(|s| s.count)
            .sum()
    };
    let spin: u64 = stacks.iter().filter(|s| s.frames.iter().any(|f| f == "Names.Work.Spin")).map(|s| s.count).sum();
    type Matches<'a> = &'a dyn Fn(&str) -> bool;
    let expected: [(&str, Matches); 5] = [
        ("Names.Orders.HandleAsync [async]", &|f| f == "Names.Orders.HandleAsync [async]"),
        ("Names.Repo.GetItems [iterator]", &|f| f == "Names.Repo.GetItems [iterator]"),
        // The metadata tells an async iterator from an async method, where
        // the stack need not (its `MoveNextAsync` inlined).
        ("Names.Repo.ReadAllAsync [async iterator]", &|f| f == "Names.Repo.ReadAllAsync [async iterator]"),
        ("Names.Builder.Build<T>.lambda#…", &|f| f.starts_with("Names.Builder.Build<T>.lambda#")),
        ("Names.Chooser.Choose.choose", &|f| f == "Names.Chooser.Choose.choose"),
    ];
    let mut found = 0;
    for (name, matches) in &expected {
        let weight = under_spin(*matches);
        assert!(weight > 0, "no sample of Work.Spin under {name}:\n{}", describe(&stacks));
        found += weight;
    }
    // Every way Spin is called is one of them, and named so (or Main itself,
    // where the JIT inlined a call).
    found += under_spin(&|f| f == "Names.Program.Main [async]");
    assert!(found * 100 >= spin * 95, "{found} of {spin} ns of Spin under the expected names:\n{}", describe(&stacks));
    for s in &stacks {
        for f in &s.frames {
            let generated = ["d__", "b__", "g__", "DisplayClass", "<>c"].iter().any(|g| f.contains(g));
            assert!(!generated, "{f} in {:?}", s.frames);
        }
    }

    let raw_stacks = report(&raw, "raw.txt", &["--raw-names"]);
    let frames: Vec<&String> = raw_stacks.iter().flat_map(|s| s.frames.iter()).collect();
    for raw_name in ["Names.Orders+<HandleAsync>d__", "Names.Repo+<GetItems>d__", "Names.Chooser.<Choose>g__choose|"] {
        assert!(frames.iter().any(|f| f.starts_with(raw_name)), "no {raw_name}…:\n{}", describe(&raw_stacks));
    }
}
