#!/usr/bin/env bash
# Two `vllm serve` OpenAI servers share a Redis: the same long prompt is sent to server A, then
# to server B, and each one's time to first token is printed (B's is lower: it loads A's KV).
# Arguments go to hma_redis.tools.demo.openai_example, e.g.
#   bash scripts/openai_example.sh --redis-url redis://127.0.0.1:6379/0
#   bash scripts/openai_example.sh --model Qwen/Qwen3-0.6B --serve-arg=--gpu-memory-utilization=0.4
# Without --redis-url a private redis-server is started; without --model a tiny random Llama is
# built. Everything started is stopped at the end (also on Ctrl-C).
set -euo pipefail
cd "$(dirname "$0")/.."

# Only .venv is needed: the second venv setup.sh builds for CI (vLLM 0.33, ~10 GB) is skipped
# unless HMA_SKIP_VLLM_033=0.
HMA_SKIP_VLLM_033="${HMA_SKIP_VLLM_033:-1}" bash scripts/setup.sh
exec .venv/bin/python -m hma_redis.tools.demo.openai_example "$@"
