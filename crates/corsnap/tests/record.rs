//! `corsnap record` end to end, under real .NET 10, 9, 8 and Core 3.1
//! runtimes: exact frames and proportions from small C# programs.

mod support;

use std::process::Command;

use support::{
    count_ending, count_with, describe, parse_collapsed, record, record_collapsed, record_with_env, scratch, Runtime,
};

fn share_of_heavy(runtime: Runtime, sampler: &str) {
    // 400 Hz: at 100 Hz the 300 samples of a 3 s run leave a standard error
    // of 2.5 points, and 75 ± 5 failed about one run in ten (69-81% seen).
    // No pause budget: on a loaded machine (the suite runs two programs at
    // once on 2 CPUs) most ticks are slow and it would thin the profile out.
    let (stacks, _) =
        record_collapsed(runtime, "split", "3", &["-r", "400", "--max-pause", "100", "--sampler", sampler]);
    let heavy = count_with(&stacks, "Split.Heavy") as f64;
    let light = count_with(&stacks, "Split.Light") as f64;
    // Collapsed cpu values are CPU nanoseconds: most of the 3 s is there.
    assert!(heavy + light >= 1.5e9, "too little CPU recorded ({heavy} + {light} ns):\n{}", describe(&stacks));
    let share = heavy / (heavy + light) * 100.0;
    assert!(
        (70.0..=80.0).contains(&share),
        "Heavy has {share:.1}% of Heavy+Light, expected 75 ± 5:\n{}",
        describe(&stacks)
    );
    // Every sample of the two methods sits right under Main (with
    // `Stopwatch.GetTimestamp` above them while it is not yet inlined, and,
    // from the signal engine, the native code it calls; from the suspend
    // engine on .NET 10, the managed GC poll the thread stopped in; and, on
    // .NET 10, at Heavy's first read of its class's statics, the runtime's
    // managed class-initialization helpers, `StaticsHelpers` and
    // `InitHelpers`, which a suspend sample once stopped in, in CI).
    // A sample the walker could not take past a frame says so
    // (`[incomplete stack]`, never a made-up caller): counted, and rare.
    let incomplete: u64 =
        stacks.iter().filter(|s| s.frames.iter().any(|f| f == "[incomplete stack]")).map(|s| s.count).sum();
    assert!(incomplete as f64 <= (heavy + light) * 0.01, "{incomplete} ns incomplete:\n{}", describe(&stacks));
    for s in stacks.iter().filter(|s| !s.frames.iter().any(|f| f == "[incomplete stack]")) {
        let mut managed = support::managed_frames(&s.frames);
        managed.retain(|f| {
            !f.starts_with("System.Threading.Thread.PollGC")
                && !f.starts_with("System.Runtime.CompilerServices.StaticsHelpers.")
                && !f.starts_with("System.Runtime.CompilerServices.InitHelpers.")
        });
        if let Some(i) = managed.iter().position(|&f| f == "Split.Heavy" || f == "Split.Light") {
            assert!(i > 0 && managed[i - 1] == "Split.Main", "{:?}", s.frames);
            assert!(managed.len() <= i + 2, "{:?}", s.frames);
        }
    }
}

#[test]
fn time_split_3_to_1_shows_as_75_percent_on_net10() {
    share_of_heavy(Runtime::Net10, "signal");
}

#[test]
fn time_split_3_to_1_shows_as_75_percent_on_core31() {
    share_of_heavy(Runtime::Core31, "signal");
}

#[test]
fn time_split_3_to_1_shows_as_75_percent_with_the_suspend_engine() {
    share_of_heavy(Runtime::Net10, "suspend");
    share_of_heavy(Runtime::Core31, "suspend");
}

#[test]
fn a_200_deep_recursion_keeps_every_frame_in_order() {
    let (stacks, _) = record_collapsed(Runtime::Net10, "recursion", "2", &[]);
    let deepest = stacks
        .iter()
        .filter(|s| s.frames.last().map(String::as_str) == Some("Deep.Bottom"))
        .max_by_key(|s| s.count)
        .unwrap_or_else(|| panic!("no sample in Deep.Bottom:\n{}", describe(&stacks)));
    let main = deepest.frames.iter().position(|f| f == "Deep.Main").expect("Main under the recursion");
    let recursion = &deepest.frames[main + 1..deepest.frames.len() - 1];
    assert_eq!(recursion.len(), 200, "frames between Main and Bottom: {:?}", deepest.frames);
    assert!(recursion.iter().all(|f| f == "Deep.Recurse"), "{:?}", deepest.frames);
    let bottom_samples = count_with(&stacks, "Deep.Bottom");
    assert!(
        deepest.count * 10 >= bottom_samples * 9,
        "most Bottom samples have the full stack:\n{}",
        describe(&stacks)
    );
}

