"""The block store at its edges, against real Redis servers (no mocks): refusals of part of a
request (an ACL that covers some keys) against outages, admission markers, TTLs on every put
path, counters that must arrive exactly once, and the same answers from a Redis Cluster."""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from hma_redis.core import codec, medium
from hma_redis.core.codec import BlockHeader
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import wire
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.client import raw_socket
from hma_redis.core.redis.store import PutResult, RedisBlockStore, Sighting, bulk_connections
from hma_redis.tools.devkit.cluster import LocalCluster
from hma_redis.tools.devkit.local_redis import LocalRedis, free_port
from tests.support.cluster_servers import started_cluster
from tests.support.kv_pages import on_path
from tests.support.redis_server import (
    command_calls,
    command_delta,
    store_connections,
    wait_for_store_connections,
)
from tests.support.tcp_proxy import BreakingProxy

KS = KeySpace("hma", "edges")
STATS_KEY = KS.stats_key()
# The ACL user of these tests may touch the tier's keys ("hma:*") and nothing else.
READER, READER_PW = "reader", "reader-pw"


def _cfg(url: str, **overrides: object) -> RedisTierConfig:
    return RedisTierConfig.from_extra_config({"redis_url": url, **overrides}, env={})


def _store(url: str, stats_key: str | None = STATS_KEY, **overrides: object) -> RedisBlockStore:
    return RedisBlockStore(_cfg(url, **overrides), stats_key=stats_key)


def _key(group: int, idx: int) -> str:
    return KS.block_key(group, idx.to_bytes(8, "big"))


def _marker(idx: int) -> str:
    return KS.sighting_key(0, idx.to_bytes(8, "big"))


def _grant_reader(client: redis.Redis, *removed: str) -> None:
    """User ``reader``: every command on the tier's keys, none on other keys."""
    client.acl_setuser(
        READER,
        enabled=True,
        passwords=[f"+{READER_PW}"],
        keys=["hma:*"],
        commands=["+@all", *(f"-{c}" for c in removed)],
    )


def _reader_url(port: int, db: int = 0) -> str:
    return f"redis://{READER}:{READER_PW}@127.0.0.1:{port}/{db}"


