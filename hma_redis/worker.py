"""Worker side: moves chunk bytes between the KV cache and Redis, off the engine's critical path.

A chunk value holds, for every layer of its KV group, the pages of the chunk's blocks
(``blocks_per_chunk`` blocks, fewer for a sliding-window chunk whose oldest blocks had already
left the window). Stores gather those pages straight into the value buffer (the one copy), encode
and put them with SET NX; loads get, validate and scatter into the given block ids.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    OffloadKey,
    TransferResult,
    get_offload_block_hash,
    get_offload_group_idx,
)

from hma_redis import codec
from hma_redis.codec import BlockHeader, CorruptBlockError, DecodedBlock
from hma_redis.keys import KeySpace
from hma_redis.manager import RedisLoadStoreSpec
from hma_redis.store import PutResult, RedisBlockStore

logger = init_logger(__name__)

# Loads wrap immutable reply bytes in tensors that are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

# Fault-injection hook for tests: seconds to sleep before each load's GET, so a test can break
# Redis between the scheduler's lookup and the worker's read. Never set in production.
TEST_LOAD_DELAY_ENV = "HMA_REDIS_TEST_LOAD_DELAY_S"

# Values per pipelined put: large enough to amortize the round trip, small enough to bound memory.
_PUT_BATCH = 16
# The same when values are sent from the KV cache in place (no memory to bound).
_PUT_BATCH_IN_PLACE = 64


@dataclass(frozen=True)
class LayerSource:
    """One layer of a KV group: its (num_blocks, padded_page) int8 view and un-padded page size.

    On the CPU, ``host`` is the tensor's memory as bytes (rows of ``row_bytes``): pages are
    copied with plain slice assignments, never with torch indexing ops, whose intra-op threads
    contend with the engine's (measured: ``index_select`` of 16 pages of 16 KiB took 8 ms with 2
    threads on a busy 2-core machine, 21 µs with 1; the slice copies take ~25 µs either way).
    """

    tensor: torch.Tensor
    page_bytes: int
    host: memoryview | None = None
    row_bytes: int = 0

    @classmethod
    def of(cls, tensor: torch.Tensor, page_bytes: int) -> LayerSource:
        host = None
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            host = tensor.view(torch.uint8).numpy().data.cast("B")
        return cls(tensor, page_bytes, host, tensor.stride(0) * tensor.element_size())


@dataclass(frozen=True)
class ChunkTransfer:
    """One chunk's part of a job: its Redis key and which blocks of the chunk go where."""

    redis_key: str
    group: int  # KV group id (as in the offload key)
    group_pos: int  # position of the group in this worker's layer table
    start: int  # first block of the chunk that is transferred (offset inside the chunk)
    block_ids: tuple[int, ...]  # KV-cache block ids, one per transferred block


@dataclass
class _Job:
    job_id: int
    is_store: bool
    # Set once the job no longer reads the KV cache (stores) or is completely done (loads).
    released: threading.Event = field(default_factory=threading.Event)
    future: Future[None] | None = None
    chunks_loaded: int = 0


