"""hma_redis' Prometheus metrics through vLLM's offloading-connector hooks: names under vLLM's
scheme, deltas per report, refusals per kind (the metrics of a real ``vllm serve``:
tests/engine/test_metrics_serve.py)."""

from __future__ import annotations

import re
from pathlib import Path

import redis
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    get_connector_metric_definitions,
)

from hma_redis.adapter.metrics import (
    PREFIX,
    REFUSAL_KINDS,
    WORKER_COUNTERS,
    ManagerMetrics,
    RedisMetricName,
    WorkerMetrics,
    exported_name,
    metric_definitions,
    metrics_table,
)
from hma_redis.adapter.spec import RedisOffloadingSpec
from hma_redis.adapter.types import ManagerStats
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.counters import FIELDS as COUNTER_FIELDS
from hma_redis.core.counters import PendingCounters
from hma_redis.core.latency import LatencySamples, Operation
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis

R = RedisMetricName


def test_metric_definitions_follow_vllm_naming() -> None:
    """Names under vLLM's ``vllm:kv_offload_`` scheme, none clashing with vLLM's own."""
    ours = RedisOffloadingSpec.build_metric_definitions({})
    assert ours == metric_definitions()
    assert all(name.startswith("vllm:kv_offload_redis_") for name in ours)
    assert not set(ours) & set(get_connector_metric_definitions())


def test_manager_and_worker_metrics_report_deltas() -> None:
    stats = ManagerStats()
    metrics = ManagerMetrics()
    first = metrics.collect(stats)
    assert first is not None and first.reduce() == {R.AVAILABLE: 1}
    assert metrics.collect(stats) is None  # nothing changed
    stats.hit_keys, stats.miss_keys, stats.failed_loads = 3, 2, 1
    delta = metrics.collect(stats, errors=2, available=False)
    assert delta is not None
    assert delta.reduce() == {
        R.CHUNK_HITS: 3,
        R.CHUNK_MISSES: 2,
        R.LOAD_FAILURES: 1,
        R.ERRORS: 2,
        R.AVAILABLE: 0,
    }
    stats.hit_keys = 5
    again = metrics.collect(stats, errors=2, available=False)
    assert again is not None and again.reduce() == {R.CHUNK_HITS: 2}

    counters = PendingCounters()
    worker = WorkerMetrics(counters)
    assert worker.collect() is None
    counters.add(stored_chunks=4, stored_bytes=400, store_failed_chunks=1)
    counters.take()  # delivered to Redis: the metric deltas do not depend on it
    out = worker.collect()
    assert out is not None
    assert out.reduce() == {R.STORED_CHUNKS: 4, R.STORE_FAILED_CHUNKS: 1}
    assert worker.collect() is None
    # Two workers' stats sum (vLLM aggregates them before the scheduler sees them).
    counters.add(stored_chunks=2)
    other_counters = PendingCounters()
    other_counters.add(stored_chunks=1, loaded_chunks=3)
    merged = worker.collect()
    other = WorkerMetrics(other_counters).collect()
    assert merged is not None and other is not None
    merged.aggregate(other)
    assert merged.reduce() == {R.STORED_CHUNKS: 3, R.LOADED_CHUNKS: 3}


def test_refusals_reach_prometheus_per_kind(local_redis: LocalRedis) -> None:
    with redis.Redis(port=local_redis.port) as admin:
        admin.acl_setuser(
            "tier", enabled=True, passwords=["+pw"], keys=["hma:*"], commands=["+@all", "-set"]
        )
    url = f"redis://tier:pw@127.0.0.1:{local_redis.port}/0"
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))
    store.put_if_absent([("hma:ns:g0:aa", b"v"), ("hma:ns:g0:bb", b"v")])
    assert metric_definitions()[R.REFUSED].labelnames == ("kind",)
    assert set(REFUSAL_KINDS) == {"noperm", "oom", "readonly", "other"}

    worker_side = WorkerMetrics(store.counters).collect()
    assert worker_side is not None
    assert worker_side.reduce() == {f"{R.REFUSED}:('noperm',)": 2}

    scheduler_side = ManagerMetrics().collect(ManagerStats(), refusals=store.counters.snapshot())
    assert scheduler_side is not None
    assert scheduler_side.reduce()[f"{R.REFUSED}:('noperm',)"] == 2
    store.close()


