"""The vLLM worker on CPU KV-cache tensors against a real Redis: vLLM's specs are mapped onto
the transfer engine so pages land where they belong and nothing else changes, and a spec that
does not add up fails its job (counted) instead of raising into vLLM. The engine's own
behaviours are tested without vLLM in tests/core/transfer/test_cpu_pages.py."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    TransferResult,
    make_offload_key,
)

from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.adapter.worker import RedisOffloadingWorker
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.kv_pages import BPC, DST, KEYSPACE, LAYERS, PAGES, SRC, kv_tensors


def _caches(strided: bool = False) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    """vLLM's canonical view of the two groups' KV caches (:func:`kv_tensors`)."""
    tensors = kv_tensors(strided)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(i, page) for i in layers]
            for layers, page in zip(LAYERS, PAGES, strict=True)
        ],
    )
    return tensors, caches


def make_worker(
    store: RedisBlockStore,
    strided: bool = False,
    max_inflight_bytes: int = 1 << 24,
    io_threads: int = 2,
    **options: Any,
) -> RedisOffloadingWorker:
    """A worker over fresh CPU KV caches (see :func:`_caches`), kept as ``worker.tensors``;
    ``options`` override the other constructor arguments (``rank``, ``auth_key`` ...)."""
    tensors, caches = _caches(strided)
    arguments: dict[str, Any] = {
        "keyspace": KEYSPACE,
        "rank": 0,
        "group_ids": [0, 1],
        "blocks_per_chunk": BPC,
        "kv_dtype": "int8",
        "shutdown_timeout_s": 1.0,
    }
    w = RedisOffloadingWorker(
        store=store,
        kv_caches=caches,
        io_threads=io_threads,
        max_inflight_bytes=max_inflight_bytes,
        **(arguments | options),
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


def finished_result(worker: RedisOffloadingWorker, job_id: int) -> TransferResult:
    """The result ``get_finished`` reports for ``job_id``, polled for at most 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for result in worker.get_finished():
            if result.job_id == job_id:
                return result
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} did not finish")


def run_job(worker: RedisOffloadingWorker, job_id: int, submit) -> bool:
    """Run one job to completion; True unless it is reported as a failed load."""
    submit(job_id)
    finished_result(worker, job_id)
    return job_id not in worker.take_failed_load_jobs()


# The chunks of tests.support.kv_pages (same Redis keys): group 0 two whole chunks; group 1
# starts mid-chunk (a sliding window keeps only the last two blocks of its first chunk).
KEYS = [make_offload_key(bytes([n]) * 16, 0) for n in (1, 2)] + [
    make_offload_key(bytes([n]) * 16, 1) for n in (3, 4)
]


def spec_of(ids: tuple[list[int], list[int]]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids[0] + ids[1], [len(ids[0]), len(ids[1])], [0, 2])


def _pages(worker, group: int, ids: list[int]) -> list[torch.Tensor]:
    return [worker.tensors[i][ids, : PAGES[group]].clone() for i in LAYERS[group]]


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
        page = PAGES[group]
        changed = torch.zeros_like(old, dtype=torch.bool)
        changed[DST[group], :page] = True
        assert torch.equal(old[~changed], new[~changed])


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


def test_store_job_with_an_inconsistent_layout_counts_its_chunks_as_failed(worker, redis_client):
    extra_key = [*KEYS, make_offload_key(bytes([9]) * 16, 1)]  # one key more than the blocks
    store = worker.test_store
    assert run_job(
        worker, 1, lambda j: worker.submit_store(j, spec_of(SRC), RedisLoadStoreSpec(extra_key))
    )
    assert store.counters.snapshot()["store_failed_chunks"] == len(extra_key)
    assert not list(redis_client.scan_iter("hma:worker-test:g*"))


def test_a_spec_the_worker_cannot_map_fails_its_load_without_raising(worker, redis_client):
    """More KV groups than the worker has: submit returns (vLLM's step goes on), the load is
    reported failed, no page is written."""
    assert run_job(
        worker, 1, lambda j: worker.submit_store(j, spec_of(SRC), RedisLoadStoreSpec(KEYS))
    )
    before = [t.clone() for t in worker.tensors]
    ids = [*SRC[0], *SRC[1], 1]
    three_groups = GPULoadStoreSpec(ids, [len(SRC[0]), len(SRC[1]), 1], [0, 2, 0])
    worker.enable_failure_reporting()
    worker.submit_load(2, RedisLoadStoreSpec(KEYS), three_groups)
    deadline = time.monotonic() + 10
    while not any(r.job_id == 2 and r.success for r in worker.get_finished()):
        assert time.monotonic() < deadline, "the load did not finish"
        time.sleep(0.001)
    assert worker.take_failed_load_jobs() == {2}
    assert all(torch.equal(a, b) for a, b in zip(before, worker.tensors, strict=True))
    assert worker.test_store.counters.snapshot()["load_failed_jobs"] == 1
