"""Removal events, the intersection's cost and second-sighting admission, at the manager,
against a real Redis (issue 14, parts 1-3)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)

from hma_redis.adapter.manager import MAX_REMOVALS_PER_STEP, RedisOffloadingManager
from hma_redis.adapter.metrics import RedisMetricName
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.client import make_client
from hma_redis.core.redis.notifications import (
    NotificationState,
    RemovalWatcher,
    ensure_flags,
    missing_flags,
)
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.cluster import LocalCluster
from tests.support.cluster_servers import started_cluster
from tests.support.redis_server import LocalRedis, command_calls, command_delta

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
CHUNK_TOKENS = 16


def _store(url: str, **extra: object) -> RedisBlockStore:
    cfg = RedisTierConfig.from_extra_config({"redis_url": url, **extra}, env={})
    return RedisBlockStore(cfg, stats_key=KeySpace("hma", "beyond").stats_key())


@pytest.fixture
def watched(redis_url: str, redis_client: redis.Redis) -> Iterator[RedisOffloadingManager]:
    """A two-group manager with vLLM's KV events on and a watcher of its namespace."""
    keyspace = KeySpace("hma", "beyond")
    store = _store(redis_url)
    watcher = RemovalWatcher(store.cfg, keyspace.block_pattern()).start()
    assert watcher.wait_subscribed(10.0)
    assert watcher.state is NotificationState.ON
    manager = RedisOffloadingManager(
        store,
        keyspace,
        lookup_wait_s=1.0,
        emit_events=True,
        removals=watcher,
        group_chunk_tokens=(CHUNK_TOKENS, CHUNK_TOKENS),
    )
    yield manager
    manager.shutdown()
    redis_client.config_set("notify-keyspace-events", "")  # the session server's default


def _ask(manager: RedisOffloadingManager, keys: list[OffloadKey], req: str) -> list[LookupResult]:
    """Look ``keys`` up twice around one step (the first answer is RETRY)."""
    ctx = ReqContext(req_id=req)
    for key in keys:
        manager.lookup(key, ctx)
    manager.on_schedule_end(END_OF_STEP)
    return [manager.lookup(key, ctx) for key in keys]


def _removals_until(
    manager: RedisOffloadingManager, expected: set[OffloadKey], timeout_s: float = 10.0
) -> set[OffloadKey]:
    seen: set[OffloadKey] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not expected <= seen:
        for event in manager.take_events():
            assert isinstance(event, OffloadingEvent)
            if event.removed:
                assert event.medium is Medium.STORAGE
                seen.update(event.keys)
        time.sleep(0.02)
    return seen


def test_expired_and_deleted_chunks_become_removal_events_for_every_group(
    watched: RedisOffloadingManager, redis_client: redis.Redis
) -> None:
    """A value that expires (TTL) or is deleted is announced as removed in BOTH groups of its
    chunk (a chunk one group lost is no usable hit), and its cached HIT is forgotten."""
    keyspace = KeySpace("hma", "beyond")
    expiring, deleted = b"\x31" * 32, b"\x32" * 32
    for block_hash in (expiring, deleted):
        for group in (0, 1):
            redis_client.set(keyspace.block_key(group, block_hash), b"v")
    keys = [make_offload_key(h, g) for h in (expiring, deleted) for g in (0, 1)]
    assert _ask(watched, keys, "r1") == [LookupResult.HIT] * 4

    redis_client.pexpire(keyspace.block_key(1, expiring), 50)  # only group 1's value goes
    redis_client.unlink(keyspace.block_key(0, deleted))

    removed = _removals_until(watched, set(keys))
    assert removed == set(keys)
    assert watched.detail_stats.removed_chunks == 4
    # The cached answers are gone: the next lookup asks Redis again.
    assert watched.lookup(make_offload_key(expiring, 0), ReqContext(req_id="r2")) is (
        LookupResult.RETRY
    )


def test_evicted_chunks_become_removal_events(local_redis: LocalRedis) -> None:
    """maxmemory eviction: every evicted block key reaches the manager as a removal."""
    client = redis.Redis.from_url(local_redis.url)
    client.config_set("maxmemory-policy", "allkeys-lru")
    keyspace = KeySpace("hma", "beyond")
    store = _store(local_redis.url)
    watcher = RemovalWatcher(store.cfg, keyspace.block_pattern()).start()
    assert watcher.wait_subscribed(10.0)
    manager = RedisOffloadingManager(
        store, keyspace, emit_events=True, removals=watcher, group_chunk_tokens=(16,)
    )
    try:
        value = b"x" * 100_000
        for i in range(40):
            client.set(keyspace.block_key(0, i.to_bytes(32, "big")), value)
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used - 1_000_000)  # ~10 values must go
        client.set(keyspace.block_key(0, b"\xee" * 32), value)  # a write triggers eviction
        evicted = int(client.info("stats")["evicted_keys"])
        assert evicted >= 5
        expected = {
            make_offload_key(i.to_bytes(32, "big"), 0)
            for i in range(40)
            if not client.exists(keyspace.block_key(0, i.to_bytes(32, "big")))
        }
        assert len(expected) >= 5
        assert expected <= _removals_until(manager, expected)
    finally:
        manager.shutdown()
        client.close()