def _refused(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The commands the store's refusal warnings name, in order (one per command and kind
    per interval: an operator reads which command to grant)."""
    found = (re.search(r" refused (\S+): ", r.getMessage()) for r in caplog.records)
    return [m.group(1) for m in found if m]


def _load_raw(
    store: RedisBlockStore, keys: list[str], max_len: int = 1 << 21, native: bool = True
) -> list[bytes | int | None] | None:
    """``load_values`` of ``keys``, each value whole in a staging buffer (the head expects no
    header, so short or random values never match it): its bytes, its length when longer
    than ``max_len`` (dropped unread), None when missing or refused; None when Redis failed."""
    targets = [medium.LoadTarget(bytearray(48), b"", [], bytearray(max_len), max_len) for _ in keys]
    with on_path(store, native):
        results = store.load_values(keys, targets)
    if results is None:
        return None
    out: list[bytes | int | None] = []
    for target, result in zip(targets, results, strict=True):
        if result.status is medium.LoadStatus.OVERSIZED:
            out.append(result.value_len)
        elif result.status is medium.LoadStatus.OK:
            assert result.landed is medium.Landed.STAGING and target.staging is not None
            out.append(bytes(target.staging[: result.value_len]))
        else:
            out.append(None)
    return out


def _native_value(key: str, body: bytes) -> tuple[bytearray, list[memoryview], bytes]:
    """A codec value as put_values takes it (head with its CRC field blank, the body's pieces)
    and the bytes Redis must hold once it is stored."""
    header = BlockHeader(key=key, group=0, first_block=0, num_blocks=1, page_bytes=(len(body),))
    parts = codec.encode_parts(header, [memoryview(body)])
    whole = b"".join(bytes(p) for p in parts)
    head = bytearray(parts[0])
    head[12:16] = bytes(4)  # the CRC32C field: put_values fills it
    return head, [memoryview(body)], whole


# ------------------------------------------------------------------------- no request, no trip


def test_empty_requests_answer_at_once_without_touching_redis(redis_client, redis_url):
    store = _store(redis_url)
    store.counters.add(lookups=1)  # would ride along on any round trip
    before = command_calls(redis_client)
    assert store.exists([]) == []
    assert store.exists_and_mark([], [], 60) == []
    assert store.put_if_absent([]) == []
    assert store.get([]) == []
    assert store.delete([]) == 0
    assert store.load_values([], []) == []
    assert store.put_values([], [], []) == []
    assert store.round_trips == 0
    assert command_delta(before, command_calls(redis_client)) == {}
    assert redis_client.exists(STATS_KEY) == 0


# ------------------------------------------------------------------- refusals of part of a call


@pytest.fixture
def reader_server(local_redis: LocalRedis) -> Iterator[tuple[LocalRedis, redis.Redis]]:
    """A private Redis with the ``reader`` ACL user, and an admin client on it."""
    admin = redis.Redis(port=local_redis.port)
    _grant_reader(admin)
    yield local_redis, admin
    admin.close()


def test_connections_are_opened_ahead_of_use_and_an_outage_is_no_error(redis_client, redis_url):
    """``warm_up`` and ``warm_lookups`` open connections the jobs and lookups then use
    (Redis sees them at once, and a lookup opens none); with Redis down they open nothing
    and raise nothing. ``warm_up(n)`` opens n parts' connections: n ×
    ``connections_per_thread``."""
    store = _store(redis_url, connections_per_thread=1)
    try:
        assert store.warm_up(3) == 3
        assert store.warm_lookups() == 1
        assert store_connections(redis_client, store.client_name) == 4
        assert store.warm_up(3) == 3  # the same three, found open
        assert store.exists([_key(0, 1)]) == [False]
        assert store_connections(redis_client, store.client_name) == 4
    finally:
        store.close()
    store = _store(redis_url, connections_per_thread=2)
    try:
        assert store.warm_up(3) == 6
        assert store_connections(redis_client, store.client_name) == 6
    finally:
        store.close()
    port = free_port()  # nothing listens there
    down = _store(f"redis://127.0.0.1:{port}/0")
    try:
        assert down.warm_up(2) == 0
        assert down.warm_lookups() == 0
    finally:
        down.close()


def test_a_refused_lookup_batch_is_misses_and_the_other_batches_answer(reader_server, caplog):
    """A lookup of more keys than one EVAL carries (4096) where one key of the second batch is
    outside the user's ACL: that whole batch is misses (never hits), the first batch answers
    exactly, one refusal is counted, and the tier stays on."""
    server, admin = reader_server
    keys = [_key(0, i) for i in range(5000)]
    keys[4096] = "other:outside-the-acl"  # the first key of the second batch
    admin.mset({k: b"v" for k in keys[::3]})
    store = _store(_reader_url(server.port))

    found = store.exists(keys)
    assert found[:4096] == [i % 3 == 0 for i in range(4096)]
    assert found[4096:] == [False] * (5000 - 4096)
    assert store.counters.snapshot()["refused_noperm"] == 1
    assert _refused(caplog) == ["EVAL"]
    assert store.breaker.state is BreakerState.CLOSED
    # The same keys without the outsider: every present key is a hit again.
    keys[4096] = _key(1, 4096)
    assert store.exists(keys) == [i % 3 == 0 and i != 4096 for i in range(5000)]


def test_delete_counts_only_the_keys_it_removed(reader_server, caplog):
    server, admin = reader_server
    admin.mset({_key(0, 1): b"v", "other:kept": b"v"})
    store = _store(_reader_url(server.port))
    assert store.delete([_key(0, 1), "other:kept", _key(0, 2)]) == 1  # one refused, one absent
    assert admin.exists(_key(0, 1), "other:kept") == 1
    assert store.counters.snapshot()["refused_noperm"] == 1
    assert _refused(caplog) == ["UNLINK"]
    assert store.breaker.state is BreakerState.CLOSED


def test_refused_counter_increments_are_dropped_and_not_counted_again(local_redis, caplog):
    """A user that may not HINCRBY: the counters that rode along, whatever the call (a
    lookup, a get, a flush), are refused, logged, dropped (they would be refused again) and
    not counted as a refusal of their own (that count would be one more counter to refuse);
    every call still answers."""
    caplog.set_level(logging.WARNING)
    admin = redis.Redis(port=local_redis.port)
    _grant_reader(admin, "hincrby")
    admin.set(_key(0, 1), b"v")
    cfg = _cfg(_reader_url(local_redis.port))
    store = RedisBlockStore(cfg, stats_key=STATS_KEY, refusal_log_interval_s=0)  # log each
    calls = [
        lambda: store.exists([_key(0, 1), _key(0, 2)]) == [True, False],
        lambda: store.get([_key(0, 1)]) == [b"v"],
        lambda: store.flush() is None,
    ]
    for idx, call in enumerate(calls):
        store.counters.add(lookups=1)
        assert call(), idx
        assert store.counters.take() == {}, idx  # nothing pending for later
    assert store.counters.snapshot() == {"lookups": 3}  # no refused_* of their own
    assert admin.exists(STATS_KEY) == 0
    assert _refused(caplog) == ["HINCRBY"] * 3
    assert store.breaker.state is BreakerState.CLOSED


def test_a_user_refused_select_gets_refusals_not_an_outage(local_redis, caplog):
    """An ACL user without SELECT, configured for db 3: every call is refused while the
    connection is set up. Each one degrades, is counted and logged as a refusal, and the
    breaker never opens (Redis answers; an operator has an ACL to fix)."""
    caplog.set_level(logging.WARNING)
    admin = redis.Redis(port=local_redis.port)
    _grant_reader(admin, "select")
    store = _store(_reader_url(local_redis.port), db=3, retry_interval_s=30)
    key = _key(0, 1)
    assert store.exists([key]) == [False]
    assert store.exists_and_mark([[key]], [_marker(1)], 60) == [Sighting.FIRST]
    assert store.put_if_absent([(key, b"v")]) == [PutResult.FAILED]
    assert store.get([key]) == [None]
    assert store.delete([key]) == 0
    assert store.write_info(KS.info_key(), {"model": "m"})  # Redis answered
    assert store.load_values([key], []) is None
    head, body, _ = _native_value(key, b"v")
    assert store.put_values([key], [head], [body]) == [PutResult.FAILED]
    store.flush()  # the refusals' own counters: refused too, and dropped
    assert store.counters.take() == {"refused_noperm": 1}  # (the flush's own refusal)
    assert store.counters.snapshot()["refused_noperm"] == 9
    assert store.breaker.state is BreakerState.CLOSED
    assert (store.breaker.failures, store.breaker.openings) == (0, 0)
    assert "(NOPERM;" in caplog.text and "failed (" not in caplog.text
    # One report per command (GET and SET stand for every read and every put path).
    assert _refused(caplog) == ["EXISTS", "EVAL", "SET", "GET", "UNLINK", "HSET", "HINCRBY"]


def test_refusals_are_reported_at_most_once_a_minute_by_default(reader_server, caplog):
    server, _ = reader_server
    caplog.set_level(logging.WARNING)
    store = _store(_reader_url(server.port))
    assert _load_raw(store, ["other:outside-the-acl"]) == [None]
    for _ in range(3):
        assert store.get(["other:outside-the-acl"]) == [None]
    assert _refused(caplog) == ["GET"]  # one GET report for every read path
    lines = [r.getMessage() for r in caplog.records if "refused GET" in r.getMessage()]
    assert len(lines) == 1
    assert "at most one report per 60s" in lines[0]
    assert f"127.0.0.1:{server.port}" in lines[0] and READER_PW not in lines[0]


# ----------------------------------------------------------------------- admission (standalone)


def test_second_sighting_is_first_then_again_until_every_shard_is_stored(redis_client, redis_url):
    """Two ranks per chunk: a chunk is PRESENT only with both shards; otherwise its marker
    says whether it was seen before (AGAIN) or is new (FIRST), and the marker expires."""
    store = _store(redis_url)
    chunks = [[_key(0, i) + ":r0", _key(0, i) + ":r1"] for i in range(4)]
    markers = [_marker(i) for i in range(4)]
    redis_client.mset({chunks[1][0]: b"v", chunks[1][1]: b"v", chunks[2][0]: b"v"})
    redis_client.set(markers[3], b"1")  # another instance saw chunk 3 before

    store.ping()
    before = command_calls(redis_client)
    trips = store.round_trips
    first = store.exists_and_mark(chunks, markers, 60)
    assert first == [Sighting.FIRST, Sighting.PRESENT, Sighting.FIRST, Sighting.AGAIN]
    assert store.round_trips == trips + 1
    assert command_delta(before, command_calls(redis_client))["eval"] == 1
    assert 0 < redis_client.ttl(markers[0]) <= 60
    assert redis_client.exists(markers[1]) == 0  # a present chunk leaves no marker

    again = store.exists_and_mark(chunks, markers, 60)
    assert again == [Sighting.AGAIN, Sighting.PRESENT, Sighting.AGAIN, Sighting.AGAIN]
    redis_client.set(chunks[2][1], b"v")
    assert store.exists_and_mark(chunks, markers, 60)[2] is Sighting.PRESENT


def test_a_refused_admission_batch_is_first_sightings_and_the_other_batches_answer(
    reader_server, caplog
):
    """More chunks than one EVAL carries (one rank: 2048 chunks per EVAL) where a marker of the
    second batch is outside the ACL: that batch's chunks are all FIRST (nothing is stored on a
    refusal, even chunks that are in Redis), the first batch answers exactly."""
    server, admin = reader_server
    total = 2100
    chunks = [[_key(0, i)] for i in range(total)]
    markers = [_marker(i) for i in range(total)]
    markers[2048] = "other:marker"
    admin.mset({chunks[i][0]: b"v" for i in range(0, total, 2)})
    admin.mset({markers[i]: b"1" for i in range(1, total, 4)})
    store = _store(_reader_url(server.port))

    got = store.exists_and_mark(chunks, markers, 60)

    def expected(i: int) -> Sighting:
        if i % 2 == 0:
            return Sighting.PRESENT
        return Sighting.AGAIN if i % 4 == 1 else Sighting.FIRST

    assert got[:2048] == [expected(i) for i in range(2048)]
    assert got[2048:] == [Sighting.FIRST] * (total - 2048)
    assert store.counters.snapshot()["refused_noperm"] == 1
    assert _refused(caplog) == ["EVAL"]
    assert admin.exists(markers[2051]) == 0  # the refused batch set no marker

    # Without the outsider both batches answer; the first call's FIRST sightings are AGAIN.
    markers[2048] = _marker(2048)

    def then(i: int) -> Sighting:
        if i % 2 == 0:
            return Sighting.PRESENT
        return Sighting.AGAIN if i < 2048 or i % 4 == 1 else Sighting.FIRST

    assert store.exists_and_mark(chunks, markers, 60) == [then(i) for i in range(total)]
    assert store.breaker.state is BreakerState.CLOSED


# -------------------------------------------------------------------------------- put paths


PUT_PATHS = ["put_if_absent", "put_values", "put_values-twin"]


def _put_on_twin(store: RedisBlockStore, *args: Any) -> list[PutResult]:
    with on_path(store, False):
        return store.put_values(*args)


def _put(store: RedisBlockStore, path: str, values: dict[str, bytes], **kw: object) -> list:
    """Put ``values`` through one of the store's put paths (a value job: the C job or its
    twin); the bytes each key must hold."""
    keys = list(values)
    if path == "put_if_absent":
        return store.put_if_absent(list(values.items()), **kw)  # type: ignore[arg-type]
    native = [_native_value(k, v) for k, v in values.items()]
    heads = [head for head, _, _ in native]
    bodies = [body for _, body, _ in native]
    twin = path == "put_values-twin"
    with on_path(store, not twin):
        return store.put_values(keys, heads, bodies, **kw)  # type: ignore[arg-type]


def _held(path: str, key: str, value: bytes) -> bytes:
    return value if path == "put_if_absent" else _native_value(key, value)[2]


@pytest.mark.parametrize("path", PUT_PATHS)
@pytest.mark.parametrize(
    ("configured", "given", "expected"),
    [(None, None, None), (1000, None, 1000), (1000, 50, 50), (None, 50, 50)],
    ids=["no-ttl", "configured", "given-wins", "given-only"],
)
def test_every_put_path_stores_once_with_the_ttl_it_should(
    redis_client, redis_url, path, configured, given, expected
):
    overrides = {} if configured is None else {"ttl_s": configured}
    store = _store(redis_url, **overrides)
    values = {_key(0, 1): os.urandom(3000), _key(0, 2): b"xy"}
    kw = {} if given is None else {"ttl_s": given}
    assert _put(store, path, values, **kw) == [PutResult.STORED] * 2
    for key, value in values.items():
        assert redis_client.get(key) == _held(path, key, value)
        ttl = redis_client.ttl(key)
        assert ttl == -1 if expected is None else expected - 5 < ttl <= expected
    # Content-addressed: a second put of the same keys leaves the first bytes alone.
    other = {k: b"z" + v for k, v in values.items()}
    assert _put(store, path, other, **kw) == [PutResult.EXISTED] * 2
    assert [redis_client.get(k) for k in values] == [_held(path, k, v) for k, v in values.items()]


@pytest.mark.parametrize("path", PUT_PATHS)
def test_a_refused_put_is_failed_counted_and_the_next_one_stores(reader_server, path, caplog):
    server, admin = reader_server
    store = _store(_reader_url(server.port))
    values = {_key(0, 1): b"one", "other:outside": b"two", _key(0, 3): b"three"}
    got = _put(store, path, values)
    assert got == [PutResult.STORED, PutResult.FAILED, PutResult.STORED]
    assert store.counters.snapshot()["refused_noperm"] == 1
    assert _refused(caplog) == ["SET"]
    assert admin.exists("other:outside") == 0
    assert store.breaker.state is BreakerState.CLOSED


def test_a_native_load_lands_values_misses_and_counts_refusals(reader_server, caplog):
    """One native job: a value put by put_values lands in its pages with a good checksum, a
    missing key is MISSING, a key outside the ACL is an ERROR counted as a refusal (GET), and
    the tier stays on."""
    server, admin = reader_server
    store = _store(_reader_url(server.port))
    body = os.urandom(5000)
    key = _key(0, 1)
    head, pieces, whole = _native_value(key, body)
    assert store.put_values([key], [head], [pieces]) == [PutResult.STORED]
    admin.set("other:secret", whole)
    expected = BlockHeader(key=key, group=0, first_block=0, num_blocks=1, page_bytes=(5000,))
    pages = [bytearray(5000) for _ in range(3)]
    targets = [
        medium.LoadTarget(
            bytearray(codec.PREFIX_BYTES + 200), expected.to_msgpack(), [page], None, 1 << 20
        )
        for page in pages
    ]
    got = store.load_values([key, _key(0, 2), "other:secret"], targets)
    assert got is not None
    assert [r.status for r in got] == [
        medium.LoadStatus.OK,
        medium.LoadStatus.MISSING,
        medium.LoadStatus.ERROR,
    ]
    assert got[0].crc_ok and bytes(pages[0]) == body
    assert pages[1] == pages[2] == bytearray(5000)
    assert store.counters.snapshot()["refused_noperm"] == 1
    assert _refused(caplog) == ["GET"]
    assert store.breaker.state is BreakerState.CLOSED


# ------------------------------------------------------------------------ outages and counters


def test_an_outage_degrades_every_call_and_keeps_counters_for_later(local_redis, caplog):
    """Redis killed: every call degrades to its default and the breaker opens (logged with the
    redacted URL); the counters of calls that could not reach Redis are kept, and delivered
    exactly once when it is back."""
    caplog.set_level(logging.WARNING)
    admin = redis.Redis(port=local_redis.port)
    _grant_reader(admin)
    url = _reader_url(local_redis.port)
    store = _store(url, retry_interval_s=0.05, connect_timeout_s=0.3, read_timeout_s=0.5)
    key = _key(0, 1)
    assert store.put_if_absent([(key, b"v")]) == [PutResult.STORED]
    local_redis.kill()

    calls = [
        lambda: store.exists([key]) == [False],
        lambda: store.exists_and_mark([[key]], [_marker(1)], 60) == [Sighting.FIRST],
        lambda: store.put_if_absent([(key, b"v")]) == [PutResult.FAILED],
        lambda: store.get([key]) == [None],
        lambda: store.delete([key]) == 0,
        lambda: store.write_info(KS.info_key(), {"model": "m"}) is False,
        lambda: store.load_values([key], []) is None,
    ]
    for idx, call in enumerate(calls):
        time.sleep(0.06)  # past the retry interval: this call is the breaker's probe
        store.counters.add(lookups=1)
        assert call(), idx
        assert store.breaker.state is BreakerState.OPEN
    time.sleep(0.06)
    store.flush()  # fails too: kept
    assert store.breaker.failures == len(calls) + 1
    url_shown = f"redis://***@127.0.0.1:{local_redis.port}/0"
    assert f"Redis at {url_shown} failed (ConnectionError: " in caplog.text
    assert READER_PW not in caplog.text

    local_redis.start()
    _grant_reader(redis.Redis(port=local_redis.port))
    time.sleep(0.06)
    store.flush()
    assert store.breaker.state is BreakerState.CLOSED
    with redis.Redis(port=local_redis.port) as client:
        assert client.hgetall(STATS_KEY) == {b"lookups": str(len(calls)).encode()}
    assert store.counters.take() == {}


def test_counters_ride_along_on_pipelined_calls_and_never_on_a_value_job(redis_client, redis_url):
    """Pending counters go with the very next pipelined call (an existence check, a lookup,
    a small put, a get) in its own round trip and arrive exactly once, the call's answers
    unchanged by them; a value job (GETs or SET NXs, on either path) carries none: nothing
    waits ahead of a load's GETs, and they wait for the next such call or :meth:`flush`."""
    store = _store(redis_url)
    key = _key(0, 1)
    head, body, _ = _native_value(_key(0, 3), b"native")
    head4, body4, _ = _native_value(_key(0, 4), b"twin")
    target = medium.LoadTarget(bytearray(200), b"", [], None, 1 << 20)
    calls = [
        lambda: store.put_if_absent([(key, b"value")]) == [PutResult.STORED],
        lambda: store.exists([key, _key(0, 2)]) == [True, False],
        lambda: store.exists_and_mark([[key]], [_marker(1)], 60) == [Sighting.PRESENT],
        lambda: store.get([key, _key(0, 2)]) == [b"value", None],
        lambda: _load_raw(store, [key], native=False) == [b"value"],
        lambda: store.put_values([_key(0, 3)], [head], [body]) == [PutResult.STORED],
        lambda: (
            [r.status for r in store.load_values([_key(0, 2)], [target]) or []]
            == [medium.LoadStatus.MISSING]
        ),
        lambda: _load_raw(store, [key]) == [b"value"],
        lambda: _put_on_twin(store, [_key(0, 4)], [head4], [body4]) == [PutResult.STORED],
    ]
    pipelined, value_jobs = calls[:4], calls[4:]
    for idx, call in enumerate(pipelined, start=1):
        trips = store.round_trips
        store.counters.add(lookups=1)
        assert call(), idx
        assert store.round_trips == trips + 1
        assert redis_client.hgetall(STATS_KEY) == {b"lookups": str(idx).encode()}, idx
    for idx, call in enumerate(value_jobs, start=1):
        store.counters.add(lookups=1)
        assert call(), idx
        assert redis_client.hgetall(STATS_KEY) == {b"lookups": b"4"}, idx
    store.flush()
    assert redis_client.hgetall(STATS_KEY) == {b"lookups": b"9"}
    assert store.counters.take() == {}


