"""The transfer engine: moves KV chunks between page tensors (CPU or CUDA) and Redis.

Engine-agnostic (no vLLM): the caller names, for every chunk of a job, its Redis key and the
block ids of the page tensors it covers (:class:`ChunkTransfer`); the engine runs the job on
its own threads and reports it through :meth:`TransferEngine.finished`.

A chunk value holds, for every layer of its KV group, the pages of the chunk's blocks
(``blocks_per_chunk`` blocks, fewer for a sliding-window chunk whose oldest blocks had already
left the window). Stores send the pages from a CPU KV cache in place (or gather them from a GPU
into pooled, pinned buffers), encode and put them with SET NX; loads get, validate and scatter
into the given block ids. Bytes held in buffers are bounded (:class:`ByteBudget`); on CUDA
every transfer is ordered after the work the caller queued before submitting it.

One flow moves the bytes: a job's chunks are split over ``connections_per_job`` parts, each
part on a thread of its own and in one call of the medium
(:meth:`BlockStore.load_values <hma_redis.core.medium.BlockStore.load_values>` /
``put_values``: the engine sees the medium only through :mod:`hma_redis.core.medium`). For
Redis (:class:`hma_redis.core.redis.store.RedisBlockStore`, on a Cluster each part sends every node
its own keys on connections to that node; the call spreads its values over
``connections_per_thread`` connections, see :func:`hma_redis.core.redis.wire.job_connections`)
that call runs the C job
(sockets, RESP parsing and CRC32C with the GIL released) where the extension is built and the
connection is plain TCP or a unix socket, and its byte-identical pure-Python twin otherwise
(TLS, ``HMA_REDIS_NATIVE=0``, no extension); one INFO line at start-up says which. The C job
receives a load's values straight into the KV cache's pages when it is host memory and values
are not sealed (else, and always on the twin, into pooled buffers, copied once valid); a value
that is not exactly what this engine would have written for its chunk lands whole in a
staging buffer and is judged by ``codec.decode``. A store sends the pages in place (CPU) or
from pooled buffers (other devices).

A load reports success only once every value was checked: checksum, prefix (magic, version,
flags), header (key echo, group, dtype, layout, page sizes, blocks) and length, and the MAC
with an ``auth_key``. In place, pages may land before their value's checksum and MAC are
known; a job with any bad or missing value fails, and every page it may have written is zeroed
before its failure is reported: no page the engine may read ever holds bytes that failed
validation (vLLM frees a failed load's blocks without rewriting them, and reuses them).

    engine = TransferEngine(store, [[LayerSource.of(t, page_bytes) for t in tensors]],
                            ValueFormat(kv_dtype="float16"), blocks_per_chunk=16)
    engine.submit_store(1, [ChunkTransfer(key, group=0, group_pos=0, start=0, block_ids=ids)])
    engine.wait({1})                 # the job no longer reads the page tensors
    results = engine.finished()      # [JobResult(job_id=1, ...)] once it is done
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import TypeVar

import torch

from hma_redis.core import codec
from hma_redis.core.codec import BlockHeader, CorruptBlockError, DecodedBlock, ForeignKeyError
from hma_redis.core.latency import Operation
from hma_redis.core.medium import (
    BlockStore,
    Landed,
    LoadResult,
    LoadStatus,
    LoadTarget,
    Pages,
    PutResult,
    body_bytes,
    body_pieces,
)
from hma_redis.core.sealing import Keyring, NonceSource
from hma_redis.core.transfer.buffers import BufferPool, ByteBudget, TransferStreams
from hma_redis.core.transfer.jobs import (
    ChunkTransfer,
    ExpectedValue,
    Job,
    JobChunks,
    JobResult,
    LayoutMismatch,
    Received,
    ValueFormat,
    chunk_count,
    describe_failures,
    split_parts,
)
from hma_redis.core.transfer.pages import (
    LayerSource,
    blocks_held,
    copy_pages,
    layer_device,
    page_layout,
    positioned_runs,
)

logger = logging.getLogger(__name__)

# Loads wrap immutable reply bytes in tensors that are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

# Fault-injection hook for tests: seconds to sleep before each load's GET, so a test can break
# Redis between the scheduler's lookup and the load's GET. Never set in production.
TEST_LOAD_DELAY_ENV = "HMA_REDIS_TEST_LOAD_DELAY_S"

# Values per put: large enough to amortize the round trip, small enough to bound memory.
_PUT_BATCH = 16
# The same when values are sent from the KV cache in place (no memory to bound).
_PUT_BATCH_IN_PLACE = 64
# The medium's counters ride along on its own calls (Redis: lookups and existence checks,
# never ahead of a load's GETs); an engine whose jobs make none of them (one that only loads)
# has them delivered on a store thread at most this often.
COUNTERS_EVERY_S = 1.0
# Room in a value's bound for header fields whose msgpack width varies with their value.
_HEADER_SLACK = 64
# The codec's prefix (hma_redis.core.codec): magic, version, flags, header length (the fields
# its MAC covers), then CRC32C at 12 and the MAC at 16. Stores fill every field but the
# CRC, which the store job computes as it sends; loads compare the first 12 bytes.
_T = TypeVar("_T")


class TransferEngine:
    """Asynchronous store and load of chunks between a set of page tensors and a medium
    (``store``: Redis' :class:`~hma_redis.core.redis.store.RedisBlockStore`, or any
    :class:`~hma_redis.core.medium.BlockStore`).

    ``groups[pos]`` are the layers of the KV group at position ``pos`` (a chunk's
    ``group_pos``), each a ``(num_blocks, padded_page)`` int8 view (:meth:`LayerSource.of`), all
    on one device. ``blocks_per_chunk`` is the most blocks one value holds (it bounds what a
    load accepts). Loads run on ``io_threads`` threads, stores on half as many; the bytes the
    jobs hold in buffers stay under ``max_inflight_bytes`` (a larger job runs alone).

    ``partial_loads``: a load whose chunks are partly missing or invalid still lands its valid
    chunks and reports the others in :attr:`JobResult.failed_chunks` (each chunk is used on its
    own, as by a secondary tier); without it such a load lands nothing.

    ``connections_per_job`` splits each job's chunks over that many parts, each on its own
    thread and in one value call of the medium. Which data path those calls take is the
    medium's, chosen when it was built (:meth:`BlockStore.describe`).

    ``counters_every_s``: after a job, the medium's pending counters are delivered
    (:meth:`BlockStore.flush`) on a store thread when that long has passed since the last
    time, so they reach the medium without a round trip ahead of any load.

    Thread safety: ``submit_*``, :meth:`finished`, :meth:`wait` and :meth:`shutdown` are
    called from one thread (the caller's step loop); the jobs run on the engine's threads.
    """

    def __init__(
        self,
        store: BlockStore,
        groups: Sequence[Sequence[LayerSource]],
        value_format: ValueFormat,
        *,
        blocks_per_chunk: int,
        io_threads: int = 4,
        max_inflight_bytes: int = 256 * 1024 * 1024,
        shutdown_timeout_s: float = 10.0,
        connections_per_job: int = 1,
        partial_loads: bool = False,
        counters_every_s: float = COUNTERS_EVERY_S,
    ) -> None:
        self._store = store
        self._partial_loads = partial_loads
        self._blocks_per_chunk = blocks_per_chunk
        self._format = value_format
        # With a shared secret every value is MAC'd, and only values MAC'd with it are read.
        key = value_format.auth_key
        self._mac_key = codec.MacKey.derive(key) if key is not None else None
        # With an encryption key every value's body is sealed (the tag replaces the MAC).
        self._keyring: Keyring | None = None
        if value_format.encryption_key is not None:
            self._keyring = Keyring.from_secrets(
                value_format.encryption_key, value_format.encryption_key_previous
            )
        self._nonces = NonceSource()
        self._shutdown_timeout_s = shutdown_timeout_s
        self._layers: list[list[LayerSource]] = [list(group) for group in groups]
        self._pages = [tuple(layer.page_bytes for layer in group) for group in self._layers]
        self._bounds: dict[tuple[int, int, int], int] = {}  # _value_bound's, by chunk shape
        self._templates: dict[tuple[int, int, int, int], codec.HeaderTemplate] = {}  # _expected's
        self._signed: dict[int, bytes] = {}  # _expected's prefix fields, by header length
        self._budget = ByteBudget(max_inflight_bytes)
        pinned = any(layer_device(group) == "cuda" for group in self._layers)
        first = next((layer for group in self._layers for layer in group), None)
        self._streams = TransferStreams(
            first.tensor.device if first is not None else torch.device("cpu")
        )
        # A CPU KV cache is sent to Redis from where it is; other devices go through buffers.
        self._in_place = all(layer.host is not None for group in self._layers for layer in group)
        # Its pages by group, described (one Pages per chunk, cut by the data path), and
        # the number of blocks whose pages every layer of the group holds.
        self._page_layouts = (
            [page_layout(group) for group in self._layers] if self._in_place else []
        )
        self._page_blocks = [blocks_held(group) for group in self._layers] if self._in_place else []
        self._buffers = BufferPool(max_inflight_bytes // 4, pinned)
        self._loads = ThreadPoolExecutor(
            io_threads, thread_name_prefix="hma-load", initializer=self._streams.init_thread
        )
        store_threads = max(1, io_threads // 2)
        self._stores = ThreadPoolExecutor(
            store_threads,
            thread_name_prefix="hma-store",
            initializer=self._streams.init_thread,
        )
        # Loads land in the KV cache's pages only where it is host memory, values are not
        # sealed (a sealed body is decrypted in its buffer: its tag is checked before any byte
        # reaches a page) and the medium says its data path should (Redis: the C job; its
        # twin receives into buffers and the engine copies once every value is valid, so on
        # the fallback no page ever holds a byte of a load that fails; the cost, one copy, is
        # small beside the twin's own work). A keyed value's MAC is checked over the pages
        # it landed in, as its checksum is: a value that fails either fails its load, whose
        # pages are zeroed before the failure is reported (_clear_pages_of_failed_load).
        # Stores send a CPU KV cache's pages in place unless values are sealed (they are
        # sealed into buffers: the ciphertext must not overwrite the pages).
        self._sends_in_place = self._in_place and self._keyring is None
        self._land_in_place = store.lands_in_place and self._in_place and self._keyring is None
        self._connections = max(1, connections_per_job)
        # Threads that run the other connections' parts of a job (its own thread runs one).
        self._parts: ThreadPoolExecutor | None = None
        if self._connections > 1:
            self._parts = ThreadPoolExecutor(
                (self._connections - 1) * (io_threads + store_threads),
                thread_name_prefix="hma-conn",
            )
        self.data_path = self._describe_path()
        store.announce(f"hma_redis: transfer data path: {self.data_path}")
        self._jobs: dict[int, Job] = {}
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        # Set when a job finishes, cleared by finished(): what wait_for_finish waits on.
        self._job_done = threading.Event()
        self._loads_running = 0
        self._loads_lock = threading.Lock()
        self._closed = False
        self._counters_every_s = counters_every_s
        self._counters_sent_at = time.monotonic()
        self._counters_lock = threading.Lock()
        # The last delivery handed to a store thread: shutdown waits for it before the store
        # closes its connections (else its read meets a closed socket).
        self._counters_future: Future[None] | None = None
        self._test_load_delay_s = float(os.environ.get(TEST_LOAD_DELAY_ENV, "0") or 0)
        # The first job's connections, opened now on a load thread: a fresh engine's first
        # load would otherwise open them itself (in_engine_timeline.py: ~1 ms).
        self._loads.submit(store.warm_up, self._connections)

    # ------------------------------------------------------------------ API

    def submit_store(
        self,
        job_id: int,
        chunks: JobChunks,
        known_absent: Collection[str] = (),
        owner: str | None = None,
    ) -> None:
        """Queue a store; returns at once. The job reads the page tensors in a background
        thread (:meth:`wait` blocks until it has), then encodes and puts the chunks. Chunks
        Redis holds already are skipped (one EXISTS round trip, not taken for the Redis keys
        in ``known_absent``, which the caller has just seen missing: ``SET NX`` leaves any
        value stored in between as it is). With ``owner`` (a tenant id), the chunks this job
        writes are counted against it (:meth:`~hma_redis.core.medium.BlockStore.account_stored`)
        once its puts are done."""
        job = Job(job_id, is_store=True, ready=self._streams.mark_submit(), owner=owner)
        self._jobs[job_id] = job
        try:
            job.future = self._stores.submit(self._run_store, job, chunks, known_absent)
        except RuntimeError:
            # Interpreter exit: thread pools take no new work, so store in this thread.
            self._run_store(job, chunks, known_absent)

    def submit_load(self, job_id: int, chunks: JobChunks) -> None:
        """Queue a load; returns at once. The chunks' blocks are written only if every chunk
        is present and valid (else none is, and the result says ``ok=False``)."""
        job = Job(job_id, is_store=False, ready=self._streams.mark_submit())
        self._jobs[job_id] = job
        with self._loads_lock:
            self._loads_running += 1
        job.future = self._loads.submit(self._run_load, job, chunks)

    def finished(self) -> list[JobResult]:
        """Jobs finished since the last call, each reported once."""
        self._job_done.clear()
        results: list[JobResult] = []
        while True:
            try:
                results.append(self._finished.get_nowait())
            except queue.Empty:
                return results

    def wait_for_finish(
        self,
        timeout_s: float,
        stores_too: bool = False,
        until: Callable[[], bool] | None = None,
        check_s: float = 0.001,
    ) -> bool:
        """Block up to ``timeout_s`` while a load job runs (with ``stores_too``, any job) and
        no job has finished since the last :meth:`finished` call; return at once otherwise.
        For a caller with nothing else to do (an engine step that computes nothing; with
        ``stores_too`` a benchmark waiting on its own jobs, as LMCache's peers wait on their
        completion events): it sleeps instead of polling, and wakes the moment a job is done.
        With ``until``, also returns once ``until()`` is true, asked every ``check_s`` (an
        engine step whose caller may have new work meanwhile).
        Whether a finished job is waiting to be collected."""
        running = self._jobs if stores_too else self._loads_running
        if timeout_s <= 0 or not running or self._job_done.is_set():
            return self._job_done.is_set()
        if until is None:
            return self._job_done.wait(timeout_s)
        end = time.monotonic() + timeout_s
        while not until():
            left = end - time.monotonic()
            if left <= 0 or self._job_done.wait(min(check_s, left)):
                break
        return self._job_done.is_set()

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs no longer read their blocks (stores) or are completely
        done (loads). Unknown or finished jobs return at once.

        Bounded whatever Redis does: every Redis operation of a job ends by the job's deadline,
        :func:`~hma_redis.core.deadline.budget_s` of its bytes over two round trips counted
        from its submission (3 x ``read_timeout_s`` + its bytes at 16 MiB/s), so a job waited
        on is done by then plus its own CPU work (checksums, copies)."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                job.released.wait()

    @property
    def loads_land_in_place(self) -> bool:
        """Whether loads receive values straight into the KV cache's pages (the C job, CPU KV
        cache, values not sealed): a failed load may then have written its own blocks."""
        return self._land_in_place

    @property
    def peak_budget_bytes(self) -> int:
        """The most bytes of ``max_inflight_bytes`` jobs have held at once (a load takes its
        values' bound before it receives anything, whether or not it uses buffers)."""
        return self._budget.peak

    @property
    def peak_buffer_bytes(self) -> int:
        """The most bytes this engine's transfers have held in value buffers at once (bounded
        by ``max_inflight_bytes``, unless a single job is larger and ran alone)."""
        return self._buffers.peak_bytes

    def memory(self, max_inflight_bytes: int) -> dict[str, int]:
        """The most bytes transfers held at once (of the in-flight budget, and in value
        buffers) next to their bound: what the worker and the secondary tier log at shutdown."""
        return {
            "peak_budget_bytes": self.peak_budget_bytes,
            "peak_buffer_bytes": self.peak_buffer_bytes,
            "max_inflight_bytes": max_inflight_bytes,
        }

    def shutdown(self) -> None:
        """Finish stores already submitted (bounded by ``shutdown_timeout_s``), stop the
        threads and deliver the medium's pending counters. Idempotent."""
        with self._counters_lock:  # no counters delivery is handed over after this
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
        with self._counters_lock:
            delivery = self._counters_future
        if delivery is not None:
            wait([delivery], timeout=self._shutdown_timeout_s)
        self._stores.shutdown(wait=False, cancel_futures=True)
        self._loads.shutdown(wait=False, cancel_futures=True)
        if self._parts is not None:
            self._parts.shutdown(wait=False)
        self._store.flush()

    def _describe_path(self) -> str:
        where = (
            "loads land in the KV cache's pages"
            if self._land_in_place
            else "loads received into buffers, copied once valid"
        )
        sealed = "; values sealed (AES-256-GCM)" if self._keyring is not None else ""
        return f"{self._store.describe()}; {where}{sealed}; {self._connections} thread(s) per job"

    def _deliver_counters_when_due(self) -> None:
        """After a job: hand the medium's pending counters to a store thread when
        ``counters_every_s`` has passed since the last time (never on a load's way)."""
        now = time.monotonic()
        with self._counters_lock:
            if self._closed or now - self._counters_sent_at < self._counters_every_s:
                return
            self._counters_sent_at = now
            with contextlib.suppress(RuntimeError):  # shut down meanwhile: shutdown() flushes
                self._counters_future = self._stores.submit(self._store.flush)

    def _in_parts(
        self, sizes: Sequence[int], run: Callable[[slice], list[_T] | None]
    ) -> list[_T] | None:
        """``run`` over the job's items cut into at most ``connections_per_job`` consecutive
        slices of about equal ``sizes``, each on its own connection and thread (this thread
        runs the first); the results in item order, None if any part gave None. Returns (or
        raises the first part's exception) only once every part has finished, so no part is
        still writing into the job's pages. The parts are calls of the job's
        :class:`~hma_redis.core.medium.MediumJob`: the job fails as a whole if one part meets
        an outage, and another part's success does not close the breaker behind it."""
        cuts = split_parts(sizes, self._connections)
        if len(cuts) == 1 or self._parts is None:
            return run(cuts[0])
        others = [self._parts.submit(run, cut) for cut in cuts[1:]]
        try:
            first = run(cuts[0])
        finally:
            wait(others)
        parts = [first, *(future.result() for future in others)]
        out: list[_T] = []
        for part in parts:
            if part is None:
                return None
            out += part
        return out

    # ------------------------------------------------------------------ stores

    def _run_store(self, job: Job, chunks: JobChunks, known_absent: Collection[str] = ()) -> None:
        """Store a job's chunks. Every chunk is counted once: stored, skipped (present) or
        failed; chunks of a job that stops early (bad layout, an error) count as failed."""
        started = time.perf_counter()
        stored_bytes = 0
        num_chunks = chunk_count(chunks)
        try:
            if isinstance(chunks, LayoutMismatch):
                logger.error("hma_redis: store job %d has an inconsistent block layout", job.job_id)
                return
            self._start_clock(job, sum(self._value_bound(chunk) for chunk in chunks))
            plan = self._not_present(job, chunks, known_absent)
            batch = _PUT_BATCH_IN_PLACE if self._sends_in_place else _PUT_BATCH
            for start in range(0, len(plan), batch):
                stored_bytes += self._store_batch(job, plan[start : start + batch])
            if job.owner is not None and job.stored_keys:
                self._store.account_stored(job.owner, job.stored_keys, job.stored_sizes)
        except Exception:
            logger.exception(
                "hma_redis: store job %d failed; its chunks are not stored", job.job_id
            )
        finally:
            job.settle()
            self._store.counters.add(store_failed_chunks=num_chunks - job.chunks_counted)
            job.released.set()
            self._jobs.pop(job.job_id, None)
            elapsed = time.perf_counter() - started
            self._finished.put(JobResult(job.job_id, True, True, stored_bytes, elapsed))
            self._job_done.set()
            self._deliver_counters_when_due()

    def _not_present(
        self, job: Job, chunks: Sequence[ChunkTransfer], known_absent: Collection[str]
    ) -> list[ChunkTransfer]:
        """The chunks to send: another instance may have stored some already, so the ones
        not known absent are asked about (one EXISTS round trip, none if all are known)."""
        ask = [c for c in chunks if c.redis_key not in known_absent]
        if not ask:
            return list(chunks)
        present = self._store.exists([c.redis_key for c in ask], job.deadline, Operation.STORE)
        self._store.counters.add(store_existed_chunks=sum(present))
        job.chunks_counted += sum(present)
        there = {c.redis_key for c, p in zip(ask, present, strict=True) if p}
        return [c for c in chunks if c.redis_key not in there]

    def _start_clock(self, job: Job, nbytes: int, paused_s: float = 0.0) -> None:
        """Start the job's calls on the medium: their deadline is the medium's bound on two
        round trips moving ``nbytes``, from the job's submission (plus ``paused_s``: the test
        hook's pause before a load, which is not the job's)."""
        job.medium = self._store.start_job(nbytes, job.submitted + paused_s)

    def _store_batch(self, job: Job, chunks: list[ChunkTransfer]) -> int:
        """Put a batch: every value's head (prefix and header, MAC with an auth_key, the
        CRC32C left to the store job) and body, sent in place over ``connections_per_job``
        connections. A CPU KV cache's pages are sent in place (the job
        holds its blocks until sent); other devices' are gathered into pooled buffers first."""
        layouts = [self._expected(chunk) for chunk in chunks]
        sizes = [layout.value_bytes for layout in layouts]
        keys = [chunk.redis_key for chunk in chunks]
        if self._sends_in_place:
            pages = [self._pages_of(chunk) for chunk in chunks]
            heads = [self._value_head(lay, body) for lay, body in zip(layouts, pages, strict=True)]
            results = self._put_in_parts(job, sizes, keys, heads, pages)
            return self._count_stored(job, keys, sizes, results)
        self._budget.acquire(sum(sizes), load=False)
        taken = [self._buffers.take(size) for size in sizes]
        try:
            views = [
                (buf[: lay.head_bytes], buf[lay.head_bytes :])
                for buf, lay in zip(taken, layouts, strict=True)
            ]
            # Every page is in its buffer when this block ends (CUDA: its copies completed).
            # A CPU KV cache's pages are sealed straight into the buffers instead.
            if not self._in_place:
                with self._streams.ordered(job.ready):
                    for chunk, (_, body) in zip(chunks, views, strict=True):
                        self._gather(chunk, body)
            for chunk, layout, (head, body) in zip(chunks, layouts, views, strict=True):
                if self._keyring is None:
                    head[:] = self._value_head(layout, [body])
                else:
                    head[:] = self._sealed_head(chunk, layout, body)
            results = self._put_in_parts(
                job, sizes, keys, [head for head, _ in views], [[body] for _, body in views]
            )
        finally:
            self._buffers.give(taken)
            self._budget.release(sum(sizes))
        return self._count_stored(job, keys, sizes, results)

    def _put_in_parts(
        self,
        job: Job,
        sizes: Sequence[int],
        keys: Sequence[str],
        heads: Sequence[memoryview | bytearray],
        bodies: Sequence[Sequence[memoryview] | Pages],
    ) -> list[PutResult]:
        def put(part: slice) -> list[PutResult]:
            return self._store.put_values(keys[part], heads[part], bodies[part], job.medium)

        results = self._in_parts(sizes, put)
        assert results is not None  # a put degrades to FAILED, never to None
        return results

    def _expected(self, chunk: ChunkTransfer) -> ExpectedValue:
        """The value this engine writes for ``chunk``, up to its CRC32C: its header's bytes
        from a template per chunk shape (:class:`~hma_redis.core.codec.HeaderTemplate`; at most
        groups x blocks_per_chunk^2 shapes), the prefix's signed fields per header length."""
        shape = (chunk.group_pos, chunk.group, chunk.start, len(chunk.block_ids))
        template = self._templates.get(shape)
        if template is None:
            template = codec.HeaderTemplate(self._header(replace(chunk, redis_key="")))
            self._templates[shape] = template
        packed = template.pack(chunk.redis_key)
        signed = self._signed.get(len(packed))
        if signed is None:
            sealed = self._keyring is not None
            signed = codec.signed_prefix(len(packed), self._mac_key, sealed=sealed)
            self._signed[len(packed)] = signed
        return ExpectedValue(template.header, chunk.redis_key, packed, signed)

    def _value_head(self, layout: ExpectedValue, body: Sequence[memoryview] | Pages) -> bytearray:
        """A value's prefix and header, every field but the CRC32C (zero: the store job
        writes it): magic, version, flags, header length, and with an auth_key the MAC over
        ``body`` (the value's body pieces in order), header and those fields, as the codec
        computes it. ValueError if the body's size is not the header's, so such a value is
        never sent."""
        size = body_bytes(body)
        if size != layout.shape.body_bytes:
            raise ValueError(
                f"body pieces hold {size} bytes, the header says {layout.shape.body_bytes}"
            )
        mac = None
        if self._mac_key is not None:
            mac = codec.value_mac(self._mac_key, body_pieces(body), layout.packed, layout.signed)
        return codec.head_without_crc(layout.signed, layout.packed, mac)

    def _sealed_head(self, chunk: ChunkTransfer, layout: ExpectedValue, body: memoryview) -> bytes:
        """Seal a chunk's body into ``body`` (its value's body in a buffer) with the write key
        and a fresh nonce: from the CPU KV cache's pages, else in place (gathered there
        already). The value's prefix and header, the CRC32C left to the store job."""
        assert self._keyring is not None
        pieces = self._pages_of(chunk).views() if self._in_place else [body]
        head = codec.seal_head(
            layout.signed,
            layout.packed,
            chunk.redis_key,
            self._keyring.write,
            self._nonces.next(),
            pieces,
            body,
        )
        return bytes(head)

    def _count_stored(
        self, job: Job, keys: Sequence[str], sizes: Sequence[int], results: list[PutResult]
    ) -> int:
        """Count a batch's outcome (with an owner, note the chunks written for its account);
        return the bytes stored."""
        stored = sum(size for size, r in zip(sizes, results, strict=True) if r is PutResult.STORED)
        if job.owner is not None:
            for key, size, result in zip(keys, sizes, results, strict=True):
                if result is PutResult.STORED:
                    job.stored_keys.append(key)
                    job.stored_sizes.append(size)
        self._store.counters.add(
            stored_chunks=results.count(PutResult.STORED),
            stored_bytes=stored,
            store_existed_chunks=results.count(PutResult.EXISTED),
            store_failed_chunks=results.count(PutResult.FAILED),
        )
        job.chunks_counted += len(results)
        return stored

    def _header(self, chunk: ChunkTransfer) -> BlockHeader:
        return BlockHeader(
            key=chunk.redis_key,
            group=chunk.group,
            first_block=chunk.start,
            num_blocks=len(chunk.block_ids),
            page_bytes=self._pages[chunk.group_pos],
            kv_dtype=self._format.kv_dtype,
            kv_cache_layout=self._format.kv_cache_layout,
            key_id=self._keyring.write.key_id if self._keyring is not None else "",
        )

    def _pages_of(self, chunk: ChunkTransfer) -> Pages:
        """The chunk's pages of every layer (layer-major) in the CPU KV cache, described:
        the data path cuts them (:class:`Pages`), so a job builds no view per page.
        ValueError for a block id outside the KV cache, before any byte moves."""
        ids = chunk.block_ids
        if ids and (min(ids) < 0 or max(ids) >= self._page_blocks[chunk.group_pos]):
            raise ValueError(f"{chunk.redis_key}: a block id is outside the KV cache")
        return Pages(self._page_layouts[chunk.group_pos], ids)

    def _gather(self, chunk: ChunkTransfer, body: memoryview) -> None:
        """Copy the chunk's pages of every layer into ``body`` (layer-major)."""
        runs = positioned_runs(chunk.block_ids)
        offset = 0
        for layer in self._layers[chunk.group_pos]:
            nbytes = len(chunk.block_ids) * layer.page_bytes
            if layer.host is not None:
                copy_pages(layer, runs, body[offset : offset + nbytes], to_cache=False)
            else:
                # Queued on the transfer stream; complete when TransferStreams.ordered ends.
                ids = torch.tensor(chunk.block_ids, dtype=torch.long, device=layer.tensor.device)
                dst = torch.frombuffer(body[offset : offset + nbytes], dtype=torch.int8)
                src = layer.tensor[:, : layer.page_bytes].index_select(0, ids)
                dst.view(len(chunk.block_ids), layer.page_bytes).copy_(src, non_blocking=True)
            offset += nbytes

    # ------------------------------------------------------------------ loads

    def _run_load(self, job: Job, chunks: JobChunks) -> None:
        started = time.perf_counter()
        loaded = 0
        success = False
        try:
            if isinstance(chunks, LayoutMismatch):
                logger.error("hma_redis: load job %d has an inconsistent block layout", job.job_id)
            else:
                loaded = self._load_chunks(chunks, job)
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
            job.settle()
            if not success and not isinstance(chunks, LayoutMismatch):
                self._clear_pages_of_failed_load(job, chunks)
            job.released.set()
            self._jobs.pop(job.job_id, None)
            if not success or job.failed_chunks:
                self._store.counters.add(
                    load_failed_jobs=1,
                    load_failed_chunks=chunk_count(chunks) - job.chunks_loaded,
                )
            elapsed = time.perf_counter() - started
            failed = job.failed_chunks if success else tuple(range(chunk_count(chunks)))
            self._finished.put(
                JobResult(job.job_id, False, success and not failed, loaded, elapsed, failed)
            )
            with self._loads_lock:
                self._loads_running -= 1
            self._job_done.set()
            self._deliver_counters_when_due()

    def _clear_pages_of_failed_load(self, job: Job, plan: Sequence[ChunkTransfer]) -> None:
        """Zero every page a failed in-place load may have written, before its failure is
        reported.

        Invariant: no page the engine may read holds bytes that failed validation. A failed
        load's blocks go back to vLLM's free pool without being rewritten; a later request can
        get one as a partly filled block, and attention kernels read a whole block under a
        mask, where a NaN or Inf from a corrupt value survives the mask (NaN x 0 = NaN) and
        changes the output. Zeros are harmless under a mask. Loads through buffers never write
        a page before its value is valid, so only in-place loads need this.
        """
        if not self._land_in_place:
            return
        try:
            for chunk in plan:
                for view in self._pages_of(chunk).views():
                    torch.frombuffer(view, dtype=torch.uint8).zero_()
        except Exception:  # never expected: the views are the KV cache's own memory
            logger.exception("hma_redis: load job %d: clearing its pages failed", job.job_id)

    def _load_chunks(self, plan: Sequence[ChunkTransfer], job: Job) -> int:
        """Fetch and validate every chunk; copy them into the KV cache; return the bytes
        received. CorruptBlockError when any chunk is missing or invalid (the request is
        recomputed whole anyway), unless ``partial_loads``: then only the valid chunks land,
        the others' pages are zeroed and recorded in ``job.failed_chunks`` (CorruptBlockError
        still when none is valid).

        The byte budget is taken before anything is received, for the most bytes each chunk's
        value can hold (:meth:`_value_bound`); a longer value is never received (its bytes are
        dropped as they arrive) and is corrupt. Values land in the pages (CPU, not sealed)
        or in buffers copied once every chunk is valid (each valid chunk with
        ``partial_loads``); a value that does not look like what this engine would have
        written for its chunk (another header or prefix) is never written into a page: it
        lands whole in its chunk's staging buffer, in the same round trip, and is judged by
        ``codec.decode`` (copied once valid). Invalid values are deleted: SET NX would never
        replace them, so the recompute's store could not heal them otherwise.
        """
        if self._test_load_delay_s:
            time.sleep(self._test_load_delay_s)
        taken: list[memoryview] = []

        def take(nbytes: int) -> memoryview:
            taken.append(self._buffers.take(nbytes))
            return taken[-1]

        bounds = [self._value_bound(chunk) for chunk in plan]
        self._start_clock(job, sum(bounds), paused_s=self._test_load_delay_s)
        self._budget.acquire(sum(bounds), load=True)
        try:
            got = self._receive(plan, bounds, take, job)
            if got.invalid:
                self._store.delete(list(got.invalid))
            failed = self._failed_indices(plan, got)
            if failed and (not self._partial_loads or len(failed) == len(plan)):
                raise CorruptBlockError(describe_failures(got))
            # The pages are in the KV cache when this block ends (CUDA: copies completed).
            with self._streams.ordered(job.ready):
                for idx, block in got.blocks.items():
                    if idx not in failed:
                        self._scatter(plan[idx], block)
            if failed:
                self._clear_pages_of_failed_load(job, [plan[idx] for idx in failed])
                job.failed_chunks = tuple(sorted(failed))
                logger.warning(
                    "hma_redis: load job %d: %s; only its other %d chunk(s) were loaded",
                    job.job_id,
                    describe_failures(got),
                    len(plan) - len(failed),
                )
            job.chunks_loaded += len(plan) - len(failed)
        finally:
            self._buffers.give(taken)
            self._budget.release(sum(bounds))
        self._store.counters.add(
            loaded_chunks=len(plan) - len(job.failed_chunks), loaded_bytes=got.nbytes
        )
        return got.nbytes

    @staticmethod
    def _failed_indices(plan: Sequence[ChunkTransfer], got: Received) -> set[int]:
        """The plan indices of the chunks that were missing or invalid."""
        bad = set(got.missing) | set(got.invalid)
        return {idx for idx, chunk in enumerate(plan) if chunk.redis_key in bad}

    def _receive(
        self,
        plan: Sequence[ChunkTransfer],
        bounds: Sequence[int],
        take: Callable[[int], memoryview],
        job: Job,
    ) -> Received:
        """Receive every chunk's value in one round trip (per connection) and judge it. A value
        that is exactly what this engine would have written for its chunk (prefix fields,
        header, length) has landed in its target: its checksum (and MAC) decide. Any other
        value has landed whole in its staging buffer and ``codec.decode`` decides
        (:meth:`_validate`)."""
        layouts = [self._expected(chunk) for chunk in plan]
        targets, bodies = self._targets(plan, layouts, bounds, take)
        keys = [chunk.redis_key for chunk in plan]

        def load(part: slice) -> list[LoadResult] | None:
            return self._store.load_values(keys[part], targets[part], job.medium)

        results = self._in_parts(bounds, load)
        got = Received()
        if results is None:  # Redis failed: every chunk is missing
            got.missing = keys
            return got
        for idx, result in enumerate(results):
            key = keys[idx]
            status = result.status
            if status is LoadStatus.OVERSIZED:
                got.invalid[key] = CorruptBlockError(
                    f"{key} holds {result.value_len} bytes, its chunk at most {bounds[idx]}"
                )
            elif status is LoadStatus.LAYOUT_MISMATCH:
                # The expected prefix and header, but not the length they announce (a value
                # that fits no target lands in staging, whose bound is the oversized one).
                got.invalid[key] = CorruptBlockError(
                    f"{key}: {result.value_len} bytes, not the length its header announces"
                )
            elif status is not LoadStatus.OK:
                got.missing.append(key)  # missing, or refused (counted by the store)
            elif result.landed is Landed.STAGING:
                self._judge_staged(got, idx, plan[idx], targets[idx], result.value_len)
            elif not result.crc_ok:
                got.invalid[key] = CorruptBlockError(f"{key}: checksum mismatch")
            elif not self._mac_ok(targets[idx].head, targets[idx].dests):
                got.invalid[key] = CorruptBlockError(
                    f"{key}: MAC mismatch: written with another auth_key, or tampered with"
                )
            elif not self._opened(key, targets[idx].head, bodies[idx]):
                got.invalid[key] = CorruptBlockError(
                    f"{key}: decryption failed: sealed with another encryption key, or "
                    "tampered with"
                )
            else:
                got.nbytes += result.value_len
                received = bodies[idx]
                if received is not None:  # in a buffer (else already in its pages)
                    got.blocks[idx] = DecodedBlock(layouts[idx].header, received)
        return got

    def _judge_staged(
        self,
        got: Received,
        idx: int,
        chunk: ChunkTransfer,
        target: LoadTarget,
        value_len: int,
    ) -> None:
        """A value that landed whole in ``target``'s staging buffer: a block to copy once
        every chunk is judged, or invalid (every check of :meth:`_validate`)."""
        assert target.staging is not None
        try:
            got.blocks[idx] = self._validate(chunk, target.staging[:value_len])
        except ForeignKeyError:
            # Sealed with a key this instance does not hold (a rotation under way): a miss,
            # left in Redis for the instances that hold it.
            got.missing.append(chunk.redis_key)
        except CorruptBlockError as exc:
            got.invalid[chunk.redis_key] = exc
        else:
            got.nbytes += value_len

    def _targets(
        self,
        plan: Sequence[ChunkTransfer],
        layouts: Sequence[ExpectedValue],
        bounds: Sequence[int],
        take: Callable[[int], memoryview],
    ) -> tuple[list[LoadTarget], list[memoryview | None]]:
        """Where each chunk's value lands. Each chunk takes one pooled buffer of its bound: a
        value that is exactly the expected one has its head at the buffer's start and its body
        in the chunk's pages (in place) or right after the head; any other value lands whole
        in that buffer (staging, from its start: the head it overlaps is no longer needed).
        The bodies in buffers (None for in place)."""
        targets: list[LoadTarget] = []
        bodies: list[memoryview | None] = []
        for chunk, layout, bound in zip(plan, layouts, bounds, strict=True):
            buffer = take(bound)
            head = buffer[: layout.head_bytes]
            dests: list[memoryview] | Pages
            if self._land_in_place:
                dests = self._pages_of(chunk)
                bodies.append(None)
            else:
                body = buffer[layout.head_bytes : layout.value_bytes]
                dests = [body]
                bodies.append(body)
            targets.append(LoadTarget(head, layout.packed, dests, buffer, bound, layout.signed))
        return targets, bodies

    def _mac_ok(self, head: memoryview | bytearray, body: Sequence[memoryview] | Pages) -> bool:
        """Whether a value that landed as expected carries the MAC of this engine's key over
        ``body``, where its body landed (its buffer, or its chunk's pages); True without a key
        (the prefix's flags, compared on arrival, say it has no MAC)."""
        if self._mac_key is None:
            return True
        return codec.head_mac_matches(head, body_pieces(body), self._mac_key)

    def _opened(self, key: str, head: memoryview | bytearray, body: memoryview | None) -> bool:
        """Decrypt in its buffer the sealed body of a value that landed as expected (its header
        names the write key); whether its tag holds (True without an encryption key)."""
        if self._keyring is None:
            return True
        assert body is not None  # sealed values always land in buffers
        return codec.open_sealed(head, body, self._keyring.write, key)

    def _value_bound(self, chunk: ChunkTransfer) -> int:
        """The most bytes a valid value under ``chunk``'s key can hold: every block of the
        chunk (a value may hold more blocks than a load needs) and its header. The header's
        size depends on the chunk only through its group and its key's length (the other
        fields are the engine's), so it is worked out once per such pair and group position."""
        shape = (chunk.group_pos, chunk.group, len(chunk.redis_key.encode()))
        bound = self._bounds.get(shape)
        if bound is None:
            whole = replace(chunk, start=0, block_ids=tuple(range(self._blocks_per_chunk)))
            bound = self._bounds[shape] = codec.value_size(self._header(whole)) + _HEADER_SLACK
        return bound

    def _validate(self, chunk: ChunkTransfer, value: memoryview) -> DecodedBlock:
        """The value as a block this engine can copy into its KV cache, or CorruptBlockError.

        Besides the codec's checks (checksum, MAC, key echo, group), the writer's KV dtype,
        kv_cache_layout and page sizes must be this engine's: the namespace normally keeps
        other layouts apart, but an explicit ``namespace`` option skips that, so the header
        is checked whatever the namespace.
        """
        block = codec.decode(
            value,
            expected_key=chunk.redis_key,
            expected_group=chunk.group,
            mac_key=self._mac_key,
            keyring=self._keyring,
        )
        header = block.header
        if header.kv_dtype != self._format.kv_dtype:
            raise CorruptBlockError(
                f"{chunk.redis_key} holds {header.kv_dtype!r} KV, this engine uses "
                f"{self._format.kv_dtype!r}"
            )
        if header.kv_cache_layout != self._format.kv_cache_layout:
            raise CorruptBlockError(
                f"{chunk.redis_key} has kv_cache_layout {header.kv_cache_layout!r}, this engine "
                f"uses {self._format.kv_cache_layout!r}"
            )
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
        runs = positioned_runs(chunk.block_ids)
        for idx, layer in enumerate(self._layers[chunk.group_pos]):
            page = layer.page_bytes
            src = block.layer(idx)[skip * page : (skip + count) * page]
            if layer.host is not None:
                copy_pages(layer, runs, src, to_cache=True)
                continue
            # Queued on the transfer stream; complete when TransferStreams.ordered ends.
            ids = torch.tensor(chunk.block_ids, dtype=torch.long, device=layer.tensor.device)
            pages = torch.frombuffer(src, dtype=torch.int8).view(count, page)
            pages = pages.to(layer.tensor.device, non_blocking=True)
            layer.tensor[:, :page].index_copy_(0, ids, pages)
