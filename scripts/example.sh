#!/usr/bin/env bash
# Profiles the bundled example app and writes a flame graph: the first thing
# to run on a fresh machine. Installs the runtime and compiler if missing.
#   scripts/example.sh [output.svg]
set -euo pipefail
cd "$(dirname "$0")/.."
# Written under target/ (ignored by git) unless a path is given.
out="${1:-target/examples/busy.svg}"
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${CORSNAP_DEPS:-$HOME/.cache/corsnap}/env.sh"
cargo build --release --workspace --quiet
bash scripts/build-cs.sh examples/busy/Busy.cs target/examples 8
mkdir -p "$(dirname "$out")"
target/release/corsnap record --threads -o "$out" -- "$CORSNAP_DOTNET8" target/examples/Busy.dll 5
echo "open $out in a browser"
