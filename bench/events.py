#!/usr/bin/env python3
"""The cost of the event profiles: exception-heavy and allocation-heavy C#
workloads (bench/programs/events.cs, fixed work) without a profiler and
under `corsnap record --event exceptions` / `--event alloc`, interleaved
round by round, as ratios. Targets: exceptions at most 10% slower,
allocations at most 3%.

Two exception workloads: `exceptions` does nothing but throw and catch (4
frames deep), the worst case; `requests` parses numbers out of text and
every other request has a malformed one, so int.Parse throws from inside
the base library. Both spend most of their time in exception handling, so
the table also gives the cost per throw: a program's slowdown is that times
its exception rate. For them the table also has floor rows
(CORSNAP_BENCH_EXCEPTIONS): the runtime's exception callbacks alone, and
those plus the one synchronous stack walk per exception that exact exception
stacks need, which no recorder of them can go below. The alloc workload has
one too (CORSNAP_BENCH_ALLOC_SESSION_ONLY): the runtime delivering its
allocation ticks, each with a stack walk of its own, to an agent that
ignores them.

    python3 bench/events.py [--rounds 7]
"""
import argparse, os, random, re, statistics, subprocess, sys, tempfile

from common import CORSNAP, paired_slowdown, prepare

# workload -> (event recorded, unit of work, what a unit contains, target)
WORKLOADS = {
    "exceptions": ("exceptions", "throw", 1.0, "10%"),
    "requests": ("exceptions", "throw", 0.5, "10%"),
    "alloc": ("alloc", "round", 1.0, "3%"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--exceptions", type=int, default=200_000, help="throw/catch pairs")
    ap.add_argument("--requests", type=int, default=200_000, help="requests (half of them throw)")
    ap.add_argument("--allocs", type=int, default=1_500_000, help="allocation rounds")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="which of them, comma-separated")
    ap.add_argument("--no-floors", dest="floors", action="store_false",
                    help="skip the rows that measure the runtime's share of the exception cost")
    args = ap.parse_args()
    env, [dll] = prepare('bench/programs/events.cs')
    dotnet = env["CORSNAP_DOTNET8"]
    corsnap = CORSNAP
    scratch = tempfile.mkdtemp(prefix="corsnap-events-bench-")
    chosen = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in chosen if w not in WORKLOADS]:
        sys.exit(f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}")
    sizes = {"exceptions": args.exceptions, "requests": args.requests, "alloc": args.allocs}

    # How a workload runs: without a profiler, recorded, or (exception
    # workloads) with the agent doing only the runtime's share: its exception
    # callbacks (`monitor`), then also the synchronous walk (`walk`).
    def modes(workload):
        floors = {"exceptions": ["monitor", "walk"], "alloc": ["session"]}[WORKLOADS[workload][0]] if args.floors else []
        return ["none", "record"] + floors

    def run(workload, mode):
        program = [dotnet, dll, workload, str(sizes[workload])]
        event = WORKLOADS[workload][0]
        e = dict(env)
        if mode == "none":
            cmd = program
        else:
            cmd = [corsnap, "record", "-e", event, "-f", "collapsed", "-o", f"{scratch}/p.txt", "--"] + program
            if mode == "session":
                e["CORSNAP_BENCH_ALLOC_SESSION_ONLY"] = "1"
            elif mode != "record":
                e["CORSNAP_BENCH_EXCEPTIONS"] = mode
        r = subprocess.run(cmd, env=e, capture_output=True, text=True)
        m = re.search(r"elapsed_ms ([\d.]+)", r.stdout)
        if r.returncode != 0 or not m:
            sys.exit(f"{workload} ({mode}) failed:\n{r.stdout}\n{r.stderr}")
        return float(m.group(1))

    results = {}
    for rnd in range(args.rounds):
        configs = [(w, m) for w in chosen for m in modes(w)]
        random.shuffle(configs)
        for c in configs:
            results.setdefault(c, []).append(run(*c))
        print(f"  round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    print(f"\nmedian of {args.rounds} interleaved rounds, {os.cpu_count()} CPUs\n")
    print("Slowdown: the ratio of medians; paired: the median of each round's ratio (middle half in brackets).\n"
          "Floor rows: the agent only takes the runtime's exception callbacks (monitor), and also makes the\n"
          "synchronous walk the issue asks for (walk); or it runs the EventPipe session that delivers allocation\n"
          "ticks and ignores them (session). Floor rows record nothing.\n")
    print("| workload | agent does | no profiler | corsnap | slowdown | paired | added per unit | target |")
    print("|---|---|---|---|---|---|---|---|")
    labels = {"record": "records", "monitor": "floor: callbacks only", "walk": "floor: callbacks + walk",
              "session": "floor: the runtime's allocation events only"}
    for workload in chosen:
        event, unit, per_item, target = WORKLOADS[workload]
        base_times = results[(workload, "none")]
        base = statistics.median(base_times)
        units = sizes[workload] * per_item
        for mode in modes(workload)[1:]:
            times = results[(workload, mode)]
            prof = statistics.median(times)
            added_us = (prof - base) * 1000 / units
            print(f"| {workload} (`--event {event}`) | {labels[mode]} | {base:.0f} ms | {prof:.0f} ms "
                  f"| {prof / base:.3f} ({(prof / base - 1) * 100:+.1f}%) | {paired_slowdown(base_times, times)} "
                  f"| {added_us:.2f} µs per {unit} (of {base * 1000 / units:.2f}) "
                  f"| {target if mode == 'record' else '-'} |")


if __name__ == "__main__":
    main()
