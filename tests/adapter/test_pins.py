"""A request's pin, through the scheduler-side manager as vLLM drives it (ReqContext with
``kv_transfer_params``), against a real Redis: with pinning on, the chunks it hit and the chunks
it stored stay persistent and listed until the deadline, at most ``pin_max_s``, while the
namespace's pins hold at most ``pin_budget_bytes``; pinning is off by default; pins asked for
while it is off and hostile values are served unpinned, counted, with one WARNING per interval;
an unreachable Redis never blocks or raises."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import redis
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.metrics import RedisMetricName
from hma_redis.core.config import MAX_EXPIRE_S, RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
TTL_S = 3600
KEYSPACE = KeySpace("hma", "pinmgr")
HIT, STORED, OTHER = (make_offload_key(bytes([i]) * 32, 0) for i in (1, 2, 3))


def _manager(url: str, **extra: Any) -> RedisOffloadingManager:
    """A manager whose operator turned pinning on (unless ``extra`` says otherwise)."""
    cfg = {
        "redis_url": url,
        "ttl_s": TTL_S,
        "read_timeout_s": 0.5,
        "connect_timeout_s": 0.5,
        "pinning": True,
    }
    store = RedisBlockStore(RedisTierConfig.from_extra_config({**cfg, **extra}, env={}))
    return RedisOffloadingManager(store, KEYSPACE, lookup_wait_s=1.0)


def _counted(manager: RedisOffloadingManager, name: str) -> int:
    """A counter of the manager's store (what the stats hash and the metrics count)."""
    return manager._store.counters.snapshot().get(name, 0)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _request(req_id: str, **params: Any) -> ReqContext:
    return ReqContext(req_id=req_id, kv_transfer_params=params or None)


def _redis_key(key: bytes) -> str:
    return KEYSPACE.block_key(0, key[:32])


def _serve(manager: RedisOffloadingManager, client: redis.Redis, ctx: ReqContext) -> None:
    """What vLLM does for a request whose first chunk is in Redis and second is not: look both
    up, store the missing one (the worker writes it as the tier does), complete the store."""
    for key in (HIT, STORED):
        manager.lookup(key, ctx)
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(HIT, ctx) is LookupResult.HIT
    out = manager.prepare_store([HIT, STORED], ctx)
    assert out is not None and out.keys_to_store == [STORED]
    client.set(_redis_key(STORED), b"v", ex=TTL_S, nx=True)
    manager.complete_store([STORED], ctx)
    manager.on_schedule_end(END_OF_STEP)
    # The step's tick may find the first sweep still running: send what is queued.
    manager._pins.flush(5.0)
    assert manager._pins.wait(5.0)


def _deadline(client: redis.Redis, key: bytes) -> float | None:
    score = client.zscore(KEYSPACE.pins_key(), _redis_key(key))
    return None if score is None else float(score)


