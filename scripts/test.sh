#!/usr/bin/env bash
# The whole test suite: installs the runtimes and compiler if missing, builds
# the agent and CLI, and runs every test, including the end-to-end ones under
# the real .NET 8 and .NET Core 3.1 runtimes (which never skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${CORSNAP_DEPS:-$HOME/.cache/corsnap}/env.sh"
# Strict lints and formatting first (inferno's habit): cheap, and they fail fast.
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
# The end-to-end tests find the agent next to the corsnap binary, so both
# must be built (cargo test alone would not build the cdylib).
cargo build --release --workspace --quiet
# Two at a time: the machines have two cores and the tests measure proportions.
cargo test --release --workspace -- --test-threads=2
