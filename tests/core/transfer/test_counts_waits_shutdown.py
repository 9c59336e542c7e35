"""Contracts of the transfer engine that a user of its counters, its waits and its shutdown
relies on, against a real Redis (no vLLM): every stored chunk is counted once as stored,
existed or failed; a valid value under another chunk's key is never loaded; a value that holds
more blocks than the load needs lands from the right block; ``wait_for_finish`` sleeps only as
long as asked, and on a store only when asked to; shutdown flushes queued stores and then takes
no work; a KV cache whose layers mix host memory and strided views stores and loads every
page.

Each job runs on both data paths (the C job and its twin, ``HMA_REDIS_NATIVE=0``)."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

import pytest
import redis
import torch

from hma_redis.core import codec
from hma_redis.core.latency import Operation
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.buffers import BufferPool
from hma_redis.core.transfer.engine import TEST_LOAD_DELAY_ENV, TransferEngine
from hma_redis.core.transfer.jobs import ValueFormat, split_parts
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.kv_pages import (
    BPC,
    DST,
    LAYERS,
    PAGES,
    SRC,
    Pages,
    chunks,
    kv_tensors,
    layer_groups,
    make_pages,
    store_at,
)


def _counted(store: RedisBlockStore) -> dict[str, int]:
    totals = store.counters.totals
    names = ("stored_chunks", "stored_bytes", "store_existed_chunks", "store_failed_chunks")
    return {name: totals[name] for name in names}


def test_each_stored_chunk_is_counted_once_as_stored_or_existed(
    pages: Pages, redis_client: redis.Redis
) -> None:
    job = chunks(SRC)
    redis_client.set(job[0].redis_key, b"another instance's value")
    # Known absent: sent without EXISTS, so SET NX itself finds the value there.
    result = pages.run(
        1, lambda jid, j: pages.engine.submit_store(jid, j, {c.redis_key for c in job}), job
    )
    assert result.ok
    assert result.nbytes == sum(len(redis_client.get(c.redis_key) or b"") for c in job[1:])
    assert _counted(pages.store) == {
        "stored_chunks": len(job) - 1,
        "stored_bytes": result.nbytes,
        "store_existed_chunks": 1,
        "store_failed_chunks": 0,
    }


def test_chunks_a_full_redis_refuses_are_counted_failed(path: str) -> None:
    server = LocalRedis(extra_args=["--maxmemory-policy", "noeviction"])
    server.start()
    store = store_at(server.url)
    rig = make_pages(store)
    try:
        client = redis.Redis.from_url(server.url)
        client.set("filler", b"x" * (2 << 20))
        client.config_set("maxmemory", "1mb")  # past it: every SET is refused (OOM)
        job = chunks(SRC)
        result = rig.store_job(1, job)
        assert result.nbytes == 0
        assert _counted(store) == {
            "stored_chunks": 0,
            "stored_bytes": 0,
            "store_existed_chunks": 0,
            "store_failed_chunks": len(job),
        }
        client.close()
    finally:
        rig.close()
        store.close()
        server.stop()


def test_a_valid_value_under_another_chunks_key_is_never_loaded(
    pages: Pages, redis_client: redis.Redis
) -> None:
    """A value whose header names another chunk (copied, or a hash collision of the key
    space) is refused even though its checksum holds: it lands in staging, never in a page."""
    job = chunks(SRC)
    assert pages.store_job(1, job).ok
    first, second = job[0], job[1]  # two whole chunks of group 0, same layout
    redis_client.set(second.redis_key, redis_client.get(first.redis_key) or b"")
    before = [t.clone() for t in pages.tensors]
    loaded = pages.load_job(2, chunks(DST))
    assert not loaded.ok
    dst_rows = DST[0][BPC : 2 * BPC]
    for idx in LAYERS[0]:
        rows = pages.tensors[idx][dst_rows, : PAGES[0]]
        # Never the other chunk's pages (zeros where an in-place load was cleared).
        src_rows = pages.tensors[idx][SRC[0][:BPC], : PAGES[0]]
        assert not torch.equal(rows, src_rows) or torch.equal(before[idx][dst_rows], rows)
    assert redis_client.get(second.redis_key) is None  # an invalid value is deleted


def test_a_value_of_another_group_under_this_key_is_never_loaded(
    pages: Pages, redis_client: redis.Redis
) -> None:
    job = chunks(SRC)
    assert pages.store_job(1, job).ok
    group0 = next(c for c in job if c.group == 0)
    group1 = [c for c in job if c.group == 1][-1]  # a whole chunk of group 1
    redis_client.set(group1.redis_key, redis_client.get(group0.redis_key) or b"")
    assert not pages.load_job(2, chunks(DST)).ok


def test_wait_for_finish_waits_as_long_as_asked_and_no_longer(
    path: str, redis_client: redis.Redis, redis_url: str, monkeypatch
) -> None:
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, "3.0")  # the load runs for 3 s at least
    store = store_at(redis_url)
    rig = make_pages(store)
    try:
        monkeypatch.delenv(TEST_LOAD_DELAY_ENV)
        assert rig.store_job(1, chunks(SRC)).ok
        rig.engine.finished()
        rig.engine.submit_load(2, chunks(DST))
        started = time.monotonic()
        assert rig.engine.wait_for_finish(0.0) is False
        assert time.monotonic() - started < 0.5  # 0: never sleeps (bounds loose for busy hosts)
        started = time.monotonic()
        assert rig.engine.wait_for_finish(0.4) is False  # still running after 0.4 s
        assert 0.35 <= time.monotonic() - started < 2.5
    finally:
        rig.close()
        store.close()


def test_wait_for_finish_with_until_ends_when_it_holds_while_the_load_still_runs(
    path: str, redis_client: redis.Redis, redis_url: str, monkeypatch
) -> None:
    """An idle engine step that watches the engine core's input queue (``until``) returns
    when a request arrives there, not when its bound or the load ends."""
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, "3.0")  # the load pauses 3 s before reading
    store = store_at(redis_url)
    rig = make_pages(store)
    try:
        rig.engine.submit_load(1, chunks(DST))
        inputs: queue.Queue[str] = queue.Queue()
        arrive = threading.Timer(0.1, inputs.put_nowait, ("request",))
        arrive.start()
        started = time.monotonic()
        assert rig.engine.wait_for_finish(20.0, until=lambda: inputs.qsize() > 0) is False
        assert time.monotonic() - started < 2.5  # the arrival ended it (bounds loose)
        assert inputs.qsize() == 1 and rig.engine.finished() == []  # the load still runs
        inputs.get_nowait()
        started = time.monotonic()
        assert rig.engine.wait_for_finish(0.3, until=lambda: inputs.qsize() > 0) is False
        assert time.monotonic() - started >= 0.25  # nothing arrived: its bound
    finally:
        rig.close()
        store.close()


def test_wait_for_finish_sleeps_on_a_running_store_only_when_asked_to(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    """An engine step (loads only) never waits on a store; a benchmark waiting on its own jobs
    (``stores_too``) sleeps while the store runs and wakes when it ends. Redis holds the store's
    SETs with CLIENT PAUSE WRITE for 1 s."""
    store = store_at(redis_url)
    rig = make_pages(store)
    try:
        redis_client.execute_command("CLIENT", "PAUSE", "1000", "WRITE")
        paused_at = time.monotonic()
        rig.engine.submit_store(1, chunks(SRC))
        started = time.monotonic()
        assert rig.engine.wait_for_finish(5.0) is False  # no load runs: at once
        assert time.monotonic() - started < 0.5
        started = time.monotonic()
        assert rig.engine.wait_for_finish(0.3, stores_too=True) is False  # still held
        assert 0.25 <= time.monotonic() - started < 0.9
        assert rig.engine.wait_for_finish(10.0, stores_too=True) is True  # woken by its end
        assert 0.9 <= time.monotonic() - paused_at < 5.0
        (result,) = rig.engine.finished()
        assert result.ok and result.nbytes > 0
        assert all(redis_client.exists(c.redis_key) for c in chunks(SRC))
        started = time.monotonic()
        assert rig.engine.wait_for_finish(5.0, stores_too=True) is False  # nothing runs
        assert time.monotonic() - started < 0.5
    finally:
        redis_client.execute_command("CLIENT", "UNPAUSE")
        rig.close()
        store.close()


def test_shutdown_flushes_queued_stores_then_takes_no_more(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    store = store_at(redis_url)
    rig = make_pages(store, io_threads=2)  # one store thread: the second job queues
    job = chunks(SRC)
    rig.engine.submit_store(1, job[:2])
    rig.engine.submit_store(2, job[2:])
    rig.engine.shutdown()
    assert all(redis_client.exists(c.redis_key) for c in job), "a queued store was dropped"
    assert _counted(store)["stored_chunks"] == len(job)
    rig.engine.shutdown()  # idempotent
    store.close()


def test_shutdown_gives_up_on_stores_that_outlast_its_timeout(
    path: str, local_redis: LocalRedis
) -> None:
    """A store stuck on a paused Redis holds shutdown for ``shutdown_timeout_s`` (1 s here),
    not for the store's own deadline."""
    store = store_at(local_redis.url, read_timeout_s=20.0)
    rig = make_pages(store)
    try:
        local_redis.pause()
        rig.engine.submit_store(1, chunks(SRC))
        time.sleep(0.2)
        started = time.monotonic()
        rig.engine.shutdown()
        assert time.monotonic() - started < 5.0
    finally:
        local_redis.resume()
        store.close()


