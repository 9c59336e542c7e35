"""Counters kept per namespace in Redis (``<prefix>:<ns>:stats``), readable with HGETALL.

Deltas accumulate in memory and ride along on the next round trip the store makes anyway
(HINCRBY appended to its pipeline), so counting never costs a call per block. Deltas that could
not be delivered (Redis down) are kept and delivered later.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping

# Field names, for the CLI and the docs.
FIELDS = (
    "lookups",
    "lookup_keys",
    "hit_chunks",
    "miss_chunks",
    "stored_chunks",
    "stored_bytes",
    "store_existed_chunks",
    "store_failed_chunks",
    "loaded_chunks",
    "loaded_bytes",
    "load_failed_chunks",
    "load_failed_jobs",
    # Commands a healthy Redis refused (hma_redis.core.redis.breaker.Refusal); the tier stays on.
    "refused_noperm",
    "refused_oom",
    "refused_readonly",
    "refused_other",
    # Chunks Redis evicted, expired or deleted (from its keyspace notifications, every group).
    "removed_chunks",
    # admission "second_sighting": chunks left unstored (first sighting) and stored.
    "admission_deferred",
    "admission_admitted",
    # Pins (kv_transfer_params hma_redis_pin_s): requests that asked while pinning is off, or
    # with a value that is not a positive integer (both served unpinned), or for longer than
    # pin_max_s (shortened); chunks pinned, and left unpinned over pin_budget_bytes.
    "pin_off_requests",
    "pin_invalid_requests",
    "pin_clamped_requests",
    "pin_chunks",
    "pin_over_budget_chunks",
    # Per-tenant quotas: chunks not stored because their request's tenant held its budget.
    "quota_refused_chunks",
    # Per KV group N (not listed): g<N>_hit_chunks, g<N>_usable_chunks (see adapter/metrics).
)


class PendingCounters:
    """Thread-safe counter deltas waiting to be added to Redis."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()  # everything ever counted in this process

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                if delta:
                    self._pending[name] += delta
                    self.totals[name] += delta

    def snapshot(self) -> dict[str, int]:
        """Everything counted in this process so far (a consistent copy of :attr:`totals`)."""
        with self._lock:
            return dict(self.totals)

    def take(self) -> dict[str, int]:
        with self._lock:
            pending = dict(self._pending)
            self._pending.clear()
        return pending

    def restore(self, deltas: Mapping[str, int]) -> None:
        """Put back deltas whose delivery failed."""
        with self._lock:
            self._pending.update(deltas)
