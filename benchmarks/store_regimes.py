"""Which speed regime a store job meets, by the state of Redis' memory: the tier benchmark's
worker (``hma-redis bench``: 8 layers of 16 KiB pages on the CPU, 16 MiB jobs) stores
``--jobs`` jobs of fresh keys back to back on a private ``redis-server`` in four states, and
prints per state the median and 90th percentile store time, redis-server's page faults per job
(``/proc/<pid>/stat``) and its memory:

* **grow**: a fresh server (flushed, then 12 s idle, so jemalloc has returned what it freed),
  the keys stay: every value is new memory;
* **reuse**: the same, but each job's keys are deleted right after it (what ``hma-redis bench``
  does after each repetition);
* **evict**: ``maxmemory`` (``--maxmemory-mib``, ``allkeys-lru``) reached by earlier stores
  before the timed jobs, the keys stay: Redis evicts old values to take each new one, as a
  shared cache tier does once it is full;
* **grow again**: flushed and idle again, to show the first state was not a first-run effect.

    .venv/bin/python benchmarks/store_regimes.py [--size 524288] [--jobs 30]
        [--maxmemory-mib 256]

Benchmarks print; they assert nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from hma_redis.tools.bench.common import Samples, server_config
from hma_redis.tools.bench.tier import QUICK, TierBench


def minor_faults(pid: int) -> int:
    """The process' minor page faults so far (field 10 of ``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=512 * 1024, choices=QUICK.sizes)
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--maxmemory-mib", type=int, default=256)
    args = parser.parse_args()
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from hma_redis.adapter.types import RedisLoadStoreSpec

    with server_config(None) as (target, where):
        bench = TierBench(target, QUICK, f"regimes-{os.getpid()}")
        try:
            bench.run(args.size, Samples())  # untimed: connections, first touch of the pages
            worker, blocks = bench.workers[args.size], bench.blocks
            client: Any = bench.store.client
            pid = int(client.info("server")["process_id"])
            chunks = blocks // bench.blocks_per_chunk(args.size)

            def store(keys: list[Any]) -> float:
                bench._job_id += 1
                src = bench.rng.sample(range(blocks), blocks)
                started = time.perf_counter()
                worker.submit_store(
                    bench._job_id,
                    GPULoadStoreSpec(src, [blocks], [0]),
                    RedisLoadStoreSpec(keys, known_absent=keys),  # type: ignore[arg-type]
                )
                result = bench._wait(worker, bench._job_id)
                if result.transfer_size <= 0:
                    raise SystemExit("store_regimes: a store job stored nothing")
                return time.perf_counter() - started

            def delete(keys: list[Any]) -> None:
                bench.store.delete([bench.keyspace.block_key(0, k[:-4]) for k in keys])

            def fresh() -> None:
                client.config_set("maxmemory", 0)
                client.flushall()
                time.sleep(12)  # past jemalloc's decay: freed memory back to the system

            def full() -> None:
                client.flushall()
                client.config_set("maxmemory-policy", "allkeys-lru")
                client.config_set("maxmemory", args.maxmemory_mib << 20)
                evicted = int(client.info("stats")["evicted_keys"])
                while int(client.info("stats")["evicted_keys"]) == evicted:
                    store(bench._keys.take(chunks))

            def run(name: str, prepare: Callable[[], None], after: Callable[[Any], None]) -> None:
                prepare()
                seconds, faults = [], []
                for _ in range(args.jobs):
                    keys = bench._keys.take(chunks)
                    before = minor_faults(pid)
                    seconds.append(store(keys))
                    faults.append(minor_faults(pid) - before)
                    after(keys)
                memory = client.info("memory")
                p90 = sorted(seconds)[int(0.9 * (len(seconds) - 1))]
                print(
                    f"  {name:<12} {statistics.median(seconds) * 1e3:8.2f} {p90 * 1e3:8.2f}"
                    f" {statistics.median(faults):9.0f} {int(memory['used_memory']) >> 20:9d}"
                    f" {int(memory['used_memory_rss']) >> 20:9d}",
                    flush=True,
                )

            print(
                f"{where}; {args.jobs} store jobs of {QUICK.job_bytes >> 20} MiB, "
                f"{args.size} B values, fresh keys, per state"
            )
            widths = {"ms p50": 8, "ms p90": 8, "faults": 9, "used MiB": 9, "rss MiB": 9}
            print(f"  {'state':<12}" + "".join(f" {c:>{w}}" for c, w in widths.items()))
            run("grow", fresh, lambda keys: None)
            run("reuse", lambda: None, delete)
            run("evict", full, lambda keys: None)
            run("grow again", fresh, lambda keys: None)
        finally:
            bench.close()


if __name__ == "__main__":
    main()
