#!/usr/bin/env python3
"""corsnap's overhead, measured side by side in one run.

Runs bench/programs/cpu.cs (a fixed amount of CPU work) with 1 and 8 busy
threads: without a profiler, under corsnap at 100 Hz and 1000 Hz, and under
the runtime's own EventPipe sample profiler. corsnap runs with its default
pause budget (--max-pause 2) and, at 100 Hz, also without one
(--max-pause 100), so the table shows what the budget buys. The
suspend-only rows are the floor: the agent suspends and resumes the runtime
each tick and walks nothing (CORSNAP_BENCH_SUSPEND_ONLY=1), so they show what
the runtime's own suspension costs, which no sampler built on SuspendRuntime
can go below. Configurations are interleaved
round by round so that noise on a shared machine hits them alike; the table
gives each one's median work time as a ratio to no profiler, and the agent's
own per-tick cost from its statistics.

    python3 bench/run.py [--rounds 5] [--iterations 12000000]
"""
import argparse, os, random, re, statistics, subprocess, sys, tempfile

from common import CORSNAP, paired_slowdown, prepare


def sh(cmd, env=None):
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=12_000_000, help="work per thread")
    ap.add_argument("--threads", default="1,8")
    args = ap.parse_args()

    env, [dll] = prepare('bench/programs/cpu.cs')
    dotnet, corsnap = env["CORSNAP_DOTNET8"], CORSNAP
    scratch = tempfile.mkdtemp(prefix="corsnap-bench-")

    def run(config, threads):
        program = [dotnet, dll, str(threads), str(args.iterations)]
        e = dict(env)
        if config == "none":
            cmd = program
        elif config.startswith("corsnap") or config.startswith("suspend-only"):
            rate, _, budget = config.split("@")[1].partition(" ")
            pause = "100" if budget == "no-budget" or config.startswith("suspend-only") else "2"
            if config.startswith("suspend-only"):
                e["CORSNAP_BENCH_SUSPEND_ONLY"] = "1"
            cmd = [corsnap, "record", "--stats", "-r", rate, "--max-pause", pause, "-f", "collapsed",
                   "-o", f"{scratch}/p.txt", "--"] + program
        else:  # EventPipe's own sampler, switched on by environment alone
            e.update(DOTNET_EnableEventPipe="1", DOTNET_EventPipeConfig="Microsoft-DotNETCore-SampleProfiler:0:5",
                     DOTNET_EventPipeOutputPath=f"{scratch}/trace.nettrace")
            cmd = program
        r = sh(cmd, e)
        m = re.search(r"elapsed_ms ([\d.]+)", r.stdout)
        if r.returncode != 0 or not m:
            sys.exit(f"{config} with {threads} threads failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        tick = re.search(r"agent: (\d+) ticks \((\d+) skipped, (\d+) throttled\); per tick median suspend ([\d.]+) µs, "
                         r"walk ([\d.]+) µs, resume ([\d.]+) µs", r.stderr)
        return float(m.group(1)), tuple(float(x) for x in tick.groups()) if tick else None

    configs = ["none", "corsnap@100", "corsnap@100 no-budget", "suspend-only@100", "corsnap@1000",
               "corsnap@1000 no-budget", "suspend-only@1000", "eventpipe"]
    results = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        for rnd in range(args.rounds):
            order = configs[:]
            random.shuffle(order)
            for c in order:
                results.setdefault((threads, c), []).append(run(c, threads))
            print(f"  round {rnd + 1}/{args.rounds} with {threads} threads done", file=sys.stderr)

    print(f"\nwork: {args.iterations} iterations per thread, median of {args.rounds} interleaved rounds, "
          f"{os.cpu_count()} CPUs\n")
    print("Slowdown: the ratio of medians; paired: the median of each round's ratio to that round's run\n"
          "without a profiler (middle half of the rounds in brackets).\n")
    print("| busy threads | profiler | median work time | slowdown vs none | paired | ticks taken / throttled (median) "
          "| agent median µs per tick: suspend / walk / resume |")
    print("|---|---|---|---|---|---|---|")
    for threads in sorted({t for t, _ in results}):
        base_times = [x for x, _ in results[(threads, "none")]]
        base = statistics.median(base_times)
        for c in configs:
            times = [x for x, _ in results[(threads, c)]]
            ticks = [t for _, t in results[(threads, c)] if t is not None]
            med = statistics.median(times)
            tick = " / ".join(f"{statistics.median(t[i] for t in ticks):.1f}" for i in (3, 4, 5)) if ticks else "-"
            taken = (f"{statistics.median(t[0] for t in ticks):.0f} / {statistics.median(t[2] for t in ticks):.0f}"
                     if ticks else "-")
            paired = paired_slowdown(base_times, times) if c != "none" else "-"
            print(f"| {threads} | {c} | {med:.0f} ms | {med / base:.3f} ({(med / base - 1) * 100:+.1f}%) | {paired} | {taken} "
                  f"| {tick} |")


if __name__ == "__main__":
    main()
