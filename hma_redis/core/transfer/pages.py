"""A KV group's layers as the engine sees them (:class:`LayerSource`) and the page copies
between them and buffers: runs of block ids, the spans a copy makes, a CPU group's
:class:`~hma_redis.core.medium.PageLayout`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hma_redis.core.medium import PageLayout, block_runs


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


def page_layout(group: Sequence[LayerSource]) -> PageLayout:
    """A CPU group's page layout: each layer's memory, page and row sizes."""
    return PageLayout(
        tuple(layer.host for layer in group),
        tuple(layer.page_bytes for layer in group),
        tuple(layer.row_bytes for layer in group),
    )


def blocks_held(group: Sequence[LayerSource]) -> int:
    """Blocks whose pages every layer of a CPU group holds."""
    held = [
        (len(layer.host) - layer.page_bytes) // layer.row_bytes + 1
        for layer in group
        if layer.host is not None
    ]
    return max(0, min(held, default=0))


def layer_device(layers: Sequence[LayerSource]) -> str:
    return layers[0].tensor.device.type if layers else "cpu"


def positioned_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in ``block_ids``, first block id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    pos = 0
    for first, count in block_runs(block_ids):
        runs.append((pos, first, count))
        pos += count
    return runs


def copy_pages(
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