fn named_threads(runtime: Runtime) {
    let (stacks, _) = record_collapsed(runtime, "threads", "2", &["--threads", "-r", "400", "--max-pause", "100"]);
    for (thread, method) in [("worker-1", "Workers.Alpha"), ("worker-2", "Workers.Beta"), ("worker-3", "Workers.Gamma")]
    {
        let of_thread: Vec<_> = stacks.iter().filter(|s| s.frames[0].starts_with(&format!("{thread} tid="))).collect();
        let total: u64 = of_thread.iter().map(|s| s.count).sum();
        // In the method, or in what it calls (its clock reads, in native
        // code, show under it with the signal engine).
        let in_method: u64 = of_thread.iter().filter(|s| s.frames.iter().any(|f| f == method)).map(|s| s.count).sum();
        // CPU nanoseconds: three spinning threads share 2 CPUs for 2 s.
        assert!(total >= 300_000_000, "{thread}: {total} ns of CPU:\n{}", describe(&stacks));
        assert!(in_method * 100 >= total * 95, "{thread}: {in_method}/{total} in {method}:\n{}", describe(&stacks));
        let tid: u32 = of_thread[0].frames[0].rsplit("tid=").next().unwrap().parse().unwrap();
        assert!(tid > 0);
        // No other thread runs this thread's method.
        let elsewhere: Vec<_> = stacks
            .iter()
            .filter(|s| !s.frames[0].starts_with(thread) && s.frames.iter().any(|f| f == method))
            .map(|s| s.frames.join(";"))
            .collect();
        assert!(elsewhere.is_empty(), "{method} seen outside {thread}: {elsewhere:?}");
    }
}

#[test]
fn named_threads_show_their_own_method_and_name_on_net10() {
    named_threads(Runtime::Net10);
}

#[test]
fn named_threads_show_their_own_method_and_name_on_core31() {
    named_threads(Runtime::Core31);
}

#[test]
fn generic_and_nested_names_render_csharp_style() {
    let (stacks, _) = record_collapsed(Runtime::Net10, "generics", "2", &[]);
    let settle = count_with(&stacks, "Shop.Billing.Ledger<TKey>+Entry.Settle<TValue>");
    let inner = count_with(&stacks, "Shop.Billing.Outer+Inner.Work");
    assert!(settle > 0 && inner > 0, "names not found:\n{}", describe(&stacks));
    assert!(settle > inner, "Settle runs 3x longer than Inner.Work:\n{}", describe(&stacks));
}

#[test]
fn a_native_qsort_between_callback_and_caller_shows_as_native_code_with_the_suspend_engine() {
    let (stacks, _) = record_collapsed(Runtime::Net10, "qsort", "2", &["--sampler", "suspend"]);
    let through_qsort = stacks
        .iter()
        .filter(|s| s.frames.windows(3).any(|w| w == ["NativeSort.SortOnce", "[native code]", "NativeSort.Compare"]))
        .map(|s| s.count)
        .sum::<u64>();
    assert!(through_qsort >= 20, "no SortOnce;[native code];Compare stacks:\n{}", describe(&stacks));
    // Compare is only ever reached through qsort.
    assert_eq!(count_with(&stacks, "NativeSort.Compare"), through_qsort, "{}", describe(&stacks));
}

