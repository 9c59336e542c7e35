"""What the GPU check measures, each through the transfer engine's public API: correctness (a
load lands byte for byte where it should and nowhere else), refusal of a corrupted value, store
and load throughput, a load's time against the sum of its phases, and whether a concurrent
matmul loop on the compute stream keeps its rate while loads run.

Every load the check times is also verified byte for byte; a wrong byte is a :class:`Row` with
``wrong=True`` (the check then exits non-zero), never an exception.
"""

from __future__ import annotations

import inspect
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.client import make_client
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.engine import TransferEngine
from hma_redis.core.transfer.jobs import ChunkTransfer, JobResult, ValueFormat
from hma_redis.tools.gpu.kvcache import KVCache, job_chunks, pick_blocks

GB = 1e9
KEYSPACE = KeySpace("hma", "gpu-check")
_JOB_TIMEOUT_S = 120.0
_POLL_S = 0.0002


class CheckError(RuntimeError):
    """The check could not run a step (a job that never finished, a server that failed)."""


def supports_connections() -> bool:
    """Whether this transfer engine takes ``connections_per_job``."""
    return "connections_per_job" in inspect.signature(TransferEngine).parameters


@dataclass(frozen=True)
class Target:
    """A Redis deployment under test: ``single`` or ``cluster``, and how to empty it."""

    name: str
    url: str
    flushall: Callable[[], None]


@dataclass(frozen=True)
class Row:
    """One line of the table. ``wrong``: a byte was wrong or a corrupted value got through;
    ``gbps``: the median rate of a throughput row."""

    check: str
    redis: str
    chunk: str
    conns: str
    measured: str
    target: str = "-"
    verdict: str = "-"
    wrong: bool = False
    gbps: float | None = None


@dataclass
class Budget:
    """Wall-clock budget of the measurements: once spent, cells run one repetition only."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def spent(self) -> bool:
        return time.monotonic() - self.started > self.seconds


class Rig:
    """One transfer engine over the KV cache, against one Redis deployment, with
    ``connections`` per job where the engine has that option. Jobs are numbered here and
    their results collected from :meth:`TransferEngine.finished` by job id."""

    def __init__(self, target: Target, cache: KVCache, chunk_blocks: int, connections: int) -> None:
        self.target = target
        self.cache = cache
        self.chunk_blocks = chunk_blocks
        self.connections = connections
        cfg = RedisTierConfig(
            url=target.url,
            pool_size=2 * connections + 8,
            connect_timeout_s=5.0,
            read_timeout_s=30.0,
        )
        self.store = RedisBlockStore(cfg)
        self.client = make_client(cfg)
        options: dict[str, Any] = {}
        if supports_connections():
            options["connections_per_job"] = connections
        self.engine = TransferEngine(
            self.store,
            [cache.sources()],
            ValueFormat(kv_dtype=cache.shape.dtype_name),
            blocks_per_chunk=chunk_blocks,
            io_threads=cfg.io_threads,
            max_inflight_bytes=cfg.max_inflight_bytes,
            **options,
        )
        self._next_job = 0
        self._results: dict[int, JobResult] = {}

    def chunks(self, tag: str, block_ids: Sequence[int]) -> list[ChunkTransfer]:
        return job_chunks(KEYSPACE, tag, block_ids, self.chunk_blocks)

    def submit(self, store: bool, chunks: Sequence[ChunkTransfer]) -> int:
        self._next_job += 1
        submit = self.engine.submit_store if store else self.engine.submit_load
        submit(self._next_job, chunks)
        return self._next_job

    def done(self, job_id: int) -> JobResult | None:
        """The job's result once it has finished (each result is handed out once)."""
        for result in self.engine.finished():
            self._results[result.job_id] = result
        return self._results.pop(job_id, None)

    def wait(self, job_id: int) -> JobResult:
        deadline = time.monotonic() + _JOB_TIMEOUT_S
        while (result := self.done(job_id)) is None:
            if time.monotonic() > deadline:
                raise CheckError(f"job {job_id} did not finish within {_JOB_TIMEOUT_S:.0f}s")
            time.sleep(_POLL_S)
        return result

    def run(self, store: bool, chunks: Sequence[ChunkTransfer]) -> tuple[JobResult, float]:
        """Submit a job and wait for it: its result and the seconds from submit to done."""
        started = time.perf_counter()
        result = self.wait(self.submit(store, chunks))
        return result, time.perf_counter() - started

    def warm_up(self, rng: random.Random) -> None:
        """One small store and load, so streams, pinned buffers and connections exist."""
        src, dst = pick_blocks(rng, self.cache.num_blocks, 2 * self.chunk_blocks)
        self.run(True, self.chunks("warm-up", src))
        self.run(False, self.chunks("warm-up", dst))

    def close(self) -> None:
        self.engine.shutdown()
        self.store.close()
        self.client.close()


