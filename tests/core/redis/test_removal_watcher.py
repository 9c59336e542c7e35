"""The removal watcher through outages: Redis down at start, restarted with its flags reset, a
Cluster failover. Real servers, no mocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.client import RedisClient, make_client
from hma_redis.core.redis.notifications import NotificationState, RemovalWatcher, missing_flags
from hma_redis.tools.devkit.cluster import LocalCluster
from hma_redis.tools.devkit.local_redis import LocalRedis, free_port

USER, PASSWORD = "tier", "watch-s3cret"
KEYSPACE = KeySpace("hma", "watched")
# The watcher backs off up to 10 s between tries: every wait here allows several tries.
WAIT_S = 60.0


def _cfg(url: str) -> RedisTierConfig:
    return RedisTierConfig.from_extra_config(
        {"redis_url": url, "connect_timeout_s": 0.5, "read_timeout_s": 1.0}, env={}
    )


def _watcher(url: str, **kwargs: object) -> RemovalWatcher:
    return RemovalWatcher(_cfg(url), KEYSPACE.block_pattern(), **kwargs).start()  # type: ignore[arg-type]


def _until(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _keys(count: int, salt: int = 0) -> list[str]:
    return [KEYSPACE.block_key(0, (salt * 1000 + i).to_bytes(32, "big")) for i in range(count)]


def _removals_seen(
    watcher: RemovalWatcher, writer: redis.Redis | RedisCluster, keys: list[str]
) -> bool:
    """Write and unlink ``keys``; whether the watcher reports every one within the wait."""
    for key in keys:
        writer.set(key, b"v")
        writer.unlink(key)
    seen: set[str] = set()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not set(keys) <= seen:
        seen.update(watcher.drain()[0])
        time.sleep(0.02)
    return set(keys) <= seen


def _flags(port: int, **creds: str) -> str:
    with redis.Redis(port=port, socket_timeout=5, **creds) as client:  # type: ignore[arg-type]
        return str(client.config_get("notify-keyspace-events")["notify-keyspace-events"])


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    """A private server (the test stops and restarts it on its port)."""
    local = LocalRedis().start()
    yield local
    local.stop()


def _counting_factory(tries: list[float]) -> Callable[[RedisTierConfig], RedisClient]:
    """A client factory that records when each client was asked for (the watcher's tries)."""

    def factory(cfg: RedisTierConfig) -> RedisClient:
        tries.append(time.monotonic())
        return make_client(cfg)

    return factory


def test_watcher_started_while_redis_is_down_sets_the_flags_and_watches_once_it_is_up() -> None:
    port = free_port()
    watcher = _watcher(f"redis://127.0.0.1:{port}/0")
    later: LocalRedis | None = None
    try:
        time.sleep(1.0)  # the first tries fail
        later = LocalRedis(port=port).start()
        with redis.Redis(port=port) as writer:
            _until("removals heard", lambda: _removals_seen(watcher, writer, _keys(5)))
        assert watcher.state is NotificationState.ON
        assert not missing_flags(_flags(port))
    finally:
        watcher.close()
        if later is not None:
            later.stop()


def test_removals_are_seen_again_after_a_restart_that_reset_the_flags(server: LocalRedis) -> None:
    watcher = _watcher(server.url)
    try:
        assert watcher.wait_subscribed(10.0)
        assert watcher.state is NotificationState.ON
        server.kill()
        server.stop()
        server = LocalRedis(port=server.port).start()  # its flags are the default: none
        with redis.Redis(port=server.port) as writer:
            _until("removals heard again", lambda: _removals_seen(watcher, writer, _keys(5)))
        assert watcher.state is NotificationState.ON
        assert not missing_flags(_flags(server.port))
    finally:
        watcher.close()
        server.stop()


def test_state_says_unreachable_while_redis_is_down_and_off_when_its_flags_are_lost(
    server: LocalRedis,
) -> None:
    """The state is never "on" while removals cannot arrive: Redis down (unreachable), or
    restarted without the flags where the watcher may not set them (not enabled)."""
    with redis.Redis(port=server.port) as admin:
        admin.config_set("notify-keyspace-events", "Kgxe")
    watcher = _watcher(server.url, allow_config_set=False)
    try:
        assert watcher.wait_subscribed(10.0)
        assert watcher.state is NotificationState.ON
        server.kill()
        _until("the state to leave on", lambda: watcher.state is NotificationState.UNREACHABLE)
        server.stop()
        server = LocalRedis(port=server.port).start()
        _until("the watcher to resubscribe", lambda: watcher.wait_subscribed(0.1))
        assert watcher.state is NotificationState.NOT_ENABLED
        assert "Kgxe" in watcher.detail
    finally:
        watcher.close()
        server.stop()


def test_watcher_started_while_the_cluster_is_down_watches_every_master_once_it_is_up() -> None:
    cluster = LocalCluster(masters=3, username=USER, password=PASSWORD)
    tries: list[float] = []
    factory = _counting_factory(tries)
    before = set(threading.enumerate())
    watcher = _watcher(cluster.url, client_factory=factory)
    try:
        time.sleep(1.0)
        assert watcher.state is NotificationState.UNREACHABLE
        cluster.start()
        writer = make_client(_cfg(cluster.url))
        try:
            _until("removals on every master", lambda: _removals_seen(watcher, writer, _keys(30)))
        finally:
            writer.close()
        assert watcher.state is NotificationState.ON
        assert len(watcher.watched_nodes()) == 3
        assert watcher.detail.endswith(" (all 3 nodes)"), watcher.detail
        # One thread per master, numbered from 0 (its number is the node's in the logs).
        assert sorted(_node_threads(before)) == [f"hma-removals-{i}" for i in range(3)]
        # Down again: the masters are asked for again and again (with back-off), never given up.
        cluster.stop()
        asked = len(tries)
        _until("the masters asked for 3 more times", lambda: len(tries) >= asked + 3, 15.0)
    finally:
        watcher.close()
        cluster.stop()


def _node_threads(before: set[threading.Thread]) -> list[str]:
    """Names of the node threads started since ``before`` that are still alive."""
    return [
        t.name
        for t in threading.enumerate()
        if t not in before and t.name.startswith("hma-removals-")
    ]


def _role(cluster: LocalCluster, port: int) -> str:
    with redis.Redis(port=port, username=USER, password=PASSWORD, socket_timeout=5) as client:
        return str(client.info("replication")["role"])


def test_a_master_promoted_by_a_cluster_failover_is_watched() -> None:
    """CLUSTER FAILOVER on a replica, then the old master stops: the watcher finds the
    promoted master, sets its flags and hears its removals; a master that stops with no
    replica to take over leaves the state degraded, never on."""
    cluster = LocalCluster(
        masters=3, replicas=1, node_timeout_ms=2000, username=USER, password=PASSWORD
    )
    cluster.start()
    tries: list[float] = []
    factory = _counting_factory(tries)
    before = set(threading.enumerate())
    watcher = _watcher(cluster.url, client_factory=factory)
    try:
        assert watcher.wait_subscribed(WAIT_S)
        assert watcher.state is NotificationState.ON
        old = next(p for p in cluster.ports if _role(cluster, p) == "master")
        promoted = cluster.replica_of(old)
        cluster.failover(promoted)
        next(n for n in cluster.nodes if n.port == old).kill()

        writer = make_client(_cfg(cluster.url))
        try:
            keys = _keys(30, salt=1)
            assert promoted in {writer.get_node_from_key(k).port for k in keys}
            _until("removals on the promoted master", lambda: _removals_seen(watcher, writer, keys))
        finally:
            writer.close()
        assert not missing_flags(_flags(promoted, username=USER, password=PASSWORD))
        assert watcher.state is NotificationState.ON
        watched = watcher.watched_nodes()
        assert f"127.0.0.1:{promoted}" in watched and f"127.0.0.1:{old}" not in watched
        # The thread of the node that is no master any more stops: one thread per watched node.
        _until("the old master's thread to stop", lambda: len(_node_threads(before)) == 3)

        asked = len(tries)
        next(n for n in cluster.nodes if n.port == promoted).kill()  # no replica left
        _until("the state to say degraded", lambda: watcher.state is NotificationState.DEGRADED)
        assert "1 of 3" in watcher.detail
        # The loss makes the watcher ask for the masters again: the same three (the lost one
        # still owns its slots). A search that changed nothing leaves the searching thread on.
        _until("the masters asked for again", lambda: len(tries) > asked)
        time.sleep(1.0)
        assert len(watcher.watched_nodes()) == 3
        searching = [
            t for t in threading.enumerate() if t not in before and t.name == "hma-removals"
        ]
        assert searching and searching[0].is_alive()
    finally:
        watcher.close()
        cluster.stop()
