"""Replies of the wrong shape to the store's calls besides lookups, one by one, over a real
socket (:class:`~tests.support.shape_server.ShapeServer`, honest but for the reply under test):
the connection set-up (HELLO, CLIENT SETNAME), UNLINK, INFO, HGETALL of the info hash, the pins
set, CONFIG and the keyspace notifications. A guarded call degrades (an outage: the breaker
opens); a call whose caller takes Redis' errors raises ``RedisError``; nothing raises anything
else, and the removal watcher's thread survives a message of the wrong shape."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from redis.exceptions import RedisError

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import pins
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.memory import MemoryRefused, TierMemory
from hma_redis.core.redis.notifications import RemovalWatcher, ensure_flags
from hma_redis.core.redis.reply_shapes import WrongReply
from hma_redis.core.redis.store import RedisBlockStore
from tests.support.shape_server import ShapeServer

KEYS = [f"hma:shapes:g0:{n:064x}" for n in range(3)]


@pytest.fixture
def server() -> Iterator[ShapeServer]:
    shapes = ShapeServer(hostile=False)
    yield shapes
    shapes.close()


@pytest.fixture
def store(server: ShapeServer) -> Iterator[RedisBlockStore]:
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": server.url, "retry_interval_s": 60, "read_timeout_s": 2}, env={}
    )
    made = RedisBlockStore(cfg)
    yield made
    made.close()


@pytest.mark.parametrize(
    "command, reply",
    [(b"HELLO", b"+OK\r\n"), (b"HELLO", b":7\r\n"), (b"CLIENT SETNAME", b":7\r\n")],
    ids=["hello-status", "hello-integer", "setname-integer"],
)
def test_a_connection_set_up_answered_in_the_wrong_shape_is_an_outage_not_a_hit(
    server: ShapeServer, store: RedisBlockStore, command: bytes, reply: bytes
) -> None:
    """The lookup that opened the connection misses (the honest server would say "every
    chunk is there") and the breaker opens; nothing else is raised."""
    server.fixed[command] = reply
    assert store.exists(KEYS) == [False] * len(KEYS)
    assert store.breaker.state is BreakerState.OPEN


def test_unlink_answered_with_a_status_is_an_outage_not_an_error(
    server: ShapeServer, store: RedisBlockStore
) -> None:
    server.fixed[b"UNLINK"] = b"+OK\r\n"
    assert store.delete(KEYS) == 0
    assert store.breaker.state is BreakerState.OPEN


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


@pytest.mark.parametrize(
    "reply", [b":7\r\n", b"*1\r\n:1\r\n", _bulk(b"# Memory\r\nused_memory:\r\n")]
)
def test_info_of_the_wrong_shape_is_no_figures(
    server: ShapeServer, store: RedisBlockStore, reply: bytes
) -> None:
    server.fixed[b"INFO"] = reply
    assert isinstance(store.memory(), MemoryRefused)
    assert store.breaker.state is BreakerState.CLOSED
    del server.fixed[b"INFO"]
    assert isinstance(store.memory(), TierMemory)


@pytest.mark.parametrize("reply", [b":7\r\n", b"*2\r\n$1\r\na\r\n*0\r\n", b"+OK\r\n"])
def test_the_info_hash_read_in_the_wrong_shape_raises_a_redis_error(
    server: ShapeServer, store: RedisBlockStore, reply: bytes
) -> None:
    server.fixed[b"HGETALL"] = reply
    with pytest.raises(WrongReply):
        store.read_hash("hma:shapes:info")
    del server.fixed[b"HGETALL"]
    assert store.read_hash("hma:shapes:info") == {"model": "m"}


@pytest.mark.parametrize("reply", [b":7\r\n", b"*1\r\n:7\r\n", b"*1\r\n*0\r\n"])
def test_a_pins_sweep_answered_in_the_wrong_shape_is_an_outage_not_an_error(
    server: ShapeServer, store: RedisBlockStore, reply: bytes
) -> None:
    server.fixed[b"ZRANGEBYSCORE"] = reply
    assert store.sweep_pins("hma:shapes:pins", 60) is None
    assert store.breaker.state is BreakerState.OPEN


@pytest.mark.parametrize("reply", [b":7\r\n", b"*2\r\n$1\r\na\r\n$1\r\nx\r\n", b"*1\r\n:1\r\n"])
def test_the_pins_listed_in_the_wrong_shape_raise_a_redis_error(
    server: ShapeServer, store: RedisBlockStore, reply: bytes
) -> None:
    server.fixed[b"ZRANGE"] = reply
    with pytest.raises(RedisError):
        pins.list_pins(store.client, "hma:shapes:pins")


@pytest.mark.parametrize(
    "command, reply",
    [
        (b"CONFIG GET", b":7\r\n"),
        (b"CONFIG GET", b"%1\r\n$22\r\nnotify-keyspace-events\r\n*0\r\n"),
        (b"CONFIG SET", b":7\r\n"),
    ],
    ids=["get-integer", "get-nested", "set-integer"],
)
def test_config_answered_in_the_wrong_shape_raises_a_redis_error(
    server: ShapeServer, store: RedisBlockStore, command: bytes, reply: bytes
) -> None:
    """ensure_flags raises outages (its caller, the removal watcher, reconnects with back-off):
    a CONFIG SET that said something else than OK never counts as flags set."""
    server.fixed[b"CONFIG GET"] = b"%1\r\n$22\r\nnotify-keyspace-events\r\n$0\r\n\r\n"
    server.fixed[command] = reply
    with pytest.raises(RedisError):
        ensure_flags(store.client)


@pytest.mark.parametrize(
    "message",
    [
        b"*4\r\n$8\r\npmessage\r\n$1\r\np\r\n$22\r\n__keyspace@0__:hma:k:1\r\n:7\r\n",
        b"*4\r\n$8\r\npmessage\r\n$1\r\np\r\n$7\r\nnocolon\r\n$3\r\ndel\r\n",
        b":7\r\n",
    ],
    ids=["integer-event", "channel-without-key", "integer"],
)
def test_a_notification_of_the_wrong_shape_is_a_lost_connection_not_a_dead_watcher(
    server: ShapeServer, message: bytes
) -> None:
    """The node's thread lives on: it reports the overflow (removals may have been missed,
    cached answers are forgotten) and subscribes again."""
    confirm = b"*3\r\n$10\r\npsubscribe\r\n$1\r\np\r\n:1\r\n"
    server.fixed[b"PSUBSCRIBE"] = confirm + message
    died: list[threading.ExceptHookArgs] = []
    previous, threading.excepthook = threading.excepthook, died.append
    cfg = RedisTierConfig.from_extra_config({"redis_url": server.url}, env={})
    watcher = RemovalWatcher(cfg, KeySpace("hma", "shapes").block_pattern()).start()
    try:
        deadline = time.monotonic() + 10
        while server.counts[b"PSUBSCRIBE"] < 2:
            assert time.monotonic() < deadline, "the watcher did not subscribe again"
            time.sleep(0.05)
        assert watcher.drain()[1], "the lost messages are not reported as an overflow"
        assert not died, [d.exc_value for d in died]
    finally:
        watcher.close()
        threading.excepthook = previous
