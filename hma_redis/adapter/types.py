"""Small types the adapter's modules share (no imports of the other adapter modules)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm.v1.kv_offload.base import LoadStoreSpec, OffloadKey


class RedisLoadStoreSpec(LoadStoreSpec):
    """What each worker transfers: offload keys in vLLM's order (grouped by KV group).

    Each worker derives its own Redis key (with its rank) from every offload key.
    ``known_absent`` (stores only): the keys Redis answered missing to this manager's lookup
    moments ago; the store job sends them without asking Redis again (``SET NX`` still leaves
    a value another instance stored in between as it is). ``tenant`` (stores only, with
    ``tenant_quotas``): the tenant id the chunks written are counted against (never the salt).
    """

    def __init__(
        self,
        keys: Iterable[OffloadKey],
        known_absent: Iterable[OffloadKey] = (),
        tenant: str | None = None,
    ):
        self.keys: list[bytes] = [bytes(k) for k in keys]
        self.known_absent: frozenset[bytes] = frozenset(bytes(k) for k in known_absent)
        self.tenant = tenant

    def __repr__(self) -> str:
        return f"RedisLoadStoreSpec({len(self.keys)} keys)"


@dataclass
class ManagerStats:
    """The scheduler side's cumulative counts (exported by :mod:`hma_redis.adapter.metrics`)."""

    lookup_round_trips: int = 0
    keys_looked_up: int = 0
    hit_keys: int = 0
    miss_keys: int = 0
    store_skipped_present: int = 0
    failed_loads: int = 0
    # In-flight store marks dropped after store_pending_timeout_s (vLLM never completed them).
    stale_store_marks: int = 0
