"""A slow server cannot stretch an operation past its deadline: a real Redis behind a proxy that
forwards its replies one byte at a time, each byte well within ``read_timeout_s`` of the one
before (so no single wait ever times out). Lookups, loads, stores and the worker's wait on a
store end (failing) by their deadline (:func:`hma_redis.core.deadline.budget_s`), on the native
path and on the Python path."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.deadline import Deadline, budget_s
from hma_redis.core.medium import LoadTarget
from hma_redis.core.redis import client as client_module
from hma_redis.core.redis import wire
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.client import bounded
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.redis.wire import NATIVE_ENV, StoreValue
from hma_redis.core.transfer.engine import TEST_LOAD_DELAY_ENV
from hma_redis.core.transfer.jobs import JobResult
from tests.support.kv_pages import (
    DST,
    KEYSPACE,
    SRC,
    UNSTORED_HASHES,
    Pages,
    chunks,
    make_pages,
    store_at,
)
from tests.support.tcp_proxy import BreakingProxy

READ_TIMEOUT_S = 0.2
BYTE_DELAY_S = 0.1  # half the read timeout: every wait succeeds, the reply crawls
MARGIN_S = 1.0  # scheduling slack on a loaded test machine
PATHS = ["native", "python"]


@pytest.fixture
def slow_proxy(local_redis: Any) -> Iterator[BreakingProxy]:
    proxy = BreakingProxy(local_redis.port)
    yield proxy
    proxy.close()


def _store(proxy: BreakingProxy) -> RedisBlockStore:
    cfg = RedisTierConfig.from_extra_config(
        {
            "redis_url": proxy.url,
            "read_timeout_s": READ_TIMEOUT_S,
            "connect_timeout_s": 0.5,
            "retry_interval_s": 0.1,
        },
        env={},
    )
    return RedisBlockStore(cfg, stats_key=KEYSPACE.stats_key())


@pytest.fixture
def slow_rig(
    slow_proxy: BreakingProxy, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Pages]:
    """A transfer engine on the path ``request.param`` names, whose Redis holds SRC's chunks
    (stored at full speed); the proxy then turns slow."""
    if request.param == "python":
        monkeypatch.setenv(NATIVE_ENV, "0")
    store = _store(slow_proxy)
    rig = make_pages(store)
    try:
        assert rig.store.native == (request.param == "native"), rig.engine.data_path
        assert rig.store_job(1, chunks(SRC)).ok
        slow_proxy.byte_delay_s = BYTE_DELAY_S
        yield rig
    finally:
        slow_proxy.byte_delay_s = None
        rig.close()
        store.close()


def _job_bound(rig: Pages, job: list[Any], read_timeout_s: float = READ_TIMEOUT_S) -> float:
    """The deadline of a transfer job (load or store) of ``job``'s chunks, counted from its
    submission."""
    engine: Any = rig.engine
    nbytes = sum(engine._value_bound(chunk) for chunk in job)
    return budget_s(read_timeout_s, nbytes, round_trips=2)


def _finished(rig: Pages, job_id: int, within_s: float) -> JobResult | None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for result in rig.engine.finished():
            if result.job_id == job_id:
                return result
        time.sleep(0.005)
    return None


def test_a_call_past_its_deadline_opens_no_connection(slow_proxy: BreakingProxy) -> None:
    """The watchdog may expire a call before the call takes its first connection (a thread
    held up on a loaded host): that connection is refused before it connects, or nothing would
    shut its socket down and a slow server could hold the call for its whole reply."""
    store = _store(slow_proxy)
    try:
        slow_proxy.byte_delay_s = BYTE_DELAY_S
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError, match="deadline"), bounded(Deadline.after(0.0)):
            call = client_module._current.call
            while not call.expired:  # the watchdog expires it on its own thread
                assert time.monotonic() - started < MARGIN_S, "the watchdog never fired"
                time.sleep(0.001)
            store.client.ping()  # the pool's first connection, through the slow proxy
        assert time.monotonic() - started < MARGIN_S
    finally:
        slow_proxy.byte_delay_s = None
        store.close()


@pytest.mark.parametrize("connected", [True, False], ids=["open-connection", "new-connection"])
def test_a_lookup_ends_by_its_deadline_however_slowly_redis_answers(
    slow_proxy: BreakingProxy, connected: bool
) -> None:
    """Also on a connection opened during the lookup: its handshake counts against it."""
    store = _store(slow_proxy)
    try:
        keys = [f"hma:deadline:{i}" for i in range(40)]
        if connected:
            assert store.exists(keys) == [False] * 40  # connects at full speed
        slow_proxy.byte_delay_s = BYTE_DELAY_S
        started = time.monotonic()
        found = store.exists(keys)  # its reply is 165 bytes: 16 s at this speed
        elapsed = time.monotonic() - started
        assert found == [False] * 40
        assert elapsed < budget_s(READ_TIMEOUT_S) + MARGIN_S
        assert store.breaker.state is BreakerState.OPEN  # a timeout: the tier turns off
    finally:
        slow_proxy.byte_delay_s = None
        store.close()


@pytest.mark.parametrize("slow_rig", PATHS, indirect=True)
def test_a_load_ends_by_its_deadline_however_slowly_redis_answers(slow_rig: Pages) -> None:
    job = chunks(DST)
    started = time.monotonic()
    slow_rig.engine.submit_load(2, job)
    result = _finished(slow_rig, 2, within_s=_job_bound(slow_rig, job) + MARGIN_S)
    assert result is not None, "the load outlived its deadline"
    assert not result.ok  # failed: its tokens are recomputed
    assert time.monotonic() - started < _job_bound(slow_rig, job) + MARGIN_S


@pytest.mark.parametrize("slow_rig", PATHS, indirect=True)
def test_the_wait_on_a_store_ends_by_its_deadline_however_slowly_redis_answers(
    slow_rig: Pages,
) -> None:
    """vLLM's model-runner thread waits on a store before it reuses the store's blocks: that
    wait ends by the store's deadline."""
    job = chunks(DST, UNSTORED_HASHES)  # not in Redis yet: an EXISTS, then SETs
    started = time.monotonic()
    slow_rig.engine.submit_store(3, job)
    slow_rig.engine.wait({3})
    assert time.monotonic() - started < _job_bound(slow_rig, job) + MARGIN_S


