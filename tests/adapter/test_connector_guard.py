"""Only ``RedisOffloadingConnector`` may drive the spec: it is the one connector that turns a
failed load (a chunk evicted or corrupted in Redis between lookup and load) into a recompute.

Under vLLM's stock ``OffloadingConnector`` the worker's failed load would leave the destination
blocks holding whatever they held and the request would be served from them (wrong tokens).
Two guards: the spec refuses to start under any other connector (a real engine that does not
start: tests/engine/test_connector_guard.py), and a worker whose connector never enabled failure
reporting reports a failed load as failed, so vLLM stops loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
from tests.adapter.test_worker import finished_result
from tests.support.scheduler_harness import (
    make_vllm_config,
    three_group_kv_cache_config,
    worker_spec,
    write_tiny_model_config,
)

NUM_BLOCKS = 8
PAGE_BYTES = 2 * 16 * 64 * 4  # the harness' groups: K and V, 16 tokens, 1 head of 64, float32


@pytest.fixture
def make_worker(tmp_path: Path, redis_url: str) -> Iterator[object]:
    """Workers as the spec builds them (``spec.get_worker``) on CPU KV-cache tensors."""
    model_dir = write_tiny_model_config(tmp_path / "tiny-llama")
    kv_cache_config = three_group_kv_cache_config(16, NUM_BLOCKS, 3)
    vllm_config = make_vllm_config(model_dir, redis_url, num_blocks=NUM_BLOCKS)
    made: list[RedisOffloadingWorker] = []

    def make() -> RedisOffloadingWorker:
        tensors = [torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.int8) for _ in range(3)]
        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, PAGE_BYTES) for t in tensors],
            group_data_refs=[[CanonicalKVCacheRef(i, PAGE_BYTES)] for i in range(3)],
        )
        worker = worker_spec(vllm_config, kv_cache_config).get_worker(caches)
        assert isinstance(worker, RedisOffloadingWorker)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


def _load_missing_chunk(worker: RedisOffloadingWorker, job_id: int) -> TransferResult:
    """Load one chunk of group 0 that Redis does not hold; the job's result."""
    missing = make_offload_key(b"\x77" * 32, 0)
    worker.submit_load(
        job_id, RedisLoadStoreSpec([missing]), GPULoadStoreSpec([3], [1, 0, 0], [0, 0, 0])
    )
    return finished_result(worker, job_id)


def test_failed_load_is_reported_as_failed_unless_the_connector_recomputes(
    make_worker, redis_client
) -> None:
    """Defence in depth: a worker whose connector did not enable failure reporting answers a
    failed load with success=False (vLLM then stops the engine rather than serve stale KV);
    under RedisOffloadingConnector (which enables it) the result says success and the job is
    listed for recompute."""
    plain = make_worker()
    assert _load_missing_chunk(plain, 1).success is False

    reporting = make_worker()
    reporting.enable_failure_reporting()
    assert _load_missing_chunk(reporting, 2).success is True
    assert reporting.take_failed_load_jobs() == {2}