def test_shutdown_stops_every_thread_of_the_engine(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    before = set(threading.enumerate())
    store = store_at(redis_url)
    rig = make_pages(store)
    assert rig.store_job(1, chunks(SRC)).ok
    assert rig.load_job(2, chunks(DST)).ok
    # Named, so they can be found.
    assert _threads("hma-load", before) >= 1 and _threads("hma-store", before) >= 1
    rig.engine.shutdown()
    deadline = time.monotonic() + 5
    names = ("hma-load", "hma-store", "hma-conn")
    while time.monotonic() < deadline:
        alive = [t for t in threading.enumerate() if t.name.startswith(names) and t not in before]
        if not alive:
            break
        time.sleep(0.05)
    assert not alive, f"threads left after shutdown: {[t.name for t in alive]}"
    store.close()


def test_a_cache_of_host_and_strided_layers_stores_and_loads_every_page(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    """Group 0 in host memory, group 1 strided (as a mixed KV cache may be): values go
    through buffers, the host layers' pages copied by runs, the strided ones by torch."""
    tensors = kv_tensors()
    strided = kv_tensors(strided=True)
    for idx in LAYERS[1]:
        tensors[idx] = strided[idx]
    store = store_at(redis_url)
    engine = TransferEngine(
        store,
        layer_groups(tensors),
        ValueFormat(kv_dtype="int8"),
        blocks_per_chunk=BPC,
        io_threads=2,
        shutdown_timeout_s=1.0,
    )
    rig = Pages(engine, tensors, store)
    try:
        before = [t.clone() for t in tensors]
        assert rig.store_job(1, chunks(SRC)).ok
        assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))
        assert rig.load_job(2, chunks(DST)).ok
        assert rig.moved(SRC, DST)
    finally:
        rig.close()
        store.close()


