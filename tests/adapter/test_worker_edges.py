"""What the worker's constructor arguments and results promise an operator, each against a real
Redis: a rank stores its own shard, an ``auth_key`` signs every value, ``io_threads``,
``max_inflight_bytes``, ``connections_per_job`` and ``shutdown_timeout_s`` reach the transfer
engine, each job's result carries the bytes and seconds vLLM's transfer metrics are built from,
``wait`` releases a store's blocks, and a store whose keys and blocks disagree fails whole.
(The worker's page mapping: tests/adapter/test_worker.py; the engine: tests/core/.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.adapter.worker import RedisOffloadingWorker
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.engine import TEST_LOAD_DELAY_ENV
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.adapter.test_worker import KEYS, finished_result, make_worker, run_job, spec_of
from tests.support.kv_pages import DST, HASHES, KEYSPACE, LAYERS, PAGES, SRC

AUTH_KEY = b"worker-edges-secret-0001"


@pytest.fixture
def store(redis_client: redis.Redis, redis_url: str) -> Iterator[RedisBlockStore]:
    """A store on the freshly flushed session Redis, shared by the test's workers."""
    block_store = RedisBlockStore(RedisTierConfig(url=redis_url))
    yield block_store
    block_store.close()


@pytest.fixture
def workers(store: RedisBlockStore) -> Iterator[list[RedisOffloadingWorker]]:
    """The test's workers (``make_worker(...)`` appended here), shut down at teardown."""
    made: list[RedisOffloadingWorker] = []
    yield made
    for worker in made:
        worker.shutdown()


def _store(worker: RedisOffloadingWorker, job_id: int) -> None:
    worker.submit_store(job_id, spec_of(SRC), RedisLoadStoreSpec(KEYS))
    assert finished_result(worker, job_id).success


def _load(worker: RedisOffloadingWorker, job_id: int) -> bool:
    """Load the chunks into the DST blocks; whether the load succeeded."""
    return run_job(
        worker, job_id, lambda j: worker.submit_load(j, RedisLoadStoreSpec(KEYS), spec_of(DST))
    )


def _moved(worker: RedisOffloadingWorker) -> bool:
    """Whether every DST page holds the bytes of its SRC page."""
    tensors = worker.tensors  # type: ignore[attr-defined]
    return all(
        torch.equal(tensors[i][DST[g], : PAGES[g]], tensors[i][SRC[g], : PAGES[g]])
        for g in (0, 1)
        for i in LAYERS[g]
    )


def _values(client: redis.Redis) -> dict[str, int]:
    """The block keys in Redis and their value sizes."""
    return {k.decode(): client.strlen(k) for k in client.scan_iter("hma:worker-test:g*")}


def test_each_rank_stores_its_own_shard(
    store: RedisBlockStore, workers: list[RedisOffloadingWorker], redis_client: redis.Redis
) -> None:
    """With tensor parallelism every rank stores its slice of a chunk under its own key (a
    chunk is a hit only when every rank's key exists)."""
    sharded = KeySpace(KEYSPACE.prefix, KEYSPACE.namespace, world_size=2)
    workers.append(worker := make_worker(store, keyspace=sharded, rank=1))
    _store(worker, 1)
    expected = {
        sharded.block_key(group, block_hash, rank=1)
        for group, hashes in enumerate(HASHES)
        for block_hash in hashes
    }
    assert set(_values(redis_client)) == expected
    assert all(key.endswith(":r1") for key in expected)


def test_job_results_carry_the_value_bytes_and_seconds(
    store: RedisBlockStore, workers: list[RedisOffloadingWorker], redis_client: redis.Redis
) -> None:
    """vLLM's ``kv_offload_{store,load}_{bytes,time}`` metrics come from these results: a
    store reports the bytes it wrote, a load the bytes it read, each with its duration."""
    workers.append(worker := make_worker(store))
    worker.submit_store(1, spec_of(SRC), RedisLoadStoreSpec(KEYS))
    stored = finished_result(worker, 1)
    written = sum(_values(redis_client).values())
    assert len(_values(redis_client)) == len(KEYS)
    assert stored.transfer_size == written
    assert isinstance(stored.transfer_time, float) and stored.transfer_time >= 0

    worker.submit_load(2, RedisLoadStoreSpec(KEYS), spec_of(DST))
    loaded = finished_result(worker, 2)
    assert loaded.success and _moved(worker)
    assert loaded.transfer_size == written
    assert isinstance(loaded.transfer_time, float) and loaded.transfer_time >= 0


