"""Redis' used/max memory as the scheduler's Prometheus gauges, against real Redis servers:
the figures INFO gives, summed over a Cluster's masters, asked at most once per interval, and
simply absent (nothing else changing) under an ACL that refuses INFO."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.metrics import RedisMetricName
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.memory import MemoryPoller, TierMemory
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.cluster import LocalCluster
from tests.support.acl import documented_tier_rules
from tests.support.cluster_servers import started_cluster
from tests.support.redis_server import LocalRedis, command_calls

R = RedisMetricName
MIB = 1024 * 1024


def _manager(url: str, interval_s: float = 0.0) -> RedisOffloadingManager:
    cfg = RedisTierConfig.from_extra_config({"redis_url": url}, env={})
    keyspace = KeySpace("hma", "mem")
    store = RedisBlockStore(cfg, stats_key=keyspace.stats_key())
    return RedisOffloadingManager(store, keyspace, memory_poll_interval_s=interval_s)


def _gauges(manager: RedisOffloadingManager) -> dict[str, float]:
    """The memory gauges of the manager's next report, from a fetch started by this call: one
    still in flight from an earlier report (started before what the test did since) is
    finished and taken first."""
    manager._memory.wait(10.0)
    manager.get_stats()  # takes what an earlier fetch found; starts one now (never waits)
    manager._memory.wait(10.0)
    stats = manager.get_stats()
    reduced = {} if stats is None else stats.reduce()
    return {k: v for k, v in reduced.items() if k in (R.USED_MEMORY_BYTES, R.MAX_MEMORY_BYTES)}


def _store_values(store: RedisBlockStore, count: int, size: int) -> None:
    items = [(f"hma:mem:g0:{i:064x}", bytes([i % 251]) * size) for i in range(count)]
    assert store.put_if_absent(items) == [PutResult.STORED] * count


@pytest.fixture
def limited_redis() -> Iterator[LocalRedis]:
    """A private redis-server with a 256 MiB maxmemory."""
    server = LocalRedis(extra_args=["--maxmemory", "256mb"]).start()
    yield server
    server.stop()


def test_gauges_are_what_info_memory_says_after_values_are_stored(
    limited_redis: LocalRedis,
) -> None:
    manager = _manager(limited_redis.url)
    admin = redis.Redis(port=limited_redis.port)
    try:
        before = _gauges(manager)
        _store_values(manager._store, 8, MIB)
        after = _gauges(manager)
        info = admin.info("memory")
        assert after[R.MAX_MEMORY_BYTES] == info["maxmemory"] == 256 * MIB
        # used_memory moves with every connection's buffers: equal to INFO's within 64 KiB,
        # and grown by the 8 MiB stored.
        assert abs(after[R.USED_MEMORY_BYTES] - info["used_memory"]) < 64 * 1024
        assert after[R.USED_MEMORY_BYTES] - before[R.USED_MEMORY_BYTES] >= 8 * MIB
    finally:
        admin.close()
        manager.shutdown()


def test_no_limit_is_a_max_of_zero(redis_url: str, redis_client: redis.Redis) -> None:
    saved = redis_client.config_get("maxmemory")["maxmemory"]
    redis_client.config_set("maxmemory", 0)
    manager = _manager(redis_url)
    try:
        assert _gauges(manager)[R.MAX_MEMORY_BYTES] == 0
    finally:
        manager.shutdown()
        redis_client.config_set("maxmemory", saved)


def test_under_the_documented_tier_acl_the_gauges_are_absent_and_the_tier_works(
    local_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The recommended ACL has no INFO: no gauge, one INFO line saying why, no refusal
    counted, Redis still available, lookups and stores as before. ``+info`` (as the doc says)
    brings the gauges."""
    admin = redis.Redis(port=local_redis.port)
    admin.execute_command("ACL", "SETUSER", "hma-tier", ">pw", *documented_tier_rules())
    url = f"redis://hma-tier:pw@127.0.0.1:{local_redis.port}/0"
    manager = _manager(url)
    try:
        with caplog.at_level(logging.INFO, logger="hma_redis"):
            for _ in range(3):
                assert _gauges(manager) == {}
        said = [r for r in caplog.records if "refused INFO" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.INFO
        assert "+info" in said[0].getMessage()
        store = manager._store
        assert store.breaker.state is BreakerState.CLOSED
        assert not any(v for k, v in store.counters.snapshot().items() if k.startswith("refused"))
        _store_values(store, 2, 1024)
        assert store.exists([f"hma:mem:g0:{i:064x}" for i in range(3)]) == [True, True, False]

        admin.execute_command("ACL", "SETUSER", "hma-tier", "+info")
        assert set(_gauges(manager)) == {R.USED_MEMORY_BYTES, R.MAX_MEMORY_BYTES}
    finally:
        admin.close()
        manager.shutdown()


class _InfoCalls:
    """INFO calls a server answered to others than this counter (which reads them with INFO:
    each read counts in the next one's figure, not in its own)."""

    def __init__(self, admin: redis.Redis) -> None:
        self._admin = admin
        self._reads = 0
        self._start = self._read()

    def _read(self) -> int:
        self._reads += 1
        return command_calls(self._admin).get("info", 0)

    def since_start(self) -> int:
        value = self._read()
        return value - self._start - (self._reads - 1)


def test_redis_is_asked_at_most_once_per_interval(local_redis: LocalRedis) -> None:
    """Counted on the server: reports within the interval ask nothing; the first report at or
    after it asks once more."""
    now = [1000.0]
    cfg = RedisTierConfig.from_extra_config({"redis_url": local_redis.url}, env={})
    store = RedisBlockStore(cfg)
    poller = MemoryPoller(store.memory, interval_s=10.0, clock=lambda: now[0])
    admin = redis.Redis(port=local_redis.port)
    try:
        calls = _InfoCalls(admin)
        assert poller.take() is None  # starts the first fetch, never waits for it
        poller.wait(10.0)
        assert calls.since_start() == 1
        found = [poller.take() for _ in range(50)]
        assert found[0] is not None and found[1:] == [None] * 49
        now[0] += 9.9
        assert [poller.take() for _ in range(50)] == [None] * 50
        poller.wait(10.0)
        assert calls.since_start() == 1
        now[0] += 0.1
        assert poller.take() is None
        poller.wait(10.0)
        assert poller.take() is not None
        assert calls.since_start() == 2
    finally:
        admin.close()
        poller.close()
        store.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    server = started_cluster("tier", "cluster-s3cret")
    yield server
    server.stop()


def test_a_clusters_gauges_sum_its_masters(cluster: LocalCluster) -> None:
    cluster.flushall()
    limits = [64 * MIB, 128 * MIB, 192 * MIB]
    clients = cluster.clients()
    for client, limit in zip(clients, limits, strict=True):
        client.config_set("maxmemory", limit)
    manager = _manager(cluster.url)
    try:
        _store_values(manager._store, 6, 256 * 1024)
        gauges = _gauges(manager)
        used = [client.info("memory")["used_memory"] for client in clients]
        assert gauges[R.MAX_MEMORY_BYTES] == sum(limits)
        assert abs(gauges[R.USED_MEMORY_BYTES] - sum(used)) < 3 * 64 * 1024
        reading = manager._store.memory()
        assert isinstance(reading, TierMemory)
        assert [n.node for n in reading.nodes] == [f"127.0.0.1:{p}" for p in sorted(cluster.ports)]

        clients[1].config_set("maxmemory", 0)  # one master without a limit: the tier has none
        assert _gauges(manager)[R.MAX_MEMORY_BYTES] == 0
    finally:
        for client in clients:
            client.config_set("maxmemory", 0)
            client.close()
        manager.shutdown()
