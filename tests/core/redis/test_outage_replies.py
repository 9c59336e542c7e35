"""Error replies of a server that answers but does not serve data (LOADING, CLUSTERDOWN,
MASTERDOWN, TRYAGAIN, BUSY) are outages: the breaker opens, as when Redis is down, and nothing
is counted as refused. READONLY, which a demoted master sends after a failover, is a refusal:
the tier stays on. On the native path and on the Python path, for lookups, loads and stores;
and against a real replica cut from its master (MASTERDOWN)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis, free_port
from tests.support.error_server import ErrorServer
from tests.support.kv_pages import DST, KEYSPACE, SRC, Pages, chunks, make_pages

OUTAGE_REPLIES = {
    "LOADING": "LOADING Redis is loading the dataset in memory",
    "CLUSTERDOWN": "CLUSTERDOWN The cluster is down",
    "MASTERDOWN": "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is 'no'.",
    "TRYAGAIN": "TRYAGAIN Multiple keys request during rehashing of slot",
    "BUSY": "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN.",
}
READONLY = "READONLY You can't write against a read only replica."


def _rig(url: str, path: str) -> Iterator[tuple[RedisBlockStore, Pages]]:
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": url, "retry_interval_s": 60, "read_timeout_s": 2}, env={}
    )
    store = RedisBlockStore(cfg, stats_key=KEYSPACE.stats_key())
    rig = make_pages(store)
    assert rig.store.native == (path == "native"), rig.engine.data_path
    try:
        yield store, rig
    finally:
        rig.close()
        store.close()


def _refused(store: RedisBlockStore) -> dict[str, int]:
    return {k: v for k, v in store.counters.snapshot().items() if k.startswith("refused_")}


@pytest.mark.parametrize("reply", OUTAGE_REPLIES.values(), ids=OUTAGE_REPLIES.keys())
@pytest.mark.parametrize("operation", ["lookup", "load", "store"])
def test_a_server_that_does_not_serve_opens_the_breaker(
    reply: str, operation: str, path: str
) -> None:
    """Each of these replies to a lookup, a load or a store opens the breaker (the tier turns
    off until a probe succeeds); a load fails (→ recompute); no refusal is counted."""
    server = ErrorServer(reply)
    try:
        for store, rig in _rig(server.url, path):
            if operation == "lookup":
                assert store.exists([chunks(DST)[0].redis_key]) == [False]
            elif operation == "load":
                assert not rig.load_job(1, chunks(DST)).ok
            else:
                rig.store_job(1, chunks(SRC))
            assert server.commands >= 1
            assert store.breaker.state is BreakerState.OPEN
            assert _refused(store) == {}
    finally:
        server.close()


def test_readonly_from_a_demoted_master_is_a_refusal(path: str) -> None:
    """After a failover the old master answers writes with READONLY: stores are refused and
    counted (``refused_readonly``), the breaker stays closed, lookups go on."""
    server = ErrorServer(READONLY, only=frozenset({b"SET"}))
    try:
        for store, rig in _rig(server.url, path):
            rig.store_job(1, chunks(SRC))
            assert store.breaker.state is BreakerState.CLOSED
            assert _refused(store).get("refused_readonly", 0) >= 1
            assert store.exists([chunks(DST)[0].redis_key]) == [False]
            assert store.breaker.state is BreakerState.CLOSED
    finally:
        server.close()


def test_a_replica_cut_from_its_master_is_an_outage(path: str) -> None:
    """A real replica whose master is gone, with ``replica-serve-stale-data no``, answers
    GET with MASTERDOWN: the load fails and the breaker opens."""
    replica = LocalRedis().start()
    admin = redis.Redis(port=replica.port)
    admin.config_set("replica-serve-stale-data", "no")
    admin.replicaof("127.0.0.1", free_port())  # a master that is not there
    admin.close()
    try:
        for store, rig in _rig(replica.url, path):
            assert not rig.load_job(1, chunks(DST)).ok
            assert store.breaker.state is BreakerState.OPEN
            assert _refused(store) == {}
    finally:
        replica.stop()
