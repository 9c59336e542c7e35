"""Behaviours that a deliberately broken copy of the code once got past the suite (issue 17).

Each test here fails on one realistic bug and passes on the real code; the bug it pins is named
in its docstring. Everything runs against a real Redis (conftest's session server, or a private
one where the test needs ACLs or an outage) and real vLLM types: no mocks, no engine.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import redis
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.adapter.worker import RedisOffloadingWorker
from hma_redis.core import codec
from hma_redis.core.codec import BlockHeader
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.kv_pages import as_before_or_cleared

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def _store(url: str, native: bool | None = None) -> RedisBlockStore:
    cfg = RedisTierConfig.from_extra_config({"redis_url": url}, env={})
    return RedisBlockStore(cfg, native=native)


def _key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(bytes([n]) * 32, group)


def _hash(n: int) -> bytes:
    return bytes([n]) * 32


# ----------------------------------------------------------------------------- manager


def _manager(
    url: str, world_size: int = 1, answer_ttl_s: float = 2.0
) -> tuple[RedisOffloadingManager, KeySpace]:
    keyspace = KeySpace("hma", "behave", world_size=world_size)
    manager = RedisOffloadingManager(
        _store(url), keyspace, answer_ttl_s=answer_ttl_s, lookup_wait_s=2.0
    )
    return manager, keyspace


def _ask(manager: RedisOffloadingManager, keys: list[OffloadKey]) -> list[LookupResult]:
    """Ask about ``keys`` the way vLLM does: a step of lookups (RETRY for unknown keys), the
    step's end (one round trip), then the answers the next step gets."""
    ctx = ReqContext(req_id="asker")
    for key in keys:
        manager.lookup(key, ctx)
    manager.on_schedule_end(END_OF_STEP)
    return [manager.lookup(key, ctx) for key in keys]