# ---------------------------------------------------------------------------------- checks


def correctness(rig: Rig, rng: random.Random, job_blocks: int, labels: Labels) -> Row:
    """Store from random block ids, load into other random ids: the destination pages equal
    the source pages byte for byte, and no other page of the cache changed."""
    cache = rig.cache
    src, dst = pick_blocks(rng, cache.num_blocks, job_blocks)
    stored, _ = rig.run(True, rig.chunks("correct", src))
    before = cache.snapshot()
    loaded, _ = rig.run(False, rig.chunks("correct", dst))
    cache.synchronize()
    wrong = cache.wrong_pages(src, dst)
    elsewhere = cache.changed_pages(before, dst)
    ok = loaded.ok and wrong == 0 and elsewhere == 0 and loaded.nbytes == stored.nbytes > 0
    measured = (
        f"{job_blocks} blocks byte-identical, rest untouched"
        if ok
        else f"load ok={loaded.ok}, {wrong} wrong pages, {elsewhere} pages changed elsewhere, "
        f"bytes stored {stored.nbytes} / loaded {loaded.nbytes}"
    )
    return labels.row("correctness", measured, "every byte", verdict_of(ok), wrong=not ok)


def corruption(rig: Rig, rng: random.Random, job_blocks: int, labels: Labels) -> Row:
    """Store, flip the last byte of one value in Redis, load: the load fails, no page outside
    the destination blocks changes, the bad value is deleted, and no destination page is
    written either, unless the engine says its loads land in place
    (:attr:`TransferEngine.loads_land_in_place`: the C job, a CPU cache, values not sealed),
    where a failed load may have written its own blocks (vLLM recomputes them): that is
    reported, not failed."""
    cache = rig.cache
    src, dst = pick_blocks(rng, cache.num_blocks, job_blocks)
    chunks = rig.chunks("corrupt", src)
    rig.run(True, chunks)
    victim = chunks[len(chunks) // 2].redis_key
    _flip_last_byte(rig, victim)
    before = cache.snapshot()
    loaded, _ = rig.run(False, rig.chunks("corrupt", dst))
    cache.synchronize()
    elsewhere = cache.changed_pages(before, dst)
    written = cache.changed_pages(before, []) - elsewhere
    deleted = not rig.client.exists(victim)
    if loaded.ok or elsewhere or (written and not rig.engine.loads_land_in_place):
        measured = f"load ok={loaded.ok}, {written} destination pages written, {elsewhere} other"
        return labels.row("corrupt value", measured, "refused", "WRONG", wrong=True)
    measured = "refused, " + (
        f"{written} destination pages written (in place), none other"
        if written
        else "no byte of the cache written"
    )
    if not deleted:
        measured += ", value NOT deleted"
    return labels.row("corrupt value", measured, "refused", "ok" if deleted else "kept value")


def _flip_last_byte(rig: Rig, key: str) -> None:
    length = int(rig.client.strlen(key))
    if length == 0:
        raise CheckError(f"{key} was not stored")
    last = rig.client.getrange(key, length - 1, length - 1)
    assert isinstance(last, bytes)  # the client does not decode responses
    rig.client.setrange(key, length - 1, bytes([last[0] ^ 0xFF]))


@dataclass
class Throughput:
    """Timed stores and loads of one cell, each load verified."""

    store_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    wrong_pages: int = 0
    failed_loads: int = 0


def throughput(
    rig: Rig, rng: random.Random, job_blocks: int, reps: int, budget: Budget, flip: bool
) -> Throughput:
    """``reps`` stores of fresh chunks from random blocks, each followed by a load of them
    into other blocks (zeroed first, so a load that writes nothing cannot pass); the budget
    cuts the repetitions after the first. ``flip``: one loaded byte is flipped before the
    comparison (proves a wrong byte fails the check)."""
    out = Throughput()
    for rep in range(reps):
        if rep and budget.spent():
            break
        tag = f"tp-{rig.chunk_blocks}-{rig.connections}-{rep}"
        src, dst = pick_blocks(rng, rig.cache.num_blocks, job_blocks)
        _, seconds = rig.run(True, rig.chunks(tag, src))
        out.store_s.append(seconds)
        rig.cache.clear(dst)
        loaded, seconds = rig.run(False, rig.chunks(tag, dst))
        out.load_s.append(seconds)
        out.failed_loads += not loaded.ok
        if flip:
            rig.cache.flip_byte(dst[0])
        out.wrong_pages += rig.cache.wrong_pages(src, dst)
    return out


def throughput_rows(
    result: Throughput, nbytes: int, labels: Labels, targets: tuple[float, float] | None
) -> list[Row]:
    """A store row and a load row: median GB/s of KV bytes (min-max over the runs), judged
    against ``targets`` (store, load GB/s; None: no target, as on the CPU)."""
    wrong = result.wrong_pages > 0 or result.failed_loads > 0
    rows: list[Row] = []
    for check, seconds, goal in (
        ("store GB/s", result.store_s, targets[0] if targets else None),
        ("load GB/s", result.load_s, targets[1] if targets else None),
    ):
        measured = _gbps(nbytes, seconds)
        target, verdict = "-", "-"
        if goal is not None:
            target = f">= {goal:g}"
            verdict = "ok" if median_gbps(nbytes, seconds) >= goal else "below"
        if check == "load GB/s" and wrong:
            measured += f"; {result.wrong_pages} WRONG pages, {result.failed_loads} failed loads"
            verdict = "WRONG"
        row = labels.row(check, measured, target, verdict, wrong=wrong and "load" in check)
        rows.append(replace(row, gbps=median_gbps(nbytes, seconds)))
    return rows


def _gbps(nbytes: int, seconds: Sequence[float]) -> str:
    rates = sorted(nbytes / s / GB for s in seconds)
    if len(rates) == 1:
        return f"{rates[0]:.2f}"
    return f"{statistics.median(rates):.2f} ({rates[0]:.2f}-{rates[-1]:.2f}, {len(rates)} runs)"


def median_gbps(nbytes: int, seconds: Sequence[float]) -> float:
    return nbytes / statistics.median(seconds) / GB


@dataclass(frozen=True)
class Phases:
    wire_s: float
    checksum_s: float
    h2d_s: float
    scatter_s: float

    @property
    def total_s(self) -> float:
        return self.wire_s + self.checksum_s + self.h2d_s + self.scatter_s


def load_timing(rig: Rig, rng: random.Random, job_blocks: int, labels: Labels) -> Row:
    """A load's time from ``submit_load`` to done (median of 3) against the sum of its phases
    measured one after the other on the same chunks: wire (one pipelined GET of every value,
    :meth:`RedisBlockStore.get`), checksum (:func:`codec.decode`), H2D (one copy of every body
    from pinned memory to the device) and scatter (``index_copy_`` into the blocks). Below 1x:
    the engine overlaps phases; above: it adds overhead of its own."""
    cache = rig.cache
    src, dst = pick_blocks(rng, cache.num_blocks, job_blocks)
    rig.run(True, rig.chunks("timing", src))
    chunks = rig.chunks("timing", dst)
    e2e: list[float] = []
    wrong = 0
    for _ in range(3):
        cache.clear(dst)
        loaded, seconds = rig.run(False, chunks)
        e2e.append(seconds)
        wrong += cache.wrong_pages(src, dst) + (not loaded.ok)
    cache.clear(dst)
    phases = _phases(rig, chunks)
    wrong += cache.wrong_pages(src, dst)
    load_s = statistics.median(e2e)
    h2d = f"{phases.h2d_s * 1e3:.0f}" if cache.device.type == "cuda" else "n/a"
    measured = (
        f"{load_s * 1e3:.0f} ms submit->done; phases {phases.total_s * 1e3:.0f} ms = wire "
        f"{phases.wire_s * 1e3:.0f} + checksum {phases.checksum_s * 1e3:.0f} + H2D {h2d} + "
        f"scatter {phases.scatter_s * 1e3:.0f}"
    )
    if wrong:
        measured += f"; {wrong} WRONG pages or failed loads"
    ratio = f"{load_s / phases.total_s:.2f}x" + (" WRONG" if wrong else "")
    return labels.row("load timing", measured, "<= 1x sum", ratio, wrong=wrong > 0)


def _phases(rig: Rig, chunks: Sequence[ChunkTransfer]) -> Phases:
    cache = rig.cache
    keys = [c.redis_key for c in chunks]
    started = time.perf_counter()
    values = rig.store.get(keys)
    wire = time.perf_counter() - started
    if any(v is None for v in values):
        raise CheckError("a chunk the timing load just read is gone from Redis")
    started = time.perf_counter()
    blocks = [
        codec.decode(v, expected_key=k, expected_group=0)
        for k, v in zip(keys, values, strict=True)
        if v is not None
    ]
    checksum = time.perf_counter() - started
    cuda = cache.device.type == "cuda"
    total = sum(b.body.nbytes for b in blocks)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    host_bytes = host.numpy().data.cast("B")
    offset = 0
    for block in blocks:
        host_bytes[offset : offset + block.body.nbytes] = block.body
        offset += block.body.nbytes
    bodies, h2d = host, 0.0
    if cuda:
        bodies = torch.empty(total, dtype=torch.uint8, device=cache.device)
        cache.synchronize()
        started = time.perf_counter()
        bodies.copy_(host, non_blocking=True)
        cache.synchronize()
        h2d = time.perf_counter() - started
    # On the CPU with one intra-op thread, as the engine copies CPU pages: torch's indexing
    # threads contend with everything else on a busy host (milliseconds instead of µs).
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)
    try:
        started = time.perf_counter()
        _scatter(cache, chunks, bodies.view(torch.int8))
        cache.synchronize()
        scatter = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    return Phases(wire, checksum, h2d, scatter)


