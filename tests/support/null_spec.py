"""An offloading medium that holds nothing, for running ``RedisOffloadingConnector`` over a spec
other than hma_redis' on a CPU-only host (vLLM's own specs make workers on CUDA and XPU only).

Worker side only: its worker is never handed a job (nothing is ever offloaded), so it reports
nothing finished.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)

NULL_SPEC_CONFIG = {"spec_name": "NullOffloadingSpec", "spec_module_path": __name__}


class NullOffloadingWorker(OffloadingWorker):
    """Takes no job: a submit means a scheduler offloaded to a medium that holds nothing."""

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        raise AssertionError(f"store job {job_id} submitted to the null medium")

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        raise AssertionError(f"load job {job_id} submitted to the null medium")

    def get_finished(self) -> list[TransferResult]:
        return []

    def wait(self, job_ids: set[int]) -> None:
        return


class NullOffloadingSpec(OffloadingSpec):
    """A spec whose worker is a :class:`NullOffloadingWorker` (no scheduler side)."""

    def get_manager(self) -> OffloadingManager:
        raise NotImplementedError("NullOffloadingSpec has a worker side only")

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return NullOffloadingWorker()
