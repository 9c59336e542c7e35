"""The transfer engine on CPU KV pages against a real Redis (no vLLM): pages land where they
belong and nothing else changes, a bad job fails, writes nothing outside its blocks (nothing at
all where values go through buffers) and counts its chunks, ``max_inflight_bytes`` bounds loads
as well as stores, fairly, and a value longer than its chunk can be is refused without ever
being held.

Every test of a job runs on both data paths (the C job, and its pure-Python twin with
``HMA_REDIS_NATIVE=0``)."""

from __future__ import annotations

import math
import os
import random
import struct
import threading
import time
from typing import Any

import pytest
import torch

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.buffers import ByteBudget
from hma_redis.core.transfer.engine import TEST_LOAD_DELAY_ENV
from hma_redis.core.transfer.jobs import LayoutMismatch, group_chunks, split_parts
from hma_redis.core.transfer.pages import positioned_runs
from hma_redis.tools.devkit.local_redis import free_port
from tests.support.kv_pages import (
    DST,
    LAYERS,
    NUM_BLOCKS,
    PAGES,
    SRC,
    Pages,
    as_before_or_cleared,
    chunks,
    make_pages,
)
from tests.support.redis_server import store_connections, wait_for_store_connections


def _store(url: str) -> RedisBlockStore:
    return RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))


def _stored_keys(client) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter("hma:worker-test:g*"))


def _changed_only_in(before: list[torch.Tensor], pages: Pages, blocks) -> bool:
    """Whether every byte outside the pages of ``blocks`` (per group) is as ``before``."""
    for idx, (old, new) in enumerate(zip(before, pages.tensors, strict=True)):
        group = 0 if idx < 3 else 1
        changed = torch.zeros_like(old, dtype=torch.bool)
        changed[blocks[group], : PAGES[group]] = True
        if not torch.equal(old[~changed], new[~changed]):
            return False
    return True


def _unchanged_unless_landed(before: list[torch.Tensor], pages: Pages, blocks) -> bool:
    """A failed load wrote nothing, except that on the native path into a CPU KV cache values
    land in their pages before the job knows it fails: there only the job's own blocks may
    have changed, and each of them holds what it held before or zeros (the job zeroes every
    page it may have written before it reports its failure)."""
    if pages.engine.loads_land_in_place:
        layer_pages = [PAGES[0 if idx < 3 else 1] for idx in range(len(before))]
        return _changed_only_in(before, pages, blocks) and as_before_or_cleared(
            before, pages.tensors, layer_pages
        )
    return all(torch.equal(a, b) for a, b in zip(before, pages.tensors, strict=True))


def test_block_runs_groups_consecutive_ids():
    assert positioned_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert positioned_runs([7]) == [(0, 7, 1)]


def test_store_then_load_moves_every_page_and_nothing_else(
    pages: Pages, pieces: str, redis_client
) -> None:
    before = [t.clone() for t in pages.tensors]
    ranges = redis_client.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0)
    stored = pages.store_job(1, chunks(SRC))
    assert stored.ok and stored.is_store and stored.nbytes > 0
    assert all(torch.equal(a, b) for a, b in zip(before, pages.tensors, strict=True))

    loaded = pages.load_job(2, chunks(DST))
    assert loaded.ok and not loaded.is_store and loaded.nbytes == stored.nbytes
    assert pages.moved(SRC, DST)
    # Only the destination pages changed: padding bytes and every other block are as before.
    assert _changed_only_in(before, pages, DST)
    after = redis_client.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0)
    assert (after > ranges) == (pieces == "pieces")


