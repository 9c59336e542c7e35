"""The worker's load job, phase by phase: the tier benchmark's worker (``hma-redis bench``: 8
layers of 16 KiB pages on the CPU, 16 MiB jobs) stores one job's worth of values once, then
loads them ``--jobs`` times into random blocks of the cache's second half and prints the median
of each phase of a job: ``submit_load`` itself (the worker's plan), the hand-off to the job's
thread, the Python before the data path's call, the call itself (the C job, or its twin), the
Python after it, and the wait until ``get_finished`` reports the job.

    .venv/bin/python benchmarks/load_phases.py [--url redis://...] [--size 524288] [--jobs 300]

To see what the placement of threads does on a small host, pin the server and the client:

    taskset -c 0 redis-server --port 6401 --save '' --appendonly no --daemonize yes
    taskset -c 1 .venv/bin/python benchmarks/load_phases.py --url redis://127.0.0.1:6401
    taskset -c 0 .venv/bin/python benchmarks/load_phases.py --url redis://127.0.0.1:6401

Without ``--url`` it starts a private ``redis-server`` (persistence off). The phases are timed
by wrapping the job's own functions on this worker's objects (a probe: nothing else differs).
Benchmarks print; they assert nothing about speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from hma_redis.core.config import RedisTierConfig
from hma_redis.tools.bench.common import Samples, server_config
from hma_redis.tools.bench.tier import QUICK, TierBench

PHASES = ("submit", "to the job's thread", "Python before", "data path call", "Python after")


def _timed(marks: dict[str, float], start: str, end: str, fn: Any) -> Any:
    """``fn`` that records when each call starts and ends under ``start`` and ``end``."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        marks[start] = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            marks[end] = time.perf_counter()

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="Redis to use (default: a private redis-server)")
    parser.add_argument("--size", type=int, default=512 * 1024, choices=QUICK.sizes)
    parser.add_argument("--jobs", type=int, default=300)
    args = parser.parse_args()
    cfg = RedisTierConfig.from_extra_config({"redis_url": args.url}, env={}) if args.url else None
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from hma_redis.adapter.types import RedisLoadStoreSpec

    with server_config(cfg) as (target, where):
        bench = TierBench(target, QUICK, f"phases-{time.monotonic_ns()}")
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
            marks: dict[str, float] = {}
            store: Any = bench.store
            engine: Any = worker._engine
            store.load_values = _timed(marks, "call", "called", store.load_values)
            engine._run_load = _timed(marks, "job", "job done", engine._run_load)
            rows: list[tuple[float, ...]] = []
            for _ in range(args.jobs):
                blocks = bench.rng.sample(range(bench.blocks, 2 * bench.blocks), bench.blocks)
                bench._job_id += 1
                t0 = time.perf_counter()
                worker.submit_load(
                    bench._job_id,
                    RedisLoadStoreSpec(keys),  # type: ignore[arg-type]
                    GPULoadStoreSpec(blocks, [bench.blocks], [0]),
                )
                t1 = time.perf_counter()
                bench._wait(worker, bench._job_id)
                t2 = time.perf_counter()
                rows.append(
                    (
                        t1 - t0,
                        marks["job"] - t1,
                        marks["call"] - marks["job"],
                        marks["called"] - marks["call"],
                        marks["job done"] - marks["called"],
                        t2 - marks["job done"],
                        t2 - t0,
                    )
                )
            mib = QUICK.job_bytes >> 20
            print(f"{where}; {args.jobs} loads of {mib} MiB, {args.size} B values")
            names = (*PHASES, "until get_finished", "whole job")
            for name, column in zip(names, zip(*rows, strict=True), strict=True):
                print(f"  {name:<22} {statistics.median(column) * 1e3:8.3f} ms (median)")
            whole = statistics.median(row[-1] for row in rows)
            print(f"  {QUICK.job_bytes / whole / 1e9:.2f} GB/s by the median whole job")
        finally:
            bench.close()


if __name__ == "__main__":
    main()
