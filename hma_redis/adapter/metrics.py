"""hma_redis' Prometheus metrics, emitted through vLLM's offloading-connector metrics hooks.

vLLM's ``OffloadingConnector`` already turns every transfer result into
``vllm:kv_offload_{load,store}_{bytes,time}`` counters and ``vllm:kv_offload_{load,store}_size``
histograms (our worker reports each job's bytes and seconds), and the engine counts
``vllm:external_prefix_cache_{queries,hits}`` in tokens. This module adds what only hma_redis
knows, under vLLM's naming scheme for offloading backends (``vllm:kv_offload_<backend>_*``; the
exposition adds ``_total`` to counters):

scheduler side (the manager's :class:`~hma_redis.adapter.types.ManagerStats`, via ``get_stats``)
    ``vllm:kv_offload_redis_lookups``          Redis round trips made for lookups
    ``vllm:kv_offload_redis_chunk_queries``    chunk keys (one per KV group) asked of Redis
    ``vllm:kv_offload_redis_chunk_hits``       ... found in Redis
    ``vllm:kv_offload_redis_chunk_misses``     ... not found (or Redis unreachable)
    ``vllm:kv_offload_redis_stores_skipped``   chunks the scheduler did not send to a store job:
                                               known present or being stored
    ``vllm:kv_offload_redis_load_failures``    requests whose load failed and were recomputed
    ``vllm:kv_offload_redis_errors``           failed Redis calls of the scheduler (timeouts, ...)
    ``vllm:kv_offload_redis_available``        gauge: 1 while the scheduler reaches Redis, else 0
    ``vllm:kv_offload_redis_used_memory_bytes``  gauge: Redis' used_memory, summed over a
                                               Cluster's masters (hma_redis.core.redis.memory; asked
                                               at most every 10 s, off the scheduler's thread;
                                               absent where the ACL refuses INFO)
    ``vllm:kv_offload_redis_max_memory_bytes``   gauge: their maxmemory summed; 0: no limit
    ``vllm:kv_offload_redis_removed_chunks``   chunks Redis evicted, expired or deleted (from its
                                               keyspace notifications; one per KV group)
    ``vllm:kv_offload_redis_admission_deferred``  chunks not stored: seen once (second_sighting)
    ``vllm:kv_offload_redis_pin_*``            pins: requests that asked while pinning is off,
                                               with an invalid value, or for more than
                                               pin_max_s; chunks pinned, and left unpinned over
                                               pin_budget_bytes (the scheduler store's
                                               counters, PIN_COUNTERS)
    ``vllm:kv_offload_redis_quota_refused_chunks{tenant=...}``  chunks not stored: their
                                               request's tenant held its byte budget
    ``vllm:kv_offload_redis_tenant_used_bytes{tenant=...}``  gauge: the tenant's bytes in the
                                               account (tenant_quotas; read every
                                               quota_refresh_interval_s)
                                               The ``tenant`` label is a tenant id (never the
                                               salt): the first MAX_TENANT_LABELS tenants an
                                               engine meets keep their own, later ones share
                                               ``other``, so the series stay bounded
    ``vllm:kv_offload_redis_group_hit_chunks{group="g<N>"}``     per finished request, the
                                               chunks of group N its hits in Redis reached
    ``vllm:kv_offload_redis_usable_hit_chunks{group="g<N>"}``    ... of those, the chunks
                                               every group reached (the intersection: the only
                                               ones vLLM can load); the difference is what the
                                               intersection throws away

worker side (the worker store's :class:`~hma_redis.core.counters.PendingCounters`, reported by the
connector's worker-side ``get_kv_connector_stats``, which vLLM ships to the scheduler with each
model-runner output and sums over workers)
    ``vllm:kv_offload_redis_stored_chunks``          chunks written to Redis
    ``vllm:kv_offload_redis_store_existed_chunks``   chunks Redis held already (any instance's)
    ``vllm:kv_offload_redis_store_failed_chunks``    chunks that could not be written (dropped)
    ``vllm:kv_offload_redis_loaded_chunks``          chunks read from Redis into the KV cache
    ``vllm:kv_offload_redis_load_failed_chunks``     chunks missing, invalid or unreadable at load

both sides (each store's :class:`~hma_redis.core.counters.PendingCounters` and
:class:`~hma_redis.core.latency.LatencySamples`)
    ``vllm:kv_offload_redis_refused{kind=...}``  commands a healthy Redis refused, by kind (a
                                               refusal never turns the tier off, see
                                               hma_redis.core.redis.breaker): ``noperm`` (ACL),
                                               ``oom`` (maxmemory under noeviction),
                                               ``readonly`` (a replica), ``other`` (WRONGTYPE,
                                               ERR ...); ``hma-redis info`` counts each as
                                               ``refused_<kind>``
    ``vllm:kv_offload_redis_round_trip_seconds{operation=...}``  histogram: seconds of each
                                               Redis call Redis answered, by ``lookup``,
                                               ``load``, ``store`` (see hma_redis.core.latency)

Every counter is a delta since the previous report, as vLLM's stats payload expects; histogram
samples are reported once each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from hma_redis.adapter.types import ManagerStats
from hma_redis.core.counters import PendingCounters
from hma_redis.core.latency import LatencySamples
from hma_redis.core.redis.breaker import Refusal
from hma_redis.core.redis.memory import TierMemory

PREFIX = "vllm:kv_offload_redis_"


class RedisMetricName:
    """Metric names (counters are exposed with a ``_total`` suffix)."""

    LOOKUPS = PREFIX + "lookups"
    CHUNK_QUERIES = PREFIX + "chunk_queries"
    CHUNK_HITS = PREFIX + "chunk_hits"
    CHUNK_MISSES = PREFIX + "chunk_misses"
    STORES_SKIPPED = PREFIX + "stores_skipped"
    LOAD_FAILURES = PREFIX + "load_failures"
    ERRORS = PREFIX + "errors"
    AVAILABLE = PREFIX + "available"
    USED_MEMORY_BYTES = PREFIX + "used_memory_bytes"
    MAX_MEMORY_BYTES = PREFIX + "max_memory_bytes"
    STORED_CHUNKS = PREFIX + "stored_chunks"
    STORE_EXISTED_CHUNKS = PREFIX + "store_existed_chunks"
    STORE_FAILED_CHUNKS = PREFIX + "store_failed_chunks"
    LOADED_CHUNKS = PREFIX + "loaded_chunks"
    LOAD_FAILED_CHUNKS = PREFIX + "load_failed_chunks"
    REFUSED = PREFIX + "refused"
    ROUND_TRIP_SECONDS = PREFIX + "round_trip_seconds"
    REMOVED_CHUNKS = PREFIX + "removed_chunks"
    ADMISSION_DEFERRED = PREFIX + "admission_deferred"
    GROUP_HIT_CHUNKS = PREFIX + "group_hit_chunks"
    USABLE_HIT_CHUNKS = PREFIX + "usable_hit_chunks"
    PIN_OFF_REQUESTS = PREFIX + "pin_off_requests"
    PIN_INVALID_REQUESTS = PREFIX + "pin_invalid_requests"
    PIN_CLAMPED_REQUESTS = PREFIX + "pin_clamped_requests"
    PIN_CHUNKS = PREFIX + "pin_chunks"
    PIN_OVER_BUDGET_CHUNKS = PREFIX + "pin_over_budget_chunks"
    QUOTA_REFUSED_CHUNKS = PREFIX + "quota_refused_chunks"
    TENANT_USED_BYTES = PREFIX + "tenant_used_bytes"


# Tenants with a label of their own per engine; the others share OTHER_TENANT.
MAX_TENANT_LABELS = 16
OTHER_TENANT = "other"


class TenantLabels:
    """The ``tenant`` label of each tenant id: its own for the first :data:`MAX_TENANT_LABELS`
    met (for the process' life: a counter's series never changes hands), ``other`` after."""

    def __init__(self, limit: int = MAX_TENANT_LABELS) -> None:
        self._limit = limit
        self._own: dict[str, None] = {}

    def label(self, tenant: str) -> str:
        if tenant in self._own:
            return tenant
        if len(self._own) < self._limit:
            self._own[tenant] = None
            return tenant
        return OTHER_TENANT

    def by_label(self, values: Mapping[str, int]) -> dict[str, int]:
        """``values`` by tenant id, summed by label."""
        out: Counter[str] = Counter()
        for tenant, value in values.items():
            out[self.label(tenant)] += value
        return dict(out)


@dataclass
class ManagerDetailStats:
    """The scheduler side's cumulative counts of removals, admission and the intersection
    (kept apart from :class:`ManagerStats`, whose module is shared)."""

    removed_chunks: int = 0
    # Times the removal queue overflowed (or a notification connection dropped): every cached
    # answer was forgotten.
    removal_overflows: int = 0
    admission_deferred: int = 0
    # Per KV group: chunks finished requests' hits reached, and those every group reached.
    group_hit_chunks: Counter[int] = field(default_factory=Counter)
    group_usable_chunks: Counter[int] = field(default_factory=Counter)
    # Per tenant label: chunks not stored because the tenant held its budget.
    quota_refused_chunks: Counter[str] = field(default_factory=Counter)


# ManagerDetailStats scalar field -> counter, with its help text.
DETAIL_COUNTERS: dict[str, tuple[str, str]] = {
    "removed_chunks": (
        RedisMetricName.REMOVED_CHUNKS,
        "KV chunks (one per KV-cache group) Redis evicted, expired or deleted.",
    ),
    "admission_deferred": (
        RedisMetricName.ADMISSION_DEFERRED,
        "KV chunks not stored because no instance had seen them before (second_sighting).",
    ),
}
# ManagerDetailStats per-group field -> counter labelled by group, with its help text.
GROUP_COUNTERS: dict[str, tuple[str, str]] = {
    "group_hit_chunks": (
        RedisMetricName.GROUP_HIT_CHUNKS,
        "Per finished request: the chunks of this KV group its hits in Redis reached.",
    ),
    "group_usable_chunks": (
        RedisMetricName.USABLE_HIT_CHUNKS,
        "Per finished request: the chunks of this KV group that every group's hits reached "
        "(the intersection vLLM can load).",
    ),
}


# PendingCounters field (scheduler process) -> counter, with its help text: what became of the
# pins requests asked for (the manager counts them; they reach the stats hash too).
PIN_COUNTERS: dict[str, tuple[str, str]] = {
    "pin_off_requests": (
        RedisMetricName.PIN_OFF_REQUESTS,
        "Requests that asked for a pin (kv_transfer_params hma_redis_pin_s) while pinning is "
        "off; served unpinned.",
    ),
    "pin_invalid_requests": (
        RedisMetricName.PIN_INVALID_REQUESTS,
        "Requests whose hma_redis_pin_s is not a positive integer of seconds; served unpinned.",
    ),
    "pin_clamped_requests": (
        RedisMetricName.PIN_CLAMPED_REQUESTS,
        "Requests that asked for a pin longer than pin_max_s; pinned for pin_max_s.",
    ),
    "pin_chunks": (
        RedisMetricName.PIN_CHUNKS,
        "KV chunks pinned, or their pin renewed, for a request.",
    ),
    "pin_over_budget_chunks": (
        RedisMetricName.PIN_OVER_BUDGET_CHUNKS,
        "KV chunks a request asked to pin that were served unpinned: the namespace's pins "
        "held pin_budget_bytes.",
    ),
}


# ManagerStats field -> counter, with its help text.
MANAGER_COUNTERS: dict[str, tuple[str, str]] = {
    "lookup_round_trips": (
        RedisMetricName.LOOKUPS,
        "Redis round trips made by the scheduler to look up KV chunks (at most one per step).",
    ),
    "keys_looked_up": (
        RedisMetricName.CHUNK_QUERIES,
        "KV chunks (one per KV-cache group) looked up in Redis.",
    ),
    "hit_keys": (RedisMetricName.CHUNK_HITS, "KV chunks looked up and found in Redis."),
    "miss_keys": (
        RedisMetricName.CHUNK_MISSES,
        "KV chunks looked up and not found in Redis (or Redis unreachable).",
    ),
    "store_skipped_present": (
        RedisMetricName.STORES_SKIPPED,
        "KV chunks the scheduler sent to no store job: a lookup found them in Redis or a "
        "store of them is in flight (store_existed_chunks counts those a store job found).",
    ),
    "failed_loads": (
        RedisMetricName.LOAD_FAILURES,
        "Requests whose load from Redis failed; their tokens were recomputed.",
    ),
}

# PendingCounters field (worker process) -> counter, with its help text.
WORKER_COUNTERS: dict[str, tuple[str, str]] = {
    "stored_chunks": (RedisMetricName.STORED_CHUNKS, "KV chunks written to Redis."),
    "store_existed_chunks": (
        RedisMetricName.STORE_EXISTED_CHUNKS,
        "KV chunks not written because Redis held them already (stored earlier by any "
        "instance, this one included).",
    ),
    "store_failed_chunks": (
        RedisMetricName.STORE_FAILED_CHUNKS,
        "KV chunks that could not be written to Redis and were dropped.",
    ),
    "loaded_chunks": (RedisMetricName.LOADED_CHUNKS, "KV chunks read from Redis."),
    "load_failed_chunks": (
        RedisMetricName.LOAD_FAILED_CHUNKS,
        "KV chunks missing, invalid or unreadable when loaded (recomputed instead).",
    ),
}

# Refusal kind (the ``kind`` label; PendingCounters field ``refused_<kind>``, either process)
# -> what it means.
REFUSAL_KINDS: dict[str, str] = {
    Refusal.NOPERM.value: "Redis commands refused with NOPERM (ACL); the tier stays on.",
    Refusal.OOM.value: "Redis commands refused with OOM (maxmemory under noeviction); the "
    "tier stays on.",
    Refusal.READONLY.value: "Redis writes refused with READONLY (a replica); the tier stays on.",
    Refusal.OTHER.value: "Redis commands answered with another error reply; the tier stays on.",
}
_REFUSED_HELP = (
    "Redis commands a healthy Redis refused, by kind: noperm (ACL), oom (maxmemory under "
    "noeviction), readonly (a replica), other (another error reply); the tier stays on."
)
_ROUND_TRIP_HELP = (
    "Seconds of each Redis call that Redis answered, by operation: lookup (the scheduler's "
    "batch), load (a load job's GETs), store (a store job's SETs, and the EXISTS before them "
    "for chunks no fresh lookup answered MISS)."
)
# From a loopback round trip (~0.1 ms) to a load of hundreds of MiB.
ROUND_TRIP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

_QUOTA_REFUSED_HELP = (
    "KV chunks not stored because their request's tenant (cache_salt, by tenant id) held its "
    "byte budget (tenant_quotas); the first 16 tenants have a label of their own, the others "
    'share tenant="other".'
)
_TENANT_USED_HELP = (
    "Bytes a tenant's stored chunks hold in Redis, from the namespace's account "
    "(tenant_quotas), by tenant label as for quota_refused_chunks."
)
_ERRORS_HELP = "Redis calls of the scheduler that failed (connection errors, timeouts)."
_AVAILABLE_HELP = "1 while the scheduler reaches Redis, 0 while it serves without the tier."
# One series per engine, summed over a Cluster's masters rather than one per node: vLLM's hooks
# can set a labelled gauge but never remove one, so a node gone (a failover promotes a replica
# at another address) would leave its last figure in every scrape, and sums over nodes would
# count it. ``hma-redis info`` and ``doctor`` show each node.
_USED_MEMORY_HELP = (
    "Bytes Redis uses (INFO memory used_memory), summed over a Cluster's masters; asked at "
    "most every 10 s; absent where the tier's ACL refuses INFO."
)
_MAX_MEMORY_HELP = (
    "Redis' maxmemory in bytes, summed over a Cluster's masters; 0: no limit (on any master). "
    "Absent where the tier's ACL refuses INFO."
)


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric hma_redis emits (vLLM registers them from the spec class at start-up)."""
    definitions: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=doc)
        for name, doc in (
            *MANAGER_COUNTERS.values(),
            *WORKER_COUNTERS.values(),
            *PIN_COUNTERS.values(),
        )
    }
    definitions[RedisMetricName.REFUSED] = OffloadingCounterMetadata(
        documentation=_REFUSED_HELP, labelnames=("kind",)
    )
    definitions[RedisMetricName.ROUND_TRIP_SECONDS] = OffloadingHistogramMetadata(
        documentation=_ROUND_TRIP_HELP, labelnames=("operation",), buckets=ROUND_TRIP_BUCKETS
    )
    for name, doc in DETAIL_COUNTERS.values():
        definitions[name] = OffloadingCounterMetadata(documentation=doc)
    for name, doc in GROUP_COUNTERS.values():
        definitions[name] = OffloadingCounterMetadata(documentation=doc, labelnames=("group",))
    definitions[RedisMetricName.QUOTA_REFUSED_CHUNKS] = OffloadingCounterMetadata(
        documentation=_QUOTA_REFUSED_HELP, labelnames=("tenant",)
    )
    definitions[RedisMetricName.TENANT_USED_BYTES] = OffloadingGaugeMetadata(
        documentation=_TENANT_USED_HELP, labelnames=("tenant",)
    )
    definitions[RedisMetricName.ERRORS] = OffloadingCounterMetadata(documentation=_ERRORS_HELP)
    definitions[RedisMetricName.AVAILABLE] = OffloadingGaugeMetadata(documentation=_AVAILABLE_HELP)
    definitions[RedisMetricName.USED_MEMORY_BYTES] = OffloadingGaugeMetadata(
        documentation=_USED_MEMORY_HELP
    )
    definitions[RedisMetricName.MAX_MEMORY_BYTES] = OffloadingGaugeMetadata(
        documentation=_MAX_MEMORY_HELP
    )
    return definitions


