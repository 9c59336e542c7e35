#!/usr/bin/env bash
# Mutation testing (a habit, not a CI gate): mutmut breaks the code one small change at a time
# and runs the tests that cover the changed function; a mutant no test notices "survived".
# Prints the score per module and every surviving mutant (`--diffs`: with its diff).
#
#   bash scripts/mutation_check.sh                        # the data path (see MODULES below)
#   bash scripts/mutation_check.sh --modules core/codec   # one module (a quick trial)
#   bash scripts/mutation_check.sh --tests "tests/core/test_codec.py tests/core/test_transfer.py"
#
# Runs in a copy of the work tree (default /tmp/hma-mutation, kept for `mutmut show NAME` there);
# the checkout is never touched. Engine tests are left out (-m "not engine"). Needs the venv of
# scripts/setup.sh; installs mutmut into it (the `mutation` extra) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

MODULES="core/codec core/store core/transfer adapter/manager adapter/worker adapter/connector"
TESTS="tests"
WORK=/tmp/hma-mutation
DIFFS=0
JOBS=$(nproc)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --modules) MODULES="$2"; shift 2 ;;
        --tests) TESTS="$2"; shift 2 ;;
        --work-dir) WORK="$2"; shift 2 ;;
        --jobs) JOBS="$2"; shift 2 ;;
        --diffs) DIFFS=1; shift ;;
        *) echo "mutation_check.sh: unknown argument $1 (see the header of this script)" >&2; exit 2 ;;
    esac
done

[[ -x .venv/bin/python ]] || { echo "mutation_check.sh: no .venv; run scripts/setup.sh" >&2; exit 2; }
[[ -x .venv/bin/mutmut ]] || .venv/bin/pip install -q 'mutmut>=3.8,<4'

# A fresh copy of the tracked and new (not ignored) files, with the venv beside it.
rm -rf "$WORK"
mkdir -p "$WORK"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c \
    '[ -f "$1" ] && mkdir -p "$2/$(dirname "$1")" && cp -p "$1" "$2/$1" || true' _ {} "$WORK"
ln -s "$REPO/.venv" "$WORK/.venv"
# The native extension is built in place and git-ignored: bring it along (else the copy would
# run the pure-Python data path and the native tests could not import it).
cp -p hma_redis/core/_fastpath*.so "$WORK/hma_redis/core/" 2>/dev/null || true

{
    echo "[mutmut]"
    echo "source_paths = hma_redis"
    echo "only_mutate ="
    for module in $MODULES; do echo "    hma_redis/$module.py"; done
    echo "pytest_add_cli_args_test_selection ="
    for test in $TESTS; do echo "    $test"; done
    echo "pytest_add_cli_args ="
    printf '    %s\n' -p no:cacheprovider -m "not engine" -q
    # Log calls and raise statements carry only messages: their mutants ("XXtextXX", None) say
    # nothing about behaviour, so they are not generated (conditions around them still are).
    echo "do_not_mutate_patterns ="
    echo '    ^\s*(logger|log)\.\w+\('
    echo '    ^\s*raise \w+\('
    # torch and the tests' thread pools are not fork-safe: fork mutants from a clean server.
    echo "process_isolation = forkserver"
} > "$WORK/setup.cfg"

cd "$WORK"
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0
started=$(date +%s)
.venv/bin/mutmut run --max-children "$JOBS" > mutmut-run.log 2>&1 || {
    echo "mutation_check.sh: mutmut run failed; the end of $WORK/mutmut-run.log:" >&2
    tail -n 40 mutmut-run.log >&2
    exit 1
}
elapsed=$(( $(date +%s) - started ))

.venv/bin/mutmut results --all true > mutmut-results.txt
.venv/bin/python - "$elapsed" "$DIFFS" <<'EOF'
"""Score per module from `mutmut results --all true` ("    <mutant>: <status>" lines)."""
import collections
import subprocess
import sys

elapsed, diffs = int(sys.argv[1]), sys.argv[2] == "1"
by_module: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
survivors: list[tuple[str, str]] = []
for line in open("mutmut-results.txt"):
    name, sep, status = line.strip().rpartition(": ")
    if not sep:
        continue
    module = name.split(".x", 1)[0].removeprefix("hma_redis.")
    by_module[module][status] += 1
    if status not in ("killed", "timeout", "caught by type check", "segfault"):
        survivors.append((name, status))

print(f"mutation score per module (mutmut, {elapsed} s):")
print(f"{'module':<20}{'mutants':>9}{'killed':>9}{'timeout':>9}{'survived':>10}{'untested':>10}{'score':>8}")
for module, counts in sorted(by_module.items()):
    total = sum(counts.values())
    caught = counts["killed"] + counts["timeout"] + counts["caught by type check"] + counts["segfault"]
    print(
        f"{module:<20}{total:>9}{counts['killed']:>9}{counts['timeout']:>9}"
        f"{counts['survived']:>10}{counts['no tests']:>10}{100 * caught / total:>7.1f}%"
    )
print(f"\n{len(survivors)} mutant(s) not killed:")
for name, status in survivors:
    print(f"  {name}: {status}")
    if diffs:
        shown = subprocess.run([".venv/bin/mutmut", "show", name], capture_output=True, text=True)
        print("\n".join("      " + line for line in shown.stdout.splitlines()[1:]))
EOF
