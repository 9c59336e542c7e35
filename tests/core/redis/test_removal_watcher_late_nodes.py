"""Removals on a Cluster master the watcher subscribed to late are reported as an overflow.

A master that joined the Cluster (or was promoted) after the watcher first found the masters
has made removals the watcher never heard: between the change and the watcher's next search
for the masters. The consumer must learn that its list is partial (an overflow: it forgets
what it believes) instead of trusting it. Real Clusters; the watcher's searches for the masters
are held (its client factory waits) while the test changes the Cluster and removes a key on
the new master, so the removal comes before the subscription whatever the timing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import redis
from redis.cluster import key_slot

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import notifications
from hma_redis.core.redis.client import RedisClient, make_client
from hma_redis.core.redis.notifications import NotificationState, RemovalWatcher
from hma_redis.tools.devkit.cluster import LocalCluster
from hma_redis.tools.devkit.local_redis import LocalRedis, free_port

USER, PASSWORD = "tier", "late-s3cret"
KEYSPACE = KeySpace("hma", "late-nodes")
WAIT_S = 60.0
SEARCH_EVERY_S = 0.2  # the watcher's search for the masters, made frequent for the test


def _cfg(url: str) -> RedisTierConfig:
    return RedisTierConfig.from_extra_config(
        {"redis_url": url, "connect_timeout_s": 0.5, "read_timeout_s": 1.0}, env={}
    )


def _until(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _HeldSearches:
    """The watcher's client factory: each search for the masters makes one client; while
    :meth:`hold` is in force the next search waits (the watcher's thread is blocked in it)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._waiting = threading.Event()

    def __call__(self, cfg: RedisTierConfig) -> RedisClient:
        if not self._open.is_set():
            self._waiting.set()
            self._open.wait(WAIT_S)
        return make_client(cfg)

    def hold(self) -> None:
        """Hold the next search, and return once the watcher waits in it (so no search sees
        what the test changes until :meth:`release`)."""
        self._waiting.clear()
        self._open.clear()
        assert self._waiting.wait(WAIT_S), "the watcher never searched for the masters again"

    def release(self) -> None:
        self._open.set()


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> _HeldSearches:
    monkeypatch.setattr(notifications, "_REDISCOVER_S", SEARCH_EVERY_S)
    return _HeldSearches()


def _watching(cluster: LocalCluster, searches: _HeldSearches) -> RemovalWatcher:
    """A watcher of ``cluster``, subscribed to every master, whose overflow so far (if any) is
    drained."""
    watcher = RemovalWatcher(
        _cfg(cluster.url), KEYSPACE.block_pattern(), client_factory=searches
    ).start()
    assert watcher.wait_subscribed(WAIT_S)
    _until("the state to say on", lambda: watcher.state is NotificationState.ON)
    watcher.drain()
    return watcher


def _node(port: int) -> redis.Redis:
    return redis.Redis(port=port, username=USER, password=PASSWORD, socket_timeout=5)


def _remove_on(port: int, key: str) -> None:
    """Write and unlink ``key`` on the master on ``port`` (which serves its slot)."""
    with _node(port) as client:
        client.set(key, b"v")
        client.unlink(key)


def _key_in_a_slot_of(cluster: LocalCluster, port: int) -> str:
    owners = cluster.slot_owners()
    for i in range(100_000):
        key = KEYSPACE.block_key(0, i.to_bytes(32, "big"))
        if owners[key_slot(key.encode())] == port:
            return key
    raise AssertionError(f"no key of the namespace falls in a slot of port {port}")


def _drained_after_subscribing(watcher: RemovalWatcher, port: int) -> tuple[list[str], bool]:
    """Wait until the watcher watches the master on ``port`` and is subscribed everywhere;
    then what a drain returns."""
    name = f"127.0.0.1:{port}"
    _until(f"the watcher to watch {name}", lambda: name in watcher.watched_nodes())
    assert watcher.wait_subscribed(WAIT_S)
    return watcher.drain()


def _joined(cluster: LocalCluster) -> int:
    """A fourth master, started, met by the Cluster and owning no slot yet; its port. It is
    stopped with the Cluster."""
    bus_port = free_port()
    node = LocalRedis(
        extra_args=[
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(bus_port),
            "--cluster-node-timeout", str(cluster.node_timeout_ms),
        ],
    )  # fmt: skip
    node.start()
    cluster.nodes.append(node)
    with redis.Redis(port=node.port, socket_timeout=5) as fresh:
        fresh.acl_setuser(
            USER,
            enabled=True,
            passwords=[f"+{PASSWORD}"],
            keys=["*"],
            channels=["*"],
            commands=["+@all"],
        )
        fresh.acl_setuser("default", enabled=False)
    with _node(cluster.ports[0]) as first:
        first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus_port)

    def everyone_knows_it() -> bool:
        for client in cluster.clients():
            with client:
                if int(client.cluster("info").get("cluster_known_nodes", 0)) != 4:
                    return False
        return True

    _until("every node to know the fourth master", everyone_knows_it)
    return node.port


def _all_ok(cluster: LocalCluster) -> bool:
    """Whether every node, the added one too, says ``cluster_state:ok``."""
    for client in cluster.clients():
        with client:
            if client.cluster("info").get("cluster_state") != "ok":
                return False
    return True


def test_removals_on_a_master_added_before_the_watcher_subscribed_to_it_are_an_overflow(
    searches: _HeldSearches,
) -> None:
    cluster = LocalCluster(masters=3, username=USER, password=PASSWORD).start()
    watcher = _watching(cluster, searches)
    try:
        searches.hold()
        added = _joined(cluster)
        key = _key_in_a_slot_of(cluster, cluster.ports[0])
        cluster.move_slot(key_slot(key.encode()), added)
        _until("every node to serve the moved slot", lambda: _all_ok(cluster))
        _remove_on(added, key)  # a removal no subscription hears
        assert watcher.drain() == ([], False)  # nothing has told the watcher yet
        searches.release()
        keys, overflowed = _drained_after_subscribing(watcher, added)
        assert overflowed, "a removal on the added master was missed without an overflow"
        assert key not in keys
        # From its subscription on, the added master's removals arrive one by one.
        _remove_on(added, key)
        _until("the removal on the added master", lambda: key in watcher.drain()[0])
        assert len(watcher.watched_nodes()) == 4
    finally:
        watcher.close()
        cluster.stop()


def test_removals_on_a_master_promoted_before_the_watcher_subscribed_to_it_are_an_overflow(
    searches: _HeldSearches,
) -> None:
    """CLUSTER FAILOVER on a replica: the old master goes on as its replica, so no connection
    of the watcher drops and nothing else reports a gap."""
    cluster = LocalCluster(
        masters=3, replicas=1, node_timeout_ms=2000, username=USER, password=PASSWORD
    ).start()
    watcher = _watching(cluster, searches)
    try:
        old = next(p for p in cluster.ports if f"127.0.0.1:{p}" in watcher.watched_nodes())
        promoted = cluster.replica_of(old)
        searches.hold()
        cluster.failover(promoted)
        key = _key_in_a_slot_of(cluster, promoted)
        _remove_on(promoted, key)
        searches.release()
        _, overflowed = _drained_after_subscribing(watcher, promoted)
        assert overflowed, "a removal on the promoted master was missed without an overflow"
        _remove_on(promoted, key)
        _until("the removal on the promoted master", lambda: key in watcher.drain()[0])
        assert f"127.0.0.1:{old}" not in watcher.watched_nodes()
    finally:
        watcher.close()
        cluster.stop()