class _ByteBudget:
    """Bounds the bytes held in transfer buffers; one oversize request may run alone."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._used == 0 or self._used + nbytes <= self._limit)
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()


class _BufferPool:
    """Value buffers kept for reuse, so a transfer neither allocates nor page-faults a fresh
    buffer per value (a new 2 MiB ``bytearray`` costs ~0.3 ms, as much as its CRC32C).
    Holds at most ``limit`` idle bytes; buffers are pinned when the KV cache is on a GPU."""

    def __init__(self, limit: int, pinned: bool) -> None:
        self._limit = limit
        self._pinned = pinned
        self._idle = 0
        self._free: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._idle -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned).numpy().data

    def give(self, buffers: Iterable[memoryview | None]) -> None:
        with self._lock:
            for buf in buffers:
                if buf is not None and self._idle + buf.nbytes <= self._limit:
                    self._free.setdefault(buf.nbytes, []).append(buf)
                    self._idle += buf.nbytes


class RedisOffloadingWorker(OffloadingWorker):
    """Asynchronous store/load of chunks for one worker rank."""

    def __init__(
        self,
        store: RedisBlockStore,
        keyspace: KeySpace,
        rank: int,
        kv_caches: CanonicalKVCaches,
        group_ids: Sequence[int],
        blocks_per_chunk: int,
        kv_dtype: str,
        io_threads: int,
        max_inflight_bytes: int,
        shutdown_timeout_s: float,
    ) -> None:
        self._store = store
        self._keyspace = keyspace
        self._rank = rank
        self._blocks_per_chunk = blocks_per_chunk
        self._kv_dtype = kv_dtype
        self._shutdown_timeout_s = shutdown_timeout_s
        self._group_pos = {gid: pos for pos, gid in enumerate(group_ids)}
        self._layers: list[list[LayerSource]] = [
            [
                LayerSource.of(kv_caches.tensors[ref.tensor_idx].tensor, ref.page_size_bytes)
                for ref in refs
            ]
            for refs in kv_caches.group_data_refs
        ]
        self._pages = [tuple(layer.page_bytes for layer in group) for group in self._layers]
        self._budget = _ByteBudget(max_inflight_bytes)
        pinned = any(layer_device(group) == "cuda" for group in self._layers)
        # A CPU KV cache is sent to Redis from where it is; other devices go through buffers.
        self._in_place = all(layer.host is not None for group in self._layers for layer in group)
        self._buffers = _BufferPool(max_inflight_bytes // 4, pinned)
        self._loads = ThreadPoolExecutor(io_threads, thread_name_prefix="hma-load")
        self._stores = ThreadPoolExecutor(max(1, io_threads // 2), thread_name_prefix="hma-store")
        self._jobs: dict[int, _Job] = {}
        self._finished: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        # Load jobs that failed; moved to _failed_reported when get_finished returns them.
        self._failed_loads: set[int] = set()
        self._failed_reported: set[int] = set()
        self._failed_lock = threading.Lock()
        self._closed = False
        self._test_load_delay_s = float(os.environ.get(TEST_LOAD_DELAY_ENV, "0") or 0)

    # ------------------------------------------------------------------ vLLM API

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Queue a store; returns at once. The job reads the KV cache in a background thread
        (``wait`` blocks until it has), then encodes and puts the chunks."""
        assert isinstance(dst_spec, RedisLoadStoreSpec)
        job = _Job(job_id, is_store=True)
        self._jobs[job_id] = job
        try:
            job.future = self._stores.submit(self._run_store, job, src_spec, dst_spec)
        except RuntimeError:
            # Interpreter exit: thread pools take no new work, so store in this thread.
            self._run_store(job, src_spec, dst_spec)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Queue a load; returns at once. Completion is reported through ``get_finished``."""
        assert isinstance(src_spec, RedisLoadStoreSpec)
        job = _Job(job_id, is_store=False)
        self._jobs[job_id] = job
        job.future = self._loads.submit(self._run_load, job, src_spec, dst_spec)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs. Every result says success (vLLM 0.32 asserts it); a load that failed is
        listed by :meth:`take_failed_load_jobs` once its result has been returned here."""
        results: list[TransferResult] = []
        while True:
            try:
                result = self._finished.get_nowait()
            except queue.Empty:
                return results
            with self._failed_lock:
                if result.job_id in self._failed_loads:
                    self._failed_loads.discard(result.job_id)
                    self._failed_reported.add(result.job_id)
            results.append(result)

    def take_failed_load_jobs(self) -> set[int]:
        """Load jobs whose failure was returned by ``get_finished`` since the last call."""
        with self._failed_lock:
            failed, self._failed_reported = self._failed_reported, set()
        return failed

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs no longer read their KV-cache blocks."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                job.released.wait()

    def shutdown(self) -> None:
        """Finish stores already scheduled (bounded by ``shutdown_timeout_s``), then stop."""
        if self._closed:
            return
        self._closed = True
        pending = [j.future for j in list(self._jobs.values()) if j.is_store and j.future]
        if pending:
            done, not_done = wait(pending, timeout=self._shutdown_timeout_s)
            logger.info(
                "hma_redis: flushed %d pending store job(s) at shutdown (%d abandoned)",
                len(done),
                len(not_done),
            )
        self._stores.shutdown(wait=False, cancel_futures=True)
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._store.flush_counters()
        # The Redis stats hash is best effort (an allkeys-* policy may evict it); this line is not.
        logger.info(
            "hma_redis: worker rank %d totals %s",
            self._rank,
            json.dumps(dict(self._store.counters.totals), sort_keys=True),
        )

    # ------------------------------------------------------------------ planning

    def _plan(self, keys: Sequence[bytes], spec: GPULoadStoreSpec) -> list[ChunkTransfer] | None:
        """Pair each offload key with its blocks. None if the spec does not add up."""
        by_group: dict[int, list[bytes]] = {}
        for key in keys:
            by_group.setdefault(get_offload_group_idx(OffloadKey(key)), []).append(key)
        bpc = self._blocks_per_chunk
        block_ids = spec.block_ids.tolist()
        plan: list[ChunkTransfer] = []
        offset = 0
        for pos, (size, first_index) in enumerate(
            zip(spec.group_sizes, spec.block_indices, strict=True)
        ):
            group_blocks = block_ids[offset : offset + size]
            offset += size
            group_id = next(g for g, p in self._group_pos.items() if p == pos)
            group_keys = by_group.pop(group_id, [])
            start = first_index % bpc
            taken = 0
            for key in group_keys:
                count = min(bpc - start, size - taken)
                if count <= 0:
                    return None
                plan.append(
                    ChunkTransfer(
                        redis_key=self._keyspace.block_key(
                            group_id, get_offload_block_hash(OffloadKey(key)), self._rank
                        ),
                        group=group_id,
                        group_pos=pos,
                        start=start,
                        block_ids=tuple(group_blocks[taken : taken + count]),
                    )
                )
                taken += count
                start = 0
            if taken != size:
                return None
        if by_group:
            return None
        return plan

    # ------------------------------------------------------------------ stores

    def _run_store(self, job: _Job, src: GPULoadStoreSpec, dst: RedisLoadStoreSpec) -> None:
        started = time.perf_counter()
        stored_bytes = 0
        try:
            plan = self._plan(dst.keys, src)
            if plan is None:
                logger.error("hma_redis: store job %d has an inconsistent block layout", job.job_id)
                return
            # Another instance may have stored some chunks already: skip them (one round trip).
            present = self._store.exists([c.redis_key for c in plan])
            self._store.counters.add(store_skipped_chunks=sum(present))
            plan = [c for c, there in zip(plan, present, strict=True) if not there]
            batch = _PUT_BATCH_IN_PLACE if self._in_place else _PUT_BATCH
            for start in range(0, len(plan), batch):
                stored_bytes += self._store_batch(plan[start : start + batch])
        except Exception:
            logger.exception(
                "hma_redis: store job %d failed; its chunks are not stored", job.job_id
            )
        finally:
            job.released.set()
            self._jobs.pop(job.job_id, None)
            self._finished.put(
                TransferResult(job.job_id, True, stored_bytes, time.perf_counter() - started)
            )

    def _store_batch(self, chunks: list[ChunkTransfer]) -> int:
        headers = [self._header(c) for c in chunks]
        if self._in_place:
            # The checksum is computed over the pages in place and the kernel copies them from
            # there to the socket: no gather, no buffer (the job holds its blocks until sent).
            # Each value is built as it is sent, while Redis reads the one before.
            def parts(idx: int) -> list[memoryview]:
                return codec.encode_parts(headers[idx], self._pages_in_place(chunks[idx]))

            keys = [c.redis_key for c in chunks]
            results = self._store.put_parts_if_absent(keys, parts)
            return self._count_stored([codec.value_size(h) for h in headers], results)
        sizes = [codec.value_size(h) for h in headers]
        self._budget.acquire(sum(sizes))
        try:
            items: list[tuple[str, memoryview]] = []
            for chunk, header, size in zip(chunks, headers, sizes, strict=True):
                encoded = codec.start_encode(header, self._buffers.take(size))
                items.append((chunk.redis_key, encoded.buffer))
                self._gather(chunk, encoded.body)
                encoded.seal()
            results = self._store.put_if_absent(items)
        finally:
            self._buffers.give(buf for _, buf in items)
            self._budget.release(sum(sizes))
        return self._count_stored(sizes, results)

    def _count_stored(self, sizes: Sequence[int], results: list[PutResult]) -> int:
        """Count a batch's outcome; return the bytes stored."""
        stored = sum(size for size, r in zip(sizes, results, strict=True) if r is PutResult.STORED)
        self._store.counters.add(
            stored_chunks=results.count(PutResult.STORED),
            stored_bytes=stored,
            store_skipped_chunks=results.count(PutResult.EXISTED),
            store_failed_chunks=results.count(PutResult.FAILED),
        )
        return stored

    def _header(self, chunk: ChunkTransfer) -> BlockHeader:
        return BlockHeader(
            key=chunk.redis_key,
            group=chunk.group,
            first_block=chunk.start,
            num_blocks=len(chunk.block_ids),
            page_bytes=self._pages[chunk.group_pos],
            kv_dtype=self._kv_dtype,
        )

    def _pages_in_place(self, chunk: ChunkTransfer) -> list[memoryview]:
        """The chunk's pages of every layer (layer-major), as views of the CPU KV cache."""
        runs = _block_runs(chunk.block_ids)
        views: list[memoryview] = []
        for layer in self._layers[chunk.group_pos]:
            assert layer.host is not None
            views += [layer.host[src : src + nbytes] for _, src, nbytes in _spans(layer, runs)]
        return views

    def _gather(self, chunk: ChunkTransfer, body: memoryview) -> None:
        """Copy the chunk's pages of every layer into ``body`` (layer-major)."""
        runs = _block_runs(chunk.block_ids)
        offset = 0
        for layer in self._layers[chunk.group_pos]:
            nbytes = len(chunk.block_ids) * layer.page_bytes
            if layer.host is not None:
                _copy_pages(layer, runs, body[offset : offset + nbytes], to_cache=False)
            else:
                ids = torch.tensor(chunk.block_ids, dtype=torch.long, device=layer.tensor.device)
                dst = torch.frombuffer(body[offset : offset + nbytes], dtype=torch.int8)
                src = layer.tensor[:, : layer.page_bytes].index_select(0, ids)
                dst.view(len(chunk.block_ids), layer.page_bytes).copy_(src)
            offset += nbytes

    # ------------------------------------------------------------------ loads

    def _run_load(self, job: _Job, src: RedisLoadStoreSpec, dst: GPULoadStoreSpec) -> None:
        started = time.perf_counter()
        loaded = 0
        success = False
        try:
            plan = self._plan(src.keys, dst)
            if plan is None:
                logger.error("hma_redis: load job %d has an inconsistent block layout", job.job_id)
            else:
                loaded = self._load_chunks(plan, job)
                success = True
        except CorruptBlockError as exc:
            logger.warning(
                "hma_redis: load job %d: %s; its tokens will be recomputed", job.job_id, exc
            )
        except Exception:
            logger.exception(
                "hma_redis: load job %d failed; its tokens will be recomputed", job.job_id
            )
        finally:
            job.released.set()
            self._jobs.pop(job.job_id, None)
            if not success:
                self._store.counters.add(
                    load_failed_jobs=1, load_failed_chunks=len(src.keys) - job.chunks_loaded
                )
                with self._failed_lock:
                    self._failed_loads.add(job.job_id)
            self._finished.put(
                TransferResult(job.job_id, True, loaded, time.perf_counter() - started)
            )

    def _load_chunks(self, plan: list[ChunkTransfer], job: _Job) -> int:
        """Fetch and validate every chunk, then copy them into the KV cache.

        Each value is validated as it arrives, while Redis sends the next (CRC32C of a value
        still in the CPU cache, in time the job would otherwise spend waiting for Redis).
        Nothing is copied unless every chunk is valid (the request is recomputed whole anyway).
        Invalid values are deleted: SET NX would never replace them, so the recompute's store
        could not heal them otherwise.
        """
        if self._test_load_delay_s:
            time.sleep(self._test_load_delay_s)
        blocks: dict[int, DecodedBlock] = {}
        invalid: dict[str, CorruptBlockError] = {}

        def check(idx: int, value: memoryview) -> None:
            try:
                blocks[idx] = self._validate(plan[idx], value)
            except CorruptBlockError as exc:
                invalid[plan[idx].redis_key] = exc

        values = self._store.get_into([c.redis_key for c in plan], self._buffers.take, check)
        total = sum(len(v) for v in values if v is not None)
        self._budget.acquire(total)
        try:
            missing = [c.redis_key for c, v in zip(plan, values, strict=True) if v is None]
            valid = [(chunk, blocks[idx]) for idx, chunk in enumerate(plan) if idx in blocks]
            if invalid:
                self._store.delete(list(invalid))
            if missing or invalid:
                first = next(iter(invalid.values()), None)
                raise CorruptBlockError(
                    f"{len(missing)} chunk(s) missing, {len(invalid)} invalid"
                    + (f" (first: {first})" if first else "")
                )
            for chunk, block in valid:
                self._scatter(chunk, block)
                job.chunks_loaded += 1
        finally:
            self._buffers.give(values)
            self._budget.release(total)
        self._store.counters.add(loaded_chunks=len(plan), loaded_bytes=total)
        return total

    def _validate(self, chunk: ChunkTransfer, value: memoryview) -> DecodedBlock:
        block = codec.decode(value, expected_key=chunk.redis_key, expected_group=chunk.group)
        header = block.header
        if header.page_bytes != self._pages[chunk.group_pos]:
            raise CorruptBlockError(f"{chunk.redis_key} has another page layout")
        skip = chunk.start - header.first_block
        if skip < 0 or skip + len(chunk.block_ids) > header.num_blocks:
            raise CorruptBlockError(f"{chunk.redis_key} does not hold the blocks needed")
        return block

    def _scatter(self, chunk: ChunkTransfer, block: DecodedBlock) -> None:
        header = block.header
        skip = chunk.start - header.first_block
        count = len(chunk.block_ids)
        runs = _block_runs(chunk.block_ids)
        for idx, layer in enumerate(self._layers[chunk.group_pos]):
            page = layer.page_bytes
            src = block.layer(idx)[skip * page : (skip + count) * page]
            if layer.host is not None:
                _copy_pages(layer, runs, src, to_cache=True)
                continue
            ids = torch.tensor(chunk.block_ids, dtype=torch.long, device=layer.tensor.device)
            pages = torch.frombuffer(src, dtype=torch.int8).view(count, page)
            layer.tensor[:, :page].index_copy_(0, ids, pages.to(layer.tensor.device))
        if layer_device(self._layers[chunk.group_pos]) == "cuda":
            torch.cuda.current_stream().synchronize()


