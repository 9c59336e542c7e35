"""CPU KV pages of two KV groups for the transfer engine's tests (no vLLM).

Group 0: three layers in tensors whose rows are padded past the page; group 1: two layers of
unpadded rows (as vLLM lays out a hybrid model whose groups have different page sizes). The
chunks of a job mirror what the vLLM adapter plans for ``GPULoadStoreSpec(ids, [8, 6], [0, 2])``:
group 0 two whole chunks, group 1 starting mid-chunk (a sliding window keeps only the last two
blocks of its first chunk), then one whole chunk. The Redis keys are the adapter's too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.engine import COUNTERS_EVERY_S, TransferEngine
from hma_redis.core.transfer.jobs import (
    ChunkTransfer,
    JobChunks,
    JobResult,
    ValueFormat,
    group_chunks,
)
from hma_redis.core.transfer.pages import LayerSource

NUM_BLOCKS = 40
BPC = 4  # blocks per chunk
ROW0, PAGE0 = 3000, 2500
PAGE1 = 1000
PAGES = (PAGE0, PAGE1)
LAYERS = ((0, 1, 2), (3, 4))  # tensor indices of each group's layers
KEYSPACE = KeySpace("hma", "worker-test")
# Block ids of a job per group; runs of consecutive blocks and gaps.
SRC = ([3, 4, 5, 9, 10, 2, 20, 21], [7, 8, 11, 12, 13, 14])
DST = ([30, 31, 32, 33, 0, 36, 38, 39], [25, 26, 27, 18, 34, 35])
# The block hashes of the job's chunks, per group.
HASHES = ([bytes([1]) * 16, bytes([2]) * 16], [bytes([3]) * 16, bytes([4]) * 16])
FIRST_INDEX = (0, 2)  # each group's first block, as an index into its chunks' blocks
# Hashes no test stores under (the rigs store SRC under HASHES): chunks Redis does not hold.
UNSTORED_HASHES = ([bytes([9]) * 16, bytes([10]) * 16], [bytes([11]) * 16, bytes([12]) * 16])


def kv_tensors(strided: bool = False) -> list[torch.Tensor]:
    """Random int8 KV caches of both groups. ``strided``: each layer a non-contiguous view (rows
    of a wider tensor), which the engine cannot address as host memory: it goes through value
    buffers and torch copies, as a GPU KV cache does."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(NUM_BLOCKS, ROW0)] * 3 + [(NUM_BLOCKS, PAGE1)] * 2
    tensors = [torch.randint(-128, 128, s, dtype=torch.int8, generator=gen) for s in shapes]
    if strided:
        tensors = [torch.cat([t, t[:, :16]], dim=1)[:, : t.shape[1]] for t in tensors]
        assert not any(t.is_contiguous() for t in tensors)
    return tensors


def layer_groups(tensors: Sequence[torch.Tensor]) -> list[list[LayerSource]]:
    return [
        [LayerSource.of(tensors[i], page) for i in layers]
        for layers, page in zip(LAYERS, PAGES, strict=True)
    ]


def chunks(
    ids: tuple[list[int], list[int]], hashes: tuple[list[bytes], list[bytes]] = HASHES
) -> list[ChunkTransfer]:
    """The job's chunks: each group's block ids cut into chunks from its first index on."""
    out: list[ChunkTransfer] = []
    for group, (group_ids, group_hashes) in enumerate(zip(ids, hashes, strict=True)):
        keys = [KEYSPACE.block_key(group, h) for h in group_hashes]
        cut = group_chunks(group, group, group_ids, FIRST_INDEX[group], keys, BPC)
        assert cut is not None, "the test's blocks and chunks do not add up"
        out += cut
    return out


@dataclass
class Pages:
    """A transfer engine over fresh CPU KV caches (see :func:`kv_tensors`)."""

    engine: TransferEngine
    tensors: list[torch.Tensor]
    store: RedisBlockStore

    def run(
        self, job_id: int, submit: Callable[[int, JobChunks], None], job: JobChunks
    ) -> JobResult:
        """Submit one job (``self.engine.submit_store`` or ``submit_load``) and wait for it."""
        submit(job_id, job)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for result in self.engine.finished():
                if result.job_id == job_id:
                    return result
            time.sleep(0.001)
        raise AssertionError(f"job {job_id} did not finish")

    def store_job(self, job_id: int, job: JobChunks) -> JobResult:
        return self.run(job_id, self.engine.submit_store, job)

    def load_job(self, job_id: int, job: JobChunks) -> JobResult:
        return self.run(job_id, self.engine.submit_load, job)

    def pages(self, group: int, ids: list[int]) -> list[torch.Tensor]:
        """Copies of the pages (without row padding) of ``ids`` in every layer of ``group``."""
        return [self.tensors[i][ids, : PAGES[group]].clone() for i in LAYERS[group]]

    def moved(self, src: tuple[list[int], list[int]], dst: tuple[list[int], list[int]]) -> bool:
        """Whether every page of ``src`` equals the page at ``dst``, in every layer."""
        return all(
            torch.equal(a, b)
            for group in (0, 1)
            for a, b in zip(
                self.pages(group, dst[group]), self.pages(group, src[group]), strict=True
            )
        )

    def close(self) -> None:
        self.engine.shutdown()


