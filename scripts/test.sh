#!/usr/bin/env bash
# The whole test suite: installs the runtimes and tools if missing, builds
# the agent and CLI, and runs every test, including the end-to-end ones under
# real .NET 10, 9, 8 and Core 3.1 runtimes (which never skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${CORSNAP_DEPS:-$HOME/.cache/corsnap}/env.sh"
# shellcheck disable=SC1091
. scripts/cargo-source.sh
# Strict lints and formatting first (inferno's habit): cheap, and they fail fast.
cargo fmt --all -- --check
cargo "${CARGO_SOURCE[@]}" clippy --release --workspace --all-targets --quiet -- -D warnings
# The end-to-end tests find the agent next to the corsnap binary, so both
# must be built (cargo test alone would not build the cdylib).
cargo "${CARGO_SOURCE[@]}" build --release --workspace --quiet
# Two at a time: the machines have two cores and the tests measure proportions.
cargo "${CARGO_SOURCE[@]}" test --release --workspace --no-fail-fast -- --test-threads=2