def _named(totals: Mapping[str, int], table: Mapping[str, tuple[str, str]]) -> dict[str, int]:
    """``totals`` of the fields in ``table``, under their metric names."""
    return {table[field][0]: value for field, value in totals.items() if field in table}


def _refusal_deltas(
    totals: Mapping[str, int], reported: Counter[str], out: OffloadingConnectorStats
) -> None:
    """The ``refused_<kind>`` totals' changes since ``reported``, as the ``kind``-labelled
    counter; ``reported`` catches up."""
    refusals = {f"refused_{kind}": totals.get(f"refused_{kind}", 0) for kind in REFUSAL_KINDS}
    for field_name, delta in _deltas(refusals, reported).items():
        out.increase_counter(RedisMetricName.REFUSED, delta, (field_name.removeprefix("refused_"),))


def _observe_latency(latency: LatencySamples, out: OffloadingConnectorStats) -> None:
    """Every latency sample since the last report, into the ``operation``-labelled histogram."""
    for operation, samples in latency.take().items():
        for seconds in samples:
            out.observe_histogram(RedisMetricName.ROUND_TRIP_SECONDS, seconds, (operation.value,))


def _deltas(totals: Mapping[str, int], reported: Counter[str]) -> dict[str, int]:
    """Positive changes of ``totals`` since ``reported``; ``reported`` catches up."""
    out: dict[str, int] = {}
    for name, value in totals.items():
        delta = value - reported[name]
        if delta > 0:
            out[name] = delta
            reported[name] = value
    return out


