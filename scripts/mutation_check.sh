#!/usr/bin/env bash
# Mutation testing (a habit, not a CI gate): mutmut breaks the code one small change at a time
# and runs the tests that cover the changed function; a mutant no test notices "survived".
# Prints the score per module and every surviving mutant (`--diffs`: with its diff).
#
#   bash scripts/mutation_check.sh                        # the data path (see MODULES below)
#   bash scripts/mutation_check.sh --modules core/codec   # one module (a quick trial)
#   bash scripts/mutation_check.sh --modules core/codec --tests "tests/core/test_codec.py"
#
# Each module is mutated in its own copy of the work tree, <work-dir>/<module> (default
# /tmp/hma-mutation; kept for `mutmut show NAME` there), against the test files that exercise
# it (tests_for below); the checkout is never touched. `--tests` replaces that choice: the
# modules are then mutated together in <work-dir> itself, against those tests. Engine tests
# are left out (-m "not engine"). Needs the venv of scripts/setup.sh; installs mutmut into it
# (the `mutation` extra) when missing.
#
# Run time: mutmut runs one pytest session per mutant (forked from a warm server), so the cost
# is the session's fixed cost plus the tests that cover the mutated function. Two choices keep
# it small: pytest's unraisableexception plugin is off (its gc.collect() x5 at the end of each
# session cost about a second per mutant with torch and vLLM loaded), and each module gets
# only the test files that exercise it (tests/tools, whose CLI tests start processes, and
# unrelated modules' tests never run for it). Still, the manager alone takes ~24 min with
# --jobs 1 on a 2-core machine: its functions are covered by 45-75 tests each.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

MODULES="core/codec core/redis/store core/transfer/engine adapter/manager adapter/worker adapter/connector"
TESTS=""
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

# The test files that exercise each module (globs, expanded in the copy: new *_edges.py files
# join by name). A file missing here only costs score, never correctness.
tests_for() {
    case "$1" in
        core/codec) echo "tests/core/test_codec*.py tests/core/redis/test_security.py tests/core/redis/test_wire.py" ;;
        core/redis/store) echo "tests/core/redis/test_store*.py tests/core/redis/test_refusals.py tests/core/redis/test_security.py tests/core/redis/test_cluster.py" ;;
        core/transfer/engine) echo "tests/core/transfer/test_*.py tests/core/redis/test_wire*.py tests/core/redis/test_deadlines.py tests/core/redis/test_security.py tests/core/redis/test_outage_replies.py" ;;
        adapter/manager) echo "tests/adapter/test_manager*.py tests/adapter/test_behaviours.py tests/adapter/test_removals_admission*.py tests/adapter/test_scheduler_lookup.py tests/adapter/test_connector_fast.py tests/adapter/test_vllm_compat.py tests/adapter/test_metrics.py" ;;
        adapter/worker) echo "tests/adapter/test_worker*.py tests/adapter/test_behaviours.py tests/adapter/test_connector_fast.py tests/adapter/test_connector_guard.py" ;;
        core/redis/breaker) echo "tests/core/redis/test_refusals.py tests/core/redis/test_outage_replies.py tests/core/redis/test_deadlines.py tests/core/redis/test_store*.py tests/core/transfer/test_data_paths.py tests/core/redis/test_breaker*.py" ;;
        core/redis/notifications) echo "tests/core/redis/test_removal_watcher*.py tests/adapter/test_removals_admission*.py tests/adapter/test_manager_edges.py" ;;
        adapter/connector) echo "tests/adapter/test_connector*.py tests/adapter/test_idle_wait.py tests/adapter/test_scheduler_lookup.py tests/adapter/test_vllm_compat.py" ;;
        *) echo "tests" ;;
    esac
}

[[ -x .venv/bin/python ]] || { echo "mutation_check.sh: no .venv; run scripts/setup.sh" >&2; exit 2; }
[[ -x .venv/bin/mutmut ]] || .venv/bin/pip install -q 'mutmut>=3.8,<4'

