#!/usr/bin/env bash
# Installs what corsnap's tests and examples need, the way a user's machine
# gets it:
#   - .NET 10: the SDK on PATH (`dotnet`: runtime, Roslyn, ASP.NET Core)
#   - .NET 9, 8 and Core 3.1: their runtime packs from NuGet (latest patch of
#     each), restored by the SDK's own NuGet client and laid out as dotnet
#     roots under the cache: <cache>/dotnet-<version>/dotnet
#   - the reference packs that Roslyn compiles the test programs against
#   - Debian's tmux (the tests drive `corsnap top` in a pane) and wrk
#     (ASP.NET Core under load), and gcc unless clang is there (the native
#     AOT shape test links with one; zlib comes in its runtime pack)
# and writes ${CORSNAP_DEPS}/env.sh exporting CORSNAP_DOTNET10/9/8/31,
# CORSNAP_REF10/9/8/31 (the assemblies to compile against) and CORSNAP_CSC.
#
# Idempotent: anything already present and working is left alone. Silent on
# success except for one line per thing it installed. Nothing comes from PyPI.
#
# Environment:
#   CORSNAP_DEPS   where to put the runtimes (default: $HOME/.cache/corsnap)
#
# Note: .NET Core 3.1 only knows ICU up to version ~70; on Debian 12 (ICU 72)
# it must run with DOTNET_SYSTEM_GLOBALIZATION_INVARIANT=1 (scripts/build-cs.sh
# also sets System.Globalization.Invariant in 3.1 runtimeconfig files).
set -euo pipefail

DEPS="${CORSNAP_DEPS:-$HOME/.cache/corsnap}"
mkdir -p "$DEPS"
DEPS="$(cd "$DEPS" && pwd -P)"   # absolute, so env.sh works from anywhere
NET9=9.0.22
NET8=8.0.33
NET31=3.1.3

die() { echo "setup.sh: error: $*" >&2; exit 1; }

