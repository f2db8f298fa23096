# Sourced by the other scripts. Where a folder ../shared/vendor/crates holds
# the crates (machines without a crate registry), writes .cargo/config.toml
# (ignored by git) so that every cargo command run in the project, `cargo
# fmt`'s own `cargo metadata` included, builds from it offline. Elsewhere it
# does nothing and cargo uses its registry. CARGO_SOURCE stays for callers
# that pass it (it is empty).
CARGO_SOURCE=()
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_vendor="$(cd "$_root/.." && pwd)/shared/vendor/crates"
if [ -d "$_vendor" ]; then
    mkdir -p "$_root/.cargo"
    cat >"$_root/.cargo/config.toml" <<TOML
# Written by scripts/cargo-source.sh: build from the vendored crates.
[source.crates-io]
replace-with = "vendored"

[source.vendored]
directory = "$_vendor"

[net]
offline = true
TOML
fi
unset _root _vendor
