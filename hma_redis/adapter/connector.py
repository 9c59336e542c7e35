"""hma_redis' KV connector: vLLM's OffloadingConnector, minus the ways it can crash or lose data.

vLLM 0.32's OffloadingConnector asserts that every transfer succeeds. With a shared Redis a chunk
that was a hit at lookup time can be evicted, flushed or corrupted before the worker reads it, so
this subclass changes exactly three behaviours:

1. **Failed loads are recomputed.** The worker reports such a load as done (so vLLM's assert
   holds) and this connector reports its request in ``failed_recving``; the spec refuses to
   start under any other connector, and a worker this connector did not enable reports a
   failed load as failed, so vLLM stops instead of serving stale blocks. Under
   ``kv_load_failure_policy="recompute"`` the scheduler recomputes the request's tokens, under
   ``"fail"`` it fails the request. (vLLM cannot take per-block failures for models with several
   KV-cache groups, so a failed load recomputes the whole request, never a partial prefix.)
2. **The scheduler forgets failed chunks.** Their keys answer MISS for a while, so the request is
   not sent back to the same broken value, and the recomputed chunks are stored again (vLLM
   would otherwise consider them offloaded already).
3. **Nothing scheduled is lost at shutdown.** Store jobs vLLM queued but had not submitted yet are
   submitted and flushed (bounded by ``shutdown_timeout_s``) when the engine shuts down or the
   process exits.

And one for speed: **an idle step sleeps instead of spinning.** While a request waits for its KV
and nothing else runs, vLLM's engine loop steps back to back, computing nothing; on a host with
few cores that loop takes the core the transfer needs. The scheduler marks a step that
schedules no tokens (:class:`RedisConnectorMetadata`), and in such a step the worker waits up to
``idle_wait_ms`` for a running load to finish (it returns the moment one does).

And one for per-tenant quotas: **the manager learns each request's** ``cache_salt`` (vLLM's
request context does not carry it), the tenant its stores are counted against.

Everything else is the stock connector.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.logger import init_logger

from hma_redis.adapter import compat
from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.metrics import WorkerMetrics
from hma_redis.adapter.spec import RedisOffloadingSpec, failure_reporting_connector
from hma_redis.adapter.worker import RedisOffloadingWorker

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class RedisConnectorMetadata(OffloadingConnectorMetadata):
    """The stock metadata, plus whether the step computes nothing (no scheduled tokens)."""

    idle_step: bool = False


class RedisOffloadingConnector(OffloadingConnector):
    """OffloadingConnector with recompute-on-failed-load and a flushing shutdown."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        # The spec vLLM builds in here learns that its connector reports failed loads (it
        # refuses to start otherwise) and gets the configs its namespace is derived from.
        # vLLM builds the scheduler side outside its config context: enter it here too.
        with (
            set_current_vllm_config(vllm_config),
            failure_reporting_connector(vllm_config, kv_cache_config),
        ):
            super().__init__(vllm_config, role, kv_cache_config)
        self._shut_down = False
        self._worker_metrics: WorkerMetrics | None = None
        if self.connector_worker is not None:
            # vLLM does not always shut connectors down (e.g. an in-process engine at exit); this
            # hook submits the queued stores before the worker flushes them.
            atexit.register(self.shutdown)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's registration (which creates the spec's worker), then tell the worker that
        its failed loads reach vLLM through :meth:`get_transfer_results`."""
        super().register_kv_caches(kv_caches)
        connector_worker = self.connector_worker
        worker = connector_worker.worker if connector_worker is not None else None
        if isinstance(worker, RedisOffloadingWorker):
            worker.enable_failure_reporting()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Like the stock connector, plus the requests whose load failed."""
        connector_worker = self.connector_worker
        assert connector_worker is not None
        worker = connector_worker.worker
        metadata = self._get_connector_metadata()
        idle = isinstance(metadata, RedisConnectorMetadata) and metadata.idle_step
        if idle and isinstance(worker, RedisOffloadingWorker):
            worker.wait_while_idle()
        load_jobs = compat.load_jobs(connector_worker)
        finished_sending, finished_recving = self.get_finished(finished_req_ids)
        failed: set[str] = set()
        if isinstance(worker, RedisOffloadingWorker):
            failed = {load_jobs[j] for j in worker.take_failed_load_jobs() if j in load_jobs}
        return KVConnectorTransferResults(
            finished_sending=set(finished_sending or ()),
            finished_recving=set(finished_recving or ()),
            failed_recving=failed,
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler side: vLLM's stats and the manager's. Worker side: the worker's counters
        (stored/failed/loaded chunks), which vLLM ships to the scheduler with each model-runner
        output and sums over workers (see hma_redis.adapter.metrics)."""
        connector_worker = self.connector_worker
        if connector_worker is None:
            return super().get_kv_connector_stats()
        if self._worker_metrics is None:
            spec = connector_worker.spec
            if not isinstance(connector_worker.worker, RedisOffloadingWorker) or not isinstance(
                spec, RedisOffloadingSpec
            ):
                # Another spec's worker (vLLM's TieringOffloadingSpec): its own stats.
                return super().get_kv_connector_stats()
            self._worker_metrics = WorkerMetrics(spec.store.counters, spec.store.latency)
        return self._worker_metrics.collect()

    def shutdown(self) -> None:
        """Submit the stores vLLM has queued, let the worker flush them, then shut down."""
        if self._shut_down:
            return
        self._shut_down = True
        connector_worker = self.connector_worker
        if connector_worker is not None and connector_worker.worker is not None:
            for job_id, src_spec, dst_spec in compat.take_unsubmitted_stores(connector_worker):
                connector_worker.worker.submit_store(job_id, src_spec, dst_spec)
        super().shutdown()

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        """Tell the manager the request's ``cache_salt`` (its tenant, with ``tenant_quotas``)
        before vLLM hands it the request's context, which does not carry the salt."""
        manager = self.scheduler.manager
        if isinstance(manager, RedisOffloadingManager):
            manager.note_cache_salt(request.request_id, request.cache_salt)
        super().on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The stock metadata, marked idle when the step schedules no tokens."""
        meta = super().build_connector_meta(scheduler_output)
        if not isinstance(meta, OffloadingConnectorMetadata):
            return meta
        return RedisConnectorMetadata(
            **{f.name: getattr(meta, f.name) for f in fields(meta)},
            idle_step=scheduler_output.total_num_scheduled_tokens == 0,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.failed_recving:
            manager = self.scheduler.manager
            for req_id in connector_output.failed_recving:
                if isinstance(manager, RedisOffloadingManager):
                    manager.on_load_failed(req_id)
                # vLLM marked the chunks it meant to load as offloaded already; the recompute
                # must store them, or the bad chunks would never be replaced.
                compat.store_request_again(self.scheduler, req_id)
        super().update_connector_output(connector_output)
