import os
import time

import pytest
import redis

from hma_redis.core.breaker import BreakerState
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.store import OversizedValue, PutResult, RedisBlockStore, RedisUnavailableError
from hma_redis.tools.demo.local_redis import LocalRedis
from tests.support.redis_server import command_calls, command_delta


def _store(url, **overrides):
    return RedisBlockStore(
        RedisTierConfig.from_extra_config({"redis_url": url, **overrides}, env={})
    )


def test_lookup_across_three_groups_is_one_round_trip(redis_client, redis_url):
    store = _store(redis_url)
    ks = KeySpace("hma", "ns1")
    keys = [ks.block_key(g, i.to_bytes(8, "big")) for g in range(3) for i in range(200)]
    present = set(keys[::3])
    store.put_if_absent([(k, b"v") for k in present])
    store.exists(keys[:1])  # open the lookup connection first (its HELLO is not the lookup)
    before = command_calls(redis_client)
    found = store.exists(keys)
    delta = command_delta(before, command_calls(redis_client))
    assert found == [k in present for k in keys]
    # One command reached the server (the EXISTS inside the script run server-side).
    assert delta == {"eval": 1, "exists": len(keys)}


def test_put_if_absent_stores_once(redis_client, redis_url):
    store = _store(redis_url)
    first = store.put_if_absent([("hma:ns:g0:01", b"a"), ("hma:ns:g1:01", b"b")])
    second = store.put_if_absent([("hma:ns:g0:01", b"other"), ("hma:ns:g0:02", b"c")])
    assert first == [PutResult.STORED, PutResult.STORED]
    assert second == [PutResult.EXISTED, PutResult.STORED]
    assert redis_client.get("hma:ns:g0:01") == b"a"


def test_get_returns_values_and_none_for_missing(redis_client, redis_url):
    store = _store(redis_url)
    big = os.urandom(4 * 1024 * 1024)
    store.put_if_absent([("k1", memoryview(big))])
    assert store.get(["k1", "missing"]) == [big, None]


def test_ttl_is_applied(redis_client, redis_url):
    store = _store(redis_url, ttl_s=100)
    store.put_if_absent([("hma:ns:g0:aa", b"x")])
    assert 0 < redis_client.ttl("hma:ns:g0:aa") <= 100


@pytest.mark.parametrize("method", ["put_if_absent", "put_parts_if_absent"])
def test_oom_put_is_reported_failed_not_stored(method):
    server = LocalRedis(extra_args=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    server.start()
    try:
        store = _store(server.url, ttl_s=100)
        keys = [f"hma:ns:g0:{i:04x}" for i in range(12)]
        value = memoryview(os.urandom(300_000))
        if method == "put_if_absent":
            results = store.put_if_absent([(k, value) for k in keys])
        else:  # the value in two pieces, sent without joining them
            results = store.put_parts_if_absent(keys, lambda i: [value[:1000], value[1000:]])
        client = redis.Redis(port=server.port)
        assert PutResult.FAILED in results
        assert PutResult.STORED in results
        # Exactly the keys reported stored are there, whole, with their TTL; nothing else.
        for key, result in zip(keys, results, strict=True):
            stored = client.get(key)
            assert (stored is not None) == (result is PutResult.STORED)
            assert stored is None or (stored == bytes(value) and 0 < client.ttl(key) <= 100)
        assert store.breaker.state is BreakerState.CLOSED  # a refusal is not an outage
    finally:
        server.stop()


def test_threads_share_one_store(redis_client, redis_url):
    from concurrent.futures import ThreadPoolExecutor

    store = _store(redis_url, pool_size=4)
    payloads = {f"hma:ns:g0:{i:04x}": os.urandom(50_000) for i in range(64)}
    items = list(payloads.items())
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: store.put_if_absent(items[i : i + 4]), range(0, 64, 4)))
        got = list(pool.map(lambda k: store.get([k])[0], payloads))
    assert got == list(payloads.values())


