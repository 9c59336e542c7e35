"""Edges of removal notifications and second-sighting admission, at the manager, against a
real Redis: a notification connection that drops loses the removals of the gap, so the
manager trusts none of its cached answers; a chunk nobody looked up is not stored at first
sight."""

from __future__ import annotations

import redis
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.notifications import RemovalWatcher
from tests.adapter.test_removals_admission import _admission_manager, _ask, _removals_until, _store


def _announced_again(
    client: redis.Redis, manager: RedisOffloadingManager, redis_key: str, key: OffloadKey
) -> bool:
    """Write and delete ``redis_key`` until the manager hears of its removal (10 s at most)."""
    for _ in range(50):
        client.set(redis_key, b"v")
        client.unlink(redis_key)
        if key in _removals_until(manager, {key}, timeout_s=0.2):
            return True
    return False


def test_a_lost_notification_connection_forgets_every_cached_answer(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The watcher's pub/sub connection is killed and a chunk is deleted before it has
    subscribed again: that removal never arrives, yet the chunk's cached HIT is not served
    again: the manager forgets every answer (``removal_overflows``) and asks Redis."""
    keyspace = KeySpace("hma", "gap")
    store = _store(redis_url)
    watcher = RemovalWatcher(store.cfg, keyspace.block_pattern()).start()
    assert watcher.wait_subscribed(10.0)
    manager = RedisOffloadingManager(
        store,
        keyspace,
        lookup_wait_s=1.0,
        emit_events=True,
        removals=watcher,
        group_chunk_tokens=(16,),
    )
    try:
        gone, canary = b"\x71" * 32, b"\x72" * 32
        for block_hash in (gone, canary):
            redis_client.set(keyspace.block_key(0, block_hash), b"v")
        key = make_offload_key(gone, 0)
        assert _ask(manager, [key], "r1") == [LookupResult.HIT]

        assert redis_client.client_kill_filter(_type="pubsub") >= 1
        redis_client.unlink(keyspace.block_key(0, gone))  # in the gap: never announced
        # The watcher is back once a later removal arrives (it waits before resubscribing).
        canary_key = make_offload_key(canary, 0)
        assert _announced_again(redis_client, manager, keyspace.block_key(0, canary), canary_key)
        assert key not in _removals_until(manager, {key}, timeout_s=0.3)

        assert _ask(manager, [key], "r2") == [LookupResult.MISS]
        assert manager.detail_stats.removal_overflows >= 1
    finally:
        manager.shutdown()
        redis_client.config_set("notify-keyspace-events", "")  # the session server's default


def test_a_chunk_never_looked_up_is_not_stored_at_first_sight(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """With ``second_sighting``, ``prepare_store`` of a chunk no lookup ever asked about (here:
    on a fresh manager) stores nothing and counts it deferred; a chunk admitted by a second
    sighting in the same call is stored."""
    first, manager = _admission_manager(redis_url), _admission_manager(redis_url)
    seen, unseen = make_offload_key(b"\x73" * 32, 0), make_offload_key(b"\x74" * 32, 0)
    try:
        assert _ask(first, [seen], "a") == [LookupResult.MISS]  # its first sighting
        assert _ask(manager, [seen], "b") == [LookupResult.MISS]  # the second
        out = manager.prepare_store([unseen, seen], ReqContext(req_id="b"))
        assert out is not None and out.keys_to_store == [seen]
        assert manager.detail_stats.admission_deferred == 1
    finally:
        first.shutdown()
        manager.shutdown()