#[test]
fn program_stdio_and_exit_code_pass_through() {
    let dir = scratch("exitcode");
    let out = dir.join("p.txt");
    let output =
        record(Runtime::Net10, "exitcode", &[], &["-f", "collapsed", "-o", out.to_str().unwrap()], Some("abc\n"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(7), "stderr:\n{stderr}");
    assert_eq!(stdout, "hello from stdout\nread: abc\n");
    assert!(stderr.contains("hello from stderr"), "{stderr}");
    assert!(out.exists(), "the profile is written even though the program failed");
}

#[test]
fn a_program_that_is_not_dotnet_gets_a_clear_error_and_keeps_its_exit_code() {
    let dir = scratch("not-dotnet");
    let out = dir.join("p.svg");
    for (program, code) in [(&["/bin/true"][..], 0), (&["sh", "-c", "exit 7"][..], 7)] {
        let output = Command::new(support::corsnap_bin())
            .args(["record", "-o", out.to_str().unwrap(), "--"])
            .args(program)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(code), "the program's own exit code: {stderr}");
        assert!(stderr.contains("without starting the .NET runtime"), "{stderr}");
        assert!(!out.exists(), "no empty profile is left behind");
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert!(leftovers.is_empty(), "no temporary file is left behind: {leftovers:?}");
    }
    // Said while the program still runs, not only when it exits.
    let started = std::time::Instant::now();
    let mut child = Command::new(support::corsnap_bin())
        .args(["record", "-o", out.to_str().unwrap(), "--", "sleep", "6"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut first).unwrap();
    assert!(first.contains("has not started the .NET runtime after 2 s"), "{first}");
    assert!(started.elapsed().as_secs_f64() < 5.0, "the warning comes early: {:?}", started.elapsed());
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn sigterm_stops_the_recording_and_writes_what_was_collected() {
    let dir = scratch("sigterm");
    let out = dir.join("p.txt");
    let dll = support::compiled("split", Runtime::Net10);
    // `timeout` signals corsnap, and then its whole process group again.
    let output = Command::new("timeout")
        .args(["2", support::corsnap_bin().to_str().unwrap(), "record", "-o", out.to_str().unwrap(), "--"])
        .arg(Runtime::Net10.dotnet())
        .arg(&dll)
        .arg("30")
        .env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("recording ended: SIGTERM"), "{stderr}");
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    assert!(count_with(&stacks, "Split.Heavy") > 0, "{}", describe(&stacks));
    let leftovers: Vec<_> =
        std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).filter(|e| e.path() != out).map(|e| e.path()).collect();
    assert!(leftovers.is_empty(), "no temporary file is left behind: {leftovers:?}");
}

#[test]
fn help_lists_every_event_and_shows_examples_line_by_line() {
    let help = Command::new(support::corsnap_bin()).args(["record", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for event in ["cpu", "wall", "exceptions", "alloc", "gc", "classload"] {
        assert!(help.contains(event), "{event} missing from record --help:\n{help}");
    }
    let examples: Vec<&str> = help.lines().filter(|l| l.trim_start().starts_with("corsnap record")).collect();
    assert!(examples.len() >= 3, "examples, one per line:\n{help}");
    let report = Command::new(support::corsnap_bin()).args(["report", "--help"]).output().unwrap();
    let report = String::from_utf8_lossy(&report.stdout);
    for option in ["--output", "--format", "--threads", "--title"] {
        let line = report.lines().find(|l| l.contains(option)).unwrap_or_else(|| panic!("{option}:\n{report}"));
        assert!(line.trim().len() > option.len() + 12, "{option} has a description:\n{report}");
    }
}

#[test]
fn the_output_extension_chooses_the_format() {
    let dir = scratch("extension");
    let out = dir.join("p.json");
    let output = record(Runtime::Net10, "split", &["1"], &["-o", out.to_str().unwrap()], None);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(json["profiles"][0]["unit"], "nanoseconds", "CPU time, in a unit speedscope shows");
    let refused = record(Runtime::Net10, "split", &["1"], &["-o", out.to_str().unwrap(), "-f", "flamegraph"], None);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("named like a speedscope file"));
    // A flame graph with a title of the user's, drawn top down, in time.
    let svg = dir.join("p.svg");
    let output = record(
        Runtime::Net10,
        "split",
        &["1"],
        &["-o", svg.to_str().unwrap(), "--title", "nightly split run", "--inverted"],
        None,
    );
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.contains(">nightly split run<"), "the title");
    assert!(svg.contains(" µs, ") || svg.contains(" ms, "), "CPU time in the tooltips");
    assert!(!svg.contains(" samples, "), "not called samples");
}

