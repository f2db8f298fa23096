//! Event stacks walked by corsnap's own unwinder (`--walker native`, the
//! default) against `DoStackSnapshot` (`--walker snapshot`), on
//! `tests/programs/eventshapes.cs`: exceptions from many stack shapes (a
//! recursion, generic methods, a throw in a catch block, a filter, a throw
//! after a finally, lambdas and LINQ, an interface call, async methods on the
//! pool), on the main thread and in thread-pool tasks, and allocation ticks.
//!
//! - `agree`: with `CORSNAP_VERIFY_EVENT_WALKS=1` every event is walked by
//!   both walkers, and the agent compares the managed frames of the two
//!   stacks of the same event (the only comparison immune to the tiered
//!   JIT inlining differently in two runs): all must be identical.
//! - `exact`: both walkers count the same exceptions, each with its stack,
//!   and the shapes read as the program wrote them.
//! - `agree_by_row_tables`: `agree` with the native modules' row tables
//!   compiled from the first round (`CORSNAP_TEST_EVENT_TABLES_AFTER=0`):
//!   by default the event walker compiles them only once its walks have
//!   stepped enough native frames one by one, which these short runs do not
//!   (`corsnap_agent::event_walks::tables_wanted`).
//! - `throw_kinds`: every way a program throws (`throw`, `throw;`, a null
//!   dereference, an integer divided by zero, `throw null`;
//!   `tests/programs/throwkinds.cs`), each counted exactly at the frame
//!   that threw, by both walkers, with CPU sampling off (nothing else
//!   installed a handler of corsnap's: a divide fault's dispatch runs on its
//!   own stack under the kernel's signal frame, which the walk must know
//!   without one) and, on .NET 9 and later, from the dispatch hook and from
//!   EventPipe.

mod support;

use support::{describe, parse_collapsed, record_with_env, scratch, Runtime, Stack};

const ROUNDS: &str = "300";

fn run(runtime: Runtime, walker: &str, events: &[&str], verify: bool) -> (Vec<Stack>, Option<Vec<Stack>>, String) {
    run_with(runtime, walker, events, verify, &[])
}

fn run_with(
    runtime: Runtime,
    walker: &str,
    events: &[&str],
    verify: bool,
    extra_env: &[(&str, &str)],
) -> (Vec<Stack>, Option<Vec<Stack>>, String) {
    let env_tag: String = extra_env.iter().map(|(k, v)| format!("-{k}={v}")).collect();
    let dir = scratch(&format!("eventwalks-{runtime:?}-{walker}-{}-{verify}{env_tag}", events.join("_")));
    let out = dir.join("p.txt");
    let log = dir.join("agent.log");
    let mut args = vec!["-f", "collapsed", "--walker", walker, "-o", out.to_str().unwrap()];
    args.extend(["--agent-log", log.to_str().unwrap()]);
    for e in events {
        args.extend(["-e", e]);
    }
    let mut env: Vec<(&str, &str)> = extra_env.to_vec();
    if verify {
        env.push(("CORSNAP_VERIFY_EVENT_WALKS", "1"));
    }
    let output = record_with_env(runtime, "eventshapes", &[ROUNDS], &args, &env, None);
    let mut stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    // The stacks the walkers disagreed on, from the agent's log, for a
    // failure to show.
    for line in std::fs::read_to_string(&log).unwrap_or_default().lines() {
        if line.contains("event walk verification (") {
            stderr.push_str(line);
            stderr.push('\n');
        }
    }
    assert!(String::from_utf8_lossy(&output.stdout).contains(&format!("rounds {ROUNDS}")));
    let read = |kind: &str| {
        let path = if events.len() == 1 { out.clone() } else { dir.join(format!("p.{kind}.txt")) };
        std::fs::read_to_string(path).ok().map(|t| parse_collapsed(&t))
    };
    (read("exceptions").expect("an exceptions profile"), read("alloc"), stderr)
}

/// `(compared, identical)` from the agent's verification notice.
fn verification(stderr: &str) -> (u64, u64) {
    let line = stderr
        .lines()
        .find(|l| l.contains("event walk verification:"))
        .unwrap_or_else(|| panic!("no verification notice:\n{stderr}"));
    let numbers: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    (numbers[0], numbers[1])
}

fn total(stacks: &[Stack]) -> u64 {
    stacks.iter().map(|s| s.count).sum()
}

/// Weight of stacks whose frames end with `tail` (the leaf last).
fn ending(stacks: &[Stack], tail: &[&str]) -> u64 {
    stacks
        .iter()
        .filter(|s| s.frames.len() >= tail.len() && s.frames[s.frames.len() - tail.len()..].iter().eq(tail.iter()))
        .map(|s| s.count)
        .sum()
}

fn agree(runtime: Runtime) {
    agree_with(runtime, &[]);
}

fn agree_by_row_tables(runtime: Runtime) {
    agree_with(runtime, &[("CORSNAP_TEST_EVENT_TABLES_AFTER", "0")]);
}

fn agree_with(runtime: Runtime, env: &[(&str, &str)]) {
    let (exceptions, alloc, stderr) = run_with(runtime, "native", &["exceptions", "alloc"], true, env);
    let (compared, identical) = verification(&stderr);
    let events = total(&exceptions) + alloc.as_ref().map_or(0, |a| a.len() as u64);
    eprintln!("{runtime:?} {env:?}: compared {compared} of {events} events, {identical} identical");
    // Events before the walker's first map is published are walked by
    // DoStackSnapshot alone and not compared.
    assert!(compared * 10 >= total(&exceptions) * 9, "compared {compared} of {events} events:\n{stderr}");
    assert_eq!(identical, compared, "the walkers disagreed (the agent log names the stacks):\n{stderr}");
    let alloc = alloc.expect("an allocation profile");
    assert!(
        alloc.iter().any(|s| s.frames.iter().any(|f| f == "EventShapes.Shapes.AllocNodes")),
        "{}",
        describe(&alloc)
    );
}

