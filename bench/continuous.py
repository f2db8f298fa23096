#!/usr/bin/env python3
"""The cost of continuous recording: bench/programs/cpu.cs (fixed CPU work on
N threads) without a profiler, under a plain recording (one pprof at the
end), and under `--interval 15s` (windows to a ring of files; windows pushed
to a Pyroscope stand-in), all at 100 Hz, interleaved round by round, in one
run. The work is sized (calibrated first) to last --seconds, so each
continuous run cuts several 15 s windows.

For each mode the table gives the program's work time as a ratio to no
profiler (paired by round), and corsnap's own cost: its CPU time per minute
of recording (read from /proc/PID/stat while it runs: the recording loop,
the window encoding, the upload thread; not the agent inside the program)
and its peak resident memory (VmHWM).

The Pyroscope stand-in is a stdlib HTTP server in this process that answers
200 to every push and counts them.

    python3 bench/continuous.py [--rounds 3] [--seconds 40] [--threads 2]
"""
import argparse, http.server, os, random, re, statistics, subprocess, sys, tempfile, threading, time

from common import CORSNAP, paired_slowdown, prepare

PUSHES = {"count": 0, "bytes": 0}


class Pyroscope(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        PUSHES["count"] += 1
        PUSHES["bytes"] += len(body)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def proc_cpu_and_hwm(pid):
    """corsnap's own CPU seconds (utime + stime, not its children's) and
    peak RSS in KiB, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            hwm = int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))
    except (OSError, AttributeError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, hwm


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=40, help="how long the work lasts without a profiler")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    env, [dll] = prepare("bench/programs/cpu.cs")
    dotnet = env["CORSNAP_DOTNET8"]
    scratch = tempfile.mkdtemp(prefix="corsnap-bench-continuous-")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pyroscope)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    push_url = f"http://127.0.0.1:{server.server_address[1]}"

    def work_ms(iterations):
        r = subprocess.run([dotnet, dll, str(args.threads), str(iterations)], env=env, capture_output=True, text=True)
        return float(re.search(r"elapsed_ms ([\d.]+)", r.stdout).group(1))

    # Calibrate: the work for --seconds.
    probe = 2_000_000
    iterations = int(probe * args.seconds * 1000 / work_ms(probe))
    print(f"{iterations} iterations per thread for about {args.seconds:.0f} s", file=sys.stderr)

    modes = {
        "none": None,
        "plain": ["-f", "pprof", "-o", f"{scratch}/whole.pb.gz"],
        "interval 15s, ring of files": ["--interval", "15s", "-f", "pprof", "-o", f"{scratch}/w-%n{{3}}.pb.gz"],
        "interval 15s, --push": ["--interval", "15s", "--push", push_url, "--service", "bench"],
    }

    def run(mode):
        program = [dotnet, dll, str(args.threads), str(iterations)]
        extra = modes[mode]
        cmd = program if extra is None else [CORSNAP, "record", "-r", "100"] + extra + ["--"] + program
        started = time.monotonic()
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        last = None
        while p.poll() is None:
            if extra is not None:
                last = proc_cpu_and_hwm(p.pid) or last
            time.sleep(0.2)
        out, err = p.communicate()
        wall = time.monotonic() - started
        m = re.search(r"elapsed_ms ([\d.]+)", out)
        if p.returncode != 0 or not m:
            sys.exit(f"{mode} failed ({p.returncode}):\n{out}\n{err}")
        windows = re.search(r"(\d+) windows? \(", err)
        return float(m.group(1)), last, wall, int(windows.group(1)) if windows else None

    results = {}
    for rnd in range(args.rounds):
        order = list(modes)
        random.shuffle(order)
        for mode in order:
            results.setdefault(mode, []).append(run(mode))
        print(f"  round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    print(f"\nmedian of {args.rounds} interleaved rounds, {args.threads} busy threads, 100 Hz, {os.cpu_count()} CPUs\n")
    print("| mode | work time | slowdown (paired) | corsnap CPU per minute | corsnap peak RSS | windows |")
    print("|---|---|---|---|---|---|")
    base = [r[0] for r in results["none"]]
    for mode in modes:
        times = [r[0] for r in results[mode]]
        med = statistics.median(times)
        if mode == "none":
            print(f"| {mode} | {med:.0f} ms | - | - | - | - |")
            continue
        cpu = [r[1][0] / r[2] * 60 for r in results[mode] if r[1]]
        hwm = [r[1][1] for r in results[mode] if r[1]]
        windows = [r[3] for r in results[mode] if r[3] is not None]
        print(f"| {mode} | {med:.0f} ms | {paired_slowdown(base, times)} "
              f"| {statistics.median(cpu) * 1000:.0f} ms | {statistics.median(hwm) / 1024:.1f} MiB "
              f"| {statistics.median(windows) if windows else '-'} |")
    print(f"\npushes received by the stand-in: {PUSHES['count']} ({PUSHES['bytes'] / 1024:.0f} KiB in all)")


if __name__ == "__main__":
    main()
