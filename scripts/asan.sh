#!/usr/bin/env bash
# The native extension under AddressSanitizer and UndefinedBehaviorSanitizer (a stage of
# scripts/test.sh, so CI runs it): the extension is built with -fsanitize=address,undefined in a
# copy of the work tree (the checkout's own build is never touched) and the fast-path and
# transfer tests run against that build, with the RESP-reply fuzz (tests/core/redis/test_resp_fuzz.py:
# a hostile server over a real socket). Any read or write outside a buffer, or undefined
# behaviour, aborts the run and fails the stage.
#
#   bash scripts/asan.sh                   # the extension as it is
#   bash scripts/asan.sh path/to/other.c   # another version of _wire.c (e.g. a planted bug)
#
# Python is not built with ASan, so libasan is preloaded; leak checks are off (the interpreter's
# own allocations at exit are not leaks of this code); PYTHONMALLOC=malloc routes Python's small
# objects through malloc as well, so ASan sees their bounds. The tests' buffers are exact
# allocations (tests/support/canned_redis.py), so a write one byte past one is caught.
# HMA_VENV_PYTHON: the interpreter (default .venv/bin/python); HMA_ASAN_DIR: the copy (default a
# fresh temporary directory, removed afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV_PYTHON=${HMA_VENV_PYTHON:-$REPO/.venv/bin/python}
# shellcheck source=scripts/native_copy.sh
source scripts/native_copy.sh

TESTS=(
    tests/core/redis/test_wire.py
    tests/core/redis/test_wire_bounds.py
    tests/core/redis/test_wire_pieces.py
    tests/core/redis/test_resp_fuzz.py
    tests/core/transfer/test_cpu_pages.py
    tests/core/transfer/test_value_checks.py
    tests/core/transfer/test_job_parts.py
    tests/core/transfer/test_data_paths.py
)

if [[ -n "${HMA_ASAN_DIR:-}" ]]; then
    WORK=$HMA_ASAN_DIR
else
    WORK=$(mktemp -d /tmp/hma-asan.XXXXXX)
    trap 'rm -rf "$WORK"' EXIT
fi
c_file=${1:-}
[[ -z "$c_file" ]] || c_file=$(realpath "$c_file")

native_copy "$WORK" "$c_file"
NATIVE_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1" \
    NATIVE_LDFLAGS="-fsanitize=address,undefined" native_build "$WORK"

libasan=$(gcc -print-file-name=libasan.so)
[[ -f "$libasan" ]] || { echo "asan.sh: no libasan.so ($libasan)" >&2; exit 1; }
cd "$WORK"
# libstdc++ right after libasan: torch throws C++ exceptions, and ASan's __cxa_throw interceptor
# aborts unless libstdc++ was loaded before ASan initialised.
export LD_PRELOAD="$libasan $(gcc -print-file-name=libstdc++.so)"
# Reports go to files (pytest captures stderr, and an abort would lose it); printed below.
mkdir -p "$WORK/sanitizer"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path=$WORK/sanitizer/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$WORK/sanitizer/ubsan"
export PYTHONMALLOC=malloc VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0
# The build under test is the one loaded: the copy's, linked against the sanitizers.
"$VENV_PYTHON" - "$WORK" <<'EOF'
import subprocess, sys
from hma_redis.core.redis import _wire
path = _wire.__file__
assert path.startswith(sys.argv[1]), f"asan.sh: loaded {path}, not the ASan build"
needed = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
assert "libasan" in needed and "libubsan" in needed, f"asan.sh: {path} lacks the sanitizers"
print(f"+ ASan/UBSan build: {path}")
EOF
status=0
# --capture=sys: pytest captures Python's own output only, so a report the sanitizers write to
# file descriptor 2 (UBSan's, alongside ASan, ignores log_path) reaches the log before the abort.
"$VENV_PYTHON" -m pytest -q -p no:cacheprovider --capture=sys "${TESTS[@]}" || status=$?
if compgen -G "$WORK/sanitizer/*" > /dev/null; then
    echo "asan.sh: the sanitizers reported:" >&2
    head -n 60 "$WORK"/sanitizer/* >&2
    status=1
fi
[[ $status = 0 ]] && echo "+ ASan/UBSan stage passed"
exit $status
