#!/usr/bin/env bash
# The engine-level fault fuzz (tests/support/fault_fuzz.py): `bash scripts/fault_fuzz.sh --rounds N
# [--seed S] [--models hybrid,gdn,...] [--modes direct,tiering] [--faults killed,paused,...]`
# prints one line per round and a summary table; exits 1 if any token was wrong or an exception
# reached an engine. Needs the .venv of scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0
exec .venv/bin/python -m tests.support.fault_fuzz "$@"
