"""The fleet publisher's changes as vLLM's own KV events (``vllm.distributed.kv_events``).

A chunk is announced as the tier's engines announce it (vLLM's offloading connector without
``self_describing_kv_events``): one ``BlockStored`` / ``BlockRemoved`` per run of changes of
one namespace and group, ``block_hashes`` the chunks' hashes as the key names carry them
(by default their low 64 bits as an int, as vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``
default gives them; else the bytes), ``medium`` ``STORAGE``, ``locality`` ``REMOTE``,
``ownership`` ``hma_redis:<namespace>``. Redis does not hold token ids or parents:
``token_ids`` is empty, ``parent_block_hash`` None and ``block_size`` 0, as in vLLM's own
placeholder events for offloaded chunks.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored

from hma_redis.tools.events.chunks import Change, Layout

_LOW_64 = (1 << 64) - 1
# vLLM's ``Locality.REMOTE.value`` (vllm.v1.kv_offload.base), what the engines send for Redis.
LOCALITY_REMOTE = "REMOTE"
OWNERSHIP_PREFIX = "hma_redis:"


class View(Enum):
    """Which changes a stream carries."""

    GROUPS = "groups"  # one event per group (group_idx set), as the engines emit
    USABLE = "usable"  # only chunks every group holds (group_idx None)


def block_hash(hash_hex: str, int_hashes: bool) -> int | bytes:
    """A key's block hash as vLLM's events carry it."""
    raw = bytes.fromhex(hash_hex)
    return int.from_bytes(raw, "big") & _LOW_64 if int_hashes else raw


def to_events(
    changes: Iterable[Change],
    view: View,
    layouts: dict[str, Layout],
    int_hashes: bool = True,
) -> list[BlockStored | BlockRemoved]:
    """The events of ``changes`` for ``view``, in order; consecutive changes of one kind,
    namespace and group share one event."""
    events: list[BlockStored | BlockRemoved] = []
    run: list[Change] = []
    for change in changes:
        if (change.group is None) != (view is View.USABLE):
            continue
        if run and _run_key(run[-1]) != _run_key(change):
            events.append(_event(run, layouts.get(run[0].namespace), int_hashes))
            run = []
        run.append(change)
    if run:
        events.append(_event(run, layouts.get(run[0].namespace), int_hashes))
    return events


def _run_key(change: Change) -> tuple[bool, str, int | None]:
    return change.stored, change.namespace, change.group


def _event(
    run: list[Change], layout: Layout | None, int_hashes: bool
) -> BlockStored | BlockRemoved:
    first = run[0]
    hashes = [block_hash(c.hash_hex, int_hashes) for c in run]
    ownership = OWNERSHIP_PREFIX + first.namespace
    locality = LOCALITY_REMOTE
    if not first.stored:
        return BlockRemoved(
            block_hashes=hashes,
            medium=MEDIUM_STORAGE,
            group_idx=first.group,
            locality=locality,
            ownership=ownership,
        )
    kind: str | None = None
    window: int | None = None
    if layout is not None and first.group is not None and first.group < len(layout.kinds):
        kind, window = layout.kinds[first.group], layout.windows[first.group]
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=MEDIUM_STORAGE,
        lora_name=None,
        group_idx=first.group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
        locality=locality,
        ownership=ownership,
    )