def test_enabling_notifications_keeps_the_flags_already_set(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Other subscribers' flags survive: the watcher adds its own, never replaces them."""
    redis_client.config_set("notify-keyspace-events", "El")
    outcome = ensure_flags(redis_client)
    after = redis_client.config_get("notify-keyspace-events")["notify-keyspace-events"]
    assert outcome.enabled and not missing_flags(after)
    assert "E" in after and "l" in after
    redis_client.config_set("notify-keyspace-events", "")  # the session server's default


def test_watcher_says_when_notifications_cannot_be_enabled(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Without CONFIG SET (here: not allowed) and with the flags off, the state says so."""
    redis_client.config_set("notify-keyspace-events", "")
    cfg = RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={})
    watcher = RemovalWatcher(cfg, "hma:x:g*:*", allow_config_set=False).start()
    try:
        assert watcher.wait_subscribed(10.0)
        assert watcher.state is NotificationState.NOT_ENABLED
        assert "Kgxe" in watcher.detail
    finally:
        watcher.close()


def test_full_removal_queue_forgets_every_cached_answer(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Removals beyond the bound are dropped, and the manager then trusts none of its answers."""
    keyspace = KeySpace("hma", "bounded")
    store = _store(redis_url)
    watcher = RemovalWatcher(store.cfg, keyspace.block_pattern(), max_pending=3).start()
    assert watcher.wait_subscribed(10.0)
    manager = RedisOffloadingManager(
        store, keyspace, lookup_wait_s=1.0, removals=watcher, group_chunk_tokens=(16,)
    )
    try:
        kept = b"\x41" * 32
        redis_client.set(keyspace.block_key(0, kept), b"v")
        assert _ask(manager, [make_offload_key(kept, 0)], "r") == [LookupResult.HIT]
        for i in range(10):
            redis_client.set(keyspace.block_key(0, i.to_bytes(32, "big")), b"v")
            redis_client.unlink(keyspace.block_key(0, i.to_bytes(32, "big")))
        deadline = time.monotonic() + 10
        while watcher.received < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watcher.dropped == 7
        manager.on_schedule_end(END_OF_STEP)
        assert manager.detail_stats.removal_overflows == 1
        assert manager.lookup(make_offload_key(kept, 0), ReqContext(req_id="r")) is (
            LookupResult.RETRY
        )
    finally:
        manager.shutdown()
        redis_client.config_set("notify-keyspace-events", "")  # the session server's default


# ---------------------------------------------------------------------------- intersection


def _positioned(ctx: ReqContext, block_hash: bytes, group: int, chunk: int) -> OffloadKey:
    key = make_offload_key(block_hash, group)
    ctx.set_offload_key_position(key, (chunk + 1) * CHUNK_TOKENS)
    return key


def test_hits_the_intersection_throws_away_are_counted_per_group(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Group 0 holds 4 chunks of a prompt, group 1 only the first 2: per group the hit
    chunks are 4 and 2, the usable ones 2 and 2, in the metrics and in the stats hash."""
    keyspace = KeySpace("hma", "beyond")
    store = _store(redis_url)
    manager = RedisOffloadingManager(
        store, keyspace, lookup_wait_s=1.0, group_chunk_tokens=(CHUNK_TOKENS, CHUNK_TOKENS)
    )
    hashes = [bytes([0x50 + i]) * 32 for i in range(5)]
    for i, block_hash in enumerate(hashes[:4]):
        redis_client.set(keyspace.block_key(0, block_hash), b"v")
        if i < 2:
            redis_client.set(keyspace.block_key(1, block_hash), b"v")
    ctx = ReqContext(req_id="req")
    keys = [_positioned(ctx, h, g, i) for g in (0, 1) for i, h in enumerate(hashes)]
    for key in keys:
        manager.lookup(key, ctx)
    manager.on_schedule_end(END_OF_STEP)
    answers = [manager.lookup(key, ctx) for key in keys]
    assert answers.count(LookupResult.HIT) == 6
    manager.on_request_finished(ctx)

    assert manager.detail_stats.group_hit_chunks == {0: 4, 1: 2}
    assert manager.detail_stats.group_usable_chunks == {0: 2, 1: 2}
    stats = manager.get_stats()
    assert stats is not None
    reduced = stats.reduce()
    hit, usable = RedisMetricName.GROUP_HIT_CHUNKS, RedisMetricName.USABLE_HIT_CHUNKS
    assert reduced[f"{hit}:('g0',)"] == 4 and reduced[f"{hit}:('g1',)"] == 2
    assert reduced[f"{usable}:('g0',)"] == 2 and reduced[f"{usable}:('g1',)"] == 2
    store.flush()
    counters = redis_client.hgetall(keyspace.stats_key())
    assert counters[b"g0_hit_chunks"] == b"4" and counters[b"g0_usable_chunks"] == b"2"
    assert counters[b"g1_hit_chunks"] == b"2" and counters[b"g1_usable_chunks"] == b"2"


# ---------------------------------------------------------------------------- admission


def _admission_manager(url: str) -> RedisOffloadingManager:
    return RedisOffloadingManager(
        _store(url, admission="second_sighting"),
        KeySpace("hma", "beyond"),
        lookup_wait_s=1.0,
        admission="second_sighting",
        admission_window_s=60,
    )


def test_second_sighting_stores_a_chunk_only_once_another_instance_saw_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Instance A sees a chunk first: not stored. Instance B sees it again: stored. The
    markers ride in the lookup's one EVAL (no extra command)."""
    first, second = _admission_manager(redis_url), _admission_manager(redis_url)
    key = make_offload_key(b"\x61" * 32, 0)
    before = command_calls(redis_client)
    assert _ask(first, [key], "a") == [LookupResult.MISS]
    delta = command_delta(before, command_calls(redis_client))
    delta.pop("hello", None)  # the new store's connection
    # One EVAL; Redis counts the EXISTS and SET NX run inside it as well.
    assert delta == {"eval": 1, "exists": 1, "set": 1}
    out = first.prepare_store([key], ReqContext(req_id="a"))
    assert out is not None and out.keys_to_store == []
    assert first.detail_stats.admission_deferred == 1

    assert _ask(second, [key], "b") == [LookupResult.MISS]
    out = second.prepare_store([key], ReqContext(req_id="b"))
    assert out is not None and out.keys_to_store == [key]
    marker = KeySpace("hma", "beyond").sighting_key(0, b"\x61" * 32)
    assert 0 < redis_client.ttl(marker) <= 60
    for manager in (first, second):
        manager.shutdown()  # delivers the counters
    counters = redis_client.hgetall(KeySpace("hma", "beyond").stats_key())
    assert counters[b"admission_deferred"] == b"1" and counters[b"admission_admitted"] == b"1"


def test_second_request_on_the_same_instance_is_a_second_sighting(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The second request for a chunk finds the first one's cached MISS (no wait), and the
    next step's batch marks its sighting: the chunk is then admitted."""
    manager = _admission_manager(redis_url)
    key = make_offload_key(b"\x63" * 32, 0)
    assert _ask(manager, [key], "first") == [LookupResult.MISS]
    out = manager.prepare_store([key], ReqContext(req_id="first"))
    assert out is not None and out.keys_to_store == []

    assert manager.lookup(key, ReqContext(req_id="second")) is LookupResult.MISS  # cached
    manager.on_schedule_end(END_OF_STEP)  # the batch carries the second sighting
    out = manager.prepare_store([key], ReqContext(req_id="second"))
    assert out is not None and out.keys_to_store == [key]


def test_a_bad_admission_policy_is_one_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^hma_redis: admission must be one of") as err:
        RedisTierConfig.from_extra_config({"admission": "sometimes"}, env={})
    assert "\n" not in str(err.value)


def test_without_admission_every_missing_chunk_is_stored(
    redis_url: str, redis_client: redis.Redis
) -> None:
    manager = RedisOffloadingManager(_store(redis_url), KeySpace("hma", "beyond"), lookup_wait_s=1)
    key = make_offload_key(b"\x62" * 32, 0)
    assert _ask(manager, [key], "a") == [LookupResult.MISS]
    out = manager.prepare_store([key], ReqContext(req_id="a"))
    assert out is not None and out.keys_to_store == [key]
    assert not redis_client.keys("hma:beyond:seen:*")


# ---------------------------------------------------------------------------- cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    server = started_cluster("tier", "cluster-s3cret")
    yield server
    server.stop()


def test_removals_on_every_cluster_master_reach_the_manager(cluster: LocalCluster) -> None:
    """Redis Cluster: notifications stay on the node that made them, so the watcher listens
    on every master; keys deleted on all three arrive, and the flags were set on each."""
    cluster.flushall()
    keyspace = KeySpace("hma", "beyond")
    store = _store(cluster.url)
    watcher = RemovalWatcher(store.cfg, keyspace.block_pattern()).start()
    assert watcher.wait_subscribed(20.0)
    assert watcher.state is NotificationState.ON
    manager = RedisOffloadingManager(
        store, keyspace, emit_events=True, removals=watcher, group_chunk_tokens=(16,)
    )
    writer = make_client(store.cfg)
    assert isinstance(writer, RedisCluster)
    try:
        hashes = [i.to_bytes(32, "big") for i in range(30)]
        for block_hash in hashes:
            writer.set(keyspace.block_key(0, block_hash), b"v")
        nodes = {writer.get_node_from_key(keyspace.block_key(0, h)).port for h in hashes}
        assert len(nodes) == 3  # the keys live on every master
        for block_hash in hashes:
            writer.unlink(keyspace.block_key(0, block_hash))
        expected = {make_offload_key(h, 0) for h in hashes}
        assert _removals_until(manager, expected) == expected
        for client in cluster.clients():
            flags = client.config_get("notify-keyspace-events")["notify-keyspace-events"]
            assert not missing_flags(flags)
            client.close()
    finally:
        writer.close()
        manager.shutdown()


def test_second_sighting_on_a_cluster(cluster: LocalCluster) -> None:
    """The markers ride in the cluster lookup's pipeline: first sighting deferred, second
    stored, a present chunk a hit."""
    cluster.flushall()
    first, second = _admission_manager(cluster.url), _admission_manager(cluster.url)
    present, seen = make_offload_key(b"\x71" * 32, 0), make_offload_key(b"\x72" * 32, 1)
    writer = make_client(RedisTierConfig.from_extra_config({"redis_url": cluster.url}, env={}))
    writer.set(KeySpace("hma", "beyond").block_key(0, b"\x71" * 32), b"v")
    writer.close()
    assert _ask(first, [present, seen], "a") == [LookupResult.HIT, LookupResult.MISS]
    out = first.prepare_store([seen], ReqContext(req_id="a"))
    assert out is not None and out.keys_to_store == []
    assert _ask(second, [seen], "b") == [LookupResult.MISS]
    out = second.prepare_store([seen], ReqContext(req_id="b"))
    assert out is not None and out.keys_to_store == [seen]


# ARGV[2] block keys: ARGV[1] then 64 hex digits of 1, 2, ...
_FLOOD_KEY = "ARGV[1] .. string.format('%064x', i)"
_FLOOD_SET = f"for i = 1, tonumber(ARGV[2]) do redis.call('SET', {_FLOOD_KEY}, 'v') end"
_FLOOD_UNLINK = f"for i = 1, tonumber(ARGV[2]) do redis.call('UNLINK', {_FLOOD_KEY}) end"


def test_a_flood_of_removals_costs_one_step_at_most_the_bound(local_redis: LocalRedis) -> None:
    """200 000 keys deleted between two steps: the step handles none of them one by one (more
    than MAX_REMOVALS_PER_STEP is an overflow: every cached answer is forgotten), and a
    chunk cached as a HIT that the flood removed is asked of Redis again, never served."""
    client = redis.Redis.from_url(local_redis.url)
    client.config_set("client-output-buffer-limit", "pubsub 0 0 0")  # the whole flood arrives
    keyspace = KeySpace("hma", "flood")
    store = _store(local_redis.url)
    watcher = RemovalWatcher(store.cfg, keyspace.block_pattern(), max_pending=300_000).start()
    assert watcher.wait_subscribed(10.0)
    manager = RedisOffloadingManager(
        store, keyspace, lookup_wait_s=1.0, removals=watcher, group_chunk_tokens=(16, 16)
    )
    try:
        kept = make_offload_key(b"\x51" * 32, 0)
        client.set(keyspace.block_key(0, b"\x51" * 32), b"v")
        assert _ask(manager, [kept], "r1") == [LookupResult.HIT]
        flood = 200_000
        prefix = keyspace.block_key(0, b"")  # every key of the flood is a block key
        client.eval(_FLOOD_SET, 0, prefix, flood)
        client.unlink(keyspace.block_key(0, b"\x51" * 32))
        client.eval(_FLOOD_UNLINK, 0, prefix, flood)
        deadline = time.monotonic() + 120
        while watcher.received < flood + 1:
            assert time.monotonic() < deadline, f"only {watcher.received} removals arrived"
            time.sleep(0.05)

        manager.on_schedule_end(END_OF_STEP)
        assert manager.detail_stats.removal_overflows == 1
        assert manager.detail_stats.removed_chunks <= MAX_REMOVALS_PER_STEP * 2
        assert manager.lookup(kept, ReqContext(req_id="r2")) is LookupResult.RETRY
        manager.on_schedule_end(END_OF_STEP)
        assert manager.lookup(kept, ReqContext(req_id="r2")) is LookupResult.MISS
    finally:
        manager.shutdown()
        client.close()