# Run a command, discarding its output unless it fails.
quiet() {
    local log
    log="$(mktemp)"
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

# ---- Debian packages -------------------------------------------------------
apt_updated=""
apt_install() {   # apt_install COMMAND PACKAGE
    command -v "$1" >/dev/null 2>&1 && return 0
    command -v apt-get >/dev/null 2>&1 || die "$1 not found and apt-get is unavailable; install $2 manually"
    if [ -z "$apt_updated" ]; then
        quiet as_root apt-get update || die "apt-get update failed"
        apt_updated=1
    fi
    quiet as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$2" \
        || die "apt-get install $2 failed"
    command -v "$1" >/dev/null 2>&1 || die "$2 installed but $1 is still not on PATH"
    echo "installed $2 ($1)"
}
apt_install tmux tmux
apt_install wrk wrk
command -v clang >/dev/null 2>&1 || apt_install gcc gcc

# ---- .NET 10: the SDK ------------------------------------------------------
sdk_dotnet="$(command -v dotnet 2>/dev/null || true)"
[ -n "$sdk_dotnet" ] || die "the .NET 10 SDK is not on PATH (install dotnet-sdk-10.0, see https://learn.microsoft.com/dotnet/core/install/linux)"
sdk_dotnet="$(readlink -f "$sdk_dotnet")"
sdk_root="$(dirname "$sdk_dotnet")"
runtimes="$("$sdk_dotnet" --list-runtimes 2>/dev/null)" || die "$sdk_dotnet --list-runtimes failed"
grep -q '^Microsoft\.NETCore\.App 10\.' <<<"$runtimes" || die "$sdk_dotnet has no .NET 10 runtime (install the .NET 10 SDK)"
sdk_version="$("$sdk_dotnet" --version 2>/dev/null)" || die "$sdk_dotnet has no SDK (install the .NET 10 SDK, not only the runtime)"
CSC="$sdk_root/sdk/$sdk_version/Roslyn/bincore/csc.dll"
[ -f "$CSC" ] || die "Roslyn not found at $CSC"
REF10="$(ls -d "$sdk_root"/packs/Microsoft.NETCore.App.Ref/10.*/ref/net10.0 2>/dev/null | sort -V | tail -1)"
[ -n "$REF10" ] || die "the .NET 10 reference pack is missing under $sdk_root/packs"

# ---- .NET 9, 8, 3.1: runtime packs from NuGet -----------------------------
PKGS="$DEPS/nuget"
pack_dir() { echo "$PKGS/$1/$2"; }   # pack_dir lowercase-id version
need_restore=""
for v in $NET9 $NET8 $NET31; do
    [ -d "$(pack_dir microsoft.netcore.app.runtime.linux-x64 $v)/runtimes" ] || need_restore=1
done
for v in $NET9 $NET8; do
    [ -d "$(pack_dir microsoft.netcore.app.ref $v)/ref" ] || need_restore=1
done
if [ -n "$need_restore" ]; then
    proj="$(mktemp -d)"
    cat >"$proj/download.csproj" <<XML
<Project Sdk="Microsoft.NET.Sdk">
  <PropertyGroup><TargetFramework>net10.0</TargetFramework></PropertyGroup>
  <ItemGroup>
    <PackageDownload Include="Microsoft.NETCore.App.Runtime.linux-x64" Version="[$NET9];[$NET8];[$NET31]" />
    <PackageDownload Include="Microsoft.NETCore.App.Ref" Version="[$NET9];[$NET8]" />
  </ItemGroup>
</Project>
XML
    quiet "$sdk_dotnet" restore "$proj/download.csproj" --packages "$PKGS" \
        || die "restoring the .NET runtime packs from NuGet failed (see above)"
    rm -rf "$proj"
    echo "downloaded .NET runtime packs $NET9, $NET8 and $NET31 from NuGet into $PKGS"
fi

# write_deps_json DIR VERSION: a framework deps.json naming DIR's files.
write_deps_json() {
    local dir="$1" v="$2" tfm f sep
    tfm=".NETCoreApp,Version=v${v%.*}"
    {
        printf '{\n  "runtimeTarget": { "name": "%s/linux-x64", "signature": "" },\n' "$tfm"
        printf '  "compilationOptions": {},\n  "targets": {\n    "%s": {},\n' "$tfm"
        printf '    "%s/linux-x64": {\n      "runtimepack.Microsoft.NETCore.App.Runtime.linux-x64/%s": {\n' "$tfm" "$v"
        printf '        "runtime": {\n'
        sep=""
        for f in "$dir"/*.dll; do
            printf '%s          "%s": {}' "$sep" "$(basename "$f")"
            sep=$',\n'
        done
        printf '\n        },\n        "native": {\n'
        sep=""
        for f in "$dir"/*; do
            case "$f" in *.dll|*.json|*.md|*.txt) continue ;; esac
            printf '%s          "%s": {}' "$sep" "$(basename "$f")"
            sep=$',\n'
        done
        printf '\n        }\n      }\n    }\n  },\n'
        printf '  "libraries": {\n    "runtimepack.Microsoft.NETCore.App.Runtime.linux-x64/%s": { "type": "runtimepack", "serviceable": false, "sha512": "" }\n  }\n}\n' "$v"
    } >"$dir/Microsoft.NETCore.App.deps.json"
}

# make_root VERSION: a dotnet root (muxer, hostfxr, shared framework) made of
# the SDK's muxer and the runtime pack, as an installed runtime is laid out.
make_root() {
    local v="$1" root="$DEPS/dotnet-$1" pack native lib tmp
    if [ -x "$root/dotnet" ] && DOTNET_SYSTEM_GLOBALIZATION_INVARIANT=1 "$root/dotnet" --list-runtimes 2>/dev/null \
            | grep -q "^Microsoft\.NETCore\.App ${v//./\\.} "; then
        return 0
    fi
    pack="$(pack_dir microsoft.netcore.app.runtime.linux-x64 "$v")/runtimes/linux-x64"
    native="$pack/native"
    lib="$(ls -d "$pack"/lib/* | head -1)"
    tmp="$root.tmp"
    rm -rf "$tmp"
    mkdir -p "$tmp/host/fxr/$v" "$tmp/shared/Microsoft.NETCore.App/$v"
    cp "$sdk_dotnet" "$tmp/dotnet"
    cp "$native/libhostfxr.so" "$tmp/host/fxr/$v/"
    cp "$lib"/* "$tmp/shared/Microsoft.NETCore.App/$v/"
    find "$native" -maxdepth 1 -type f ! -name 'libhostfxr.so' ! -name '*.a' \
        -exec cp {} "$tmp/shared/Microsoft.NETCore.App/$v/" \;
    chmod +x "$tmp/dotnet" "$tmp/shared/Microsoft.NETCore.App/$v/createdump" 2>/dev/null || true
    # 3.1's pack has no deps.json, which its host requires: list the files,
    # as the installed runtime's own does.
    [ -f "$tmp/shared/Microsoft.NETCore.App/$v/Microsoft.NETCore.App.deps.json" ] \
        || write_deps_json "$tmp/shared/Microsoft.NETCore.App/$v" "$v"
    rm -rf "$root"
    mv "$tmp" "$root"
    DOTNET_SYSTEM_GLOBALIZATION_INVARIANT=1 "$root/dotnet" --list-runtimes 2>/dev/null \
        | grep -q "^Microsoft\.NETCore\.App ${v//./\\.} " || die "made $root but it does not list Microsoft.NETCore.App $v"
    echo "installed .NET runtime $v at $root"
}
make_root $NET9
make_root $NET8
make_root $NET31

# ---- env.sh ----------------------------------------------------------------
env_tmp="$(mktemp "$DEPS/env.sh.XXXXXX")"
{
    echo "# Generated by scripts/setup.sh; source this file."
    echo "# .NET Core 3.1 needs DOTNET_SYSTEM_GLOBALIZATION_INVARIANT=1 here (no compatible libicu)."
    printf 'export CORSNAP_DOTNET10=%q\n' "$sdk_dotnet"
    printf 'export CORSNAP_DOTNET9=%q\n' "$DEPS/dotnet-$NET9/dotnet"
    printf 'export CORSNAP_DOTNET8=%q\n' "$DEPS/dotnet-$NET8/dotnet"
    printf 'export CORSNAP_DOTNET31=%q\n' "$DEPS/dotnet-$NET31/dotnet"
    printf 'export CORSNAP_REF10=%q\n' "$REF10"
    printf 'export CORSNAP_REF9=%q\n' "$(pack_dir microsoft.netcore.app.ref $NET9)/ref/net9.0"
    printf 'export CORSNAP_REF8=%q\n' "$(pack_dir microsoft.netcore.app.ref $NET8)/ref/net8.0"
    # No reference pack for 3.1 is needed: its implementation assemblies do.
    printf 'export CORSNAP_REF31=%q\n' "$DEPS/dotnet-$NET31/shared/Microsoft.NETCore.App/$NET31"
    printf 'export CORSNAP_CSC=%q\n' "$CSC"
} >"$env_tmp"
chmod 644 "$env_tmp"
mv -f "$env_tmp" "$DEPS/env.sh"
