"""The GPU check: the transfer engine on a KV cache shaped like Llama-3-8B, on a CUDA device,
against a local ``redis-server`` and a local 3-shard Redis Cluster; one table out.

    python -m hma_redis.tools.gpu.check --output table.txt            # CUDA (scripts/gpu_check.sh)
    python -m hma_redis.tools.gpu.check --device cpu --output t.txt   # the CI variant, seconds

For each Redis (single, cluster), chunk size (1 and 16 blocks) and connection count per job
(1, 2, 4, 8 where the engine has ``connections_per_job``, else 1): stores from random block
ids and loads into other ids, every load compared byte for byte on the device; per chunk
size, a full-cache correctness check and a corrupted value that must be refused with nothing
written; a load's time against the sum of its phases; and a matmul loop's rate on the compute stream
with and without loads running. Exit status: 0 every byte right, 1 a wrong byte (or a corrupted
value let through, or a load that failed), 2 the check could not run. Speed targets are shown
(``below`` / ``BLOCKED``) but do not change the exit status.

Imports torch, redis-py and hma_redis.core only, no vLLM, except for the ``tiering`` rows
(:mod:`hma_redis.tools.gpu.tiering`): where vLLM is installed they run vLLM's own CPU tier
(``TieringOffloadingSpec``, its real GPU copy on CUDA) with the Redis secondary tier on the same
KV cache; where it is not, one row says so (``--no-tiering`` leaves them out).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import NoReturn

import redis
import torch

import hma_redis
from hma_redis.core.redis import wire
from hma_redis.tools.gpu import measure
from hma_redis.tools.gpu.kvcache import LLAMA3_8B, SMALL, KVCache, KVShape
from hma_redis.tools.gpu.measure import Budget, CheckError, Labels, Rig, Row, Target
from hma_redis.tools.gpu.servers import IoThreads, LocalShards, redis_version, start_single

# Targets on a GPU host (docs/gpu.md): store and load GB/s with the best connection count.
STORE_TARGET_GBPS = 4.0
LOAD_TARGET_GBPS = 6.0
EXIT_OK, EXIT_WRONG, EXIT_ERROR = 0, 1, 2
# Target and verdict of a speed row on the CPU: the targets are for a GPU host.
NA = ("-", "-")
SECTIONS = ("correctness", "corrupt value", "store GB/s", "load GB/s", "load timing",
            "compute rate")  # fmt: skip
COLUMNS = ("check", "redis", "chunk", "conns", "measured", "target", "verdict")


@dataclass(frozen=True)
class Plan:
    """What the check moves: ``job_blocks`` blocks per job out of ``num_blocks``."""

    shape: KVShape
    num_blocks: int
    job_blocks: int
    chunk_blocks: tuple[int, ...]
    connections: tuple[int, ...]
    reps: int
    compute_s: float
    matmul_n: int


# 256 blocks per job: a 4096-token prompt of Llama-3-8B, 512 MiB of KV; 2 GiB of cache.
GPU_PLAN = Plan(LLAMA3_8B, num_blocks=1024, job_blocks=256, chunk_blocks=(1, 16),
                connections=(1, 2, 4, 8), reps=3, compute_s=2.0, matmul_n=8192)  # fmt: skip
CPU_PLAN = Plan(SMALL, num_blocks=96, job_blocks=32, chunk_blocks=(1, 16),
                connections=(1, 2), reps=1, compute_s=0.3, matmul_n=192)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hma_redis.tools.gpu.check",
        description="Correctness and speed of the transfer engine on a CUDA KV cache, against "
        "a local redis-server and a local 3-shard Redis Cluster (no vLLM).",
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--output", help="also write the table to this file")
    parser.add_argument(
        "--connections", help="connections per job to measure, e.g. 1,4 (default 1,2,4,8 on a "
        "GPU, 1,2 on the CPU; 1 where the engine has no connections_per_job)"
    )  # fmt: skip
    parser.add_argument("--reps", type=int, help="runs per throughput cell (default 3; CPU 1)")
    parser.add_argument(
        "--shape", choices=("small", "llama3-8b"),
        help="KV cache and job size: llama3-8b (the GPU default: 512 MiB jobs) or small (the "
        "CPU default: 1 MiB jobs); llama3-8b on the CPU gives a scaling table in ~2 min",
    )  # fmt: skip
    parser.add_argument("--no-cluster", action="store_true", help="single redis-server only")
    parser.add_argument(
        "--cores", type=int, default=os.cpu_count() or 1,
        help="cores to size the servers' io-threads for (default: this host's)",
    )  # fmt: skip
    parser.add_argument(
        "--budget-s", type=float, default=200.0,
        help="after this many seconds of measuring, cells run once (default 200)",
    )  # fmt: skip
    parser.add_argument(
        "--no-tiering", action="store_true",
        help="leave out the tiering rows (vLLM's CPU tier with the Redis secondary tier)",
    )  # fmt: skip
    parser.add_argument(
        "--flip-a-loaded-byte", action="store_true",
        help="flip one loaded byte before each comparison: the check must exit 1 (self-test)",
    )  # fmt: skip
    return parser


def _refuse(message: str) -> NoReturn:
    """A bad option or a host the check cannot run on: one line, exit 2."""
    print(f"hma_redis GPU check: {message}", file=sys.stderr)
    raise SystemExit(EXIT_ERROR)


def choose_plan(args: argparse.Namespace, device: torch.device) -> Plan:
    """The plan for ``device`` with the command line's overrides; connections limited to 1
    where the engine has no ``connections_per_job``."""
    plan = GPU_PLAN if device.type == "cuda" else CPU_PLAN
    if args.connections:
        try:
            conns = tuple(int(n) for n in args.connections.split(","))
        except ValueError:
            _refuse("--connections: expected numbers separated by commas")
        if not conns or min(conns) < 1:
            _refuse("--connections: every count must be >= 1")
        plan = replace(plan, connections=conns)
    if not measure.supports_connections():
        plan = replace(plan, connections=(1,))
    if args.shape is not None:
        sized = GPU_PLAN if args.shape == "llama3-8b" else CPU_PLAN
        plan = replace(
            plan, shape=sized.shape, num_blocks=sized.num_blocks, job_blocks=sized.job_blocks
        )
    if args.reps is not None:
        if args.reps < 1:
            _refuse("--reps must be >= 1")
        plan = replace(plan, reps=args.reps)
    return plan


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        _refuse(f"--device: not a device: {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        _refuse("--device cuda: torch sees no CUDA device (pass --device cpu)")
    if device.type not in ("cuda", "cpu"):
        _refuse(f"--device: cuda or cpu, not {name!r}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@contextmanager
def redis_targets(cores: int, cluster: bool) -> Iterator[tuple[list[Target], list[str]]]:
    """Start the servers; yield them as targets, and lines describing them."""
    version = redis_version()
    threads = IoThreads.for_host(cores)
    with ExitStack() as stack:
        single = start_single(threads.single, version)
        stack.callback(single.stop)
        targets = [Target("single", single.url, _flusher(single.url))]
        lines = [f"redis-server {version}: single (io-threads {threads.single})"]
        if cluster:
            shards = LocalShards(3, threads.shard, version).start()
            stack.callback(shards.stop)
            targets.append(Target("cluster", shards.url, shards.flushall))
            lines[0] += f", 3-shard cluster (io-threads {threads.shard} each)"
        lines[0] += f"; persistence off; sized for {cores} cores"
        yield targets, lines


def _flusher(url: str) -> Callable[[], None]:
    def flushall() -> None:
        with redis.Redis.from_url(url) as client:
            client.flushall()

    return flushall


@dataclass
class Results:
    """The table's rows, and the data path each Redis deployment's jobs took."""

    rows: list[Row]
    data_paths: dict[str, str]


def run_cells(
    plan: Plan, cache: KVCache, targets: Sequence[Target], budget: Budget, flip: bool
) -> Results:
    """Every cell of the table, rows in the order of its sections, for every connection count
    of the plan (the C job and its twin both split a job over ``connections_per_job``)."""
    rng = random.Random(20261130)
    sections: dict[str, list[Row]] = {}
    paths: dict[str, str] = {}
    for target in targets:
        probe = Rig(target, cache, plan.chunk_blocks[0], 1)
        paths[target.name] = probe.engine.data_path
        connections = plan.connections
        probe.close()
        for chunk in plan.chunk_blocks:
            for conns in connections:
                rig = Rig(target, cache, chunk, conns)
                try:
                    rows = _cell(plan, rig, rng, budget, flip, connections, target is targets[0])
                finally:
                    rig.close()
                    target.flushall()
                for row in rows:
                    sections.setdefault(row.check, []).append(row)
    ordered = [row for check in SECTIONS for row in sections.get(check, [])]
    return Results(ordered + summary_rows(sections, cache.device.type == "cuda"), paths)


def _cell(
    plan: Plan,
    rig: Rig,
    rng: random.Random,
    budget: Budget,
    flip: bool,
    connections: Sequence[int],
    first_target: bool,
) -> list[Row]:
    """The rows of one (deployment, chunk size, connections) cell: throughput always;
    correctness and corruption with the most connections; load timing with the fewest, for
    the largest chunks; the compute-stream check once, on the first deployment."""
    gpu = rig.cache.device.type == "cuda"
    conns, chunk = rig.connections, rig.chunk_blocks
    labels = Labels(rig.target.name, f"{chunk} blk", str(conns))
    largest = chunk == max(plan.chunk_blocks)
    rig.warm_up(rng)
    rows: list[Row] = []
    if conns == connections[-1]:
        rows.append(measure.correctness(rig, rng, plan.job_blocks, labels))
        rows.append(measure.corruption(rig, rng, plan.job_blocks, labels))
    cell = measure.throughput(rig, rng, plan.job_blocks, plan.reps, budget, flip)
    nbytes = plan.job_blocks * plan.shape.block_bytes
    goals = (STORE_TARGET_GBPS, LOAD_TARGET_GBPS) if gpu else None
    rows += measure.throughput_rows(cell, nbytes, labels, goals)
    if largest and conns == connections[0]:
        rows.append(measure.load_timing(rig, rng, plan.job_blocks, labels))
    if largest and conns == connections[-1] and first_target:
        rows.append(
            measure.compute_overlap(
                rig, rng, plan.job_blocks, plan.compute_s, plan.matmul_n, labels
            )
        )
    return rows


def _tiering(plan: Plan, cache: KVCache, target: Target, flip: bool) -> list[Row]:
    """The tiering rows on the first deployment (the single server), or why they cannot run."""
    from hma_redis.tools.gpu import tiering

    missing = tiering.unavailable(cache.device.type)
    if missing is not None:
        return [tiering.skipped_row(missing, target.name)]
    rows = tiering.tiering_rows(
        cache, target.url, target.name, plan.job_blocks, plan.chunk_blocks, plan.reps, flip
    )
    target.flushall()
    return rows


def summary_rows(sections: dict[str, list[Row]], gpu: bool) -> list[Row]:
    """The best store and load rate over every cell, per Redis, against the targets."""
    rows: list[Row] = []
    for check, goal in (("store GB/s", STORE_TARGET_GBPS), ("load GB/s", LOAD_TARGET_GBPS)):
        best: dict[str, tuple[float, Row]] = {}
        for row in sections.get(check, []):
            rate = row.gbps or 0.0
            if row.redis not in best or rate > best[row.redis][0]:
                best[row.redis] = (rate, row)
        for redis_name, (rate, row) in best.items():
            target, verdict = (f">= {goal:g}", "ok" if rate >= goal else "below") if gpu else NA
            labels = Labels(redis_name, row.chunk, row.conns)
            rows.append(labels.row(f"best {check}", f"{rate:.2f}", target, verdict))
        if "single" in best and "cluster" in best:
            ratio = best["cluster"][0] / best["single"][0]
            target, verdict = ("> 1x", "ok" if ratio > 1 else "below") if gpu else NA
            labels = Labels("cluster", "best", "best")
            rows.append(labels.row(f"cluster/single {check.split()[0]}", f"{ratio:.2f}x",
                                   target, verdict))  # fmt: skip
    return rows


def format_table(rows: Sequence[Row]) -> str:
    cells = [COLUMNS] + [
        (r.check, r.redis, r.chunk, r.conns, r.measured, r.target, r.verdict) for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells[1:]:
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
    return "\n".join(lines)


def describe_host(device: torch.device, cores: int) -> str:
    what = "CPU"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        what = f"{props.name} ({device}, {props.total_memory / 2**30:.0f} GiB)"
    return (
        f"device: {what}; torch {torch.__version__}; Python {platform.python_version()}; "
        f"{cores} cores ({platform.node() or 'host'})"
    )


def report(
    plan: Plan, device: torch.device, cores: int, servers: Sequence[str], results: Results
) -> str:
    rows = results.rows
    wrong = [r for r in rows if r.wrong]
    conns = (
        ", ".join(map(str, plan.connections))
        if measure.supports_connections()
        else "1 only: this transfer engine has no connections_per_job option"
    )
    head = [
        "hma_redis GPU check (hma_redis.tools.gpu.check)",
        describe_host(device, cores),
        *servers,
        f"KV cache: {plan.shape.describe()}; {plan.num_blocks} blocks on {device}",
        f"jobs: {plan.job_blocks} blocks ({plan.job_blocks * plan.shape.block_bytes / 2**20:g} "
        f"MiB of KV); GB/s = KV bytes / (submit -> done), 1e9 bytes; connections per job: "
        f"{conns}",
        f"hma_redis from {os.path.dirname(hma_redis.__file__)}; extension: {wire.describe()}",
        *(f"data path ({name}): {path}" for name, path in results.data_paths.items()),
        "",
    ]
    verdict = (
        f"RESULT: {len(wrong)} row(s) with a WRONG byte or a failed load: exit {EXIT_WRONG}"
        if wrong
        else f"RESULT: every byte correct, every corrupted value refused: exit {EXIT_OK}"
    )
    return "\n".join([*head, format_table(rows), "", verdict]) + "\n"


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a timeout's) unwinds like an exception, so the servers are stopped."""
    raise SystemExit(EXIT_ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = resolve_device(args.device)
    plan = choose_plan(args, device)
    started = time.monotonic()
    try:
        with redis_targets(args.cores, not args.no_cluster) as (targets, servers):
            if device.type == "cuda":
                torch.cuda.set_device(device)
            cache = KVCache(plan.shape, plan.num_blocks, device, seed=1)
            results = run_cells(
                plan, cache, targets, Budget(args.budget_s), args.flip_a_loaded_byte
            )
            if not args.no_tiering:
                results.rows += _tiering(plan, cache, targets[0], args.flip_a_loaded_byte)
    except (CheckError, RuntimeError, OSError, redis.RedisError) as exc:
        print(f"hma_redis GPU check could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    text = report(plan, device, args.cores, servers, results)
    text += f"(measured in {time.monotonic() - started:.0f} s)\n"
    sys.stdout.write(text)
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
    return EXIT_WRONG if any(r.wrong for r in results.rows) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
