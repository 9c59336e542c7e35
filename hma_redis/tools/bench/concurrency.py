"""The bench's concurrent mode (``hma-redis bench --concurrency 1,4,16``): many requests' loads
and stores in flight at once on one transfer engine, against LMCache's ``resp://`` client and
its MP mode's Redis L2 adapter doing the same, in one run against one Redis.

A GPU server's worker submits the loads and stores of many requests at once. For each level N
and value size, each client runs a closed loop: N jobs in flight, a new one submitted as soon
as one finishes, until ``jobs`` jobs have run, alternating load and store (half of each). A job
moves ``job_bytes`` of KV in values of the size (8 MiB: 16 values of 512 KiB or 4 of 2 MiB).

- **hma_redis**: one :class:`~hma_redis.adapter.worker.RedisOffloadingWorker` (so one
  :class:`~hma_redis.core.transfer.engine.TransferEngine`, its default threads) per value size, on a
  CPU KV cache of ``LAYERS`` x ``(num_blocks, PAGE_BYTES)`` int8. A store job sends the pages
  of random blocks of a 16-job source region under fresh keys; a load job reads one of 16 jobs'
  worth of values stored before the loop (untimed) into the blocks of its own slot.
- **LMCache** (``--lmcache-python``): ``benchmarks/lmcache_peer.py --concurrency N`` in that
  interpreter, once per connector, each with its default worker threads: ``resp://``, N
  coroutines on its event loop, each a ``batched_put`` of a job's values (from 16 jobs' worth
  of filled buffers) or a ``batched_get`` of one of 16 jobs' worth stored before the loop; and
  the MP mode's RESP L2 adapter (``lmcache-mp``, the mode LMCache runs by default), N tasks in
  flight, ``submit_store_task`` of one of 16 jobs' worth of filled L1 buffers or
  ``submit_load_task`` of one of 16 jobs' worth stored before the loop into fresh L1 buffers,
  awaited on the adapter's event fds as the MP server's controllers await them. A release
  without the MP mode leaves a note instead of its rows.

Each level runs an untimed warm-up loop first. A job's latency runs from its submission until
the loop sees it finished; aggregate GB/s is the payload bytes of the loop's loads, stores or
both over the loop's wall time. Every job's byte count is checked; the last load of every slot
is compared byte for byte with what was stored, and one store job's values are read back and
compared. ``--smoke`` compares every load and every store job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.tools.bench.common import (
    GB,
    KIB,
    KV_DTYPE,
    LAYERS,
    LMCACHE_PEER,
    MIB,
    PAGE_BYTES,
    WAIT_SLICE_S,
    BenchError,
    OffloadKeys,
    bench_kv_cache,
    check,
    peer_outcome,
    process_cpu_s,
    require_lmcache_python,
    require_single_server,
    server_counters,
    server_version,
)

Op = Literal["load", "store"]
SOURCE_JOBS = 16  # jobs' worth of distinct source pages (stores) and stored values (loads)
PEERS = ("lmcache-resp", "lmcache-mp")
CLIENTS = ("hma_redis", *PEERS)


@dataclass(frozen=True)
class ConcurrencyPlan:
    """How much the concurrent mode measures."""

    levels: tuple[int, ...]  # jobs in flight at once
    sizes: tuple[int, ...]  # value sizes
    job_bytes: int  # KV payload per job (a multiple of every size)
    jobs: int  # timed jobs per level, client and repetition (half loads, half stores)
    reps: int  # interleaved repetitions; job latencies are pooled over them
    check_every_job: bool = False  # compare every load and store byte for byte (--smoke)

    def values_per_job(self, size: int) -> int:
        return self.job_bytes // size

    def warmup_jobs(self, level: int) -> int:
        return max(4, 2 * level)


def concurrency_plan(
    levels: Sequence[int], *, smoke: bool, quick: bool, reps: int | None
) -> ConcurrencyPlan:
    """The plan for ``levels`` under the bench's ``--smoke`` / ``--quick`` / ``--reps``."""
    if smoke:
        return ConcurrencyPlan(tuple(levels), (512 * KIB, 2 * MIB), 4 * MIB, 8, reps or 1, True)
    jobs = 48 if quick else 96
    return ConcurrencyPlan(tuple(levels), (512 * KIB, 2 * MIB), 8 * MIB, jobs, reps or 3)


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> ``(1, 4, 16)``; ``ValueError`` unless every level is 1..64."""
    message = "--concurrency takes a list of levels from 1 to 64, e.g. 1,4,16"
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and 1 <= int(part) <= 64 for part in parts):
        raise ValueError(message)
    return tuple(int(part) for part in parts)


@dataclass(frozen=True)
class LevelRun:
    """One client's timed loop at one level and value size."""

    client: str
    size: int
    level: int
    wall_s: float
    job_bytes: int
    spans: dict[str, list[tuple[float, float]]]  # by op: each job's (submitted, finished), s
    client_cpu_s: float = 0.0  # the client process's CPU seconds over the timed loop
    server_cpu_s: float = 0.0  # redis-server's (INFO cpu) over the timed loop

    def cpu_per_gb(self) -> tuple[float, float]:
        """Client and redis-server CPU seconds per GB of payload the timed loop moved."""
        gb = sum(len(spans) for spans in self.spans.values()) * self.job_bytes / GB
        return self.client_cpu_s / gb, self.server_cpu_s / gb

    def latencies(self, op: Op) -> list[float]:
        return [end - start for start, end in self.spans[op]]

    def gbps(self, op: Op | None = None) -> float:
        """Payload GB/s of the loop (None: all its jobs over its wall time), or of its loads
        or stores over the time at least one of them was in flight (as the two alternate,
        their counts are equal: over the wall time both would read half of the total)."""
        if op is None:
            jobs = sum(len(spans) for spans in self.spans.values())
            return jobs * self.job_bytes / self.wall_s / GB
        return len(self.spans[op]) * self.job_bytes / _busy_s(self.spans[op]) / GB


