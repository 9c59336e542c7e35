"""The worker's load job, phase by phase: the tier benchmark's worker (``hma-redis bench``: 8
layers of 16 KiB pages on the CPU, 16 MiB jobs) stores one job's worth of values once, then
loads them ``--jobs`` times into random blocks of the cache's second third and prints the median
of each phase of a job: ``submit_load`` itself (the worker's plan), the hand-off to the job's
thread, the Python before the data path's call, the call itself (the C job, or its twin), the
Python after it, and the wait until ``get_finished`` reports the job. ``--idle-ms``,
``--busy-ms`` and ``--tiering`` put time asleep, time spinning or one tiering-mode job before
each load, to compare a load right after a load with one after the host did something else.

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
from collections.abc import Callable
from typing import Any

# The same worker and stored values as load_loop.py.
from load_loop import free_blocks, stored_job, submit_load

from hma_redis.tools.bench.tier import QUICK

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


def _before_each_job(args: argparse.Namespace, bench: Any) -> Callable[[], None]:
    """What runs before each timed job (its docstring says what, for the report)."""
    idle_s, busy_s = args.idle_ms / 1e3, args.busy_ms / 1e3
    tiering: Any = None
    if args.tiering:
        from hma_redis.tools.bench.common import Samples
        from hma_redis.tools.bench.tier import LAYERS, PAGE_BYTES
        from hma_redis.tools.bench.tiering import TieringBench

        tiering = TieringBench(bench.cfg, QUICK.job_bytes, QUICK.sizes, LAYERS * PAGE_BYTES)

    def before() -> None:
        if tiering is not None:
            tiering.run(args.size, Samples())
        time.sleep(idle_s)
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass

    parts = [f"{args.idle_ms:g} ms asleep", f"{args.busy_ms:g} ms spinning"]
    before.__doc__ = "before each: " + ", ".join(
        (["a tiering-mode job"] if args.tiering else []) + parts
    )
    return before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=0.0,
        help="sleep this long before each job (an idle engine)",
    )
    parser.add_argument(
        "--busy-ms",
        type=float,
        default=0.0,
        help="spin this long before each job (the engine's thread busy, the transfer's idle)",
    )
    parser.add_argument(
        "--tiering",
        action="store_true",
        help="before each job, one job of the benchmark's tiering mode (vLLM's tiering spec "
        "in this process, as hma-redis bench runs it between its samples)",
    )
    with stored_job(parser, "phases") as (args, bench, worker, keys, where):
        before = _before_each_job(args, bench)
        marks: dict[str, float] = {}
        store: Any = bench.store
        engine: Any = worker._engine
        store.load_values = _timed(marks, "call", "called", store.load_values)
        engine._run_load = _timed(marks, "job", "job done", engine._run_load)
        rows: list[tuple[float, ...]] = []
        for _ in range(args.jobs):
            blocks = free_blocks(bench)
            before()
            t0 = time.perf_counter()
            submit_load(bench, worker, keys, blocks)
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
        print(f"{where}; {args.jobs} loads of {mib} MiB, {args.size} B values; {before.__doc__}")
        names = (*PHASES, "until get_finished", "whole job")
        for name, column in zip(names, zip(*rows, strict=True), strict=True):
            print(f"  {name:<22} {statistics.median(column) * 1e3:8.3f} ms (median)")
        whole = statistics.median(row[-1] for row in rows)
        print(f"  {QUICK.job_bytes / whole / 1e9:.2f} GB/s by the median whole job")


if __name__ == "__main__":
    main()
