"""The KV cache of the GPU check: one ``(num_blocks, page_bytes)`` int8 view per layer, as the
vLLM adapter hands them to the transfer engine, filled with random bytes; the jobs' chunks; and
byte-for-byte comparisons made where the cache lives (on the GPU for a CUDA cache).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hma_redis.core.keys import KeySpace
from hma_redis.core.transfer.jobs import ChunkTransfer, group_chunks
from hma_redis.core.transfer.pages import LayerSource


@dataclass(frozen=True)
class KVShape:
    """A model's KV cache per layer: K and V of ``block_size`` tokens x ``kv_heads`` x
    ``head_dim`` per block."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.kv_heads * self.head_dim * itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer (what a 1-block chunk's value carries)."""
        return self.layers * self.page_bytes

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        return (
            f"{self.name}: {self.dtype_name}, {self.layers} layers x {self.kv_heads} KV heads x "
            f"{self.head_dim}, block {self.block_size} ({self.page_bytes // 1024} KiB per layer "
            f"page, {self.block_bytes // 1024} KiB per block)"
        )


LLAMA3_8B = KVShape("Llama-3-8B", layers=32, kv_heads=8, head_dim=128, block_size=16,
                    dtype=torch.bfloat16)  # fmt: skip
# The CPU check's cache: the same layout, small enough to move in milliseconds.
SMALL = KVShape("small (CPU check)", layers=4, kv_heads=2, head_dim=64, block_size=16,
                dtype=torch.bfloat16)  # fmt: skip


class KVCache:
    """Random KV pages on one device, and the comparisons the check makes on them.

    Each layer is allocated as vLLM does (``(num_blocks, 2, block_size, kv_heads, head_dim)``
    in the model's dtype) and handed to the engine as its int8 ``(num_blocks, page_bytes)``
    view. Comparisons run on the cache's device and report how many (layer, block) pages differ.
    """

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device, seed: int) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.device = device
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layers: list[torch.Tensor] = []
        for _ in range(shape.layers):
            full = torch.empty(
                (num_blocks, 2, shape.block_size, shape.kv_heads, shape.head_dim),
                dtype=shape.dtype,
                device=device,
            )
            pages = full.view(num_blocks, -1).view(torch.int8)
            pages.random_(-128, 128, generator=gen)
            self.layers.append(pages)

    def sources(self) -> list[LayerSource]:
        """The layers as the engine's one KV group."""
        return [LayerSource.of(layer, self.shape.page_bytes) for layer in self.layers]

    def index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def clear(self, block_ids: Sequence[int]) -> None:
        """Zero the blocks (queued on the current stream, before the next submit's event)."""
        idx = self.index(block_ids)
        for layer in self.layers:
            layer.index_fill_(0, idx, 0)

    def wrong_pages(self, src: Sequence[int], dst: Sequence[int]) -> int:
        """How many (layer, block) pages of ``dst`` differ from the same position in ``src``."""
        src_idx, dst_idx = self.index(src), self.index(dst)
        wrong = 0
        for layer in self.layers:
            differs = layer.index_select(0, src_idx) != layer.index_select(0, dst_idx)
            wrong += int(differs.any(dim=1).sum().item())
        return wrong

    def snapshot(self) -> list[torch.Tensor]:
        return [layer.clone() for layer in self.layers]

    def changed_pages(self, before: Sequence[torch.Tensor], outside: Sequence[int]) -> int:
        """How many (layer, block) pages changed since ``before``, blocks ``outside`` not
        counted (pass the blocks a load may write; ``[]`` counts every block)."""
        keep = torch.ones(self.num_blocks, dtype=torch.bool, device=self.device)
        if outside:
            keep[self.index(outside)] = False
        changed = 0
        for layer, old in zip(self.layers, before, strict=True):
            changed += int(((layer != old).any(dim=1) & keep).sum().item())
        return changed

    def flip_byte(self, block_id: int) -> None:
        """Flip the first byte of ``block_id`` in layer 0 (``--flip-a-loaded-byte``: proves the
        check catches a wrong byte)."""
        self.layers[0][block_id, 0] ^= 1

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def pick_blocks(rng: random.Random, num_blocks: int, count: int) -> tuple[list[int], list[int]]:
    """Random source block ids and other random destination ids (disjoint, unsorted: runs of
    consecutive ids are rare, as in a long-running engine)."""
    ids = rng.sample(range(num_blocks), 2 * count)
    return ids[:count], ids[count:]


def job_chunks(
    keyspace: KeySpace, tag: str, block_ids: Sequence[int], chunk_blocks: int
) -> list[ChunkTransfer]:
    """The chunks of a job over ``block_ids`` (group 0, from the first block of a chunk). The
    keys depend on ``tag`` and the chunk's position only, so a load names the chunks a store
    of the same tag wrote, whatever block ids each used."""
    count = -(-len(block_ids) // chunk_blocks)
    hashes = [hashlib.sha256(f"{tag}/{n}".encode()).digest()[:16] for n in range(count)]
    keys = [keyspace.block_key(0, block_hash) for block_hash in hashes]
    chunks = group_chunks(0, 0, block_ids, 0, keys, chunk_blocks)
    assert chunks is not None, "the job's blocks and chunks do not add up"
    return chunks