def test_cached_answer_expires_after_two_steps_and_its_ttl(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Bug pinned: the manager never expires its cached answers (a chunk stored by another
    instance would stay a MISS forever)."""
    manager, keyspace = _manager(redis_url, answer_ttl_s=0.05)
    key = _key(1)
    assert _ask(manager, [key]) == [LookupResult.MISS]
    redis_client.set(keyspace.block_key(0, _hash(1)), b"x")  # another instance stores it
    time.sleep(0.1)  # the TTL is over ...
    for _ in range(2):
        manager.on_schedule_end(END_OF_STEP)
        # ... but answers live at least two steps, so a waiting request still finds it.
        assert manager.lookup(key, ReqContext(req_id="r")) is LookupResult.MISS
    manager.on_schedule_end(END_OF_STEP)  # the third step: both bounds are past
    assert manager.lookup(key, ReqContext(req_id="r")) is LookupResult.RETRY  # asks Redis again
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(key, ReqContext(req_id="r")) is LookupResult.HIT
    manager.shutdown()


def test_cached_answer_lives_for_its_ttl_however_many_steps_pass(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Bug pinned: answers expiring by step count alone (fast steps would re-ask Redis about
    every key every third step)."""
    manager, keyspace = _manager(redis_url, answer_ttl_s=60.0)
    key = _key(2)
    assert _ask(manager, [key]) == [LookupResult.MISS]
    redis_client.set(keyspace.block_key(0, _hash(2)), b"x")
    for _ in range(5):
        manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(key, ReqContext(req_id="r")) is LookupResult.MISS
    manager.shutdown()


def test_lookup_results_are_sliced_per_chunk_with_several_ranks(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Bug pinned: the per-rank slicing of a batch's EXISTS flags off by one chunk (only
    visible with world_size >= 2 and several chunks in one batch)."""
    manager, keyspace = _manager(redis_url, world_size=2)
    shards = {1: (0, 1), 2: (0,), 3: (1,), 4: (0, 1), 5: ()}  # chunk -> ranks that stored it
    for n, ranks in shards.items():
        for rank in ranks:
            redis_client.set(keyspace.block_key(0, _hash(n), rank), b"x")
    answers = _ask(manager, [_key(n) for n in shards])
    hit, miss = LookupResult.HIT, LookupResult.MISS
    assert answers == [hit, miss, miss, hit, miss]
    manager.shutdown()


def test_chunk_missing_any_one_rank_shard_is_a_miss(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Bug pinned: a chunk counted as a hit when only some ranks' shards are in Redis (each
    rank would then load a chunk another rank cannot)."""
    manager, keyspace = _manager(redis_url, world_size=3)
    shards = {1: (0, 1, 2), 2: (1, 2), 3: (0, 2), 4: (0, 1)}
    for n, ranks in shards.items():
        for rank in ranks:
            redis_client.set(keyspace.block_key(1, _hash(n), rank), b"x")
    answers = _ask(manager, [_key(n, group=1) for n in shards])
    assert answers == [LookupResult.HIT] + [LookupResult.MISS] * 3
    manager.shutdown()


def test_failed_load_makes_its_keys_misses(redis_url: str, redis_client: redis.Redis) -> None:
    """Bug pinned: ``on_load_failed`` not marking the failed keys as misses (the recompute
    would be sent back to the same broken values)."""
    manager, keyspace = _manager(redis_url)
    failed, other = [_key(1), _key(2)], _key(3)
    for n in (1, 2, 3):
        redis_client.set(keyspace.block_key(0, _hash(n)), b"x")
    assert _ask(manager, [*failed, other]) == [LookupResult.HIT] * 3
    manager.prepare_load(failed, ReqContext(req_id="r1"))
    manager.prepare_load([other], ReqContext(req_id="r2"))
    manager.on_load_failed("r1")
    ctx = ReqContext(req_id="r3")
    assert [manager.lookup(k, ctx) for k in failed] == [LookupResult.MISS] * 2
    assert manager.lookup(other, ctx) is LookupResult.HIT  # another request's load is fine
    manager.shutdown()


def test_store_already_in_flight_is_not_stored_twice(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Bug pinned: ``prepare_store`` ignoring stores already in flight (two requests with one
    prefix would both store it)."""
    manager, _ = _manager(redis_url)
    first = manager.prepare_store([_key(1)], ReqContext(req_id="r1"))
    assert first is not None and list(first.keys_to_store) == [_key(1)]
    second = manager.prepare_store([_key(1), _key(2)], ReqContext(req_id="r2"))
    assert second is not None and list(second.keys_to_store) == [_key(2)]
    manager.complete_store([_key(1)], ReqContext(req_id="r1"))
    # Done, but Redis was never asked: a dropped store must not turn into "present".
    third = manager.prepare_store([_key(1)], ReqContext(req_id="r3"))
    assert third is not None and list(third.keys_to_store) == [_key(1)]
    manager.shutdown()


# ----------------------------------------------------------------------------- worker

NUM_BLOCKS = 16
BPC = 4
PAGE = 1000
LAYERS = 2


@pytest.fixture
def worker(redis_url: str, redis_client: redis.Redis) -> Iterator[RedisOffloadingWorker]:
    with _worker(redis_url) as w:
        yield w


@contextmanager
def _worker(url: str, native: bool | None = None) -> Iterator[RedisOffloadingWorker]:
    """One KV group of two layers of unpadded pages over CPU tensors (``.tensors``), its
    store's counters as ``.counters``; ``native`` picks the data path (None: the default)."""
    gen = torch.Generator().manual_seed(3)
    tensors = [
        torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
        for _ in range(LAYERS)
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
    )
    store = _store(url, native=native)
    w = RedisOffloadingWorker(
        store=store,
        keyspace=KeySpace("hma", "behave-worker"),
        rank=0,
        kv_caches=caches,
        group_ids=[0],
        blocks_per_chunk=BPC,
        kv_dtype="int8",
        io_threads=2,
        max_inflight_bytes=1 << 22,
        shutdown_timeout_s=1.0,
    )
    w.tensors = tensors  # type: ignore[attr-defined]
    w.counters = store.counters  # type: ignore[attr-defined]
    try:
        yield w
    finally:
        w.shutdown()
        store.close()


def _run(worker: RedisOffloadingWorker, job_id: int, submit: Callable[[int], bool]) -> bool:
    """Run one job to completion; True unless it is reported as a failed load."""
    assert submit(job_id)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(r.job_id == job_id for r in worker.get_finished()):
            return job_id not in worker.take_failed_load_jobs()
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} did not finish")


def _spec(block_ids: list[int], first_index: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, [len(block_ids)], [first_index])


def _snapshot(worker: RedisOffloadingWorker) -> list[torch.Tensor]:
    return [t.clone() for t in worker.tensors]  # type: ignore[attr-defined]


def _unchanged(worker: RedisOffloadingWorker, before: list[torch.Tensor]) -> bool:
    now = worker.tensors  # type: ignore[attr-defined]
    return all(torch.equal(a, b) for a, b in zip(before, now, strict=True))


def _put_value(
    client: redis.Redis, worker: RedisOffloadingWorker, n: int, first: int, count: int
) -> bytes:
    """Write a well-formed value for chunk ``n`` holding ``count`` blocks from ``first``;
    return its body (layer-major pages)."""
    redis_key = KeySpace("hma", "behave-worker").block_key(0, _hash(n))
    header = BlockHeader(
        key=redis_key,
        group=0,
        first_block=first,
        num_blocks=count,
        page_bytes=(PAGE,) * LAYERS,
        kv_dtype="int8",
    )
    body = torch.randint(0, 256, (header.body_bytes,), dtype=torch.uint8).numpy().tobytes()
    client.set(redis_key, bytes(codec.encode(header, body)))
    return body


def _load(worker: RedisOffloadingWorker, job_id: int, keys: list[OffloadKey], spec) -> bool:
    return _run(worker, job_id, lambda j: worker.submit_load(j, RedisLoadStoreSpec(keys), spec))


@pytest.mark.parametrize(
    ("first", "count"),
    [pytest.param(0, BPC - 1, id="last-block-missing"), pytest.param(1, BPC - 1, id="first")],
)
def test_value_one_block_short_is_rejected_and_deleted(
    worker: RedisOffloadingWorker, redis_client: redis.Redis, first: int, count: int
) -> None:
    """Bug pinned: load validation not checking that a value holds every block the chunk
    needs (a value one block short would write other pages into the KV cache and stay in
    Redis, where SET NX would never replace it)."""
    _put_value(redis_client, worker, 1, first, count)
    before = _snapshot(worker)
    assert not _load(worker, 1, [_key(1)], _spec([4, 5, 6, 7]))  # needs blocks 0..3
    assert as_before_or_cleared(before, worker.tensors)  # type: ignore[attr-defined]
    redis_key = KeySpace("hma", "behave-worker").block_key(0, _hash(1))
    assert redis_client.exists(redis_key) == 0


def test_value_holding_exactly_the_blocks_needed_is_loaded(
    worker: RedisOffloadingWorker, redis_client: redis.Redis
) -> None:
    """The other side of the check above: a sliding-window chunk stored without its first
    block serves a load of exactly its blocks (no off-by-one in the bound)."""
    body = _put_value(redis_client, worker, 2, 1, BPC - 1)
    assert _load(worker, 2, [_key(2)], _spec([9, 3, 4], first_index=1))
    tensors = worker.tensors  # type: ignore[attr-defined]
    for layer in range(LAYERS):
        want = body[layer * 3 * PAGE : (layer + 1) * 3 * PAGE]
        got = b"".join(tensors[layer][b].numpy().tobytes() for b in (9, 3, 4))
        assert got == want


def test_missing_chunk_in_the_middle_fails_the_load_before_any_page_is_written(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Validate-before-copy (second test; the first corrupts the last chunk), on the Python
    path: a load of three chunks whose middle one is gone writes nothing, not even the valid
    first chunk."""
    with _worker(redis_url, native=False) as worker:
        _put_value(redis_client, worker, 1, 0, BPC)
        _put_value(redis_client, worker, 3, 0, BPC)
        before = _snapshot(worker)
        keys = [_key(1), _key(2), _key(3)]
        assert not _load(worker, 1, keys, _spec(list(range(12))))
        assert _unchanged(worker, before)


def test_native_load_with_a_missing_chunk_fails_and_touches_only_its_own_blocks(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The native path receives values straight into the job's pages, so a failed job may
    leave bytes there: it must then be reported failed (vLLM frees those blocks uncached and
    recomputes the request) and never write a page outside the job's destination blocks."""
    with _worker(redis_url, native=True) as worker:
        assert worker.data_path.startswith("native")  # type: ignore[attr-defined]
        _put_value(redis_client, worker, 1, 0, BPC)
        _put_value(redis_client, worker, 3, 0, BPC)
        before = _snapshot(worker)
        keys = [_key(1), _key(2), _key(3)]
        destination = list(range(4, 16))
        assert not _load(worker, 1, keys, _spec(destination))
        others = [b for b in range(NUM_BLOCKS) if b not in destination]
        now = worker.tensors  # type: ignore[attr-defined]
        assert all(torch.equal(a[others], b[others]) for a, b in zip(before, now, strict=True))


def test_failed_loads_are_reported_once_and_good_loads_never(local_redis: LocalRedis) -> None:
    """Recording failed loads (second test; the first corrupts a value): a load that meets a
    dead Redis is reported failed exactly once, counted, and a good load is not reported."""
    with _worker(local_redis.url) as worker:
        _fail_a_load_on_a_dead_redis(local_redis, worker)


def _fail_a_load_on_a_dead_redis(server: LocalRedis, worker: RedisOffloadingWorker) -> None:
    client = redis.Redis.from_url(server.url)
    _put_value(client, worker, 1, 0, BPC)
    client.close()
    assert _load(worker, 1, [_key(1)], _spec([0, 1, 2, 3]))
    assert worker.take_failed_load_jobs() == set()

    server.kill()
    assert worker.submit_load(2, RedisLoadStoreSpec([_key(1)]), _spec([4, 5, 6, 7]))
    deadline = time.monotonic() + 10
    finished: list[int] = []
    while 2 not in finished and time.monotonic() < deadline:
        finished += [r.job_id for r in worker.get_finished()]
        time.sleep(0.005)
    assert finished == [2]
    assert worker.take_failed_load_jobs() == {2}
    assert worker.take_failed_load_jobs() == set()  # reported once
    totals = worker.counters.totals  # type: ignore[attr-defined]
    assert totals.get("load_failed_jobs") == 1
    assert totals.get("load_failed_chunks") == 1


# ----------------------------------------------------------------------------- ACL

ACL_USER, ACL_PASSWORD = "tier-behave", "Behave-s3cret-5e1d"


@pytest.fixture(scope="module")
def acl_server() -> Iterator[LocalRedis]:
    """A private redis-server whose user ``tier-behave`` may touch only ``hma:*`` keys."""
    server = LocalRedis().start()
    admin = redis.Redis(port=server.port, socket_timeout=2)
    admin.execute_command(
        "ACL", "SETUSER", ACL_USER, "on", f">{ACL_PASSWORD}", "resetkeys", "~hma:*", "+@all"
    )
    admin.close()
    yield server
    server.stop()


def test_lookup_refused_by_an_acl_is_a_miss_not_an_outage(acl_server: LocalRedis) -> None:
    """Bug pinned: ``exists()`` reporting an ACL-refused lookup as hits (every load would then
    fail, and be refused again). It is a miss, and Redis is not considered down."""
    admin = redis.Redis(port=acl_server.port, socket_timeout=2)
    admin.set("other:g0:aa", b"x")
    admin.set("hma:behave:g0:aa", b"x")
    url = f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{acl_server.port}/0"
    store = _store(url)
    assert store.exists(["other:g0:aa"]) == [False]
    mixed = store.exists(["hma:behave:g0:aa", "other:g0:aa"])
    assert len(mixed) == 2 and mixed[1] is False
    assert store.exists(["hma:behave:g0:aa"]) == [True]
    assert store.breaker.failures == 0

    # Through the manager: a namespace outside the user's key pattern only ever misses.
    block = _hash(9)
    keyspace = KeySpace("other", "ns")
    admin.set(keyspace.block_key(0, block), b"x")
    manager = RedisOffloadingManager(store, keyspace, lookup_wait_s=2.0)
    assert _ask(manager, [make_offload_key(block, 0)]) == [LookupResult.MISS]
    manager.shutdown()
    store.close()
    admin.close()


def test_worker_logs_its_transfer_memory_peak_against_its_bound_at_shutdown(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator (and the soak) reads the tier's memory from the log: at shutdown the worker
    logs the most bytes its transfers held at once next to ``max_inflight_bytes``."""
    with _worker(redis_url) as worker:
        _put_value(redis_client, worker, 1, 0, BPC)
        assert _load(worker, 1, [_key(1)], _spec([0, 1, 2, 3]))
        with caplog.at_level(logging.INFO, logger="hma_redis.adapter.worker"):
            worker.shutdown()
    (line,) = [r.getMessage() for r in caplog.records if "memory" in r.getMessage()]
    memory = json.loads(line.split("memory", 1)[1])
    assert memory == worker.memory()
    assert 0 < memory["peak_budget_bytes"] <= memory["max_inflight_bytes"]
