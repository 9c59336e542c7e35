#!/usr/bin/env bash
# Mutation testing of the native extension (a habit, not a CI gate): each hand-made mutant of
# hma_redis/core/redis/_wire.c in scripts/c_mutants.txt (an off-by-one in a length check, a check
# left out, ...) is built in a copy of the work tree and the fast-path tests run against it; a
# mutant the tests do not notice "survived". Prints one line per mutant and the score.
#
#   bash scripts/c_mutants.sh                          # every mutant
#   bash scripts/c_mutants.sh --only oversized-off-by-one,staging-one-byte-short
#   bash scripts/c_mutants.sh --asan                   # survivors again, under scripts/asan.sh
#   bash scripts/c_mutants.sh --tests "tests/core/redis/test_wire.py"   # other tests
#
# A mutant is killed when the tests fail, hang past the limit or crash; one that does not
# compile is "stillborn" (left out of the score). --asan runs each survivor once more through
# the AddressSanitizer stage (a write one byte past a buffer often changes no result).
# HMA_VENV_PYTHON: the interpreter (default .venv/bin/python). About 10 s a mutant on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV_PYTHON=${HMA_VENV_PYTHON:-$REPO/.venv/bin/python}
export HMA_VENV_PYTHON=$VENV_PYTHON
# shellcheck source=scripts/native_copy.sh
source scripts/native_copy.sh

ONLY=""
ASAN=0
TESTS=(tests/core/redis/test_wire.py tests/core/redis/test_wire_bounds.py tests/core/redis/test_resp_fuzz.py)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --only) ONLY="$2"; shift 2 ;;
        --asan) ASAN=1; shift ;;
        --tests) read -r -a TESTS <<< "$2"; shift 2 ;;
        *) echo "c_mutants.sh: unknown argument $1 (see the header of this script)" >&2; exit 2 ;;
    esac
done
WORK=$(mktemp -d /tmp/hma-c-mutants.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
native_copy "$WORK/tree"
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0

# apply NAME: write the mutant NAME of the checkout's C file to $WORK/mutant.c.
apply() {
    "$VENV_PYTHON" - "$1" hma_redis/core/redis/_wire.c scripts/c_mutants.txt "$WORK/mutant.c" <<'EOF'
import sys

name, source, listing, out = sys.argv[1:]
for line in open(listing):
    if line.startswith("#") or not line.strip():
        continue
    fields = line.rstrip("\n").split("\t")
    if fields[0] != name:
        continue
    old, new = (f.replace("<NL>", "\n") for f in fields[1:3])
    which = int(fields[3]) if len(fields) > 3 else 1
    text = open(source).read()
    at = -1
    for _ in range(which):
        at = text.find(old, at + 1)
        if at < 0:
            sys.exit(f"c_mutants.sh: mutant {name}: its text is not in {source} (edited?)")
    open(out, "w").write(text[:at] + new + text[at + len(old) :])
    break
else:
    sys.exit(f"c_mutants.sh: no mutant {name}")
EOF
}

names=$(grep -v '^#' scripts/c_mutants.txt | grep -v '^\s*$' | cut -f1)
[[ -z "$ONLY" ]] || names=${ONLY//,/ }
killed=0 survived=0 stillborn=0
survivors=()
missing=0
for name in $names; do
    if ! apply "$name"; then
        missing=$((missing + 1))
        continue
    fi
    cp "$WORK/mutant.c" "$WORK/tree/hma_redis/core/redis/_wire.c"
    if ! native_build "$WORK/tree" 2> /dev/null; then
        echo "stillborn  $name"
        stillborn=$((stillborn + 1))
        continue
    fi
    if (cd "$WORK/tree" && timeout 300 "$VENV_PYTHON" -m pytest -x -q -p no:cacheprovider \
        "${TESTS[@]}" > "$WORK/$name.log" 2>&1); then
        verdict=survived
        if [[ $ASAN = 1 ]] && ! bash scripts/asan.sh "$WORK/mutant.c" > "$WORK/$name.asan.log" 2>&1; then
            verdict="killed (ASan)"
        fi
    else
        verdict=killed
    fi
    printf '%-10s %s%s\n' "${verdict%% *}" "$name" "$([[ $verdict != *ASan* ]] || echo ' (by ASan)')"
    if [[ $verdict = survived ]]; then
        survived=$((survived + 1))
        survivors+=("$name")
    else
        killed=$((killed + 1))
    fi
done
total=$((killed + survived))
echo "C mutants: $killed of $total killed ($((total ? 100 * killed / total : 0)) %), $stillborn stillborn, $missing not found"
[[ ${#survivors[@]} = 0 ]] || echo "survived: ${survivors[*]}"