def test_a_pinned_request_keeps_its_hit_and_stored_chunks_until_the_deadline(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.set(_redis_key(HIT), b"v", ex=TTL_S)
    manager = _manager(redis_url)
    ctx = _request("pinned", hma_redis_pin_s=600)
    # Every chunk of the prefix, hits included, is offered to prepare_store.
    assert manager.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL
    _serve(manager, redis_client, ctx)
    for key in (HIT, STORED):
        assert redis_client.ttl(_redis_key(key)) == -1
        assert _deadline(redis_client, key) == pytest.approx(time.time() + 600, abs=5)
    manager.shutdown()


def test_an_unpinned_request_leaves_ttl_s_alone(redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.set(_redis_key(HIT), b"v", ex=TTL_S)
    manager = _manager(redis_url)
    ctx = _request("plain")
    assert manager.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
    _serve(manager, redis_client, ctx)
    assert all(redis_client.ttl(_redis_key(k)) > 0 for k in (HIT, STORED))
    assert redis_client.zcard(KEYSPACE.pins_key()) == 0
    manager.shutdown()


def test_a_later_request_extends_the_pin_and_an_earlier_deadline_does_not_shorten_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.set(_redis_key(HIT), b"v", ex=TTL_S)
    manager = _manager(redis_url)
    for req_id, pin_s in (("a", 600), ("b", 6000), ("c", 60)):
        ctx = _request(req_id, hma_redis_pin_s=pin_s)
        manager.on_new_request(ctx)
        manager.lookup(HIT, ctx)
        manager.on_schedule_end(END_OF_STEP)
        assert manager.lookup(HIT, ctx) is LookupResult.HIT
        manager.on_schedule_end(END_OF_STEP)
        manager._pins.flush(5.0)
        assert manager._pins.wait(5.0)
    assert _deadline(redis_client, HIT) == pytest.approx(time.time() + 6000, abs=5)
    manager.shutdown()


@pytest.mark.parametrize(
    "value", [-5, 0, 1.5, "600", True, None, [600], {"s": 1}, "x" * 10_000, -(10**30)]
)
def test_a_hostile_pin_is_refused_with_one_line_and_the_request_is_stored_unpinned(
    value: object, redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    redis_client.set(_redis_key(HIT), b"v", ex=TTL_S)
    manager = _manager(redis_url)
    ctx = _request("hostile", hma_redis_pin_s=value)
    with caplog.at_level(logging.WARNING):
        assert manager.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
        _serve(manager, redis_client, ctx)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "hma_redis_pin_s" in lines[0], lines
    assert len(lines[0]) < 400  # a huge value is not copied into the log
    assert redis_client.exists(_redis_key(STORED))  # stored all the same
    assert all(redis_client.ttl(_redis_key(k)) > 0 for k in (HIT, STORED))
    assert redis_client.zcard(KEYSPACE.pins_key()) == 0
    manager.shutdown()


def test_pinning_without_ttl_s_is_refused_when_the_tier_starts() -> None:
    with pytest.raises(ValueError, match=r"^hma_redis: pinning needs ttl_s: .*volatile-lru"):
        RedisTierConfig.from_extra_config({"pinning": True}, env={})


def test_pinning_is_off_by_default_and_a_pin_asked_for_is_served_unpinned_counted_and_said_once(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    assert RedisTierConfig.from_extra_config({}, env={}).pinning is False
    redis_client.set(_redis_key(HIT), b"v", ex=TTL_S)
    manager = _manager(redis_url, pinning=False)
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            ctx = _request(f"r{i}", hma_redis_pin_s=3153600000)
            assert manager.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
        _serve(manager, redis_client, ctx)
    lines = _warnings(caplog)
    assert len(lines) == 1 and "pinning is off" in lines[0], lines
    assert all(redis_client.ttl(_redis_key(k)) > 0 for k in (HIT, STORED))
    assert redis_client.zcard(KEYSPACE.pins_key()) == 0
    assert _counted(manager, "pin_off_requests") == 5
    stats = manager.get_stats()
    assert stats is not None and stats.reduce()[RedisMetricName.PIN_OFF_REQUESTS] == 5
    manager.shutdown()


def test_hostile_pins_of_many_requests_write_one_warning_and_are_each_counted(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = _manager(redis_url)
    with caplog.at_level(logging.WARNING):
        for i, value in enumerate([-1, "600", 1.5, None] * 5):
            ctx = _request(f"r{i}", hma_redis_pin_s=value)
            assert manager.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
    lines = _warnings(caplog)
    assert len(lines) == 1 and "hma_redis_pin_s" in lines[0], lines
    assert _counted(manager, "pin_invalid_requests") == 20
    manager.shutdown()


@pytest.mark.parametrize("asked", [3153600000, MAX_EXPIRE_S + 1, 10**30])
def test_a_pin_longer_than_pin_max_s_is_shortened_to_it_and_counted(
    asked: int, redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.set(_redis_key(HIT), b"v", ex=TTL_S)
    manager = _manager(redis_url, pin_max_s=900)
    ctx = _request("long", hma_redis_pin_s=asked)
    assert manager.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL
    _serve(manager, redis_client, ctx)
    for key in (HIT, STORED):
        assert redis_client.ttl(_redis_key(key)) == -1
        assert _deadline(redis_client, key) == pytest.approx(time.time() + 900, abs=5)
    assert _counted(manager, "pin_clamped_requests") == 1
    manager.shutdown()


def test_chunks_over_the_pin_budget_are_served_unpinned_and_counted_in_a_metric(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    redis_client.set(_redis_key(HIT), b"v" * 100, ex=TTL_S)
    manager = _manager(redis_url, pin_budget_bytes=150)  # one chunk of 100 bytes
    ctx = _request("pinned", hma_redis_pin_s=600)
    manager.on_new_request(ctx)
    with caplog.at_level(logging.WARNING):
        for key in (HIT, STORED):
            manager.lookup(key, ctx)
        manager.on_schedule_end(END_OF_STEP)
        manager.prepare_store([HIT, STORED], ctx)
        manager._pins.flush(5.0)  # HIT is pinned first: the budget is full
        redis_client.set(_redis_key(STORED), b"v" * 100, ex=TTL_S, nx=True)
        manager.complete_store([STORED], ctx)
        manager._pins.flush(5.0)
    assert redis_client.ttl(_redis_key(HIT)) == -1
    assert redis_client.ttl(_redis_key(STORED)) > 0  # over the budget: evictable as any chunk
    assert _counted(manager, "pin_over_budget_chunks") == 1
    stats = manager.get_stats()
    assert stats is not None and stats.reduce()[RedisMetricName.PIN_OVER_BUDGET_CHUNKS] == 1
    assert stats.reduce()[RedisMetricName.PIN_CHUNKS] == 1
    assert any("pin_budget_bytes" in line for line in _warnings(caplog))
    manager.shutdown()


CHUNK_BYTES = 64 * 1024


@pytest.fixture
def small_redis() -> Any:
    """A Redis of 4 MiB that evicts only keys with a TTL: what pinning asks for."""
    server = LocalRedis(
        extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru"]
    ).start()
    yield server
    server.stop()


def test_many_requests_asking_for_huge_pins_never_leave_ordinary_stores_refused(
    small_redis: LocalRedis,
) -> None:
    """100 requests each pin a 64 KiB chunk for 100 years, 1.5 times what Redis holds: the
    budget (1 MiB) pins 16 of them; the others stay evictable, and 100 ordinary stores after
    them are all written."""
    manager = _manager(small_redis.url, pin_budget_bytes=1 << 20)
    store = manager._store
    for i in range(100):
        key = make_offload_key(i.to_bytes(32, "big"), 0)
        ctx = _request(f"abuse{i}", hma_redis_pin_s=3153600000)
        manager.on_new_request(ctx)
        out = manager.prepare_store([key], ctx)
        assert out is not None and out.keys_to_store == [key]
        store.put_if_absent([(_redis_key(key), bytes(CHUNK_BYTES))])  # as the worker writes it
        manager.complete_store([key], ctx)
        manager.on_schedule_end(END_OF_STEP)
        manager._pins.flush(5.0)
    ordinary = [
        (KEYSPACE.block_key(0, (1000 + i).to_bytes(32, "big")), bytes(CHUNK_BYTES))
        for i in range(100)
    ]
    results = [store.put_if_absent([item])[0] for item in ordinary]
    assert results == [PutResult.STORED] * 100, results.count(PutResult.FAILED)
    assert store.counters.snapshot().get("refused_oom", 0) == 0
    with redis.Redis.from_url(small_redis.url) as client:
        assert client.zcard(KEYSPACE.pins_key()) == 16
    assert _counted(manager, "pin_over_budget_chunks") == 84
    manager.shutdown()


def test_an_unreachable_redis_never_blocks_or_fails_a_pinned_request(
    local_redis: LocalRedis,
) -> None:
    manager = _manager(local_redis.url, retry_interval_s=60.0)
    local_redis.pause()  # answers nothing: every call runs into its timeout
    try:
        ctx = _request("pinned", hma_redis_pin_s=600)
        started = time.monotonic()
        manager.on_new_request(ctx)
        for _ in range(3):
            for key in (HIT, STORED, OTHER):
                manager.lookup(key, ctx)
            out = manager.prepare_store([STORED], ctx)
            assert out is not None
            manager.complete_store(out.keys_to_store, ctx)
            manager.on_schedule_end(END_OF_STEP)
        # Only the lookup's bounded wait (lookup_wait_s) per step, never the pin's calls.
        assert time.monotonic() - started < 3 * 1.0 + 0.5
        assert manager._pins.wait(10.0)
        assert manager._pins.pinned == 0
    finally:
        local_redis.resume()
        manager.shutdown()
