#!/usr/bin/env python3
"""The long torture soak (the short versions run in `cargo test`,
crates/corsnap/tests/torture.rs): for --minutes, alternately
  - record each storm of tests/programs/storm.cs (thread churn, GC storm with
    JIT, exceptions on many threads) at 1000 Hz with cpu, exceptions and gc
    events, checking the program's own exit code and output;
  - attach/record/detach against a process running all storms at once, in a
    loop (--cycles per round, 100 by default), checking it keeps beating and
    the agent leaves each time.
Every run has a deadline that catches a deadlock. Prints what it survived.

    python3 bench/torture.py [--minutes 10] [--cycles 100]
"""
import argparse, os, re, subprocess, sys, tempfile, threading, time

from common import CORSNAP, prepare


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--cycles", type=int, default=100)
    args = ap.parse_args()
    env, [dll] = prepare('tests/programs/storm.cs')
    dotnet = env["CORSNAP_DOTNET8"]
    corsnap = CORSNAP
    scratch = tempfile.mkdtemp(prefix="corsnap-torture-")
    totals = {"runs": 0, "threads": 0, "gcs": 0, "exceptions": 0, "samples": 0, "attach_cycles": 0}
    deadline = time.monotonic() + args.minutes * 60

    def storm(kind):
        r = subprocess.run([corsnap, "record", "--stats", "-r", "1000", "-e", "cpu", "-e", "exceptions", "-e", "gc",
                            "-f", "collapsed", "-o", f"{scratch}/p.txt", "--", dotnet, dll, kind, "20"],
                           env=env, capture_output=True, text=True, timeout=180)
        survived = re.search(r"survived (.*)", r.stdout)
        if r.returncode != 0 or not survived:
            sys.exit(f"storm {kind} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        counts = dict(kv.split("=") for kv in survived.group(1).split())
        totals["runs"] += 1
        totals["threads"] += int(counts["threads"])
        totals["gcs"] += int(counts["gcs"])
        totals["exceptions"] += int(counts["exceptions"])
        totals["samples"] += int(re.search(r"\((\d+) samples", r.stderr).group(1))

    def agent_gone(pid):
        with open(f"/proc/{pid}/maps") as f:
            return "libcorsnap_agent" not in f.read()

    def signal_leftovers(pid):
        """What the signal engine could leave behind: POSIX timers, perf
        event fds, a SIGPROF handler, more than one trampoline page pair."""
        found = []
        try:
            with open(f"/proc/{pid}/timers") as f:
                if f.read().strip():
                    found.append("POSIX timers")
        except FileNotFoundError:
            pass
        def link(fd):
            try:
                return os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:  # closed since the listing
                return ""
        perf = sum(1 for fd in os.listdir(f"/proc/{pid}/fd") if "perf_event" in link(fd))
        if perf:
            found.append(f"{perf} perf event fds")
        with open(f"/proc/{pid}/status") as f:
            caught = int(next(l for l in f if l.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << 26):
            found.append("a SIGPROF handler")
        with open(f"/proc/{pid}/maps") as f:
            trampolines = sum(1 for l in f if "corsnap-signal-trampoline" in l)
        if trampolines > 2:
            found.append(f"{trampolines} trampoline mappings")
        return found

    def attach_loop():
        p = subprocess.Popen([dotnet, dll, "all", "3600"], env=env, stdout=subprocess.PIPE, text=True)
        pid = int(p.stdout.readline().split()[1])
        beats = [0]
        threading.Thread(target=lambda: [beats.__setitem__(0, beats[0] + 1) for _ in p.stdout], daemon=True).start()
        try:
            for cycle in range(args.cycles):
                if time.monotonic() > deadline:
                    break
                r = subprocess.run([corsnap, "record", "--pid", str(pid), "-d", "0.5", "-r", "1000", "-e", "cpu",
                                    "-e", "exceptions", "-e", "gc", "-f", "collapsed", "-o", f"{scratch}/a.txt"],
                                   capture_output=True, text=True, timeout=60)
                if r.returncode != 0:
                    sys.exit(f"attach cycle {cycle} failed:\n{r.stderr}")
                t0 = time.monotonic()
                while not agent_gone(pid):
                    if time.monotonic() - t0 > 10:
                        sys.exit(f"attach cycle {cycle}: the agent did not leave")
                    time.sleep(0.02)
                left = signal_leftovers(pid)
                if left:
                    sys.exit(f"attach cycle {cycle} left behind: {left}")
                before = beats[0]
                t0 = time.monotonic()
                while beats[0] <= before:
                    if p.poll() is not None or time.monotonic() - t0 > 10:
                        how = (f"exited with {p.returncode} (negative: killed by that signal)" if p.poll() is not None
                               else "still running, no heartbeat for 10 s")
                        sys.exit(f"attach cycle {cycle}: the process stopped beating: {how}\n{r.stderr[-2000:]}")
                    time.sleep(0.02)
                totals["attach_cycles"] += 1
        finally:
            p.kill()

    while time.monotonic() < deadline:
        for kind in ("churn", "gc", "exceptions"):
            if time.monotonic() < deadline:
                storm(kind)
        if time.monotonic() < deadline:
            attach_loop()
        print(f"  {totals}", file=sys.stderr)
    print(f"\nsurvived {args.minutes:g} minutes: {totals['runs']} storm runs at 1000 Hz, {totals['threads']} threads "
          f"created and destroyed, {totals['gcs']} GCs, {totals['exceptions']} exceptions recorded, "
          f"{totals['samples']} samples, {totals['attach_cycles']} attach/record/detach cycles under storm, each "
          f"leaving no timer, perf event, SIGPROF handler or agent mapping behind")


if __name__ == "__main__":
    main()