def test_unreachable_server_is_reported_with_redacted_url():
    store = _store("redis://user:topsecret@127.0.0.1:1/0", connect_timeout_s=0.2)
    with pytest.raises(RedisUnavailableError) as info:
        store.ping()
    assert "topsecret" not in str(info.value)
    assert "127.0.0.1:1" in str(info.value)


def test_killed_server_degrades_within_timeout_and_recovers_on_restart(local_redis):
    store = _store(local_redis.url, connect_timeout_s=0.3, read_timeout_s=0.5, retry_interval_s=0.5)
    keys = ["hma:ns:g0:01", "hma:ns:g1:01"]
    assert store.put_if_absent([(k, b"v") for k in keys]) == [PutResult.STORED] * 2
    assert store.exists(keys) == [True, True]

    local_redis.kill()
    started = time.monotonic()
    assert store.exists(keys) == [False, False]
    assert store.put_if_absent([("hma:ns:g0:02", b"v")]) == [PutResult.FAILED]
    assert store.get(keys) == [None, None]
    assert time.monotonic() - started < 0.3 + 0.5 + 0.5  # one failed call, then fail-fast
    assert store.breaker.state is BreakerState.OPEN

    # While open, calls fail fast without touching the network.
    fast = time.monotonic()
    for _ in range(100):
        store.exists(keys)
    assert time.monotonic() - fast < 0.2

    local_redis.start()  # same port, empty (persistence off)
    time.sleep(0.6)
    assert store.put_if_absent([(k, b"v") for k in keys]) == [PutResult.STORED] * 2
    assert store.exists(keys) == [True, True]
    assert store.breaker.state is BreakerState.CLOSED


def test_separate_db_key_wins_over_url(redis_client, redis_url):
    store = _store(redis_url, db=3)
    store.put_if_absent([("hma:ns:g0:0a", b"v")])
    assert redis_client.exists("hma:ns:g0:0a") == 0  # not in the URL's db 0
    other = redis_client.connection_pool.connection_kwargs
    import redis as redis_py

    db3 = redis_py.Redis(host=other["host"], port=other["port"], db=3)
    assert db3.get("hma:ns:g0:0a") == b"v"
    db3.flushdb()


# ---------------------------------------------------------------------------------- get_into


