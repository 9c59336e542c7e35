"""The Redis client's tests: in the vLLM 0.33 stage only those that use torch run.

hma_redis.core.redis imports neither vLLM nor torch (tests/core/test_no_vllm.py); a file here
that does not use torch either tests code whose every dependency (redis-py, hiredis, msgpack,
the native extension built from the same source) is the same in both venvs. scripts/test.sh
checks that those releases match before it sets HMA_TEST_TORCH_USERS_ONLY for the 0.33 stage,
which then leaves those files out (their tests are run once, in the vLLM 0.32 stage).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ONLY_TORCH_USERS_ENV = "HMA_TEST_TORCH_USERS_ONLY"
_USES_TORCH = re.compile(r"^\s*(import torch|from torch\b)", re.MULTILINE)


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if os.environ.get(ONLY_TORCH_USERS_ENV) != "1" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return _USES_TORCH.search(collection_path.read_text()) is None or None