def _loaded(store: RedisBlockStore) -> dict[str, int]:
    totals = store.counters.totals
    names = ("loaded_chunks", "loaded_bytes", "load_failed_jobs", "load_failed_chunks")
    return {name: totals[name] for name in names}


def test_a_load_counts_its_chunks_and_bytes(pages: Pages, redis_client: redis.Redis) -> None:
    job = chunks(SRC)
    assert pages.store_job(1, job).ok
    value_bytes = sum(len(redis_client.get(c.redis_key) or b"") for c in job)
    loaded = pages.load_job(2, chunks(DST))
    assert loaded.ok and loaded.nbytes == value_bytes
    assert _loaded(pages.store) == {
        "loaded_chunks": len(job),
        "loaded_bytes": value_bytes,
        "load_failed_jobs": 0,
        "load_failed_chunks": 0,
    }


def _damage(value: bytes, how: str) -> bytes:
    """``value`` damaged the way the world damages values."""
    if how == "random-body":  # random bytes over the second half, the header intact
        half = len(value) // 2
        return value[:half] + os.urandom(len(value) - half)
    if how == "longer":  # one byte past what its chunk can hold
        return value + os.urandom(1 << 20)
    if how == "truncated":  # the expected header, a body short of what it announces
        return value[:-7]
    raise AssertionError(how)


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("random-body", "checksum mismatch"),
        ("longer", "its chunk at most"),
        ("truncated", "not the length its header announces"),
    ],
)
def test_a_failed_load_says_why_and_counts_every_chunk(
    pages: Pages, redis_client: redis.Redis, caplog, how: str, reason: str
) -> None:
    job = chunks(SRC)
    assert pages.store_job(1, job).ok
    bad = chunks(DST)[1]
    redis_client.set(bad.redis_key, _damage(redis_client.get(bad.redis_key) or b"", how))
    redis_client.unlink(chunks(DST)[2].redis_key)
    with caplog.at_level("WARNING", logger="hma_redis.core.transfer.engine"):
        assert not pages.load_job(2, chunks(DST)).ok
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "1 chunk(s) missing, 1 invalid" in said and reason in said, said
    assert bad.redis_key in said
    assert _loaded(pages.store) == {
        "loaded_chunks": 0,
        "loaded_bytes": 0,
        "load_failed_jobs": 1,
        "load_failed_chunks": len(job),
    }