# mutate DIR MODULES TESTS: mutmut on MODULES against TESTS in a fresh copy of the tree at DIR;
# leaves DIR/mutmut-results.txt and DIR/elapsed (seconds).
mutate() {
    local dir=$1 modules=$2 tests=$3
    rm -rf "$dir"
    mkdir -p "$dir"
    # A fresh copy of the tracked and new (not ignored) files, with the venv beside it.
    git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c \
        '[ -f "$1" ] && mkdir -p "$2/$(dirname "$1")" && cp -p "$1" "$2/$1" || true' _ {} "$dir"
    ln -s "$REPO/.venv" "$dir/.venv"
    # The native extension is built in place and git-ignored: bring it along (else the copy
    # would run the pure-Python data path and the native tests could not import it).
    cp -p hma_redis/core/redis/_wire*.so "$dir/hma_redis/core/redis/" 2>/dev/null || true
    (
        cd "$dir"
        {
            echo "[mutmut]"
            echo "source_paths = hma_redis"
            echo "only_mutate ="
            for module in $modules; do echo "    hma_redis/$module.py"; done
            echo "pytest_add_cli_args_test_selection ="
            # Globs expand here, in the copy; a pattern matching nothing is dropped.
            for test in $tests; do if [[ -e $test ]]; then echo "    $test"; fi; done
            echo "pytest_add_cli_args ="
            printf '    %s\n' -p no:cacheprovider -p no:unraisableexception -m "not engine" -q
            # Log calls and raise statements carry only messages: their mutants ("XXtextXX",
            # None) say nothing about behaviour, so they are not generated (conditions around
            # them still are).
            echo "do_not_mutate_patterns ="
            echo '    ^\s*(logger|log)\.\w+\('
            echo '    ^\s*raise \w+\('
            # torch and the tests' thread pools are not fork-safe: fork mutants from a clean
            # server.
            echo "process_isolation = forkserver"
        } > setup.cfg
        export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0
        local started
        started=$(date +%s)
        .venv/bin/mutmut run --max-children "$JOBS" > mutmut-run.log 2>&1 || {
            echo "mutation_check.sh: mutmut run failed; the end of $dir/mutmut-run.log:" >&2
            tail -n 40 mutmut-run.log >&2
            exit 1
        }
        echo $(( $(date +%s) - started )) > elapsed
        .venv/bin/mutmut results --all true > mutmut-results.txt
    )
}

rm -rf "$WORK"
DIRS=()
if [[ -n "$TESTS" ]]; then
    mutate "$WORK" "$MODULES" "$TESTS"
    DIRS+=("$WORK")
else
    for module in $MODULES; do
        mutate "$WORK/${module//\//-}" "$module" "$(tests_for "$module")"
        DIRS+=("$WORK/${module//\//-}")
    done
fi

.venv/bin/python - "$DIFFS" "${DIRS[@]}" <<'EOF'
"""Score per module from each run's `mutmut results --all true` ("    <mutant>: <status>")."""
import collections
import pathlib
import subprocess
import sys

diffs, dirs = sys.argv[1] == "1", [pathlib.Path(d) for d in sys.argv[2:]]
by_module: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
seconds: dict[str, int] = {}
survivors: list[tuple[pathlib.Path, str, str]] = []
for run in dirs:
    elapsed = int((run / "elapsed").read_text())
    for line in open(run / "mutmut-results.txt"):
        name, sep, status = line.strip().rpartition(": ")
        if not sep:
            continue
        module = name.split(".x", 1)[0].removeprefix("hma_redis.")
        by_module[module][status] += 1
        seconds[module] = elapsed  # a run's time, shown on each of its modules
        if status not in ("killed", "timeout", "caught by type check", "segfault"):
            survivors.append((run, name, status))

total_s = sum(int((run / "elapsed").read_text()) for run in dirs)
print(f"mutation score per module (mutmut, {total_s} s in all):")
print(
    f"{'module':<20}{'mutants':>9}{'killed':>9}{'timeout':>9}{'survived':>10}{'untested':>10}"
    f"{'score':>8}{'run s':>8}"
)
for module, counts in sorted(by_module.items()):
    total = sum(counts.values())
    caught = counts["killed"] + counts["timeout"] + counts["caught by type check"] + counts["segfault"]
    print(
        f"{module:<20}{total:>9}{counts['killed']:>9}{counts['timeout']:>9}"
        f"{counts['survived']:>10}{counts['no tests']:>10}{100 * caught / total:>7.1f}%"
        f"{seconds[module]:>8}"
    )
print(f"\n{len(survivors)} mutant(s) not killed:")
for run, name, status in survivors:
    print(f"  {name}: {status}" + (f"  ({run})" if len(dirs) > 1 else ""))
    if diffs:
        shown = subprocess.run(
            [".venv/bin/mutmut", "show", name], capture_output=True, text=True, cwd=run
        )
        print("\n".join("      " + line for line in shown.stdout.splitlines()[1:]))
EOF
