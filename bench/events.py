#!/usr/bin/env python3
"""The cost of the event profiles: an exception-heavy and an allocation-heavy
C# workload (bench/programs/events.cs, fixed work) without a profiler and
under `corsnap record --event exceptions` / `--event alloc`, interleaved
round by round, as ratios. Targets: exceptions at most 10% slower,
allocations at most 3%.

    python3 bench/events.py [--rounds 7]
"""
import argparse, os, random, re, statistics, subprocess, sys, tempfile

from common import CORSNAP, prepare


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--exceptions", type=int, default=40_000, help="throw/catch pairs")
    ap.add_argument("--allocs", type=int, default=150_000, help="allocation rounds")
    args = ap.parse_args()
    env, [dll] = prepare('bench/programs/events.cs')
    dotnet = env["CORSNAP_DOTNET8"]
    corsnap = CORSNAP
    scratch = tempfile.mkdtemp(prefix="corsnap-events-bench-")

    def run(workload, profiled):
        n = args.exceptions if workload == "exceptions" else args.allocs
        program = [dotnet, dll, workload, str(n)]
        cmd = [corsnap, "record", "-e", workload, "-f", "collapsed", "-o", f"{scratch}/p.txt", "--"] + program if profiled else program
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        m = re.search(r"elapsed_ms ([\d.]+)", r.stdout)
        if r.returncode != 0 or not m:
            sys.exit(f"{workload} (profiled={profiled}) failed:\n{r.stdout}\n{r.stderr}")
        return float(m.group(1))

    results = {}
    for rnd in range(args.rounds):
        configs = [(w, p) for w in ("exceptions", "alloc") for p in (False, True)]
        random.shuffle(configs)
        for c in configs:
            results.setdefault(c, []).append(run(*c))
        print(f"  round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    print(f"\nmedian of {args.rounds} interleaved rounds, {os.cpu_count()} CPUs\n")
    print("| workload | no profiler | corsnap | slowdown | added per unit of work | target |")
    print("|---|---|---|---|---|---|")
    for workload, target, n, unit in (("exceptions", "10%", args.exceptions, "throw"),
                                      ("alloc", "3%", args.allocs, "round")):
        base = statistics.median(results[(workload, False)])
        prof = statistics.median(results[(workload, True)])
        added_us = (prof - base) * 1000 / n
        print(f"| {workload} (`--event {workload}`) | {base:.0f} ms | {prof:.0f} ms | {prof / base:.3f} "
              f"({(prof / base - 1) * 100:+.1f}%) | {added_us:.2f} µs per {unit} (of {base * 1000 / n:.2f}) | {target} |")


if __name__ == "__main__":
    main()
