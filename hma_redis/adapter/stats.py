"""The scheduler side's counts: one method per event, each event counted here and only here.

An event's one method writes every sink it reaches: the cumulative totals that
:meth:`SchedulerStats.report` turns into vLLM's Prometheus deltas (:mod:`hma_redis.adapter.metrics`
names them), and the scheduler store's :class:`~hma_redis.core.counters.PendingCounters`, whose
deltas ride on the store's next round trip to the namespace's stats hash (``hma-redis info``):

* ``lookup_batch_sent``: ``lookup_round_trips``, ``keys_looked_up`` (metrics only);
* ``lookup_batch_answered``: ``hit_keys``, ``miss_keys``; the hash's ``lookups``,
  ``lookup_keys``, ``hit_chunks``, ``miss_chunks``;
* ``stores_skipped``, ``load_failed``: ``store_skipped_present``, ``failed_loads`` (metrics);
* ``admission_decided``: ``admission_deferred`` (both); the hash's ``admission_admitted``;
* ``chunks_removed``: ``removed_chunks`` (both);
* ``request_reached``: per group, ``group_hit_chunks`` / ``group_usable_chunks``; the hash's
  ``g<N>_hit_chunks`` / ``g<N>_usable_chunks``;
* ``pin_off``, ``pin_invalid``, ``pin_clamped``, ``pins_taken``: the hash's ``pin_*`` counters
  (the metrics read them back: :data:`~hma_redis.adapter.metrics.PIN_COUNTERS`);
* ``quota_refused``: per tenant label (:func:`~hma_redis.adapter.metrics.tenant_label`),
  ``quota_refused_chunks``; the hash's ``quota_refused_chunks``;
* ``stale_store_mark``, ``removal_overflow``: kept in memory only.

A lookup batch is two events: sent (the metrics show a step's round trip at once) and answered
by Redis, on the lookups' thread (the hash counts it then: its counts ride on a later round
trip, never on the batch's own call).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from hma_redis.adapter.metrics import ManagerDetailStats, ManagerMetrics, TenantLabels
from hma_redis.adapter.types import ManagerStats
from hma_redis.core.counters import PendingCounters
from hma_redis.core.latency import LatencySamples
from hma_redis.core.redis.memory import TierMemory

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )


class GroupReach(NamedTuple):
    """How far one finished request's hits reached in one KV group, in chunks of that group:
    its own hits, and those inside every group's reach (the only ones vLLM can load)."""

    group: int
    hit_chunks: int
    usable_chunks: int


