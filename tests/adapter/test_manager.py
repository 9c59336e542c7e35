"""The scheduler-side manager against a real Redis, without an engine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.spec import no_resume_reason
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.scheduler_harness import make_vllm_config, write_tiny_model_config

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def _manager(redis_url: str, world_size: int) -> tuple[RedisOffloadingManager, KeySpace]:
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    keyspace = KeySpace("hma", "mgrtest", world_size=world_size)
    return RedisOffloadingManager(store, keyspace, lookup_wait_s=1.0), keyspace


def _lookup_twice(manager: RedisOffloadingManager, key: bytes) -> LookupResult:
    ctx = ReqContext(req_id="r1")
    assert manager.lookup(key, ctx) is LookupResult.RETRY  # unknown: queued, never blocks
    manager.on_schedule_end(END_OF_STEP)
    return manager.lookup(key, ctx)


def test_chunk_is_a_hit_only_when_every_rank_stored_its_shard(
    redis_url: str, redis_client: redis.Redis
) -> None:
    manager, keyspace = _manager(redis_url, world_size=2)
    block_hash = b"\x11" * 32
    key = make_offload_key(block_hash, 1)
    redis_client.set(keyspace.block_key(1, block_hash, rank=0), b"x")
    assert _lookup_twice(manager, key) is LookupResult.MISS

    manager.reset_cache()
    redis_client.set(keyspace.block_key(1, block_hash, rank=1), b"x")
    assert _lookup_twice(manager, key) is LookupResult.HIT


def test_store_skips_chunks_known_to_be_in_redis(redis_url: str, redis_client: redis.Redis) -> None:
    manager, keyspace = _manager(redis_url, world_size=1)
    present, absent = make_offload_key(b"\x01" * 32, 0), make_offload_key(b"\x02" * 32, 0)
    redis_client.set(keyspace.block_key(0, b"\x01" * 32), b"x")
    _lookup_twice(manager, present)
    _lookup_twice(manager, absent)
    out = manager.prepare_store([present, absent], ReqContext(req_id="r1"))
    assert out is not None and out.keys_to_store == [absent]
    # While this instance stores it, the chunk is "coming" (HIT_PENDING), not a miss.
    assert manager.lookup(absent, ReqContext(req_id="r2")) is LookupResult.HIT_PENDING
    manager.complete_store([absent], ReqContext(req_id="r1"))
    assert manager.lookup(absent, ReqContext(req_id="r2")) is LookupResult.RETRY  # ask Redis


def test_a_store_spec_names_the_chunks_redis_just_answered_missing(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Only chunks whose MISS is fresh are ``known_absent`` (their store skips EXISTS); a
    chunk never looked up, or whose answer has aged out, is asked about again."""
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    manager = RedisOffloadingManager(
        store, KeySpace("hma", "absent"), lookup_wait_s=1.0, answer_ttl_s=0.2
    )
    seen, unseen = make_offload_key(b"\x03" * 32, 0), make_offload_key(b"\x04" * 32, 0)
    assert _lookup_twice(manager, seen) is LookupResult.MISS
    out = manager.prepare_store([seen, unseen], ReqContext(req_id="r1"))
    assert out is not None and out.keys_to_store == [seen, unseen]
    assert out.store_spec.known_absent == {bytes(seen)}  # type: ignore[attr-defined]
    manager.complete_store([seen, unseen], ReqContext(req_id="r1"), success=False)

    assert _lookup_twice(manager, seen) is LookupResult.MISS
    for _ in range(3):  # the answer ages out: more than two steps and answer_ttl_s
        manager.on_schedule_end(END_OF_STEP)
    time.sleep(0.3)
    out = manager.prepare_store([seen], ReqContext(req_id="r2"))
    assert out is not None and out.store_spec.known_absent == frozenset()  # type: ignore[attr-defined]


def test_cached_answers_are_bounded(redis_url: str, redis_client: redis.Redis) -> None:
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    manager = RedisOffloadingManager(
        store, KeySpace("hma", "bound"), max_answers=100, lookup_wait_s=1.0
    )
    ctx = ReqContext(req_id="r")
    for i in range(1000):
        manager.lookup(make_offload_key(i.to_bytes(32, "big"), 0), ctx)
    manager.on_schedule_end(END_OF_STEP)
    manager.lookup(make_offload_key(b"\xff" * 32, 0), ctx)  # absorbs the finished batch
    assert len(manager._answers) == 100