def test_a_store_without_a_stats_key_sends_no_counters(redis_client, redis_url):
    store = _store(redis_url, stats_key=None)
    store.counters.add(lookups=1)
    key = _key(0, 1)
    head, body, _ = _native_value(key, b"native")
    target = medium.LoadTarget(bytearray(200), b"", [], None, 1 << 20)
    assert store.put_values([key], [head], [body]) == [PutResult.STORED]
    assert [r.status for r in store.load_values([_key(0, 2)], [target]) or []] == [
        medium.LoadStatus.MISSING
    ]
    assert store.exists([key]) == [True]
    assert _load_raw(store, [_key(0, 2)], native=False) == [None]
    store.flush()
    assert "hincrby" not in command_calls(redis_client)
    assert store.counters.snapshot() == {"lookups": 1}  # still counted in this process


def test_counters_pending_across_a_native_job_that_times_out_are_kept(local_redis):
    """Redis stops answering during a native job while counters are pending: the job fails,
    the breaker opens, and the counters (which a value job never carries) are kept for a
    later round trip."""
    store = _store(local_redis.url, read_timeout_s=0.3, retry_interval_s=30)
    head, body, _ = _native_value(_key(0, 1), b"native")
    assert store.put_values([_key(0, 1)], [head], [body]) == [PutResult.STORED]  # connected
    store.counters.add(loaded_chunks=2)
    target = medium.LoadTarget(bytearray(200), b"", [], None, 1 << 20)
    local_redis.pause()
    try:
        assert store.load_values([_key(0, 1)], [target]) is None
    finally:
        local_redis.resume()
    assert store.breaker.state is BreakerState.OPEN
    assert store.counters.take() == {"loaded_chunks": 2}


