#!/usr/bin/env python3
"""The cost of the event profiles: exception-heavy and allocation-heavy C#
workloads (bench/programs/events.cs, fixed work) without a profiler and
under `corsnap record --event exceptions` / `--event alloc`, interleaved
round by round, as ratios, on .NET 8 and 10 (`--runtimes`), with both event
walkers: `native` (corsnap's own unwinder, the default) and `snapshot`
(`--walker snapshot`, DoStackSnapshot).

Targets (issue 18): `validate` (two thread-pool workers validating records,
one in four bad and thrown for) at most 6% slower under `-e exceptions`;
`alloc` at most 3%, with corsnap's share over the runtime's own delivery of
allocation ticks (as elapsed time over the floor row's, and as corsnap's
own frames in a CPU profile recorded with `-e cpu -e alloc`); and, recording
`-e cpu -e exceptions` of `validate`, corsnap's own frames at most 2% of the
CPU profile.

Exception workloads: `exceptions` does nothing but throw and catch (4
frames deep), the worst case; `requests` parses numbers out of text and
every other request has a malformed one, so int.Parse throws from inside
the base library; `validate` is the issue's two-thread workload. For them
the table also has floor rows (CORSNAP_BENCH_EXCEPTIONS): the runtime's
exception callbacks alone, and those plus the one synchronous stack walk
per exception that exact exception stacks need (with each walker); and the
design issue 18 proposes instead of the callbacks, the runtime's one
`ExceptionThrown_V1` event per throw from an in-process EventPipe session,
alone and with the native walk; and, without corsnap, the third way the
runtime tells code in the process of a throw: an empty
`AppDomain.FirstChanceException` handler, subscribed by a startup hook
(bench/programs/firstchance_hook.cs), and one that calls the agent, which
makes the native walk (on neither the callbacks nor EventPipe). The
alloc workload has one too (CORSNAP_BENCH_ALLOC_SESSION_ONLY): the runtime
delivering its allocation ticks to an agent that ignores them (started
with the snapshot walker, whose start-up is the lighter).

    python3 bench/events.py [--rounds 7] [--runtimes 8,10] [--workloads validate,alloc]
"""
import argparse, os, random, re, statistics, subprocess, sys, tempfile

from common import CORSNAP, OUT, ROOT, paired_slowdown, prepare

# workload -> (event recorded, unit of work, what a unit contains, target)
WORKLOADS = {
    "validate": ("exceptions", "record", 0.25, "6%"),
    "exceptions": ("exceptions", "throw", 1.0, "10%"),
    "requests": ("exceptions", "throw", 0.5, "10%"),
    "alloc": ("alloc", "round", 1.0, "3%"),
}

LABELS = {
    "record": "records (native walker)",
    "record-snapshot": "records (`--walker snapshot`)",
    "record-eventpipe": "records, throws from EventPipe (`CORSNAP_EXCEPTION_HOOK=0`)",
    "monitor": "floor: callbacks only",
    "walk": "floor: callbacks + native walk",
    "walk-snapshot": "floor: callbacks + DoStackSnapshot",
    "eventpipe": "floor: EventPipe's ExceptionThrown only",
    "eventpipe-walk": "floor: EventPipe's ExceptionThrown + native walk",
    "firstchance": "floor: no profiler, an empty FirstChanceException handler",
    "firstchance-walk": "floor: a FirstChanceException handler calling the agent's native walk",
    "hook": "floor: the dispatch hook's call only (.NET 9+)",
    "hook-walk": "floor: the dispatch hook's call + native walk (.NET 9+)",
    "session": "floor: the runtime's allocation events only",
    "cpu": "with `-e cpu`, native",
    "cpu-snapshot": "`-e cpu -e exceptions`, snapshot",
    "cpu-eventpipe": "`-e cpu -e exceptions`, native, throws from EventPipe (`CORSNAP_EXCEPTION_HOOK=0`)",
}


