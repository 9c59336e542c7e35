"""Real vLLM engines share KV through a 3-master Redis Cluster and across a Sentinel failover
(the store's own behaviour there: tests/core/test_cluster.py, tests/core/test_sentinel.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_llama
from tests.support.cluster_servers import (
    LocalCluster,
    LocalSentinel,
    started_cluster,
    started_sentinel,
)
from tests.support.engine_runner import make_prompts, run_engine
from tests.support.tier import assert_loaded_from_the_tier, tier_config

pytestmark = pytest.mark.engine

USER, PASSWORD = "tier", "ha-s3cret"


@pytest.fixture
def clean() -> Iterator[LocalCluster]:
    server = started_cluster(USER, PASSWORD)
    yield server
    server.stop()


@pytest.fixture
def fresh_sentinel() -> Iterator[LocalSentinel]:
    setup = started_sentinel(USER, PASSWORD)
    yield setup
    setup.stop()


def test_two_engines_share_kv_through_the_cluster(
    clean: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_llama(tmp_path_factory.mktemp("llama-cluster"))
    prompts = [make_prompts(90 + i, 1, n, VOCAB_SIZE)[0] for i, n in enumerate((700, 1100))]
    baseline = run_engine(model, prompts, 8, kv_transfer_config=None)
    engine_a = run_engine(model, prompts, 8, tier_config(clean.url))
    engine_b = run_engine(model, prompts, 8, tier_config(clean.url))

    assert engine_a.token_ids == baseline.token_ids, engine_a.stderr_tail
    assert engine_a.num_cached_tokens == [0] * len(prompts)
    assert engine_b.token_ids == baseline.token_ids, engine_b.stderr_tail
    assert_loaded_from_the_tier(engine_b, prompts)
    # The chunks are spread over the three masters.
    block_keys = []
    for client in clean.clients():
        with client:
            block_keys.append([k for k in client.scan_iter(match="hma:*:g*", count=1000)])
    assert all(block_keys), [len(k) for k in block_keys]


def test_engines_share_kv_across_a_failover(
    fresh_sentinel: LocalSentinel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_llama(tmp_path_factory.mktemp("llama-sentinel"))
    prompts = [make_prompts(95 + i, 1, n, VOCAB_SIZE)[0] for i, n in enumerate((700, 1100))]
    baseline = run_engine(model, prompts, 8, kv_transfer_config=None)
    engine_a = run_engine(model, prompts, 8, tier_config(fresh_sentinel.url))
    assert engine_a.token_ids == baseline.token_ids, engine_a.stderr_tail

    fresh_sentinel.wait_replicated()
    old_master = fresh_sentinel.master_port()
    new_master = fresh_sentinel.failover()
    assert new_master != old_master

    engine_b = run_engine(model, prompts, 8, tier_config(fresh_sentinel.url))
    assert engine_b.token_ids == baseline.token_ids, engine_b.stderr_tail
    assert_loaded_from_the_tier(engine_b, prompts)
