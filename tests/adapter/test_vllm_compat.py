"""What the adapter does about the differences between vLLM 0.32 and 0.33
(hma_redis/adapter/compat.py); runs on both (CI's second stage runs it on 0.33)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import redis
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

from hma_redis.adapter import compat
from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.spec import RedisOffloadingSpec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.scheduler_harness import SchedulerHarness

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def test_sync_load_budget_is_refused_with_the_reason(
    redis_url: str, redis_client: redis.Redis, model_dir: str
) -> None:
    """vLLM 0.33's sync loads run inside the step of their request and cannot be recomputed
    when they fail: refused at start-up, one line saying why."""
    with pytest.raises(ValueError) as refused:
        SchedulerHarness(redis_url, model_dir, extra_config={"sync_load_budget_bytes": 1 << 20})
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "hma_redis: kv_connector_extra_config sync_load_budget_bytes is not supported"
    )
    assert "recompute" in message


def test_config_info_names_the_namespace_and_hides_the_password(
    redis_url: str, redis_client: redis.Redis, model_dir: str
) -> None:
    """vLLM 0.33 publishes the manager's config_info as vllm:kv_offload_config_info, with the
    label names the spec declares: the labels lead an operator to the namespace in Redis and
    never carry the password."""
    password = "s3cret-Pw-0"
    redis_client.config_set("requirepass", password)
    try:
        authed = redis_url.replace("redis://", f"redis://:{password}@", 1)
        h = SchedulerHarness(authed, model_dir)
        try:
            extra = h.vllm_config.kv_transfer_config.kv_connector_extra_config  # type: ignore[union-attr]
            (info,) = h.manager.config_info()
            assert tuple(info) == RedisOffloadingSpec.config_info_keys(extra)
            assert redis_client.exists(f"{info['key_prefix']}:{info['namespace']}:info") == 1
            assert info["namespace"] == h.keyspace.namespace
            assert all(password not in str(value) for value in info.values())
        finally:
            h.close()
    finally:
        redis_client.config_set("requirepass", "")


def test_reset_flush_forgets_answers_so_flushed_stores_are_found(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """vLLM 0.33 calls on_reset_flushed once the stores a cache reset flushed have landed: a
    MISS learned before must not hide them."""
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    keyspace = KeySpace("hma", "compat", world_size=1)
    manager = RedisOffloadingManager(store, keyspace, lookup_wait_s=1.0, answer_ttl_s=60.0)
    block_hash = b"\x21" * 32
    key = make_offload_key(block_hash, 0)
    ctx = ReqContext(req_id="r1")
    assert manager.lookup(key, ctx) is LookupResult.RETRY
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(key, ctx) is LookupResult.MISS

    redis_client.set(keyspace.block_key(0, block_hash), b"x")  # the flushed store lands
    manager.on_reset_flushed()
    assert manager.lookup(key, ctx) is LookupResult.RETRY  # asked of Redis again
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(key, ctx) is LookupResult.HIT
    manager.shutdown()


def test_sync_loads_are_not_reported_as_requests() -> None:
    """vLLM 0.33 lists a sync load in the connector worker's load jobs with request None; only
    the asynchronous loads have a request whose failure can be reported."""
    connector_worker = SimpleNamespace(_load_jobs={1: "req-a", 2: None, 3: "req-b"})
    assert compat.load_jobs(connector_worker) == {1: "req-a", 3: "req-b"}
