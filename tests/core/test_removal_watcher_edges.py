"""The removal watcher's edges on a real Redis: a refused CONFIG is reported, not raised; the
drain bound counts every removal it drops and reports an overflow once."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.notifications import NotificationState, RemovalWatcher, ensure_flags
from hma_redis.tools.devkit.local_redis import LocalRedis

KEYSPACE = KeySpace("hma", "watcher-edges")
WAIT_S = 30.0


def _until(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _unlink_new(client: redis.Redis, count: int, salt: int) -> None:
    for i in range(count):
        key = KEYSPACE.block_key(0, (salt * 1000 + i).to_bytes(32, "big"))
        client.set(key, b"v")
        client.unlink(key)


def test_a_refused_config_get_is_reported_not_raised(redis_client: redis.Redis) -> None:
    redis_client.acl_setuser(
        "no-config", enabled=True, passwords=["+pw-edge"], keys=["*"], commands=["+@all", "-config"]
    )
    try:
        port = redis_client.connection_pool.connection_kwargs["port"]
        with redis.Redis(port=port, username="no-config", password="pw-edge") as client:
            outcome = ensure_flags(client)
        assert (outcome.before, outcome.after, outcome.enabled) == (None, None, False)
        assert outcome.error.startswith("CONFIG GET refused")
    finally:
        redis_client.acl_deluser("no-config")


def test_drain_returns_exactly_limit_keys_and_counts_every_removal_it_drops(
    redis_url: str, redis_client: redis.Redis
) -> None:
    cfg = RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={})
    watcher = RemovalWatcher(cfg, KEYSPACE.block_pattern()).start()
    try:
        assert watcher.wait_subscribed(WAIT_S)
        _unlink_new(redis_client, 3, salt=1)
        _until("3 removals", lambda: watcher.received >= 3)
        keys, overflowed = watcher.drain(limit=3)  # exactly the bound: all returned
        assert (len(keys), overflowed, watcher.dropped) == (3, False, 0)
        _unlink_new(redis_client, 4, salt=2)
        _until("7 removals", lambda: watcher.received >= 7)
        assert watcher.drain(limit=3) == ([], True)
        _unlink_new(redis_client, 4, salt=3)
        _until("11 removals", lambda: watcher.received >= 11)
        assert watcher.drain(limit=3) == ([], True)
        assert watcher.dropped == 8  # both floods counted
        assert watcher.drain(limit=3) == ([], False)  # an overflow is reported once
    finally:
        watcher.close()


def test_a_lost_connection_is_an_overflow_and_named_in_the_detail_at_once() -> None:
    """The drain right after the loss (before any resubscription) already reports the overflow,
    and the state names the error that cut the connection."""
    server = LocalRedis().start()
    try:
        cfg = RedisTierConfig.from_extra_config(
            {"redis_url": server.url, "connect_timeout_s": 0.5, "read_timeout_s": 1.0}, env={}
        )
        watcher = RemovalWatcher(cfg, KEYSPACE.block_pattern()).start()
        try:
            assert watcher.wait_subscribed(WAIT_S)
            assert watcher.drain() == ([], False)
            server.stop()
            _until("the loss", lambda: watcher.state is NotificationState.UNREACHABLE)
            assert watcher.detail.startswith("ConnectionError: "), watcher.detail
            assert watcher.drain() == ([], True)
        finally:
            watcher.close()
    finally:
        server.stop()