#[test]
fn allocation_samples_carry_the_thread_that_allocated() {
    let (stacks, _) = record_collapsed(Runtime::Net10, "allocthreads", "1.5", &["-e", "alloc", "--threads"]);
    let on = |thread: &str, leaf: &str| -> u64 {
        stacks
            .iter()
            .filter(|s| s.frames[0].starts_with(thread) && s.frames.last().map(String::as_str) == Some(leaf))
            .map(|s| s.count)
            .sum()
    };
    assert!(on("allocator tid=", "System.Byte[]") > 100_000_000, "{}", describe(&stacks));
    let bytes_elsewhere: u64 = stacks
        .iter()
        .filter(|s| !s.frames[0].starts_with("allocator tid=") && s.frames.iter().any(|f| f == "Allocators.Bytes"))
        .map(|s| s.count)
        .sum();
    assert_eq!(bytes_elsewhere, 0, "Bytes runs only on the allocator:\n{}", describe(&stacks));
    let text_on_allocator: u64 = stacks
        .iter()
        .filter(|s| s.frames[0].starts_with("allocator tid=") && s.frames.iter().any(|f| f == "Allocators.Text"))
        .map(|s| s.count)
        .sum();
    assert_eq!(text_on_allocator, 0, "Text runs only on the main thread:\n{}", describe(&stacks));
}

