"""``RedisSecondaryTier``: a shared Redis behind vLLM's CPU primary tier.

Configured as one entry of ``secondary_tiers`` in ``kv_connector_extra_config`` of
``TieringOffloadingSpec``::

    {"type": "RedisSecondaryTier", "module_path": "hma_redis.tiering",
     "redis_url": "redis://cache:6379/0", ...the direct spec's options}

Every method runs in the scheduler process under the tiering manager's lock and returns at
once. Lookups go through the direct mode's :class:`RedisOffloadingManager` (RETRY while one
batch per step asks Redis about every key of every group). Promotions (Redis -> primary) and
cascades (primary -> Redis) run on the core's transfer engine, on its threads, straight
between Redis and the primary's buffer; a promotion reports a key loaded only once its value
passed every check (checksum, key echo, header, MAC with an ``auth_key``), and the primary rows
of the keys that failed are zeroed before the failure is reported.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hma_redis.adapter.metrics import metric_definitions
from hma_redis.adapter.namespace import Mode, deployment_fingerprint, namespace_name
from hma_redis.adapter.spec import (
    SECONDARY_TIER,
    adopt_vllm_logging,
    check_hash_seed,
    connector_context,
    lookup_manager,
)
from hma_redis.adapter.tiering.layout import PrimaryRowLayout
from hma_redis.core.config import VLLM_OWNED_KEYS, RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.pins import PIN_PARAM
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer import engine as transfer
from hma_redis.core.transfer.engine import TransferEngine
from hma_redis.core.transfer.jobs import ChunkTransfer, ValueFormat
from hma_redis.core.transfer.pages import LayerSource

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata, OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = init_logger(__name__)

# Options of the direct spec that mean nothing here: vLLM's connector keys (they belong in
# kv_connector_extra_config itself), the worker's step-loop knobs (no worker of ours runs) and
# pinning (this tier never pins: see on_new_request), and per-tenant quotas (direct mode only:
# vLLM's tiering manager hands the tier no request's cache_salt).
_REFUSED_OPTIONS = VLLM_OWNED_KEYS | {
    "idle_wait_ms",
    "gil_switch_interval_ms",
    "pinning",
    "pin_max_s",
    "pin_budget_bytes",
    "tenant_quotas",
    "tenant_budget_bytes",
    "quota_refresh_interval_s",
    "quota_reconcile_interval_s",
}


@dataclass
class Job:
    """A job of the tiering manager this tier runs (or ran) on the engine."""

    keys: list[OffloadKey]
    req_context: ReqContext
    is_promotion: bool
    # Cascades: the keys actually sent (admission and known-present keys are left out).
    stored: list[OffloadKey]


class RedisSecondaryTier(SecondaryTierManager):
    """A secondary tier in a (shared) Redis, on hma_redis' core."""

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """hma_redis' Prometheus metrics, as the direct spec registers them."""
        return metric_definitions()

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        locality: str | None = None,
        **options: Any,
    ) -> None:
        """``options``: the direct spec's options (:class:`RedisTierConfig`), validated the
        same way (an unknown or meaningless one raises ``ValueError`` naming it). Built by
        vLLM inside :class:`~hma_redis.adapter.connector.RedisOffloadingConnector` (which
        hands it vLLM's config, the namespace's inputs); under any other connector it refuses
        to start with one line saying so. Connects to Redis once to write the namespace's info
        hash (a Redis that is down only warns)."""
        adopt_vllm_logging()
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else Locality.REMOTE
        refused = sorted(_REFUSED_OPTIONS & options.keys())
        if refused:
            raise ValueError(
                f"hma_redis: option(s) {refused} do not apply to the Redis secondary tier"
            )
        context = connector_context(SECONDARY_TIER)
        self.config = RedisTierConfig.from_extra_config(options)
        check_hash_seed(context.vllm_config, self.config)
        self.row = PrimaryRowLayout.of(offloading_spec)
        self.fingerprint = deployment_fingerprint(
            offloading_spec.config,
            context.vllm_config,
            context.kv_cache_config,
            kv_cache_layout=self.row.describe(),
            auth_key_id=self.config.auth_key_id,
            encryption_key_id=self.config.encryption_key_id,
        )
        namespace = namespace_name(self.config, self.fingerprint, Mode.TIERING)
        self.keyspace = KeySpace(self.config.key_prefix, namespace, 1)
        self._store = RedisBlockStore(self.config, stats_key=self.keyspace.stats_key())
        self._announce()
        self._lookups = lookup_manager(
            offloading_spec, self._store, self.keyspace, self.config, context.vllm_config
        )
        self._engine: TransferEngine | None = self._make_engine(primary_kv_view)
        self._jobs: dict[int, Job] = {}
        self._done: list[JobResult] = []
        self._warned_pin = False

    def _announce(self) -> None:
        if not self._store.write_info(self.keyspace.info_key(), self.fingerprint.info_fields()):
            logger.warning(
                "hma_redis: Redis at %s is not reachable at start-up; the secondary tier "
                "misses until it is",
                self.config.redacted_url,
            )
        logger.info(
            "hma_redis: secondary tier, namespace %s (%s, %d bytes per chunk) at %s",
            self.keyspace.base,
            self.fingerprint.model,
            self.row.payload_bytes,
            self.config.redacted_url,
        )

    @property
    def engine(self) -> TransferEngine:
        """The transfer engine over the primary buffer (``RuntimeError`` after shutdown)."""
        if self._engine is None:
            raise RuntimeError("hma_redis: the secondary tier is shut down")
        return self._engine

    def _make_engine(self, primary_kv_view: memoryview) -> TransferEngine:
        """The engine over the primary buffer: one "layer" whose blocks are its rows."""
        rows = torch.frombuffer(primary_kv_view.cast("B"), dtype=torch.int8)
        rows = rows.view(-1, self.block_size_bytes)
        cfg = self.config
        return TransferEngine(
            self._store,
            [[LayerSource.of(rows, self.row.payload_bytes)]],
            ValueFormat(
                kv_dtype=self._offloading_spec.config.model.dtype,
                kv_cache_layout=self.row.describe(),
                auth_key=cfg.auth_key,
                encryption_key=cfg.encryption_key,
                encryption_key_previous=cfg.encryption_key_previous,
            ),
            blocks_per_chunk=1,
            io_threads=cfg.io_threads,
            max_inflight_bytes=cfg.max_inflight_bytes,
            shutdown_timeout_s=cfg.shutdown_timeout_s,
            connections_per_job=cfg.connections_per_job,
            partial_loads=True,
        )

    # ------------------------------------------------------------------ lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT / MISS from the answers of earlier batches; RETRY while the key's batch is in
        flight (and while this tier is storing it). Never a round trip."""
        result = self._lookups.lookup(key, req_context)
        return LookupResult.RETRY if result is LookupResult.HIT_PENDING else result

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send this step's unknown keys of every group to Redis in one round trip."""
        self._lookups.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self._lookups.has_pending_work()

    # ------------------------------------------------------------------ transfers

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Cascade: put the chunks Redis is not known to hold (and that admission lets in)
        from their primary rows, on the engine's threads."""
        keys = list(job_metadata.keys)
        prepared = self._lookups.prepare_store(keys, job_metadata.req_context)
        stored = list(prepared.keys_to_store) if prepared is not None else []
        rows = dict(zip(keys, _row_ids(job_metadata.chunk_ids), strict=True))
        self._jobs[job_metadata.job_id] = Job(keys, job_metadata.req_context, False, stored)
        self.engine.submit_store(
            job_metadata.job_id, self._chunks(stored, [rows[k] for k in stored])
        )

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Promotion: get, validate and write the chunks into their primary rows."""
        keys = list(job_metadata.keys)
        self._lookups.prepare_load(keys, job_metadata.req_context)
        self._jobs[job_metadata.job_id] = Job(keys, job_metadata.req_context, True, [])
        self.engine.submit_load(
            job_metadata.job_id, self._chunks(keys, _row_ids(job_metadata.chunk_ids))
        )

    def _chunks(self, keys: Sequence[OffloadKey], rows: Sequence[int]) -> list[ChunkTransfer]:
        return [
            ChunkTransfer(
                self.keyspace.block_key(get_offload_group_idx(k), get_offload_block_hash(k)),
                group=get_offload_group_idx(k),
                group_pos=0,
                start=0,
                block_ids=(row,),
            )
            for k, row in zip(keys, rows, strict=True)
        ]

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs the engine finished since the last call; a promotion names exactly the keys
        whose values were valid and written (``successful_keys``)."""
        self._collect()
        done, self._done = self._done, []
        return done

    def wait_for_any_job(self, timeout_s: float) -> None:
        """Sleep until a running job finishes (at most ``timeout_s``); at once when none runs
        or one has finished already. For benchmarks waiting on their own jobs (vLLM's
        tiering manager polls :meth:`get_finished_jobs` and never calls this)."""
        if self._engine is not None:
            self._engine.wait_for_finish(timeout_s, stores_too=True)

    def _collect(self) -> None:
        if self._engine is None:
            return
        for result in self._engine.finished():
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                self._done.append(self._finish(result, job))

    def _finish(self, result: transfer.JobResult, job: Job) -> JobResult:
        if not job.is_promotion:
            self._lookups.complete_store(job.stored, job.req_context, success=True)
            return JobResult(
                result.job_id, True, transfer_time=result.seconds, transfer_bytes=result.nbytes
            )
        self._lookups.complete_load(job.keys, job.req_context)
        failed = {job.keys[idx] for idx in result.failed_chunks}
        self._lookups.forget_as_missing(failed)
        loaded = [k for k in job.keys if k not in failed]
        return JobResult(
            result.job_id,
            success=not failed,
            successful_keys=None if not failed else loaded,
            transfer_time=result.seconds,
            transfer_bytes=result.nbytes,
        )

    def drain_jobs(self) -> None:
        """Wait until every submitted job is done (bounded: each job's Redis operations end
        by its deadline) and its result is queued for :meth:`get_finished_jobs`."""
        self.engine.wait(list(self._jobs))
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        # A job signals "done" just before it queues its result: collect until all have.
        while True:
            self._collect()
            if not self._jobs or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        for job_id in self._jobs:
            logger.warning("hma_redis: secondary-tier job %d did not report; failed", job_id)
            self._done.append(JobResult(job_id, success=False))
        self._jobs.clear()

    # ------------------------------------------------------------------ requests, events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """A request asking for a pin is served unpinned: vLLM's tiering manager stores chunks
        into this tier by cascades from its CPU tier, not per request (counted as a pin asked
        for while pinning is off; WARNING once)."""
        params = req_context.kv_transfer_params
        if params and PIN_PARAM in params:
            self._store.counters.add(pin_off_requests=1)
        if params and PIN_PARAM in params and not self._warned_pin:
            self._warned_pin = True
            logger.warning(
                "hma_redis: request %s asks for a pin (kv_transfer_params %s), which the "
                "secondary tier of TieringOffloadingSpec does not do; pinning needs the direct "
                "spec (RedisOffloadingSpec); requests are served unpinned (logged once)",
                req_context.req_id,
                PIN_PARAM,
            )
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.on_request_finished(req_context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored chunks, and chunks Redis evicted, expired or deleted (keyspace
        notifications), with vLLM's KV events on."""
        return self._lookups.take_events()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Redis evicts by its own policy (``maxmemory-policy``): nothing to record."""
        return

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self._lookups.get_stats()

    @property
    def lookup_round_trips(self) -> int:
        """Lookup batches sent to Redis so far (one per step that had unknown keys)."""
        return self._lookups.stats.lookup_round_trips

    def shutdown(self) -> None:
        """Finish the jobs already submitted (bounded: see :meth:`drain_jobs`), stop the
        threads, close the connections and let go of the primary buffer (vLLM unmaps it right
        after). Idempotent."""
        engine = self._engine
        if engine is None:
            return
        if self._jobs:
            logger.info(
                "hma_redis: secondary tier: %d job(s) in flight at shutdown; finishing them "
                "(at most shutdown_timeout_s %.0f s)",
                len(self._jobs),
                self.config.shutdown_timeout_s,
            )
        self.drain_jobs()
        engine.shutdown()
        self._lookups.shutdown()
        # As the direct worker's last lines (its counters; the transfers' peak next to bound).
        logger.info(
            "hma_redis: secondary tier totals %s",
            json.dumps(dict(self._store.counters.totals), sort_keys=True),
        )
        memory = engine.memory(self.config.max_inflight_bytes)
        logger.info("hma_redis: secondary tier memory %s", json.dumps(memory))
        self._store.close()
        # The engine's views of the primary buffer must be gone before vLLM closes its mmap.
        self._engine = None


def _row_ids(chunk_ids: Any) -> list[int]:
    return [int(c) for c in chunk_ids]
