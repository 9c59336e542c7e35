"""Two vLLM instances share chunks through the Redis secondary tier behind vLLM's CPU tier."""

from __future__ import annotations

from collections.abc import Callable

import redis
from vllm.v1.kv_offload.base import LookupResult

from tests.support.tiering import TieringInstance, chunk_keys, payloads


def _cascade(inst: TieringInstance, seed: int, count: int = 4, group: int = 0):
    keys = chunk_keys(seed, count, group)
    data = payloads(seed, count, inst.payload_bytes)
    inst.gpu_store(keys, data, inst.context())
    inst.settle()
    return keys, data


def test_chunks_cascaded_by_one_instance_are_promoted_byte_for_byte_in_another(
    instance: Callable[..., TieringInstance], redis_client: redis.Redis
) -> None:
    writer, reader = instance(), instance()
    keys, data = _cascade(writer, seed=1)
    assert len(list(redis_client.scan_iter(writer.tier.keyspace.block_pattern()))) == 4

    ctx = reader.context()
    assert reader.lookup_until_settled(keys, ctx) == [LookupResult.HIT] * 4
    assert reader.gpu_load(keys, ctx) == data
