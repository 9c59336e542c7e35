#!/usr/bin/env bash
# Build the GPU-check bundle (docs/gpu.md): everything scripts/gpu_check.sh needs on an offline
# GPU host besides torch and this repository, in one git-ignored folder (default .gpu-bundle/,
# under 30 MB):
#   wheels/       the core's dependencies (pyproject.toml's, torch excluded) and numpy (torch's
#                 .numpy() needs it; the check installs it only where the host has none), for
#                 one Python version and platform, binary wheels only
#   redis/redis-server   the server from Debian's redis-tools package (redis-server depends on
#                 it; that package itself holds only config files), unpacked, not installed
#   redis/lib/    the shared libraries it links that a GPU host may lack, from their Debian
#                 packages; gpu_check.sh uses only those the host's loader cannot find
#   MANIFEST.txt  what is in it
# Run on a connected Debian/Ubuntu x86-64 machine (apt-get download, dpkg -x, ldd, pip), from
# anywhere in the checkout:
#   bash scripts/gpu_bundle.sh [--python-version 3.12] [--platform manylinux2014_x86_64]
#                              [--out .gpu-bundle]
# Pins: the versions in .venv when there is one (what the tests ran), else pyproject.toml's.
set -euo pipefail
cd "$(dirname "$0")/.."

py_version=3.12
platforms=()
out=.gpu-bundle
limit_mb=30
while [ $# -gt 0 ]; do
    case "$1" in
    --python-version) py_version=$2; shift 2 ;;
    --platform) platforms+=("$2"); shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_bundle: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ ${#platforms[@]} -gt 0 ] || platforms=(manylinux2014_x86_64 manylinux_2_28_x86_64)
for tool in apt-get dpkg dpkg-deb ldd; do
    command -v "$tool" >/dev/null || { echo "gpu_bundle: needs $tool (Debian/Ubuntu)" >&2; exit 2; }
done
if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi

rm -rf "$out"
mkdir -p "$out/wheels" "$out/redis/lib"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --- wheels ------------------------------------------------------------------------------
# The core's requirements (torch excluded: the GPU host has its own CUDA build), pinned to the
# versions installed in .venv when it has them.
mapfile -t reqs < <("$python" - <<'EOF'
import re, tomllib
from importlib import metadata
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] + ["numpy"]
for spec in deps:
    name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0)
    if name.lower() == "torch":
        continue
    extras = re.match(r"[A-Za-z0-9_.-]+(\[[^\]]*\])?", spec).group(1) or ""
    try:
        print(f"{name}{extras}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(spec)
EOF
)
platform_args=()
for p in "${platforms[@]}"; do platform_args+=(--platform "$p"); done
echo "gpu_bundle: wheels for Python $py_version (${platforms[*]}): ${reqs[*]}"
"$python" -m pip download --quiet --only-binary=:all: --implementation cp \
    --python-version "$py_version" "${platform_args[@]}" --dest "$out/wheels" "${reqs[@]}"

# --- redis-server ------------------------------------------------------------------------
# The binary is /usr/bin/redis-check-rdb of redis-tools (redis-server is a link to it); it acts
# as the server when its name says redis-server.
(cd "$work" && apt-get download -o APT::Sandbox::User=root redis-tools >/dev/null)
dpkg -x "$work"/redis-tools_*.deb "$work/redis-tools"
cp "$work/redis-tools/usr/bin/redis-check-rdb" "$out/redis/redis-server"
binary="$out/redis/redis-server"
redis_deb=$(basename "$work"/redis-tools_*.deb)

# Libraries: every one it links (ldd lists the indirect ones too) except glibc's own (they must
# match the host's loader), libstdc++ and libgcc_s (torch needs them: a torch host has them) and
# OpenSSL 3 (every glibc >= 2.34 distribution, which this binary needs anyway, ships it; it
# would double the bundle).
skip='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s|libssl|libcrypto)\.'
declare -A known=([liblzf.so.1]=liblzf1 [libjemalloc.so.2]=libjemalloc2 [libatomic.so.1]=libatomic1)

package_of() { # soname, path or "" -> the Debian package that ships it
    local soname=$1 path=$2 found=""
    if [ -n "$path" ]; then
        found=$(dpkg -S "$path" 2>/dev/null || dpkg -S "$(readlink -f "$path")" 2>/dev/null ||
            dpkg -S "/usr$path" 2>/dev/null || true)
    fi
    [ -n "$found" ] || found=$(dpkg -S "/$soname" 2>/dev/null | grep -m1 "x86_64-linux-gnu/$soname\$" || true)
    if [ -n "$found" ]; then echo "${found%%:*}"; else echo "${known[$soname]:-}"; fi
}

libs=()
while read -r soname _ path _; do
    [[ "$soname" =~ $skip ]] && continue
    [ "$path" = "not" ] && path=""
    pkg=$(package_of "$soname" "$path")
    [ -n "$pkg" ] || { echo "gpu_bundle: no Debian package known for $soname" >&2; exit 1; }
    mkdir -p "$work/pkg/$pkg"
    if [ ! -e "$work/pkg/$pkg.done" ]; then
        (cd "$work/pkg" && apt-get download -o APT::Sandbox::User=root "$pkg" >/dev/null)
        dpkg -x "$work"/pkg/"${pkg}"_*.deb "$work/pkg/$pkg"
        touch "$work/pkg/$pkg.done"
    fi
    file=$(find "$work/pkg/$pkg" -name "$soname" | head -1)
    [ -n "$file" ] || { echo "gpu_bundle: $pkg has no $soname" >&2; exit 1; }
    cp -L "$file" "$out/redis/lib/$soname"
    libs+=("$soname ($pkg)")
done < <(ldd "$binary" | awk '/=>/ {print $1, $2, $3, $4}')

# --- manifest and size -------------------------------------------------------------------
{
    echo "hma_redis GPU-check bundle, built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm)"
    echo "python_version=$py_version"
    echo "platforms=${platforms[*]}"
    echo "redis=$redis_deb"
    echo "libs=${libs[*]}"
    echo "wheels:"
    (cd "$out/wheels" && ls -1)
} >"$out/MANIFEST.txt"

bytes=$(du -sb "$out" | cut -f1)
echo "gpu_bundle: $out: $(awk -v b="$bytes" 'BEGIN {printf "%.1f MB", b / 1e6}')" \
    "($(ls "$out/wheels" | wc -l) wheels, redis-server, ${#libs[@]} libraries: ${libs[*]})"
if [ "$bytes" -gt $((limit_mb * 1000000)) ]; then
    echo "gpu_bundle: over the ${limit_mb} MB a GPU host takes" >&2
    exit 1
fi
