"""How the transfer engine judges what a load received, and what a finished job leaves behind,
against a real Redis (no vLLM): values that land whole in staging (another header than the one
this engine expects) are loaded from the right block or refused with their reason; a failed
load's warning names every reason and no reason it does not have; a job's result says how long
it ran; loads are never flushed as stores; the engine keeps no record of a finished job.

Each job runs on both data paths (the C job and its twin, ``HMA_REDIS_NATIVE=0``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import redis
import torch

from hma_redis.core import codec
from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.kv_pages import (
    DST,
    PAGES,
    SRC,
    UNSTORED_HASHES,
    Pages,
    as_before_or_cleared,
    chunks,
    make_pages,
    store_at,
)
from tests.support.tcp_proxy import BreakingProxy


def _warnings(caplog: pytest.LogCaptureFixture) -> str:
    return " ".join(
        r.getMessage() for r in caplog.records if r.name == "hma_redis.core.transfer.engine"
    )


def test_a_value_whose_header_names_another_group_is_never_loaded_under_this_key(
    pages: Pages, redis_client: redis.Redis
) -> None:
    """A hostile writer's value: this chunk's key echoed, a valid checksum, group 1's page
    sizes, but group 0 in its header. The key alone does not prove the group."""
    job = chunks(SRC)
    assert pages.store_job(1, job).ok
    chunk = [c for c in job if c.group == 1][-1]
    stored: Any = redis_client.get(chunk.redis_key)
    block = codec.decode(stored, expected_key=chunk.redis_key)
    forged = dataclasses.replace(block.header, group=0)
    redis_client.set(chunk.redis_key, bytes(codec.encode(forged, bytes(block.body))))
    assert not pages.load_job(2, chunks(DST)).ok
    assert redis_client.get(chunk.redis_key) is None  # deleted: a recompute may store it again


def test_a_value_holding_more_blocks_than_needed_loads_from_its_first_block(
    pages: Pages, redis_client: redis.Redis
) -> None:
    """A load that needs only the first blocks of a stored chunk (the prompt ends inside it):
    the stored value holds the whole chunk, so its header is not the expected one and it lands
    in staging, where it is valid from its very first block."""
    assert pages.store_job(1, chunks(SRC)).ok
    short_src, short_dst = (SRC[0][:6], SRC[1]), (DST[0][:6], DST[1])
    job = chunks(short_dst)
    assert len(job[1].block_ids) == 2 and job[1].start == 0  # two of the chunk's four blocks
    values = {c.redis_key: len(redis_client.get(c.redis_key) or b"") for c in job}
    result = pages.load_job(2, job)
    assert result.ok
    assert pages.moved(short_src, short_dst)
    assert result.nbytes == sum(values.values())  # staged values count their whole length


def test_a_load_result_says_how_long_the_job_ran(pages: Pages) -> None:
    assert pages.store_job(1, chunks(SRC)).ok
    started = time.perf_counter()
    result = pages.load_job(2, chunks(DST))
    wall = time.perf_counter() - started
    assert result.ok and not result.is_store
    assert 0 < result.seconds <= wall


def test_a_load_with_only_missing_chunks_names_no_invalid_one(
    pages: Pages, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="hma_redis.core.transfer.engine"):
        assert not pages.load_job(2, chunks(DST)).ok
    said = _warnings(caplog)
    assert f"{len(chunks(DST))} chunk(s) missing, 0 invalid;" in said, said
    assert "first" not in said


def test_a_staged_value_that_fails_says_why(
    pages: Pages, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Another chunk's valid value under this key lands in staging; the warning names the
    key it echoes instead of a bare count."""
    job = chunks(SRC)
    assert pages.store_job(1, job).ok
    redis_client.set(job[1].redis_key, redis_client.get(job[0].redis_key) or b"")
    with caplog.at_level("WARNING", logger="hma_redis.core.transfer.engine"):
        assert not pages.load_job(2, chunks(DST)).ok
    said = _warnings(caplog)
    assert "0 chunk(s) missing, 1 invalid (first: " in said, said
    assert "None" not in said and job[0].redis_key in said


