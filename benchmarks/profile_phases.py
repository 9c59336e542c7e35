"""Where a worker job's time goes: milliseconds per phase of the real store and load jobs.

    .venv/bin/python benchmarks/profile_phases.py [--jobs 6]

Runs the tier benchmark's worker (``hma_redis.tools.bench.tier.TierBench``: 8 layers of
``(num_blocks, 16 KiB)`` int8 on the CPU, 32 MiB jobs) against a private ``redis-server`` and
wraps the worker's and store's own functions with timers, so each line is the time spent inside
that function, per job (averaged over ``--jobs`` jobs after one warm-up job per size):

- store: ``exists`` (the pre-check), ``_pages_of`` (describing a chunk's pages; the data
  path cuts them), ``_value_head`` (prefix, header, MAC with an auth_key), ``put_values``
  (the store job, C or twin: CRC32C over the pages in place, sending, replies);
- load: ``load_values`` (the load job, C or twin: GETs received into the pages or pooled
  buffers, CRC32C as they arrive), ``_validate`` (``codec.decode`` of values that landed in
  staging), ``_scatter`` (copies from buffers into the KV cache).

Wall time of the whole job is the ``total`` line. Profiling adds a little overhead per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.engine import TransferEngine
from hma_redis.tools.bench import tier as bench_tier
from hma_redis.tools.bench.common import MIB, Samples
from hma_redis.tools.devkit.local_redis import LocalRedis

SPENT: Counter[str] = Counter()


def _timed(owner: Any, name: str, label: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=6, help="jobs per size and direction")
    args = parser.parse_args()
    for owner, name, label in (
        (TransferEngine, "_run_store", "store total"),
        (RedisBlockStore, "exists", "store exists"),
        (RedisBlockStore, "put_values", "store put_values (CRC32C, send)"),
        (TransferEngine, "_value_head", "store _value_head"),
        (TransferEngine, "_pages_of", "_pages_of (stores and loads)"),
        (TransferEngine, "_run_load", "load total"),
        (RedisBlockStore, "load_values", "load load_values (receive, CRC32C)"),
        (TransferEngine, "_validate", "load _validate (staged values)"),
        (TransferEngine, "_scatter", "load _scatter"),
    ):
        _timed(owner, name, label)
    plan = dataclasses.replace(bench_tier.QUICK, reps=1, rb_bytes=0, job_bytes=32 * MIB)
    server = LocalRedis().start()
    try:
        tier = bench_tier.TierBench(server.url, plan, "profile")
        for size in plan.sizes:
            tier.run(size, Samples())  # warm-up
            SPENT.clear()
            samples = Samples()
            for _ in range(args.jobs):
                tier.run(size, samples)
            medians = {
                op: statistics.median(samples.values[f"hma_redis {op} {size}"])
                for op in ("store", "load")
            }
            store_ms, load_ms = medians["store"] * 1e3, medians["load"] * 1e3
            print(
                f"{bench_tier.size_label(size)} values, 32 MiB jobs: store job {store_ms:.1f} ms, "
                f"load job {load_ms:.1f} ms (medians); ms per job inside:"
            )
            for label in sorted(SPENT, key=lambda lb: (lb.split()[0] != "store", lb)):
                print(f"  {label:<34}{SPENT[label] / args.jobs * 1e3:8.1f}")
        tier.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
