"""Running the ``hma-redis`` CLI in the tests, and real encoded blocks for it to find."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from hma_redis.core import codec
from hma_redis.core.keys import GroupLayout, KeySpace, NamespaceFingerprint, RedisKey
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.store import RedisBlockStore

PAGE_BYTES = (1024, 1024)
FINGERPRINT = NamespaceFingerprint(
    model="/models/tiny-gemma3",
    kv_dtype="bfloat16",
    groups=(
        GroupLayout(256, ("layers.1.attn", "layers.3.attn"), PAGE_BYTES, "full"),
        GroupLayout(256, ("layers.0.attn", "layers.2.attn"), PAGE_BYTES, "sliding_window:512"),
    ),
    kv_cache_layout="NHD",
)


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def block_header(key: str, group: int, num_blocks: int) -> codec.BlockHeader:
    return codec.BlockHeader(
        key=key,
        group=group,
        first_block=16 - num_blocks,
        num_blocks=num_blocks,
        page_bytes=PAGE_BYTES,
        kv_dtype="bfloat16",
    )


def write_blocks(
    store: RedisBlockStore, keys: KeySpace, chunks: list[tuple[int, int]]
) -> list[RedisKey]:
    """Store one real encoded chunk per (group, num_blocks); returns the keys."""
    items = []
    for serial, (group, num_blocks) in enumerate(chunks):
        key = keys.block_key(group, serial.to_bytes(32, "big"))
        header = block_header(key, group, num_blocks)
        items.append((key, codec.encode(header, os.urandom(header.body_bytes))))
    assert store.put_if_absent(items) == [PutResult.STORED] * len(items)
    return [key for key, _ in items]


def cli_command() -> list[str]:
    """The CLI as its own process, the module the console script ``hma-redis`` runs (that
    pyproject.toml's entry point names it: tests/tools/test_cli.py)."""
    return [sys.executable, "-m", "hma_redis.tools.cli.main"]


def run_script(*args: str, env: dict[str, str] | None = None) -> Run:
    """``hma-redis ARGS`` in a process of its own (stdin closed, 60 s at most)."""
    proc = subprocess.run(
        [*cli_command(), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line_error(run: Run) -> None:
    assert run.code != 0
    assert run.err.startswith("hma-redis: ")
    assert run.err.count("\n") == 1, run.err
    assert "Traceback" not in run.err + run.out
