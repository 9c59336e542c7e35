"""The store through Redis Sentinel, across real failovers (no mocks).

One master, one replica, one sentinel (quorum 1, down-after 1 s). The data servers have an ACL
user that the URL names, so the credentials are shown to reach whichever server is master.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from hma_redis.core.config import EndpointKind, RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.store import RedisBlockStore, RedisUnavailableError
from hma_redis.tools.devkit.cluster import LocalSentinel
from tests.support.cluster_servers import started_sentinel
from tests.support.redis_server import store_connections

USER, PASSWORD = "tier", "sentinel-s3cret"
READ_TIMEOUT_S = 1.0
# From the moment the sentinel names a new master until the store writes to it again: one
# breaker interval plus a reconnect, with plenty of slack for a busy 2-core machine.
RECOVERY_BOUND_S = 10.0


@pytest.fixture(scope="module")
def sentinel() -> Iterator[LocalSentinel]:
    """Shared by the tests that leave the topology as it is."""
    setup = started_sentinel(USER, PASSWORD)
    yield setup
    setup.stop()


@pytest.fixture
def fresh_sentinel() -> Iterator[LocalSentinel]:
    """A setup of its own for a test that fails the master over or kills it."""
    setup = started_sentinel(USER, PASSWORD)
    yield setup
    setup.stop()


def _store(url: str, **overrides: object) -> RedisBlockStore:
    extra = {"redis_url": url, "read_timeout_s": READ_TIMEOUT_S, "retry_interval_s": 0.5}
    return RedisBlockStore(RedisTierConfig.from_extra_config({**extra, **overrides}, env={}))


def _keys(namespace: str, n: int) -> list[str]:
    ks = KeySpace("hma", namespace)
    return [ks.block_key(0, i.to_bytes(8, "big")) for i in range(n)]


@pytest.mark.parametrize(
    ("url", "hosts", "service", "db", "tls"),
    [
        (
            "redis+sentinel://s1:26380,s2/mymaster",
            (("s1", 26380), ("s2", 26379)),
            "mymaster",
            0,
            False,
        ),
        ("redis+sentinel://u:pw@s1/cache/4", (("s1", 26379),), "cache", 4, False),
        ("rediss+sentinel://[::1]:5000/m/1", (("::1", 5000),), "m", 1, True),
    ],
)
def test_sentinel_url_forms(
    url: str, hosts: tuple[tuple[str, int], ...], service: str, db: int, tls: bool
) -> None:
    cfg = RedisTierConfig.from_extra_config({"redis_url": url}, env={})
    topo = cfg.endpoint
    assert (topo.kind, topo.hosts, topo.service, cfg.db, cfg.tls) == (
        EndpointKind.SENTINEL,
        hosts,
        service,
        db,
        tls,
    )
    assert ":pw@" not in cfg.redacted_url


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("redis+sentinel://u:pw@s1:26379/", "service name"),
        ("redis+sentinel://u:pw@s1:26379/m/x", "db in redis_url"),
        ("redis+sentinel://u:pw@s1:26379/m/0/extra", "has the form"),
        ("redis+sentinel://u:pw@s1:port/m", "invalid host or port"),
    ],
)
def test_bad_sentinel_urls_fail_with_one_redacted_line(url: str, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        RedisTierConfig.from_extra_config({"redis_url": url}, env={})
    assert ":pw@" not in str(info.value) and "\n" not in str(info.value)


def test_sentinel_url_reaches_the_master_with_the_tier_options(sentinel: LocalSentinel) -> None:
    url = sentinel.url.removesuffix("/0") + "/3"  # database 3 of the service's master
    store = _store(url, connect_timeout_s=0.7, pool_size=3)
    keys = _keys("basic", 20)
    assert store.put_if_absent([(k, b"v") for k in keys]) == [PutResult.STORED] * 20
    assert store.put_if_absent([(keys[0], b"w")]) == [PutResult.EXISTED]
    assert store.exists([*keys, "hma:basic:g0:none"]) == [True] * 20 + [False]
    assert store.get(keys[:2]) == [b"v", b"v"]

    master = sentinel.master_port()
    with sentinel.data_client(master, db=3) as client:
        assert client.get(keys[0]) == b"v"
    with sentinel.data_client(master, db=0) as client:
        assert client.get(keys[0]) is None

    pool = store.client.connection_pool
    assert isinstance(pool, redis.BlockingConnectionPool)
    assert pool.max_connections == 3
    kwargs = pool.connection_kwargs
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (READ_TIMEOUT_S, 0.7)
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == (USER, PASSWORD, 3)
    assert kwargs["retry"].get_retries() == 0
    for node in pool.sentinel_manager.sentinels:  # the sentinels get the same timeouts
        sentinel_kwargs = node.connection_pool.connection_kwargs
        assert sentinel_kwargs["socket_timeout"] == READ_TIMEOUT_S
        assert sentinel_kwargs["retry"].get_retries() == 0
    store.close()


def test_a_sentinel_store_names_its_connections_to_the_master_and_the_sentinel(
    sentinel: LocalSentinel,
) -> None:
    store = _store(sentinel.url)
    try:
        assert store.exists(_keys("named", 3)) == [False] * 3
        with sentinel.data_client(sentinel.master_port()) as master:
            assert store_connections(master, store.client_name) >= 1
        with sentinel.sentinel_client() as client:
            assert store_connections(client, store.client_name) >= 1
    finally:
        store.close()


def test_wrong_password_is_one_redacted_line(sentinel: LocalSentinel) -> None:
    url = sentinel.url.replace(PASSWORD, "not-the-password")
    store = _store(url)
    with pytest.raises(RedisUnavailableError) as info:
        store.ping()
    message = str(info.value)
    assert "not-the-password" not in message and "***" in message and "\n" not in message
    assert store.exists(["hma:x:g0:00"]) == [False]
    store.close()


def test_unreachable_sentinels_degrade_and_never_raise() -> None:
    from hma_redis.tools.devkit.local_redis import free_port

    store = _store(f"redis+sentinel://127.0.0.1:{free_port()}/nobody/0", retry_interval_s=0.05)
    assert store.exists(["hma:x:g0:00"]) == [False]
    time.sleep(0.06)
    assert store.put_if_absent([("hma:x:g0:00", b"v")]) == [PutResult.FAILED]
    assert store.breaker.state is BreakerState.OPEN
    with pytest.raises(RedisUnavailableError, match="nobody"):
        store.ping()
    store.close()


class _Writer(threading.Thread):
    """Writes a new block and looks up the old ones every 50 ms; records what it saw."""

    def __init__(self, store: RedisBlockStore, old_keys: list[str]) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.old_keys = old_keys
        self.stop_event = threading.Event()
        self.log: list[tuple[float, PutResult, bool, float]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        i = 0
        try:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                (put,) = self.store.put_if_absent([(f"hma:writer:g0:{i:08x}", b"w")])
                found = all(self.store.exists(self.old_keys))
                self.log.append((t0, put, found, time.monotonic() - t0))
                i += 1
                time.sleep(0.05)
        except BaseException as exc:
            self.error = exc

    def recovered_since(self, since: float, master: redis.Redis, n: int = 5) -> bool:
        """The last ``n`` rounds started after ``since`` and succeeded, on ``master``."""
        tail = self.log[-n:]
        if len(tail) < n or not all(
            t > since and put is PutResult.STORED and found for t, put, found, _ in tail
        ):
            return False
        return bool(master.get(f"hma:writer:g0:{len(self.log) - 1:08x}") == b"w")


def _run_through(setup: LocalSentinel, break_master: str) -> None:
    store = _store(setup.url)
    old_keys = _keys("before", 30)
    assert store.put_if_absent([(k, b"v") for k in old_keys]) == [PutResult.STORED] * 30
    setup.wait_replicated()  # what the old master acknowledged reached the replica
    old_master = setup.master_port()

    writer = _Writer(store, old_keys)
    writer.start()
    time.sleep(0.5)
    t_break = time.monotonic()
    if break_master == "failover":
        setup.failover()
    else:
        setup.server(old_master).kill()
        setup.wait_for_new_master(old_master)
    t_new = time.monotonic()
    new_master = setup.master_port()
    assert new_master != old_master
    master = setup.data_client(new_master)
    deadline = t_new + RECOVERY_BOUND_S
    while time.monotonic() < deadline and not writer.recovered_since(t_new, master):
        time.sleep(0.1)
    recovered_after = time.monotonic() - t_new
    recovered = writer.recovered_since(t_new, master)
    writer.stop_event.set()
    writer.join(10)
    assert writer.error is None, f"the store raised: {writer.error!r}"
    # The store writes to the new master again (and finds the replicated blocks there).
    assert recovered, (
        f"the store did not write to the new master within {RECOVERY_BOUND_S}s of its "
        f"promotion (failover took {t_new - t_break:.1f}s); last rounds: {writer.log[-5:]}"
    )
    took = t_new - t_break
    print(f"failover {took:.2f}s, then the store on the new master in {recovered_after:.2f}s")
    # No single call waited longer than the timeouts allow (no retry storm, no hang).
    assert max(took for *_, took in writer.log) < 2 * READ_TIMEOUT_S + 1.0
    assert master.exists(*old_keys) == len(old_keys)
    master.close()
    assert store.breaker.state is BreakerState.CLOSED
    store.close()


def test_store_follows_a_sentinel_failover(fresh_sentinel: LocalSentinel) -> None:
    _run_through(fresh_sentinel, "failover")


def test_store_survives_the_master_being_killed(fresh_sentinel: LocalSentinel) -> None:
    _run_through(fresh_sentinel, "kill")