def test_counters_pending_across_a_broken_load_arrive_once_with_the_next_call(local_redis):
    """A load whose connection drops while counters are pending: the next call (the
    breaker's probe) delivers them, exactly once."""
    proxy = BreakingProxy(local_redis.port)
    try:
        values = {_key(0, i): os.urandom(1_000_000) for i in range(3)}
        redis.Redis(port=local_redis.port).mset(values)
        store = _store(proxy.url, read_timeout_s=0.5, retry_interval_s=0.2)
        store.ping()
        proxy.limit, proxy.mode = 1_500_000, "close"  # the bulk connection breaks in value 2
        store.counters.add(loaded_chunks=3)
        assert _load_raw(store, list(values)) is None
        assert store.breaker.state is BreakerState.OPEN
        proxy.limit = None
        time.sleep(0.25)  # past the retry interval: the next call is the breaker's probe
        assert store.exists([_key(0, 0)]) == [True]
        assert store.breaker.state is BreakerState.CLOSED
        with redis.Redis(port=local_redis.port) as client:
            assert client.hgetall(STATS_KEY) == {b"loaded_chunks": b"3"}
    finally:
        proxy.close()


# ------------------------------------------------------------------------------ metadata


def test_namespace_info_reads_back_as_text(redis_client, redis_url):
    store = _store(redis_url)
    assert store.write_info(KS.info_key(), {"model": "m", "tp_size": "2"})
    assert store.write_info(KS.info_key(), {"model": "m", "tp_size": "2"})  # idempotent
    assert store.read_hash(KS.info_key()) == {"model": "m", "tp_size": "2"}
    assert store.read_hash(KS.base + ":nothing") == {}


