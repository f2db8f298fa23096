#!/usr/bin/env bash
# Compile one C# file with Roslyn (the .NET SDK's csc), Release, with a
# portable PDB, for a .NET runtime.
#
#   scripts/build-cs.sh SRC.cs OUTDIR [10|9|8|3.1]
#
# Produces OUTDIR/<name>.dll, OUTDIR/<name>.pdb and
# OUTDIR/<name>.runtimeconfig.json, where <name> is SRC's file name without
# .cs. The runtime defaults to 10. Run the result with
#   "$CORSNAP_DOTNET10" OUTDIR/<name>.dll [args]      (or $CORSNAP_DOTNET8 ...)
#
# A source with the line `// corsnap-build: aspnetcore` is an ASP.NET Core
# app (.NET 10 only): it is also compiled against the SDK's
# Microsoft.AspNetCore.App reference pack ($CORSNAP_REF_ASPNET10, else the
# newest under the SDK's packs/), and its runtimeconfig names the
# Microsoft.AspNetCore.App framework.
#
# CORSNAP_CSC_DEBUG=embedded embeds the portable PDB in the assembly
# (`csc -debug:embedded`) instead of writing it beside.
#
# The compiler and the assemblies compiled against come from
# $CORSNAP_DEPS/env.sh (scripts/setup.sh), unless already in the environment.
set -euo pipefail

die() { echo "build-cs.sh: error: $*" >&2; exit 1; }

[ $# -ge 2 ] && [ $# -le 3 ] || die "usage: build-cs.sh SRC.cs OUTDIR [10|9|8|3.1]"
src="$1"
outdir="$2"
runtime="${3:-10}"

if [ -z "${CORSNAP_CSC:-}" ]; then
    env_sh="${CORSNAP_DEPS:-$HOME/.cache/corsnap}/env.sh"
    [ -f "$env_sh" ] || die "$env_sh not found (run scripts/setup.sh)"
    # shellcheck disable=SC1090
    . "$env_sh"
fi

invariant=""
case "$runtime" in
    10|10.0) framework_version="10.0.0"; tfm=net10.0; refs="${CORSNAP_REF10:-}" ;;
    9|9.0)   framework_version="9.0.0"; tfm=net9.0; refs="${CORSNAP_REF9:-}" ;;
    8|8.0)   framework_version="8.0.0"; tfm=net8.0; refs="${CORSNAP_REF8:-}" ;;
    3.1)     framework_version="3.1.0"; tfm=netcoreapp3.1; refs="${CORSNAP_REF31:-}"
             # .NET Core 3.1 does not know ICU >= 71 (Debian 12 has 72).
             invariant=',
    "configProperties": { "System.Globalization.Invariant": true }' ;;
    *)       die "unknown runtime '$runtime' (expected 10, 9, 8 or 3.1)" ;;
esac
[ -d "$refs" ] || die "no assemblies to compile against for .NET $runtime (run scripts/setup.sh)"

[ -f "$src" ] || die "source file not found: $src"
case "$src" in *.cs) ;; *) die "source file must end in .cs: $src" ;; esac
name="$(basename "$src" .cs)"
[ -n "$name" ] || die "cannot derive an assembly name from $src"

framework=Microsoft.NETCore.App
extra_refs=""
if grep -q '^// corsnap-build: aspnetcore *$' "$src"; then
    case "$runtime" in 10|10.0) ;; *) die "$src is an ASP.NET Core app: .NET 10 only" ;; esac
    extra_refs="${CORSNAP_REF_ASPNET10:-}"
    if [ -z "$extra_refs" ]; then
        dotnet_root="$(dirname "$(readlink -f "$(command -v "${CORSNAP_DOTNET10:-dotnet}")")")"
        extra_refs="$(ls -d "$dotnet_root"/packs/Microsoft.AspNetCore.App.Ref/10.*/ref/net10.0 2>/dev/null | sort -V | tail -n 1)"
    fi
    [ -d "$extra_refs" ] || die "no Microsoft.AspNetCore.App reference pack for .NET 10 (set CORSNAP_REF_ASPNET10)"
    framework=Microsoft.AspNetCore.App
fi

mkdir -p "$outdir" || die "cannot create output directory: $outdir"
dll="$outdir/$name.dll"
config="$outdir/$name.runtimeconfig.json"

debug="${CORSNAP_CSC_DEBUG:-portable}"
case "$debug" in portable|embedded) ;; *) die "CORSNAP_CSC_DEBUG must be portable or embedded, not '$debug'" ;; esac

rsp="$(mktemp)"
trap 'rm -f "$rsp"' EXIT
{
    echo "-nologo -target:exe -optimize+ -deterministic -debug:${debug} -unsafe -langversion:latest"
    echo "-nowarn:CS1701,CS1702,CS8981"
    printf -- '-out:"%s"\n' "$dll"
    for f in "$refs"/*.dll; do
        # 3.1's implementation folder also holds native libraries' managed
        # shims; only assemblies with metadata are references.
        case "$(basename "$f")" in Microsoft.DiaSymReader.Native*|mscordaccore*|*.ni.dll) continue ;; esac
        printf -- '-r:"%s"\n' "$f"
    done
    if [ -n "$extra_refs" ]; then
        for f in "$extra_refs"/*.dll; do printf -- '-r:"%s"\n' "$f"; done
    fi
    printf '"%s"\n' "$src"
} >"$rsp"
if ! log="$("${CORSNAP_DOTNET10:-dotnet}" "$CORSNAP_CSC" "@$rsp" 2>&1)"; then
    printf '%s\n' "$log" >&2
    rm -f "$dll"
    die "csc failed to compile $src for .NET $runtime"
fi
[ -z "$log" ] || printf '%s\n' "$log" >&2

cat >"$config" <<JSON
{
  "runtimeOptions": {
    "tfm": "$tfm",
    "framework": { "name": "$framework", "version": "$framework_version" }$invariant
  }
}
JSON