def _busy_s(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``spans``."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy


@dataclass
class ConcurrencyReport:
    plan: ConcurrencyPlan
    where: str
    redis_version: str
    data_path: str
    load_before: float
    load_after: float = 0.0
    seconds: float = 0.0
    # LMCache's version, each connector's worker threads, and why a connector is absent
    lmcache: dict[str, Any] | None = None
    runs: list[LevelRun] = field(default_factory=list)

    def cell(self, client: str, size: int, level: int) -> list[LevelRun]:
        return [r for r in self.runs if (r.client, r.size, r.level) == (client, size, level)]

    def summary(self, client: str, size: int, level: int) -> dict[str, float] | None:
        """Medians over repetitions of the GB/s, and p50 / p99 of every job's latency (ms),
        pooled over repetitions; None when not measured."""
        runs = self.cell(client, size, level)
        if not runs:
            return None
        summary = {
            "load_gbps": statistics.median(r.gbps("load") for r in runs),
            "store_gbps": statistics.median(r.gbps("store") for r in runs),
            "all_gbps": statistics.median(r.gbps() for r in runs),
            "client_cpu_s_per_gb": statistics.median(r.cpu_per_gb()[0] for r in runs),
            "server_cpu_s_per_gb": statistics.median(r.cpu_per_gb()[1] for r in runs),
        }
        groups: tuple[tuple[tuple[Op, ...], str], ...] = (
            (("load", "store"), ""),
            (("load",), "load_"),
            (("store",), "store_"),
        )
        for ops, label in groups:
            latencies = [s for r in runs for op in ops for s in r.latencies(op)]
            p50, p99 = np.percentile(latencies, [50, 99])
            summary |= {f"{label}p50_ms": float(p50) * 1e3, f"{label}p99_ms": float(p99) * 1e3}
        summary["jobs"] = sum(len(spans) for r in runs for spans in r.spans.values())
        return summary

    def to_json(self) -> dict[str, Any]:
        rows = []
        for size in self.plan.sizes:
            for level in self.plan.levels:
                row: dict[str, Any] = {"size": size, "concurrency": level}
                for client in CLIENTS:
                    row[client] = self.summary(client, size, level)
                rows.append(row)
        return {
            "mode": "concurrency",
            "redis_version": self.redis_version,
            "data_path": self.data_path,
            "lmcache": self.lmcache,
            "load_average": [self.load_before, self.load_after],
            "plan": dataclasses.asdict(self.plan),
            "rows": rows,
            "runs": [dataclasses.asdict(r) for r in self.runs],
        }


# ---------------------------------------------------------------------------------- hma_redis


@dataclass(frozen=True)
class _Stored:
    """Values a store job wrote: their offload keys and the blocks they were read from."""

    keys: Sequence[bytes]
    src_ids: list[int]


@dataclass
class _InFlight:
    op: Op
    started: float
    stored: _Stored  # what a store writes, or what a load reads
    slot: int | None = None  # a load's destination slot
    dst_ids: list[int] = field(default_factory=list)
    finished: float = 0.0


@dataclass
class _Checks:
    """What a loop leaves to compare byte for byte: the last load into each slot (its pages
    are not overwritten after it), and the last store job (every store job when ``every``)."""

    loads: dict[int, _InFlight] = field(default_factory=dict)
    stores: list[_InFlight] = field(default_factory=list)

    def add(self, job: _InFlight, every: bool) -> None:
        if job.slot is not None:
            self.loads[job.slot] = job
        elif every:
            self.stores.append(job)
        else:
            self.stores[:] = [job]


class HmaConcurrency:
    """hma_redis' worker under N jobs in flight; one worker per value size, one KV cache."""

    name = "hma_redis"

    def __init__(self, cfg: RedisTierConfig, plan: ConcurrencyPlan, namespace: str) -> None:

        from hma_redis.core.redis.store import RedisBlockStore

        self.plan = plan
        self.cfg = dataclasses.replace(cfg, read_timeout_s=60.0)
        self.store = RedisBlockStore(self.cfg)
        self.keyspace = KeySpace(self.cfg.key_prefix, namespace)
        self.job_blocks = plan.job_bytes // (LAYERS * PAGE_BYTES)
        self.source_blocks = SOURCE_JOBS * self.job_blocks
        num_blocks = self.source_blocks + max(plan.levels) * self.job_blocks
        kv = bench_kv_cache(self.cfg, self.store, self.keyspace, num_blocks, plan.sizes)
        self.tensors, self.arrays, self.workers = kv.tensors, kv.arrays, kv.workers
        self.data_path = next(iter(self.workers.values())).data_path
        self.rng = random.Random(4)
        self._keys = OffloadKeys()
        self._job_id = 0
        self._written: list[bytes] = []  # offload keys this level stored, deleted after it

    def run(self, size: int, level: int) -> LevelRun:
        """Store the loads' values, run an untimed loop and a timed one at ``level``, check
        the bytes, delete every key the level wrote."""
        worker = self.workers[size]
        try:
            sources = [self._new_stored(size) for _ in range(SOURCE_JOBS)]
            self._loop(worker, size, SOURCE_JOBS, SOURCE_JOBS, sources, stores_only=True)
            self._loop(worker, size, level, self.plan.warmup_jobs(level), sources)
            spans: dict[str, list[tuple[float, float]]] = {"load": [], "store": []}
            cpu = process_cpu_s(), server_counters(self.store.client)[0]
            started = time.perf_counter()
            checks = self._loop(worker, size, level, self.plan.jobs, sources, spans)
            wall_s = time.perf_counter() - started
            cost = process_cpu_s() - cpu[0], server_counters(self.store.client)[0] - cpu[1]
            for op_spans in spans.values():
                op_spans[:] = [(a - started, b - started) for a, b in op_spans]
            for job in checks.loads.values():
                self._check_pages(job)
            for job in checks.stores:
                self._check_readback(worker, size, job.stored)
        finally:
            self.store.delete([self._redis_key(k) for k in self._written])
            self._written.clear()
        return LevelRun(self.name, size, level, wall_s, self.plan.job_bytes, spans, *cost)

    def _new_stored(self, size: int) -> _Stored:
        keys = self._keys.take(self.plan.values_per_job(size))
        self._written += keys
        return _Stored(keys, self.rng.sample(range(self.source_blocks), self.job_blocks))

    def _redis_key(self, offload_key: bytes) -> str:
        return self.keyspace.block_key(0, offload_key[:-4])

    def _slot_ids(self, slot: int) -> list[int]:
        """A slot's blocks in random order; zeroed first where every job is compared, so a
        load that writes nothing cannot pass on what the slot held before."""
        first = self.source_blocks + slot * self.job_blocks
        ids = self.rng.sample(range(first, first + self.job_blocks), self.job_blocks)
        if self.plan.check_every_job:
            for array in self.arrays:
                array[ids] = 0
        return ids

    def _job_value_bytes(self, size: int) -> int:
        """Bytes a job of ``size`` values moves, envelopes included (its transfer_size)."""
        from hma_redis.core import codec

        header = codec.BlockHeader(
            key=self._redis_key(bytes(36)),
            group=0,
            first_block=0,
            num_blocks=size // (LAYERS * PAGE_BYTES),
            page_bytes=(PAGE_BYTES,) * LAYERS,
            kv_dtype=KV_DTYPE,
        )
        return self.plan.values_per_job(size) * codec.value_size(header)

    def _loop(
        self,
        worker: Any,
        size: int,
        level: int,
        jobs: int,
        sources: Sequence[_Stored],
        spans: dict[str, list[tuple[float, float]]] | None = None,
        stores_only: bool = False,
    ) -> _Checks:
        """Run ``jobs`` jobs, ``level`` in flight, alternating load and store (only stores of
        ``sources`` with ``stores_only``); record each job's (submitted, finished) in
        ``spans``. Every job's byte count is checked (with ``check_every_job`` every load's
        pages too, before its slot is used again); returns what is left to compare."""
        expected = self._job_value_bytes(size)
        free_slots = list(range(level))
        running: dict[int, _InFlight] = {}
        checks = _Checks()
        submitted = 0
        while submitted < jobs or running:
            while submitted < jobs and len(running) < level:
                if stores_only:
                    job = _InFlight("store", 0.0, sources[submitted])
                elif submitted % 2 == 0:
                    slot = free_slots.pop()
                    source = sources[submitted // 2 % len(sources)]
                    job = _InFlight("load", 0.0, source, slot, self._slot_ids(slot))
                else:
                    job = _InFlight("store", 0.0, self._new_stored(size))
                self._submit(worker, job)
                running[self._job_id] = job
                submitted += 1
            for job, nbytes in self._finished(worker, running):
                if spans is not None:
                    spans[job.op].append((job.started, job.finished))
                check(
                    nbytes == expected,
                    f"hma_redis: a {job.op} job moved {nbytes} of {expected} bytes",
                )
                checks.add(job, self.plan.check_every_job)
                if job.slot is not None:
                    if self.plan.check_every_job:
                        self._check_pages(job)
                    free_slots.append(job.slot)
        return checks

    def _submit(self, worker: Any, job: _InFlight) -> None:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        from hma_redis.adapter.types import RedisLoadStoreSpec

        self._job_id += 1
        keys = RedisLoadStoreSpec(job.stored.keys)  # type: ignore[arg-type]
        job.started = time.perf_counter()
        if job.op == "store":
            pages = GPULoadStoreSpec(job.stored.src_ids, [self.job_blocks], [0])
            # Fresh keys, as after a lookup that answered MISS: no EXISTS pre-check.
            fresh = RedisLoadStoreSpec(job.stored.keys, job.stored.keys)  # type: ignore[arg-type]
            worker.submit_store(self._job_id, pages, fresh)
        else:
            pages = GPULoadStoreSpec(job.dst_ids, [self.job_blocks], [0])
            worker.submit_load(self._job_id, keys, pages)

    @staticmethod
    def _finished(worker: Any, running: dict[int, _InFlight]) -> list[tuple[_InFlight, int]]:
        """Asleep until at least one job has finished (as LMCache's peer awaits its jobs);
        those jobs (their finish time set) with the bytes each moved."""
        while True:
            worker.wait_for_any_job(WAIT_SLICE_S)
            results = worker.get_finished()
            if not results:
                continue
            now = time.perf_counter()
            failed = worker.take_failed_load_jobs()
            done = []
            for result in results:
                check(result.job_id not in failed, f"hma_redis: load job {result.job_id} failed")
                job = running.pop(result.job_id)
                job.finished = now
                done.append((job, result.transfer_size))
            return done

    def _check_pages(self, job: _InFlight) -> None:
        for layer, array in enumerate(self.arrays):
            check(
                np.array_equal(array[job.dst_ids], array[job.stored.src_ids]),
                f"hma_redis: loaded blocks differ from stored ones (layer {layer})",
            )

    def _check_readback(self, worker: Any, size: int, stored: _Stored) -> None:
        """Load what a store job wrote into slot 0 (zeroed first) and compare it with its
        source pages."""
        job = _InFlight("load", 0.0, stored, 0, self._slot_ids(0))
        for array in self.arrays:
            array[job.dst_ids] = 0
        self._submit(worker, job)
        for _, nbytes in self._finished(worker, {self._job_id: job}):
            check(nbytes == self._job_value_bytes(size), "hma_redis: read-back moved too few")
        self._check_pages(job)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.shutdown()
        self.store.close()


# ---------------------------------------------------------------------------------- LMCache


class LMCacheConcurrency:
    """LMCache's ``resp://`` client or its MP mode's RESP L2 adapter (``connector`` "resp" or
    "mp"; its default worker threads) under N jobs in flight: ``benchmarks/lmcache_peer.py
    --concurrency N``, run by ``python`` (a venv with LMCache), one process per level and value
    size. ``absent``: why the MP mode is not measured (this LMCache has none), else None."""

    def __init__(
        self, python: str, cfg: RedisTierConfig, plan: ConcurrencyPlan, connector: str = "resp"
    ) -> None:
        require_lmcache_python(python, cfg)
        self.python = python
        self.url = cfg.url
        self.plan = plan
        self.connector = connector
        self.name = f"lmcache-{connector}"
        self.info: dict[str, Any] = {}
        self.absent: str | None = None

    def run(self, size: int, level: int) -> LevelRun | None:
        """The timed loop's run; None once the MP mode turned out absent."""
        if self.absent is not None:
            return None
        plan = self.plan
        args = [
            self.python, str(LMCACHE_PEER), "--url", self.url, "--connector", self.connector,
            "--size", str(size), "--count", str(plan.values_per_job(size)),
            "--concurrency", str(level), "--jobs", str(plan.jobs),
            "--warmup-jobs", str(plan.warmup_jobs(level)),
        ]  # fmt: skip
        if plan.check_every_job:
            args.append("--check-every-job")
        proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
        lines = proc.stdout.strip().splitlines()
        why, absent = peer_outcome(self.connector, proc)
        if absent:
            self.absent = why
            return None
        if proc.returncode or not lines:
            raise BenchError(f"bench: LMCache {self.connector} peer failed: {why}")
        result = json.loads(lines[-1])
        self.info = {"version": result["lmcache_version"], "threads": result["threads"]}
        check(
            len(result["load_spans"]) + len(result["store_spans"]) == plan.jobs,
            f"LMCache's {self.connector} peer ran another number of jobs than asked",
        )
        spans = {op: [(a, b) for a, b in result[f"{op}_spans"]] for op in ("load", "store")}
        return LevelRun(
            self.name,
            size,
            level,
            result["wall_s"],
            plan.job_bytes,
            spans,
            result["client_cpu_s"],
            result["server_cpu_s"],
        )


def _peers_info(peers: Sequence[LMCacheConcurrency]) -> dict[str, Any] | None:
    """The report's ``lmcache``: the version, each measured connector's worker threads, and
    why a connector is absent."""
    if not peers:
        return None
    version = next((p.info["version"] for p in peers if p.info), "?")
    threads = {p.name: p.info["threads"] for p in peers if p.info}
    absent = {p.name: p.absent for p in peers if p.absent is not None}
    return {"version": version, "threads": threads, "absent": absent}


# ---------------------------------------------------------------------------------- run


def measure_concurrency(
    cfg: RedisTierConfig, plan: ConcurrencyPlan, where: str, lmcache_python: str | None
) -> ConcurrencyReport:
    """Every level and size, hma_redis and (with ``lmcache_python``) LMCache's two clients
    interleaved, the order rotating, ``plan.reps`` times."""
    require_single_server(cfg)
    started = time.perf_counter()
    peers = [
        LMCacheConcurrency(lmcache_python, cfg, plan, connector)
        for connector in ("resp", "mp")
        if lmcache_python
    ]
    hma = HmaConcurrency(cfg, plan, f"bench-conc-{os.getpid()}")
    try:
        hma.store.ping()
        report = ConcurrencyReport(
            plan=plan,
            where=where,
            redis_version=server_version(hma.store.client),
            data_path=hma.data_path,
            load_before=os.getloadavg()[0],
        )
        turn = 0
        for _ in range(plan.reps):
            for size in plan.sizes:
                for level in plan.levels:
                    clients: list[HmaConcurrency | LMCacheConcurrency] = [hma, *peers]
                    turn += 1
                    clients = clients[turn % len(clients) :] + clients[: turn % len(clients)]
                    runs = [client.run(size, level) for client in clients]
                    report.runs += [run for run in runs if run is not None]
        report.lmcache = _peers_info(peers)
        report.load_after = os.getloadavg()[0]
        report.seconds = time.perf_counter() - started
        return report
    finally:
        hma.close()


def _size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


_FIGURES = (
    "load_gbps",
    "store_gbps",
    "all_gbps",
    "p50_ms",
    "p99_ms",
    "load_p99_ms",
    "store_p99_ms",
    "client_cpu_s_per_gb",
    "server_cpu_s_per_gb",
)


def _row(*cells: object) -> str:
    return "{:<9}{:>5}  {:<14}{:>8}{:>8}{:>8}{:>9}{:>9}{:>9}{:>9}{:>11}{:>11}".format(*cells)


def format_concurrency(report: ConcurrencyReport) -> str:
    """The concurrent mode's table: per value size, level and client, GB/s and latencies,
    then hma_redis ÷ LMCache (GB/s: higher is better for hma_redis; p99: lower is)."""
    plan = report.plan
    lines = [
        f"hma_redis concurrency benchmark: {report.redis_version}, {report.where}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}",
        f"{plan.reps} interleaved repetitions; GB/s medians, latencies pooled; load average "
        f"{report.load_before:.2f} at start, {report.load_after:.2f} at end; run took "
        f"{report.seconds:.0f} s",
        f"each level: {plan.jobs} jobs (half loads, half stores, alternating) of "
        f"{plan.job_bytes // MIB} MiB, N in flight, after {plan.warmup_jobs(1)}+ untimed ones; "
        "GB/s = 10^9 payload bytes per second of the loop's wall time; CPU s/GB over the timed "
        "loop: the client's process (cli) and redis-server (srv, INFO cpu); p99 of every job, "
        "of the loads (ld) and of the stores (st)",
        f"hma_redis: one worker (transfer engine), data path {report.data_path}",
    ]
    if report.lmcache is not None:
        threads = report.lmcache["threads"]
        lines.append(
            f"LMCache {report.lmcache['version']}, each with its default worker threads: "
            f"resp:// ({threads.get('lmcache-resp', '?')}), N coroutines of batched_put / "
            f"batched_get; lmc-mp, the MP mode's RESP L2 adapter "
            f"({threads.get('lmcache-mp', '?')}), N tasks of submit_store_task / "
            "submit_load_task on L1 buffers"
        )
        for name, why in report.lmcache["absent"].items():
            lines.append(f"{name} absent: {why}")
    lines += [
        "",
        _row(
            "value",
            "N",
            "client",
            "load",
            "store",
            "all",
            "p50 ms",
            "p99 ms",
            "ld p99",
            "st p99",
            "cli s/GB",
            "srv s/GB",
        ),
    ]
    ratios: list[str] = []
    for size in plan.sizes:
        for level in plan.levels:
            cells = {c: report.summary(c, size, level) for c in CLIENTS}
            for client, summary in cells.items():
                if summary is not None:
                    figures = [f"{summary[k]:.2f}" for k in _FIGURES[:3]]
                    figures += [f"{summary[k]:.1f}" for k in _FIGURES[3:7]]
                    figures += [f"{summary[k]:.3f}" for k in _FIGURES[7:]]
                    lines.append(_row(_size_label(size), level, client, *figures))
            ours = cells["hma_redis"]
            for peer in PEERS:
                theirs = cells[peer]
                if ours is not None and theirs is not None:
                    figures = [f"{ours[k] / theirs[k]:.2f}" for k in _FIGURES]
                    label = "hma/" + peer.replace("lmcache-", "lmc-")
                    ratios.append(_row(_size_label(size), level, label, *figures))
    if ratios:
        lines += [
            "",
            "hma_redis ÷ each LMCache client (GB/s: >= 1 is ahead; latency and CPU per GB: <= 1 "
            "is)",
        ]
        lines += ratios
    return "\n".join(lines)
