"""``max_inflight_bytes`` bounds loads as well as stores, fairly, and a value longer than its
chunk can be is refused without ever being held: real worker, real Redis, CPU KV caches."""

from __future__ import annotations

import os
import threading
import time

import torch
from test_worker import DST, KEYS, SRC, make_worker, run_job, spec_of

from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.store import RedisBlockStore
from hma_redis.core.transfer import TEST_LOAD_DELAY_ENV, _ByteBudget


def _store(url: str) -> RedisBlockStore:
    return RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))


def _stored_keys(client) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter("hma:worker-test:g*"))


def test_concurrent_loads_never_hold_more_than_the_budget(redis_client, redis_url, monkeypatch):
    # Every load pauses before its GETs, so the four loads reach Redis together.
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, "0.3")
    budget = 100_000  # one load (~77 kB of values) fits, two do not
    store = _store(redis_url)
    worker = make_worker(store, max_inflight_bytes=budget, io_threads=4)
    try:
        assert run_job(
            worker, 1, lambda j: worker.submit_store(j, spec_of(SRC), RedisLoadStoreSpec(KEYS))
        )
        values = sum(redis_client.strlen(k) for k in _stored_keys(redis_client))
        assert budget / 2 < values <= budget

        jobs = range(10, 14)
        for job in jobs:
            worker.submit_load(job, RedisLoadStoreSpec(KEYS), spec_of(DST))
        finished: set[int] = set()
        deadline = time.monotonic() + 20
        while finished != set(jobs):
            assert time.monotonic() < deadline, f"loads {set(jobs) - finished} did not finish"
            finished |= {r.job_id for r in worker.get_finished()}
            time.sleep(0.01)
        assert not worker.take_failed_load_jobs()
        assert values <= worker.peak_buffer_bytes <= budget
    finally:
        worker.shutdown()
        store.close()


def test_a_value_longer_than_its_chunk_is_refused_unread_and_deleted(redis_client, redis_url):
    store = _store(redis_url)
    worker = make_worker(store)
    try:
        assert run_job(
            worker, 1, lambda j: worker.submit_store(j, spec_of(SRC), RedisLoadStoreSpec(KEYS))
        )
        keys = _stored_keys(redis_client)
        victim = keys[0]
        redis_client.set(victim, os.urandom(1 << 20) * 64)  # 64 MiB of junk under a chunk key
        before = [t.clone() for t in worker.tensors]

        assert not run_job(
            worker, 2, lambda j: worker.submit_load(j, RedisLoadStoreSpec(KEYS), spec_of(DST))
        )
        # Refused as corrupt: the request is recomputed, nothing was written, the value is gone
        # (so the recompute's store can put a good one there).
        assert all(torch.equal(a, b) for a, b in zip(before, worker.tensors, strict=True))
        assert redis_client.exists(victim) == 0
        assert redis_client.exists(*keys[1:]) == len(keys) - 1
        assert store.counters.snapshot()["load_failed_jobs"] == 1
        # No buffer of that size was ever taken: the 64 MiB went through a small scratch buffer.
        assert worker.peak_buffer_bytes < 1 << 20
        assert store.breaker.failures == 0

        # The connection it arrived on is clean: the tier heals and serves the chunk again.
        assert run_job(
            worker, 3, lambda j: worker.submit_store(j, spec_of(SRC), RedisLoadStoreSpec(KEYS))
        )
        assert run_job(
            worker, 4, lambda j: worker.submit_load(j, RedisLoadStoreSpec(KEYS), spec_of(DST))
        )
        for layer, tensor in enumerate(worker.tensors):
            page = 2500 if layer < 3 else 1000
            src, dst = (SRC[0], DST[0]) if layer < 3 else (SRC[1], DST[1])
            assert torch.equal(tensor[dst, :page], tensor[src, :page])
    finally:
        worker.shutdown()
        store.close()


# ---------------------------------------------------------------------------------- fairness


def _acquire_in_thread(budget: _ByteBudget, nbytes: int, load: bool) -> threading.Event:
    """Start a thread that acquires ``nbytes``; the event is set once it holds them."""
    holding = threading.Event()

    def run() -> None:
        budget.acquire(nbytes, load=load)
        holding.set()

    threading.Thread(target=run, daemon=True).start()
    return holding


def test_a_waiting_load_goes_before_stores_that_would_fit():
    budget = _ByteBudget(100)
    budget.acquire(60, load=False)
    load = _acquire_in_thread(budget, 50, load=True)  # does not fit yet: waits
    time.sleep(0.1)
    store = _acquire_in_thread(budget, 10, load=False)  # would fit, but a load waits
    assert not store.wait(0.3)
    assert not load.is_set()
    budget.release(60)
    assert load.wait(2) and store.wait(2)


def test_a_load_larger_than_the_budget_is_not_starved_by_steady_stores():
    budget = _ByteBudget(100)
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
