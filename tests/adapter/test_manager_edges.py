"""The scheduler-side manager's bookkeeping, against a real Redis (issue 17, part 3).

What an operator reads off the manager besides HIT and MISS: its counters and metrics, the
events it gives vLLM, how long its answers and marks live, what it logs, and which Redis it
names. Each test pins one of these; mutation testing found them unpinned.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import pytest
import redis
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.metrics import RedisMetricName
from hma_redis.core.codec import FORMAT_VERSION
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.notifications import RemovalWatcher
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
NAMESPACE = "edges"
CHUNK_TOKENS = 16


def _hash(n: int) -> bytes:
    return bytes([n]) * 32


def _key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(_hash(n), group)


def _store(url: str, **extra: object) -> RedisBlockStore:
    cfg = RedisTierConfig.from_extra_config({"redis_url": url, **extra}, env={})
    return RedisBlockStore(cfg, stats_key=KeySpace("hma", NAMESPACE).stats_key())


def _manager(
    url: str, world_size: int = 1, **kwargs: object
) -> tuple[RedisOffloadingManager, KeySpace]:
    keyspace = KeySpace("hma", NAMESPACE, world_size=world_size)
    extra = {"admission": kwargs["admission"]} if "admission" in kwargs else {}
    kwargs.setdefault("lookup_wait_s", 2.0)
    manager = RedisOffloadingManager(_store(url, **extra), keyspace, **kwargs)  # type: ignore[arg-type]
    return manager, keyspace


def _put(client: redis.Redis, keyspace: KeySpace, *numbers: int, group: int = 0) -> None:
    for n in numbers:
        for rank in range(keyspace.world_size):
            client.set(keyspace.block_key(group, _hash(n), rank), b"x")


def _ask(
    manager: RedisOffloadingManager, keys: list[OffloadKey], req: str = "asker"
) -> list[LookupResult]:
    """A step of lookups (RETRY for unknown keys), its end (one round trip), and the answers
    the next step gets."""
    ctx = ReqContext(req_id=req)
    for key in keys:
        manager.lookup(key, ctx)
    manager.on_schedule_end(END_OF_STEP)
    return [manager.lookup(key, ctx) for key in keys]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


# ---------------------------------------------------------------------------- counters


def _reduced(manager: RedisOffloadingManager) -> dict[str, Any]:
    """The manager's metrics as vLLM would report them (``get_stats().reduce()``)."""
    reported = manager.get_stats()
    assert reported is not None
    return reported.reduce()


def test_lookup_counters_add_up_over_steps(redis_url: str, redis_client: redis.Redis) -> None:
    """Round trips, chunks asked, hits and misses accumulate step after step, in the manager's
    stats, in the store's counters (the stats hash) and in the metrics vLLM exports."""
    manager, keyspace = _manager(redis_url)
    _put(redis_client, keyspace, 1, 2, 4)
    assert _ask(manager, [_key(1), _key(2), _key(3)]) == [HIT, HIT, MISS]
    assert _ask(manager, [_key(4), _key(5), _key(1)]) == [HIT, MISS, HIT]  # 1: from the cache

    stats = manager.stats
    assert (stats.lookup_round_trips, stats.keys_looked_up) == (2, 5)
    assert (stats.hit_keys, stats.miss_keys) == (3, 2)
    totals = manager._store.counters.snapshot()
    assert {k: totals.get(k) for k in ("lookups", "lookup_keys", "hit_chunks", "miss_chunks")} == {
        "lookups": 2,
        "lookup_keys": 5,
        "hit_chunks": 3,
        "miss_chunks": 2,
    }
    reduced = _reduced(manager)
    assert reduced[RedisMetricName.LOOKUPS] == 2
    assert reduced[RedisMetricName.CHUNK_QUERIES] == 5
    assert reduced[RedisMetricName.CHUNK_HITS] == 3
    assert reduced[RedisMetricName.CHUNK_MISSES] == 2
    assert reduced[RedisMetricName.AVAILABLE] == 1
    assert reduced.get(RedisMetricName.ERRORS, 0) == 0
    manager.shutdown()


