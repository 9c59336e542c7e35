"""Replies of the wrong shape to what the scheduler side reads, one by one, over a real socket
(:class:`~tests.support.shape_server.ShapeServer`, honest but for the reply under test): a
lookup answered with an integer, a status, an empty, short, long or nested array is a miss in
both admission modes (an outage: the breaker opens), never a HIT and never an exception out of
``lookup()`` / ``on_schedule_end()``; ``INFO memory`` with figures Redis never writes gives no
gauges and ``get_stats()`` goes on."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.metrics import RedisMetricName
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.shape_server import ShapeServer

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
KEYS = [make_offload_key(bytes([n]) * 32, n % 2) for n in range(4)]
# One lookup script's reply for 4 chunks, in shapes Redis never sends.
WRONG_LOOKUP_REPLIES = {
    "integer": b":7\r\n",
    "status": b"+OK\r\n",
    "empty-array": b"*0\r\n",
    "too-few-flags": b"*2\r\n:1\r\n:1\r\n",
    "too-many-flags": b"*6\r\n" + b":1\r\n" * 6,
    "nested-arrays": b"*4\r\n" + b"*1\r\n:1\r\n" * 4,
    "flag-out-of-range": b"*4\r\n:1\r\n:1\r\n:7\r\n:1\r\n",
    "bulk-flags": b"*4\r\n" + b"$1\r\n1\r\n" * 4,
    "nil": b"*-1\r\n",
}


@pytest.fixture
def server() -> Iterator[ShapeServer]:
    shapes = ShapeServer(hostile=False)
    yield shapes
    shapes.close()


def _manager(url: str, admission: str = "always") -> RedisOffloadingManager:
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": url, "admission": admission, "retry_interval_s": 60}, env={}
    )
    keyspace = KeySpace("hma", "shapes")
    store = RedisBlockStore(cfg, stats_key=keyspace.stats_key())
    return RedisOffloadingManager(
        store, keyspace, lookup_wait_s=2.0, admission=admission, memory_poll_interval_s=0.0
    )


@pytest.mark.parametrize("admission", ["always", "second_sighting"])
@pytest.mark.parametrize("reply", WRONG_LOOKUP_REPLIES.values(), ids=WRONG_LOOKUP_REPLIES.keys())
def test_a_lookup_reply_of_the_wrong_shape_is_a_miss_never_a_hit_nor_an_error(
    server: ShapeServer, admission: str, reply: bytes
) -> None:
    server.fixed[b"EVAL"] = reply
    manager = _manager(server.url, admission)
    try:
        ctx = ReqContext(req_id="r")
        assert [manager.lookup(k, ctx) for k in KEYS] == [LookupResult.RETRY] * len(KEYS)
        manager.on_schedule_end(END_OF_STEP)
        assert [manager.lookup(k, ctx) for k in KEYS] == [LookupResult.MISS] * len(KEYS)
        assert server.counts[b"EVAL"] == 1
        assert manager._store.breaker.state is BreakerState.OPEN
    finally:
        manager.shutdown()


def test_the_same_lookup_answered_like_redis_hits(server: ShapeServer) -> None:
    """The server's honest answer (every chunk there) is a HIT: the misses above come from
    the replies' shapes, not from the rig."""
    manager = _manager(server.url)
    try:
        ctx = ReqContext(req_id="r")
        [manager.lookup(k, ctx) for k in KEYS]
        manager.on_schedule_end(END_OF_STEP)
        assert [manager.lookup(k, ctx) for k in KEYS] == [LookupResult.HIT] * len(KEYS)
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    "field", [b"used_memory:12GB", b"used_memory:-5", b"maxmemory:1.5", b"used_memory:4mb"]
)
def test_info_memory_with_figures_redis_never_writes_gives_no_gauges_and_the_stats_go_on(
    server: ShapeServer, field: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy's ``used_memory:12GB``: no memory gauges, ``get_stats()`` (vLLM calls it on the
    engine core's thread every step) never raises, and lookups are not turned off for it. One
    line says the figures are not Redis' (not that INFO was refused, nor to grant +info)."""
    body = b"# Memory\r\n" + field + b"\r\n"
    server.fixed[b"INFO"] = b"$%d\r\n%s\r\n" % (len(body), body)
    manager = _manager(server.url)
    try:
        with caplog.at_level(logging.INFO, logger="hma_redis"):
            for _ in range(3):
                stats = manager.get_stats()
                manager._memory.wait(10.0)
                reduced = {} if stats is None else stats.reduce()
                assert RedisMetricName.USED_MEMORY_BYTES not in reduced
        said = [r.getMessage() for r in caplog.records if "INFO" in r.getMessage()]
        assert len(said) == 1 and "is not Redis'" in said[0], said
        assert "+info" not in said[0] and "refused" not in said[0]
        assert server.counts[b"INFO"] >= 2
        assert manager._store.breaker.state is BreakerState.CLOSED
        ctx = ReqContext(req_id="r")
        [manager.lookup(k, ctx) for k in KEYS]
        manager.on_schedule_end(END_OF_STEP)
        assert [manager.lookup(k, ctx) for k in KEYS] == [LookupResult.HIT] * len(KEYS)
    finally:
        manager.shutdown()


def test_the_tier_recovers_once_lookups_are_answered_like_redis_again(
    server: ShapeServer,
) -> None:
    """After an integer for a lookup (breaker open), the first probe past the retry interval
    that gets Redis' shape closes the breaker, and the lookups HIT."""
    server.fixed[b"EVAL"] = b":7\r\n"
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": server.url, "retry_interval_s": 0.05}, env={}
    )
    keyspace = KeySpace("hma", "shapes")
    manager = RedisOffloadingManager(
        RedisBlockStore(cfg, stats_key=keyspace.stats_key()), keyspace, lookup_wait_s=2.0
    )
    try:
        ctx = ReqContext(req_id="r")
        [manager.lookup(k, ctx) for k in KEYS]
        manager.on_schedule_end(END_OF_STEP)
        assert manager._store.breaker.state is BreakerState.OPEN
        del server.fixed[b"EVAL"]
        time.sleep(0.1)
        fresh = [make_offload_key(bytes([n]) * 32, 0) for n in range(10, 14)]
        [manager.lookup(k, ctx) for k in fresh]
        manager.on_schedule_end(END_OF_STEP)
        assert [manager.lookup(k, ctx) for k in fresh] == [LookupResult.HIT] * len(fresh)
        assert manager._store.breaker.state is BreakerState.CLOSED
    finally:
        manager.shutdown()