def test_a_store_never_completed_stops_answering_hit_pending(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A chunk being stored answers HIT_PENDING (the request waits for it), but only for
    store_pending_timeout_s: vLLM never completes a store it dropped, and the request must not
    wait for ever. After that the key is asked of Redis again."""
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    manager = RedisOffloadingManager(
        store, KeySpace("hma", "pending"), lookup_wait_s=1.0, store_pending_timeout_s=0.2
    )
    key = make_offload_key(b"\x05" * 32, 0)
    out = manager.prepare_store([key], ReqContext(req_id="writer"))
    assert out is not None and out.keys_to_store == [key]
    reader = ReqContext(req_id="reader")
    assert manager.lookup(key, reader) is LookupResult.HIT_PENDING
    time.sleep(0.3)
    assert manager.lookup(key, reader) is LookupResult.RETRY  # queued for Redis
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(key, reader) is LookupResult.MISS
    assert manager.stats.stale_store_marks == 1
    # The chunk is stored again by whoever computes it next.
    again = manager.prepare_store([key], ReqContext(req_id="writer-2"))
    assert again is not None and again.keys_to_store == [key]


def test_second_load_of_a_request_keeps_the_first_loads_keys(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Both loads of a request are forgotten when its load fails, not only the last one
    (a later prepare_load used to overwrite the earlier keys, which then kept answering HIT)."""
    manager, keyspace = _manager(redis_url, world_size=1)
    first, second = make_offload_key(b"\x21" * 32, 0), make_offload_key(b"\x22" * 32, 1)
    redis_client.set(keyspace.block_key(0, b"\x21" * 32), b"x")
    redis_client.set(keyspace.block_key(1, b"\x22" * 32), b"x")
    assert _lookup_twice(manager, first) is LookupResult.HIT
    assert _lookup_twice(manager, second) is LookupResult.HIT
    ctx = ReqContext(req_id="r1")
    manager.prepare_load([first], ctx)
    manager.prepare_load([second], ctx)

    manager.on_load_failed("r1")

    other = ReqContext(req_id="r2")
    assert manager.lookup(first, other) is LookupResult.MISS
    assert manager.lookup(second, other) is LookupResult.MISS


def test_completing_one_load_keeps_the_requests_other_load(
    redis_url: str, redis_client: redis.Redis
) -> None:
    manager, keyspace = _manager(redis_url, world_size=1)
    first, second = make_offload_key(b"\x31" * 32, 0), make_offload_key(b"\x32" * 32, 0)
    for block_hash in (b"\x31" * 32, b"\x32" * 32):
        redis_client.set(keyspace.block_key(0, block_hash), b"x")
    assert _lookup_twice(manager, first) is LookupResult.HIT
    assert _lookup_twice(manager, second) is LookupResult.HIT
    ctx = ReqContext(req_id="r1")
    manager.prepare_load([first], ctx)
    manager.prepare_load([second], ctx)
    manager.complete_load([first], ctx)

    manager.on_load_failed("r1")  # the second load failed

    other = ReqContext(req_id="r2")
    assert manager.lookup(first, other) is LookupResult.HIT  # loaded fine: still a hit
    assert manager.lookup(second, other) is LookupResult.MISS


def test_an_engine_that_cannot_resume_from_cached_kv_finds_nothing(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """With prefix caching off (vLLM turns it off where its attention cannot start after
    computed tokens: MLA on a CPU without AMX), a chunk in Redis is a miss at once, asked of
    nobody; its stores go on."""
    vllm_config = make_vllm_config(write_tiny_model_config(tmp_path / "m"), redis_url)
    assert no_resume_reason(vllm_config) is None
    vllm_config.cache_config.enable_prefix_caching = False
    assert "without prefix caching" in str(no_resume_reason(vllm_config))

    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    keyspace = KeySpace("hma", "noresume")
    manager = RedisOffloadingManager(store, keyspace, lookup_wait_s=1.0, loads=False)
    block_hash = b"\x21" * 32
    key = make_offload_key(block_hash, 0)
    redis_client.set(keyspace.block_key(0, block_hash), b"x")
    redis_client.config_resetstat()
    assert manager.lookup(key, ReqContext(req_id="r1")) is LookupResult.MISS
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(key, ReqContext(req_id="r1")) is LookupResult.MISS
    calls = redis_client.info("commandstats")
    assert not [name for name in calls if "exists" in name or "evalsha" in name], calls
    other = make_offload_key(b"\x22" * 32, 0)
    out = manager.prepare_store([other], ReqContext(req_id="r1"))
    assert out is not None and out.keys_to_store == [other]


def test_an_mla_engine_on_a_cpu_finds_nothing_even_with_prefix_caching_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU MLA backend (AMX) gives other tokens after cached KV than a recompute, its
    own prefix cache included: no loads there. Elsewhere (a GPU) MLA with prefix caching
    loads."""
    from vllm.platforms import current_platform

    vllm_config = make_vllm_config(write_tiny_model_config(tmp_path / "m"), "redis://h:1/0")
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    assert no_resume_reason(vllm_config) is None  # not MLA
    monkeypatch.setattr(type(vllm_config.model_config), "use_mla", property(lambda self: True))
    assert "CPU MLA backend" in str(no_resume_reason(vllm_config))
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert no_resume_reason(vllm_config) is None
