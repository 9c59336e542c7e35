"""What a chunk looks like in vLLM's primary tier.

The primary tier (``TieringOffloadingSpec``) holds one row per chunk in a shared host-memory
region: every worker's pages of the chunk side by side (one copy with the replicated MLA
layout), padded to the region's alignment. A secondary tier stores the row's payload (the
padding left out) as one Redis value. Those bytes differ from the direct spec's values (one
value per worker there), so the tier's namespace is derived with the row's layout in place of
the KV-cache layout and ends in ``.tiering`` (:mod:`hma_redis.adapter.namespace`): the two
modes never read each other's values.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadingSpec


@dataclass(frozen=True)
class PrimaryRowLayout:
    """One chunk's row in the primary buffer."""

    # Bytes of KV in a row: every worker's pages (``copies`` of ``bytes_per_copy``).
    payload_bytes: int
    copies: int
    replicated: bool
    canonical: bool
    kv_cache_layout: str

    @classmethod
    def of(cls, spec: OffloadingSpec) -> PrimaryRowLayout:
        """The layout vLLM's CPU spec computed (``cpu_page_size_per_worker`` per copy)."""
        replicated = bool(getattr(spec, "replicated_layout", False))
        copies = 1 if replicated else spec.config.parallel.world_size
        per_copy = int(getattr(spec, "cpu_page_size_per_worker", 0))
        if per_copy <= 0:
            raise ValueError(
                "hma_redis: the Redis secondary tier needs TieringOffloadingSpec's primary tier "
                "(its cpu_page_size_per_worker is unknown)"
            )
        return cls(
            payload_bytes=per_copy * copies,
            copies=copies,
            replicated=replicated,
            canonical=bool(spec.config.canonical_layout),
            kv_cache_layout=spec.config.kv_cache_layout or "",
        )

    def describe(self) -> str:
        """The layout as one string: in every value's header (checked on each load) and in
        the namespace fingerprint."""
        return (
            f"tiering(payload={self.payload_bytes},copies={self.copies},"
            f"replicated={int(self.replicated)},canonical={int(self.canonical)},"
            f"kv_cache_layout={self.kv_cache_layout})"
        )