def own_share(path):
    """The share of a collapsed CPU profile's weight in stacks with one of
    corsnap's own frames (its callbacks, and what they call)."""
    total = ours = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            if "libcorsnap_agent" in stack:
                ours += n
    return ours / total if total else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runtimes", default="8,10", help="comma-separated: 8, 9, 10")
    ap.add_argument("--validate", type=int, default=1_200_000, help="records (a quarter of them throw)")
    ap.add_argument("--exceptions", type=int, default=200_000, help="throw/catch pairs")
    ap.add_argument("--requests", type=int, default=200_000, help="requests (half of them throw)")
    ap.add_argument("--allocs", type=int, default=1_500_000, help="allocation rounds")
    ap.add_argument("--cpu-rate", type=int, default=1000,
                    help="samples a second of the `cpu` rows, whose share of corsnap's frames is measured: at 100 Hz a "
                         "run of `validate` holds a few hundred samples, too few to tell 2%% from 3%%")
    ap.add_argument("--workloads", default="validate,alloc", help=f"which of {', '.join(WORKLOADS)}, comma-separated")
    ap.add_argument("--no-floors", dest="floors", action="store_false",
                    help="skip the rows that measure the runtime's share of the cost")
    ap.add_argument("--baseline", help="another build's corsnap binary (its agent beside it): every row is also "
                                       "run with it, interleaved, and marked (baseline)")
    ap.add_argument("--modes", default="",
                    help="only these rows (comma-separated, of " + ", ".join(LABELS) + "), beside the run without "
                         "a profiler: a longer side-by-side comparison of a few")
    args = ap.parse_args()
    if unknown := [m for m in args.modes.split(",") if m and m not in LABELS]:
        sys.exit(f"unknown mode {unknown[0]!r}: choose from {', '.join(LABELS)}")
    env, _ = prepare()
    runtimes = [r for r in args.runtimes.split(",") if r]
    dlls = {}
    for rt in runtimes:
        out = os.path.join(OUT, f"events-net{rt}")
        subprocess.run(["bash", f"{ROOT}/scripts/build-cs.sh", f"{ROOT}/bench/programs/events.cs", out, rt],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        dlls[rt] = (env[f"CORSNAP_DOTNET{rt}"], os.path.join(out, "events.dll"))
        subprocess.run(["bash", f"{ROOT}/scripts/build-cs.sh", f"{ROOT}/bench/programs/firstchance_hook.cs", out, rt],
                       env=env, check=True, stdout=subprocess.DEVNULL)
    corsnap = CORSNAP
    scratch = tempfile.mkdtemp(prefix="corsnap-events-bench-")
    chosen = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in chosen if w not in WORKLOADS]:
        sys.exit(f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}")
    sizes = {"validate": args.validate, "exceptions": args.exceptions, "requests": args.requests,
             "alloc": args.allocs}

    # How a workload runs: without a profiler, recorded (with either
    # walker), or with the agent doing only the runtime's share.
    def modes(workload):
        if WORKLOADS[workload][0] == "exceptions":
            floors = ["monitor", "walk", "walk-snapshot", "eventpipe", "eventpipe-walk", "firstchance",
                      "firstchance-walk", "hook", "hook-walk", "record-eventpipe"]
            extra = ["cpu", "cpu-snapshot", "cpu-eventpipe"] if workload == "validate" else []
        else:
            # corsnap's share of the allocating thread's time, in a CPU
            # profile recorded with the allocations: the elapsed rows'
            # difference from the floor is a few points of a noisy ratio.
            floors, extra = ["session"], ["cpu"]
        every = ["none", "record", "record-snapshot"] + (floors if args.floors else []) + extra
        if args.modes:
            chosen_modes = args.modes.split(",")
            every = ["none"] + [m for m in every if m in chosen_modes]
        if args.baseline:
            # (The first-chance floor runs no corsnap: once.)
            every = every[:1] + [v for m in every[1:] for v in ((m,) if m == "firstchance" else (m, m + "@base"))]
        return every

    shares = {}

    def run(rt, workload, mode):
        binary = args.baseline if mode.endswith("@base") else corsnap
        mode = mode.removesuffix("@base")
        dotnet, dll = dlls[rt]
        program = [dotnet, dll, workload, str(sizes[workload])]
        event = WORKLOADS[workload][0]
        e = dict(env)
        # The allocation floor runs the snapshot walker: the agent ignores
        # the ticks either way, and the native walker's start-up (75 to 160
        # ms of the sampler thread's CPU on `alloc`, .NET 8, against 6 to 8)
        # is corsnap's, not the runtime's delivery.
        walker = "snapshot" if mode.endswith("snapshot") or mode == "session" else "native"
        if mode == "none":
            cmd = program
        elif mode == "firstchance":
            cmd = program
            e["DOTNET_STARTUP_HOOKS"] = os.path.join(os.path.dirname(dll), "firstchance_hook.dll")
        else:
            # `--roots show`: on .NET 9 and later the callbacks run inside the
            # runtime's managed exception dispatch, whose frames (and all
            # above them) a profile otherwise folds into `[exception dispatch]`.
            events = (["-e", "cpu", "-e", event, "--roots", "show", "-r", str(args.cpu_rate)] if mode.startswith("cpu")
                      else ["-e", event])
            cmd = [binary, "record", *events, "--walker", walker, "-f", "collapsed", "-o", f"{scratch}/p.txt",
                   "--"] + program
            if mode == "session":
                e["CORSNAP_BENCH_ALLOC_SESSION_ONLY"] = "1"
            elif mode.startswith("eventpipe"):
                e["CORSNAP_BENCH_EXCEPTIONS"] = mode
            elif mode == "firstchance-walk":
                e["CORSNAP_BENCH_EXCEPTIONS"] = mode
                e["DOTNET_STARTUP_HOOKS"] = os.path.join(os.path.dirname(dll), "firstchance_hook.dll")
            elif mode.startswith("walk"):
                e["CORSNAP_BENCH_EXCEPTIONS"] = "walk"
            elif mode.startswith("hook"):
                e["CORSNAP_BENCH_EXCEPTIONS"] = mode
            elif mode in ("record-eventpipe", "cpu-eventpipe"):
                e["CORSNAP_EXCEPTION_HOOK"] = "0"
            elif mode == "monitor":
                e["CORSNAP_BENCH_EXCEPTIONS"] = "monitor"
        r = subprocess.run(cmd, env=e, capture_output=True, text=True)
        m = re.search(r"elapsed_ms ([\d.]+)", r.stdout)
        if r.returncode != 0 or not m:
            sys.exit(f"{workload} on .NET {rt} ({mode}) failed:\n{r.stdout}\n{r.stderr}")
        if mode.startswith("cpu"):
            key = mode + ("@base" if binary != corsnap else "")
            shares.setdefault((rt, workload, key), []).append(own_share(f"{scratch}/p.cpu.txt"))
        return float(m.group(1))

    # A round runs each workload's rows back to back, in a new order each
    # round, and the workloads in a new order too: a row and the run without
    # a profiler it is paired with are seconds apart, not the whole round
    # (minutes). This host's speed moves on the scale of tens of seconds
    # (one program's run took 1.6 s and 2.3 s in two stretches of the same
    # hour), and with every run of a round shuffled together, the middle
    # half of `alloc`'s paired ratios on .NET 8 spanned 12 points.
    results = {}
    for rnd in range(args.rounds):
        blocks = [(rt, w) for rt in runtimes for w in chosen]
        random.shuffle(blocks)
        for rt, w in blocks:
            order = list(modes(w))
            random.shuffle(order)
            for m in order:
                results.setdefault((rt, w, m), []).append(run(rt, w, m))
        print(f"  round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    load = open("/proc/loadavg").read().split()[:3]
    print(f"\nmedian of {args.rounds} interleaved rounds, {os.cpu_count()} CPUs, load average at the end "
          f"{' '.join(load)}\n")
    print("Slowdown: the ratio of medians; paired: the median of each round's ratio (middle half in brackets);\n"
          "fastest: the ratio of the fastest runs (this host runs a whole program up to 1.7 times slower for\n"
          "stretches of seconds to minutes; the fastest run of each row is the least touched by them).\n"
          "Floor rows record nothing: the agent only takes the runtime's exception callbacks (monitor), or EventPipe's\n"
          "event (eventpipe), and also makes the synchronous walk exact stacks need, with either walker; a startup\n"
          "hook's FirstChanceException handler does nothing, without corsnap (firstchance), or calls the agent's walk\n"
          "(firstchance-walk); or the agent runs the EventPipe session that delivers allocation ticks and ignores\n"
          "them (session). corsnap's share: of the CPU profile recorded with\n"
          f"the exceptions or allocations at {args.cpu_rate} Hz (the weight of stacks with a frame of corsnap's agent), median and\n"
          "range over rounds.\n")
    print("| .NET | workload | agent does | no profiler | corsnap | slowdown | paired | fastest | added per unit | target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rt in runtimes:
        for workload in chosen:
            event, unit, per_item, target = WORKLOADS[workload]
            base_times = results[(rt, workload, "none")]
            base = statistics.median(base_times)
            units = sizes[workload] * per_item
            for mode in modes(workload)[1:]:
                times = results[(rt, workload, mode)]
                prof = statistics.median(times)
                added_us = (prof - base) * 1000 / units
                label = LABELS[mode.removesuffix("@base")] + (" (baseline)" if mode.endswith("@base") else "")
                note = target if mode == "record" else "-"
                if mode.startswith("cpu"):
                    sh = sorted(shares[(rt, workload, mode)])
                    note = (f"corsnap {statistics.median(sh) * 100:.1f}% of CPU ({sh[0] * 100:.1f}..{sh[-1] * 100:.1f})"
                            + (" (target 2%)" if mode == "cpu" and event == "exceptions" else ""))
                print(f"| {rt} | {workload} (`-e {event}`) | {label} | {base:.0f} ms | {prof:.0f} ms "
                      f"| {prof / base:.3f} ({(prof / base - 1) * 100:+.1f}%) | {paired_slowdown(base_times, times)} "
                      f"| {(min(times) / min(base_times) - 1) * 100:+.1f}% "
                      f"| {added_us:.2f} µs per {unit} (of {base * 1000 / units:.2f}) | {note} |")
            if workload == "alloc" and args.floors and not args.modes:
                session = statistics.median(results[(rt, workload, "session")])
                for mode in ["record", "record-snapshot"]:
                    prof = statistics.median(results[(rt, workload, mode)])
                    print(f"| {rt} | alloc | corsnap's share over the runtime's delivery ({LABELS[mode]}) | | | "
                          f"{(prof - session) / base * 100:+.1f}% of the run | | | | |")


if __name__ == "__main__":
    main()
