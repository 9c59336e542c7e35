"""``RedisOffloadingConnector`` over a spec other than hma_redis' (tests/support/null_spec.py):
its changes concern hma_redis' worker only, and what it reports to vLLM keeps the stock
connector's types."""

from __future__ import annotations

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)

from hma_redis.adapter.connector import RedisOffloadingConnector
from tests.support.null_spec import NULL_SPEC_CONFIG, NullOffloadingWorker
from tests.support.scheduler_harness import (
    HEAD_SIZE,
    make_vllm_config,
    three_group_kv_cache_config,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 8


def test_under_another_spec_transfer_results_are_empty_sets(redis_url: str, model_dir: str) -> None:
    """A worker-side connector whose spec is not hma_redis' registers its KV caches, reports
    three empty sets from ``get_transfer_results`` (never ``None``: vLLM's multi-worker
    aggregator unions ``failed_recving`` with ``|=``), no stats of hma_redis' worker, and
    shuts down."""
    vllm_config = make_vllm_config(
        model_dir, redis_url, block_size=BLOCK_SIZE, extra_config=NULL_SPEC_CONFIG
    )
    kv_cache_config = three_group_kv_cache_config(BLOCK_SIZE, NUM_BLOCKS, 3)
    with set_current_vllm_config(vllm_config):
        connector = RedisOffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches(
        {
            name: torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, 1, HEAD_SIZE, dtype=torch.float32)
            for group in kv_cache_config.kv_cache_groups
            for name in group.layer_names
        }
    )
    connector_worker = connector.connector_worker
    assert connector_worker is not None
    assert isinstance(connector_worker.worker, NullOffloadingWorker)

    connector.bind_connector_metadata(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    results = connector.get_transfer_results(set())
    connector.clear_connector_metadata()
    assert (results.finished_sending, results.finished_recving, results.failed_recving) == (
        set(),
        set(),
        set(),
    )
    assert connector.get_kv_connector_stats() is None
    connector.shutdown()
