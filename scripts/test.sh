#!/usr/bin/env bash
# The project's test command: setup, lint, format check, type check, then the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k store -x`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

.venv/bin/ruff check hma_redis tests benchmarks scripts
.venv/bin/ruff format --check hma_redis tests benchmarks
.venv/bin/mypy hma_redis
VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0 \
    .venv/bin/python -m pytest -q tests "$@"