def test_a_store_of_chunks_known_absent_asks_redis_nothing_and_overwrites_nothing(
    pages: Pages, redis_client
) -> None:
    """Chunks the caller has just seen missing are sent without an EXISTS round trip; one
    another instance stored in between keeps its value (SET NX) and counts as existed."""
    job = chunks(SRC)
    assert not isinstance(job, LayoutMismatch)
    first, rest = job[0], job[1:]
    redis_client.set(first.redis_key, b"another instance's value")
    trips = pages.store.round_trips
    stored = pages.run(
        1, lambda jid, j: pages.engine.submit_store(jid, j, {c.redis_key for c in job}), job
    )
    assert stored.ok and stored.nbytes > 0
    assert redis_client.get(first.redis_key) == b"another instance's value"
    assert all(redis_client.exists(c.redis_key) for c in rest)
    assert pages.store.round_trips - trips == 1  # the SETs only: no EXISTS
    assert pages.store.counters.totals["store_existed_chunks"] == 1

    # Not known absent: asked first, and the present chunks are not sent again.
    trips = pages.store.round_trips
    again = pages.store_job(2, job)
    assert again.ok and again.nbytes == 0
    assert pages.store.round_trips - trips == 1  # the EXISTS only


def test_wait_returns_once_a_store_no_longer_reads_its_pages(pages: Pages) -> None:
    pages.engine.submit_store(1, chunks(SRC))
    pages.engine.wait({1, 99})  # 99: never submitted, returns at once
    before = [t.clone() for t in pages.tensors]
    for tensor in pages.tensors:
        tensor.zero_()  # the pages may be reused now: what was read is stored as it was
    for tensor, old in zip(pages.tensors, before, strict=True):
        tensor.copy_(old)
    deadline = time.monotonic() + 10
    while not any(r.job_id == 1 for r in pages.engine.finished()):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert pages.load_job(2, chunks(DST)).ok
    assert pages.moved(SRC, DST)


def test_a_job_whose_layout_does_not_add_up_fails_and_counts_its_chunks(pages: Pages) -> None:
    before = [t.clone() for t in pages.tensors]
    assert pages.store_job(1, LayoutMismatch(5)).ok  # a store is best effort: nothing stored
    assert pages.store.counters.snapshot()["store_failed_chunks"] == 5
    failed = pages.load_job(2, LayoutMismatch(3))
    assert not failed.ok and failed.nbytes == 0
    totals = pages.store.counters.snapshot()
    assert (totals["load_failed_jobs"], totals["load_failed_chunks"]) == (1, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, pages.tensors, strict=True))


def test_store_job_that_raises_counts_every_chunk_as_failed(pages: Pages) -> None:
    # A block id past the end of the KV cache: the job fails while it reads the pages.
    bad = ([*SRC[0][:-1], NUM_BLOCKS + 5], SRC[1])
    assert pages.store_job(1, chunks(bad)).ok
    # Every chunk is counted once; those of the failed batch as failed.
    totals = pages.store.counters.snapshot()
    assert totals.get("stored_chunks", 0) + totals["store_failed_chunks"] == 4
    assert totals["store_failed_chunks"] >= 1


def test_corrupt_chunk_fails_the_load_and_is_dropped(pages: Pages, redis_client):
    assert pages.store_job(1, chunks(SRC)).ok
    keys = _stored_keys(redis_client)
    assert len(keys) == 4
    victim = keys[-1]
    value = bytearray(redis_client.get(victim))
    value[-1] ^= 0xFF  # one flipped bit in the last page of the last layer
    redis_client.set(victim, bytes(value))

    before = [t.clone() for t in pages.tensors]
    assert not pages.load_job(2, chunks(DST)).ok
    assert _unchanged_unless_landed(before, pages, DST)
    assert redis_client.exists(victim) == 0  # dropped, so the recompute can store a good copy
    assert redis_client.exists(*keys[:-1]) == 3


def _random_middle_half(value: bytes, rng: random.Random) -> bytes:
    quarter = len(value) // 4
    return value[:quarter] + rng.randbytes(2 * quarter) + value[3 * quarter :]


def _nan_payload(value: bytes, rng: random.Random) -> bytes:
    """The body past the header as float32 NaN and Inf, the prefix and header kept."""
    head = 256
    words = (len(value) - head) // 4
    body = struct.pack(f"<{words}f", *rng.choices([math.nan, math.inf, -math.inf], k=words))
    return value[:head] + body + value[head + 4 * words :]


def _truncated(value: bytes, rng: random.Random) -> bytes:
    return value[: rng.randrange(1, len(value))]


# Faults the way the world makes them, for :func:`damage`.
FAULTS = [_random_middle_half, _nan_payload, _truncated, "other-keys-value", "one-missing"]
FAULT_IDS = ["random-middle-half", "nan-payload", "truncated", "other-keys-value", "one-missing"]


