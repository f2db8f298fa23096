#!/usr/bin/env bash
# Profiles the bundled example app and writes a flame graph: the first thing
# to run on a fresh machine. Installs the runtimes and tools if missing.
#   scripts/example.sh [output.svg]
set -euo pipefail
cd "$(dirname "$0")/.."
# Written under target/ (ignored by git) unless a path is given.
out="${1:-target/examples/busy.svg}"
echo "example.sh: checking the .NET runtimes and tools (scripts/setup.sh)..."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${CORSNAP_DEPS:-$HOME/.cache/corsnap}/env.sh"
# shellcheck disable=SC1091
. scripts/cargo-source.sh
echo "example.sh: building corsnap (cargo build --release; a minute or two the first time)..."
cargo "${CARGO_SOURCE[@]}" build --release --workspace
bash scripts/build-cs.sh examples/busy/Busy.cs target/examples 10
mkdir -p "$(dirname "$out")"
echo "example.sh: profiling the example for 5 seconds..."
target/release/corsnap record --threads -o "$out" -- "$CORSNAP_DOTNET10" target/examples/Busy.dll 5
echo "open $out in a browser"