fn exact(runtime: Runtime) {
    let (native, _, native_err) = run(runtime, "native", &["exceptions"], false);
    let (snapshot, _, snapshot_err) = run(runtime, "snapshot", &["exceptions"], false);
    let rounds: u64 = ROUNDS.parse().unwrap();
    // Ten throws a round on the main thread and ten on the pool, and at
    // least one per async task.
    assert!(total(&native) >= 21 * rounds, "{native_err}\n{}", describe(&native));
    assert_eq!(total(&native), total(&snapshot), "native:\n{}\nsnapshot:\n{}", describe(&native), describe(&snapshot));
    for (tail, count) in [
        (&["EventShapes.Shapes.Leaf", "EventShapes.ShapeException"][..], None),
        (&["EventShapes.Shapes.Generic<T>", "System.InvalidOperationException"][..], Some(4 * rounds)),
        (&["EventShapes.Shapes.FromCatch", "System.ArgumentException"][..], Some(2 * rounds)),
        (&["EventShapes.Shapes.FromFinally", "System.TimeoutException"][..], Some(2 * rounds)),
        (&["EventShapes.Thrower.Throw", "System.NotSupportedException"][..], Some(2 * rounds)),
    ] {
        let (n, s) = (ending(&native, tail), ending(&snapshot, tail));
        assert_eq!(n, s, "{tail:?}: native {n}, snapshot {s}\n{}\n{snapshot_err}", describe(&native));
        if let Some(count) = count {
            assert_eq!(n, count, "{tail:?}\n{}", describe(&native));
        }
    }
}

/// See the module's notes (`throw_kinds`).
fn throw_kinds(runtime: Runtime) {
    let managed_dispatch = runtime != Runtime::Net8;
    // `at-dispatch`: the hook's call at the start of `DispatchEx`, the way
    // taken should the entry points not be as expected.
    for (walker, hook) in [("native", "1"), ("snapshot", "1"), ("native", "0"), ("native", "at-dispatch")] {
        let dir = scratch(&format!("eventwalks-throwkinds-{runtime:?}-{walker}-hook-{hook}"));
        let out = dir.join("p.txt");
        let log = dir.join("agent.log");
        let args = [
            "-f",
            "collapsed",
            "-e",
            "exceptions",
            "--walker",
            walker,
            "--agent-log",
            log.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ];
        let env = match hook {
            "at-dispatch" => [("CORSNAP_EXCEPTION_HOOK", "1"), ("CORSNAP_TEST_HOOK_AT_DISPATCH", "1")],
            _ => [("CORSNAP_EXCEPTION_HOOK", hook), ("CORSNAP_TEST_HOOK_AT_DISPATCH", "0")],
        };
        let output = record_with_env(runtime, "throwkinds", &[], &args, &env, None);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        let rewritten = match hook {
            _ if !managed_dispatch => None,
            "1" => Some("the agent's call goes into RhThrowEx, RhRethrow, RhThrowHwEx"),
            "at-dispatch" => Some("the agent's call goes into DispatchEx"),
            _ => None,
        };
        assert_eq!(
            rewritten.is_some_and(|r| log.contains(r)) && log.contains("exceptions: from the dispatch hook"),
            rewritten.is_some(),
            "{walker}, hook {hook}:\n{log}"
        );
        assert!(String::from_utf8_lossy(&output.stdout).contains("done 900"), "{stderr}");
        let stacks = parse_collapsed(&std::fs::read_to_string(&out).unwrap());
        let exactly = |method: &str, exception: &str| -> u64 {
            let frames = ["[host start-up]", "Faults.Kinds.Main", method, exception];
            stacks.iter().filter(|s| s.frames == frames).map(|s| s.count).sum()
        };
        // From .NET 9 the runtime's own dispatch sends no `ExceptionThrown_V1`
        // for a rethrow (measured: 200 events for these 400 throws); the hook
        // and .NET 8's callbacks see every throw.
        let rethrows = if managed_dispatch && hook == "0" { 200 } else { 400 };
        let counts = [
            exactly("Faults.Kinds.Thrown", "System.InvalidOperationException"),
            exactly("Faults.Kinds.Rethrown", "System.FormatException"),
            exactly("Faults.Kinds.NullDeref", "System.NullReferenceException"),
            exactly("Faults.Kinds.Divide", "System.DivideByZeroException"),
            exactly("Faults.Kinds.ThrowsNull", "System.NullReferenceException"),
        ];
        assert_eq!(counts, [300, rethrows, 100, 50, 50], "{walker}, hook {hook}:\n{}", describe(&stacks));
        assert_eq!(total(&stacks), counts.iter().sum::<u64>(), "{walker}, hook {hook}:\n{}", describe(&stacks));
    }
}

on_each_runtime!(both_walkers_see_the_same_managed_frames_for_the_same_events, agree);
on_each_runtime!(both_walkers_count_every_exception_with_its_stack, exact);
on_each_runtime!(both_walkers_agree_with_row_tables_from_the_first_round, agree_by_row_tables);
on_each_runtime!(every_way_of_throwing_is_counted_at_the_frame_that_threw, throw_kinds);
