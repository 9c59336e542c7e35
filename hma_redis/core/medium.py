"""The medium seam: what the transfer engine needs from the place values live, and the value
types both sides share.

:class:`BlockStore` is the whole surface the transfer engine
(:class:`hma_redis.core.transfer.engine.TransferEngine`) uses: check which keys exist, land
values where the engine says (:meth:`BlockStore.load_values`), put values written by the engine
(:meth:`BlockStore.put_values`), delete the bad ones, and count.
:class:`hma_redis.core.redis.store.RedisBlockStore` implements it for Redis; the engine imports
this module, never the store nor its wire code.

Every call of the protocol degrades instead of raising when the medium fails (an outage, a
refusal, a deadline passed): the result says so, and the engine turns it into a miss, a
failed store or a failed load. The bytes a value holds are the codec's envelope
(:mod:`hma_redis.core.codec`); a medium moves them and checksums them on the way, it does not
judge them beyond what :class:`LoadTarget` says.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, NamedTuple, TypeVar

from hma_redis.core.counters import PendingCounters
from hma_redis.core.deadline import Deadline
from hma_redis.core.latency import Operation

logger = logging.getLogger(__name__)

__all__ = [
    "BlockStore",
    "JobT",
    "Landed",
    "LoadResult",
    "LoadStatus",
    "LoadTarget",
    "MediumJob",
    "PageLayout",
    "Pages",
    "PutResult",
    "block_runs",
    "body_bytes",
    "body_pieces",
]


class LoadStatus(Enum):
    OK = "ok"  # the value landed (see LoadResult.landed)
    MISSING = "missing"  # no such key
    OVERSIZED = "oversized"  # longer than max_len: drained, never held whole
    ERROR = "error"  # an error reply (LoadResult.error)
    LAYOUT_MISMATCH = "layout-mismatch"  # did not fit the targets and no staging: drained


class Landed(Enum):
    PAGES = "pages"  # head + dests
    STAGING = "staging"  # the whole value in staging[0:value_len]


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Where one KV group's pages live in a CPU KV cache: for each layer, its memory (one
    row of ``row_bytes[i]`` bytes per block, the page in the row's first ``page_bytes[i]``).
    Built once per group; every :class:`Pages` of the group shares it, so a job's pages are
    described by block ids instead of one buffer per page (the native job takes each layer's
    memory once per job and works out the pages itself)."""

    layers: tuple[Any, ...]  # writable byte buffers, one per layer
    page_bytes: tuple[int, ...]
    row_bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Pages:
    """A chunk's body in place: the pages of ``block_ids``, layer by layer (every block's page
    of layer 0, then of layer 1, ...), as :meth:`views` lists them. A destination of a load
    (``LoadTarget.dests``) or the pieces of a stored value, in place of a list of buffers.
    Either path refuses one whose block id puts a page outside its layer's memory
    (ValueError, before anything is sent)."""

    layout: PageLayout
    block_ids: Sequence[int]

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * sum(self.layout.page_bytes)

    def views(self) -> list[memoryview]:
        """The pages as views of the layers' memory, in order; consecutive blocks of a layer
        whose pages fill their rows are one view. The native job makes the same cut, after the
        same checks in the same order (the layout whole, then the block ids)."""
        layers = _layer_memory(self.layout)
        runs = block_runs(self.block_ids)
        views: list[memoryview] = []
        for memory, page, row in layers:
            last = (memory.nbytes - page) // row  # the last block whose page fits the layer
            for first, count in runs:
                if first < 0 or first + count - 1 > last:
                    raise ValueError("a block id puts a page outside its layer's memory")
                if page == row:
                    views.append(memory[first * row : (first + count) * row])
                else:
                    views += [memory[b * row : b * row + page] for b in range(first, first + count)]
        return views