class SchedulerStats:
    """Counts the scheduler side's events, and reports them.

    Thread-safe: the lookups' thread counts answered batches, the pins' thread pins taken,
    the scheduler's thread everything else. :attr:`totals` and :attr:`detail` are the live
    cumulative counts (read them, never write them).
    """

    def __init__(self, counters: PendingCounters) -> None:
        """``counters``: the scheduler store's counters (delivered to its stats hash)."""
        self.totals = ManagerStats()
        self.detail = ManagerDetailStats()
        self._counters = counters
        self._lock = threading.Lock()
        self._metrics = ManagerMetrics()
        self.tenant_labels = TenantLabels()

    # ------------------------------------------------------------------ lookups

    def lookup_batch_sent(self, keys: int) -> None:
        """A lookup batch of ``keys`` chunk keys left for Redis (one round trip)."""
        with self._lock:
            self.totals.lookup_round_trips += 1
            self.totals.keys_looked_up += keys

    def lookup_batch_answered(self, keys: int, hits: int) -> None:
        """Redis answered a batch of ``keys`` chunk keys, ``hits`` of them present (a failed
        call answers none present)."""
        with self._lock:
            self.totals.hit_keys += hits
            self.totals.miss_keys += keys - hits
        self._counters.add(lookups=1, lookup_keys=keys, hit_chunks=hits, miss_chunks=keys - hits)

    # ------------------------------------------------------------------ stores, loads

    def stores_skipped(self, chunks: int) -> None:
        """``chunks`` offered for storing went to no store job: known present, or a store of
        them in flight here."""
        with self._lock:
            self.totals.store_skipped_present += chunks

    def stale_store_mark(self) -> None:
        """An in-flight store mark was dropped after store_pending_timeout_s."""
        with self._lock:
            self.totals.stale_store_marks += 1

    def admission_decided(self, deferred: int, admitted: int) -> None:
        """second_sighting, one offer of chunks for storing: ``deferred`` left unstored (seen
        once), ``admitted`` stored (seen before)."""
        with self._lock:
            self.detail.admission_deferred += deferred
        self._counters.add(admission_deferred=deferred, admission_admitted=admitted)

    def load_failed(self) -> None:
        """A request's load failed (its tokens are recomputed)."""
        with self._lock:
            self.totals.failed_loads += 1

    # ------------------------------------------------------------------ removals

    def removal_overflow(self) -> None:
        """Removals were lost (the watcher's queue overflowed or its connection dropped)."""
        with self._lock:
            self.detail.removal_overflows += 1

    def chunks_removed(self, chunks: int) -> None:
        """``chunks`` offload keys (every group of each removed chunk) were announced removed."""
        with self._lock:
            self.detail.removed_chunks += chunks
        self._counters.add(removed_chunks=chunks)

    # ------------------------------------------------------------------ intersection

    def request_reached(self, reaches: Iterable[GroupReach]) -> None:
        """One request is done (finished, or still open at shutdown): its reach per group."""
        deltas: dict[str, int] = {}
        with self._lock:
            for reach in reaches:
                self.detail.group_hit_chunks[reach.group] += reach.hit_chunks
                self.detail.group_usable_chunks[reach.group] += reach.usable_chunks
                deltas[f"g{reach.group}_hit_chunks"] = reach.hit_chunks
                deltas[f"g{reach.group}_usable_chunks"] = reach.usable_chunks
        self._counters.add(**deltas)

    # ------------------------------------------------------------------ pins

    def pin_off(self) -> None:
        """A request asked for a pin while pinning is off (served unpinned)."""
        self._counters.add(pin_off_requests=1)

    def pin_invalid(self) -> None:
        """A request's pin is not a positive integer of seconds (served unpinned)."""
        self._counters.add(pin_invalid_requests=1)

    def pin_clamped(self) -> None:
        """A request asked for a pin longer than pin_max_s (pinned for pin_max_s)."""
        self._counters.add(pin_clamped_requests=1)

    def pins_taken(self, pinned: int, over_budget: int) -> None:
        """One pin job: ``pinned`` chunk keys pinned or renewed, ``over_budget`` left
        unpinned (the namespace's pin budget was full)."""
        self._counters.add(pin_chunks=pinned, pin_over_budget_chunks=over_budget)

    # ------------------------------------------------------------------ quotas

    def quota_refused(self, tenant: str, chunks: int) -> None:
        """``chunks`` of a request of ``tenant`` were not stored: it holds its budget."""
        label = self.tenant_labels.label(tenant)
        with self._lock:
            self.detail.quota_refused_chunks[label] += chunks
        self._counters.add(quota_refused_chunks=chunks)

    # ------------------------------------------------------------------ report

    def report(
        self,
        *,
        errors: int,
        available: bool,
        latency: LatencySamples | None = None,
        memory: TierMemory | None = None,
        tenant_used: Mapping[str, int] | None = None,
    ) -> OffloadingConnectorStats | None:
        """vLLM's metrics: what changed since the last report, or None if nothing did (see
        :meth:`~hma_redis.adapter.metrics.ManagerMetrics.collect` for the arguments; the
        refusal and pin counters come from the store's counters). ``tenant_used``: the
        tenants' bytes (quotas), by tenant id; reported by label."""
        with self._lock:
            totals = replace(self.totals)
            detail = replace(
                self.detail,
                group_hit_chunks=self.detail.group_hit_chunks.copy(),
                group_usable_chunks=self.detail.group_usable_chunks.copy(),
                quota_refused_chunks=self.detail.quota_refused_chunks.copy(),
            )
        return self._metrics.collect(
            totals,
            errors=errors,
            available=available,
            refusals=self._counters.snapshot(),
            detail=detail,
            latency=latency,
            memory=memory,
            tenant_used=self.tenant_labels.by_label(tenant_used) if tenant_used else None,
        )
