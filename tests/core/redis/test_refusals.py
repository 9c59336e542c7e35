"""Command refusals (NOPERM, OOM, READONLY) are answers from a healthy Redis, not outages: they
are counted per kind, logged at most once per interval per kind, never open the circuit breaker,
and everything else the tier does keeps working. Real redis-servers, real ACLs, a real replica."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import pytest
import redis
import torch
from redis.exceptions import (
    ClusterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hma_redis.core import codec, medium
from hma_redis.core.codec import BlockHeader
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.breaker import (
    BreakerState,
    ErrorKind,
    RateLimitedLog,
    Refusal,
    classify,
    refusal_of,
)
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.kv_pages import DST, HASHES, SRC, chunks, make_pages, on_path

VALUES = {f"hma:ns:g0:{i:02x}": os.urandom(1000) for i in range(3)}
INFO_KEY = "hma:ns:info"
STATS_KEY = "hma:ns:stats"


def _store(url: str, **kwargs: object) -> RedisBlockStore:
    cfg = RedisTierConfig.from_extra_config({"redis_url": url, "retry_interval_s": 30}, env={})
    return RedisBlockStore(cfg, stats_key=STATS_KEY, **kwargs)  # type: ignore[arg-type]


def _job_value(key: str, body: memoryview) -> tuple[bytearray, list[memoryview]]:
    """A codec value as ``put_values`` takes it: head (CRC field blank) and body pieces."""
    header = BlockHeader(key=key, group=1, first_block=0, num_blocks=1, page_bytes=(len(body),))
    head = bytearray(codec.encode_parts(header, [body])[0])
    head[12:16] = bytes(4)
    return head, [body[:10], body[10:]]


def _loaded(store: RedisBlockStore, keys: list[str], native: bool) -> list[bytes | None]:
    """``load_values`` of ``keys``, each whole in a staging buffer (no header expected)."""
    targets = [medium.LoadTarget(bytearray(48), b"", [], bytearray(2000), 2000) for _ in keys]
    with on_path(store, native):
        results = store.load_values(keys, targets)
    assert results is not None
    return [
        bytes(t.staging[: r.value_len]) if r.status is medium.LoadStatus.OK else None  # type: ignore[index]
        for t, r in zip(targets, results, strict=True)
    ]


def _assert_refused_writes_leave_the_tier_on(
    store: RedisBlockStore, kind: Refusal, caplog: pytest.LogCaptureFixture
) -> None:
    """Every kind of write is refused, counted as ``kind``; the breaker never opens, and
    lookups and loads (reads) keep working on the same store."""
    caplog.set_level(logging.WARNING)
    keys = [f"hma:ns:g1:{i:02x}" for i in range(4)]
    value = memoryview(os.urandom(5000))
    assert store.put_if_absent([(k, value) for k in keys]) == [PutResult.FAILED] * 4
    jobs = [_job_value(k, value) for k in keys]
    for native in (True, False):  # the C job and its twin
        with on_path(store, native):
            got = store.put_values(keys, [h for h, _ in jobs], [b for _, b in jobs])
        assert got == [PutResult.FAILED] * 4
    assert store.write_info(INFO_KEY, {"model": "m"})  # Redis answered: not "unreachable"
    store.counters.add(lookups=1)
    store.flush()

    counted = store.counters.snapshot()
    assert counted[f"refused_{kind.value}"] >= 13, counted  # 12 SETs and the HSET
    assert store.breaker.state is BreakerState.CLOSED
    assert (store.breaker.failures, store.breaker.openings) == (0, 0)
    # Reads work on: lookups find the values, loads receive them.
    assert store.exists([*VALUES, "hma:ns:g0:ff"]) == [True, True, True, False]
    for native in (True, False):
        assert _loaded(store, list(VALUES), native) == list(VALUES.values())
    assert "not reachable" not in caplog.text and "failed (" not in caplog.text
    assert f"({kind.name};" in caplog.text


@pytest.fixture
def acl_server(local_redis: LocalRedis) -> Iterator[tuple[LocalRedis, redis.Redis]]:
    """A Redis whose user ``tier`` may read everything of the tier but write nothing."""
    admin = redis.Redis(port=local_redis.port)
    admin.mset(VALUES)
    admin.acl_setuser(
        "tier",
        enabled=True,
        passwords=["+pw"],
        keys=["hma:*"],
        commands=["+@all", "-set", "-hset", "-unlink", "-hincrby"],
    )
    yield local_redis, admin
    admin.close()


def test_noperm_refusals_are_counted_and_never_turn_the_tier_off(acl_server, caplog):
    server, admin = acl_server
    store = _store(f"redis://tier:pw@127.0.0.1:{server.port}/0")
    _assert_refused_writes_leave_the_tier_on(store, Refusal.NOPERM, caplog)
    assert store.delete(list(VALUES)) == 0  # UNLINK refused too, and still no outage
    assert store.breaker.state is BreakerState.CLOSED
    assert admin.exists(*VALUES) == len(VALUES)
    assert ":pw@" not in caplog.text
    store.close()


def test_oom_refusals_are_counted_and_never_turn_the_tier_off(local_redis, caplog):
    admin = redis.Redis(port=local_redis.port)
    admin.mset(VALUES)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1mb")
    with pytest.raises(OutOfMemoryError):  # fill it up, if the server is not full already
        for i in range(1000):
            admin.set(f"filler:{i}", os.urandom(10_000))
    store = _store(local_redis.url)
    _assert_refused_writes_leave_the_tier_on(store, Refusal.OOM, caplog)
    store.close()


def test_readonly_refusals_from_a_replica_are_counted_and_never_turn_the_tier_off(
    local_redis, caplog
):
    admin = redis.Redis(port=local_redis.port)
    admin.mset(VALUES)
    replica = LocalRedis(extra_args=["--replicaof", "127.0.0.1", str(local_redis.port)]).start()
    try:
        replica_client = redis.Redis(port=replica.port)
        deadline = time.monotonic() + 10
        while replica_client.exists(*VALUES) != len(VALUES):
            assert time.monotonic() < deadline, "the replica did not sync"
            time.sleep(0.05)
        store = _store(replica.url)
        _assert_refused_writes_leave_the_tier_on(store, Refusal.READONLY, caplog)
        store.close()
    finally:
        replica.stop()


def test_refusals_are_logged_once_per_interval_with_the_number_held_back(acl_server, caplog):
    server, _ = acl_server
    caplog.set_level(logging.WARNING)
    store = _store(f"redis://tier:pw@127.0.0.1:{server.port}/0", refusal_log_interval_s=0.5)
    for i in range(5):
        store.put_if_absent([(f"hma:ns:g0:a{i}", b"v")])
    lines = [r.getMessage() for r in caplog.records if "refused SET" in r.getMessage()]
    assert len(lines) == 1
    time.sleep(0.6)
    store.put_if_absent([("hma:ns:g0:b0", b"v")])
    lines = [r.getMessage() for r in caplog.records if "refused SET" in r.getMessage()]
    assert len(lines) == 2  # not once per process forever
    assert "4 more since the last report" in lines[1]
    assert store.counters.snapshot()["refused_noperm"] == 6
    store.close()


def test_an_engine_whose_stores_are_refused_still_loads(acl_server):
    server, _ = acl_server
    writer_store = _store(server.url)  # the default user: may write
    writer = make_pages(writer_store)
    reader_store = _store(f"redis://tier:pw@127.0.0.1:{server.port}/0")
    reader = make_pages(reader_store)
    try:
        assert writer.store_job(1, chunks(SRC)).ok
        others = tuple([h[:-1] + b"\xee" for h in group] for group in HASHES)  # other chunks
        assert reader.store_job(2, chunks(SRC, others)).ok
        totals = reader_store.counters.snapshot()
        assert totals["store_failed_chunks"] == 4
        assert totals["refused_noperm"] >= 4
        assert reader_store.breaker.state is BreakerState.CLOSED

        assert reader.load_job(3, chunks(DST)).ok
        for group in (0, 1):
            for got, want in zip(
                reader.pages(group, DST[group]), writer.pages(group, SRC[group]), strict=True
            ):
                assert torch.equal(got, want)
    finally:
        for pages, store in ((writer, writer_store), (reader, reader_store)):
            pages.close()
            store.close()


@pytest.mark.parametrize(
    ("error", "kind", "refusal"),
    [
        (RedisConnectionError("refused"), ErrorKind.OUTAGE, None),
        (RedisTimeoutError("timed out"), ErrorKind.OUTAGE, None),
        (ResponseError("LOADING Redis is loading the dataset in memory"), ErrorKind.OUTAGE, None),
        (ClusterDownError("The cluster is down"), ErrorKind.OUTAGE, None),
        (NoPermissionError("this user has no permissions"), ErrorKind.REFUSAL, Refusal.NOPERM),
        (ResponseError("NOPERM this user has no permissions"), ErrorKind.REFUSAL, Refusal.NOPERM),
        (OutOfMemoryError("command not allowed"), ErrorKind.REFUSAL, Refusal.OOM),
        (ResponseError("OOM command not allowed"), ErrorKind.REFUSAL, Refusal.OOM),
        (ReadOnlyError("You can't write against a replica"), ErrorKind.REFUSAL, Refusal.READONLY),
        (ResponseError("WRONGTYPE Operation against a key"), ErrorKind.REFUSAL, Refusal.OTHER),
    ],
)
def test_errors_are_outages_or_refusals(error, kind, refusal):
    assert classify(error) is kind
    if refusal is not None:
        assert refusal_of(error) is refusal


def test_rate_limited_log_counts_what_it_holds_back():
    now = [0.0]
    log = RateLimitedLog(60.0, clock=lambda: now[0])
    assert log.admit("SET:oom") == 0
    assert [log.admit("SET:oom") for _ in range(3)] == [None] * 3
    assert log.admit("GET:noperm") == 0  # kinds are limited apart
    now[0] = 59.9
    assert log.admit("SET:oom") is None
    now[0] = 60.0
    assert log.admit("SET:oom") == 4


def test_a_missing_password_is_named_in_the_tier_warning(
    local_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    redis.Redis(port=local_redis.port).config_set("requirepass", "s3cret-pw")
    store = RedisBlockStore(
        RedisTierConfig.from_extra_config({"redis_url": local_redis.url}, env={})
    )
    try:
        with caplog.at_level(logging.WARNING, logger="hma_redis"):
            assert not store.write_info(INFO_KEY, {"model": "m"})
        with pytest.raises(
            ConnectionError,
            match="Redis requires a password: set HMA_REDIS_PASSWORD or password_file",
        ):
            store.ping()
    finally:
        store.close()
    assert store.breaker.state is BreakerState.OPEN
    text = caplog.text
    assert "Redis requires a password: set HMA_REDIS_PASSWORD or password_file" in text
    assert "HELLO" not in text and "NOAUTH" not in text
