"""The keyspace feed behind ``hma-redis events`` against a real Redis: notifications become key
changes, what they cannot say becomes a resync, and the marker tells a flush from a deletion."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.keyspace_feed import FeedItem, KeyChange, KeyspaceFeed, Resync
from tests.support.redis_server import LocalRedis

KEY = "hma:ns:g0:" + "ab" * 32


@pytest.fixture
def feed(local_redis: LocalRedis) -> Iterator[KeyspaceFeed]:
    feed = KeyspaceFeed(RedisTierConfig(url=local_redis.url), marker_check_s=0.1)
    yield feed
    feed.close()


def _poll_for(feed: KeyspaceFeed, seconds: float) -> list[FeedItem]:
    items: list[FeedItem] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        items += feed.poll(0.02)
    return items


def test_the_first_poll_is_a_resync_of_what_redis_holds(
    local_redis: LocalRedis, feed: KeyspaceFeed
) -> None:
    client = redis.Redis.from_url(local_redis.url)
    client.set(KEY, b"v")
    client.set("hma:ns:info", b"not a chunk")
    items = _poll_for(feed, 0.3)
    assert items[0] == Resync(frozenset({KEY}), False, "started")
    client.delete(KEY)
    client.set(KEY, b"v")
    assert [i for i in _poll_for(feed, 0.5) if isinstance(i, KeyChange)] == [
        KeyChange(KEY, False),
        KeyChange(KEY, True),
    ]
    client.close()


def test_a_deleted_marker_is_written_again_and_a_flush_is_one_cleared_resync(
    local_redis: LocalRedis, feed: KeyspaceFeed
) -> None:
    client = redis.Redis.from_url(local_redis.url)
    _poll_for(feed, 0.3)
    assert client.exists("hma:events")
    client.delete("hma:events")
    assert _poll_for(feed, 0.5) == []  # a deletion announced: no resync
    assert client.exists("hma:events")
    client.flushall()
    client.set(KEY, b"v")  # written after the flush, maybe before the feed noticed it
    items = [i for i in _poll_for(feed, 0.6) if isinstance(i, Resync)]
    assert len(items) == 1 and items[0].cleared and items[0].keys == {KEY}
    client.close()


def test_flags_that_cannot_be_set_are_one_warning_naming_them(
    local_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis.from_url(local_redis.url)
    admin.acl_setuser(
        "tier", enabled=True, passwords=["+pw-feed"], keys=["*"], channels=["*"],
        commands=["+@all", "-config"],
    )  # fmt: skip
    cfg = RedisTierConfig(url=local_redis.url, username="tier", password="pw-feed")
    feed = KeyspaceFeed(cfg)
    try:
        with caplog.at_level(logging.WARNING):
            items = _poll_for(feed, 0.3)
    finally:
        feed.close()
        admin.close()
    assert isinstance(items[0], Resync)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'K$gxe'" in warnings[0], warnings
    assert "pw-feed" not in warnings[0]
