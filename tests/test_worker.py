"""The worker's data path on CPU KV-cache tensors against a real Redis: pages land where they
belong, padding and other blocks are never touched, a bad value writes nothing, and every
chunk a store job drops is counted."""

from __future__ import annotations

import time

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    make_offload_key,
)

from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.adapter.worker import RedisOffloadingWorker
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.store import RedisBlockStore
from hma_redis.core.transfer import _block_runs

NUM_BLOCKS = 40
BPC = 4  # blocks per chunk
# Group 0: three layers in tensors whose rows are padded past the page; group 1: two layers
# of unpadded rows (as vLLM lays out a hybrid model whose groups have different page sizes).
ROW0, PAGE0 = 3000, 2500
PAGE1 = 1000


def _caches(strided: bool = False) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    """The KV caches of two groups. ``strided``: each layer a non-contiguous view (rows of a
    wider tensor), which the worker cannot address as host memory: it goes through value
    buffers and torch copies, as a GPU KV cache does."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(NUM_BLOCKS, ROW0)] * 3 + [(NUM_BLOCKS, PAGE1)] * 2
    tensors = [torch.randint(-128, 128, s, dtype=torch.int8, generator=gen) for s in shapes]
    if strided:
        tensors = [torch.cat([t, t[:, :16]], dim=1)[:, : t.shape[1]] for t in tensors]
        assert not any(t.is_contiguous() for t in tensors)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(i, PAGE0) for i in range(3)],
            [CanonicalKVCacheRef(i, PAGE1) for i in (3, 4)],
        ],
    )
    return tensors, caches


def make_worker(
    store: RedisBlockStore,
    strided: bool = False,
    max_inflight_bytes: int = 1 << 24,
    io_threads: int = 2,
) -> RedisOffloadingWorker:
    """A worker over fresh CPU KV caches (see :func:`_caches`), kept as ``worker.tensors``."""
    tensors, caches = _caches(strided)
    w = RedisOffloadingWorker(
        store=store,
        keyspace=KeySpace("hma", "worker-test"),
        rank=0,
        kv_caches=caches,
        group_ids=[0, 1],
        blocks_per_chunk=BPC,
        kv_dtype="int8",
        io_threads=io_threads,
        max_inflight_bytes=max_inflight_bytes,
        shutdown_timeout_s=1.0,
    )
    w.tensors = tensors  # type: ignore[attr-defined]
    w.test_store = store  # type: ignore[attr-defined]
    return w


@pytest.fixture(params=[False, True], ids=["in-place", "buffered"])
def worker(request, redis_client, redis_url):
    store = RedisBlockStore(RedisTierConfig(url=redis_url))
    w = make_worker(store, strided=request.param)
    yield w
    w.shutdown()
    store.close()


def run_job(worker: RedisOffloadingWorker, job_id: int, submit) -> bool:
    """Run one job to completion; True unless it is reported as a failed load."""
    submit(job_id)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(r.job_id == job_id for r in worker.get_finished()):
            return job_id not in worker.take_failed_load_jobs()
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} did not finish")


# Group 0: two whole chunks; group 1 starts mid-chunk (a sliding window keeps only the last two
# blocks of its first chunk), then one whole chunk. Ids mix runs of consecutive blocks and gaps.
SRC = ([3, 4, 5, 9, 10, 2, 20, 21], [7, 8, 11, 12, 13, 14])
DST = ([30, 31, 32, 33, 0, 36, 38, 39], [25, 26, 27, 18, 34, 35])
KEYS = [make_offload_key(bytes([n]) * 16, 0) for n in (1, 2)] + [
    make_offload_key(bytes([n]) * 16, 1) for n in (3, 4)
]


def spec_of(ids: tuple[list[int], list[int]]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids[0] + ids[1], [len(ids[0]), len(ids[1])], [0, 2])


def _pages(worker, group: int, ids: list[int]) -> list[torch.Tensor]:
    layers = range(3) if group == 0 else (3, 4)
    page = PAGE0 if group == 0 else PAGE1
    return [worker.tensors[i][ids, :page].clone() for i in layers]


def test_block_runs_groups_consecutive_ids():
    assert _block_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert _block_runs([7]) == [(0, 7, 1)]


def test_store_then_load_moves_every_page_and_nothing_else(worker):
    before = [t.clone() for t in worker.tensors]
    assert run_job(
        worker, 1, lambda j: worker.submit_store(j, spec_of(SRC), RedisLoadStoreSpec(KEYS))
    )
    assert all(torch.equal(a, b) for a, b in zip(before, worker.tensors, strict=True))

    assert run_job(
        worker, 2, lambda j: worker.submit_load(j, RedisLoadStoreSpec(KEYS), spec_of(DST))
    )
    for group in (0, 1):
        for got, want in zip(
            _pages(worker, group, DST[group]), _pages(worker, group, SRC[group]), strict=True
        ):
            assert torch.equal(got, want)
    # Only the destination pages changed: padding bytes and every other block are as before.
    for idx, (old, new) in enumerate(zip(before, worker.tensors, strict=True)):
        group = 0 if idx < 3 else 1
        page = PAGE0 if group == 0 else PAGE1
        changed = torch.zeros_like(old, dtype=torch.bool)
        changed[DST[group], :page] = True
        assert torch.equal(old[~changed], new[~changed])


def test_corrupt_chunk_fails_the_load_before_any_page_is_written(worker, redis_client):
    assert run_job(
        worker, 1, lambda j: worker.submit_store(j, spec_of(SRC), RedisLoadStoreSpec(KEYS))
    )
    keys = sorted(k.decode() for k in redis_client.scan_iter("hma:worker-test:g*"))
    assert len(keys) == 4
    victim = keys[-1]
    value = bytearray(redis_client.get(victim))
    value[-1] ^= 0xFF  # one flipped bit in the last page of the last layer
    redis_client.set(victim, bytes(value))

    before = [t.clone() for t in worker.tensors]
    assert not run_job(
        worker, 2, lambda j: worker.submit_load(j, RedisLoadStoreSpec(KEYS), spec_of(DST))
    )
    assert all(torch.equal(a, b) for a, b in zip(before, worker.tensors, strict=True))
    assert redis_client.exists(victim) == 0  # dropped, so the recompute can store a good copy
    assert redis_client.exists(*keys[:-1]) == 3


def test_gil_switch_interval_is_lowered_never_raised():
    import sys

    from hma_redis.adapter.spec import lower_gil_switch_interval

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        lower_gil_switch_interval(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        lower_gil_switch_interval(0.002)  # a second worker asking for more leaves it
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


def test_store_job_that_raises_counts_every_chunk_as_failed(worker, redis_client):
    # A block id past the end of the KV cache: the job fails while it reads the pages.
    bad = ([*SRC[0][:-1], NUM_BLOCKS + 5], SRC[1])
    store = worker.test_store
    assert run_job(
        worker, 1, lambda j: worker.submit_store(j, spec_of(bad), RedisLoadStoreSpec(KEYS))
    )
    # Every chunk is counted once; those of the failed batch as failed.
    totals = store.counters.snapshot()
    assert totals.get("stored_chunks", 0) + totals["store_failed_chunks"] == len(KEYS)
    assert totals["store_failed_chunks"] >= 1


def test_store_job_with_an_inconsistent_layout_counts_its_chunks_as_failed(worker, redis_client):
    extra_key = [*KEYS, make_offload_key(bytes([9]) * 16, 1)]  # one key more than the blocks
    store = worker.test_store
    assert run_job(
        worker, 1, lambda j: worker.submit_store(j, spec_of(SRC), RedisLoadStoreSpec(extra_key))
    )
    assert store.counters.snapshot()["store_failed_chunks"] == len(extra_key)
    assert not list(redis_client.scan_iter("hma:worker-test:g*"))