def damage(client: Any, keys: list[str], fault: Any, rng: random.Random) -> None:
    """Apply one of :data:`FAULTS` to the values under ``keys``: each value rewritten by the
    function, each key given the next key's value, or the last key deleted."""
    values = [client.get(k) for k in keys]
    if fault == "other-keys-value":
        for key, value in zip(keys, values[1:] + values[:1], strict=True):
            client.set(key, value)
    elif fault == "one-missing":
        client.delete(keys[-1])
    else:
        for key, value in zip(keys, values, strict=True):
            client.set(key, fault(value, rng))


@pytest.mark.parametrize("fault", FAULTS, ids=FAULT_IDS)
def test_a_failed_load_leaves_every_page_as_it_was_or_zero(
    pages: Pages, redis_client, fault, pieces: str
) -> None:
    """After a failed load, each destination page holds what it held before or zeros: never a
    byte of a value that failed validation (vLLM frees those blocks unwritten, and a later
    request reads a partly filled block under a mask, where NaN or Inf would survive)."""
    assert pages.store_job(1, chunks(SRC)).ok
    damage(redis_client, _stored_keys(redis_client), fault, random.Random(11))

    before = [t.clone() for t in pages.tensors]
    assert not pages.load_job(2, chunks(DST)).ok
    assert _unchanged_unless_landed(before, pages, DST), "a page holds bytes of a failed load"


# ---------------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("strided", [False, True], ids=["in-place", "buffered"])
def test_concurrent_loads_never_hold_more_than_the_budget(
    redis_client, redis_url, monkeypatch, path: str, strided: bool
):
    # Every load pauses before its GETs, so the four loads reach Redis together.
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, "0.3")
    budget = 100_000  # one load (~77 kB of values) fits, two do not
    store = _store(redis_url)
    rig = make_pages(store, strided=strided, max_inflight_bytes=budget, io_threads=4)
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        values = sum(redis_client.strlen(k) for k in _stored_keys(redis_client))
        assert budget / 2 < values <= budget

        jobs = range(10, 14)
        for job in jobs:
            rig.engine.submit_load(job, chunks(DST))
        finished: dict[int, bool] = {}
        deadline = time.monotonic() + 20
        while set(finished) != set(jobs):
            assert time.monotonic() < deadline, f"loads {set(jobs) - set(finished)} did not finish"
            finished |= {r.job_id: r.ok for r in rig.engine.finished()}
            time.sleep(0.01)
        assert all(finished.values())
        # Each load took its values' bound before receiving; never two at once. Its buffers
        # (each chunk's staging, which holds the body too unless it lands in place) fit it.
        assert values <= rig.engine.peak_budget_bytes <= budget
        assert values <= rig.engine.peak_buffer_bytes <= budget
    finally:
        rig.close()
        store.close()


def test_a_value_longer_than_its_chunk_is_refused_unread_and_deleted(
    redis_client, redis_url, path: str, pieces: str
):
    store = _store(redis_url)
    rig = make_pages(store)
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        keys = _stored_keys(redis_client)
        victim = keys[0]
        redis_client.set(victim, os.urandom(1 << 20) * 64)  # 64 MiB of junk under a chunk key
        before = [t.clone() for t in rig.tensors]

        assert not rig.load_job(2, chunks(DST)).ok
        # Refused as corrupt: the request is recomputed, no page holds a byte of it (the
        # native path zeroes the job's pages), the value is gone (so the recompute's store can
        # put a good one there).
        assert _unchanged_unless_landed(before, rig, DST)
        assert redis_client.exists(victim) == 0
        assert redis_client.exists(*keys[1:]) == len(keys) - 1
        assert store.counters.snapshot()["load_failed_jobs"] == 1
        # No buffer of that size was ever taken: the 64 MiB went through a small scratch buffer.
        assert rig.engine.peak_buffer_bytes < 1 << 20
        assert store.breaker.failures == 0

        # The connection it arrived on is clean: the tier heals and serves the chunk again.
        assert rig.store_job(3, chunks(SRC)).ok
        assert rig.load_job(4, chunks(DST)).ok
        assert rig.moved(SRC, DST)
    finally:
        rig.close()
        store.close()


