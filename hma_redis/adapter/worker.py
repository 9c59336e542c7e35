"""Worker side: vLLM's offloading worker, mapped onto the transfer engine.

vLLM hands each job as a :class:`GPULoadStoreSpec` (block ids grouped by KV group) and our
:class:`~hma_redis.adapter.types.RedisLoadStoreSpec` (offload keys in the same order). This module
pairs every offload key with its blocks and this rank's Redis key (:func:`plan_chunks`) and
hands the chunks to :class:`~hma_redis.core.transfer.engine.TransferEngine`, which moves the bytes;
results go back as vLLM's :class:`TransferResult`, with failed loads reported the way the
connector can recompute them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

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

from hma_redis.adapter import arrivals
from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.engine import TransferEngine
from hma_redis.core.transfer.jobs import (
    ChunkTransfer,
    JobChunks,
    LayoutMismatch,
    ValueFormat,
    group_chunks,
)
from hma_redis.core.transfer.pages import LayerSource

logger = init_logger(__name__)


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
        auth_key: bytes | None = None,
        kv_cache_layout: str = "",
        encryption_key: bytes | None = None,
        encryption_key_previous: bytes | None = None,
        connections_per_job: int | None = None,
        idle_wait_s: float = 0.0,
    ) -> None:
        """``connections_per_job`` (default: the store's config) splits each job over that
        many threads (:class:`TransferEngine`; the data path is the store's, chosen when it
        was built); ``idle_wait_s`` bounds :meth:`wait_while_idle`."""
        self._store = store
        self._idle_wait_s = idle_wait_s
        self._arrivals: arrivals.Arrivals | None = None  # found at the first idle step
        self._keyspace = keyspace
        self._rank = rank
        self._group_ids = list(group_ids)
        self._blocks_per_chunk = blocks_per_chunk
        self._max_inflight_bytes = max_inflight_bytes
        self._engine = TransferEngine(
            store,
            layer_groups(kv_caches),
            ValueFormat(
                kv_dtype, kv_cache_layout, auth_key, encryption_key, encryption_key_previous
            ),
            blocks_per_chunk=blocks_per_chunk,
            io_threads=io_threads,
            max_inflight_bytes=max_inflight_bytes,
            shutdown_timeout_s=shutdown_timeout_s,
            connections_per_job=connections_per_job or store.cfg.connections_per_job,
        )
        # Load jobs whose failure get_finished has returned, until take_failed_load_jobs.
        # Both run on the worker's step thread (the connector's get_transfer_results).
        self._failed_reported: set[int] = set()
        # Whether the connector turns failed loads into recomputes (enable_failure_reporting);
        # until it says so a failed load is reported as failed and vLLM stops the engine.
        self._failures_reported = False
        self._closed = False

    # ------------------------------------------------------------------ vLLM API

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Queue a store; returns at once. The job reads the KV cache in a background thread
        (``wait`` blocks until it has), then encodes and puts the chunks."""
        assert isinstance(dst_spec, RedisLoadStoreSpec)
        absent = {self._redis_key(key) for key in dst_spec.known_absent}
        plan = self._plan(dst_spec.keys, src_spec)
        self._engine.submit_store(job_id, plan, absent, owner=dst_spec.tenant)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Queue a load; returns at once. Completion is reported through ``get_finished``.

        ``expedited`` (vLLM 0.33: a sync load the step waits on) is accepted and never set:
        the spec refuses sync loads (see :mod:`hma_redis.adapter.compat`)."""
        assert isinstance(src_spec, RedisLoadStoreSpec)
        self._engine.submit_load(job_id, self._plan(src_spec.keys, dst_spec))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs. Every result says success (vLLM 0.32 asserts it) except a failed load
        before :meth:`enable_failure_reporting`; a load that failed is listed by
        :meth:`take_failed_load_jobs` once its result has been returned here."""
        results: list[TransferResult] = []
        for done in self._engine.finished():
            if not done.ok:
                self._failed_reported.add(done.job_id)
            success = done.ok or self._failures_reported
            results.append(TransferResult(done.job_id, success, done.nbytes, done.seconds))
        return results

    def wait_while_idle(self) -> None:
        """The engine's step computes nothing: sleep until a running load finishes rather than
        return at once and let the step loop spin on a core the transfer could use. Returns at
        once when no load runs or one has finished already, and never sleeps with
        ``idle_wait_s`` 0. How long it may sleep is what the engine core that called it allows
        (:mod:`hma_redis.adapter.arrivals`, found at the first idle step): until the load
        finishes where no request can arrive meanwhile, until one arrives where the worker
        sees the engine core's input queue, else ``idle_wait_s`` at most."""
        if self._idle_wait_s <= 0:
            return
        if self._arrivals is None:
            self._arrivals = arrivals.arrivals_here()
            logger.info("hma_redis: idle engine steps: %s", self._arrivals.describe())
        watch = self._arrivals
        if watch.kind == "in-process":
            self._engine.wait_for_finish(arrivals.WATCHED_WAIT_S)
        elif watch.kind == "watched":
            self._engine.wait_for_finish(
                arrivals.WATCHED_WAIT_S, until=watch.arrived, check_s=arrivals.ARRIVAL_CHECK_S
            )
        else:
            self._engine.wait_for_finish(self._idle_wait_s)

    def wait_for_any_job(self, timeout_s: float) -> None:
        """Sleep until a running job, load or store, finishes (at most ``timeout_s``); at once
        when none runs or one has finished already. For benchmarks that wait on their own
        jobs the way LMCache's peers wait on their completion events, not for an engine step
        (which waits only on loads: :meth:`wait_while_idle`)."""
        self._engine.wait_for_finish(timeout_s, stores_too=True)

    def enable_failure_reporting(self) -> None:
        """Called by RedisOffloadingConnector, which reads :meth:`take_failed_load_jobs` and
        has vLLM recompute those requests: from now on a failed load's result says success
        (vLLM 0.32 asserts it). Without this call it says failure, so a connector that cannot
        recompute stops loudly instead of serving the destination blocks' stale contents."""
        self._failures_reported = True

    @property
    def data_path(self) -> str:
        """Which data path the transfer engine runs (as its start-up INFO line says)."""
        return self._engine.data_path

    @property
    def peak_buffer_bytes(self) -> int:
        """The most bytes this worker's transfers have held in value buffers at once."""
        return self._engine.peak_buffer_bytes

    def take_failed_load_jobs(self) -> set[int]:
        """Load jobs whose failure was returned by ``get_finished`` since the last call."""
        failed, self._failed_reported = self._failed_reported, set()
        return failed

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs no longer read their KV-cache blocks: at most until each
        job's deadline (3 x ``read_timeout_s`` + its bytes at 16 MiB/s from its submission,
        :meth:`TransferEngine.wait`), whatever Redis does."""
        self._engine.wait(job_ids)

    def shutdown(self) -> None:
        """Finish stores already scheduled (bounded by ``shutdown_timeout_s``), then stop."""
        if self._closed:
            return
        self._closed = True
        self._engine.shutdown()
        # The Redis stats hash is best effort (an allkeys-* policy may evict it); this line is not.
        logger.info(
            "hma_redis: worker rank %d totals %s",
            self._rank,
            json.dumps(dict(self._store.counters.totals), sort_keys=True),
        )
        logger.info("hma_redis: worker rank %d memory %s", self._rank, json.dumps(self.memory()))

    def memory(self) -> dict[str, int]:
        """The most bytes transfers held at once (of the in-flight budget, and in value
        buffers) next to their bound, ``max_inflight_bytes``; logged at shutdown."""
        return self._engine.memory(self._max_inflight_bytes)

    # ------------------------------------------------------------------ planning

    def _plan(self, keys: Sequence[bytes], spec: GPULoadStoreSpec) -> JobChunks:
        return plan_chunks(
            keys,
            spec,
            group_ids=self._group_ids,
            blocks_per_chunk=self._blocks_per_chunk,
            redis_key=self._block_key,
        )

    def _block_key(self, group: int, block_hash: bytes) -> str:
        """This worker's (its rank's) Redis key of a chunk."""
        return self._keyspace.block_key(group, block_hash, self._rank)

    def _redis_key(self, key: bytes) -> str:
        """This worker's Redis key of an offload key."""
        offload_key = OffloadKey(key)
        return self._block_key(
            get_offload_group_idx(offload_key), get_offload_block_hash(offload_key)
        )


