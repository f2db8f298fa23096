#!/usr/bin/env python3
"""corsnap's overhead and accuracy, measured side by side in one run.

Runs bench/programs/cpu.cs (a fixed amount of CPU work) with 1 and 8 busy
threads: without a profiler, under corsnap's two engines at 100 Hz and
1000 Hz, and under the runtime's own EventPipe sample profiler.

- signal: the default engine (perf events where the kernel allows them);
  signal-timers: the same with POSIX CPU timers instead (--cpu-clock timer),
  what a container without perf_event_open gets; signal-handler-walk: the
  default engine with each stack walked in the signal handler, as before
  copy-first sampling (CORSNAP_WALK_IN_HANDLER=1), so that what moving the
  walk to the agent's thread costs the program shows beside it.
- suspend: SuspendRuntime + DoStackSnapshot every tick, default pause budget.
- suspend-only: the floor of any SuspendRuntime sampler: the agent suspends
  and resumes each tick and walks nothing (CORSNAP_BENCH_SUSPEND_ONLY=1).

Configurations are interleaved round by round so that noise on a shared
machine hits them alike; the table gives each one's median work time as a
ratio to no profiler, and the agent's own cost from its statistics (per
sample in the signal handler, per tick for suspend).

Then accuracy: tests/programs/phases.cs measures its own three phases; each
engine's profile of it is compared with that, as the largest difference in
points over the three shares (median over --rounds runs at 100 Hz).

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

    env, [dll, phases_dll] = prepare('bench/programs/cpu.cs', 'tests/programs/phases.cs')
    dotnet, corsnap = env["CORSNAP_DOTNET8"], CORSNAP
    scratch = tempfile.mkdtemp(prefix="corsnap-bench-")

    def run(config, threads):
        program = [dotnet, dll, str(threads), str(args.iterations)]
        e = dict(env)
        if config == "none":
            cmd = program
        elif config != "eventpipe":
            engine, _, rate = config.partition("@")
            sampler = "signal" if engine.startswith("signal") else "suspend"
            clock = ["--cpu-clock", "timer"] if engine == "signal-timers" else []
            if engine == "suspend-only":
                e["CORSNAP_BENCH_SUSPEND_ONLY"] = "1"
            if engine == "signal-handler-walk":
                e["CORSNAP_WALK_IN_HANDLER"] = "1"
            pause = "100" if engine == "suspend-only" else "2"
            cmd = [corsnap, "record", "--stats", "--sampler", sampler, "-r", rate, "--max-pause", pause,
                   "-f", "collapsed", "-o", f"{scratch}/p.txt"] + clock + ["--"] + program
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
        handler = re.search(r"agent \(signal engine\): (\d+) samples.*?handler median ([\d.]+) µs, p99 ([\d.]+) µs",
                            r.stderr)
        cost = None
        if tick:
            cost = ("tick", tuple(float(x) for x in tick.groups()))
        elif handler:
            cost = ("signal", tuple(float(x) for x in handler.groups()))
        return float(m.group(1)), cost

    configs = ["none", "signal@100", "signal-timers@100", "suspend@100", "suspend-only@100",
               "signal@1000", "signal-handler-walk@1000", "signal-timers@1000", "suspend@1000", "suspend-only@1000",
               "eventpipe"]
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
          "without a profiler (middle half of the rounds in brackets). Agent cost: signal engine, median and p99\n"
          "of the time from entering the handler to the stored sample; suspend, median µs per tick to suspend,\n"
          "walk and resume.\n")
    print("| busy threads | profiler | median work time | slowdown vs none | paired | samples or ticks (median) "
          "| agent cost |")
    print("|---|---|---|---|---|---|---|")
    for threads in sorted({t for t, _ in results}):
        base_times = [x for x, _ in results[(threads, "none")]]
        base = statistics.median(base_times)
        for c in configs:
            times = [x for x, _ in results[(threads, c)]]
            costs = [k for _, k in results[(threads, c)] if k is not None]
            med = statistics.median(times)
            if costs and costs[0][0] == "tick":
                taken = f"{statistics.median(k[1][0] for k in costs):.0f} ticks"
                cost = "suspend / walk / resume " + " / ".join(
                    f"{statistics.median(k[1][i] for k in costs):.1f}" for i in (3, 4, 5)) + " µs"
            elif costs:
                taken = f"{statistics.median(k[1][0] for k in costs):.0f} samples"
                cost = (f"handler {statistics.median(k[1][1] for k in costs):.1f} µs median, "
                        f"{statistics.median(k[1][2] for k in costs):.1f} µs p99")
            else:
                taken, cost = "-", "-"
            paired = paired_slowdown(base_times, times) if c != "none" else "-"
            print(f"| {threads} | {c} | {med:.0f} ms | {med / base:.3f} ({(med / base - 1) * 100:+.1f}%) | {paired} "
                  f"| {taken} | {cost} |")

    # Accuracy on a program that measures itself.
    methods = ["Phases.Trig", "Phases.Build", "Phases.Parse"]
    errors = {}
    for rnd in range(args.rounds):
        for engine in ("signal", "suspend"):
            r = sh([corsnap, "record", "--sampler", engine, "-f", "collapsed", "-o", f"{scratch}/phases.txt", "--",
                    dotnet, phases_dll, "3"], env)
            truth = dict((k, float(v)) for k, v in re.findall(r"(\w+)=([\d.]+)", r.stdout.split("share", 1)[1].split("\n")[0]))
            weight = {m: 0 for m in methods}
            for line in open(f"{scratch}/phases.txt"):
                stack, count = line.rsplit(" ", 1)
                for m in methods:
                    if m in stack.split(";"):
                        weight[m] += int(count)
            total = sum(weight.values()) or 1
            worst = max(abs(weight[m] / total - truth[m.split(".")[1].lower()]) * 100 for m in methods)
            errors.setdefault(engine, []).append(worst)
    print("\nAccuracy (tests/programs/phases.cs, 100 Hz): the largest error over its three self-measured shares\n")
    print("| engine | median error | runs |")
    print("|---|---|---|")
    for engine, errs in errors.items():
        print(f"| {engine} | {statistics.median(errs):.1f} points | {', '.join(f'{e:.1f}' for e in errs)} |")


if __name__ == "__main__":
    main()
