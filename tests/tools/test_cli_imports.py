"""The CLI runs where neither vLLM nor torch is installed: every module of
``hma_redis.tools.cli`` imports with both unimportable (what lets the vLLM 0.33 stage of
scripts/test.sh leave out the CLI's tests that touch neither, tests/conftest.py)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import hma_redis.tools.cli

_BLOCKED = """
import importlib, sys
from importlib.abc import MetaPathFinder

class Blocked(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "torch"):
            raise ImportError(f"blocked here: {name}")
        return None

sys.meta_path.insert(0, Blocked())
for name in sys.argv[1:]:
    importlib.import_module(name)
print("imported", len(sys.argv) - 1)
"""


def test_every_cli_module_imports_without_vllm_or_torch() -> None:
    names = [
        info.name
        for info in pkgutil.walk_packages(hma_redis.tools.cli.__path__, "hma_redis.tools.cli.")
    ]
    assert "hma_redis.tools.cli.main" in names
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED, "hma_redis.tools.cli", *names],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(names) + 1}" in done.stdout
