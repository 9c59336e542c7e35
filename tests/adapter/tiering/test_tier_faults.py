"""Faults in Redis become misses of the secondary tier, never bytes in vLLM's primary tier."""

from __future__ import annotations

import math
import random
import struct
import time
from collections.abc import Callable

import numpy as np
import pytest
import redis
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, get_offload_block_hash
from vllm.v1.kv_offload.tiering.base import JobResult

from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.tiering import TieringInstance, chunk_keys, payloads


def _cascade(
    inst: TieringInstance, seed: int, count: int = 4
) -> tuple[list[OffloadKey], list[bytes]]:
    keys = chunk_keys(seed, count)
    data = payloads(seed, count, inst.payload_bytes)
    inst.gpu_store(keys, data, inst.context())
    inst.settle()
    return keys, data


def _redis_key(inst: TieringInstance, key: OffloadKey) -> str:
    return inst.tier.keyspace.block_key(0, get_offload_block_hash(key))


def _random_over_half(value: bytes, other: bytes) -> bytes:
    half = len(value) // 2
    return value[:half] + np.random.default_rng(7).bytes(len(value) - half)


def _other_keys_value(value: bytes, other: bytes) -> bytes:
    return other


def _truncated(value: bytes, other: bytes) -> bytes:
    return value[: len(value) - 100]


def _nan_payload(value: bytes, other: bytes) -> bytes:
    """The body past the first 256 bytes (prefix and header) as float32 NaN / Inf words."""
    words = (len(value) - 256) // 4
    specials = random.Random(5).choices([math.nan, math.inf, -math.inf], k=words)
    return value[:256] + struct.pack(f"<{words}f", *specials) + value[256 + 4 * words :]


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize(
    "corrupt", [_random_over_half, _nan_payload, _other_keys_value, _truncated]
)
def test_corrupt_value_is_a_miss_and_its_neighbours_still_load(
    instance: Callable[..., TieringInstance],
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    corrupt: Callable[[bytes, bytes], bytes],
    path: str,
) -> None:
    monkeypatch.setenv("HMA_REDIS_NATIVE", "1" if path == "native" else "0")
    writer, reader = instance(), instance()
    keys, data = _cascade(writer, seed=2)
    bad = _redis_key(writer, keys[1])
    other = redis_client.get(_redis_key(writer, keys[2]))
    value = redis_client.get(bad)
    assert value is not None and other is not None
    redis_client.set(bad, corrupt(value, other))

    ctx = reader.context()
    answers = reader.lookup_until_settled(keys, ctx)
    assert answers == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT, LookupResult.HIT]
    good = [keys[0], keys[2], keys[3]]
    assert reader.gpu_load(good, ctx) == [data[0], data[2], data[3]]
    if corrupt in (_random_over_half, _nan_payload):
        garbage = bytes(reader.rows[:, : reader.payload_bytes].tobytes())
        assert corrupt(value, other)[-1000:] not in garbage  # never left in the primary
    assert redis_client.exists(bad) == 0  # deleted, so the next cascade heals it


def test_promotion_job_names_exactly_the_keys_that_loaded(
    instance: Callable[..., TieringInstance], redis_client: redis.Redis
) -> None:
    writer, reader = instance(), instance()
    keys, _ = _cascade(writer, seed=3)
    reported: list[JobResult] = []
    finished = reader.tier.get_finished_jobs

    def spy() -> list[JobResult]:
        out = list(finished())
        reported.extend(out)
        return out

    reader.tier.get_finished_jobs = spy  # type: ignore[method-assign]
    ctx = reader.context()
    assert [reader.manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 4
    reader.step(0.05)  # the lookup batch: all four are in Redis
    # Between the lookup and the promotion: one value gone, one damaged.
    redis_client.delete(_redis_key(writer, keys[0]))
    redis_client.setrange(_redis_key(writer, keys[3]), 200, b"\xff" * 64)
    answers = reader.lookup_until_settled(keys, ctx)

    assert answers == [LookupResult.MISS, LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    (job,) = reported  # the reader only promotes: one job for the four keys
    assert not job.success
    assert job.successful_keys is not None
    assert set(job.successful_keys) == {keys[1], keys[2]}


def test_redis_down_is_a_miss_and_back_is_a_hit(
    instance: Callable[..., TieringInstance], local_redis: LocalRedis
) -> None:
    options = {"retry_interval_s": 0.2, "read_timeout_s": 0.5, "connect_timeout_s": 0.5}
    writer = instance(local_redis.url, **options)
    reader = instance(local_redis.url, **options)
    keys, _ = _cascade(writer, seed=4, count=2)
    local_redis.kill()
    ctx = reader.context()
    assert reader.lookup_until_settled(keys, ctx) == [LookupResult.MISS] * 2
    _cascade(writer, seed=5, count=2)  # a cascade while Redis is down ends (dropped)

    local_redis.start()
    # The killed server kept nothing; the same two instances carry on by themselves.
    deadline = time.monotonic() + 10
    while True:
        keys, data = _cascade(writer, seed=6 + int(time.monotonic() * 1000) % 1000, count=2)
        ctx = reader.context()
        if reader.lookup_until_settled(keys, ctx) == [LookupResult.HIT] * 2:
            break
        assert time.monotonic() < deadline, "the tier did not resume"
        time.sleep(0.2)
    assert reader.gpu_load(keys, ctx) == data


def test_reset_cache_with_promotions_in_flight_drains_them(
    instance: Callable[..., TieringInstance], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's reset_cache waits for the tier's jobs (drain_jobs) and then requires every one of
    them to have reported: a promotion still running must not be lost or left writing."""
    writer = instance()
    keys, data = _cascade(writer, seed=8)
    monkeypatch.setenv("HMA_REDIS_TEST_LOAD_DELAY_S", "0.3")
    reader = instance()
    ctx = reader.context()
    assert [reader.manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 4
    reader.step(0.05)
    assert [reader.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 4
    reader.step(0)  # submits the promotion, which now sleeps in the engine
    assert reader.tier.has_pending_work()

    reader.manager.reset_cache()  # asserts internally that no job is left

    assert not reader.tier.has_pending_work()
    # vLLM 0.33 holds promotions (every lookup a MISS) until its scheduler connector hears that
    # every worker flushed the reset; 0.32 has no hold. Release it as that connector does.
    on_reset_flushed = getattr(reader.manager, "on_reset_flushed", None)
    if on_reset_flushed is not None:
        ctx = reader.context()
        assert reader.lookup_until_settled(keys, ctx) == [LookupResult.MISS] * 4
        on_reset_flushed()
    ctx = reader.context()
    assert reader.lookup_until_settled(keys, ctx) == [LookupResult.HIT] * 4
    assert reader.gpu_load(keys, ctx) == data


def test_lookups_never_wait_for_a_stalled_redis(
    instance: Callable[..., TieringInstance], local_redis: LocalRedis
) -> None:
    inst = instance(local_redis.url, read_timeout_s=5.0)
    keys = [k for group in range(3) for k in chunk_keys(9 + group, 20, group)]
    local_redis.pause()
    try:
        ctx = inst.context()
        t0 = time.monotonic()
        for _ in range(3):
            assert {inst.manager.lookup(k, ctx) for k in keys} == {LookupResult.RETRY}
            inst.step(0)
        # Generous bound: three steps of 60 lookups each wait at most lookup_wait_s (5 ms) for
        # Redis, never its 5 s read timeout.
        assert time.monotonic() - t0 < 2.0
    finally:
        local_redis.resume()
    assert inst.lookup_until_settled(keys, ctx) == [LookupResult.MISS] * len(keys)