def layer_device(layers: Sequence[LayerSource]) -> str:
    return layers[0].tensor.device.type if layers else "cpu"


def _block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in ``block_ids``, first block id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for pos in range(1, len(block_ids) + 1):
        if pos == len(block_ids) or block_ids[pos] != block_ids[pos - 1] + 1:
            runs.append((start, block_ids[start], pos - start))
            start = pos
    return runs


def _copy_pages(
    layer: LayerSource, runs: Sequence[tuple[int, int, int]], pages: memoryview, to_cache: bool
) -> None:
    """Copy between ``pages`` (back to back) and the layer's CPU memory at the runs' block ids."""
    host = layer.host
    assert host is not None
    for at, src, nbytes in _spans(layer, runs):
        if to_cache:
            host[src : src + nbytes] = pages[at : at + nbytes]
        else:
            pages[at : at + nbytes] = host[src : src + nbytes]


def _spans(layer: LayerSource, runs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(offset in the pages back to back, offset in the layer's memory, bytes) to copy: one
    span per run of consecutive blocks where rows are unpadded, else one per page."""
    page, row = layer.page_bytes, layer.row_bytes
    if row == page:
        return [(pos * page, first * row, count * page) for pos, first, count in runs]
    return [
        ((pos + i) * page, (first + i) * row, page)
        for pos, first, count in runs
        for i in range(count)
    ]
