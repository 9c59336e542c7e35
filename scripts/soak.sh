#!/usr/bin/env bash
# The multi-engine soak (tests/support/soak.py): `bash scripts/soak.sh --duration-s S [--seed N]
# [--maxmemory 6mb] [--fault-every-s 5] [--workdir DIR] [--families gdn,short-conv|all]
# [--modes direct,tiering]` runs three engines with the tier at once (two hybrid in one namespace,
# one Llama-shaped; one more per family named, from GDN, MLA, short conv and chunked local
# attention; with tiering, a hybrid and a Llama engine of vLLM's tiering mode) against one
# evicting Redis with faults on a timer, checks every request against an engine without the tier, and prints one table; exits 1
# if any token was wrong, a request errored or exceeded its bound, or the tier's memory passed
# its bound. Needs the .venv of scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0
exec .venv/bin/python -m tests.support.soak "$@"
