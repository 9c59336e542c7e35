"""The worker's load job, over and over, for a profiler to watch: the tier benchmark's worker
(``hma-redis bench``: 8 layers of 16 KiB pages on the CPU, 16 MiB jobs) stores one job's worth
of values once, then loads them into random blocks of the cache's second third for ``--seconds``
seconds, each load timed from submit until ``get_finished`` reports it, and prints the median.
While it runs, profile the host, e.g. ``perf record -a -g -- sleep 8`` once it prints
``looping``, then ``perf report --no-children --sort comm,sym``.

    .venv/bin/python benchmarks/load_loop.py [--url redis://...] [--size 524288] [--seconds 25]

Without ``--url`` it starts a private ``redis-server`` (persistence off). Benchmarks print;
they assert nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from hma_redis.core.config import RedisTierConfig
from hma_redis.tools.bench.common import Samples, server_config
from hma_redis.tools.bench.tier import QUICK, TierBench


@contextlib.contextmanager
def stored_job(
    parser: argparse.ArgumentParser, prefix: str
) -> Iterator[tuple[argparse.Namespace, TierBench, Any, list[Any], str]]:
    """Parse ``--url`` and ``--size`` (with the parser's own options), start the tier
    benchmark's worker on that Redis (a private ``redis-server`` without ``--url``), run one
    untimed store and load, store one job's worth of fresh values and yield the parsed
    arguments, the bench, the worker, the stored keys and where Redis is. Also used by
    ``benchmarks/load_phases.py``."""
    parser.add_argument("--url", help="Redis to use (default: a private redis-server)")
    parser.add_argument("--size", type=int, default=512 * 1024, choices=QUICK.sizes)
    args = parser.parse_args()
    cfg = RedisTierConfig.from_extra_config({"redis_url": args.url}, env={}) if args.url else None
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from hma_redis.adapter.types import RedisLoadStoreSpec

    with server_config(cfg) as (target, where):
        bench = TierBench(target, QUICK, f"{prefix}-{os.getpid()}")
        try:
            worker = bench.workers[args.size]
            bench.run(args.size, Samples())  # untimed: connections, first touch of the pages
            keys = bench._keys.take(bench.blocks // bench.blocks_per_chunk(args.size))
            bench._job_id += 1
            worker.submit_store(
                bench._job_id,
                GPULoadStoreSpec(list(range(bench.blocks)), [bench.blocks], [0]),
                RedisLoadStoreSpec(keys, known_absent=keys),  # type: ignore[arg-type]
            )
            bench._wait(worker, bench._job_id)
            yield args, bench, worker, keys, where
        finally:
            bench.close()


def free_blocks(bench: TierBench) -> list[int]:
    """A job's worth of random block ids in the cache's second third (the stored job's blocks
    are in the first)."""
    return bench.rng.sample(range(bench.blocks, 2 * bench.blocks), bench.blocks)


def submit_load(bench: TierBench, worker: Any, keys: list[Any], blocks: list[int]) -> None:
    """Submit the next load job of ``keys`` into ``blocks`` (its id: ``bench._job_id``)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from hma_redis.adapter.types import RedisLoadStoreSpec

    bench._job_id += 1
    worker.submit_load(
        bench._job_id,
        RedisLoadStoreSpec(keys),  # type: ignore[arg-type]
        GPULoadStoreSpec(blocks, [bench.blocks], [0]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=25.0)
    with stored_job(parser, "loop") as (args, bench, worker, keys, where):
        print(f"looping: {where}; {QUICK.job_bytes >> 20} MiB loads of {args.size} B values")
        seconds: list[float] = []
        started = time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            blocks = free_blocks(bench)
            t0 = time.perf_counter()
            submit_load(bench, worker, keys, blocks)
            bench._wait(worker, bench._job_id)
            seconds.append(time.perf_counter() - t0)
        median = statistics.median(seconds)
        print(
            f"{len(seconds)} loads, median {median * 1e3:.2f} ms, "
            f"{QUICK.job_bytes / median / 1e9:.2f} GB/s"
        )


if __name__ == "__main__":
    main()