def test_values_are_signed_with_the_auth_key(
    store: RedisBlockStore, workers: list[RedisOffloadingWorker]
) -> None:
    """An instance sharing the secret loads what a keyed instance stored; one without the
    secret refuses those values (its load fails, the request is recomputed)."""
    workers.append(writer := make_worker(store, auth_key=AUTH_KEY))
    _store(writer, 1)
    workers.append(same_secret := make_worker(store, auth_key=AUTH_KEY))
    assert _load(same_secret, 2)
    assert _moved(same_secret)
    workers.append(no_secret := make_worker(store))
    assert not _load(no_secret, 3)
    assert not _moved(no_secret)


def test_a_job_runs_over_the_configured_connections(
    store: RedisBlockStore, workers: list[RedisOffloadingWorker]
) -> None:
    """``connections_per_job`` (here more than the store's default) splits each job over
    that many threads on the native path, each on up to ``connections_per_thread``
    connections, as the start-up line says, and moves every page."""
    assert store.cfg.connections_per_job == 1
    assert store.native
    workers.append(worker := make_worker(store, connections_per_job=3))
    lanes = f"up to {store.cfg.connections_per_thread} connection(s) per thread"
    assert lanes in worker.data_path and worker.data_path.endswith("; 3 thread(s) per job")
    _store(worker, 1)
    assert _load(worker, 2)
    assert _moved(worker)


def test_a_store_whose_keys_name_a_group_without_blocks_fails_whole(
    store: RedisBlockStore, workers: list[RedisOffloadingWorker], redis_client: redis.Redis
) -> None:
    """Keys of KV group 1 with blocks of group 0 only: vLLM's spec and ours disagree, so no
    chunk is stored (a guess could put pages under the wrong key) and all are counted."""
    workers.append(worker := make_worker(store))
    group0_only = GPULoadStoreSpec(SRC[0], [len(SRC[0])], [0])
    worker.submit_store(1, group0_only, RedisLoadStoreSpec(KEYS))
    finished_result(worker, 1)
    assert _values(redis_client) == {}
    assert store.counters.snapshot()["store_failed_chunks"] == len(KEYS)


def test_wait_returns_once_a_store_no_longer_reads_its_blocks(
    store: RedisBlockStore, workers: list[RedisOffloadingWorker]
) -> None:
    """vLLM waits on a store before it reuses the store's blocks (``jobs_to_flush``): once
    ``wait`` returns, overwriting them does not change what is stored."""
    workers.append(worker := make_worker(store))
    tensors = worker.tensors  # type: ignore[attr-defined]
    worker.submit_store(1, spec_of(SRC), RedisLoadStoreSpec(KEYS))
    worker.wait({1})
    before = [t.clone() for t in tensors]
    for tensor in tensors:
        tensor.zero_()
    assert finished_result(worker, 1).success
    for tensor, old in zip(tensors, before, strict=True):
        tensor.copy_(old)
    assert _load(worker, 2)
    assert _moved(worker)


@pytest.fixture
def paused_redis_worker(
    local_redis: LocalRedis,
) -> Iterator[Callable[..., RedisOffloadingWorker]]:
    """Workers (native path, buffered pages) on a private Redis that the test pauses."""
    made: list[RedisOffloadingWorker] = []
    block_store = RedisBlockStore(RedisTierConfig(url=local_redis.url), native=True)

    def make(**options: Any) -> RedisOffloadingWorker:
        made.append(worker := make_worker(block_store, strided=True, **options))
        return worker

    yield make
    for worker in made:
        worker.shutdown()
    block_store.close()


