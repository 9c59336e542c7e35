"""The removal watcher's edges and contracts on a real Redis: a refused CONFIG is reported, not
raised; the drain bound counts every removal it drops and reports an overflow once; its state and
detail before, while and after it subscribes; its threads (named daemons, gone after close, close
bounded even when a node hangs); the back-off of its retries; the flags checked once per
subscription and again at every recheck; every gap in what it heard reported as an overflow; its
default queue bound."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import notifications
from hma_redis.core.redis.client import RedisClient, make_client
from hma_redis.core.redis.notifications import (
    FlagsOutcome,
    NotificationState,
    RemovalWatcher,
    ensure_flags,
    missing_flags,
)
from hma_redis.tools.devkit.local_redis import LocalRedis, free_port
from tests.support.tcp_proxy import BreakingProxy

KEYSPACE = KeySpace("hma", "watcher-edges")
PATTERN = KEYSPACE.block_pattern()
WAIT_S = 30.0
ON, UNREACHABLE = NotificationState.ON, NotificationState.UNREACHABLE


def _until(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _cfg(url: str, read_timeout_s: float = 1.0) -> RedisTierConfig:
    return RedisTierConfig.from_extra_config(
        {"redis_url": url, "connect_timeout_s": 0.5, "read_timeout_s": read_timeout_s}, env={}
    )


def _subscribed(server: LocalRedis, **kwargs: object) -> RemovalWatcher:
    """A started watcher of ``server``, subscribed and with its state worked out."""
    watcher = RemovalWatcher(_cfg(server.url), PATTERN, **kwargs).start()  # type: ignore[arg-type]
    assert watcher.wait_subscribed(WAIT_S)
    _until("the state to say on", lambda: watcher.state is ON)
    return watcher


def _detail_of_a_new_watcher(server: LocalRedis) -> str:
    """The detail a freshly subscribed watcher of ``server`` works out (the watcher closed)."""
    watcher = _subscribed(server)
    try:
        return watcher.detail
    finally:
        watcher.close()


def _config_gets(admin: redis.Redis) -> int:
    stats = admin.info("commandstats").get("cmdstat_config|get", {})
    return int(stats.get("calls", 0))


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before]


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


@pytest.fixture
def admin(local_redis: LocalRedis) -> Iterator[redis.Redis]:
    with redis.Redis(port=local_redis.port, socket_timeout=5) as client:
        yield client


def test_a_watcher_not_started_is_unreachable_watches_nothing_and_closes_quietly() -> None:
    watcher = RemovalWatcher(_cfg(f"redis://127.0.0.1:{free_port()}/0"), PATTERN)
    assert (watcher.state, watcher.detail) == (UNREACHABLE, "not started")
    assert watcher.watched_nodes() == []
    assert watcher.drain() == ([], False)
    watcher.close()


def test_a_standalone_server_is_one_unnamed_node_and_the_detail_says_who_set_its_flags(
    local_redis: LocalRedis,
) -> None:
    """The first watcher turns the flags on and says so; the next finds them on; a single
    node's detail is its own, with no node count."""
    first = _subscribed(local_redis)
    try:
        assert first.watched_nodes() == [""]
        assert first.detail == "notify-keyspace-events set to 'Kgxe'"
    finally:
        first.close()
    assert _detail_of_a_new_watcher(local_redis) == "notify-keyspace-events already on"


def test_ensure_flags_says_what_it_found_and_what_is_in_force(
    local_redis: LocalRedis, admin: redis.Redis
) -> None:
    """Not allowed to set them: found and in force are the same, the error names the missing
    flags. Allowed: in force is what it set. A refused CONFIG SET is reported, not raised."""
    assert ensure_flags(admin, allow_config_set=False) == FlagsOutcome(
        "", "", "flags 'Kgxe' missing"
    )
    admin.acl_setuser(
        "no-set", enabled=True, passwords=["+pw-set"], keys=["*"], commands=["+@all", "-config|set"]
    )
    with redis.Redis(port=local_redis.port, username="no-set", password="pw-set") as limited:
        refused = ensure_flags(limited)
    assert (refused.before, refused.after) == ("", "")
    assert refused.error.startswith("CONFIG SET refused: ") and "pw-set" not in refused.error
    assert ensure_flags(admin) == FlagsOutcome("", "Kgxe")
    assert ensure_flags(admin) == FlagsOutcome("gxeK", "gxeK")  # as Redis spells them


def test_flags_given_as_the_a_alias_count_as_on_and_are_left_alone(
    local_redis: LocalRedis, admin: redis.Redis
) -> None:
    """``A`` stands for ``g$lshzxetd``: with ``AK`` set, nothing is missing or changed."""
    assert missing_flags("AK") == ""
    assert missing_flags("A") == "K"
    admin.config_set("notify-keyspace-events", "AK")
    outcome = ensure_flags(admin)
    assert (outcome.before, outcome.after, outcome.enabled) == ("AK", "AK", True)
    assert _detail_of_a_new_watcher(local_redis) == "notify-keyspace-events already on"