def test_a_partial_load_counts_what_landed_and_what_failed(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    store = store_at(redis_url)
    rig = make_pages(store, partial_loads=True)
    try:
        job = chunks(SRC)
        assert rig.store_job(1, job).ok
        redis_client.unlink(chunks(DST)[1].redis_key)
        value_bytes = sum(len(redis_client.get(c.redis_key) or b"") for c in job)
        result = rig.load_job(2, chunks(DST))
        assert not result.ok and result.failed_chunks == (1,)
        assert result.nbytes == value_bytes
        assert _loaded(store) == {
            "loaded_chunks": len(job) - 1,
            "loaded_bytes": value_bytes,
            "load_failed_jobs": 1,
            "load_failed_chunks": 1,
        }
    finally:
        rig.close()
        store.close()


@pytest.mark.parametrize(
    ("field", "at", "value"),
    [("magic", 0, b"XMAK"), ("version", 4, b"\x7f\x7f"), ("flags", 6, b"\x00\x80")],
    ids=["magic", "version", "flags"],
)
def test_a_value_of_another_format_is_never_loaded_though_its_checksum_holds(
    pages: Pages, redis_client: redis.Redis, field: str, at: int, value: bytes
) -> None:
    """The checksum covers the header and body, not the prefix: a value whose prefix says
    another magic, format version or an unknown flag, with this engine's header and a valid
    checksum, is refused, never landed as this format."""
    assert pages.store_job(1, chunks(SRC)).ok
    bad = chunks(DST)[0]
    stored = bytearray(redis_client.get(bad.redis_key) or b"")
    stored[at : at + len(value)] = value
    redis_client.set(bad.redis_key, bytes(stored))
    assert not pages.load_job(2, chunks(DST)).ok, field
    assert redis_client.exists(bad.redis_key) == 0


def _wire_calls(make: Callable[[], Pages]) -> set[str]:
    """The wire's functions the threads of the engine ``make`` builds call for one store
    and one load (profiled from before the engine starts its threads)."""
    called: set[str] = set()

    def profile(frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        if event == "call" and frame.f_code.co_filename.endswith("wire.py"):
            called.add(frame.f_code.co_name)

    threading.setprofile(profile)
    try:
        rig = make()
        try:
            assert rig.store_job(1, chunks(SRC)).ok
            assert rig.load_job(2, chunks(DST)).ok
        finally:
            rig.close()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    return called


TWIN = {"python_store_values", "python_load_values"}
NATIVE = {"native_store_values", "native_load_values"}


def test_each_job_runs_on_the_data_path_its_engine_names(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    """A native engine's jobs run the C job; an engine on the Python path (here
    ``HMA_REDIS_NATIVE=0``) runs the twin for stores and loads alike. Seen by which of the
    fast path's functions the engine's threads call."""
    store = store_at(redis_url)
    try:
        called = _wire_calls(lambda: make_pages(store))
    finally:
        store.close()
    assert called >= (NATIVE if path == "native" else TWIN), called
    assert not called & (TWIN if path == "native" else NATIVE), called


def test_a_store_asked_for_the_python_path_runs_the_twin_where_c_could_run(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """``native=False`` (the builder's choice, not the environment's): where the store could
    run the C job, the engine's jobs run the twin."""
    probe = store_at(redis_url)
    assert probe.native
    probe.close()
    store = store_at(redis_url, native=False)
    tensors = kv_tensors()
    try:
        called = _wire_calls(lambda: Pages(_engine(store, tensors), tensors, store))
    finally:
        store.close()
    assert called >= TWIN and not called & NATIVE, called


def test_a_store_that_asks_first_counts_what_was_there_once_and_times_it_as_a_store(
    pages: Pages, redis_client: redis.Redis
) -> None:
    """Chunks not known absent are asked about first (EXISTS); those present are counted
    existed once, never sent, and the round trip's time is a store's, not a lookup's."""
    job = chunks(SRC)
    redis_client.set(job[0].redis_key, b"another instance's value")
    pages.store.latency.take()
    result = pages.store_job(1, job)
    assert result.ok
    assert redis_client.get(job[0].redis_key) == b"another instance's value"
    assert _counted(pages.store) == {
        "stored_chunks": len(job) - 1,
        "stored_bytes": result.nbytes,
        "store_existed_chunks": 1,
        "store_failed_chunks": 0,
    }
    samples = pages.store.latency.take()
    assert set(samples) == {Operation.STORE} and len(samples[Operation.STORE]) == 2, samples


@pytest.mark.parametrize(
    ("sizes", "parts"),
    [([1] * 6, 3), ([1, 1, 10], 3), ([10, 1, 1], 3), ([1, 1, 1, 1], 2), ([5], 4), ([], 2)],
)
def test_a_job_is_cut_into_consecutive_non_empty_parts_in_order(
    sizes: list[int], parts: int
) -> None:
    cuts = split_parts(sizes, parts)
    assert 1 <= len(cuts) <= max(1, parts)
    covered = [i for cut in cuts for i in range(len(sizes))[cut]]
    assert covered == list(range(len(sizes)))  # every item once, in order
    assert all(cut.stop > cut.start for cut in cuts) or sizes == []


def test_six_equal_items_in_three_parts_are_two_each() -> None:
    assert split_parts([1] * 6, 3) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert split_parts([1] * 4, 2) == [slice(0, 2), slice(2, 4)]
    assert split_parts([10, 1, 1], 3) == [slice(0, 1), slice(1, 2), slice(2, 3)]


def test_the_buffer_pool_reuses_what_it_was_given_up_to_its_limit() -> None:
    pool = BufferPool(limit=3000, pinned=False)
    first = pool.take(1000)
    second = pool.take(1000)
    assert pool.peak_bytes == 2000
    pool.give([first, second])
    again = pool.take(1000)
    assert again.obj is second.obj or again.obj is first.obj  # reused, not allocated
    other = pool.take(500)  # another size is never served from the 1000-byte buffers
    assert other.nbytes == 500 and all(other.obj is not b.obj for b in (first, second))
    assert pool.peak_bytes == 2000  # out now: 1000 + 500
    pool.give([again, other])
    # Idle bytes stay under the limit: of three more 1000-byte buffers only what fits is kept.
    extra = [pool.take(1000) for _ in range(4)]
    pool.give(extra)
    kept = [pool.take(1000) for _ in range(4)]
    reused = sum(any(k.obj is e.obj for e in extra) for k in kept)
    assert reused == 2, reused  # 3000 idle at most: 500 + 2 x 1000 (a third would pass it)


def test_stores_abandoned_at_shutdown_never_run_later(path: str, local_redis: LocalRedis) -> None:
    """Stores still queued when shutdown gives up (Redis paused past ``shutdown_timeout_s``)
    are dropped: none of them runs once Redis is back, and shutdown returns within its
    timeout, not the stuck job's own deadline."""
    store = store_at(local_redis.url, read_timeout_s=20.0)
    rig = make_pages(store, io_threads=2)  # one store thread: jobs 2 and 3 queue behind 1
    job = chunks(SRC)
    client = redis.Redis.from_url(local_redis.url)
    try:
        local_redis.pause()
        for job_id, part in enumerate((job[:1], job[1:2], job[2:]), start=1):
            rig.engine.submit_store(job_id, part, {c.redis_key for c in part})
        time.sleep(0.2)
        started = time.monotonic()
        rig.engine.shutdown()
        assert time.monotonic() - started < 5.0
        local_redis.resume()
        time.sleep(1.5)
        assert not any(client.exists(c.redis_key) for c in job[1:]), "a dropped store ran"
    finally:
        local_redis.resume()
        client.close()
        store.close()


def _engine(store: RedisBlockStore, tensors: list[torch.Tensor], **kwargs) -> TransferEngine:
    """An engine as the worker builds one: every option not given at its default."""
    return TransferEngine(
        store, layer_groups(tensors), ValueFormat(kv_dtype="int8"), blocks_per_chunk=BPC, **kwargs
    )


@pytest.mark.parametrize(
    ("strided", "native", "auth_key", "where"),
    [
        (False, None, None, "loads land in the KV cache's pages"),
        (True, None, None, "loads received into buffers, copied once valid"),
        (False, False, None, "loads received into buffers, copied once valid"),
        (False, None, b"k" * 32, "loads land in the KV cache's pages"),
    ],
    ids=["host", "strided", "python-asked", "auth-key"],
)
def test_the_data_path_line_says_where_loads_land_and_why(
    redis_url: str, strided: bool, native: bool | None, auth_key: bytes | None, where: str
) -> None:
    store = store_at(redis_url, native=native)
    engine = TransferEngine(
        store,
        layer_groups(kv_tensors(strided)),
        ValueFormat(kv_dtype="int8", auth_key=auth_key),
        blocks_per_chunk=BPC,
    )
    try:
        assert where in engine.data_path
        assert engine.loads_land_in_place == where.startswith("loads land")
        if native is False:
            assert "(the Python path was asked for)" in engine.data_path and not store.native
        else:
            assert store.native and engine.data_path.startswith("native")
        assert "1 thread(s) per job" in engine.data_path
    finally:
        engine.shutdown()
        store.close()


def _threads(prefix: str, since: set[threading.Thread] | None = None) -> int:
    """Live threads named ``prefix...``, of those started after ``since`` was taken (other
    tests' engines may still be winding down)."""
    return sum(
        t.name.startswith(prefix) and t not in (since or set()) for t in threading.enumerate()
    )


@pytest.mark.parametrize(
    ("io_threads", "loads", "stores"), [(None, 4, 2), (2, 2, 1)], ids=["default", "two"]
)
def test_an_engine_runs_io_threads_loads_and_half_as_many_stores_at_once(
    path: str, local_redis: LocalRedis, io_threads: int | None, loads: int, stores: int
) -> None:
    """``io_threads`` (default 4) loads at once, stores on half as many threads (at least one)."""
    before = set(threading.enumerate())
    store = store_at(local_redis.url)
    tensors = kv_tensors()
    options = {} if io_threads is None else {"io_threads": io_threads}
    rig = Pages(_engine(store, tensors, **options), tensors, store)
    job = chunks(SRC)
    try:
        assert rig.store_job(1, job).ok
        local_redis.pause()
        for job_id in range(10, 16):  # six loads and three stores wait on the paused Redis
            rig.engine.submit_load(job_id, chunks(DST))
        for job_id in range(20, 23):
            rig.engine.submit_store(job_id, job[:1])
        deadline = time.monotonic() + 5  # threads start as their jobs are taken
        while time.monotonic() < deadline and (
            _threads("hma-load", before) < loads or _threads("hma-store", before) < stores
        ):
            time.sleep(0.05)
        time.sleep(0.2)  # and no more than that start
        assert _threads("hma-load", before) == loads
        assert _threads("hma-store", before) == stores
    finally:
        local_redis.resume()
        rig.close()
        store.close()


def test_a_load_with_a_missing_chunk_lands_nothing_by_default(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    """Without ``partial_loads`` a load is all or nothing: one missing chunk fails every
    chunk of the job, and no page of the others is written."""
    store = store_at(redis_url)
    tensors = kv_tensors()
    rig = Pages(_engine(store, tensors), tensors, store)
    try:
        job = chunks(SRC)
        assert rig.store_job(1, job).ok
        redis_client.unlink(chunks(DST)[3].redis_key)
        before = [t.clone() for t in tensors]
        result = rig.load_job(2, chunks(DST))
        assert not result.ok and result.failed_chunks == tuple(range(len(job)))
        for idx in LAYERS[0]:  # the first chunks' pages: as before or cleared, never loaded
            rows = tensors[idx][DST[0][:BPC], : PAGES[0]]
            assert torch.equal(rows, before[idx][DST[0][:BPC], : PAGES[0]]) or not rows.any()
    finally:
        rig.close()
        store.close()


def test_values_carry_a_mac_exactly_when_the_engine_has_an_auth_key(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    for auth_key in (None, b"k" * 32):
        redis_client.flushall()
        store = store_at(redis_url)
        rig = make_pages(store, auth_key=auth_key)
        try:
            assert rig.store_job(1, chunks(SRC)).ok
            values = [redis_client.get(c.redis_key) or b"" for c in chunks(SRC)]
            assert [codec.has_mac(v) for v in values] == [auth_key is not None] * len(values)
        finally:
            rig.close()
            store.close()


def test_a_store_submitted_after_shutdown_runs_in_the_callers_thread(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    """At interpreter exit the thread pools take no new work: a store submitted then is not
    lost, it runs at once in the caller's thread."""
    store = store_at(redis_url)
    rig = make_pages(store)
    rig.engine.shutdown()
    job = chunks(SRC)
    rig.engine.submit_store(1, job, {c.redis_key for c in job})
    assert all(redis_client.exists(c.redis_key) for c in job)
    assert _counted(store)["stored_chunks"] == len(job)
    store.close()


def test_wait_for_finish_returns_at_once_when_no_load_runs(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    store = store_at(redis_url)
    rig = make_pages(store)
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        assert rig.load_job(2, chunks(DST)).ok
        assert rig.load_job(3, chunks(DST)).ok
        started = time.monotonic()
        assert rig.engine.wait_for_finish(3.0) is False
        assert time.monotonic() - started < 2.0  # nothing runs: no sleep
    finally:
        rig.close()
        store.close()


def test_the_parts_of_a_split_job_run_on_their_own_named_threads(
    path: str, redis_client: redis.Redis, redis_url: str
) -> None:
    """With ``connections_per_job`` 2 each job's second part runs on an ``hma-conn`` thread
    while the job's own thread runs the first; both parts land."""
    before = set(threading.enumerate())
    store = store_at(redis_url)
    tensors = kv_tensors()
    rig = Pages(_engine(store, tensors, connections_per_job=2), tensors, store)
    try:
        assert "2 thread(s) per job" in rig.engine.data_path
        assert rig.store_job(1, chunks(SRC)).ok
        assert rig.load_job(2, chunks(DST)).ok and rig.moved(SRC, DST)
        assert _threads("hma-conn", before) >= 1
    finally:
        rig.close()
        store.close()
