"""The Redis secondary tier on a Redis Cluster and behind Sentinel: two instances share."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from vllm.v1.kv_offload.base import LookupResult

from tests.support.cluster_servers import started_cluster, started_sentinel
from tests.support.tiering import TieringInstance, chunk_keys, payloads


def _share(instance: Callable[..., TieringInstance], url: str) -> None:
    writer, reader = instance(url), instance(url)
    keys = [k for group in range(3) for k in chunk_keys(70 + group, 4, group)]
    data = payloads(70, len(keys), writer.payload_bytes)
    writer.gpu_store(keys, data, writer.context())
    writer.settle()
    ctx = reader.context()
    assert reader.lookup_until_settled(keys, ctx) == [LookupResult.HIT] * len(keys)
    assert reader.gpu_load(keys, ctx) == data
    assert reader.tier.lookup_round_trips == 1


@pytest.mark.parametrize("topology", ["cluster", "sentinel"])
def test_instances_share_chunks_on_a_cluster_and_behind_sentinel(
    instance: Callable[..., TieringInstance],
    monkeypatch: pytest.MonkeyPatch,
    topology: str,
) -> None:
    start = started_cluster if topology == "cluster" else started_sentinel
    server = start("tier", "topology-s3cret")
    try:
        # The URL (with its password) from the environment: none of it in vLLM's config.
        monkeypatch.setenv("HMA_REDIS_URL", server.url)
        _share(instance, "")
    finally:
        server.stop()
