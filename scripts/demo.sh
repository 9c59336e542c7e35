#!/usr/bin/env bash
# The main job: set everything up, then two vLLM engines share a Redis (see README). Engine A
# computes a 4k-token prompt on a random-weight model (seconds on a CPU) and stores its KV cache
# in Redis; engine B, a fresh process, loads it and answers at once with the same tokens.
# Arguments go to the demo, e.g. `bash scripts/demo.sh --redis-url redis://host:6379/0`,
# `--model NAME_OR_PATH`, `--hybrid` (a Gemma-3-style model), `--quick` (a small one).
set -euo pipefail
cd "$(dirname "$0")/.."

# The demo needs only .venv; the second venv setup.sh builds for CI (vLLM 0.33, ~10 GB) is
# skipped unless asked for.
HMA_SKIP_VLLM_033="${HMA_SKIP_VLLM_033:-1}" bash scripts/setup.sh
exec .venv/bin/python -m hma_redis.tools.demo.demo "$@"