def _peak_of_loads_held_by_a_paused_redis(
    worker: RedisOffloadingWorker, server: LocalRedis, first_job: int, count: int
) -> int:
    """Submit ``count`` loads while Redis is paused: every load a thread (and the budget)
    lets run takes its buffers and waits on Redis. Then resume, wait for all; the worker's
    peak of buffer bytes."""
    jobs = set(range(first_job, first_job + count))
    server.pause()
    try:
        for job in jobs:
            worker.submit_load(job, RedisLoadStoreSpec(KEYS), spec_of(DST))
        time.sleep(0.3)  # far less than the read timeout: the loads wait, none fails
    finally:
        server.resume()
    succeeded: dict[int, bool] = {}
    deadline = time.monotonic() + 10
    while set(succeeded) != jobs:
        assert time.monotonic() < deadline, f"loads {jobs - set(succeeded)} did not finish"
        succeeded |= {r.job_id: r.success for r in worker.get_finished()}
        time.sleep(0.001)
    assert all(succeeded.values())
    return worker.peak_buffer_bytes


def test_io_threads_bounds_the_loads_running_at_once(
    paused_redis_worker: Callable[..., RedisOffloadingWorker], local_redis: LocalRedis
) -> None:
    """``io_threads=1``: loads submitted together run one after the other, so they never hold
    more buffer memory than one load does."""
    worker = paused_redis_worker(io_threads=1)
    _store(worker, 1)
    assert _load(worker, 2)
    one_load = worker.peak_buffer_bytes
    assert one_load > 0
    assert _peak_of_loads_held_by_a_paused_redis(worker, local_redis, 10, 3) == one_load


def test_max_inflight_bytes_bounds_the_buffers_of_concurrent_loads(
    paused_redis_worker: Callable[..., RedisOffloadingWorker], local_redis: LocalRedis
) -> None:
    """Loads on four threads, a budget that fits one load's values but not two: the buffers
    held at once never exceed ``max_inflight_bytes``."""
    budget = 100_000
    worker = paused_redis_worker(io_threads=4, max_inflight_bytes=budget)
    _store(worker, 1)
    client = redis.Redis.from_url(local_redis.url)
    values = sum(_values(client).values())
    client.close()
    assert budget / 2 < values <= budget
    assert values <= _peak_of_loads_held_by_a_paused_redis(worker, local_redis, 10, 3) <= budget


def test_shutdown_waits_for_pending_stores_at_most_shutdown_timeout_s(
    local_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A store stuck on an unresponsive Redis does not hold the engine's exit longer than
    ``shutdown_timeout_s``: it is abandoned, and the shutdown says so."""
    stuck = RedisBlockStore(RedisTierConfig(url=local_redis.url))
    worker = make_worker(stuck, shutdown_timeout_s=0.2)
    try:
        local_redis.pause()
        worker.submit_store(1, spec_of(SRC), RedisLoadStoreSpec(KEYS))
        with caplog.at_level(logging.INFO, logger="hma_redis"):
            worker.shutdown()
        assert "flushed 0 pending store job(s) at shutdown (1 abandoned)" in caplog.text
    finally:
        local_redis.resume()
        worker.shutdown()
        stuck.close()


def test_shutdown_twice_reports_the_totals_once(
    store: RedisBlockStore, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM and the exit hook may both shut a worker down: the second call does nothing, so
    the operator's totals line is not doubled."""
    worker = make_worker(store)
    _store(worker, 1)
    with caplog.at_level(logging.INFO, logger="hma_redis"):
        worker.shutdown()
        worker.shutdown()
    totals = [r for r in caplog.records if "worker rank 0 totals" in r.getMessage()]
    assert len(totals) == 1
    assert '"stored_chunks": 4' in totals[0].getMessage()


def test_a_worker_built_without_idle_wait_s_does_not_wait_in_idle_steps(
    store: RedisBlockStore, workers: list[RedisOffloadingWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``idle_wait_s`` defaults to no wait: an idle step returns while a load still runs
    (the spec passes ``idle_wait_ms`` from the config; this is the constructor's default)."""
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, "0.5")
    workers.append(worker := make_worker(store))
    _store(worker, 1)
    worker.submit_load(2, RedisLoadStoreSpec(KEYS), spec_of(DST))
    worker.wait_while_idle()
    assert worker.get_finished() == []  # the load, 0.5 s long, was not waited for
    assert finished_result(worker, 2).success
