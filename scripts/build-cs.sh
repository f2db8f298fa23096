#!/usr/bin/env bash
# Compile one C# file with mcs for .NET (Core).
#
#   scripts/build-cs.sh SRC.cs OUTDIR [8|3.1]
#
# Produces OUTDIR/<name>.dll and OUTDIR/<name>.runtimeconfig.json, where <name>
# is SRC's file name without .cs. The runtime defaults to 8. Run the result with
#   "$CORSNAP_DOTNET8" OUTDIR/<name>.dll [args]      (or $CORSNAP_DOTNET31)
#
# mcs is taken from $CORSNAP_MCS, else from PATH (see scripts/setup.sh).
set -euo pipefail

die() { echo "build-cs.sh: error: $*" >&2; exit 1; }

[ $# -ge 2 ] && [ $# -le 3 ] || die "usage: build-cs.sh SRC.cs OUTDIR [8|3.1]"
src="$1"
outdir="$2"
runtime="${3:-8}"

case "$runtime" in
    8|8.0)   framework_version="8.0.0"; invariant="" ;;
    3.1)     framework_version="3.1.0"
             # .NET Core 3.1 does not know ICU >= 71 (Debian 12 has 72).
             invariant=',
    "configProperties": { "System.Globalization.Invariant": true }' ;;
    *)       die "unknown runtime '$runtime' (expected 8 or 3.1)" ;;
esac

[ -f "$src" ] || die "source file not found: $src"
case "$src" in *.cs) ;; *) die "source file must end in .cs: $src" ;; esac
name="$(basename "$src" .cs)"
[ -n "$name" ] || die "cannot derive an assembly name from $src"

mcs="${CORSNAP_MCS:-}"
if [ -z "$mcs" ]; then
    mcs="$(command -v mcs 2>/dev/null)" || die "mcs not found (run scripts/setup.sh, or set CORSNAP_MCS)"
fi
[ -x "$mcs" ] || die "mcs is not executable: $mcs"

mkdir -p "$outdir" || die "cannot create output directory: $outdir"
dll="$outdir/$name.dll"
config="$outdir/$name.runtimeconfig.json"

# mcs writes diagnostics to stdout. Pass warnings and errors on to stderr, but
# drop the "Compilation succeeded" banner so a clean build is silent.
if ! log="$("$mcs" -target:exe -unsafe -optimize+ \
        -r:System.dll -r:System.Core.dll -out:"$dll" "$src" 2>&1)"; then
    printf '%s\n' "$log" >&2
    rm -f "$dll"
    die "mcs failed to compile $src"
fi
log="$(printf '%s\n' "$log" | grep -v '^Compilation succeeded' || true)"
[ -z "$log" ] || printf '%s\n' "$log" >&2

cat >"$config" <<JSON
{
  "runtimeOptions": {
    "framework": { "name": "Microsoft.NETCore.App", "version": "$framework_version" }$invariant
  }
}
JSON
