# Sourced by the other scripts: sets CARGO_SOURCE, the arguments that make
# cargo build from the vendored crates in ../shared/vendor/crates when that
# folder is there (machines without a crate registry), and nothing otherwise.
CARGO_SOURCE=()
_vendor="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/shared/vendor/crates"
if [ -d "$_vendor" ]; then
    CARGO_SOURCE=(--config "source.crates-io.replace-with='vendored'"
                  --config "source.vendored.directory='$_vendor'" --offline)
fi
unset _vendor
