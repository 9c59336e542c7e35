"""What a transfer job is: its chunks (:class:`ChunkTransfer`, :func:`group_chunks`), the
format its values carry (:class:`ValueFormat`), its state while it runs (:class:`Job`), what a
load received (:class:`Received`) and its result (:class:`JobResult`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from hma_redis.core import codec
from hma_redis.core.codec import BlockHeader, CorruptBlockError, DecodedBlock
from hma_redis.core.deadline import Deadline
from hma_redis.core.medium import MediumJob


@dataclass(frozen=True)
class ChunkTransfer:
    """One chunk's part of a job: its Redis key and which blocks of the chunk go where."""

    redis_key: str
    group: int  # KV group id (as in the offload key)
    group_pos: int  # position of the group in the engine's layer groups
    start: int  # first block of the chunk that is transferred (offset inside the chunk)
    block_ids: tuple[int, ...]  # KV-cache block ids, one per transferred block


@dataclass(frozen=True)
class LayoutMismatch:
    """A job whose keys could not be paired with its blocks (the caller's spec does not add
    up). Submitted in place of its chunks, it fails like a job that broke: a load reports
    failure, a store stores nothing; its ``num_chunks`` are counted as failed."""

    num_chunks: int


# What a job moves: its chunks, or why there are none.
JobChunks = Sequence[ChunkTransfer] | LayoutMismatch


def group_chunks(
    group: int,
    group_pos: int,
    block_ids: Sequence[int],
    first_index: int,
    redis_keys: Sequence[str],
    blocks_per_chunk: int,
) -> list[ChunkTransfer] | None:
    """One KV group's chunks of a job: ``block_ids`` are consecutive blocks of a request, the
    first at block index ``first_index``, covered in order by one chunk per Redis key. The
    first chunk starts at ``first_index % blocks_per_chunk`` (a sliding window may have dropped
    the older blocks of that chunk); the others at 0. None when the keys and the blocks do not
    add up (a chunk left without blocks, or blocks left without a chunk)."""
    start, taken = first_index % blocks_per_chunk, 0
    chunks: list[ChunkTransfer] = []
    for key in redis_keys:
        count = min(blocks_per_chunk - start, len(block_ids) - taken)
        if count <= 0:
            return None
        chunks.append(
            ChunkTransfer(key, group, group_pos, start, tuple(block_ids[taken : taken + count]))
        )
        taken += count
        start = 0
    return chunks if taken == len(block_ids) else None


@dataclass(frozen=True)
class ValueFormat:
    """What every value this engine writes says of its bytes, and every value it reads must.

    ``kv_dtype`` and ``kv_cache_layout`` go into each header and are checked on each load
    (whatever the namespace). With ``auth_key`` every value is MAC'd with it and only values
    MAC'd with it are read. With ``encryption_key`` every value's body is sealed with it
    (:mod:`hma_redis.core.sealing`) and only values sealed with it or with
    ``encryption_key_previous`` are read; the config never sets both an auth_key and an
    encryption_key.
    """

    kv_dtype: str
    kv_cache_layout: str = ""
    auth_key: bytes | None = field(default=None, repr=False)
    encryption_key: bytes | None = field(default=None, repr=False)
    encryption_key_previous: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class JobResult:
    """A finished job. ``ok`` is False only for a load that did not copy every chunk (its
    blocks must be recomputed); a store is best effort, its dropped chunks are counted in the
    store's counters. ``nbytes``: value bytes stored or loaded."""

    job_id: int
    is_store: bool
    ok: bool
    nbytes: int
    seconds: float
    # A load's chunks (indices into its plan) that were not loaded: none when ``ok``, every
    # chunk when the job failed whole, some with ``partial_loads`` (the others landed).
    failed_chunks: tuple[int, ...] = ()


@dataclass
class Job:
    job_id: int
    is_store: bool
    # Set once the job no longer reads the KV cache (stores) or is completely done (loads).
    released: threading.Event = field(default_factory=threading.Event)
    future: Future[None] | None = None
    # Recorded on the compute stream at submit (CUDA only): the transfer starts after it.
    ready: torch.cuda.Event | None = None
    chunks_loaded: int = 0
    # partial_loads: chunks (plan indices) that were missing or invalid while others landed.
    failed_chunks: tuple[int, ...] = ()
    chunks_counted: int = 0  # store: chunks counted as stored, skipped or failed so far
    # store: the tenant the chunks it writes are counted against (None: no account), and the
    # keys and bytes it wrote so far.
    owner: str | None = None
    stored_keys: list[str] = field(default_factory=list)
    stored_sizes: list[int] = field(default_factory=list)
    submitted: float = field(default_factory=time.monotonic)
    # The job as its medium sees it (its deadline, its calls' one outcome), from when it starts.
    medium: MediumJob | None = None

    @property
    def deadline(self) -> Deadline | None:
        """When every call of the job on the medium must have ended (None before it starts)."""
        return self.medium.deadline if self.medium is not None else None

    def settle(self) -> None:
        """Report the outcome of the job's calls to the medium, once, after the last."""
        if self.medium is not None:
            self.medium.settle()
            self.medium = None


@dataclass(frozen=True)
class ExpectedValue:
    """What a value written by this engine for a chunk starts with: its header (and that
    header as msgpack), and the prefix fields before the CRC (magic, version, flags, header
    length). A load's value must be exactly this (and its body) to land in its target; any
    other value lands in staging and is decoded.

    ``shape`` is the header with every field but the key (``redis_key``): the header itself
    is built only when asked for (:attr:`header`), as most loads never need it."""

    shape: BlockHeader
    redis_key: str
    packed: bytes
    signed: bytes

    @cached_property
    def header(self) -> BlockHeader:
        return replace(self.shape, key=self.redis_key)

    @property
    def head_bytes(self) -> int:
        return codec.PREFIX_BYTES + len(self.packed)

    @property
    def value_bytes(self) -> int:
        return self.head_bytes + self.shape.body_bytes


@dataclass
class Received:
    """What a load job's values turned out to be: valid values still to copy from buffers
    (``blocks``, by chunk index; valid values that landed in the KV cache's pages need
    nothing more), invalid values (by key) and missing keys; ``nbytes``: bytes of the values
    received."""

    blocks: dict[int, DecodedBlock] = field(default_factory=dict)
    invalid: dict[str, CorruptBlockError] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    nbytes: int = 0


def describe_failures(got: Received) -> str:
    first = next(iter(got.invalid.values()), None)
    return f"{len(got.missing)} chunk(s) missing, {len(got.invalid)} invalid" + (
        f" (first: {first})" if first else ""
    )


def split_parts(sizes: Sequence[int], parts: int) -> list[slice]:
    """Consecutive slices of ``sizes``' indices, at most ``parts`` and none empty (one empty
    slice for no items), each about ``sum(sizes) / parts``."""
    count = len(sizes)
    parts = max(1, min(parts, count))
    if parts == 1:
        return [slice(0, count)]
    total = sum(sizes)
    cuts: list[slice] = []
    start, acc = 0, 0
    for idx, size in enumerate(sizes):
        acc += size
        left = parts - len(cuts) - 1  # cuts still to make after this one
        if left and acc * parts >= total * (len(cuts) + 1) and count - idx - 1 >= left:
            cuts.append(slice(start, idx + 1))
            start = idx + 1
    cuts.append(slice(start, count))
    return cuts


def chunk_count(chunks: JobChunks) -> int:
    return chunks.num_chunks if isinstance(chunks, LayoutMismatch) else len(chunks)
