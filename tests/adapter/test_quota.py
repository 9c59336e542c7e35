"""Per-tenant quotas through vLLM's real Scheduler and the connector's worker half (no model),
against a real Redis: a request's ``cache_salt`` is its tenant; the chunks its stores write are
counted against it (never the chunks Redis held already); once a tenant holds its budget its
chunks are not stored (counted per tenant, in the metrics with a bounded label) while another
tenant's are; the operator's override in the quotas hash lifts or sets a budget."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import pytest
import redis

from hma_redis.adapter.metrics import OTHER_TENANT, ManagerMetrics, RedisMetricName, TenantLabels
from hma_redis.adapter.types import ManagerStats
from hma_redis.core.redis import quotas
from hma_redis.core.tenants import DEFAULT_TENANT, tenant_id
from tests.support.connector_harness import BLOCK_SIZE, ConnectorHarness

NUM_BLOCKS = 4
PROMPT_LEN = NUM_BLOCKS * BLOCK_SIZE + 3
QUOTA = {"tenant_quotas": True, "quota_refresh_interval_s": 0.001}
A, B = tenant_id("tenant-a", "hma"), tenant_id("tenant-b", "hma")


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(PROMPT_LEN)]


def _serve(harness: ConnectorHarness, seed: int, salt: str | None) -> list[str]:
    """Compute one prompt of tenant ``salt``; the Redis keys its chunks may have (every
    group; the sliding-window group stores only the chunks of its window)."""
    req = harness.add_request(_prompt(seed), cache_salt=salt)
    harness.run()
    groups = len(harness.kv_cache_config.kv_cache_groups)
    return [harness.redis_key(req, g, b) for g in range(groups) for b in range(NUM_BLOCKS)]


def _refresh(harness: ConnectorHarness) -> None:
    """Let the keeper take a snapshot of the account (it runs at each step's end)."""
    keeper = harness.manager.quotas
    assert keeper is not None
    for _ in range(3):
        keeper.tick()
        assert keeper.wait(5.0)


def _held(client: redis.Redis, keys: list[str]) -> int:
    return sum(int(client.strlen(k)) for k in keys)


def _usage(harness: ConnectorHarness, client: redis.Redis) -> dict[str, int]:
    return quotas.usage(client, harness.keyspace.tenants_key())


def test_a_tenant_over_its_budget_is_not_stored_and_the_other_tenant_is(
    instance: Callable[..., ConnectorHarness],
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    harness = instance(extra_config={**QUOTA, "tenant_budget_bytes": 1})
    first_a = _serve(harness, 1, "tenant-a")
    stored_a = redis_client.exists(*first_a)
    assert stored_a >= NUM_BLOCKS  # under budget when it started
    assert _usage(harness, redis_client) == {A: _held(redis_client, first_a)}
    _refresh(harness)
    assert harness.manager.quotas is not None and harness.manager.quotas.over_budget(A)

    with caplog.at_level(logging.WARNING):
        second_a = _serve(harness, 2, "tenant-a")
        _serve(harness, 4, "tenant-a")
    said = [r.getMessage() for r in caplog.records if "its chunks are not stored" in r.getMessage()]
    assert len(said) == 1 and A in said[0] and "tenant-a" not in said[0], said
    first_b = _serve(harness, 3, "tenant-b")
    assert redis_client.exists(*second_a) == 0  # refused: recomputed when needed
    assert redis_client.exists(*first_b) == stored_a  # B is stored as A was
    assert redis_client.exists(*first_a) == stored_a  # what A had stays
    assert _usage(harness, redis_client) == {
        A: _held(redis_client, first_a),
        B: _held(redis_client, first_b),
    }
    refused = harness.manager.detail_stats.quota_refused_chunks
    assert refused == {A: 2 * stored_a}  # each refused request: the first one's chunks
    assert harness.manager._store.counters.totals["quota_refused_chunks"] == 2 * stored_a
    # The scheduler has reported its stats each step already: what a first report says.
    stats = ManagerMetrics().collect(
        ManagerStats(), detail=harness.manager.detail_stats, tenant_used={A: 5}
    )
    assert stats is not None
    reduced = stats.reduce()
    assert reduced[f"{RedisMetricName.QUOTA_REFUSED_CHUNKS}:{(A,)}"] == 2 * stored_a
    assert reduced[f"{RedisMetricName.TENANT_USED_BYTES}:{(A,)}"] == 5


def test_chunks_another_tenant_stored_already_are_not_counted_again(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """Two instances serve the same unsalted prompt: the second's store finds the chunks there
    (EXISTED) and the default tenant is counted once."""
    first = instance(extra_config=QUOTA)
    keys = _serve(first, 5, None)
    once = _usage(first, redis_client)
    assert once == {DEFAULT_TENANT: _held(redis_client, keys)}
    second = instance(extra_config=QUOTA)
    second.manager.reset_cache()
    _serve(second, 5, None)
    assert _usage(second, redis_client) == once


def test_the_operator_lifts_a_budget_and_sets_one_for_the_default_tenant(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    harness = instance(extra_config={**QUOTA, "tenant_budget_bytes": 1})
    _serve(harness, 1, "tenant-a")
    quotas_key = harness.keyspace.quotas_key()
    quotas.set_budget(redis_client, quotas_key, A, quotas.NO_BUDGET)
    quotas.set_budget(redis_client, quotas_key, DEFAULT_TENANT, 0)
    _refresh(harness)
    assert redis_client.exists(*_serve(harness, 2, "tenant-a")) > 0
    assert redis_client.exists(*_serve(harness, 3, None)) == 0


def test_quotas_off_count_nothing_and_write_no_account(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    harness = instance()
    keys = _serve(harness, 1, "tenant-a")
    assert redis_client.exists(*keys) >= NUM_BLOCKS
    assert harness.manager.quotas is None
    assert not redis_client.exists(harness.keyspace.tenants_key())


def test_tenant_labels_are_bounded() -> None:
    labels = TenantLabels(limit=2)
    assert [labels.label(t) for t in ("a", "b", "c", "a", "d")] == [
        "a",
        "b",
        OTHER_TENANT,
        "a",
        OTHER_TENANT,
    ]
    assert labels.by_label({"a": 1, "c": 2, "d": 3}) == {"a": 1, OTHER_TENANT: 5}


def test_chunks_redis_removed_leave_the_account_through_the_schedulers_watcher(
    instance: Callable[..., ConnectorHarness], redis_client: redis.Redis
) -> None:
    """With quotas the removal watcher runs (vLLM's KV events off here): a chunk deleted in
    Redis is taken off its tenant within a few scheduler steps, and the tenant's stores
    resume once it is under its budget again."""
    harness = instance(extra_config={**QUOTA, "tenant_budget_bytes": 1})
    watcher = harness.manager._removals
    assert watcher is not None and watcher.wait_subscribed(10.0)
    keys = [k for k in _serve(harness, 1, "tenant-a") if redis_client.exists(k)]
    assert _usage(harness, redis_client) == {A: _held(redis_client, keys)}
    redis_client.delete(*keys)
    for _ in range(500):
        harness.step()
        if not _usage(harness, redis_client):
            break
    assert _usage(harness, redis_client) == {}
    _refresh(harness)
    assert redis_client.exists(*_serve(harness, 2, "tenant-a")) > 0