class _Buffers:
    """An ``alloc`` for get_into that records what it was asked for."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.sizes: list[int] = []
        self.given: list[memoryview] = []
        self.fail_at = fail_at

    def __call__(self, nbytes: int) -> memoryview:
        if self.fail_at is not None and len(self.sizes) == self.fail_at:
            raise MemoryError("no buffer for this test")
        self.sizes.append(nbytes)
        self.given.append(memoryview(bytearray(nbytes)))
        return self.given[-1]


@pytest.mark.parametrize("protocol", [2, 3])
def test_get_into_receives_each_value_into_its_buffer(redis_client, redis_url, protocol):
    client = redis.Redis.from_url(redis_url, protocol=protocol)
    store = RedisBlockStore(
        RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}), client=client
    )
    values = {f"hma:ns:g0:{i:02x}": os.urandom(n) for i, n in enumerate([3_000_000, 1, 0, 70_000])}
    store.put_if_absent(list(values.items()))
    keys = ["hma:ns:g0:missing", *values, "hma:ns:g0:gone", *values]  # more keys than the window
    buffers = _Buffers()
    before = command_calls(redis_client)
    trips = store.round_trips
    got = store.get_into(keys, buffers)

    assert [None if v is None else bytes(v) for v in got] == [values.get(k) for k in keys]
    # Each present value arrived in the buffer made for it, sized exactly.
    assert buffers.sizes == [len(values[k]) for k in keys if k in values]
    present = [v for v in got if v is not None]
    assert len(present) == len(buffers.given)
    assert all(a is b for a, b in zip(present, buffers.given, strict=True))
    assert command_delta(before, command_calls(redis_client)) == {"get": len(keys)}
    assert store.round_trips == trips + 1
    assert store.breaker.state is BreakerState.CLOSED
    # The connection is left clean for the next caller.
    assert store.get_into(keys[:2], _Buffers())[1] == values[keys[1]]


def test_get_into_delivers_pending_counters_on_the_same_connection(redis_client, redis_url):
    store = RedisBlockStore(
        RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}),
        stats_key="hma:ns:stats",
    )
    store.put_if_absent([("hma:ns:g0:01", b"value")])
    store.counters.add(loaded_chunks=3, loaded_bytes=4096)
    trips = store.round_trips
    assert [bytes(v) for v in store.get_into(["hma:ns:g0:01"], _Buffers())] == [b"value"]
    assert store.round_trips == trips + 1
    stats = redis_client.hgetall("hma:ns:stats")
    assert stats[b"loaded_chunks"] == b"3"
    assert stats[b"loaded_bytes"] == b"4096"
    assert store.counters.take() == {}


def test_get_into_refused_key_is_a_miss_and_the_others_arrive(local_redis, caplog):
    admin = redis.Redis(port=local_redis.port)
    admin.set("other:secret", b"not for the tier")
    admin.set("hma:ns:g0:01", b"first")
    admin.set("hma:ns:g0:02", b"second")
    admin.acl_setuser("tier", enabled=True, passwords=["+pw"], keys=["hma:*"], commands=["+@all"])
    store = _store(f"redis://tier:pw@127.0.0.1:{local_redis.port}/0")
    got = store.get_into(["hma:ns:g0:01", "other:secret", "hma:ns:g0:02"], _Buffers())
    assert [None if v is None else bytes(v) for v in got] == [b"first", None, b"second"]
    assert store.breaker.state is BreakerState.CLOSED
    assert "NOPERM" in caplog.text
    assert ":pw@" not in caplog.text  # the URL in the warning is redacted


@pytest.mark.parametrize("mode", ["stall", "close"])
def test_get_into_broken_mid_value_misses_all_within_timeout(local_redis, mode):
    """A reply that stops (or whose connection drops) part way through a value: every key is
    a miss, within the read timeout; the half-read connection is never reused."""
    from tests.support.tcp_proxy import BreakingProxy

    proxy = BreakingProxy(local_redis.port)
    try:
        values = {f"hma:ns:g0:{i:02x}": os.urandom(1_000_000) for i in range(3)}
        redis.Redis(port=local_redis.port).mset(values)
        store = _store(proxy.url, read_timeout_s=0.5, retry_interval_s=0.3)
        assert store.ping() is None  # a first connection through the proxy, unbroken
        proxy.limit, proxy.mode = 1_500_000, mode  # the bulk connection breaks in value 2

        started = time.monotonic()
        assert store.get_into(list(values), _Buffers()) == [None, None, None]
        assert time.monotonic() - started < 0.5 + 0.5
        assert store.breaker.state is BreakerState.OPEN

        proxy.limit = None
        time.sleep(0.4)  # past the retry interval: the breaker lets one call probe
        got = store.get_into(list(values), _Buffers())
        assert [bytes(v) for v in got] == list(values.values())
        assert store.breaker.state is BreakerState.CLOSED
    finally:
        proxy.close()


def test_get_into_drops_a_value_longer_than_its_bound_without_receiving_it(redis_client, redis_url):
    store = _store(redis_url)
    values = {
        "hma:ns:g0:01": os.urandom(1000),
        "hma:ns:g0:02": os.urandom(3_000_000),  # over its bound: never held
        "hma:ns:g0:03": os.urandom(1000),  # exactly its bound: fine
        "hma:ns:g0:04": os.urandom(5),
    }
    store.put_if_absent(list(values.items()))
    keys = list(values)
    buffers = _Buffers()
    got = store.get_into(keys, buffers, max_bytes=[1000, 1000, 1000, 1000])
    assert got[1] == OversizedValue(3_000_000)
    assert [bytes(v) for i, v in enumerate(got) if i != 1] == [values[keys[i]] for i in (0, 2, 3)]
    assert buffers.sizes == [1000, 1000, 5]  # alloc never asked for the long one
    assert store.breaker.state is BreakerState.CLOSED
    # Its bytes were drained: the connection's next replies are the next call's own.
    assert [bytes(v) for v in store.get_into(keys[2:], _Buffers())] == [values[k] for k in keys[2:]]


def test_get_into_alloc_error_propagates_and_leaves_no_stale_reply(redis_client, redis_url):
    store = _store(redis_url)
    values = {f"hma:ns:g0:{i:02x}": os.urandom(200_000) for i in range(4)}
    store.put_if_absent(list(values.items()))
    with pytest.raises(MemoryError):
        store.get_into(list(values), _Buffers(fail_at=1))
    # Not a Redis failure: the breaker stays closed, and the next call reads its own replies.
    assert store.breaker.state is BreakerState.CLOSED
    got = store.get_into(list(values)[::-1], _Buffers())
    assert [bytes(v) for v in got] == list(values.values())[::-1]


# ---------------------------------------------------------------------------------- put_parts


@pytest.mark.parametrize("protocol", [2, 3])
def test_put_parts_stores_each_value_whole_from_its_pieces(redis_client, redis_url, protocol):
    client = redis.Redis.from_url(redis_url, protocol=protocol)
    store = RedisBlockStore(
        RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}), client=client
    )
    redis_client.set("hma:ns:g0:taken", b"first writer")
    big = memoryview(os.urandom(9_000_000))  # more than a socket buffer: sendmsg sends part
    pages = memoryview(os.urandom(1500 * 100))
    items = [
        ("hma:ns:g0:big", [memoryview(b"head"), big[:4_000_000], big[4_000_000:]]),
        ("hma:ns:g0:taken", [memoryview(b"second writer")]),
        # More pieces than one sendmsg call takes.
        ("hma:ns:g0:pages", [pages[i : i + 100] for i in range(0, len(pages), 100)]),
        ("hma:ns:g0:empty", [memoryview(b"")]),
    ]
    store.ping()  # open the connection first (its HELLO is not the put)
    before = command_calls(redis_client)
    results = store.put_parts_if_absent([k for k, _ in items], lambda i: items[i][1])
    assert results == [PutResult.STORED, PutResult.EXISTED, PutResult.STORED, PutResult.STORED]
    assert command_delta(before, command_calls(redis_client)) == {"set": 4}
    assert redis_client.get("hma:ns:g0:big") == b"head" + bytes(big)
    assert redis_client.get("hma:ns:g0:taken") == b"first writer"
    assert redis_client.get("hma:ns:g0:pages") == bytes(pages)
    assert redis_client.get("hma:ns:g0:empty") == b""


def test_put_parts_on_a_dropped_connection_stores_nothing_partial(local_redis):
    """A connection that drops while a value is being sent: every put is FAILED, and no key
    holds part of a value (Redis discards a command that never arrived whole)."""
    from tests.support.tcp_proxy import BreakingProxy

    proxy = BreakingProxy(local_redis.port)
    try:
        store = _store(proxy.url, read_timeout_s=0.5, retry_interval_s=0.3)
        proxy.request_limit, proxy.mode = 2_500_000, "close"
        value = memoryview(os.urandom(1_000_000))
        items = [(f"hma:ns:g0:{i:02x}", [value[:10], value[10:]]) for i in range(4)]
        keys = [k for k, _ in items]
        assert store.put_parts_if_absent(keys, lambda i: items[i][1]) == [PutResult.FAILED] * 4
        client = redis.Redis(port=local_redis.port)
        assert all(v in (None, bytes(value)) for v in client.mget([k for k, _ in items]))
        assert store.breaker.state is BreakerState.OPEN
    finally:
        proxy.close()
