"""docker/grafana's dashboard against a real scrape: vLLM's own Prometheus exporter
(``PrometheusStatLogger``, as ``vllm serve`` builds it from a VllmConfig naming our connector)
renders what the tier's metrics code reports after real calls to a real Redis; every metric a
panel reads must be in that scrape, with the labels it groups by. (The same check runs against a
real ``vllm serve`` in tests/engine/test_metrics_serve.py.)"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import prometheus_client
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

from hma_redis.adapter.metrics import ManagerDetailStats, ManagerMetrics, WorkerMetrics
from hma_redis.adapter.types import ManagerStats
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.memory import TierMemory
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.tiny_models import build_llama
from tests.support.dashboard import DASHBOARD, Query, dashboard_queries

DOCKER = Path(__file__).resolve().parents[2] / "docker"
USER, PASSWORD = "dashboard-noset", "Dashb0ard-noset-pw"
# vLLM's own transfer counters, as its offloading scheduler names them from the worker's
# transfer results (not ours to report; the engine test sees them from a real engine).
VLLM_TRANSFER = ("vllm:kv_offload_load_bytes", "vllm:kv_offload_store_bytes")


def _tier_stats(redis_url: str, admin: redis.Redis) -> list[dict]:
    """The payloads the tier's metrics code reports after real lookups, stores, loads and a
    refused store on a real Redis (scheduler side, then worker side)."""
    admin.acl_setuser(
        USER, enabled=True, passwords=[f"+{PASSWORD}"], keys=["*"], commands=["+@all", "-set"]
    )
    try:
        ok = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
        url = redis_url.replace("redis://", f"redis://{USER}:{PASSWORD}@", 1)
        refused = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))
        keys = ["hma:dash:g0:aa", "hma:dash:g0:bb"]
        admin.delete(*keys)
        results = ok.put_if_absent([(keys[0], b"value")])  # a store
        ok.counters.add(stored_chunks=len(results), store_existed_chunks=1, store_failed_chunks=1)
        found = ok.exists(keys)  # a lookup: one hit, one miss
        loaded = ok.get(keys[:1])  # a load
        ok.counters.add(loaded_chunks=len(loaded), load_failed_chunks=1)
        refused.put_if_absent([(keys[0], b"value")])  # refused: NOPERM
        stats = ManagerStats(
            lookup_round_trips=1,
            keys_looked_up=len(found),
            hit_keys=sum(found),
            miss_keys=len(found) - sum(found),
            store_skipped_present=1,
            failed_loads=1,
        )
        detail = ManagerDetailStats(removed_chunks=1, admission_deferred=1)
        detail.group_hit_chunks[0] += 2
        detail.group_usable_chunks[0] += 1
        memory = ok.memory()  # INFO memory, as the scheduler's poller asks it
        assert isinstance(memory, TierMemory)
        scheduler = ManagerMetrics().collect(
            stats,
            errors=1,
            refusals=refused.counters.snapshot(),
            detail=detail,
            latency=ok.latency,
            memory=memory,
        )
        worker = WorkerMetrics(ok.counters, ok.latency).collect()
        ok.close()
        refused.close()
    finally:
        admin.acl_deluser(USER)
    assert scheduler is not None and worker is not None
    for name in VLLM_TRANSFER:
        worker.increase_counter(name, 5 * len(keys))
    return [scheduler.data, worker.data]


@pytest.fixture(scope="module")
def scrape(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``/metrics`` as vLLM's exporter renders it after one step's stats."""
    model = build_llama(tmp_path_factory.mktemp("dashboard") / "llama")
    config = VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True),
        # vLLM 0.33's GPU build finds no device on a CPU-only machine: the exporter needs none.
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="RedisOffloadingConnector",
            kv_connector_module_path="hma_redis.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "RedisOffloadingSpec",
                "spec_module_path": "hma_redis.spec",
                "redis_url": redis_url,
            },
        ),
    )
    exporter = PrometheusStatLogger(config, [0])
    with redis.Redis.from_url(redis_url) as admin:
        payloads = _tier_stats(redis_url, admin)
    for payload in payloads:
        external = PrefixCacheStats()
        external.record(num_tokens=256, num_hits=128, preempted=False)
        exporter.record(
            SchedulerStats(kv_connector_stats=payload, connector_prefix_cache_stats=external),
            None,
        )
    return prometheus_client.generate_latest().decode()


def _series_labels(scrape: str) -> dict[str, set[str]]:
    """Every sample name in the scrape, with the label names its series carry."""
    out: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            out[sample.name] |= set(sample.labels)
    return out


def test_the_dashboard_has_panels_for_latency_refusals_and_hits() -> None:
    queries = dashboard_queries()
    read = {name for q in queries for name in q.metrics}
    assert "vllm:kv_offload_redis_round_trip_seconds_bucket" in read
    assert "vllm:kv_offload_redis_refused_total" in read
    assert "vllm:kv_offload_redis_chunk_hits_total" in read
    assert "vllm:kv_offload_redis_used_memory_bytes" in read
    assert "vllm:kv_offload_redis_max_memory_bytes" in read


@pytest.mark.parametrize("query", dashboard_queries(), ids=lambda q: q.panel)
def test_every_dashboard_query_reads_metrics_a_real_scrape_has(scrape: str, query: Query) -> None:
    series = _series_labels(scrape)
    assert query.metrics, f"{query.panel}: no vllm: metric in {query.expr!r}"
    for name in query.metrics:
        assert name in series, f"{query.panel}: {name} is not in the scrape"
    for label in query.grouped_by:
        assert any(label in series[name] for name in query.metrics), (query.panel, label)


def test_the_scrape_has_redis_memory_as_info_gives_it(scrape: str, redis_url: str) -> None:
    """The memory panel's gauges: maxmemory as configured, used_memory a real figure."""
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
        if sample.name.endswith("_memory_bytes")
    }
    with redis.Redis.from_url(redis_url) as admin:
        info = admin.info("memory")
    assert values["vllm:kv_offload_redis_max_memory_bytes"] == info["maxmemory"]
    assert 0 < values["vllm:kv_offload_redis_used_memory_bytes"] <= 2 * info["used_memory"]


def test_the_scrape_has_a_round_trip_histogram_per_operation(scrape: str) -> None:
    """Lookups, stores and loads each timed, under vLLM's engine labels."""
    operations = {
        sample.labels["operation"]
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
        if sample.name == "vllm:kv_offload_redis_round_trip_seconds_count" and sample.value > 0
    }
    assert operations == {"lookup", "load", "store"}


@pytest.mark.parametrize("file", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_scrapes_both_servers_and_provisions_the_dashboard(file: str) -> None:
    services = yaml.safe_load((DOCKER / file).read_text())["services"]
    prometheus = yaml.safe_load((DOCKER / "prometheus.yaml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]}  # fmt: skip
    assert targets == {"vllm-a:8000", "vllm-b:8000"}
    mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert mounts["./grafana/dashboards"] == "/var/lib/grafana/dashboards"
    assert (DOCKER / "grafana" / "dashboards" / DASHBOARD.name).is_file()
    config = "./prometheus.yaml:/etc/prometheus/prometheus.yml:ro"
    assert config in services["prometheus"]["volumes"]