def layer_groups(kv_caches: CanonicalKVCaches) -> list[list[LayerSource]]:
    """vLLM's canonical KV views as the engine's layer groups (one list per KV group)."""
    return [
        [
            LayerSource.of(kv_caches.tensors[ref.tensor_idx].tensor, ref.page_size_bytes)
            for ref in refs
        ]
        for refs in kv_caches.group_data_refs
    ]


def plan_chunks(
    keys: Sequence[bytes],
    spec: GPULoadStoreSpec,
    *,
    group_ids: Sequence[int],
    blocks_per_chunk: int,
    redis_key: Callable[[int, bytes], str],
) -> JobChunks:
    """Pair each offload key with its blocks: one :class:`ChunkTransfer` per key, in order.

    ``spec`` lists, per KV group (in ``group_ids`` order), the job's block ids and the index of
    the group's first block; each group's keys cover those blocks chunk by chunk, the first
    chunk from ``block_indices[g] % blocks_per_chunk`` on. :class:`LayoutMismatch` when the
    keys and blocks do not add up (vLLM's spec and ours disagree: the job must fail, not guess).
    """
    mismatch = LayoutMismatch(len(keys))
    if len(spec.group_sizes) > len(group_ids):
        return mismatch
    by_group: dict[int, list[bytes]] = {}
    for key in keys:
        by_group.setdefault(get_offload_group_idx(OffloadKey(key)), []).append(key)
    block_ids = spec.block_ids.tolist()
    plan: list[ChunkTransfer] = []
    offset = 0
    for pos, (size, first_index) in enumerate(
        zip(spec.group_sizes, spec.block_indices, strict=True)
    ):
        group_id = group_ids[pos]
        redis_keys = [
            redis_key(group_id, get_offload_block_hash(OffloadKey(key)))
            for key in by_group.pop(group_id, [])
        ]
        chunks = group_chunks(
            group_id,
            pos,
            block_ids[offset : offset + size],
            first_index,
            redis_keys,
            blocks_per_chunk,
        )
        offset += size
        if chunks is None:
            return mismatch
        plan += chunks
    return mismatch if by_group else plan
