"""Pins in a real Redis (one server and a 3-master Cluster): pinned chunks lose their TTL and
are listed with their deadline, a later deadline wins, the sweep gives ended pins their TTL
back (and keeps a pin renewed while it runs), only chunk keys of the set's namespace are ever
touched, a namespace's pins stay within their byte budget, and an unreachable Redis never
blocks or raises into the caller."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import pins
from hma_redis.core.redis.pins import PinKeeper
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.cluster import LocalCluster
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.cluster_servers import started_cluster

TTL_S = 3600
KEYSPACE = KeySpace("hma", "pintest")
PINS = KEYSPACE.pins_key()


def _store(url: str, **extra: Any) -> RedisBlockStore:
    cfg = {"redis_url": url, "ttl_s": TTL_S, "read_timeout_s": 0.5, "connect_timeout_s": 0.5}
    return RedisBlockStore(RedisTierConfig.from_extra_config({**cfg, **extra}, env={}))


def _chunks(client: Any, n: int, start: int = 0) -> list[str]:
    """``n`` chunk keys stored as the tier stores them (with ``ttl_s``)."""
    keys = [KEYSPACE.block_key(0, i.to_bytes(32, "big")) for i in range(start, start + n)]
    for key in keys:
        client.set(key, b"v", ex=TTL_S)
    return keys


def _deadline(client: Any, key: str) -> float | None:
    score = client.zscore(PINS, key)
    return None if score is None else float(score)


def test_pinned_chunks_are_persistent_and_listed_with_their_deadline(
    redis_url: str, redis_client: redis.Redis
) -> None:
    pinned, other = _chunks(redis_client, 3), _chunks(redis_client, 1, start=10)
    deadline = time.time() + 600
    assert _store(redis_url).pin(PINS, dict.fromkeys(pinned, deadline))
    for key in pinned:
        assert redis_client.ttl(key) == -1  # no TTL: volatile-* never evicts it
        assert _deadline(redis_client, key) == pytest.approx(deadline, abs=0.01)
    assert 0 < redis_client.ttl(other[0]) <= TTL_S  # the others keep ttl_s
    assert [k for k, _ in pins.list_pins(redis_client, PINS)] == sorted(pinned)


def test_a_later_deadline_extends_a_pin_and_an_earlier_one_does_not_shorten_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    (key,) = _chunks(redis_client, 1)
    store, now = _store(redis_url), time.time()
    store.pin(PINS, {key: now + 100})
    store.pin(PINS, {key: now + 500})
    assert _deadline(redis_client, key) == pytest.approx(now + 500, abs=0.01)
    store.pin(PINS, {key: now + 50})
    assert _deadline(redis_client, key) == pytest.approx(now + 500, abs=0.01)


def test_the_sweep_gives_ended_pins_their_ttl_back_and_keeps_the_others(
    redis_url: str, redis_client: redis.Redis
) -> None:
    ended, lasting = _chunks(redis_client, 3), _chunks(redis_client, 2, start=10)
    store, now = _store(redis_url), time.time()
    store.pin(PINS, dict.fromkeys(ended, now - 1))
    store.pin(PINS, dict.fromkeys(lasting, now + 600))
    result = store.sweep_pins(PINS, TTL_S)
    assert result == pins.SweepResult(expired=3, renewed=0)
    for key in ended:
        assert 0 < redis_client.ttl(key) <= TTL_S
        assert _deadline(redis_client, key) is None
    for key in lasting:
        assert redis_client.ttl(key) == -1
        assert _deadline(redis_client, key) is not None


def test_the_sweep_runs_in_rounds_over_many_pins(redis_url: str, redis_client: redis.Redis) -> None:
    keys = _chunks(redis_client, pins.SWEEP_BATCH + 5)
    store = _store(redis_url)
    store.pin(PINS, dict.fromkeys(keys, time.time() - 1))
    assert store.sweep_pins(PINS, TTL_S) == pins.SweepResult(len(keys), 0)
    assert redis_client.zcard(PINS) == 0
    assert all(t > 0 for t in redis_client.pipeline().ttl(keys[0]).ttl(keys[-1]).execute())


class _RenewBeforeRemoving:
    """The real client, but a pin renewal (by another instance, on its own connection) lands
    after the sweep read and expired its members and before it removes them."""

    def __init__(self, client: redis.Redis, renew: dict[str, float]) -> None:
        self._client, self._renew = client, renew

    def eval(self, *args: Any) -> Any:
        pins.pin(redis.Redis(connection_pool=self._client.connection_pool), PINS, self._renew)
        return self._client.eval(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_pin_renewed_while_the_sweep_runs_stays(redis_client: redis.Redis) -> None:
    renewed, ended = _chunks(redis_client, 1), _chunks(redis_client, 1, start=10)
    now = time.time()
    pins.pin(redis_client, PINS, dict.fromkeys(renewed + ended, now - 1))
    later = now + 600
    racing = _RenewBeforeRemoving(redis_client, dict.fromkeys(renewed, later))
    assert pins.sweep(racing, PINS, TTL_S) == pins.SweepResult(expired=1, renewed=1)
    assert redis_client.ttl(renewed[0]) == -1
    assert _deadline(redis_client, renewed[0]) == pytest.approx(later, abs=0.01)
    assert 0 < redis_client.ttl(ended[0]) <= TTL_S
    assert _deadline(redis_client, ended[0]) is None


def test_unpinning_every_pin_ends_those_not_due_too(redis_client: redis.Redis) -> None:
    keys = _chunks(redis_client, 2)
    pins.pin(redis_client, PINS, dict.fromkeys(keys, time.time() + 600))
    assert pins.sweep(redis_client, PINS, TTL_S, now=pins.EVERY_PIN).expired == 2
    assert all(redis_client.ttl(k) > 0 for k in keys)


def test_the_keeper_pins_and_sweeps_off_the_callers_thread(
    redis_url: str, redis_client: redis.Redis
) -> None:
    ended, fresh = _chunks(redis_client, 1), _chunks(redis_client, 1, start=10)
    store = _store(redis_url)
    store.pin(PINS, dict.fromkeys(ended, time.time() - 1))
    keeper = PinKeeper(
        lambda d: store.pin(PINS, d), lambda: store.sweep_pins(PINS, TTL_S), sweep_interval_s=3600
    )
    keeper.add(fresh, time.time() + 600)
    keeper.tick()
    assert keeper.wait(5.0)
    assert redis_client.ttl(fresh[0]) == -1 and keeper.pinned == 1
    assert redis_client.ttl(ended[0]) > 0  # the first tick sweeps
    keeper.close()


def test_an_unreachable_redis_never_blocks_or_raises_into_the_caller(
    local_redis: LocalRedis,
) -> None:
    # A 2 s read timeout: a caller that waited on Redis would take that long; the bounds below
    # leave a busy host half of it.
    store = _store(local_redis.url, retry_interval_s=60.0, read_timeout_s=2.0)
    keeper = PinKeeper(lambda d: store.pin(PINS, d), lambda: store.sweep_pins(PINS, TTL_S))
    local_redis.pause()  # a Redis that answers nothing: every call runs into its timeout
    try:
        started = time.monotonic()
        keeper.add(["hma:pintest:g0:00"], time.time() + 600)
        keeper.tick()
        assert time.monotonic() - started < 1.0  # the caller never waits for Redis
        assert keeper.wait(10.0)
        assert keeper.dropped == 1 and keeper.pinned == 0
        # The breaker is open now: the next pins fail at once, without a round trip.
        started = time.monotonic()
        assert store.pin(PINS, {"hma:pintest:g0:01": time.time()}) is None
        assert store.sweep_pins(PINS, TTL_S) is None
        assert time.monotonic() - started < 1.0
    finally:
        local_redis.resume()
        keeper.close()


# A key of another namespace, the namespace's own info hash, an application's key: what a pins
# set may hold that the tier never wrote there.
FOREIGN_CHUNK = KeySpace("hma", "another").block_key(0, b"\x07" * 32)
APP_KEY = "app:session:42"


def _foreign_members(client: Any) -> list[bytes]:
    """Keys a pins set must never touch, each set without a TTL (and the info hash)."""
    client.set(FOREIGN_CHUNK, b"theirs")
    client.set(APP_KEY, b"session")
    client.hset(KEYSPACE.info_key(), "model", "m")
    return [FOREIGN_CHUNK.encode(), APP_KEY.encode(), KEYSPACE.info_key().encode()]


def test_the_sweep_touches_only_chunks_of_its_namespace_and_unlists_every_other_member(
    redis_url: str, redis_client: redis.Redis
) -> None:
    (chunk,) = _chunks(redis_client, 1)
    foreign = _foreign_members(redis_client)
    redis_client.set(APP_KEY, b"session", ex=500)  # one with a TTL: PERSIST must not take it
    store = _store(redis_url)
    store.pin(PINS, {chunk: time.time() - 1})
    redis_client.zadd(PINS, dict.fromkeys(foreign, time.time() - 1))
    result = store.sweep_pins(PINS, 60)
    assert 0 < redis_client.ttl(chunk) <= 60
    assert redis_client.ttl(FOREIGN_CHUNK) == -1
    assert redis_client.ttl(KEYSPACE.info_key()) == -1
    assert 500 - 5 < redis_client.ttl(APP_KEY) <= 500
    assert redis_client.zcard(PINS) == 0
    assert result == pins.SweepResult(expired=1, renewed=0, dropped=3)


def test_unpinning_every_pin_never_touches_another_namespaces_or_an_applications_key(
    redis_client: redis.Redis,
) -> None:
    (chunk,) = _chunks(redis_client, 1)
    foreign = _foreign_members(redis_client)
    pins.pin(redis_client, PINS, {chunk: time.time() + 600})
    redis_client.zadd(PINS, dict.fromkeys(foreign, time.time() + 600))
    result = pins.sweep(redis_client, PINS, 60, now=pins.EVERY_PIN)
    assert [redis_client.ttl(k) for k in (FOREIGN_CHUNK, APP_KEY, KEYSPACE.info_key())] == [-1] * 3
    assert 0 < redis_client.ttl(chunk) <= 60
    assert result == pins.SweepResult(expired=1, renewed=0, dropped=3)


def test_a_pin_never_makes_a_key_persistent_that_is_not_a_chunk_of_its_namespace(
    redis_client: redis.Redis,
) -> None:
    redis_client.set(APP_KEY, b"session", ex=500)
    redis_client.set(FOREIGN_CHUNK, b"theirs", ex=500)
    result = pins.pin(redis_client, PINS, dict.fromkeys([APP_KEY, FOREIGN_CHUNK], time.time() + 60))
    assert redis_client.ttl(APP_KEY) > 0 and redis_client.ttl(FOREIGN_CHUNK) > 0
    assert redis_client.zcard(PINS) == 0
    assert result == pins.PinResult(pinned=0, over_budget=0, missing=2)


def test_a_member_that_is_not_text_is_unlisted_and_the_sweep_and_the_listing_go_on(
    redis_url: str, redis_client: redis.Redis
) -> None:
    ended, lasting = _chunks(redis_client, 1), _chunks(redis_client, 1, start=10)
    store = _store(redis_url)
    store.pin(PINS, {ended[0]: time.time() - 1, lasting[0]: time.time() + 600})
    redis_client.zadd(PINS, {b"\xff\xfe": time.time() - 1, b"\xc3(": time.time() + 600})
    assert [k for k, _ in pins.list_pins(redis_client, PINS)] == ended + lasting
    result = store.sweep_pins(PINS, 60)
    assert 0 < redis_client.ttl(ended[0]) <= 60
    assert redis_client.ttl(lasting[0]) == -1
    assert result == pins.SweepResult(expired=1, renewed=0, dropped=1)


def test_a_keeper_job_that_raises_is_logged_not_lost(caplog: pytest.LogCaptureFixture) -> None:
    def failing_sweep() -> pins.SweepResult | None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    keeper = PinKeeper(lambda d: pins.PinResult(len(d)), failing_sweep, sweep_interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="hma_redis.core.redis.pins"):
        for _ in range(3):
            keeper.tick()
            assert keeper.wait(5.0)
        keeper.tick()
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "sweep job failed" in lines[0].getMessage(), lines
    assert lines[0].exc_info is not None and lines[0].exc_info[0] is UnicodeDecodeError
    keeper.close()


def test_pins_beyond_the_byte_budget_are_left_unpinned_and_renewals_still_pass(
    redis_client: redis.Redis,
) -> None:
    keys = _chunks(redis_client, 5)  # one byte each: a budget of 3 bytes holds 3 of them
    deadline = time.time() + 600
    pins.pin(redis_client, PINS, dict.fromkeys(keys[:2], deadline), 3)
    over = pins.pin(redis_client, PINS, dict.fromkeys(keys[2:], deadline), 3)
    assert [redis_client.ttl(k) == -1 for k in keys] == [True, True, True, False, False]
    assert over == pins.PinResult(pinned=1, over_budget=2, missing=0)
    later = deadline + 600  # a renewal takes no more of the budget
    assert pins.pin(redis_client, PINS, dict.fromkeys(keys[:3], later), 3) == pins.PinResult(3)
    assert _deadline(redis_client, keys[0]) == pytest.approx(later, abs=0.01)
    assert redis_client.zcard(PINS) == 3


def test_the_budget_counts_each_pin_as_the_largest_chunk_of_its_batch(
    redis_client: redis.Redis,
) -> None:
    small = KEYSPACE.block_key(0, b"\x01" * 32)
    large = KEYSPACE.block_key(1, b"\x01" * 32)
    redis_client.set(small, b"x" * 100, ex=TTL_S)
    redis_client.set(large, b"x" * 1000, ex=TTL_S)
    result = pins.pin(redis_client, PINS, {small: time.time() + 60, large: time.time() + 60}, 1999)
    assert result == pins.PinResult(pinned=1, over_budget=1, missing=0)


# --------------------------------------------------------------------------------- Cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    server = started_cluster("tier", "pin-s3cret")
    yield server
    server.stop()


def test_pins_and_the_sweep_work_on_a_cluster(cluster: LocalCluster) -> None:
    cluster.flushall()
    store = _store(cluster.url)
    client = store.client
    keys = _chunks(client, 30)  # spread over every master's slots
    owners = cluster.slot_owners()
    assert len({owners[redis.cluster.key_slot(k.encode())] for k in keys}) == 3
    now = time.time()
    assert store.pin(PINS, dict.fromkeys(keys[:20], now - 1))
    assert store.pin(PINS, dict.fromkeys(keys[20:], now + 600))
    assert all(client.ttl(k) == -1 for k in keys)
    assert store.sweep_pins(PINS, TTL_S) == pins.SweepResult(expired=20, renewed=0)
    assert all(0 < client.ttl(k) <= TTL_S for k in keys[:20])
    assert all(client.ttl(k) == -1 for k in keys[20:])
    assert sorted(k for k, _ in pins.list_pins(client, PINS)) == sorted(keys[20:])
    store.close()