def _slow_socket(proxy: BreakingProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=5)


def _run_bounded(job: Callable[[], object]) -> float:
    """Seconds until ``job`` raised TimeoutError (it must)."""
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        job()
    return time.monotonic() - started


@pytest.mark.parametrize("path", PATHS)
def test_a_slow_server_fails_a_fast_path_job_at_its_budget(
    slow_proxy: BreakingProxy, local_redis: Any, path: str
) -> None:
    """The native job (its poll waits until the deadline at most) and its Python twin end with
    TimeoutError once ``budget_s`` has run out, loads and stores alike."""
    load = wire.native_load_values if path == "native" else wire.python_load_values
    store = wire.native_store_values if path == "native" else wire.python_store_values
    with redis.Redis(port=local_redis.port) as client:
        client.set("v", b"x" * 4096)  # 4 KiB: 7 minutes at this speed
    slow_proxy.byte_delay_s = BYTE_DELAY_S
    budget = 0.5
    with _slow_socket(slow_proxy) as sock:
        target = LoadTarget(bytearray(100), b"", [], bytearray(8192), 8192)
        command = b"*2\r\n$3\r\nGET\r\n$1\r\nv\r\n"
        elapsed = _run_bounded(
            lambda: load(sock, [command], [target], READ_TIMEOUT_S, 1, budget_s=budget)
        )
        assert budget * 0.9 <= elapsed < budget + MARGIN_S
    with _slow_socket(slow_proxy) as sock:
        head = bytearray(codec.PREFIX_BYTES)
        framing = b"*4\r\n$3\r\nSET\r\n$1\r\nw\r\n$48\r\n"
        values = [StoreValue(framing, head, [], b"\r\n$2\r\nNX\r\n")] * 10  # replies: 5 s
        elapsed = _run_bounded(lambda: store(sock, values, READ_TIMEOUT_S, budget_s=budget))
        assert budget * 0.9 <= elapsed < budget + MARGIN_S


@pytest.mark.parametrize("path", PATHS)
def test_a_load_queued_behind_others_ends_by_its_deadline_from_submission(
    local_redis: Any, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's deadline counts from its submission, not from when a thread took it: vLLM
    waits on a job by that bound. Two loads hold the engine's two load threads for 2 s each
    (the test hook's pause, which their own deadlines leave out); the third, queued meanwhile,
    is taken after 2 s and pauses 2 s more: by then its deadline (2 s of pause plus 1.5 s)
    has passed, so it fails without running a budget of its own, though Redis is fast."""
    if path == "python":
        monkeypatch.setenv(NATIVE_ENV, "0")
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, "2.0")
    store = store_at(local_redis.url, read_timeout_s=0.5)
    rig = make_pages(store, io_threads=2)  # two load threads
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        for job_id in (2, 3, 9):
            rig.engine.submit_load(job_id, chunks(DST))
        results: dict[int, JobResult] = {}
        deadline = time.monotonic() + 20
        while len(results) < 3 and time.monotonic() < deadline:
            results.update({r.job_id: r for r in rig.engine.finished()})
            time.sleep(0.01)
        assert results[2].ok and results[3].ok  # their pauses are not theirs to pay for
        assert not results[9].ok  # queued 2 s, paused 2 s: past 2 s + its 1.5 s budget
    finally:
        rig.close()
        store.close()