def test_a_refused_namespace_record_still_says_redis_answered(local_redis, caplog):
    """An ACL without HSET: write_info is True (start-up must not report Redis unreachable),
    the refusal is counted and logged as HSET's, and nothing was written."""
    admin = redis.Redis(port=local_redis.port)
    _grant_reader(admin, "hset")
    store = _store(_reader_url(local_redis.port))
    assert store.write_info(KS.info_key(), {"model": "m"})
    assert store.counters.snapshot()["refused_noperm"] == 1
    assert _refused(caplog) == ["HSET"]
    assert admin.exists(KS.info_key()) == 0
    assert store.breaker.state is BreakerState.CLOSED


def test_the_native_path_is_chosen_unless_tls_or_disabled(monkeypatch):
    """A store chooses its data path once, when built: the C job unless TLS or
    ``HMA_REDIS_NATIVE=0``; ``native=True`` where it cannot run is one clear error."""
    assert _store("redis://127.0.0.1:1/0").native_reason is None
    assert _store("unix:///tmp/no-such.sock").native
    tls = _store("rediss://127.0.0.1:1/0")
    assert not tls.native and tls.native_reason == "TLS connections stay in Python's ssl"
    assert "pure Python (TLS connections stay in Python's ssl)" in tls.describe()
    with pytest.raises(ValueError, match="the native data path cannot run: TLS"):
        RedisBlockStore(tls.cfg, native=True)
    monkeypatch.setenv(wire.NATIVE_ENV, "0")
    disabled = _store("redis://127.0.0.1:1/0").native_reason
    assert disabled == f"disabled by {wire.NATIVE_ENV}=0"


