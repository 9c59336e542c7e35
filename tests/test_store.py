import os
import time

import pytest
import redis
from redis_server import command_calls, command_delta

from hma_redis.breaker import BreakerState
from hma_redis.config import RedisTierConfig
from hma_redis.keys import KeySpace
from hma_redis.local_redis import LocalRedis
from hma_redis.store import PutResult, RedisBlockStore, RedisUnavailableError


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


def test_oom_put_is_reported_failed_not_stored():
    server = LocalRedis(extra_args=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    server.start()
    try:
        store = _store(server.url)
        keys = [f"hma:ns:g0:{i:04x}" for i in range(12)]
        results = store.put_if_absent([(k, os.urandom(300_000)) for k in keys])
        client = redis.Redis(port=server.port)
        assert PutResult.FAILED in results
        assert PutResult.STORED in results
        # Exactly the keys reported stored are there, whole; nothing else.
        for key, result in zip(keys, results, strict=True):
            value = client.get(key)
            assert (value is not None) == (result is PutResult.STORED)
            assert value is None or len(value) == 300_000
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