def store_at(url: str, native: bool | None = None, **options: Any) -> RedisBlockStore:
    """A store on ``url`` with ``options`` (extra_config keys) and nothing from the environment;
    ``native`` as :class:`RedisBlockStore` takes it."""
    cfg = RedisTierConfig.from_extra_config({"redis_url": url, **options}, env={})
    return RedisBlockStore(cfg, native=native)


@contextlib.contextmanager
def on_path(store: RedisBlockStore, native: bool) -> Iterator[RedisBlockStore]:
    """``store``'s value calls inside the block on the C job (``native``) or its pure-Python
    twin, as a store built with that path runs them; its own path again after. For tests that
    put one store's values through both paths (counters and breaker shared)."""
    values = store.values
    saved = values.native, values.native_reason
    if not native:
        values.native, values.native_reason = False, "the Python path was asked for"
    try:
        yield store
    finally:
        values.native, values.native_reason = saved


def make_pages(
    store: RedisBlockStore,
    strided: bool = False,
    max_inflight_bytes: int = 1 << 24,
    io_threads: int = 2,
    auth_key: bytes | None = None,
    partial_loads: bool = False,
    counters_every_s: float = COUNTERS_EVERY_S,
    encryption_key: bytes | None = None,
    encryption_key_previous: bytes | None = None,
    gathered: bool = False,
) -> Pages:
    """``gathered``: the layers are described without their host memory, so the engine takes
    the path of a GPU KV cache (pages gathered into buffers, loads scattered from them)."""
    tensors = kv_tensors(strided)
    groups = layer_groups(tensors)
    if gathered:
        groups = [[replace(layer, host=None) for layer in group] for group in groups]
    engine = TransferEngine(
        store,
        groups,
        ValueFormat(
            kv_dtype="int8",
            auth_key=auth_key,
            encryption_key=encryption_key,
            encryption_key_previous=encryption_key_previous,
        ),
        blocks_per_chunk=BPC,
        io_threads=io_threads,
        max_inflight_bytes=max_inflight_bytes,
        shutdown_timeout_s=1.0,
        connections_per_job=store.cfg.connections_per_job,
        partial_loads=partial_loads,
        counters_every_s=counters_every_s,
    )
    return Pages(engine, tensors, store)


def as_before_or_cleared(
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    pages: Sequence[int] | None = None,
) -> bool:
    """Whether every block (row) of every layer holds what it held ``before``, or zeros in its
    page and its padding unchanged: what a failed load may leave (an in-place load zeroes
    every page it may have written). ``pages``: each layer's page bytes (None: whole rows)."""
    for idx, (old, new) in enumerate(zip(before, after, strict=True)):
        page = new.shape[1] if pages is None else pages[idx]
        same = (old == new).all(dim=1)
        cleared = ~new[:, :page].any(dim=1) & (old[:, page:] == new[:, page:]).all(dim=1)
        if not bool((same | cleared).all()):
            return False
    return True


# Group 1 from one block further on than DST: the first chunk's value holds one block more than
# this load needs (a sliding window moved on), so it does not match the expected header and
# lands in staging on either path, where the codec judges it.
NARROW = (DST[0], DST[1][1:])


def chunk_values(client: Any) -> dict[bytes, bytes]:
    """Every chunk value in Redis under KEYSPACE, by key."""
    return {key: client.get(key) or b"" for key in client.scan_iter(f"{KEYSPACE.base}:g*")}


def narrow_chunks() -> list[ChunkTransfer]:
    """The chunks of a load of :data:`NARROW` (group 1 from one block further on)."""
    out = [c for c in chunks(DST) if c.group == 0]
    keys = [KEYSPACE.block_key(1, h) for h in HASHES[1]]
    cut = group_chunks(1, 1, NARROW[1], FIRST_INDEX[1] + 1, keys, BPC)
    assert cut is not None and cut[0].start == FIRST_INDEX[1] + 1
    return out + cut


def store_load_and_narrow_load(
    rig: Pages, client: Any
) -> tuple[dict[bytes, bytes], list[torch.Tensor], list[torch.Tensor]]:
    """Store SRC, load it into DST, then the narrow load (through staging); what Redis holds
    after the store, and the KV cache after each load."""
    assert rig.store_job(1, chunks(SRC)).ok
    stored = chunk_values(client)
    assert len(stored) == 4
    assert rig.load_job(2, chunks(DST)).ok
    assert rig.moved(SRC, DST)
    after_load = [t.clone() for t in rig.tensors]
    for tensor in rig.tensors:
        tensor[DST[0] + DST[1]] = 0  # the narrow load must fill them again
    assert rig.load_job(3, narrow_chunks()).ok
    assert rig.moved((SRC[0], SRC[1][1:]), NARROW), "the narrow load did not land"
    return stored, after_load, [t.clone() for t in rig.tensors]