def test_a_step_whose_keys_are_all_cached_makes_no_round_trip(
    redis_url: str, redis_client: redis.Redis
) -> None:
    manager, keyspace = _manager(redis_url)
    _put(redis_client, keyspace, 1)
    assert _ask(manager, [_key(1), _key(2)]) == [HIT, MISS]
    assert _ask(manager, [_key(2), _key(1)]) == [MISS, HIT]
    assert manager.stats.lookup_round_trips == 1
    assert not manager.has_pending_work()
    manager.shutdown()


def test_queued_lookups_and_sightings_are_pending_work(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """vLLM keeps stepping while the manager has pending work: a queued lookup, and (with
    admission on) a sighting still to be marked, are such work until the step's end."""
    manager, _ = _manager(redis_url)
    assert not manager.has_pending_work()
    assert manager.lookup(_key(1), ReqContext(req_id="a")) is RETRY
    assert manager.has_pending_work()
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(_key(1), ReqContext(req_id="a")) is MISS
    assert not manager.has_pending_work()
    manager.shutdown()

    admitting, _ = _manager(redis_url, admission="second_sighting", admission_window_s=60)
    assert _ask(admitting, [_key(2)], req="first") == [MISS]
    assert not admitting.has_pending_work()
    assert admitting.lookup(_key(2), ReqContext(req_id="second")) is MISS  # from the cache
    assert admitting.has_pending_work()  # its sighting rides in the next batch
    admitting.on_schedule_end(END_OF_STEP)
    assert not admitting.has_pending_work()
    admitting.shutdown()


def test_a_lookup_stalled_at_step_end_is_answered_once_redis_recovers(
    local_redis: LocalRedis,
) -> None:
    """One lookup batch at a time: keys asked while a batch hangs on a stalled Redis wait
    for the next one, and the stalled batch's keys are answered when Redis recovers (a
    second batch sent meanwhile would orphan them: asked again, answered a step late)."""
    client = redis.Redis.from_url(local_redis.url)
    manager, keyspace = _manager(local_redis.url, lookup_wait_s=0.2)
    _put(client, keyspace, 1, 2)
    client.close()
    ctx = ReqContext(req_id="r")
    local_redis.pause()
    try:
        assert manager.lookup(_key(1), ctx) is RETRY
        manager.on_schedule_end(END_OF_STEP)  # batch 1 hangs
        assert manager.lookup(_key(2), ctx) is RETRY
        manager.on_schedule_end(END_OF_STEP)  # batch 1 still out: 2 waits
    finally:
        local_redis.resume()
    for _ in range(20):
        if not manager.has_pending_work():
            break
        manager.on_schedule_end(END_OF_STEP)
    assert [manager.lookup(_key(n), ctx) for n in (1, 2)] == [HIT, HIT]
    assert manager.stats.lookup_round_trips == 2
    manager.shutdown()


def test_shutdown_does_not_wait_for_a_lookup_stuck_on_a_stalled_redis(
    local_redis: LocalRedis,
) -> None:
    """vLLM shutting down while Redis hangs is not held up by the lookup in flight (it would
    wait for the read timeout)."""
    manager, _ = _manager(local_redis.url, lookup_wait_s=0.01)
    local_redis.pause()
    try:
        assert manager.lookup(_key(1), ReqContext(req_id="r")) is RETRY
        manager.on_schedule_end(END_OF_STEP)  # the batch hangs
        assert manager.has_pending_work()
        closing = threading.Thread(target=manager.shutdown)
        closing.start()
        closing.join(timeout=1.0)  # the read timeout is 2 s
        assert not closing.is_alive()
    finally:
        local_redis.resume()


def test_unreachable_redis_is_reported_as_errors_and_unavailable() -> None:
    """A scheduler that cannot reach Redis answers MISS, and says so in its metrics: the
    errors counter moves and the availability gauge drops to 0."""
    manager, _ = _manager(f"redis://127.0.0.1:{_closed_port()}/0")
    assert _ask(manager, [_key(1)]) == [MISS]
    assert manager.stats.miss_keys == 1
    reduced = _reduced(manager)
    assert reduced[RedisMetricName.ERRORS] >= 1
    assert reduced[RedisMetricName.AVAILABLE] == 0
    manager.shutdown()


def test_skipped_stores_and_failed_loads_are_counted_each_time(
    redis_url: str, redis_client: redis.Redis
) -> None:
    manager, keyspace = _manager(redis_url)
    _put(redis_client, keyspace, 1, 2)
    assert _ask(manager, [_key(1), _key(2), _key(3)]) == [HIT, HIT, MISS]
    out = manager.prepare_store([_key(1), _key(2), _key(3)], ReqContext(req_id="w1"))
    assert out is not None and out.keys_to_store == [_key(3)]
    assert out.evicted_keys == []  # Redis evicts on its own; a store never makes room here
    assert manager.stats.store_skipped_present == 2
    out = manager.prepare_store([_key(1), _key(3)], ReqContext(req_id="w2"))  # 3: in flight
    assert out is not None and out.keys_to_store == []
    assert manager.stats.store_skipped_present == 4

    manager.on_load_failed("never-loaded")  # a request without loads: counted, nothing else
    manager.prepare_load([_key(1)], ReqContext(req_id="r"))
    manager.on_load_failed("r")
    assert manager.stats.failed_loads == 2
    reduced = _reduced(manager)
    assert reduced[RedisMetricName.STORES_SKIPPED] == 4
    assert reduced[RedisMetricName.LOAD_FAILURES] == 2
    manager.shutdown()


def test_refused_lookup_shows_in_the_schedulers_refusal_metrics(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A lookup Redis refuses (here: the ACL user may not run EVAL) is a miss, counted as a
    refusal in the scheduler's metrics; Redis is not reported down."""
    user, password = "edges-noeval", "Edges-n0eval-pw"
    redis_client.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-eval", "-evalsha"
    )
    try:
        url = redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
        manager, keyspace = _manager(url)
        _put(redis_client, keyspace, 1)
        assert _ask(manager, [_key(1)]) == [MISS]
        reduced = _reduced(manager)
        assert reduced[f"{RedisMetricName.REFUSED}:('noperm',)"] == 1
        assert reduced[RedisMetricName.AVAILABLE] == 1
        manager.shutdown()
    finally:
        redis_client.execute_command("ACL", "DELUSER", user)


# ---------------------------------------------------------------------------- events


def test_completed_stores_become_events_only_when_they_succeed_and_events_are_on(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """With vLLM's KV events on, a successful store is one "stored" event for exactly its
    chunks; a failed or empty one is none; with events off there are none at all."""
    manager, _ = _manager(redis_url, emit_events=True)
    ctx = ReqContext(req_id="w")
    manager.prepare_store([_key(1), _key(2)], ctx)
    manager.complete_store([_key(1), _key(2)], ctx)
    manager.prepare_store([_key(3)], ctx)
    manager.complete_store([_key(3)], ctx, success=False)
    manager.complete_store([], ctx)
    (event,) = manager.take_events()
    assert list(event.keys) == [_key(1), _key(2)]
    assert event.medium is Medium.STORAGE and event.locality is Locality.REMOTE
    assert event.removed is False
    assert list(manager.take_events()) == []  # taken once
    manager.shutdown()

    quiet, _ = _manager(redis_url)
    quiet.prepare_store([_key(1)], ctx)
    quiet.complete_store([_key(1)], ctx)
    assert list(quiet.take_events()) == []
    quiet.shutdown()


# ---------------------------------------------------------------------------- ageing


def test_default_answers_are_asked_again_after_two_seconds(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A manager built as the spec builds it keeps an answer for 2 s (and two steps): a
    chunk another instance stores is seen after that, not later."""
    store = _store(redis_url)
    keyspace = KeySpace("hma", NAMESPACE)
    manager = RedisOffloadingManager(store, keyspace)
    ctx = ReqContext(req_id="r")
    assert manager.lookup(_key(1), ctx) is RETRY
    deadline = time.monotonic() + 10
    while manager.has_pending_work() and time.monotonic() < deadline:
        manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(_key(1), ctx) is MISS
    _put(redis_client, keyspace, 1)
    for _ in range(3):
        manager.on_schedule_end(END_OF_STEP)
    time.sleep(2.1)
    assert manager.lookup(_key(1), ctx) is RETRY
    manager.shutdown()


def test_failed_load_misses_age_out_and_the_chunks_are_asked_again(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The MISS a failed load leaves lasts as long as any answer (two steps and the TTL),
    then Redis is asked again: a chunk stored meanwhile is a hit once more."""
    manager, keyspace = _manager(redis_url, answer_ttl_s=0.05)
    _put(redis_client, keyspace, 1)
    assert _ask(manager, [_key(1)]) == [HIT]
    manager.prepare_load([_key(1)], ReqContext(req_id="r"))
    manager.on_load_failed("r")
    ctx = ReqContext(req_id="later")
    time.sleep(0.1)
    for _ in range(2):
        manager.on_schedule_end(END_OF_STEP)
        assert manager.lookup(_key(1), ctx) is MISS
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(_key(1), ctx) is RETRY
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(_key(1), ctx) is HIT
    manager.shutdown()


def test_a_failed_loads_miss_wins_over_a_lookup_queued_in_the_same_step(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A chunk whose load failed after another request queued a lookup for it is not asked
    of Redis at the step's end: the failure's MISS stands, so the recompute does not walk
    back into the value that just failed."""
    manager, keyspace = _manager(redis_url, answer_ttl_s=0.05)
    _put(redis_client, keyspace, 1)
    assert _ask(manager, [_key(1)], req="loader") == [HIT]
    manager.prepare_load([_key(1)], ReqContext(req_id="loader"))
    time.sleep(0.1)
    for _ in range(3):
        manager.on_schedule_end(END_OF_STEP)  # the HIT ages out
    asker = ReqContext(req_id="asker")
    assert manager.lookup(_key(1), asker) is RETRY  # queued
    manager.on_load_failed("loader")
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(_key(1), asker) is MISS
    assert manager.stats.lookup_round_trips == 1
    manager.shutdown()


def test_stale_store_marks_are_counted_and_logged_once(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    manager, _ = _manager(redis_url, store_pending_timeout_s=0.05)
    ctx = ReqContext(req_id="w")
    manager.prepare_store([_key(1), _key(2)], ctx)
    time.sleep(0.1)
    with caplog.at_level(logging.WARNING, logger="hma_redis.adapter.manager"):
        assert manager.lookup(_key(1), ctx) is RETRY
        assert manager.lookup(_key(2), ctx) is RETRY
    assert manager.stats.stale_store_marks == 2
    warnings = [r for r in caplog.records if "store_pending_timeout_s" in r.getMessage()]
    assert len(warnings) == 1
    manager.shutdown()


def test_a_refreshed_answer_is_evicted_last(redis_url: str, redis_client: redis.Redis) -> None:
    """The answer cache drops the least recently learned answer first: one learned again
    (here by a failed load) outlives those learned before it."""
    manager, keyspace = _manager(redis_url, max_answers=3)
    _put(redis_client, keyspace, 1, 2, 3)
    assert _ask(manager, [_key(1), _key(2), _key(3)]) == [HIT] * 3
    manager.prepare_load([_key(1)], ReqContext(req_id="r"))
    manager.on_load_failed("r")  # 1 is learned again (a MISS now)
    assert _ask(manager, [_key(4)]) == [MISS]  # one answer too many: 2 goes
    ctx = ReqContext(req_id="check")
    assert [manager.lookup(_key(n), ctx) for n in (1, 2, 3, 4)] == [MISS, RETRY, HIT, MISS]
    manager.shutdown()


# ---------------------------------------------------------------------------- ranks, admission


def test_second_sighting_slices_each_chunks_rank_shards(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """With admission on and two ranks, each chunk is judged by its own two shards, and only
    chunks missing some shard get a sighting marker."""
    manager, keyspace = _manager(
        redis_url, world_size=2, admission="second_sighting", admission_window_s=60
    )
    shards = {1: (0, 1), 2: (0,), 3: (1,), 4: (0, 1), 5: ()}
    for n, ranks in shards.items():
        for rank in ranks:
            redis_client.set(keyspace.block_key(0, _hash(n), rank), b"x")
    assert _ask(manager, [_key(n) for n in shards]) == [HIT, MISS, MISS, HIT, MISS]
    marked = [n for n in shards if redis_client.exists(keyspace.sighting_key(0, _hash(n)))]
    assert marked == [2, 3, 5]
    manager.shutdown()


def test_a_request_asking_again_is_not_a_second_sighting(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Under ``second_sighting`` one request looking a chunk up in two steps has seen it
    once: the chunk is not admitted for storing."""
    manager, _ = _manager(redis_url, admission="second_sighting", admission_window_s=60)
    assert _ask(manager, [_key(1)], req="a") == [MISS]  # asked twice by "a"
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(_key(1), ReqContext(req_id="a")) is MISS
    manager.on_schedule_end(END_OF_STEP)
    out = manager.prepare_store([_key(1)], ReqContext(req_id="a"))
    assert out is not None and out.keys_to_store == []
    assert manager.stats.lookup_round_trips == 1
    manager.shutdown()


def test_admission_counts_accumulate_over_stores(redis_url: str, redis_client: redis.Redis) -> None:
    """Deferred chunks add up over calls, in the metrics and in the stats hash."""
    manager, keyspace = _manager(redis_url, admission="second_sighting", admission_window_s=60)
    assert _ask(manager, [_key(1), _key(2), _key(3)]) == [MISS] * 3
    ctx = ReqContext(req_id="asker")
    out = manager.prepare_store([_key(1), _key(2)], ctx)
    assert out is not None and out.keys_to_store == []
    out = manager.prepare_store([_key(3)], ctx)
    assert out is not None and out.keys_to_store == []
    assert manager.detail_stats.admission_deferred == 3
    assert _reduced(manager)[RedisMetricName.ADMISSION_DEFERRED] == 3
    manager.shutdown()
    assert redis_client.hget(keyspace.stats_key(), "admission_deferred") == b"3"


# ---------------------------------------------------------------------------- intersection


def _positioned(ctx: ReqContext, n: int, group: int, chunk: int) -> OffloadKey:
    key = _key(n, group)
    ctx.set_offload_key_position(key, (chunk + 1) * CHUNK_TOKENS)
    return key


def test_hits_after_the_first_miss_do_not_count_as_reached(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Group 0 holds chunks 0, 1 and 3 (2 is gone), group 1 holds nothing: group 0 reaches
    two chunks (a prefix scan stops at the gap), and nothing is usable."""
    manager, keyspace = _manager(redis_url, group_chunk_tokens=(CHUNK_TOKENS, CHUNK_TOKENS))
    _put(redis_client, keyspace, 10, 11, 13)
    ctx = ReqContext(req_id="req")
    keys = [_positioned(ctx, 10 + i, g, i) for g in (0, 1) for i in range(4)]
    for key in keys:
        manager.lookup(key, ctx)
    manager.on_schedule_end(END_OF_STEP)
    answers = [manager.lookup(key, ctx) for key in keys]
    assert answers == [HIT, HIT, MISS, HIT] + [MISS] * 4
    manager.on_request_finished(ctx)
    assert manager.detail_stats.group_hit_chunks == {0: 2, 1: 0}
    assert manager.detail_stats.group_usable_chunks == {0: 0, 1: 0}
    manager.on_request_finished(ctx)  # counted once
    assert manager.detail_stats.group_hit_chunks == {0: 2, 1: 0}

    for name in ("again-1", "again-2"):  # requests for group 0 alone add up
        again = ReqContext(req_id=name)
        for key in [_positioned(again, 10 + i, 0, i) for i in range(2)]:
            assert manager.lookup(key, again) is HIT
        manager.on_request_finished(again)
    assert manager.detail_stats.group_hit_chunks == {0: 6, 1: 0}
    assert manager.detail_stats.group_usable_chunks == {0: 4, 1: 0}
    manager.shutdown()


def test_a_chunk_being_stored_counts_as_reached(redis_url: str, redis_client: redis.Redis) -> None:
    """A chunk this instance is storing answers HIT_PENDING, and the request's reach counts
    it like a hit."""
    manager, _ = _manager(redis_url, group_chunk_tokens=(CHUNK_TOKENS,))
    manager.prepare_store([_key(30)], ReqContext(req_id="writer"))
    ctx = ReqContext(req_id="reader")
    stored, missing = _positioned(ctx, 30, 0, 0), _positioned(ctx, 31, 0, 1)
    assert manager.lookup(stored, ctx) is LookupResult.HIT_PENDING
    assert manager.lookup(missing, ctx) is RETRY
    manager.on_schedule_end(END_OF_STEP)
    assert manager.lookup(missing, ctx) is MISS
    manager.on_request_finished(ctx)
    assert manager.detail_stats.group_hit_chunks == {0: 1}
    assert manager.detail_stats.group_usable_chunks == {0: 1}
    manager.shutdown()


def test_without_chunk_sizes_reach_is_counted_per_position(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A manager told no chunk sizes (``group_chunk_tokens`` empty) counts each position as
    one chunk instead of failing when a request finishes."""
    manager, keyspace = _manager(redis_url)
    _put(redis_client, keyspace, 20, 21)
    ctx = ReqContext(req_id="req")
    keys = []
    for group in (0, 1):
        for i in range(3):
            key = _key(20 + i, group)
            ctx.set_offload_key_position(key, i + 1)
            keys.append(key)
    for key in keys:
        manager.lookup(key, ctx)
    manager.on_schedule_end(END_OF_STEP)
    assert [manager.lookup(key, ctx) for key in keys] == [HIT, HIT, MISS] + [MISS] * 3
    manager.on_request_finished(ctx)
    assert manager.detail_stats.group_hit_chunks == {0: 2, 1: 0}
    assert manager.detail_stats.group_usable_chunks == {0: 0, 1: 0}
    manager.shutdown()


def test_finished_request_is_forgotten_by_a_later_load_failure(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Once a request finished, a failure reported for it no longer touches the chunks it
    loaded (other requests keep hitting them)."""
    manager, keyspace = _manager(redis_url)
    _put(redis_client, keyspace, 1)
    assert _ask(manager, [_key(1)]) == [HIT]
    ctx = ReqContext(req_id="r")
    manager.prepare_load([_key(1)], ctx)
    manager.on_request_finished(ctx)
    manager.on_load_failed("r")
    assert manager.lookup(_key(1), ReqContext(req_id="other")) is HIT
    manager.shutdown()


# ---------------------------------------------------------------------------- removals


def test_a_stray_key_among_removals_does_not_hide_the_chunks_after_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A key under the namespace's block pattern that is no block key (here ``g0:stray``) is
    skipped; the chunk removed right after it still becomes a removal event, for the one KV
    group a manager told no group sizes has."""
    keyspace = KeySpace("hma", NAMESPACE)
    store = _store(redis_url)
    watcher = RemovalWatcher(store.cfg, keyspace.block_pattern()).start()
    try:
        assert watcher.wait_subscribed(10.0)
        manager = RedisOffloadingManager(store, keyspace, emit_events=True, removals=watcher)
        stray = f"{keyspace.base}:g0:stray"
        chunk = keyspace.block_key(0, _hash(7))
        redis_client.set(stray, b"x")
        redis_client.set(chunk, b"x")
        redis_client.delete(stray, chunk)  # one command: both notifications, in this order
        removed: list[OffloadKey] = []
        deadline = time.monotonic() + 10
        time.sleep(0.2)  # let both arrive before the first drain
        while not removed and time.monotonic() < deadline:
            events = [e for e in manager.take_events() if e.removed]
            assert all(e.locality is Locality.REMOTE for e in events)
            removed = [k for e in events for k in e.keys]
            time.sleep(0.02)
        assert removed == [_key(7)]
        assert manager.detail_stats.removed_chunks == 1
        assert manager._store.counters.snapshot().get("removed_chunks") == 1
        manager.shutdown()
    finally:
        watcher.close()
        redis_client.config_set("notify-keyspace-events", "")  # the session server's default


def test_each_removal_overflow_is_counted(redis_url: str, redis_client: redis.Redis) -> None:
    keyspace = KeySpace("hma", NAMESPACE)
    store = _store(redis_url)
    watcher = RemovalWatcher(store.cfg, keyspace.block_pattern(), max_pending=1).start()
    try:
        assert watcher.wait_subscribed(10.0)
        manager = RedisOffloadingManager(store, keyspace, removals=watcher)
        for round_ in (1, 2):
            for n in (1, 2):
                redis_client.set(keyspace.block_key(0, _hash(n)), b"x")
                redis_client.unlink(keyspace.block_key(0, _hash(n)))
            deadline = time.monotonic() + 10
            while watcher.received < 2 * round_ and time.monotonic() < deadline:
                time.sleep(0.02)
            manager.on_schedule_end(END_OF_STEP)
            assert manager.detail_stats.removal_overflows == round_
        manager.shutdown()
    finally:
        watcher.close()
        redis_client.config_set("notify-keyspace-events", "")


# ---------------------------------------------------------------------------- identity


def test_lookups_run_on_a_thread_named_for_them(redis_url: str, redis_client: redis.Redis) -> None:
    """A thread dump of a stuck scheduler names the lookup thread (``hma-lookup``)."""
    manager, _ = _manager(redis_url)
    assert _ask(manager, [_key(1)]) == [MISS]
    names = [t.name for t in threading.enumerate()]
    assert any(name.startswith("hma-lookup") for name in names), names
    manager.shutdown()


def test_config_info_names_prefix_namespace_redis_and_format(
    redis_url: str, redis_client: redis.Redis
) -> None:
    url = redis_url.replace("redis://", "redis://someone:Hidden-pw-9@", 1)
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))
    manager = RedisOffloadingManager(store, KeySpace("pfx", "ns-1"), lookup_wait_s=2.0)
    (info,) = manager.config_info()
    host_port = redis_url.removeprefix("redis://").split("/")[0]
    assert info["key_prefix"] == "pfx" and info["namespace"] == "ns-1"
    assert info["format_version"] == str(FORMAT_VERSION)
    assert host_port in info["redis_url"] and "Hidden-pw-9" not in info["redis_url"]
    assert set(info) == {"key_prefix", "namespace", "redis_url", "format_version"}
    manager.shutdown()


def test_a_request_still_unfinished_at_shutdown_has_its_group_hits_counted(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """vLLM reports a request finished only when its stores are done; an offline engine shut
    down after its last request never does. Its hits still reach the stats hash."""
    manager, keyspace = _manager(redis_url, group_chunk_tokens=(CHUNK_TOKENS,))
    _put(redis_client, keyspace, 40, 41)
    ctx = ReqContext(req_id="last-request")
    keys = [_positioned(ctx, 40 + i, 0, i) for i in range(2)]
    for key in keys:
        manager.lookup(key, ctx)
    manager.on_schedule_end(END_OF_STEP)
    assert [manager.lookup(key, ctx) for key in keys] == [HIT, HIT]
    manager.shutdown()  # no on_request_finished
    stats = redis_client.hgetall(keyspace.stats_key())
    assert stats[b"g0_hit_chunks"] == b"2"
    assert stats[b"g0_usable_chunks"] == b"2"
