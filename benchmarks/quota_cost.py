"""What per-tenant quotas cost on the data path, against a real Redis (a local redis-server
unless ``--redis-url``).

* scheduler: ``on_new_request`` + ``prepare_store`` of one request's chunks, with quotas off
  and on (the tenant id hashed once per request; the budget check answers from the keeper's
  snapshot, no round trip);
* store: the account's one ``EVAL`` after a store job's puts, for a job of N chunks (on the
  store job's thread, after its SETs; the job's own time is its SETs of N values);
* removals: ``EXISTS`` + ``EVAL`` for a batch of removed keys (the keeper's thread);
* memory: the account's bytes per chunk record (``MEMORY USAGE`` of the tenants hash).

    python benchmarks/quota_cost.py [--redis-url redis://...] [--value-kib 1024]

Prints a markdown table (docs/operations.md, "Per-tenant quotas").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator

import redis
from vllm.v1.kv_offload.base import ReqContext, make_offload_key

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import quotas
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import redis_or_local

KEYSPACE = KeySpace("hma", "quotabench")


def _median_us(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _manager(url: str, on: bool) -> RedisOffloadingManager:
    extra = {"redis_url": url, "tenant_quotas": on}
    if on:
        extra["tenant_budget_bytes"] = 1 << 40
    cfg = RedisTierConfig.from_extra_config(extra, env={})
    store = RedisBlockStore(cfg, quota_space=KEYSPACE if on else None)
    keeper = None
    if on:
        keeper = quotas.QuotaKeeper(
            store.quota_snapshot, store.account_removed, store.reconcile_quota, 1 << 40, 1.0, 300.0
        ).start()
    return RedisOffloadingManager(store, KEYSPACE, quotas=keeper)


def _scheduler_row(url: str, chunks: int, repeat: int) -> tuple[float, float]:
    out = []
    for on in (False, True):
        manager = _manager(url, on)
        counter = iter(range(10**9))

        def request(m: RedisOffloadingManager = manager, counter: Iterator[int] = counter) -> None:
            n = next(counter)
            req = ReqContext(req_id=f"r{n}")
            m.note_cache_salt(req.req_id, f"salt-{n % 7}")
            m.on_new_request(req)
            keys = [
                make_offload_key(n.to_bytes(8, "big") + bytes([i]) * 24, 0) for i in range(chunks)
            ]
            m.prepare_store(keys, req)
            m.complete_store(keys, req)

        out.append(_median_us(request, repeat))
        manager.shutdown()
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url")
    parser.add_argument("--value-kib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    with redis_or_local(args.redis_url) as url:
        client = redis.Redis.from_url(url)
        client.flushall()
        rows = ["| what | per | quotas off | quotas on / cost |", "| --- | --- | --- | --- |"]
        off, on = _scheduler_row(url, 16, args.repeat)
        rows.append(
            "| scheduler: on_new_request + prepare_store | request of 16 chunks | "
            f"{off:.0f} µs | {on:.0f} µs |"
        )
        cfg = RedisTierConfig.from_extra_config({"redis_url": url, "tenant_quotas": True}, env={})
        store = RedisBlockStore(cfg, quota_space=KEYSPACE)
        value = b"x" * (args.value_kib * 1024)
        for n in (1, 16):
            ids = iter(range(10**9))

            def job(n: int = n, ids: Iterator[int] = ids) -> None:
                keys = [KEYSPACE.block_key(0, next(ids).to_bytes(32, "big")) for _ in range(n)]
                pipe = client.pipeline(transaction=False)
                for key in keys:
                    pipe.set(key, value, nx=True)
                pipe.execute()

            def account(n: int = n, ids: Iterator[int] = ids) -> None:
                keys = [KEYSPACE.block_key(1, next(ids).to_bytes(32, "big")) for _ in range(n)]
                store.account_stored("0123456789abcdef", keys, [len(value)] * n)

            sets = _median_us(job, max(10, args.repeat // 10))
            eval_us = _median_us(account, args.repeat)
            rows.append(
                f"| store job: SETs of {args.value_kib} KiB values vs the account's EVAL | "
                f"job of {n} chunks | "
                f"{sets:.0f} µs | +{eval_us:.0f} µs ({100 * eval_us / sets:.1f} %) |"
            )
        client.flushall()
        keys = [KEYSPACE.block_key(0, i.to_bytes(32, "big")) for i in range(10_000)]
        for start in range(0, len(keys), 500):
            store.account_stored("0123456789abcdef", keys[start : start + 500], [len(value)] * 500)
        per_record = int(client.memory_usage(KEYSPACE.tenants_key()) or 0) / len(keys)
        batch = keys[:256]
        removal = _median_us(lambda: store.account_removed(batch), 20)
        rows.append(
            "| removals (keeper's thread): EXISTS + EVAL | batch of 256 keys | - | "
            f"{removal:.0f} µs |"
        )
        rows.append(
            f"| memory: the tenants hash | chunk record | - | {per_record:.0f} bytes "
            f"({100 * per_record / len(value):.3f} % of a {args.value_kib} KiB value) |"
        )
        store.close()
        client.flushall()
        print("\n".join(rows))


if __name__ == "__main__":
    main()
