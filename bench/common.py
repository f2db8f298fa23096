"""What every benchmark does first: install what is missing, build corsnap,
compile the C# workloads."""
import os, re, statistics, subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where cargo puts its builds: $CARGO_TARGET_DIR when set, as cargo does.
CORSNAP = os.path.join(os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target"), "release/corsnap")
OUT = os.path.join(ROOT, "target/bench")


def prepare(*programs, runtime="8"):
    """Runs scripts/setup.sh, builds the workspace in release mode, compiles
    each C# source (a path relative to the repository) for .NET 8 (or
    `runtime`: "10", "9"). Returns the environment (with CORSNAP_DOTNET8 and
    friends) and the compiled .dll paths."""
    subprocess.run(["bash", f"{ROOT}/scripts/setup.sh"], check=True)
    deps = os.environ.get("CORSNAP_DEPS", os.path.expanduser("~/.cache/corsnap"))
    env = dict(os.environ)
    with open(os.path.join(deps, "env.sh")) as f:
        for line in f:
            m = re.match(r"\s*export\s+(\w+)=['\"]?([^'\"\n]*)", line)
            if m:
                env[m.group(1)] = m.group(2)
    subprocess.run(["cargo", "build", "--release", "--workspace", "--quiet"], cwd=ROOT, check=True)
    dlls = []
    for program in programs:
        subprocess.run(["bash", f"{ROOT}/scripts/build-cs.sh", os.path.join(ROOT, program), OUT, runtime], env=env, check=True)
        dlls.append(os.path.join(OUT, os.path.splitext(os.path.basename(program))[0] + ".dll"))
    return env, dlls


def paired_slowdown(base, profiled):
    """Slowdown from runs paired by round (the same round's base and
    profiled run saw the same machine): the median of the per-round ratios,
    and the middle half of them, as "+x.x% (+a.a..+b.b)"."""
    ratios = sorted(p / b for b, p in zip(base, profiled))
    if len(ratios) < 4:
        return f"{(statistics.median(ratios) - 1) * 100:+.1f}%"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return f"{(statistics.median(ratios) - 1) * 100:+.1f}% ({(q1 - 1) * 100:+.1f}..{(q3 - 1) * 100:+.1f})"
