"""What the fleet publisher believes Redis holds, and which changes of it a router must hear.

A chunk of a namespace is one block hash; Redis holds one key per (group, rank) of it
(:mod:`hma_redis.core.keys`). :class:`ChunkTable` records which of those keys exist and turns a
key written or removed into :class:`Change` records for two views:

* **per group** (``group`` set): group ``g`` of the chunk is present once every rank's key of
  ``g`` is (a tensor-parallel deployment writes one key per rank; one rank's key alone loads
  nothing), absent as soon as one is gone;
* **usable** (``group`` None): every group of the namespace is present, which is what a load
  needs (vLLM takes the intersection over groups); it stops the moment one group's key goes.

The number of groups and ranks comes from the namespace's info hash (its fingerprint); until it
is known, a chunk is never usable, and a group is complete with its rank-0 key.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from hma_redis.core.keys import KeySpace, parse_block_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """A namespace's shape as its info hash says it."""

    num_groups: int
    world_size: int
    # Per group: vLLM's KV-cache spec kind and sliding window (None: not one).
    kinds: tuple[str | None, ...] = ()
    windows: tuple[int | None, ...] = ()

    @staticmethod
    def from_info(fields: dict[str, str]) -> Layout | None:
        """The layout of an info hash; None if its fields are missing or not numbers."""
        try:
            groups = int(fields["num_groups"])
            world = int(fields.get("world_size", "1"))
        except (KeyError, ValueError):
            return None
        if groups < 1 or world < 1:
            return None
        kinds: list[str | None] = []
        windows: list[int | None] = []
        for idx in range(groups):
            kind, _, window = fields.get(f"g{idx}.kind", "").partition(":")
            kinds.append(kind or None)
            windows.append(int(window) if window.isdigit() else None)
        return Layout(groups, world, tuple(kinds), tuple(windows))


@dataclass(frozen=True)
class Change:
    """One transition a router hears of: ``group`` (None: the usable view) of the chunk
    ``hash_hex`` of ``namespace`` became present (``stored``) or absent."""

    namespace: str
    hash_hex: str
    group: int | None
    stored: bool


# A chunk's keys present are the bits of one int: bit ``rank * MAX_GROUPS + group``.
MAX_GROUPS = 64


class ChunkTable:
    """The chunk keys believed present, per namespace and block hash.

    Memory: one dict entry per chunk (all its groups and ranks together, as bits of an int;
    the hash as bytes), on the order of 200 bytes per chunk; the table is the fleet's index, as
    a router's own is. A key of a group beyond ``MAX_GROUPS`` is ignored.
    """

    def __init__(self, prefix: str, namespace: str | None = None) -> None:
        self._prefix = prefix
        self._namespace = namespace
        self._chunks: dict[tuple[str, bytes], int] = {}
        self._count = 0  # keys present
        # Per namespace: whether its keys carry a rank (``:r<rank>``, world_size > 1).
        self._ranked: dict[str, bool] = {}
        self._layouts: dict[str, Layout] = {}

    def __len__(self) -> int:
        return self._count

    def keys(self) -> frozenset[str]:
        """Every key believed present, as Redis names it (built again from the table)."""
        out: set[str] = set()
        for (namespace, raw), bits in self._chunks.items():
            base = f"{self._prefix}:{namespace}:g"
            ranked = self._ranked.get(namespace, False)
            for group, rank in _parts(bits):
                key = f"{base}{group}:{raw.hex()}"
                out.add(f"{key}:r{rank}" if ranked else key)
        return frozenset(out)

    def layout(self, namespace: str) -> Layout | None:
        return self._layouts.get(namespace)

    def layouts(self) -> dict[str, Layout]:
        """Every layout learnt, by namespace."""
        return dict(self._layouts)

    def set_layout(self, namespace: str, layout: Layout) -> list[Change]:
        """Learn a namespace's layout; the changes it causes (chunks it makes usable or
        complete; groups that were complete with rank 0 alone and are not)."""
        before = {ident: self._states(ident) for ident in self._chunks if ident[0] == namespace}
        self._layouts[namespace] = layout
        out: list[Change] = []
        for ident, old in before.items():
            out += _diff(ident, old, self._states(ident))
        return out

    def clear(self) -> None:
        """Forget every key (Redis lost its data set)."""
        self._chunks.clear()
        self._count = 0

    def apply(self, key: str, stored: bool) -> list[Change]:
        """A key written or removed: the changes of both views. A key that is no chunk key
        of the namespace scope, one written twice, one removed while not known: none."""
        parts = parse_block_key(key)
        if parts is None or parts.prefix != self._prefix or parts.group >= MAX_GROUPS:
            return []
        if self._namespace is not None and parts.namespace != self._namespace:
            return []
        if not KeySpace(self._prefix, parts.namespace).is_block_key(key):
            return []  # parse_block_key is lenient (":x1" as rank 0, "g01" as group 1)
        ident = (sys.intern(parts.namespace), bytes.fromhex(parts.hash_hex))
        bits = self._chunks.get(ident, 0)
        bit = 1 << (parts.rank * MAX_GROUPS + parts.group)
        if stored == bool(bits & bit):
            return []
        self._ranked.setdefault(ident[0], key.count(":") == 4)
        old = self._states(ident)
        bits ^= bit
        self._count += 1 if stored else -1
        if bits:
            self._chunks[ident] = bits
        else:
            del self._chunks[ident]
        return _diff(ident, old, self._states(ident))

    def _states(self, ident: tuple[str, bytes]) -> dict[int | None, bool]:
        """Per group (and None: usable), whether the chunk is present."""
        bits = self._chunks.get(ident, 0)
        layout = self._layouts.get(ident[0])
        world = layout.world_size if layout is not None else 1
        groups = {g for g, _ in _parts(bits)}
        if layout is not None:
            groups |= set(range(layout.num_groups))
        states: dict[int | None, bool] = {
            g: all(bits >> (r * MAX_GROUPS + g) & 1 for r in range(world)) for g in groups
        }
        states[None] = layout is not None and all(states[g] for g in range(layout.num_groups))
        return states


def _parts(bits: int) -> list[tuple[int, int]]:
    """The (group, rank) pairs of a chunk's bits."""
    out: list[tuple[int, int]] = []
    while bits:
        low = bits & -bits
        index = low.bit_length() - 1
        out.append((index % MAX_GROUPS, index // MAX_GROUPS))
        bits ^= low
    return out


def _diff(
    ident: tuple[str, bytes], old: dict[int | None, bool], new: dict[int | None, bool]
) -> list[Change]:
    namespace, raw = ident
    out: list[Change] = []
    for group in sorted(set(old) | set(new), key=lambda g: -1 if g is None else g):
        was, now = old.get(group, False), new.get(group, False)
        if was != now:
            out.append(Change(namespace, raw.hex(), group, now))
    return out
