#!/usr/bin/env python3
"""ASP.NET Core under load: what recording a Kestrel app by pid costs in
requests per second, against dotnet-trace, in the same run.

tests/programs/webapp.cs (a minimal-API app, GET /work?n=2000: LINQ and
string formatting, about 60% of its CPU time) runs on .NET 10, on 127.0.0.1,
for the whole run. Each measurement window is one `wrk -t1 -c8 -dSECONDS`
against it. Each round has a window without a profiler before and after every
profiler's window:

    none, P1, none, P2, none, P3, none

with P1..P3 the profilers in a fresh random order each round:

- corsnap: `corsnap record --pid` at 100 Hz, default signal engine and its
  default clock (`--cpu-clock auto`: perf events on threads that run long
  stretches, POSIX CPU timers on threads that block often);
- corsnap-perf: the same with `--cpu-clock perf` (perf events on every
  thread);
- corsnap-timer: the same with `--cpu-clock timer` (POSIX CPU timers);
- dotnet-trace: `dotnet-trace collect --profile
  dotnet-common,dotnet-sampled-thread-time`, EventPipe's sample profiler and
  the runtime's default events: what `collect --profile cpu-sampling` was
  before dotnet-trace 9.0.661903 (where `cpu-sampling` became a
  `collect-linux` kernel profile that `collect` refuses), and what `collect`
  does with no profile now.

A profiler's window starts once it samples (corsnap: its agent logs that it
started; dotnet-trace: it prints its output file, once the session is on)
and ends with wrk; the profiler is then stopped (SIGINT), and the next
window starts once corsnap's agent is unmapped or dotnet-trace has exited.
The profilers' own processes run on the same two CPUs, as they would.

A profiler's loss is 1 - during / mean(before, after) of each round (the
windows either side of it), given as the median over rounds with the middle
half of the rounds in brackets. Failed requests (non-2xx/3xx, socket errors)
are counted for every window and must be zero.

Requests/s on a shared machine move with everyone else's load, by far more
than 2% from one window to the next. So each window also measures the CPU
time per request of the app (/proc/PID/stat) and, during a profiler's
window, of the profiler's own process: what throughput comes to when the app
has the CPUs to itself; it does not depend on how much CPU the others leave
the app, though it still moves with how they disturb it (caches, the thread
pool spinning more or less).

dotnet-trace is installed into $CORSNAP_DEPS/tools (~/.cache/corsnap/tools)
from NuGet (`dotnet tool install`) if it is not there.

    python3 bench/aspnet.py [--rounds 7] [--seconds 6] [--profilers corsnap,corsnap-perf,corsnap-timer,dotnet-trace]
"""
import argparse, os, random, re, signal, statistics, subprocess, sys, tempfile, threading, time

from common import CORSNAP, prepare

PROFILERS = ["corsnap", "corsnap-perf", "corsnap-timer", "dotnet-trace"]


def install_dotnet_trace(env):
    """The dotnet-trace in $CORSNAP_DEPS/tools, installed there if missing;
    returns its path and version."""
    deps = env.get("CORSNAP_DEPS", os.path.expanduser("~/.cache/corsnap"))
    tools = os.path.join(deps, "tools")
    tool = os.path.join(tools, "dotnet-trace")
    if not os.path.exists(tool):
        subprocess.run([env["CORSNAP_DOTNET10"], "tool", "install", "dotnet-trace", "--tool-path", tools,
                        "--version", "10.0.*"], env=env, check=True)
    version = subprocess.run([tool, "--version"], env=env, capture_output=True, text=True, check=True).stdout
    return tool, version.strip().split("+")[0]


TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def cpu_ns(pid):
    """CPU time of a process so far (all its threads, the exited ones too),
    in ns; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return (int(fields[11]) + int(fields[12])) * TICK_NS  # utime, stime


def wrk(url, seconds, pids=()):
    """One wrk window: requests/s, p50 and p99 latency in ms, failures, and
    the CPU time `pids` used meanwhile, per request, in µs."""
    cpu_before = sum(cpu_ns(p) for p in pids)
    r = subprocess.run(["wrk", "-t1", "-c8", f"-d{seconds}s", "--latency", url], capture_output=True, text=True)
    cpu = sum(cpu_ns(p) for p in pids) - cpu_before
    out = r.stdout
    if r.returncode != 0 or "Requests/sec:" not in out:
        sys.exit(f"wrk failed ({r.returncode}):\n{out}\n{r.stderr}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    failures = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    failures += int(m.group(1)) if m else 0

    def latency(pct):
        value, unit = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    requests = int(re.search(r"(\d+) requests in", out).group(1))
    return {"rps": rps, "p50": latency(50), "p99": latency(99), "failures": failures,
            "cpu_us": cpu / 1000 / max(requests, 1)}


def agent_mapped(pid):
    with open(f"/proc/{pid}/maps") as f:
        return "libcorsnap_agent" in f.read()


def wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    sys.exit(f"timed out waiting for {what}")


def measure(profiler, pid, url, seconds, env, dotnet_trace, scratch):
    """One window under `profiler` ("none" for none): wrk's figures, and the
    profiler's own report (corsnap's --stats)."""
    if profiler == "none":
        return wrk(url, seconds, [pid]), None
    if profiler.startswith("corsnap"):
        log = os.path.join(scratch, "agent.log")
        if os.path.exists(log):
            os.remove(log)
        clock = {"corsnap-timer": ["--cpu-clock", "timer"], "corsnap-perf": ["--cpu-clock", "perf"]}.get(profiler, [])
        p = subprocess.Popen([CORSNAP, "record", "--pid", str(pid), "-r", "100", "--stats", "-f", "collapsed",
                              "-o", os.path.join(scratch, "p.txt"), "--agent-log", log] + clock,
                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)

        def started():
            if p.poll() is not None:
                sys.exit(f"corsnap exited before its agent started:\n{p.stderr.read()}")
            return os.path.exists(log) and "started (attached)" in open(log, errors="replace").read()

        wait_for(started, 30, "corsnap's agent to start")
        result = wrk(url, seconds, [pid, p.pid])
        p.send_signal(signal.SIGINT)
        stderr = p.communicate(timeout=60)[1]
        if p.returncode != 0:
            sys.exit(f"corsnap failed ({p.returncode}):\n{stderr}")
        wait_for(lambda: not agent_mapped(pid), 30, "the agent to be unmapped")
        m = re.search(r"(\d+) samples from (\d+) threads now sampled \((\d+) by CPU timers.*?\), (\d+) dropped; "
                      r"per sample in the handler median ([\d.]+) µs, p99 ([\d.]+) µs;.*agent thread CPU (\d+) ms",
                      stderr)
        return result, {"samples": int(m.group(1)), "threads": int(m.group(2)), "on_timers": int(m.group(3)),
                        "handler_median": float(m.group(5)), "handler_p99": float(m.group(6)),
                        "agent_cpu_ms": int(m.group(7))} if m else None
    # dotnet-trace: its session is on once it prints the output file's name.
    p = subprocess.Popen([dotnet_trace, "collect", "-p", str(pid), "--profile",
                          "dotnet-common,dotnet-sampled-thread-time", "-o", os.path.join(scratch, "t.nettrace"),
                          "--duration", "00:00:10:00"],
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("Output File"):
            break
    else:
        sys.exit(f"dotnet-trace never started ({p.wait()}):\n{''.join(seen)}")
    result = wrk(url, seconds, [pid, p.pid])
    p.send_signal(signal.SIGINT)
    rest = p.communicate(timeout=120)[0]
    if p.returncode != 0 or "Trace completed" not in rest:
        sys.exit(f"dotnet-trace failed ({p.returncode}):\n{''.join(seen)}{rest}")
    return result, {"trace_bytes": os.path.getsize(os.path.join(scratch, "t.nettrace"))}


def spread(values):
    """Median and middle half of per-round values, as percentages."""
    med = statistics.median(values)
    if len(values) < 4:
        return f"{med * 100:+.1f}%"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{med * 100:+.1f}% ({q1 * 100:+.1f}..{q3 * 100:+.1f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=int, default=6, help="length of each wrk window")
    ap.add_argument("--profilers", default=",".join(PROFILERS))
    args = ap.parse_args()
    profilers = args.profilers.split(",")
    for p in profilers:
        if p not in PROFILERS:
            sys.exit(f"unknown profiler {p!r} (expected some of {', '.join(PROFILERS)})")

    env, [dll] = prepare("tests/programs/webapp.cs", runtime="10")
    env["DOTNET_SYSTEM_GLOBALIZATION_INVARIANT"] = "1"
    dotnet_trace, trace_version = install_dotnet_trace(env) if "dotnet-trace" in profilers else (None, None)
    scratch = tempfile.mkdtemp(prefix="corsnap-aspnet-bench-")
    app = subprocess.Popen([env["CORSNAP_DOTNET10"], dll, "86400"], env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, text=True)
    ready = app.stdout.readline().split()
    if len(ready) != 3 or ready[0] != "ready":
        sys.exit(f"webapp did not start: {ready}")
    pid, port = int(ready[1]), int(ready[2])
    threading.Thread(target=lambda: [None for _ in app.stdout], daemon=True).start()
    url = f"http://127.0.0.1:{port}/work?n=2000"

    windows = []  # (round, position, profiler, wrk result, profiler report)
    loads = [os.getloadavg()[0]]
    try:
        # Warm-up: JIT tiers, Kestrel's and the thread pool's pools.
        warm = wrk(url, max(10, args.seconds))
        print(f"  warm-up: {warm['rps']:.0f} requests/s", file=sys.stderr)
        for rnd in range(args.rounds):
            order = profilers[:]
            random.shuffle(order)
            sequence = ["none"]
            for p in order:
                sequence += [p, "none"]
            for position, p in enumerate(sequence):
                result, report = measure(p, pid, url, args.seconds, env, dotnet_trace, scratch)
                windows.append((rnd, position, p, result, report))
            loads.append(os.getloadavg()[0])
            figures = ", ".join(f"{w[2]} {w[3]['rps']:.0f}" for w in windows if w[0] == rnd)
            print(f"  round {rnd + 1}/{args.rounds} (load average {loads[-1]:.2f}): {figures}", file=sys.stderr)
    finally:
        app.kill()

    # Per profiler and round: the windows before, during and after.
    by_round = {}
    for rnd, position, p, result, report in windows:
        by_round.setdefault(rnd, {})[position] = (p, result, report)
    rows = {p: [] for p in profilers}
    for rnd, seq in by_round.items():
        for position, (p, result, report) in seq.items():
            if p != "none":
                rows[p].append((seq[position - 1][1], result, seq[position + 1][1], report))

    failures = sum(w[3]["failures"] for w in windows) + warm["failures"]
    print(f"\nwebapp.cs on .NET 10 (Kestrel, 127.0.0.1), `wrk -t1 -c8 -d{args.seconds}s` per window, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs shared by the app, wrk and the profiler "
          f"(and other users: load average {min(loads):.2f}..{max(loads):.2f})")
    if trace_version:
        print(f"dotnet-trace {trace_version}")
    print(f"failed requests (non-2xx/3xx and socket errors), all windows: {failures}\n")
    names = {"corsnap": "corsnap 100 Hz", "corsnap-perf": "corsnap 100 Hz, `--cpu-clock perf`",
             "corsnap-timer": "corsnap 100 Hz, `--cpu-clock timer`",
             "dotnet-trace": "dotnet-trace (EventPipe sampler)"}

    def series(p, key):
        return ([b[key] for b, _, _, _ in rows[p]], [d[key] for _, d, _, _ in rows[p]],
                [a[key] for _, _, a, _ in rows[p]])

    print("Requests/s: medians over rounds. Loss: each round's 1 - during / mean(before, after), median over rounds\n"
          "(middle half in brackets); after vs before likewise.\n")
    print("| profiler | before | during | after | loss | after vs before | p99 latency before / during |")
    print("|---|---|---|---|---|---|---|")
    loss_rounds = {}
    for p in profilers:
        before, during, after = series(p, "rps")
        loss = [1 - d / ((b + a) / 2) for b, d, a in zip(before, during, after)]
        drift = [a / b - 1 for b, a in zip(before, after)]
        loss_rounds[p] = loss
        p99b, p99d, _ = (statistics.median(x) for x in series(p, "p99"))
        print(f"| {names[p]} | {statistics.median(before):.0f} | {statistics.median(during):.0f} | "
              f"{statistics.median(after):.0f} | {spread(loss)} | {spread(drift)} | {p99b:.2f} / {p99d:.2f} ms |")

    print("\nCPU time per request, the app's and (during) the profiler's own process's, in µs: what the requests/s\n"
          "above come to on a machine of one's own, whatever CPU the others leave. Cost: each round's\n"
          "during / mean(before, after) - 1, median over rounds (middle half in brackets).\n")
    print("| profiler | before | during | after | cost | profiler's own report |")
    print("|---|---|---|---|---|---|")
    cost_rounds = {}
    for p in profilers:
        before, during, after = series(p, "cpu_us")
        cost = [d / ((b + a) / 2) - 1 for b, d, a in zip(before, during, after)]
        cost_rounds[p] = cost
        reports = [r for _, _, _, r in rows[p] if r]
        if reports and "samples" in reports[0]:
            own = (f"{statistics.median(r['samples'] for r in reports):.0f} samples a window, handler "
                   f"{statistics.median(r['handler_median'] for r in reports):.1f} µs median, "
                   f"{statistics.median(r['handler_p99'] for r in reports):.1f} µs p99; "
                   f"{statistics.median(r['on_timers'] for r in reports):.0f} of "
                   f"{statistics.median(r['threads'] for r in reports):.0f} threads on timers; agent thread "
                   f"{statistics.median(r['agent_cpu_ms'] for r in reports):.0f} ms CPU a recording")
        elif reports:
            own = f"trace {statistics.median(r['trace_bytes'] for r in reports) / 1e6:.1f} MB a window"
        else:
            own = "-"
        print(f"| {names[p]} | {statistics.median(before):.1f} | {statistics.median(during):.1f} | "
              f"{statistics.median(after):.1f} | {spread(cost)} | {own} |")
    if "corsnap" in loss_rounds:
        # Decided only when the middle half of the rounds is on one side of 2%.
        for what, per_round in (("requests/s lost", loss_rounds), ("CPU per request added", cost_rounds)):
            v = per_round["corsnap"]
            q1, q3 = (statistics.quantiles(v, n=4)[0::2] if len(v) >= 4 else (min(v), max(v)))
            verdict = "met" if q3 <= 0.02 else "MISSED" if q1 > 0.02 else "not shown either way"
            against = ""
            if "dotnet-trace" in per_round:
                below = statistics.median(v) < statistics.median(per_round["dotnet-trace"])
                against = (f"; {'below' if below else 'NOT below'} dotnet-trace's "
                           f"{statistics.median(per_round['dotnet-trace']) * 100:+.1f}%")
            print(f"{'' if what.startswith('CPU') else chr(10)}target, {what} at 100 Hz at most 2%: {verdict} "
                  f"({statistics.median(v) * 100:+.1f}%, middle half {q1 * 100:+.1f}..{q3 * 100:+.1f}){against}")
    if failures:
        sys.exit(f"{failures} requests failed")


if __name__ == "__main__":
    main()