def test_flags_the_watcher_may_not_set_are_named_and_warned_about_once(
    local_redis: LocalRedis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without CONFIG SET the state is not enabled; the detail names the missing flags and
    says what to set; one warning when the state changes, none at each recheck (shortened to
    0.3 s here)."""
    monkeypatch.setattr(notifications, "_FLAGS_RECHECK_S", 0.3)
    caplog.set_level(logging.INFO, logger=notifications.__name__)
    watcher = RemovalWatcher(_cfg(local_redis.url), PATTERN, allow_config_set=False).start()
    try:
        assert watcher.wait_subscribed(WAIT_S)
        _until("the state", lambda: watcher.state is NotificationState.NOT_ENABLED)
        time.sleep(0.8)  # two rechecks or more
        assert watcher.detail == (
            "flags 'Kgxe' missing; set notify-keyspace-events to include 'Kgxe' so routers "
            "learn of evicted and expired chunks"
        )
    finally:
        watcher.close()
    mine = [r for r in caplog.records if r.name == notifications.__name__]
    warnings = [r.getMessage() for r in mine if r.levelno == logging.WARNING]
    assert warnings == [f"hma_redis: removal events are not_enabled: {watcher.detail}"]
    states = [r.getMessage() for r in mine if "removal notifications unreachable" in r.getMessage()]
    assert states == []  # the state never changed to unreachable: it started there


def test_every_watcher_thread_is_a_named_daemon_and_none_outlives_close(
    local_redis: LocalRedis,
) -> None:
    """The node's thread is ``hma-removals-0`` (numbered from 0), a daemon (a process that
    exits without close() is not held up), and stops within close() even while the server
    sends nothing (its socket would time out only after 5 s)."""
    before = set(threading.enumerate())
    cfg = _cfg(local_redis.url, read_timeout_s=5.0)
    watcher = RemovalWatcher(cfg, PATTERN).start()
    try:
        assert watcher.wait_subscribed(WAIT_S)
        threads = _new_threads(before)
        nodes = [(t.name, t.daemon) for t in threads if t.name != "hma-removals"]
        assert nodes == [("hma-removals-0", True)]
        assert all(t.daemon for t in threads)
    finally:
        watcher.close()
    assert [t.name for t in threads if t.is_alive()] == []


def test_a_cluster_that_stays_down_is_retried_with_doubling_back_off_and_named_in_the_state() -> (
    None
):
    """The masters are asked for at once, then after 0.5 s, then after 1 s more; meanwhile the
    state is unreachable and names the error, from a daemon thread named ``hma-removals``."""
    tries: list[float] = []

    def factory(cfg: RedisTierConfig) -> RedisClient:
        tries.append(time.monotonic())
        return make_client(cfg)

    before = set(threading.enumerate())
    url = f"redis+cluster://127.0.0.1:{free_port()}/"
    watcher = RemovalWatcher(_cfg(url), PATTERN, client_factory=factory).start()
    try:
        _until("three tries", lambda: len(tries) >= 3, timeout_s=10.0)
        first_gap, second_gap = tries[1] - tries[0], tries[2] - tries[1]
        # Lower bounds only bind: a busy host stretches a gap (a try's own connect), never
        # shortens it.
        assert 0.45 <= first_gap < 3.0, tries
        assert 0.95 <= second_gap < 3.0, tries
        assert watcher.state is UNREACHABLE
        assert watcher.detail.startswith("ConnectionError: no Redis Cluster node answered")
        threads = _new_threads(before)
        assert [(t.name, t.daemon) for t in threads] == [("hma-removals", True)]
    finally:
        watcher.close()
    assert not any(t.is_alive() for t in threads)


def test_close_returns_within_its_bound_while_a_node_hangs_on_a_paused_server(
    local_redis: LocalRedis,
) -> None:
    """A node whose server stopped answering (its socket times out after 8 s) holds close()
    up for no more than its join bound (1.4 s); until it subscribes, the state says the node
    is not subscribed yet."""
    local_redis.pause()
    try:
        watcher = RemovalWatcher(_cfg(local_redis.url, read_timeout_s=8.0), PATTERN).start()
        try:
            _until("the node to be counted", lambda: watcher.detail != "not started", 5.0)
            assert watcher.watched_nodes() == [""]
            assert (watcher.state, watcher.detail) == (UNREACHABLE, "not subscribed yet")
            time.sleep(0.2)  # the node's thread now waits for its CONFIG GET reply
        finally:
            started = time.monotonic()
            watcher.close()
            took = time.monotonic() - started
        assert took < 2.0, f"close() took {took:.2f} s"
    finally:
        local_redis.resume()


def test_a_server_slower_than_a_poll_to_confirm_the_subscription_is_still_subscribed(
    local_redis: LocalRedis, admin: redis.Redis
) -> None:
    """Every reply comes 0.3 s late (more than the 0.2 s poll): the watcher keeps waiting for
    the confirmation, then hears removals."""
    proxy = BreakingProxy(local_redis.port)
    proxy.reply_delay_s = 0.3
    try:
        watcher = RemovalWatcher(_cfg(proxy.url, read_timeout_s=3.0), PATTERN).start()
        try:
            assert watcher.wait_subscribed(10.0)
            key = KEYSPACE.block_key(0, bytes(32))
            admin.set(key, b"v")
            admin.unlink(key)
            _until("the removal", lambda: watcher.received >= 1, timeout_s=5.0)
            assert watcher.drain() == ([key], False)
        finally:
            watcher.close()
    finally:
        proxy.close()


def test_removals_missed_after_the_drain_that_reported_a_loss_are_reported_on_resubscription(
    local_redis: LocalRedis, admin: redis.Redis
) -> None:
    """A consumer that drained the loss's overflow before the watcher resubscribed may still
    have missed removals made in between: the resubscription reports an overflow again."""
    watcher = _subscribed(local_redis)
    try:
        assert watcher.drain() == ([], False)
        for _ in range(5):
            admin.client_kill_filter(_type="pubsub")
            _until("the loss", lambda: watcher.state is UNREACHABLE)
            assert watcher.drain()[1]  # the loss itself
            if not watcher.wait_subscribed(0.05):
                break  # drained before the resubscription: what this test is about
            _until("the state to say on", lambda: watcher.state is ON)
        else:
            pytest.fail("the watcher resubscribed before every drain")
        assert watcher.wait_subscribed(WAIT_S)
        assert watcher.drain() == ([], True)
    finally:
        watcher.close()


def test_flags_are_read_once_per_subscription_not_again_before_the_recheck(
    local_redis: LocalRedis, admin: redis.Redis
) -> None:
    admin.config_resetstat()
    watcher = _subscribed(local_redis)
    try:
        time.sleep(0.5)  # a couple of polls
        assert _config_gets(admin) == 1
    finally:
        watcher.close()


def test_flags_an_operator_resets_are_set_again_at_every_recheck_and_only_then(
    local_redis: LocalRedis, admin: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the recheck period shortened to 0.5 s: the flags an operator clears come back,
    and CONFIG GET runs about once per period, not on every poll."""
    monkeypatch.setattr(notifications, "_FLAGS_RECHECK_S", 0.5)
    watcher = _subscribed(local_redis)
    try:
        admin.config_set("notify-keyspace-events", "")

        def flags_back() -> bool:
            flags = admin.config_get("notify-keyspace-events")["notify-keyspace-events"]
            return not missing_flags(str(flags))

        _until("the flags to be set again", flags_back, timeout_s=5.0)
        admin.config_resetstat()
        time.sleep(1.6)
        assert 2 <= _config_gets(admin) <= 4
        assert watcher.state is ON
    finally:
        watcher.close()


