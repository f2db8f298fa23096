#!/usr/bin/env python3
"""The profiled process's extra resident memory under corsnap.

Runs a 50-thread C# process (bench/programs/many.cs) for SECONDS without a
profiler and under `corsnap record -r 100`, side by side, sampling the
process's VmRSS from /proc once a second. The extra memory is the
difference; its growth per second over the second half of the run,
extrapolated to one hour, gives the one-hour figure (stated as such).

    python3 bench/memory.py [--seconds 60] [--threads 50] [--sampler signal|suspend]
"""
import argparse, os, re, subprocess, tempfile, time

from common import CORSNAP, prepare


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
    except (OSError, AttributeError):
        return None


def run(cmd, env, seconds):
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pid = int(p.stdout.readline().split()[1])
    samples = []
    start = time.monotonic()
    while p.poll() is None:
        r = rss_kib(pid)
        if r is not None:
            samples.append((time.monotonic() - start, r))
        time.sleep(1)
    p.stdout.read()
    return samples


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--threads", type=int, default=50)
    ap.add_argument("--sampler", default="signal", help="signal (default) or suspend")
    args = ap.parse_args()
    env, [many_dll] = prepare('bench/programs/many.cs')
    program = [env["CORSNAP_DOTNET8"], many_dll, str(args.threads), str(args.seconds)]
    scratch = tempfile.mkdtemp(prefix="corsnap-memory-bench-")
    corsnap = [CORSNAP, "record", "--sampler", args.sampler, "-r", "100", "-f", "raw", "-o", f"{scratch}/p.corsnap",
               "--"]

    results = {}
    for name, cmd in (("none", program), ("corsnap", corsnap + program)):
        # The process whose memory counts is the dotnet program, corsnap's child.
        results[name] = run(cmd, env, args.seconds)
    base, prof = results["none"], results["corsnap"]
    half = args.seconds / 2

    def late(samples):
        return [(t, r) for t, r in samples if t >= half and t <= args.seconds - 1]

    def slope(samples):
        pts = late(samples)
        if len(pts) < 2:
            return 0.0
        (t0, r0), (t1, r1) = pts[0], pts[-1]
        return (r1 - r0) / (t1 - t0)

    def median_late(samples):
        v = sorted(r for _, r in late(samples))
        return v[len(v) // 2] if v else 0

    extra_kib = median_late(prof) - median_late(base)
    growth = slope(prof) - slope(base)  # KiB per second attributable to corsnap
    hour = extra_kib + max(growth, 0) * (3600 - args.seconds)
    print(f"\n{args.threads}-thread .NET 8 process, {args.seconds:.0f} s each, sampled at 100 Hz, {os.cpu_count()} CPUs\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| resident memory without a profiler (median, 2nd half) | {median_late(base) / 1024:.1f} MiB |")
    print(f"| resident memory under corsnap (median, 2nd half) | {median_late(prof) / 1024:.1f} MiB |")
    print(f"| extra resident memory | {extra_kib / 1024:.1f} MiB |")
    print(f"| growth attributable to corsnap (2nd half) | {growth:.1f} KiB/s |")
    print(f"| one hour, extrapolated from this run | {hour / 1024:.1f} MiB (target: under 32 MiB) |")


if __name__ == "__main__":
    main()