def _layer_memory(layout: PageLayout) -> list[tuple[memoryview, int, int]]:
    """(memory as bytes, page size, row size) of each layer, checked."""
    if not len(layout.layers) == len(layout.page_bytes) == len(layout.row_bytes):
        raise ValueError("a page layout needs one page size and one row size per layer")
    out = []
    for layer, page, row in zip(layout.layers, layout.page_bytes, layout.row_bytes, strict=True):
        memory = memoryview(layer)
        if memory.readonly or not memory.c_contiguous:
            raise TypeError("a layer must be a writable contiguous buffer")
        if not 0 < page <= row:
            raise ValueError("a page must be 1 to row_bytes bytes")
        out.append((memory.cast("B"), page, row))
    return out


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, length) of each run of consecutive ids, in order (the cut of :class:`Pages`
    and of the transfer engine's copies between buffers and pages)."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and block == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def body_bytes(body: Pages | Sequence[Any]) -> int:
    """Bytes of a body given as :class:`Pages` or as a sequence of buffers."""
    if isinstance(body, Pages):
        return body.nbytes
    return sum(memoryview(piece).nbytes for piece in body)


def body_pieces(body: Pages | Sequence[Any]) -> Sequence[Any]:
    """A body's pieces in order: a :class:`Pages`' views (checked), or the sequence itself."""
    return body.views() if isinstance(body, Pages) else body


class LoadTarget(NamedTuple):
    """Where one value goes. A value whose prefix starts with ``expected_prefix`` (when
    given) and whose header is ``expected_header`` lands with its prefix and header in
    ``head`` and its body in ``dests`` when its length is exactly theirs (``PAGES``); a value
    longer than ``max_len`` is dropped (``OVERSIZED``); any other value lands whole in
    ``staging`` (``STAGING``), or is dropped without one (``LAYOUT_MISMATCH``). The byte-level
    rules are :mod:`hma_redis.core.redis.wire`'s module docstring."""

    head: Any  # writable, >= 48 + the largest header expected
    expected_header: bytes | memoryview  # the exact msgpack header bytes a matching value has
    # The body's destinations in order: writable buffers (or ints: bytes to skip), or Pages.
    dests: Sequence[Any] | Pages
    staging: Any | None  # writable buffer for values that do not match, or None
    max_len: int  # longer values are drained and reported oversized
    # The first bytes (at most 48) a matching value's prefix must have, or None for any.
    expected_prefix: bytes | memoryview | None = None


class LoadResult(NamedTuple):
    status: LoadStatus
    value_len: int  # bytes of the value (oversized: its length); 0 when missing or an error
    header_len: int  # the prefix's header length field; -1 when no prefix was received
    crc_ok: bool  # CRC32C of header ‖ body equals the prefix's field (landed values only)
    landed: Landed | None
    error: str | None  # the error reply's text (status ERROR)


class PutResult(Enum):
    STORED = "stored"  # newly written by this call
    EXISTED = "existed"  # already there (content-addressed: same bytes)
    FAILED = "failed"  # not written (medium down, full, refused, deadline passed, ...)


class MediumJob(ABC):
    """One transfer job as its medium sees it: made by :meth:`BlockStore.start_job` when the
    job starts running, handed to each of the job's value calls, settled once after the last.

    ``deadline``: when every call of the job must have ended. The job's calls (its parts, run
    at once on several threads, and its batches) reach the medium's health as one outcome: the
    job is let through or not as a whole, once one of its calls met an outage the later ones
    fail without being sent, and :meth:`settle` reports the outcome once."""

    deadline: Deadline

    @abstractmethod
    def settle(self) -> None:
        """Report the job's outcome; called once, after every call of the job has returned."""


JobT = TypeVar("JobT", bound=MediumJob)


class BlockStore(ABC, Generic[JobT]):
    """What the transfer engine needs from a medium: four verbs (:meth:`exists`,
    :meth:`load_values`, :meth:`put_values`, :meth:`delete`), the job they run in
    (:meth:`start_job`) and the counters the engine adds to; the rest are hooks with no-op
    defaults. Thread safe: the engine calls it from its load, store and part threads at once.

    The data path a medium runs is chosen once, when it is built; the engine asks only whether
    loads may land in the KV cache's pages (:attr:`lands_in_place`) and passes no medium knob."""

    #: The namespace's counters (set by the medium); the engine adds its chunk and byte counts.
    counters: PendingCounters

    @abstractmethod
    def start_job(self, nbytes: int, since: float) -> JobT:
        """The job of value calls moving ``nbytes`` in all, submitted at ``since``
        (:func:`time.monotonic`): its deadline is the medium's own bound on two round trips
        moving those bytes, counted from ``since``."""

    @abstractmethod
    def exists(
        self,
        keys: Sequence[str],
        deadline: Deadline | None = None,
        operation: Operation = Operation.LOOKUP,
    ) -> list[bool]:
        """Which of ``keys`` exist, in key order; all ``False`` when the medium fails or
        ``deadline`` passes. ``operation``: what the call's time is a sample of."""

    @abstractmethod
    def load_values(
        self, keys: Sequence[str], targets: Sequence[LoadTarget], job: JobT
    ) -> list[LoadResult] | None:
        """Fetch every key's value into ``targets[i]``, one :class:`LoadResult` per key in key
        order. Writes only into the memory the targets name (head, dests, staging), and only
        as :class:`LoadTarget` says; checks nothing but the CRC32C (``crc_ok``) and, with
        ``expected_prefix``, the prefix: the MAC and a staged value are the caller's to judge.
        None when the medium failed or is off (every value is then a miss); the targets'
        memory may have been written all the same, the call returns only once nothing writes
        to it any more. Ends by the job's deadline."""

    @abstractmethod
    def put_values(
        self,
        keys: Sequence[str],
        heads: Sequence[Any],
        bodies: Sequence[Sequence[Any] | Pages],
        job: JobT,
    ) -> list[PutResult]:
        """Store ``heads[i]`` followed by ``bodies[i]`` (buffers, or :class:`Pages`) under
        ``keys[i]`` unless the key exists, whole or not at all; one :class:`PutResult` per
        key in key order, FAILED when the medium fails or the job's deadline passes (never
        raises for that). Each head is the codec's prefix and header with every field filled
        but the CRC32C, which this call computes over header and body and writes into the
        head. Reads the bodies in place until it returns."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> int:
        """Remove ``keys`` (values that failed validation: puts never replace a value); how
        many were removed, 0 when the medium fails."""

    # ------------------------------------------------------------------ hooks

    @property
    def lands_in_place(self) -> bool:
        """Whether :meth:`load_values` should receive bodies straight into the destinations
        a :class:`LoadTarget` names (the engine then zeroes the pages of a load that fails);
        False: the engine receives into buffers and copies once every value is valid."""
        return False

    def warm_up(self, parts: int) -> int:
        """Open what ``parts`` value calls at once need, ahead of the first job (best effort,
        never raises for the medium's failures); how many connections are then open."""
        return 0

    def flush(self) -> None:
        """Deliver the counters now (at shutdown); kept for later when the medium fails."""

    def account_stored(self, owner: str, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """Count values a :meth:`put_values` wrote (:attr:`PutResult.STORED` only, ``sizes``
        their bytes) against ``owner`` (a tenant id), where the medium keeps such an account;
        never raises for the medium's failures. Called by the store job's thread after its
        puts, only for jobs that name an owner. No-op by default."""

    def describe(self) -> str:
        """The data path value calls take, for the engine's start-up line."""
        return type(self).__name__

    def announce(self, line: str) -> None:
        """Log the engine's start-up ``line`` about the data path (INFO by default)."""
        logger.info("%s", line)
