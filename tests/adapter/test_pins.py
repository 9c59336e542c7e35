"""A request's pin, through the scheduler-side manager as vLLM drives it (ReqContext with
``kv_transfer_params``), against a real Redis: the chunks it hit and the chunks it stored stay
persistent and listed until the deadline; hostile values and a tier without ttl_s are refused
with one WARNING and served unpinned; an unreachable Redis never blocks or raises."""

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
from hma_redis.core.config import MAX_EXPIRE_S, RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
TTL_S = 3600
KEYSPACE = KeySpace("hma", "pinmgr")
HIT, STORED, OTHER = (make_offload_key(bytes([i]) * 32, 0) for i in (1, 2, 3))


def _manager(url: str, **extra: Any) -> RedisOffloadingManager:
    cfg = {"redis_url": url, "ttl_s": TTL_S, "read_timeout_s": 0.5, "connect_timeout_s": 0.5}
    store = RedisBlockStore(RedisTierConfig.from_extra_config({**cfg, **extra}, env={}))
    return RedisOffloadingManager(store, KEYSPACE, lookup_wait_s=1.0)


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
    "value",
    [-5, 0, MAX_EXPIRE_S + 1, 10**30, 1.5, "600", True, None, [600], {"s": 1}, "x" * 10_000],
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


def test_a_pin_without_ttl_s_is_refused_with_one_warning_for_all_requests(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    manager = RedisOffloadingManager(store, KEYSPACE, lookup_wait_s=1.0)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            ctx = _request(f"r{i}", hma_redis_pin_s=600)
            assert manager.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "ttl_s" in lines[0] and "volatile-lru" in lines[0], lines
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
