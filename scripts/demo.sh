#!/usr/bin/env bash
# The main job: set everything up, then two vLLM engines share a Redis (see README).
# Arguments go to the demo, e.g. `bash scripts/demo.sh --redis-url redis://host:6379/0`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
exec .venv/bin/python -m hma_redis.tools.demo.demo "$@"