def _scatter(cache: KVCache, chunks: Sequence[ChunkTransfer], bodies: torch.Tensor) -> None:
    """Copy each chunk's body (layer-major pages) into its blocks."""
    page = cache.shape.page_bytes
    offset = 0
    for chunk in chunks:
        count = len(chunk.block_ids)
        ids = cache.index(chunk.block_ids)
        for layer in cache.layers:
            pages = bodies[offset : offset + count * page].view(count, page)
            layer.index_copy_(0, ids, pages)
            offset += count * page


class LoadLoop:
    """Keeps one load in flight, resubmitting it whenever it finishes (:meth:`tick`)."""

    def __init__(self, rig: Rig, chunks: Sequence[ChunkTransfer]) -> None:
        self._rig = rig
        self._chunks = chunks
        self.loads = 0
        self.failed = 0
        self._job = rig.submit(False, chunks)

    def tick(self) -> None:
        result = self._rig.done(self._job)
        if result is None:
            return
        self.loads += 1
        self.failed += not result.ok
        self._job = self._rig.submit(False, self._chunks)

    def finish(self) -> None:
        result = self._rig.wait(self._job)
        self.loads += 1
        self.failed += not result.ok


def compute_overlap(
    rig: Rig, rng: random.Random, job_blocks: int, seconds: float, matmul_n: int, labels: Labels
) -> Row:
    """The rate of a matmul loop on the compute (default) stream alone, then while loads run
    back to back on the engine's transfer stream; target: >= 0.95x on a GPU."""
    cache = rig.cache
    src, dst = pick_blocks(rng, cache.num_blocks, job_blocks)
    rig.run(True, rig.chunks("overlap", src))
    cache.clear(dst)
    alone = matmul_rate(cache.device, matmul_n, seconds)
    loop = LoadLoop(rig, rig.chunks("overlap", dst))
    during = matmul_rate(cache.device, matmul_n, seconds, loop.tick)
    loop.finish()
    wrong = cache.wrong_pages(src, dst) + loop.failed
    ratio = during / alone
    measured = (
        f"{during:.0f} vs {alone:.0f} matmuls/s alone ({matmul_n}x{matmul_n}); "
        f"{loop.loads} loads ran meanwhile"
    )
    if wrong:
        measured += f"; {wrong} WRONG pages or failed loads"
    gpu = cache.device.type == "cuda"
    verdict = f"{ratio:.2f}x" + ((" ok" if ratio >= 0.95 else " BLOCKED") if gpu else "")
    if wrong:
        verdict += " WRONG"
    return labels.row("compute rate", measured, ">= 0.95x" if gpu else "-", verdict, wrong > 0)


def matmul_rate(
    device: torch.device, n: int, seconds: float, tick: Callable[[], None] | None = None
) -> float:
    """Matmuls per second of a loop on the current stream, synchronized every batch (so the
    rate is what the stream achieved), calling ``tick`` between batches."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty_like(a)
    batch = 8

    def run_batch() -> None:
        for _ in range(batch):
            torch.mm(a, a, out=out)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    run_batch()
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        run_batch()
        done += batch
        if tick is not None:
            tick()
    return done / (time.perf_counter() - started)


@dataclass(frozen=True)
class Labels:
    """The first columns of a cell's rows."""

    redis: str
    chunk: str
    conns: str

    def row(
        self, check: str, measured: str, target: str = "-", verdict: str = "-", wrong: bool = False
    ) -> Row:
        return Row(check, self.redis, self.chunk, self.conns, measured, target, verdict, wrong)


def verdict_of(ok: bool) -> str:
    """A correctness row's verdict; ``WRONG`` fails the check."""
    return "ok" if ok else "WRONG"
