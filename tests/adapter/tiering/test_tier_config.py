"""The Redis secondary tier's options, namespace, lookup batching, admission and events."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import redis
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, get_offload_block_hash

from hma_redis.adapter.namespace import Mode
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.scheduler_harness import (
    make_vllm_config,
    three_group_kv_cache_config,
    worker_spec,
)
from tests.support.tiering import TieringInstance, chunk_keys, payloads


def test_lookups_of_every_group_in_a_step_take_one_round_trip(
    instance: Callable[..., TieringInstance],
) -> None:
    inst = instance()
    keys = [k for group in range(3) for k in chunk_keys(10 + group, 8, group)]
    ctx = inst.context()
    assert all(inst.manager.lookup(k, ctx) is LookupResult.RETRY for k in keys)
    inst.step()
    assert inst.tier.lookup_round_trips == 1
    assert inst.lookup_until_settled(keys, ctx) == [LookupResult.MISS] * len(keys)
    assert inst.tier.lookup_round_trips == 1
    # hma_redis' Prometheus counters reach vLLM through the tiering manager's stats.
    stats = inst.manager.get_stats()
    assert stats is not None
    assert stats.data["data"]["vllm:kv_offload_redis_lookups"] == {(): 1}


def test_tier_namespace_differs_from_the_direct_specs(
    instance: Callable[..., TieringInstance], model_dir: str, redis_url: str
) -> None:
    tier = instance().tier
    vllm_config = make_vllm_config(model_dir, redis_url)
    vllm_config.kv_transfer_config.engine_id = "direct"
    direct = worker_spec(vllm_config, three_group_kv_cache_config(16, 1000, 3))
    assert tier.keyspace.namespace != direct.keyspace.namespace
    assert "tiering(" in tier.fingerprint.info_fields()["kv_cache_layout"]

    named = instance(namespace="shared").tier
    fingerprint_id = named.fingerprint.namespace_id()
    assert named.keyspace.namespace == f"shared.{fingerprint_id}{Mode.TIERING.value}"
    assert tier.keyspace.namespace == f"{tier.fingerprint.namespace_id()}.tiering"


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("no_such_option", 1),
        ("idle_wait_ms", 1.0),
        ("blocks_per_chunk", 2),
        ("ttl_s", -1),
        ("pinning", True),
        ("pin_budget_bytes", 1 << 20),
        ("tenant_quotas", True),
        ("tenant_budget_bytes", 1 << 20),
    ],
)
def test_bad_tier_option_fails_at_start_up_naming_it(
    instance: Callable[..., TieringInstance], option: str, value: object
) -> None:
    with pytest.raises(ValueError, match=option):
        instance(**{option: value})


def test_a_pin_asked_of_the_tier_is_served_unpinned_counted_and_said_once(
    instance: Callable[..., TieringInstance],
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    inst = instance()
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            ctx = ReqContext(req_id=f"pin-{i}", kv_transfer_params={"hma_redis_pin_s": 600})
            inst.manager.on_new_request(ctx)
    lines = [r.getMessage() for r in caplog.records if "hma_redis_pin_s" in r.getMessage()]
    assert len(lines) == 1 and "served unpinned" in lines[0], lines
    assert inst.tier._store.counters.snapshot().get("pin_off_requests") == 3
    assert not list(redis_client.scan_iter("hma:*:pins"))


def test_password_from_the_environment_reaches_redis_and_no_log_line(
    instance: Callable[..., TieringInstance],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    local_redis: LocalRedis,
) -> None:
    secret = "tier-s3cret-pw"
    redis.Redis(port=local_redis.port).config_set("requirepass", secret)
    monkeypatch.setenv("HMA_REDIS_PASSWORD", secret)
    with caplog.at_level(logging.DEBUG):
        writer, reader = instance(local_redis.url), instance(local_redis.url)
        keys = chunk_keys(20, 2)
        data = payloads(20, 2, writer.payload_bytes)
        writer.gpu_store(keys, data, writer.context())
        writer.settle()
        ctx = reader.context()
        assert reader.lookup_until_settled(keys, ctx) == [LookupResult.HIT] * 2
    assert reader.gpu_load(keys, ctx) == data
    assert secret not in caplog.text
    assert secret not in repr(reader.tier.config)


def test_instances_with_an_auth_key_share_and_other_keys_do_not(
    instance: Callable[..., TieringInstance], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HMA_REDIS_AUTH_KEY", "k" * 32)
    writer, reader = instance(), instance()
    keys = chunk_keys(30, 3)
    data = payloads(30, 3, writer.payload_bytes)
    writer.gpu_store(keys, data, writer.context())
    writer.settle()
    ctx = reader.context()
    assert reader.lookup_until_settled(keys, ctx) == [LookupResult.HIT] * 3
    assert reader.gpu_load(keys, ctx) == data

    monkeypatch.setenv("HMA_REDIS_AUTH_KEY", "o" * 32)
    stranger = instance()
    assert stranger.tier.keyspace.namespace != reader.tier.keyspace.namespace
    ctx = stranger.context()
    assert stranger.lookup_until_settled(keys, ctx) == [LookupResult.MISS] * 3


def test_second_sighting_cascades_a_chunk_only_once_another_instance_saw_it(
    instance: Callable[..., TieringInstance], redis_client: redis.Redis
) -> None:
    first, second = instance(admission="second_sighting"), instance(admission="second_sighting")
    keys = chunk_keys(40, 2)
    data = payloads(40, 2, first.payload_bytes)
    pattern = first.tier.keyspace.block_pattern()
    first.gpu_store(keys, data, first.context())
    first.settle()
    assert list(redis_client.scan_iter(pattern)) == []  # never looked up: not admitted

    ctx = second.context()
    assert second.lookup_until_settled(keys, ctx) == [LookupResult.MISS] * 2  # 1st sighting
    third = instance(admission="second_sighting")
    ctx = third.context()
    assert third.lookup_until_settled(keys, ctx) == [LookupResult.MISS] * 2  # 2nd sighting
    third.gpu_store(keys, data, ctx)
    third.settle()
    assert len(list(redis_client.scan_iter(pattern))) == 2


def test_chunks_deleted_from_redis_become_removal_events(
    instance: Callable[..., TieringInstance], redis_client: redis.Redis
) -> None:
    inst = instance(kv_events=True)
    try:
        keys = chunk_keys(50, 2)
        inst.gpu_store(keys, payloads(50, 2, inst.payload_bytes), inst.context())
        inst.settle()
        list(inst.manager.take_events())
        redis_client.delete(inst.tier.keyspace.block_key(0, get_offload_block_hash(keys[0])))
        deadline = time.monotonic() + 10
        removed: set[bytes] = set()
        while keys[0] not in removed:
            assert time.monotonic() < deadline, removed
            for event in inst.manager.take_events():
                if event.removed and event.medium is Medium.STORAGE:
                    removed |= {bytes(k) for k in event.keys}
            time.sleep(0.02)
    finally:
        redis_client.config_set("notify-keyspace-events", "")  # the session server's default


def test_shutdown_lets_vllm_unmap_the_primary_buffer(
    instance: Callable[..., TieringInstance], caplog: pytest.LogCaptureFixture
) -> None:
    inst = instance()
    keys = chunk_keys(60, 2)
    inst.gpu_store(keys, payloads(60, 2, inst.payload_bytes), inst.context())
    with caplog.at_level(logging.WARNING):
        inst.close()  # the cascade may still run: shutdown waits for it, then lets go
    assert "Failed to close mmap_obj" not in caplog.text