def test_a_client_that_decodes_replies_still_reports_removals(
    local_redis: LocalRedis, admin: redis.Redis
) -> None:
    """``client_factory`` may give a client with ``decode_responses``: channels and events
    then arrive as text, and the removed keys are the same."""

    def factory(cfg: RedisTierConfig) -> RedisClient:
        return redis.Redis(port=local_redis.port, decode_responses=True, socket_timeout=1.0)

    watcher = _subscribed(local_redis, client_factory=factory)
    try:
        key = KEYSPACE.block_key(0, bytes(32))
        admin.set(key, b"v")
        admin.unlink(key)
        _until("the removal", lambda: watcher.received >= 1, timeout_s=5.0)
        assert watcher.drain() == ([key], False)
    finally:
        watcher.close()


def test_the_default_queue_holds_65536_removals_and_one_more_is_an_overflow(
    local_redis: LocalRedis, admin: redis.Redis
) -> None:
    watcher = _subscribed(local_redis)
    try:
        prefix = KEYSPACE.block_key(0, bytes(32))
        admin.eval(
            "for i = 1, tonumber(ARGV[1]) do"
            " redis.call('set', KEYS[1] .. i, 'v') redis.call('unlink', KEYS[1] .. i) end",
            1,
            prefix,
            65_537,
        )
        _until("every removal", lambda: watcher.received >= 65_537, timeout_s=20.0)
        keys, overflowed = watcher.drain()
        assert (len(keys), overflowed, watcher.dropped) == (65_536, True, 1)
        assert keys[0] == f"{prefix}2" and keys[-1] == f"{prefix}65537"  # the oldest dropped
    finally:
        watcher.close()
