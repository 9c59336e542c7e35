"""The transfer engine's two data paths against each other and against a real Redis: the same
jobs through the native path and through ``HMA_REDIS_NATIVE=0`` leave every byte of the KV
cache and of Redis the same; a job's chunks go over ``connections_per_job`` connections; a
native job that breaks fails and the tier heals; pending counters go first on a native job's
connection."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.redis.wire import NATIVE_ENV
from tests.support.kv_pages import (
    DST,
    HASHES,
    KEYSPACE,
    PAGES,
    SRC,
    Pages,
    as_before_or_cleared,
    chunks,
    make_pages,
    store_load_and_narrow_load,
)
from tests.support.redis_server import command_calls, command_delta, store_connections
from tests.support.tcp_proxy import BreakingProxy

AUTH_KEY = b"transfer-paths-secret-0001"


def _store(url: str, native: bool | None = None, **options: object) -> RedisBlockStore:
    return RedisBlockStore(
        RedisTierConfig.from_extra_config({"redis_url": url, **options}, env={}),
        stats_key=KEYSPACE.stats_key(),
        native=native,
    )


@pytest.mark.parametrize("connections", [1, 3])
@pytest.mark.parametrize("auth_key", [None, AUTH_KEY], ids=["unkeyed", "keyed"])
@pytest.mark.parametrize("strided", [False, True], ids=["in-place", "buffered"])
def test_both_paths_leave_the_same_bytes_in_the_kv_cache_and_in_redis(
    redis_client: redis.Redis,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    strided: bool,
    auth_key: bytes | None,
    connections: int,
) -> None:
    outcome = {}
    for path in ("native", "python"):
        if path == "python":
            monkeypatch.setenv(NATIVE_ENV, "0")
        redis_client.flushall()
        store = _store(redis_url, connections_per_job=connections)
        rig = make_pages(store, strided=strided, auth_key=auth_key)
        try:
            assert rig.store.native == (path == "native"), rig.engine.data_path
            outcome[path] = store_load_and_narrow_load(rig, redis_client)
        finally:
            rig.close()
            store.close()
    native, python = outcome["native"], outcome["python"]
    assert native[0] == python[0], "Redis holds other bytes after a native store"
    for got, want in zip(native[1] + native[2], python[1] + python[2], strict=True):
        assert torch.equal(got, want), "the KV cache differs after a native load"
    # The narrow load left the block before its window alone (zeroed above) on both paths.
    for layer in (3, 4):
        assert not native[2][layer][DST[1][0], : PAGES[1]].any()


def test_a_job_is_split_over_connections_per_job_connections(
    redis_client: redis.Redis, redis_url: str
) -> None:
    store = _store(redis_url, connections_per_job=3)
    rig = make_pages(store)
    try:
        assert rig.store.native and "3 thread(s) per job" in rig.engine.data_path
        trips = store.round_trips
        assert rig.store_job(1, chunks(SRC)).ok  # EXISTS, then the 4 values over 3 connections
        assert store.round_trips - trips == 1 + 3
        trips = store.round_trips
        assert rig.load_job(2, chunks(DST)).ok
        assert store.round_trips - trips == 3
        assert rig.moved(SRC, DST)
        # The parts ran on connections of their own, which the pool keeps.
        assert store_connections(redis_client, store.client_name) >= 1 + 3
    finally:
        rig.close()
        store.close()


def test_connections_per_job_is_validated() -> None:
    for bad in (0, -1, 65, "two", True):
        with pytest.raises(ValueError, match="connections_per_job"):
            RedisTierConfig.from_extra_config({"connections_per_job": bad}, env={})
    cfg = RedisTierConfig.from_extra_config({"connections_per_job": "4"}, env={})
    assert cfg.connections_per_job == 4


@pytest.mark.parametrize("path", ["native", "twin"])
def test_a_load_sends_no_counters_ahead_of_its_gets_they_arrive_off_the_load_path(
    redis_client: redis.Redis, redis_url: str, path: str
) -> None:
    """A value job carries no counters: a load with counters pending sends its GETs and
    nothing else (no round trip ahead of them). The engine delivers them on a store thread
    after a job once ``counters_every_s`` has passed, so an instance that only loads still
    reports them, exactly once."""
    stats, per_load = KEYSPACE.stats_key(), len(chunks(DST))
    store = _store(redis_url, native=path == "native")
    rig = make_pages(store, counters_every_s=3600.0)
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        store.flush()
        assert store.counters.take() == {}  # nothing pending
        before = command_calls(redis_client)
        assert rig.load_job(2, chunks(DST)).ok
        assert rig.load_job(3, chunks(DST)).ok
        assert command_delta(before, command_calls(redis_client)) == {"get": 2 * per_load}
        assert redis_client.hget(stats, "loaded_chunks") is None
        assert store.counters.snapshot()["loaded_chunks"] == 2 * per_load  # not yet delivered
        assert rig.moved(SRC, DST)
    finally:
        rig.close()  # shutdown flushes them
        store.close()
    assert redis_client.hget(stats, "loaded_chunks") == b"%d" % (2 * per_load)

    redis_client.delete(stats)
    store = _store(redis_url, native=path == "native")
    rig = make_pages(store, counters_every_s=0.0)  # due after every job
    try:
        assert rig.load_job(4, chunks(DST)).ok
        deadline = time.monotonic() + 5
        while redis_client.hget(stats, "loaded_chunks") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert redis_client.hget(stats, "loaded_chunks") == b"%d" % per_load  # no other call
    finally:
        rig.close()
        store.close()
    assert redis_client.hget(stats, "loaded_chunks") == b"%d" % per_load  # once


@pytest.fixture
def paused_store(local_redis) -> Iterator[tuple[RedisBlockStore, Pages]]:
    store = _store(local_redis.url, read_timeout_s=0.3, retry_interval_s=0.2)
    rig = make_pages(store)
    yield store, rig
    rig.close()
    store.close()


def test_a_native_job_that_times_out_fails_and_the_tier_heals_with_the_right_bytes(
    local_redis, paused_store: tuple[RedisBlockStore, Pages]
) -> None:
    """A load that times out mid-job fails (its blocks are recomputed) and opens the breaker;
    its connection, with the late replies still on their way, is dropped: once Redis is back
    the next load (the breaker's probe) gets the right bytes."""
    store, rig = paused_store
    assert rig.store.native
    assert rig.store_job(1, chunks(SRC)).ok
    local_redis.pause()
    try:
        assert not rig.load_job(2, chunks(DST)).ok
    finally:
        local_redis.resume()
    assert store.breaker.failures >= 1
    for tensor in rig.tensors:
        tensor[DST[0] + DST[1]] = 0
    time.sleep(0.3)  # past retry_interval_s: the next load is the breaker's probe
    assert rig.load_job(3, chunks(DST)).ok
    assert rig.moved(SRC, DST)
    assert store.breaker.state is BreakerState.CLOSED


def test_the_native_path_runs_over_a_unix_socket(tmp_path) -> None:
    from hma_redis.tools.devkit.local_redis import LocalRedis

    path = tmp_path / "redis.sock"
    server = LocalRedis(extra_args=["--unixsocket", str(path), "--unixsocketperm", "700"])
    server.start()
    # The store builds its own client from the URL (unix:///path must stay a unix URL).
    cfg = RedisTierConfig.from_extra_config({"redis_url": f"unix://{path}"}, env={})
    store = RedisBlockStore(cfg)
    rig = make_pages(store)
    try:
        assert rig.store.native, rig.engine.data_path
        assert rig.store_job(1, chunks(SRC)).ok
        assert rig.load_job(2, chunks(DST)).ok
        assert rig.moved(SRC, DST)
        assert store.counters.snapshot()["loaded_chunks"] == 4
    finally:
        rig.close()
        store.close()
        server.stop()


def test_a_refused_get_on_the_native_path_is_a_miss_not_an_outage(local_redis) -> None:
    """A user whose ACL covers only group 0's keys: a native load of both groups fails (the
    refused chunks are misses), each refusal is counted, and the breaker stays closed; a load
    of group 0 alone succeeds on the same store."""
    admin = redis.Redis(port=local_redis.port)
    admin.acl_setuser(
        "g0", enabled=True, passwords=["+pw"], keys=["hma:worker-test:g0:*"], commands=["+@all"]
    )
    writer_store = _store(local_redis.url)
    writer = make_pages(writer_store)
    store = _store(f"redis://g0:pw@127.0.0.1:{local_redis.port}/0")
    reader = make_pages(store)
    try:
        assert reader.store.native
        assert writer.store_job(1, chunks(SRC)).ok
        assert not reader.load_job(2, chunks(DST)).ok
        assert store.counters.snapshot()["refused_noperm"] >= 2  # group 1's two GETs
        assert store.breaker.state is BreakerState.CLOSED and store.breaker.failures == 0
        assert admin.exists(*[KEYSPACE.block_key(1, h) for h in HASHES[1]]) == 2  # not deleted
        group0 = [c for c in chunks(DST) if c.group == 0]
        assert reader.load_job(3, group0).ok
        assert all(
            torch.equal(a, b)
            for a, b in zip(reader.pages(0, DST[0]), writer.pages(0, SRC[0]), strict=True)
        )
    finally:
        for pages, each in ((writer, writer_store), (reader, store)):
            pages.close()
            each.close()
        admin.close()


@pytest.mark.parametrize(
    ("url", "env", "path"),
    [
        ("redis://127.0.0.1:1/0", {}, "native, GIL released"),
        (
            "redis://127.0.0.1:1/0",
            {NATIVE_ENV: "0"},
            "pure Python (disabled by HMA_REDIS_NATIVE=0)",
        ),
        ("rediss://127.0.0.1:1/0", {}, "pure Python (TLS connections stay in Python's ssl)"),
        ("redis+cluster://127.0.0.1:1/", {}, "native, GIL released"),
    ],
    ids=["plain", "disabled", "tls", "cluster"],
)
def test_the_start_up_line_says_which_path_runs_and_why(
    url: str,
    env: dict[str, str],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    caplog.set_level("INFO", logger="hma_redis.core.redis.wire")
    store = _store(url, connect_timeout_s=0.2)
    rig = make_pages(store)  # builds the engine only: nothing is sent
    try:
        assert rig.store.native == path.startswith("native")
        lines = [r.getMessage() for r in caplog.records if "transfer data path" in r.getMessage()]
        assert lines == [f"hma_redis: transfer data path: {rig.engine.data_path}"]
        assert rig.engine.data_path.startswith(path)
    finally:
        rig.close()
        store.close()


def _keep_only(admin: redis.Redis, ours: list[dict[str, Any]], keep: list[dict[str, Any]]) -> None:
    """Kill every one of ``ours`` (the store's connections, through the proxy) but ``keep``:
    the job's other connection and any the pool holds beside it (the engine's start-up
    warm-up can open some while the first job opens its own), so the next job's third part
    is sure to meet a broken one, whichever connections the pool hands out."""
    kept = {c["id"] for c in keep}
    for conn in ours:
        if conn["id"] not in kept:
            admin.client_kill_filter(_id=conn["id"])


def test_a_job_with_one_failing_connection_opens_the_breaker_once(local_redis, caplog) -> None:
    """``connections_per_job=3`` and one of a job's connections broken (Redis drops it, and
    every new connection is cut at once) while the other two still answer: the job fails,
    the breaker opens once and stays open (the other parts' answers do not close it), so
    five failing jobs log one WARNING and send no GET after the first job's."""
    caplog.set_level(logging.WARNING, logger="hma_redis.core.redis.breaker")
    proxy = BreakingProxy(local_redis.port)
    store = _store(proxy.url, connections_per_job=3, connections_per_thread=1, retry_interval_s=600)
    rig = make_pages(store)
    admin = redis.Redis(port=local_redis.port)
    try:
        assert rig.store.native
        assert rig.store_job(1, chunks(SRC)).ok
        # Slow replies: a job's parts overlap, so each holds a connection of its own (a part
        # that started after another ended could reuse its connection and never meet the
        # broken one), and the parts that still answer end after the broken one. A quarter
        # second outlasts a busy host's scheduling delays.
        proxy.reply_delay_s = 0.25
        assert rig.load_job(2, chunks(DST)).ok  # the pool's last three connections
        proxy.limit, proxy.mode = 0, "close"  # every connection from now on is cut at once
        # This store's connections only: another test's idle client of the same server may
        # also have sent GET last.
        ours = [c for c in admin.client_list() if c["addr"] in set(proxy.upstream_addrs)]
        bulk = [c for c in ours if c["cmd"] == "get"]
        assert len(bulk) == 3
        _keep_only(admin, ours, bulk[1:])
        gets = int(admin.info("commandstats")["cmdstat_get"]["calls"])
        caplog.clear()

        for job in range(3, 8):
            assert not rig.load_job(job, chunks(DST)).ok
        warnings = [r for r in caplog.records if r.name == "hma_redis.core.redis.breaker"]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "failed" in warnings[0].getMessage()
        assert store.breaker.state is BreakerState.OPEN
        sent = int(admin.info("commandstats")["cmdstat_get"]["calls"]) - gets
        assert sent <= len(chunks(DST))  # the first job's answering parts only
    finally:
        rig.close()
        store.close()
        proxy.close()
        admin.close()


@pytest.mark.parametrize("attempt", range(3))
def test_a_load_failing_on_some_connections_leaves_its_pages_as_before_or_zero(
    local_redis, attempt: int
) -> None:
    """``connections_per_job=3``, two of a job's three connections broken and the third slow
    but answering: the job fails, and its pages hold what they held before or zeros, never
    the answering part's bytes. Its pages are zeroed only once every part has finished; a
    job that zeroed them as soon as its own part failed would let the slow part write after.
    (Which part meets a broken connection depends on the pool: the job's own part does in
    about half the runs, hence three attempts.)"""
    proxy = BreakingProxy(local_redis.port)
    store = _store(proxy.url, connections_per_job=3, connections_per_thread=1, retry_interval_s=600)
    rig = make_pages(store)
    admin = redis.Redis(port=local_redis.port)
    try:
        assert rig.store.native and rig.engine.loads_land_in_place
        assert rig.store_job(1, chunks(SRC)).ok
        proxy.reply_delay_s = 0.25  # the parts overlap, each on a connection of its own
        assert rig.load_job(2, chunks(DST)).ok
        proxy.limit, proxy.mode = 0, "close"
        ours = [c for c in admin.client_list() if c["addr"] in set(proxy.upstream_addrs)]
        bulk = [c for c in ours if c["cmd"] == "get"]
        assert len(bulk) == 3
        _keep_only(admin, ours, bulk[attempt % 3 :][:1])
        # Pages unlike what the values hold, so a late write would show.
        for tensor in rig.tensors:
            tensor.fill_(0x5A)
        before = [t.clone() for t in rig.tensors]
        layer_pages = [PAGES[0 if idx < 3 else 1] for idx in range(len(before))]

        assert not rig.load_job(3, chunks(DST)).ok
        assert as_before_or_cleared(before, rig.tensors, layer_pages), "a page holds its bytes"
        time.sleep(0.5)  # nothing writes after the job reported its failure either
        assert as_before_or_cleared(before, rig.tensors, layer_pages), "a part wrote later"
    finally:
        rig.close()
        store.close()
        proxy.close()
        admin.close()


def _fresh(job: int) -> list[Any]:
    """SRC's chunks under hashes of their own (not in Redis): a store sends only SETs."""
    hashes = ([bytes([job, g, i]) * 5 + b"\0" for i in (1, 2)] for g in (0, 1))
    return chunks(SRC, tuple(hashes))  # type: ignore[arg-type]


def test_a_store_with_one_failing_connection_opens_the_breaker_once(local_redis, caplog) -> None:
    """The store side of the test above: a store job split over three connections, one of
    them broken while the other two still answer. The job's chunks are not stored, the
    breaker opens once and the answering parts do not close it: five failing jobs, one
    WARNING."""
    caplog.set_level(logging.WARNING, logger="hma_redis.core.redis.breaker")
    proxy = BreakingProxy(local_redis.port)
    store = _store(proxy.url, connections_per_job=3, connections_per_thread=1, retry_interval_s=600)
    rig = make_pages(store)
    admin = redis.Redis(port=local_redis.port)

    def store_job(job: int) -> None:
        fresh = _fresh(job)
        rig.run(
            job, lambda jid, c: rig.engine.submit_store(jid, c, {k.redis_key for k in c}), fresh
        )

    try:
        assert rig.store.native
        proxy.reply_delay_s = 0.25  # a job's parts overlap, each on a connection of its own
        store_job(1)
        assert all(admin.exists(c.redis_key) for c in _fresh(1))
        proxy.limit, proxy.mode = 0, "close"  # every connection from now on is cut at once
        ours = [c for c in admin.client_list() if c["addr"] in set(proxy.upstream_addrs)]
        sets = [c for c in ours if c["cmd"] == "set"]
        assert len(sets) == 3
        _keep_only(admin, ours, sets[1:])
        caplog.clear()

        for job in range(3, 8):
            store_job(job)
        warnings = [r for r in caplog.records if r.name == "hma_redis.core.redis.breaker"]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert store.breaker.state is BreakerState.OPEN
    finally:
        rig.close()
        store.close()
        proxy.close()
        admin.close()


@pytest.mark.parametrize("native", [True, False], ids=["native", "twin"])
def test_a_job_on_two_connections_fails_whole_when_one_breaks_and_drops_both(
    local_redis, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """One thread, two connections (``connections_per_thread=2``): Redis drops one of them in
    the middle of a load. The job fails as a whole (its chunks are recomputed), the breaker
    opens, and the connection that still answered is dropped too: the job stopped with a
    command unanswered on it, so its stream is at an unknown position."""
    if not native:
        monkeypatch.setenv(NATIVE_ENV, "0")
    proxy = BreakingProxy(local_redis.port)
    store = _store(proxy.url, connections_per_job=1, connections_per_thread=2, retry_interval_s=600)
    rig = make_pages(store)
    admin = redis.Redis(port=local_redis.port)

    def ours() -> list[dict[str, Any]]:
        return [c for c in admin.client_list() if c["name"] == store.client_name]

    try:
        assert rig.store.native == native
        assert "up to 2 connection(s) per thread" in rig.engine.data_path
        assert rig.store_job(1, chunks(SRC)).ok
        assert rig.load_job(2, chunks(DST)).ok
        lanes = [c for c in ours() if c["cmd"] == "get"]
        assert len(lanes) == 2, lanes  # the load ran on two connections
        # Job 3's requests reach Redis after one of its connections is dropped, and the other
        # connection's replies are still on their way when the job fails.
        proxy.request_delay_s = proxy.reply_delay_s = 0.3
        killer = threading.Timer(0.1, lambda: admin.client_kill_filter(_id=lanes[0]["id"]))
        killer.start()
        assert not rig.load_job(3, chunks(DST)).ok
        killer.join()
        assert store.breaker.state is BreakerState.OPEN
        deadline = time.monotonic() + 5
        while lanes[1]["id"] in {c["id"] for c in ours()} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lanes[1]["id"] not in {c["id"] for c in ours()}
    finally:
        rig.close()
        store.close()
        proxy.close()
        admin.close()