class ManagerMetrics:
    """Scheduler side: turns the manager's cumulative stats into per-call deltas."""

    def __init__(self) -> None:
        self._reported: Counter[str] = Counter()
        self._reported_groups: Counter[tuple[str, int]] = Counter()
        self._reported_tenants: Counter[str] = Counter()
        self._available: bool | None = None

    def collect(
        self,
        stats: ManagerStats,
        *,
        errors: int = 0,
        available: bool = True,
        refusals: Mapping[str, int] | None = None,
        detail: ManagerDetailStats | None = None,
        latency: LatencySamples | None = None,
        memory: TierMemory | None = None,
        tenant_used: Mapping[str, int] | None = None,
    ) -> OffloadingConnectorStats | None:
        """What changed since the last call, or None if nothing did.

        ``tenant_used``: the tenants' bytes by label (the gauge, set when given); the
        refused chunks by tenant label come with ``detail``.

        ``detail``: removals, admission and the per-group intersection counts (the last as
        counters labelled ``group="g<N>"``).

        ``errors`` is the scheduler store's cumulative count of failed Redis calls, ``available``
        whether it reaches Redis now, ``refusals`` its counters' totals
        (:meth:`~hma_redis.core.counters.PendingCounters.snapshot`; the ``refused_*`` and
        :data:`PIN_COUNTERS` ones count),
        ``latency`` its call times (drained here), ``memory`` Redis' figures when a new
        reading came in (the used/max memory gauges are set from it; never set otherwise).
        """
        totals = {name: getattr(stats, field) for field, (name, _) in MANAGER_COUNTERS.items()}
        totals[RedisMetricName.ERRORS] = errors
        if detail is not None:
            totals.update({name: getattr(detail, f) for f, (name, _) in DETAIL_COUNTERS.items()})
        totals.update(_named(refusals or {}, PIN_COUNTERS))
        out = OffloadingConnectorStats()
        for name, delta in _deltas(totals, self._reported).items():
            out.increase_counter(name, delta)
        _refusal_deltas(refusals or {}, self._reported, out)
        if latency is not None:
            _observe_latency(latency, out)
        if detail is not None:
            self._collect_groups(detail, out)
            for label, value in detail.quota_refused_chunks.items():
                delta = value - self._reported_tenants[label]
                if delta > 0:
                    out.increase_counter(RedisMetricName.QUOTA_REFUSED_CHUNKS, delta, (label,))
                    self._reported_tenants[label] = value
        for label, used in (tenant_used or {}).items():
            out.set_gauge(RedisMetricName.TENANT_USED_BYTES, used, (label,))
        if available != self._available:
            self._available = available
            out.set_gauge(RedisMetricName.AVAILABLE, 1 if available else 0)
        if memory is not None:
            out.set_gauge(RedisMetricName.USED_MEMORY_BYTES, memory.used_bytes)
            out.set_gauge(RedisMetricName.MAX_MEMORY_BYTES, memory.max_bytes)
        return None if out.is_empty() else out

    def _collect_groups(self, detail: ManagerDetailStats, out: OffloadingConnectorStats) -> None:
        for field_name, (name, _) in GROUP_COUNTERS.items():
            counts: Counter[int] = getattr(detail, field_name)
            for group, value in counts.items():
                delta = value - self._reported_groups[(name, group)]
                if delta > 0:
                    out.increase_counter(name, delta, (f"g{group}",))
                    self._reported_groups[(name, group)] = value


