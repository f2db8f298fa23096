#!/usr/bin/env python3
"""How quickly corsnap attaches and detaches, measured against a running
C# service (tests/programs/service.cs) on .NET 8.

For each of N cycles: `corsnap record --pid P -d 1 --stats`; corsnap reports
when the first sample arrived (from its own start) and when recording
stopped; meanwhile this script polls /proc/P/maps every millisecond to see
when the agent's library is unmapped, i.e. when the detach has completed.

    python3 bench/attach.py [--cycles 10]
"""
import argparse, os, re, statistics, subprocess, sys, tempfile, threading, time

from common import CORSNAP, prepare


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=10)
    args = ap.parse_args()
    env, [service_dll] = prepare('tests/programs/service.cs')
    corsnap = CORSNAP
    service = subprocess.Popen([env["CORSNAP_DOTNET8"], service_dll, "600"], stdout=subprocess.PIPE, text=True)
    pid = int(service.stdout.readline().split()[1])
    threading.Thread(target=lambda: [None for _ in service.stdout], daemon=True).start()
    scratch = tempfile.mkdtemp(prefix="corsnap-attach-bench-")

    def mapped():
        with open(f"/proc/{pid}/maps") as f:
            return "libcorsnap_agent" in f.read()

    rows = []
    try:
        for cycle in range(args.cycles):
            while mapped():
                time.sleep(0.01)
            gone = {}
            started = time.monotonic()

            def watch():
                seen = False
                while time.monotonic() - started < 30:
                    m = mapped()
                    seen |= m
                    if seen and not m:
                        gone["t"] = (time.monotonic() - started) * 1000
                        return
                    time.sleep(0.001)

            w = threading.Thread(target=watch)
            w.start()
            r = subprocess.run([corsnap, "record", "--pid", str(pid), "-d", "1", "--stats", "-f", "collapsed",
                                "-o", f"{scratch}/p.txt"], capture_output=True, text=True)
            w.join()
            m = re.search(r"first sample ([\d.]+) ms after start; recording stopped at ([\d.]+) ms", r.stderr)
            if r.returncode != 0 or not m or "t" not in gone:
                sys.exit(f"cycle {cycle} failed:\n{r.stderr}")
            first, stopped = float(m.group(1)), float(m.group(2))
            rows.append((first, gone["t"] - stopped))
    finally:
        service.kill()

    firsts = [a for a, _ in rows]
    detaches = [b for _, b in rows]
    print(f"\n{args.cycles} attach/record/detach cycles on one .NET 8 process, {os.cpu_count()} CPUs\n")
    print("| measure | median | min | max |")
    print("|---|---|---|---|")
    for name, v in [("`corsnap record --pid` start to first sample", firsts),
                    ("stop to completed detach (agent unmapped)", detaches)]:
        print(f"| {name} | {statistics.median(v):.1f} ms | {min(v):.1f} ms | {max(v):.1f} ms |")


if __name__ == "__main__":
    main()