def test_round_trips_reach_the_histogram_once_by_operation(local_redis: LocalRedis) -> None:
    """A lookup, a store (its SET) and a load against a real Redis are each one sample of
    their operation; a sample is reported once; a call the breaker never let through is none."""
    url = f"redis://127.0.0.1:{local_redis.port}/0"
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))
    store.exists(["hma:ns:g0:aa"])
    store.put_if_absent([("hma:ns:g0:aa", b"v")])
    store.get(["hma:ns:g0:aa"])
    store.exists(["hma:ns:g0:aa"], operation=Operation.STORE)
    metrics = WorkerMetrics(store.counters, store.latency)
    out = metrics.collect()
    assert out is not None
    reduced = out.reduce()
    histogram = R.ROUND_TRIP_SECONDS
    counts = {k: v for k, v in reduced.items() if k.startswith(histogram) and k.endswith("_count")}
    assert counts == {
        f"{histogram}:('lookup',)_count": 1,
        f"{histogram}:('store',)_count": 2,
        f"{histogram}:('load',)_count": 1,
    }
    assert all(0 < reduced[k.replace("_count", "_sum")] < 5 for k in counts)
    assert metrics.collect() is None  # each sample once
    local_redis.stop()
    store.exists(["hma:ns:g0:aa"])  # fails: Redis is gone
    store.exists(["hma:ns:g0:aa"])  # the breaker is open: not even sent
    assert store.latency.take() == {}
    store.close()


def test_latency_samples_are_bounded_and_keep_the_newest() -> None:
    samples = LatencySamples(max_samples=3)
    for seconds in (1.0, 2.0, 3.0, 4.0):
        samples.record(Operation.LOAD, seconds)
    assert samples.take() == {Operation.LOAD: [2.0, 3.0, 4.0]}
    assert samples.take() == {}


def test_a_worker_count_has_one_name_in_info_and_in_prometheus() -> None:
    """What ``hma-redis info`` calls ``store_existed_chunks`` is exported as
    ``vllm:kv_offload_redis_store_existed_chunks_total``, and so for every worker count."""
    for field_name, (metric, _) in WORKER_COUNTERS.items():
        assert field_name in COUNTER_FIELDS
        assert metric == PREFIX + field_name
    for kind in REFUSAL_KINDS:
        assert f"refused_{kind}" in COUNTER_FIELDS
        assert f'`{R.REFUSED}_total{{kind="{kind}"}}` | `refused_{kind}` |' in metrics_table()


def test_operations_md_maps_every_metric_and_info_counter_to_its_meaning() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    assert metrics_table() in doc
    for field_name in COUNTER_FIELDS:
        assert f"| `{field_name}` |" in metrics_table(), field_name
    for name in metric_definitions():
        assert f"`{name}" in metrics_table(), name


def test_existing_chunk_help_counts_this_instances_repeats_too() -> None:
    (_, help_text) = WORKER_COUNTERS["store_existed_chunks"]
    assert "another instance stored them" not in help_text
    assert "this one included" in help_text


def test_every_metric_the_docs_name_is_one_the_tier_exports() -> None:
    """One vocabulary: a ``vllm:kv_offload_redis_*`` name in the README, docs/ or docker/README.md
    is a metric of :func:`metric_definitions`, as defined or as a scrape shows it (counters
    with ``_total``, histograms with ``_bucket``/``_sum``/``_count``)."""
    root = Path(__file__).resolve().parents[2]
    known: set[str] = set()
    for name, meta in metric_definitions().items():
        known |= {name, exported_name(name, meta)}
        known |= {f"{name}_{part}" for part in ("bucket", "sum", "count")}
    for doc in [root / "README.md", root / "docker" / "README.md", *(root / "docs").glob("*.md")]:
        named = set(re.findall(r"vllm:kv_offload_redis_[a-z_]*[a-z]", doc.read_text()))
        assert named <= known, (doc.name, sorted(named - known))