# ---------------------------------------------------------------------------------- fairness


def _acquire_in_thread(budget: ByteBudget, nbytes: int, load: bool) -> threading.Event:
    """Start a thread that acquires ``nbytes``; the event is set once it holds them."""
    holding = threading.Event()

    def run() -> None:
        budget.acquire(nbytes, load=load)
        holding.set()

    threading.Thread(target=run, daemon=True).start()
    return holding


def test_a_waiting_load_goes_before_stores_that_would_fit():
    budget = ByteBudget(100)
    budget.acquire(60, load=False)
    load = _acquire_in_thread(budget, 50, load=True)  # does not fit yet: waits
    time.sleep(0.1)
    store = _acquire_in_thread(budget, 10, load=False)  # would fit, but a load waits
    assert not store.wait(0.3)
    assert not load.is_set()
    budget.release(60)
    assert load.wait(2) and store.wait(2)


def test_a_load_larger_than_the_budget_is_not_starved_by_steady_stores():
    budget = ByteBudget(100)
    stop = threading.Event()
    big_holds = threading.Event()
    overlaps: list[int] = []

    def steady_stores() -> None:
        # Each holds 40 for a moment and comes straight back: two of three always hold some.
        while not stop.is_set():
            budget.acquire(40, load=False)
            if big_holds.is_set():
                overlaps.append(1)
            time.sleep(0.005)
            budget.release(40)

    threads = [threading.Thread(target=steady_stores, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    try:
        big = _acquire_in_thread(budget, 150, load=True)
        assert big.wait(2.0), "the oversize load never got the budget"
        big_holds.set()
        time.sleep(0.1)  # it runs alone: no store acquires meanwhile
        big_holds.clear()
        budget.release(150)
        assert not overlaps
    finally:
        stop.set()
        for thread in threads:
            thread.join(2)


def test_a_job_is_split_into_consecutive_parts_of_about_equal_bytes() -> None:
    assert split_parts([10, 10, 10, 10], 2) == [slice(0, 2), slice(2, 4)]
    assert split_parts([10, 10, 10], 4) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert split_parts([30, 10, 10, 10], 2) == [slice(0, 1), slice(1, 4)]
    assert split_parts([5, 5], 1) == [slice(0, 2)]
    assert split_parts([], 3) == [slice(0, 0)]
    for sizes in ([1] * 7, [3, 1, 4, 1, 5, 9, 2, 6], [100, 1, 1, 1]):
        for parts in range(1, 6):
            cuts = split_parts(sizes, parts)
            assert 1 <= len(cuts) <= parts and all(c.stop > c.start for c in cuts)
            assert [i for c in cuts for i in range(c.start, c.stop)] == list(range(len(sizes)))


def test_a_groups_blocks_are_cut_into_chunks_from_its_first_index() -> None:
    # A sliding window dropped the first block of chunk 1 (first index 5, 4 blocks a chunk).
    blocks = [7, 8, 9, 11, 12, 13, 14]
    cut = group_chunks(1, 0, blocks, 5, ["a", "b"], 4)
    assert cut is not None
    assert [(c.redis_key, c.group, c.start, c.block_ids) for c in cut] == [
        ("a", 1, 1, (7, 8, 9)),
        ("b", 1, 0, (11, 12, 13, 14)),
    ]
    # A key left without blocks, or blocks left without a key: the job does not add up.
    assert group_chunks(1, 0, blocks, 5, ["a", "b", "c"], 4) is None
    assert group_chunks(1, 0, blocks, 5, ["a"], 4) is None


def test_wait_for_finish_sleeps_only_while_a_load_runs_and_wakes_when_it_ends(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle engine step sleeps in ``wait_for_finish`` instead of polling: it returns at once
    when no load runs (or one has finished, not yet collected), and the moment a running load
    ends, long before its timeout."""
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, "0.3")  # every load pauses before its GET
    store = _store(redis_url)
    pages = make_pages(store)
    try:
        assert pages.store_job(1, chunks(SRC)).ok
        started = time.monotonic()
        assert pages.engine.wait_for_finish(30.0) is False  # nothing runs: no wait
        assert time.monotonic() - started < 10

        pages.engine.submit_load(2, chunks(DST))
        started = time.monotonic()
        assert pages.engine.wait_for_finish(30.0) is True  # woken by the load's end
        assert time.monotonic() - started < 10
        assert pages.engine.wait_for_finish(30.0) is True  # finished, not collected yet
        (result,) = pages.engine.finished()
        assert (result.job_id, result.ok) == (2, True)
        assert pages.moved(SRC, DST)

        # A load still running when the timeout ends: back after the timeout, nothing done.
        pages.engine.submit_load(3, chunks(DST))
        assert pages.engine.wait_for_finish(0.01) is False
        assert pages.engine.finished() == []
        assert pages.engine.wait_for_finish(30.0) is True
        assert [r.job_id for r in pages.engine.finished()] == [3]
    finally:
        pages.close()
        store.close()


def test_a_native_engine_opens_its_job_connections_before_the_first_job(
    redis_url: str, redis_client
) -> None:
    """A fresh engine's first load should not wait for TCP connects and handshakes: the
    native engine opens ``connections_per_job`` × ``connections_per_thread`` connections of
    the bulk pool at start-up (on a load thread, so start-up does not wait either), and its
    first load job opens none."""
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": redis_url, "connections_per_job": 2, "connections_per_thread": 2}, env={}
    )
    store = RedisBlockStore(cfg)
    pages = make_pages(store)
    try:
        assert pages.store.native
        assert wait_for_store_connections(redis_client, store.client_name, 4) == 4
        pages.engine.submit_load(1, chunks(DST))  # nothing stored: a miss, on those four
        pages.engine.wait([1])
        (result,) = pages.engine.finished()
        assert not result.ok
        assert store_connections(redis_client, store.client_name) == 4
    finally:
        pages.close()
        store.close()


def test_an_engine_starts_at_once_when_redis_is_down() -> None:
    """Warming the connections never delays or fails start-up: Redis down, the engine is
    built at once and its first load fails (to be recomputed) as it would have anyway."""
    store = _store(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    started = time.monotonic()
    pages = make_pages(store)
    try:
        assert time.monotonic() - started < 5
        pages.engine.submit_load(1, chunks(DST))
        pages.engine.wait([1])
        (result,) = pages.engine.finished()
        assert not result.ok
    finally:
        pages.close()
        store.close()


@pytest.mark.parametrize("fault", ["flipped-bit", "missing"])
@pytest.mark.parametrize("strided", [False, True], ids=["in-place", "buffered"])
def test_a_partial_load_lands_its_valid_chunks_and_zeroes_the_others(
    path: str, redis_client, redis_url: str, strided: bool, fault: str, pieces: str
) -> None:
    """partial_loads (a secondary tier's promotions): one bad chunk fails alone; the job names
    it, its pages hold zeros or what they held, and every other chunk lands."""
    store = _store(redis_url)
    rig = make_pages(store, strided=strided, partial_loads=True)
    try:
        assert rig.store_job(1, chunks(SRC)).ok
        plan = chunks(DST)
        victim = plan[1].redis_key
        if fault == "missing":
            redis_client.delete(victim)
        else:
            value = bytearray(redis_client.get(victim))
            value[-1] ^= 0xFF
            redis_client.set(victim, bytes(value))
        before = [t.clone() for t in rig.tensors]

        result = rig.load_job(2, plan)

        assert not result.ok and result.failed_chunks == (1,)
        for idx, (src, dst) in enumerate(zip(chunks(SRC), plan, strict=True)):
            ids, group = list(dst.block_ids), dst.group
            got = rig.pages(group, ids)
            if idx == 1:
                old = [before[i][ids, : PAGES[group]] for i in LAYERS[group]]
                assert all(torch.equal(g, o) or not g.any() for g, o in zip(got, old, strict=True))
            else:
                assert all(
                    torch.equal(g, w)
                    for g, w in zip(got, rig.pages(group, list(src.block_ids)), strict=True)
                )
    finally:
        rig.close()
        store.close()
