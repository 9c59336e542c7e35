import os
import time

import pytest
import redis

from hma_redis.core import codec
from hma_redis.core.codec import BlockHeader
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.medium import Landed, LoadTarget, PutResult
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.store import RedisBlockStore, RedisUnavailableError
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.kv_pages import on_path
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


def _job_values(keys: list[str], body: memoryview) -> tuple[bytes, bytes]:
    """A codec head for ``body`` as put_values takes it (CRC field blank), and the whole value
    Redis holds once it is stored (the same under every key: its key echo is ``keys[0]``)."""
    header = BlockHeader(key=keys[0], group=0, first_block=0, num_blocks=1, page_bytes=(len(body),))
    parts = codec.encode_parts(header, [body])
    head = bytearray(parts[0])
    head[12:16] = bytes(4)
    return bytes(head), b"".join(bytes(p) for p in parts)


@pytest.mark.parametrize("method", ["put_if_absent", "put_values", "put_values-twin"])
def test_oom_put_is_reported_failed_not_stored(method):
    server = LocalRedis(extra_args=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    server.start()
    try:
        store = _store(server.url, ttl_s=100)
        keys = [f"hma:ns:g0:{i:04x}" for i in range(12)]
        value = memoryview(os.urandom(300_000))
        if method == "put_if_absent":
            results = store.put_if_absent([(k, value) for k in keys])
        else:  # a value job (the C job or its twin), the value sent in pieces
            head, wants = _job_values(keys, value)
            heads = [bytearray(head) for _ in keys]
            pieces = [[value[:1000], value[1000:]]] * len(keys)
            with on_path(store, method == "put_values"):
                results = store.put_values(keys, heads, pieces)
            value = memoryview(wants)
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


# ---------------------------------------------------------------------------------- value jobs


def _job(key: str, pieces: list[memoryview]) -> tuple[bytearray, bytes]:
    """``key``'s codec head for a body of ``pieces`` as put_values takes it (CRC field blank)
    and the whole value Redis holds once it is stored."""
    size = sum(p.nbytes for p in pieces)
    header = BlockHeader(key=key, group=0, first_block=0, num_blocks=1, page_bytes=(size,))
    parts = codec.encode_parts(header, pieces)
    head = bytearray(parts[0])
    head[12:16] = bytes(4)
    return head, b"".join(bytes(p) for p in parts)


@pytest.mark.parametrize("native", [True, False], ids=["native", "twin"])
@pytest.mark.parametrize("protocol", [2, 3])
def test_a_value_job_stores_each_value_whole_from_its_pieces(
    redis_client, redis_url, protocol, native
):
    client = redis.Redis.from_url(redis_url, protocol=protocol)
    store = RedisBlockStore(
        RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}), client=client
    )
    redis_client.set("hma:ns:g0:taken", b"first writer")
    big = memoryview(os.urandom(9_000_000))  # more than a socket buffer: sendmsg sends part
    pages = memoryview(os.urandom(1500 * 100))
    bodies = {
        "hma:ns:g0:big": [big[:4_000_000], big[4_000_000:]],
        "hma:ns:g0:taken": [memoryview(b"second writer")],
        # More pieces than one sendmsg call takes.
        "hma:ns:g0:pages": [pages[i : i + 100] for i in range(0, len(pages), 100)],
    }
    jobs = {key: _job(key, pieces) for key, pieces in bodies.items()}
    store.ping()  # open the connection first (its HELLO is not the put)
    before = command_calls(redis_client)
    with on_path(store, native):
        results = store.put_values(
            list(bodies), [jobs[k][0] for k in bodies], list(bodies.values())
        )
    assert results == [PutResult.STORED, PutResult.EXISTED, PutResult.STORED]
    assert command_delta(before, command_calls(redis_client)) == {"set": 3}
    assert redis_client.get("hma:ns:g0:big") == jobs["hma:ns:g0:big"][1]
    assert redis_client.get("hma:ns:g0:taken") == b"first writer"
    assert redis_client.get("hma:ns:g0:pages") == jobs["hma:ns:g0:pages"][1]


@pytest.mark.parametrize("native", [True, False], ids=["native", "twin"])
def test_a_value_job_on_a_dropped_connection_stores_nothing_partial(local_redis, native):
    """A connection that drops while a value is being sent: every put is FAILED, and no key
    holds part of a value (Redis discards a command that never arrived whole)."""
    from tests.support.tcp_proxy import BreakingProxy

    proxy = BreakingProxy(local_redis.port)
    try:
        store = _store(proxy.url, read_timeout_s=0.5, retry_interval_s=0.3)
        # Each of the job's two connections (connections_per_thread) carries two values:
        # both are cut inside their second.
        proxy.request_limit, proxy.mode = 1_500_000, "close"
        value = memoryview(os.urandom(1_000_000))
        keys = [f"hma:ns:g0:{i:02x}" for i in range(4)]
        jobs = [_job(key, [value[:10], value[10:]]) for key in keys]
        with on_path(store, native):
            results = store.put_values(
                keys, [head for head, _ in jobs], [[value[:10], value[10:]]] * 4
            )
        assert results == [PutResult.FAILED] * 4
        client = redis.Redis(port=local_redis.port)
        held = client.mget(keys)
        assert all(v in (None, whole) for v, (_, whole) in zip(held, jobs, strict=True))
        assert store.breaker.state is BreakerState.OPEN
    finally:
        proxy.close()


def _client_ports(client: redis.Redis, name: str | None) -> set[str]:
    """The client ports of the server's connections named ``name``."""
    return {c["addr"].rsplit(":", 1)[1] for c in client.client_list() if c.get("name") == name}


def test_dropped_value_connections_close_and_the_next_job_opens_new_ones(redis_client, redis_url):
    """drop_value_connections (for benchmarks) closes the value jobs' connections at the
    server; the next value job works, on a new one."""
    redis_client.set("hma:ns:g0:drop", b"x" * 1000)
    store = _store(redis_url)

    def load() -> bytes:
        staging = bytearray(2000)
        target = LoadTarget(bytearray(64), b"", [], staging, len(staging))
        (result,) = store.load_values(["hma:ns:g0:drop"], [target]) or [None]
        assert result is not None and result.landed is Landed.STAGING
        return bytes(staging[: result.value_len])

    assert load() == b"x" * 1000
    before = _client_ports(redis_client, store.client_name)
    store.drop_value_connections()
    deadline = time.monotonic() + 5
    while len(_client_ports(redis_client, store.client_name)) >= len(before):
        assert time.monotonic() < deadline, "the value connection is still open"
        time.sleep(0.01)
    assert load() == b"x" * 1000
    assert _client_ports(redis_client, store.client_name) - before, "no new value connection"
    store.close()