def test_a_value_signed_with_another_key_fails_as_a_mac_mismatch(
    path: str, redis_client: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Keyed values land in the pages on the C job (their MAC checked there, as their
    checksum is) and in buffers on the twin; either way a value MAC'd with another key fails
    its load and no page holds a byte of it afterwards."""
    writer_store, reader_store = store_at(redis_url), store_at(redis_url)
    writer = make_pages(writer_store, auth_key=b"w" * 32)
    reader = make_pages(reader_store, auth_key=b"r" * 32)
    try:
        assert reader.engine.loads_land_in_place == (path == "native")
        assert writer.store_job(1, chunks(SRC)).ok
        before = [t.clone() for t in reader.tensors]
        with caplog.at_level("WARNING", logger="hma_redis.core.transfer.engine"):
            assert not reader.load_job(2, chunks(DST)).ok
        said = _warnings(caplog)
        assert f"0 chunk(s) missing, {len(chunks(DST))} invalid" in said, said
        assert "MAC mismatch" in said
        layer_pages = [PAGES[0 if idx < 3 else 1] for idx in range(len(before))]
        assert as_before_or_cleared(before, reader.tensors, layer_pages)
        if path == "python":
            assert all(torch.equal(a, b) for a, b in zip(before, reader.tensors, strict=True))
    finally:
        for rig, store in ((writer, writer_store), (reader, reader_store)):
            rig.close()
            store.close()


def test_a_load_redis_cannot_answer_fails_as_missing_chunks_not_as_a_crash(
    path: str, local_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis gone mid-session: every chunk is missing, said in one warning; no traceback."""
    proxy = BreakingProxy(local_redis.port)
    store = store_at(proxy.url, connect_timeout_s=0.5, read_timeout_s=0.5)
    rig = make_pages(store)
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        proxy.close()  # the listener and every connection through it
        with caplog.at_level("WARNING", logger="hma_redis.core.transfer.engine"):
            assert not rig.load_job(2, chunks(DST)).ok
        said = _warnings(caplog)
        assert f"{len(chunks(DST))} chunk(s) missing, 0 invalid" in said, said
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "transfer" in r.name]
        assert not errors, [r.getMessage() for r in errors]
    finally:
        rig.close()
        store.close()


def test_shutdown_does_not_hold_for_a_load(
    path: str, local_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Shutdown flushes stores; a load still in flight is not one (its request is going away
    with the engine), so shutdown neither waits for it nor counts it as a flushed store."""
    store = store_at(local_redis.url, read_timeout_s=20.0)
    rig = make_pages(store)
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        local_redis.pause()
        rig.engine.submit_load(2, chunks(DST))
        time.sleep(0.2)  # the load is waiting on the paused Redis
        started = time.monotonic()
        with caplog.at_level("INFO", logger="hma_redis.core.transfer.engine"):
            rig.engine.shutdown()
        assert time.monotonic() - started < 0.9  # under shutdown_timeout_s (1 s)
        assert "pending store job" not in _warnings(caplog)
    finally:
        local_redis.resume()
        store.close()


def test_a_second_load_in_flight_keeps_wait_for_finish_waiting(
    path: str, local_redis: LocalRedis
) -> None:
    """Two loads in flight and the first collected: the engine still has a load running, so
    ``wait_for_finish`` sleeps until the second is done instead of returning at once."""
    proxy = BreakingProxy(local_redis.port)
    store = store_at(proxy.url)
    rig = make_pages(store, io_threads=4)  # two loads at once
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        rig.engine.finished()
        proxy.reply_delay_s = 0.5  # every piece of every reply waits; a load takes >= 0.5 s
        rig.engine.submit_load(2, chunks(DST)[:1])
        time.sleep(0.2)
        rig.engine.submit_load(3, chunks(DST))
        deadline = time.monotonic() + 10
        first: list[int] = []
        while not first and time.monotonic() < deadline:
            first = [r.job_id for r in rig.engine.finished()]
            time.sleep(0.005)
        assert first == [2], first  # the one-chunk load, submitted first, ends first
        started = time.monotonic()
        assert rig.engine.wait_for_finish(10.0) is True
        assert time.monotonic() - started > 0.05  # it slept until job 3 ended
        assert [r.job_id for r in rig.engine.finished()] == [3]
    finally:
        proxy.reply_delay_s = 0.0
        rig.close()
        store.close()
        proxy.close()


def test_the_engine_keeps_no_record_of_finished_jobs(pages: Pages) -> None:
    """A long-lived engine runs millions of jobs: none is remembered once it has finished."""
    for job_id in range(1, 6):
        assert pages.store_job(job_id, chunks(SRC)).ok
        assert pages.load_job(100 + job_id, chunks(DST)).ok
    assert not pages.load_job(200, chunks(DST, UNSTORED_HASHES)).ok  # a load that fails
    engine: Any = pages.engine
    assert engine._jobs == {}


def test_a_chunks_value_bound_follows_its_key_length_and_group(pages: Pages) -> None:
    """The most bytes a chunk's value may hold (beyond it a value is refused unread) depends on
    its header, so on its key's length and its group: a bound worked out once for one chunk
    is reused only for chunks whose header has the same size, in whatever order they come."""
    base = chunks(SRC)
    by_group = {c.group: c for c in base}
    engine: Any = pages.engine
    bpc = len(by_group[0].block_ids)
    seen = []
    for group in (0, 1, 0, 1):
        for key in ("k" * 300, "k", "k" * 40, "k" * 300, "é" * 20):
            chunk = dataclasses.replace(by_group[group], redis_key=key)
            whole = dataclasses.replace(chunk, start=0, block_ids=tuple(range(bpc)))
            want = codec.value_size(engine._header(whole)) + 64
            assert engine._value_bound(chunk) == want, (group, len(key))
            seen.append(want)
    assert len(set(seen)) >= 6  # key lengths and groups do change the bound
