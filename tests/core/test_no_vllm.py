"""The core runs where vLLM is not installed (an offline GPU host with torch and redis-py only):
every module of ``hma_redis.core`` imports, a transfer engine stores and loads CPU pages through
a real Redis, and the core's own tests import, all with every ``vllm`` module unimportable."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import hma_redis.core

REPO_ROOT = Path(__file__).resolve().parents[2]

# Installed first in each child: any import of vllm or vllm.* raises ImportError.
_BLOCK_VLLM = """
import sys
from importlib.abc import MetaPathFinder

class NoVllm(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"vllm is blocked here: {name}")
        return None

sys.meta_path.insert(0, NoVllm())
for loaded in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
    del sys.modules[loaded]
"""

_ROUND_TRIP = """
import importlib, sys, time
import torch
for name in sys.argv[2:]:
    importlib.import_module(name)
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.engine import TransferEngine
from hma_redis.core.transfer.jobs import ChunkTransfer, ValueFormat
from hma_redis.core.transfer.pages import LayerSource

pages = [torch.randint(-128, 128, (8, 256), dtype=torch.int8) for _ in range(2)]
store = RedisBlockStore(RedisTierConfig(url=sys.argv[1]))
engine = TransferEngine(store, [[LayerSource.of(t, 256) for t in pages]],
                        ValueFormat("int8"), blocks_per_chunk=2)
keys = KeySpace("hma", "no-vllm")
def job(first):
    ids = [(first + 2 * n, first + 2 * n + 1) for n in range(2)]
    return [ChunkTransfer(keys.block_key(0, bytes([n]) * 16), 0, 0, 0, ids[n]) for n in range(2)]
def run(job_id, submit, chunks):
    submit(job_id, chunks)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done = [r for r in engine.finished() if r.job_id == job_id]
        if done:
            return done[0]
        time.sleep(0.001)
    raise SystemExit(f"job {job_id} did not finish")
assert run(1, engine.submit_store, job(0)).ok
assert run(2, engine.submit_load, job(4)).ok
assert all(torch.equal(t[0:4], t[4:8]) for t in pages), "loaded pages differ"
engine.shutdown()
store.close()
assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
print("core without vLLM: ok")
"""


def _core_modules() -> list[str]:
    """Every module of hma_redis.core and its folders (Python modules; a native extension is
    one too)."""
    return [
        info.name
        for info in pkgutil.walk_packages(hma_redis.core.__path__, "hma_redis.core.")
        if not info.name.rsplit(".", 1)[1].startswith("_")
    ]


def _without_vllm(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -c <blocker>; <args[0]>`` with ``args[1:]`` as its argv, at the repo root."""
    return subprocess.run(
        [sys.executable, "-c", _BLOCK_VLLM + args[0], *args[1:]],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=300,
    )


def test_the_blocker_blocks_vllm() -> None:
    """The check below can fail: with the blocker, importing vLLM raises."""
    proc = _without_vllm("import vllm")
    assert proc.returncode != 0 and "vllm is blocked here" in proc.stderr


def test_every_core_module_imports_and_moves_pages_without_vllm(redis_url: str) -> None:
    modules = _core_modules()
    assert {"config", "keys", "codec", "client", "wire", "store", "engine"} <= {
        m.rsplit(".", 1)[1] for m in modules
    }
    proc = _without_vllm(_ROUND_TRIP, redis_url, *modules)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "core without vLLM: ok" in proc.stdout


def test_the_core_tests_import_without_vllm() -> None:
    """tests/core needs no vLLM: collecting it imports every module and its helpers."""
    collect = (
        "import sys, pytest; "
        "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests/core']))"
    )
    proc = _without_vllm(collect)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