#[test]
fn an_unwritable_output_is_refused_before_the_program_starts() {
    let dir = scratch("unwritable");
    let marker = dir.join("ran");
    let output = Command::new(support::corsnap_bin())
        .args(["record", "-o", "/nonexistent-dir/profile.svg", "--", "sh", "-c"])
        .arg(format!("touch {}", marker.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("cannot write the output file /nonexistent-dir/profile.svg"), "{stderr}");
    assert!(!marker.exists(), "the program must not have run");
}

#[test]
fn the_pause_budget_is_counted_and_can_be_lifted() {
    let refused = Command::new(support::corsnap_bin())
        .args(["record", "--max-pause", "0", "-o", "/tmp/corsnap-pause.svg", "--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(stderr.contains("0 is not a percentage above 0 and at most 100"), "{stderr}");

    let dir = scratch("pause");
    let out = dir.join("p.txt");
    let lifted = record(
        Runtime::Net10,
        "split",
        &["1"],
        &["--sampler", "suspend", "--stats", "--max-pause", "100", "-f", "collapsed", "-o", out.to_str().unwrap()],
        None,
    );
    let stderr = String::from_utf8_lossy(&lifted.stderr);
    assert!(lifted.status.success(), "{stderr}");
    assert!(stderr.contains(" skipped, 0 throttled)"), "no tick is throttled at 100%: {stderr}");
    assert!(!stderr.contains("ticks were skipped because the runtime was slow to stop"), "{stderr}");
}

#[test]
fn a_missing_program_is_named() {
    let output = Command::new(support::corsnap_bin())
        .args(["record", "-o", "/tmp/corsnap-missing.svg", "--", "/no/such/program"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("cannot run /no/such/program"), "{stderr}");
}

#[test]
fn raw_recordings_render_later_like_live_ones() {
    let dir = scratch("raw");
    let raw = dir.join("rec.corsnap");
    let output = record(Runtime::Net10, "split", &["1"], &["-f", "raw", "-o", raw.to_str().unwrap()], None);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    for (format, file) in [("collapsed", "out.txt"), ("flamegraph", "out.svg"), ("speedscope", "out.json")] {
        let out = dir.join(file);
        let status = Command::new(support::corsnap_bin())
            .args(["report", raw.to_str().unwrap(), "-f", format, "-o", out.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(status.success(), "report --format {format}");
        let text = std::fs::read_to_string(&out).unwrap();
        match format {
            "collapsed" => {
                let stacks = parse_collapsed(&text);
                assert!(count_with(&stacks, "Split.Heavy") > 0, "{}", describe(&stacks));
            }
            "flamegraph" => assert!(text.contains("<svg") && text.contains("Split.Heavy"), "svg"),
            _ => {
                let json: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert_eq!(json["$schema"], "https://www.speedscope.app/file-format-schema.json");
                assert!(text.contains("Split.Heavy"));
            }
        }
    }
    let not_raw = dir.join("out.txt");
    let output = Command::new(support::corsnap_bin())
        .args(["report", not_raw.to_str().unwrap(), "-o", dir.join("x.svg").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("not a corsnap raw recording"));
}

#[test]
fn default_flamegraph_from_a_live_run_is_an_svg_with_the_methods() {
    let dir = scratch("svg");
    let out = dir.join("p.svg");
    let output = record(Runtime::Net10, "threads", &["1"], &["-o", out.to_str().unwrap()], None);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<?xml") && svg.contains("Workers.Alpha") && svg.contains("Workers.Gamma"));
}

#[test]
fn duration_stops_recording_while_the_program_runs_on() {
    let dir = scratch("duration");
    let out = dir.join("p.txt");
    let started = std::time::Instant::now();
    let output = record(
        Runtime::Net10,
        "split",
        &["3"],
        // No pause budget: under the suite's load it thins the ticks (the
        // budget has tests of its own).
        &["-f", "collapsed", "-e", "wall", "-d", "1", "--max-pause", "100", "-o", out.to_str().unwrap()],
        None,
    );
    assert!(output.status.success());
    assert!(started.elapsed().as_secs_f64() >= 2.5, "corsnap waits for the program to exit");
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    let samples: u64 = stacks.iter().map(|s| s.count).sum();
    assert!((50..=150).contains(&samples), "about 1 s at 100 Hz, got {samples}");
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("done "), "program ran to its end");
}

#[test]
fn cpu_profiles_leave_out_sleeping_threads_that_wall_profiles_show() {
    cpu_and_wall_of_a_spinner_and_a_sleeper("cpu-vs-wall", &[]);
}

/// The same on POSIX CPU timers alone: periodic, re-armed by the kernel from
/// their last expiry, their samples weigh the period times 1 + overrun and
/// the handler reads the thread's clock only when it changes the period.
/// Those weights still add up to the CPU time the spinner measured.
#[test]
fn cpu_timer_samples_add_up_to_the_cpu_time_a_thread_measured() {
    cpu_and_wall_of_a_spinner_and_a_sleeper("cpu-vs-wall-timers", &["--cpu-clock", "timer"]);
}

fn cpu_and_wall_of_a_spinner_and_a_sleeper(name: &str, extra: &[&str]) {
    let dir = scratch(name);
    let out = dir.join("p.txt");
    let mut args = vec![
        "-f",
        "collapsed",
        "--threads",
        "--max-pause",
        "100",
        "-e",
        "cpu",
        "-e",
        "wall",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let output = record(Runtime::Net10, "sleeper", &["2"], &args, None);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let read = |kind: &str| parse_collapsed(&std::fs::read_to_string(dir.join(format!("p.{kind}.txt"))).unwrap());
    let (cpu, wall) = (read("cpu"), read("wall"));
    let on = |stacks: &[support::Stack], thread: &str| -> u64 {
        stacks.iter().filter(|s| s.frames[0].starts_with(&format!("{thread} tid="))).map(|s| s.count).sum()
    };
    // Wall: both threads, every tick.
    let (wall_spin, wall_sleep) = (on(&wall, "spinner"), on(&wall, "sleeper"));
    assert!(wall_spin >= 150 && wall_sleep >= 150, "spinner {wall_spin}, sleeper {wall_sleep}:\n{}", describe(&wall));
    assert!(count_with(&wall, "System.Threading.Thread.Sleep") >= 150, "{}", describe(&wall));
    // CPU: nanoseconds of CPU time, as much as the spinner measured it had
    // (on a loaded machine, less than its 2 s); the sleeper's share is next
    // to nothing.
    let (cpu_spin, cpu_sleep) = (on(&cpu, "spinner"), on(&cpu, "sleeper"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let measured: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("spinner_cpu_ns "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no spinner_cpu_ns line:\n{stdout}"));
    assert!(measured >= 200_000_000, "the spinner had {measured} ns of CPU: too little to judge");
    let ratio = cpu_spin as f64 / measured as f64;
    eprintln!("spinner: {cpu_spin} ns in the profile, {measured} ns measured by itself ({ratio:.3})");
    assert!(
        (0.9..=1.1).contains(&ratio),
        "the profile gives the spinner {cpu_spin} ns of CPU; it measured {measured} ns itself"
    );
    assert!(cpu_sleep * 50 < cpu_spin, "sleeper {cpu_sleep} ns vs spinner {cpu_spin} ns:\n{}", describe(&cpu));
}

on_each_runtime!(exceptions_are_counted_exactly_with_their_type_as_the_leaf, exceptions_exact);

fn exceptions_exact(runtime: Runtime) {
    let dir = scratch(&format!("exceptions-{runtime:?}"));
    let out = dir.join("p.txt");
    let output = record(
        runtime,
        "throws",
        &[],
        &["-f", "collapsed", "-e", "exceptions", "-e", "gc", "-e", "classload", "-o", out.to_str().unwrap()],
        None,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let exceptions = parse_collapsed(&std::fs::read_to_string(dir.join("p.exceptions.txt")).unwrap());
    let first: u64 = exceptions
        .iter()
        .filter(|s| {
            s.frames.ends_with(&["Faults.Thrower.First".to_string(), "System.InvalidOperationException".to_string()])
        })
        .map(|s| s.count)
        .sum();
    let second: u64 = exceptions
        .iter()
        .filter(|s| s.frames.ends_with(&["Faults.Thrower.Second".to_string(), "System.ArgumentException".to_string()]))
        .map(|s| s.count)
        .sum();
    assert_eq!((first, second), (1000, 500), "{}", describe(&exceptions));
    assert_eq!(
        exceptions.iter().map(|s| s.count).sum::<u64>(),
        1500,
        "no other exceptions:\n{}",
        describe(&exceptions)
    );

    // Four induced collections from Main (three gen2, one gen0), with their stacks.
    let gcs = parse_collapsed(&std::fs::read_to_string(dir.join("p.gc.txt")).unwrap());
    let induced: Vec<_> = gcs.iter().filter(|s| s.frames.iter().any(|f| f == "System.GC.Collect")).collect();
    assert!(induced.iter().any(|s| s.frames.last().unwrap() == "[gen2 GC, induced]"), "{}", describe(&gcs));
    assert!(induced.iter().any(|s| s.frames.last().unwrap() == "[gen0 GC, induced]"), "{}", describe(&gcs));
    assert!(stderr.contains("garbage collections"), "{stderr}");
    assert!(stderr.contains("gen2: 3 collections"), "{stderr}");

    // The program's own class is loaded once, with the loading stack.
    let loads = parse_collapsed(&std::fs::read_to_string(dir.join("p.classload.txt")).unwrap());
    let payload: Vec<_> = loads.iter().filter(|s| s.frames.last().unwrap() == "Faults.Payload").collect();
    assert_eq!(payload.iter().map(|s| s.count).sum::<u64>(), 1, "{}", describe(&loads));
}

on_each_runtime!(allocation_profiles_show_the_type_and_method_that_allocate_most, allocations);

fn allocations(runtime: Runtime) {
    let (stacks, _) = record_collapsed(runtime, "allocs", "2", &["-e", "alloc"]);
    let total: u64 = stacks.iter().map(|s| s.count).sum();
    let nodes: u64 = stacks
        .iter()
        .filter(|s| s.frames.ends_with(&["Allocs.MakeNodes".to_string(), "Allocs+Node".to_string()]))
        .map(|s| s.count)
        .sum();
    let text = count_with(&stacks, "Allocs.MakeText");
    assert!(total > 1_000_000_000, "gigabytes allocated, got {total} bytes");
    let share = nodes as f64 / total as f64;
    assert!(
        (0.75..=0.97).contains(&share),
        "Node from MakeNodes: {:.1}% of bytes:\n{}",
        share * 100.0,
        describe(&stacks)
    );
    assert!(text > 0 && text < nodes, "{}", describe(&stacks));
}

#[test]
fn alloc_on_core31_is_refused_in_words() {
    let dir = scratch("alloc-31");
    let out = dir.join("p.txt");
    let output = record(
        Runtime::Core31,
        "allocs",
        &["1"],
        &["-f", "collapsed", "-e", "alloc", "-e", "wall", "-o", out.to_str().unwrap()],
        None,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("--event alloc needs .NET 5 or later"), "{stderr}");
    let wall = parse_collapsed(&std::fs::read_to_string(dir.join("p.wall.txt")).unwrap());
    // Wall samples come from the suspend engine, which sees a thread where
    // the runtime parks it: on Core 3.1 about 92 of 100 land in Allocs.Main's
    // loop and 0 to 2 in Allocs.MakeNodes (safe-point bias, README), so
    // MakeNodes is no sign that wall samples were recorded; the program's
    // own Main is.
    assert!(count_with(&wall, "Allocs.Main") > 0, "the other events still record:\n{}", describe(&wall));
}
#[test]
fn pprof_holds_one_sample_type_per_event_kind() {
    let dir = scratch("pprof");
    let out = dir.join("p.pb.gz");
    let output = record(
        Runtime::Net10,
        "throws",
        &[],
        &["-f", "pprof", "-e", "exceptions", "-e", "wall", "-o", out.to_str().unwrap()],
        None,
    );
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(&bytes[..2], &[0x1f, 0x8b], "gzip");
    let profile = corsnap_profile::writers::decode_pprof(&bytes).unwrap();
    let types: Vec<_> = profile.sample_types.iter().map(|(t, u)| format!("{t}/{u}")).collect();
    assert!(types.contains(&"exceptions/count".to_string()), "{types:?}");
    let exceptions = profile.sample_types.iter().position(|(t, _)| t == "exceptions").unwrap();
    assert_eq!(profile.total(exceptions), 1500);
    assert!(profile.function_names.iter().any(|f| f == "Faults.Thrower.First"));
}

#[test]
fn ctrl_c_stops_the_recording_and_writes_what_was_collected() {
    use std::os::unix::process::CommandExt;
    let dir = scratch("ctrl-c");
    let out = dir.join("p.txt");
    let log = dir.join("agent.log");
    // Its own process group, as a shell gives a foreground job: Ctrl-C goes
    // to corsnap and the program alike.
    let child = Command::new(support::corsnap_bin())
        .args(["record", "-f", "collapsed", "-o"])
        .arg(&out)
        .arg("--agent-log")
        .arg(&log)
        .arg("--")
        .arg(Runtime::Net10.dotnet())
        .arg(support::compiled("split", Runtime::Net10))
        .arg("60")
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(&log).unwrap_or_default().contains("started") {
        assert!(started.elapsed().as_secs() < 20, "the agent never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let group = format!("-{}", child.id());
    assert!(Command::new("kill").args(["-INT", "--", &group]).status().unwrap().success());
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(started.elapsed().as_secs() < 30, "Ctrl-C ended the run");
    assert!(stderr.contains("corsnap: wrote"), "{stderr}");
    let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    assert!(count_with(&stacks, "Split.Heavy") > 0, "{}", describe(&stacks));
}

#[test]
fn a_terminal_gets_a_live_status_line_and_a_pipe_does_not() {
    let dir = scratch("status-line");
    let out = dir.join("p.txt");
    // A terminal of 24 rows: the line gets the last one to itself.
    let cmd = format!(
        "stty rows 24 cols 120; {} record -f collapsed -o {} -- {} {} 1",
        support::corsnap_bin().display(),
        out.display(),
        Runtime::Net10.dotnet().display(),
        support::compiled("split", Runtime::Net10).display()
    );
    // `script` runs the command on a pseudo-terminal.
    let output = Command::new("script").args(["-qec", &cmd, "/dev/null"]).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("corsnap: recording ") && text.contains(" samples, 1 thread (Ctrl-C to stop)"), "{text}");
    // Drawn on row 24 inside a scrolling region of rows 1-23, which is reset
    // at the end; the program's own output is never on the line's row.
    assert!(text.contains("\x1b[1;23r") && text.contains("\x1b[24;1H") && text.contains("\x1b[r"), "{text:?}");
    let done = text.find("done ").expect("the program's output");
    assert!(!text[..done].ends_with("(Ctrl-C to stop)"), "{text:?}");
    let piped = record(Runtime::Net10, "split", &["1"], &["-f", "collapsed", "-o", out.to_str().unwrap()], None);
    assert!(!String::from_utf8_lossy(&piped.stderr).contains("corsnap: recording "));
}

/// The benchmark switches that measure the runtime's share of the cost
/// record nothing of their own, and say so, while the runtime still does
/// the work they measure.
#[test]
fn benchmark_floor_switches_do_the_runtimes_part_and_record_nothing() {
    let dir = scratch("bench-switches");
    let run = |program: &str, program_args: &[&str], env: (&str, &str), args: &[&str]| {
        let out = dir.join(format!("{program}.txt"));
        let mut all_args = args.to_vec();
        all_args.extend(["--stats", "-f", "collapsed", "-o", out.to_str().unwrap()]);
        let output = record_with_env(Runtime::Net10, program, program_args, &all_args, &[env], None);
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        assert!(output.status.success(), "{stderr}");
        stderr
    };
    let suspend_only =
        run("split", &["1"], ("CORSNAP_BENCH_SUSPEND_ONLY", "1"), &["--sampler", "suspend", "--max-pause", "100"]);
    let ticks: u64 = suspend_only
        .split("agent: ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no tick count: {suspend_only}"));
    assert!(ticks > 20, "the runtime is suspended every tick: {suspend_only}");
    assert!(suspend_only.contains(" 0 stacks,"), "{suspend_only}");
    assert!(suspend_only.contains("no samples were recorded"), "{suspend_only}");

    for mode in ["monitor", "walk"] {
        let stderr = run("throws", &[], ("CORSNAP_BENCH_EXCEPTIONS", mode), &["-e", "exceptions"]);
        assert!(stderr.contains("no samples were recorded"), "{mode}: {stderr}");
    }
    let session_only = run("allocs", &["1"], ("CORSNAP_BENCH_ALLOC_SESSION_ONLY", "1"), &["-e", "alloc"]);
    assert!(session_only.contains("no samples were recorded"), "{session_only}");
}

on_each_runtime!(exceptions_come_from_a_call_in_the_runtimes_own_dispatch_on_net9_and_later, exceptions_from_the_hook);

/// On .NET 9 and later throws come from the call the agent puts where
/// `System.Runtime.EH`'s dispatch starts (ReJIT), exactly counted; with
/// `CORSNAP_EXCEPTION_HOOK=0`, from EventPipe, the same counts. .NET 8 has
/// no managed dispatch and keeps its callbacks.
fn exceptions_from_the_hook(runtime: Runtime) {
    let hooked = runtime != Runtime::Net8;
    for hook in ["1", "0"] {
        let dir = scratch(&format!("exceptions-hook{hook}-{runtime:?}"));
        let out = dir.join("p.txt");
        let log = dir.join("agent.log");
        let output = record_with_env(
            runtime,
            "throws",
            &[],
            &["-f", "collapsed", "-e", "exceptions", "--agent-log", log.to_str().unwrap(), "-o", out.to_str().unwrap()],
            &[("CORSNAP_EXCEPTION_HOOK", hook)],
            None,
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        let log = std::fs::read_to_string(&log).unwrap();
        assert_eq!(log.contains("exceptions: from the dispatch hook"), hooked && hook == "1", "hook {hook}:\n{log}");
        let exceptions = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
        let counts = (
            count_ending(&exceptions, &["Faults.Thrower.First", "System.InvalidOperationException"]),
            count_ending(&exceptions, &["Faults.Thrower.Second", "System.ArgumentException"]),
            exceptions.iter().map(|s| s.count).sum::<u64>(),
        );
        assert_eq!(counts, (1000, 500, 1500), "hook {hook}:\n{}", describe(&exceptions));
    }
}

/// A launched program that outlives its recording of exceptions on .NET 10
/// runs on to its end: the agent cannot leave (a profiler that enabled
/// ReJIT may not detach), so it puts the dispatch back and stays idle.
#[test]
fn a_program_outliving_its_exception_recording_runs_on_with_its_dispatch_put_back() {
    let dir = scratch("exceptions-outlived");
    let out = dir.join("p.txt");
    let log = dir.join("agent.log");
    let output = record(
        Runtime::Net10,
        "service",
        &["3"],
        &[
            "-d",
            "1",
            "-f",
            "collapsed",
            "-e",
            "exceptions",
            "--agent-log",
            log.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
        None,
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.lines().any(|l| l.starts_with("done ")), "the program did not finish:\n{stdout}\n{stderr}");
    // Its heartbeats went on for two seconds after the recording (one a
    // 100 ms, each after a throw through the dispatch put back).
    let last_beat = stdout.lines().filter_map(|l| l.strip_prefix("heartbeat ")?.parse::<u64>().ok()).max();
    assert!(last_beat.is_some_and(|b| b >= 20), "heartbeats stopped at {last_beat:?}:\n{stdout}");
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains("exceptions: from the dispatch hook"), "{log}");
    assert!(log.contains("the dispatch hook is reverted and the agent stays loaded, idle"), "{log}");
    let exceptions = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
    let beats = count_ending(&exceptions, &["Service.Beat", "System.InvalidOperationException"]);
    assert!((5..=12).contains(&beats), "{beats} exceptions in a second:\n{}", describe(&exceptions));
}
