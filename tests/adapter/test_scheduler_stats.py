"""The scheduler side's counts: each event counted once, in vLLM's metrics and in the stats
hash alike (hma_redis.adapter.stats), a lookup batch's answer as soon as Redis gave it."""

from __future__ import annotations

import time

import redis
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.metrics import RedisMetricName
from hma_redis.adapter.stats import GroupReach, SchedulerStats
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.counters import PendingCounters
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
R = RedisMetricName


def test_each_event_is_counted_once_in_each_of_its_sinks() -> None:
    counters = PendingCounters()
    stats = SchedulerStats(counters)
    stats.lookup_batch_sent(5)
    stats.lookup_batch_answered(5, hits=2)
    stats.stores_skipped(3)
    stats.stale_store_mark()
    stats.admission_decided(deferred=4, admitted=1)
    stats.load_failed()
    stats.removal_overflow()
    stats.chunks_removed(6)
    stats.request_reached([GroupReach(0, 3, 2), GroupReach(1, 2, 2)])
    stats.pin_off()
    stats.pin_invalid()
    stats.pin_clamped()
    stats.pins_taken(pinned=7, over_budget=8)

    assert stats.totals.lookup_round_trips == 1 and stats.totals.keys_looked_up == 5
    assert (stats.totals.hit_keys, stats.totals.miss_keys) == (2, 3)
    assert stats.totals.store_skipped_present == 3 and stats.totals.failed_loads == 1
    assert stats.totals.stale_store_marks == 1 and stats.detail.removal_overflows == 1
    assert counters.snapshot() == {
        "lookups": 1,
        "lookup_keys": 5,
        "hit_chunks": 2,
        "miss_chunks": 3,
        "admission_deferred": 4,
        "admission_admitted": 1,
        "removed_chunks": 6,
        "g0_hit_chunks": 3,
        "g0_usable_chunks": 2,
        "g1_hit_chunks": 2,
        "g1_usable_chunks": 2,
        "pin_off_requests": 1,
        "pin_invalid_requests": 1,
        "pin_clamped_requests": 1,
        "pin_chunks": 7,
        "pin_over_budget_chunks": 8,
    }
    report = stats.report(errors=0, available=True)
    assert report is not None
    reduced = report.reduce()
    assert {
        name: reduced.get(name)
        for name in (
            R.LOOKUPS,
            R.CHUNK_QUERIES,
            R.CHUNK_HITS,
            R.CHUNK_MISSES,
            R.STORES_SKIPPED,
            R.LOAD_FAILURES,
            R.ADMISSION_DEFERRED,
            R.REMOVED_CHUNKS,
            R.PIN_OFF_REQUESTS,
            R.PIN_INVALID_REQUESTS,
            R.PIN_CLAMPED_REQUESTS,
            R.PIN_CHUNKS,
            R.PIN_OVER_BUDGET_CHUNKS,
        )
    } == {
        R.LOOKUPS: 1,
        R.CHUNK_QUERIES: 5,
        R.CHUNK_HITS: 2,
        R.CHUNK_MISSES: 3,
        R.STORES_SKIPPED: 3,
        R.LOAD_FAILURES: 1,
        R.ADMISSION_DEFERRED: 4,
        R.REMOVED_CHUNKS: 6,
        R.PIN_OFF_REQUESTS: 1,
        R.PIN_INVALID_REQUESTS: 1,
        R.PIN_CLAMPED_REQUESTS: 1,
        R.PIN_CHUNKS: 7,
        R.PIN_OVER_BUDGET_CHUNKS: 8,
    }
    assert reduced[f"{R.GROUP_HIT_CHUNKS}:('g0',)"] == 3
    assert reduced[f"{R.USABLE_HIT_CHUNKS}:('g1',)"] == 2
    # Nothing new happened: the next report has no counter in it.
    assert stats.report(errors=0, available=True) is None


def test_a_report_counts_a_batch_redis_answered_before_the_scheduler_took_it_in(
    local_redis: LocalRedis,
) -> None:
    """A batch Redis answers after its step stopped waiting is counted, hits and misses, as
    soon as it is answered: in vLLM's next report as in the stats hash, before any lookup takes
    the answer in. (Before, the report had its chunk query but not yet its miss.)"""
    keyspace = KeySpace("hma", "late-answer")
    cfg = RedisTierConfig.from_extra_config({"redis_url": local_redis.url}, env={})
    store = RedisBlockStore(cfg, stats_key=keyspace.stats_key())
    manager = RedisOffloadingManager(store, keyspace, lookup_wait_s=0.01)
    ctx = ReqContext(req_id="r")
    local_redis.pause()
    try:
        assert manager.lookup(make_offload_key(b"\x01" * 32, 0), ctx) is LookupResult.RETRY
        manager.on_schedule_end(END_OF_STEP)  # gives up waiting after 10 ms
    finally:
        local_redis.resume()
    deadline = time.monotonic() + 10
    while store.counters.snapshot().get("miss_chunks") != 1:  # answered, on the lookups' thread
        assert time.monotonic() < deadline, store.counters.snapshot()
        time.sleep(0.01)
    report = manager.get_stats()
    assert report is not None
    reduced = report.reduce()
    assert reduced[R.LOOKUPS] == 1 and reduced[R.CHUNK_QUERIES] == 1
    assert reduced.get(R.CHUNK_MISSES) == 1 and reduced.get(R.CHUNK_HITS, 0) == 0
    manager.shutdown()  # delivers the counters
    client = redis.Redis.from_url(local_redis.url)
    assert client.hmget(keyspace.stats_key(), ["lookups", "miss_chunks"]) == [b"1", b"1"]
    client.close()
