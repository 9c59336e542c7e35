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
from dataclasses import dataclass, field

from hma_redis.core.keys import parse_block_key

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


@dataclass
class _Chunk:
    parts: set[tuple[int, int]] = field(default_factory=set)  # (group, rank) keys present


class ChunkTable:
    """The chunk keys believed present, per namespace and block hash.

    Memory is one entry per key Redis holds (about 150 bytes each): the table is the fleet's
    index, as a router's own is.
    """

    def __init__(self, prefix: str, namespace: str | None = None) -> None:
        self._prefix = prefix
        self._namespace = namespace
        self._chunks: dict[tuple[str, str], _Chunk] = {}
        self._keys: set[str] = set()
        self._layouts: dict[str, Layout] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> frozenset[str]:
        return frozenset(self._keys)

    def namespaces(self) -> set[str]:
        return {ns for ns, _ in self._chunks}

    def layout(self, namespace: str) -> Layout | None:
        return self._layouts.get(namespace)

    def layouts(self) -> dict[str, Layout]:
        """Every layout learnt, by namespace."""
        return dict(self._layouts)

    def set_layout(self, namespace: str, layout: Layout) -> list[Change]:
        """Learn a namespace's layout; the changes it causes (chunks it makes usable or
        complete; groups that were complete with rank 0 alone and are not)."""
        before = {key: self._states(*key) for key in self._chunks if key[0] == namespace}
        self._layouts[namespace] = layout
        out: list[Change] = []
        for key, old in before.items():
            out += self._diff(key, old, self._states(*key))
        return out

    def clear(self) -> None:
        """Forget every key (Redis lost its data set)."""
        self._chunks.clear()
        self._keys.clear()

    def apply(self, key: str, stored: bool) -> list[Change]:
        """A key written or removed: the changes of both views. A key that is no chunk key
        of the namespace scope, one written twice, one removed while not known: none."""
        parts = parse_block_key(key)
        if parts is None or parts.prefix != self._prefix:
            return []
        if self._namespace is not None and parts.namespace != self._namespace:
            return []
        if stored == (key in self._keys):
            return []
        ident = (parts.namespace, parts.hash_hex)
        chunk = self._chunks.setdefault(ident, _Chunk())
        old = self._states(*ident)
        if stored:
            self._keys.add(key)
            chunk.parts.add((parts.group, parts.rank))
        else:
            self._keys.discard(key)
            chunk.parts.discard((parts.group, parts.rank))
        new = self._states(*ident)
        if not chunk.parts:
            del self._chunks[ident]
        return self._diff(ident, old, new)

    def _states(self, namespace: str, hash_hex: str) -> dict[int | None, bool]:
        """Per group (and None: usable), whether the chunk is present."""
        chunk = self._chunks.get((namespace, hash_hex))
        parts = chunk.parts if chunk is not None else set()
        layout = self._layouts.get(namespace)
        world = layout.world_size if layout is not None else 1
        groups = {g for g, _ in parts}
        if layout is not None:
            groups |= set(range(layout.num_groups))
        states: dict[int | None, bool] = {
            g: all((g, r) in parts for r in range(world)) for g in groups
        }
        states[None] = layout is not None and all(states[g] for g in range(layout.num_groups))
        return states

    @staticmethod
    def _diff(
        ident: tuple[str, str], old: dict[int | None, bool], new: dict[int | None, bool]
    ) -> list[Change]:
        namespace, hash_hex = ident
        out: list[Change] = []
        for group in sorted(set(old) | set(new), key=lambda g: -1 if g is None else g):
            was, now = old.get(group, False), new.get(group, False)
            if was != now:
                out.append(Change(namespace, hash_hex, group, now))
        return out