# ------------------------------------------------------------------------------ connections


def test_concurrent_loads_each_get_a_connection_beyond_the_lookup_pool(redis_client, redis_url):
    """A load while another holds a bulk connection, on a store whose lookup pool holds one
    connection: it gets a connection of its own (it does not wait for the other), and its
    value arrives."""
    store = _store(redis_url, pool_size=1, io_threads=2, connections_per_job=1)
    redis_client.mset({_key(0, 1): b"one", _key(0, 2): b"two"})
    pool = store._bulk.connection_pool  # type: ignore[union-attr]
    held = pool.get_connection()  # the other load's, in flight
    try:
        assert _load_raw(store, [_key(0, 1)]) == [b"one"]
        assert _load_raw(store, [_key(0, 2)], native=False) == [b"two"]
    finally:
        pool.release(held)
    assert store.breaker.state is BreakerState.CLOSED


def test_a_store_given_a_client_uses_it_for_everything(redis_client, redis_url):
    """A caller's client (here on db 5) serves lookups and values alike; none is built from
    the configuration (whose URL says db 0)."""
    where = redis_client.connection_pool.connection_kwargs
    client = redis.Redis(host=where["host"], port=where["port"], db=5)
    store = RedisBlockStore(_cfg(redis_url), client=client)
    try:
        assert store.put_if_absent([(_key(0, 1), b"v")]) == [PutResult.STORED]
        assert store.exists([_key(0, 1)]) == [True]
        assert _load_raw(store, [_key(0, 1)]) == [b"v"]
        assert redis_client.exists(_key(0, 1)) == 0
        assert client.get(_key(0, 1)) == b"v"
    finally:
        client.flushdb()
        client.close()


def test_the_bulk_pool_has_a_connection_for_every_transfer_thread():
    # Loads (io_threads) and stores (half as many, at least one), each holding
    # connections_per_job parts of connections_per_thread connections (default 2), and one
    # more for counters or a stray call.
    cfg = _cfg("redis://127.0.0.1:1/0", io_threads=4, connections_per_job=3)
    assert bulk_connections(cfg) == (4 + 2) * 3 * 2 + 1
    cfg = _cfg(
        "redis://127.0.0.1:1/0", io_threads=1, connections_per_job=2, connections_per_thread=3
    )
    assert bulk_connections(cfg) == (1 + 1) * 2 * 3 + 1


# --------------------------------------------------------------------------------- cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    server = started_cluster("tier", "edges-s3cret")
    for client in server.clients():
        with client:
            _grant_reader(client)
    yield server
    server.stop()


@pytest.fixture
def clean(cluster: LocalCluster) -> LocalCluster:
    cluster.flushall()
    return cluster


def _cluster_url(cluster: LocalCluster, user: str, password: str) -> str:
    hosts = ",".join(f"127.0.0.1:{p}" for p in cluster.ports)
    return f"redis+cluster://{user}:{password}@{hosts}/"


def _cluster_client(cluster: LocalCluster) -> redis.RedisCluster:
    return redis.RedisCluster(
        host="127.0.0.1",
        port=cluster.ports[0],
        username=cluster.username,
        password=cluster.password,
    )


def test_cluster_admission_answers_as_standalone(clean: LocalCluster) -> None:
    store = _store(clean.url, read_timeout_s=1.0)
    chunks = [[_key(0, i) + ":r0", _key(0, i) + ":r1"] for i in range(6)]
    markers = [_marker(i) for i in range(6)]
    assert (
        store.put_if_absent([(k, b"v") for k in chunks[1] + chunks[2][:1]])
        == [PutResult.STORED] * 3
    )
    first = store.exists_and_mark(chunks, markers, 60)
    assert first == [Sighting.FIRST, Sighting.PRESENT, *[Sighting.FIRST] * 4]
    again = store.exists_and_mark(chunks, markers, 60)
    assert again == [Sighting.AGAIN, Sighting.PRESENT, *[Sighting.AGAIN] * 4]
    with _cluster_client(clean) as client:
        # (Unlike one EVAL, the pipeline sets a present chunk's marker too: harmless.)
        assert 0 < client.ttl(markers[0]) <= 60
    store.close()