class WorkerMetrics:
    """Worker side: turns a worker store's counters into per-call deltas.

    The worker runs in its own process (vLLM's multiprocessing executor), so these stats reach
    the scheduler's Prometheus exporter only through vLLM's worker-side
    ``KVConnectorBase_V1.get_kv_connector_stats`` channel, which ships them with each
    model-runner output and sums them over workers.
    """

    def __init__(self, counters: PendingCounters, latency: LatencySamples | None = None) -> None:
        self._counters = counters
        self._latency = latency
        self._reported: Counter[str] = Counter()

    def collect(self) -> OffloadingConnectorStats | None:
        """What changed since the last call (the latency samples drained), or None if nothing
        did."""
        totals = self._counters.snapshot()
        out = OffloadingConnectorStats()
        for name, delta in _deltas(_named(totals, WORKER_COUNTERS), self._reported).items():
            out.increase_counter(name, delta)
        _refusal_deltas(totals, self._reported, out)
        if self._latency is not None:
            _observe_latency(self._latency, out)
        return None if out.is_empty() else out


# The ``hma-redis info`` counter (stats hash field, core.counters.FIELDS) each metric counts too;
# metrics without one are the scheduler's own view, kept in memory only.
INFO_COUNTER_OF: dict[str, str] = {
    RedisMetricName.LOOKUPS: "lookups",
    RedisMetricName.CHUNK_QUERIES: "lookup_keys",
    RedisMetricName.CHUNK_HITS: "hit_chunks",
    RedisMetricName.CHUNK_MISSES: "miss_chunks",
    RedisMetricName.ADMISSION_DEFERRED: "admission_deferred",
    RedisMetricName.REMOVED_CHUNKS: "removed_chunks",
    RedisMetricName.GROUP_HIT_CHUNKS: "g<N>_hit_chunks",
    RedisMetricName.USABLE_HIT_CHUNKS: "g<N>_usable_chunks",
    RedisMetricName.QUOTA_REFUSED_CHUNKS: "quota_refused_chunks",
    **{name: field for field, (name, _) in WORKER_COUNTERS.items()},
    **{name: field for field, (name, _) in PIN_COUNTERS.items()},
}
# ``hma-redis info`` counters no hma_redis metric counts, and what does instead.
INFO_ONLY_COUNTERS: dict[str, str] = {
    "stored_bytes": "Value bytes written to Redis (Prometheus: vLLM's "
    "vllm:kv_offload_store_bytes).",
    "loaded_bytes": "Value bytes read from Redis (Prometheus: vLLM's vllm:kv_offload_load_bytes).",
    "load_failed_jobs": "Load jobs that failed (each fails its requests' loads; Prometheus "
    "counts the requests: " + RedisMetricName.LOAD_FAILURES + "_total).",
    "admission_admitted": "KV chunks admitted by second_sighting (seen before) and stored.",
}


