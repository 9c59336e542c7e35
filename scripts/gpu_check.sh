#!/usr/bin/env bash
# Run the GPU check (hma_redis.tools.gpu.check, docs/gpu.md) on an offline host that has Python
# and torch (CUDA) but nothing else of hma_redis: from the repository root,
#   bash scripts/gpu_check.sh [--python PY] [--no-build] BUNDLE TABLE_FILE [-- CHECK_ARGS...]
# BUNDLE is the folder scripts/gpu_bundle.sh built; TABLE_FILE receives the table (also printed).
# CHECK_ARGS go to the check (e.g. -- --device cpu, -- --connections 1,8).
# Nothing is installed on the host: in a temporary folder (removed at exit) it
#   1. installs the bundle's wheels (pip install --no-index --no-deps --target; numpy only if the
#      host's Python has none),
#   2. copies hma_redis/ and builds its native extension there with the host's C compiler when
#      there is one and Python's headers (else the pure-Python data path runs; the table says
#      which),
#   3. makes a redis-server launcher that adds the bundled libraries the host lacks, and
#   4. runs the check with both on PYTHONPATH / PATH: it starts redis-server and a 3-shard
#      cluster (--save '' --appendonly no, io-threads sized from nproc) and stops them.
# Exit status: the check's (0 every byte right, 1 a wrong byte, 2 could not run).
set -euo pipefail

python=${PYTHON:-python3}
build=1
while [ $# -gt 0 ]; do
    case "$1" in
    --python) python=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    --) break ;;
    -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "usage: bash scripts/gpu_check.sh [--python PY] [--no-build] BUNDLE TABLE_FILE [-- CHECK_ARGS...]" >&2
    exit 2
fi
bundle=$(cd "$1" && pwd)
case "$2" in /*) table=$2 ;; *) table=$PWD/$2 ;; esac
shift 2
[ "${1:-}" != "--" ] || shift

fail() { echo "gpu_check: $*" >&2; exit 2; }
[ -f hma_redis/tools/gpu/check.py ] || fail "run from the repository root (hma_redis/ not found)"
[ -x "$bundle/redis/redis-server" ] || fail "$bundle has no redis/redis-server (build it with scripts/gpu_bundle.sh)"
command -v "$python" >/dev/null || fail "no $python (give --python or PYTHON=)"
# An absolute path (not resolved: a venv's python is a link that must keep its name): the check
# runs from another directory.
case "$python" in
*/*) python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python") ;;
*) python=$(command -v "$python") ;;
esac
"$python" -c "import torch" 2>/dev/null || fail "$python cannot import torch"

have=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
want=$(sed -n 's/^python_version=//p' "$bundle/MANIFEST.txt" 2>/dev/null || true)
if [ -n "$want" ] && [ "$want" != "$have" ]; then
    fail "the bundle's wheels are for Python $want, $python is $have (scripts/gpu_bundle.sh --python-version $have)"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/hma-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site" "$work/src" "$work/bin" "$work/lib"

# 1. Wheels. numpy from the bundle only where the host has none: torch was built against the
#    host's, and a second one first on the path would shadow it.
wheels=()
for whl in "$bundle"/wheels/*.whl; do
    [ -e "$whl" ] || continue
    case "$(basename "$whl")" in
    numpy-*) "$python" -c "import numpy" 2>/dev/null && continue ;;
    esac
    wheels+=("$whl")
done
if [ ${#wheels[@]} -gt 0 ]; then
    if "$python" -m pip --version >/dev/null 2>&1; then
        "$python" -m pip install --quiet --no-index --no-deps --no-compile --target "$work/site" "${wheels[@]}"
    else
        # No pip on the host: a wheel is a zip laid out for site-packages.
        echo "gpu_check: no pip for $python; unpacking the wheels" >&2
        "$python" -c 'import sys, zipfile
for whl in sys.argv[2:]:
    zipfile.ZipFile(whl).extractall(sys.argv[1])' "$work/site" "${wheels[@]}"
    fi
fi

# 2. The package, and its native extension built in the copy (the checkout stays as it is).
tar -cf - --exclude=__pycache__ --exclude='*.so' hma_redis | tar -xf - -C "$work/src"
native="pure Python (--no-build)"
if [ "$build" = 1 ]; then
    cc=${CC:-$(command -v cc || command -v gcc || true)}
    include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    if [ -z "$cc" ]; then
        native="pure Python (no C compiler)"
    elif [ ! -f "$include/Python.h" ]; then
        native="pure Python (no Python.h in $include)"
    elif "$cc" -O2 -std=gnu11 -shared -fPIC -I"$include" hma_redis/core/redis/_wire.c \
        -o "$work/src/hma_redis/core/redis/_wire$suffix" 2>"$work/cc.log"; then
        native="native, built with $cc"
    else
        native="pure Python (the build failed: $(head -c 300 "$work/cc.log"))"
    fi
fi
echo "gpu_check: data path: $native"

# 3. redis-server: a launcher that lends the bundled libraries the host's loader cannot find.
server="$bundle/redis/redis-server"
missing=()
if command -v ldd >/dev/null; then
    mapfile -t missing < <(ldd "$server" 2>/dev/null | awk '/not found/ {print $1}')
else
    mapfile -t missing < <(ls "$bundle/redis/lib")
fi
for lib in "${missing[@]}"; do
    [ -e "$bundle/redis/lib/$lib" ] || fail "redis-server needs $lib: not on this host, not in the bundle"
    ln -s "$bundle/redis/lib/$lib" "$work/lib/$lib"
done
cat >"$work/bin/redis-server" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$work/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$server" "\$@"
EOF
chmod +x "$work/bin/redis-server"
"$work/bin/redis-server" --version >"$work/version.log" 2>&1 ||
    fail "the bundled redis-server does not run here (it needs glibc >= 2.34): $(cat "$work/version.log")"
echo "gpu_check: $(cat "$work/version.log")${missing[*]:+ (bundled libraries: ${missing[*]})}"

# 4. The check, from the temporary folder: python -m puts the current directory first on the
#    path, and the checkout's hma_redis (without the extension) would shadow the copy.
set +e
(
    cd "$work"
    PATH="$work/bin:$PATH" PYTHONPATH="$work/src:$work/site${PYTHONPATH:+:$PYTHONPATH}" \
        "$python" -m hma_redis.tools.gpu.check --output "$table" --cores "$(nproc)" "$@"
)
status=$?
set -e
echo "gpu_check: exit $status; table in $table"
exit $status