def test_cluster_refusals_are_misses_and_first_sightings(
    clean: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """On a cluster the user's ACL refuses single commands: a refused EXISTS is a miss, a
    refused marker is a FIRST sighting, a refused GET or GETRANGE is None; the tier stays on."""
    store = _store(_cluster_url(clean, "tier", "edges-s3cret"), read_timeout_s=1.0)
    store.put_if_absent([(_key(0, 1), b"v"), ("other:there", b"v"), (_key(0, 2), b"")])
    store.close()
    store = _store(_cluster_url(clean, READER, READER_PW), read_timeout_s=1.0)
    assert store.exists([_key(0, 1), "other:there", _key(0, 3)]) == [True, False, False]
    sightings = store.exists_and_mark(
        [[_key(0, 1)], ["other:there"], [_key(0, 3)], [_key(0, 4)]],
        [_marker(1), _marker(2), "other:marker", _marker(4)],
        60,
    )
    assert sightings == [Sighting.PRESENT, Sighting.FIRST, Sighting.FIRST, Sighting.FIRST]
    assert store.exists_and_mark([[_key(0, 4)]], [_marker(4)], 60) == [Sighting.AGAIN]
    keys = [_key(0, 1), "other:there", _key(0, 2), _key(0, 9)]
    assert _load_raw(store, keys, max_len=1) == [b"v", None, b"", None]
    assert _load_raw(store, keys, max_len=1, native=False) == [b"v", None, b"", None]
    assert store.get(keys) == [b"v", None, b"", None]
    # EXISTS; EXISTS and SET of the admission; the GET of each load job; GET.
    assert store.counters.snapshot()["refused_noperm"] == 1 + 2 + 2 + 1
    assert _refused(caplog) == ["EXISTS", "SET", "GET"]
    assert store.breaker.state is BreakerState.CLOSED
    store.close()


def test_cluster_values_are_bounded_exactly_on_both_paths(clean: LocalCluster) -> None:
    """On a cluster the C job and its twin (``native=False``, as TLS or ``HMA_REDIS_NATIVE=0``
    run it) route every key to its node and agree on every value: whole, bounded exactly (a
    value one byte over its bound is dropped unread), missing."""
    store = _store(clean.url, read_timeout_s=1.0, ttl_s=1000)
    values = {_key(0, i): os.urandom(n) for i, n in enumerate([100, 101, 0, 30, 47])}
    put = _put(store, "put_values-twin", values, ttl_s=50)
    assert put == [PutResult.STORED] * len(values)
    held = {k: _native_value(k, v)[2] for k, v in values.items()}
    keys = [*values, _key(0, 9)]
    bound = len(held[_key(0, 0)])  # the 101-byte body's value is one byte longer
    want = [held[_key(0, 0)], bound + 1, *(held[k] for k in keys[2:5]), None]
    assert _load_raw(store, keys, max_len=bound) == want
    assert _load_raw(store, keys, max_len=bound, native=False) == want
    with _cluster_client(clean) as client:
        assert [client.get(k) for k in values] == list(held.values())
        assert all(40 < client.ttl(k) <= 50 for k in values)
    store.close()


def test_cluster_connections_are_opened_ahead_of_use_on_every_primary(
    clean: LocalCluster,
) -> None:
    """Warming a Cluster store opens connections to each of its three primaries."""
    store = _store(clean.url, connections_per_thread=1)
    try:
        assert store.warm_up(2) == 6
        assert store.warm_lookups() == 3
    finally:
        store.close()


def test_cluster_native_jobs_answer_in_key_order_across_nodes(clean: LocalCluster) -> None:
    """A native put and load of keys on every node: one connection per node, the results
    back in the caller's key order; the pending counters are not carried by the job, and a
    flush delivers them to the stats key's node."""
    store = _store(clean.url, read_timeout_s=1.0)
    keys = [_key(0, i) for i in range(12)]
    owners = clean.slot_owners()
    assert len({owners[key_slot(k.encode())] for k in keys}) == 3  # every node has some
    bodies = {k: os.urandom(100 + i) for i, k in enumerate(keys)}
    store.put_if_absent([(keys[5], b"there before")])
    native = [_native_value(k, bodies[k]) for k in keys]
    store.counters.add(stored_chunks=11)
    got = store.put_values(keys, [n[0] for n in native], [n[1] for n in native])
    assert got == [PutResult.EXISTED if i == 5 else PutResult.STORED for i in range(12)]
    with _cluster_client(clean) as client:
        assert client.hgetall(STATS_KEY) == {}
        store.flush()
        assert client.hgetall(STATS_KEY) == {b"stored_chunks": b"11"}
        assert [client.get(k) for k in keys] == [
            b"there before" if i == 5 else n[2] for i, n in enumerate(native)
        ]

    wanted = [k for i, k in enumerate(keys) if i != 5] + [_key(0, 99)]
    pages = [bytearray(len(bodies.get(k, b""))) for k in wanted]
    targets = [
        medium.LoadTarget(
            bytearray(codec.PREFIX_BYTES + 200),
            BlockHeader(
                key=k, group=0, first_block=0, num_blocks=1, page_bytes=(len(page),)
            ).to_msgpack(),
            [page],
            None,
            1 << 20,
        )
        for k, page in zip(wanted, pages, strict=True)
    ]
    loaded = store.load_values(wanted, targets)
    assert loaded is not None
    statuses = [r.status for r in loaded]
    assert statuses == [medium.LoadStatus.OK] * 11 + [medium.LoadStatus.MISSING]
    assert [bytes(p) for p in pages[:11]] == [bodies[k] for k in wanted[:11]]
    store.close()


def test_a_native_put_to_a_moved_slot_fails_then_stores_on_the_new_owner(
    clean: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A slot resharded after the store learnt the slot table: a native put there is refused
    (MOVED: FAILED, counted, the tier stays on) and the next one, on the refreshed table,
    stores on the node that owns the slot now. (A store without a stats key: counts stay in
    the process and never hold up a native job.)"""
    store = _store(clean.url, stats_key=None, read_timeout_s=1.0)
    store.counters.add(stored_chunks=1)
    key = _key(0, 1)
    head, body, _ = _native_value(key, b"first")
    assert store.put_values([key], [head], [body]) == [PutResult.STORED]
    slot = key_slot(key.encode())
    target = next(p for p in clean.ports if p != clean.slot_owners()[slot])
    clean.move_slot(slot, target)
    moved = next(k for k in (_key(1, i) for i in range(1_000_000)) if key_slot(k.encode()) == slot)

    head, body, whole = _native_value(moved, b"second")
    assert store.put_values([moved], [head], [body]) == [PutResult.FAILED]
    assert store.breaker.state is BreakerState.CLOSED
    assert store.counters.snapshot()["refused_other"] == 1
    assert _refused(caplog) == ["SET"]
    head, body, whole = _native_value(moved, b"second")
    assert store.put_values([moved], [head], [body]) == [PutResult.STORED]
    with redis.Redis(port=target, username=clean.username, password=clean.password) as client:
        assert client.get(moved) == whole

    # The same for a load: the slot moves on again, a load there fails, the next one lands.
    clean.move_slot(slot, next(p for p in clean.ports if p != target))
    page = bytearray(5)
    header = BlockHeader(key=key, group=0, first_block=0, num_blocks=1, page_bytes=(5,))
    job = [medium.LoadTarget(bytearray(256), header.to_msgpack(), [page], None, 1 << 20)]
    failed = store.load_values([key], job)
    assert failed is not None and [r.status for r in failed] == [medium.LoadStatus.ERROR]
    assert store.counters.snapshot()["refused_other"] == 2
    assert _refused(caplog) == ["SET", "GET"]
    landed = store.load_values([key], job)
    assert landed is not None and [r.status for r in landed] == [medium.LoadStatus.OK]
    assert page == bytearray(b"first")
    assert store.breaker.state is BreakerState.CLOSED
    store.close()


def test_a_user_who_may_not_name_connections_still_gets_a_working_tier(reader_server):
    """``CLIENT SETNAME`` refused by the ACL: the store's connections stay unnamed, and
    lookups, stores and loads work as before (the name is for operators, never a condition)."""
    server, admin = reader_server
    _grant_reader(admin, "client")
    store = _store(_reader_url(server.port), stats_key=None)
    try:
        key = _key(0, 2)
        head, body, _ = _native_value(key, b"v")
        assert store.put_values([key], [head], [body]) == [PutResult.STORED]
        assert store.exists([key]) == [True]
        assert store.breaker.state is BreakerState.CLOSED
        assert store_connections(admin, store.client_name) == 0
    finally:
        store.close()


def test_every_connection_of_a_store_carries_its_name(redis_client, redis_url):
    """Both pools, the lookups' and the values' (the native path's sockets): ``CLIENT LIST``
    shows ``hma_redis-<pid>-<n>``, one name per store."""
    first, second = _store(redis_url), _store(redis_url)
    try:
        assert first.warm_up(1) == 2 and first.warm_lookups() == 1
        assert second.warm_lookups() == 1
        assert first.client_name.startswith(f"hma_redis-{os.getpid()}-")
        assert first.client_name != second.client_name
        assert store_connections(redis_client, first.client_name) == 3
        assert store_connections(redis_client, second.client_name) == 1
    finally:
        first.close()
        second.close()


def _congestion_of(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def _pool_congestion(client: redis.Redis) -> set[str]:
    """The congestion controls of a client's open connections."""
    pool = client.connection_pool
    return {_congestion_of(raw_socket(conn)) for conn in pool._connections if conn._sock}


@pytest.mark.parametrize("setting", ["cubic", "reno", ""])
def test_value_connections_run_the_configured_congestion_control(redis_url, setting):
    """``tcp_congestion``: the connections values travel on (the native job's sockets) run
    it; "" leaves the system's; the lookups' connections keep the system's either way. Values
    are stored and loaded through them as usual."""
    system = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    store = _store(redis_url, tcp_congestion=setting)
    try:
        assert store.warm_up(1) == 2 and store.warm_lookups() == 1
        assert _pool_congestion(store._bulk) == {setting or system}
        assert _pool_congestion(store.client) == {system}
        key = _key(0, 9)
        head, body, whole = _native_value(key, b"v")
        assert store.put_values([key], [head], [body]) == [PutResult.STORED]
        assert store.get([key]) == [whole]
    finally:
        store.delete([_key(0, 9)])
        store.close()


def test_a_congestion_control_the_kernel_lacks_is_one_warning_and_the_systems(redis_url, caplog):
    """A name the kernel has no congestion control for: one warning naming it (however many
    connections open), the system's congestion control, and a tier that works."""
    caplog.set_level(logging.WARNING, logger="hma_redis.core.redis.client")
    system = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    store = _store(redis_url, tcp_congestion="nosuchcc")
    try:
        assert store.warm_up(2) == 4
        assert _pool_congestion(store._bulk) == {system}
        key = _key(0, 10)
        head, body, _ = _native_value(key, b"v")
        assert store.put_values([key], [head], [body]) == [PutResult.STORED]
    finally:
        store.delete([_key(0, 10)])
        store.close()
    lines = [r.getMessage() for r in caplog.records if "tcp_congestion" in r.getMessage()]
    assert len(lines) == 1 and "'nosuchcc' is not available here" in lines[0], lines


def test_close_disconnects_every_connection_it_opened(redis_client, redis_url):
    """Both pools (small commands and values, the native path's included) are the store's:
    close() leaves no connection of its own open on the server (counted by the store's client
    name, so other clients of the shared server do not count)."""
    store = _store(redis_url)
    key = _key(0, 1)
    head, body, _ = _native_value(key, b"v")
    assert store.put_values([key], [head], [body]) == [PutResult.STORED]
    assert store.exists([key]) == [True]
    assert store_connections(redis_client, store.client_name) == 2
    store.close()
    assert wait_for_store_connections(redis_client, store.client_name, 0) == 0
    redis_client.delete(key)