def exported_name(name: str, meta: OffloadingMetricMetadata) -> str:
    """The name a scrape shows for metric ``name``: counters get ``_total``; a histogram's
    series are ``<name>_bucket``, ``_sum`` and ``_count``."""
    return f"{name}_total" if isinstance(meta, OffloadingCounterMetadata) else name


def metrics_table() -> str:
    """docs/operations.md's table: every metric as a scrape shows it, the ``hma-redis info``
    counter that counts the same, and what it means (the refusal counter one row per
    ``kind``); then the counters no metric counts."""
    rows = ["| Prometheus metric | `hma-redis info` counter | meaning |", "| --- | --- | --- |"]
    for name, meta in metric_definitions().items():
        shown = exported_name(name, meta)
        if name == RedisMetricName.REFUSED:
            for kind, meaning in REFUSAL_KINDS.items():
                rows.append(f'| `{shown}{{kind="{kind}"}}` | `refused_{kind}` | {meaning} |')
            continue
        if isinstance(meta, OffloadingHistogramMetadata):
            shown += "_bucket` / `_sum` / `_count"
        info = INFO_COUNTER_OF.get(name)
        rows.append(f"| `{shown}` | {f'`{info}`' if info else '-'} | {meta.documentation} |")
    for field_name, meaning in INFO_ONLY_COUNTERS.items():
        rows.append(f"| - | `{field_name}` | {meaning} |")
    return "\n".join(rows) + "\n"
