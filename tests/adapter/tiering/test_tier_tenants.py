"""Tenants and deployments kept apart in the tiering mode, through vLLM's real tiering manager
(and its real Scheduler): what tests/engine/test_tenants.py proves for the direct spec.

- Two deployments of one model path (or one shape) that compute different KV, given one
  ``namespace`` name, never promote each other's chunks; a second instance of the same
  deployment promotes all of them, byte for byte.
- ``cache_salt`` keeps tenants apart and still shares within a tenant.
- Under vLLM's stock ``OffloadingConnector`` the tier refuses to start (one line): it would not
  know the model's revision, quantization, dtype or ``hf_overrides``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult

from tests.support.scheduler_harness import (
    SchedulerHarness,
    make_vllm_config,
    three_group_kv_cache_config,
)
from tests.support.tiering import (
    TieringInstance,
    chunk_keys,
    make_instance,
    payloads,
    tiering_extra_config,
    tiering_manager,
)

NAME = "team-models"
CHUNKS = 4
BLOCK = 16


@pytest.fixture
def other_model_dir(model_dir: str, tmp_path: Path) -> str:
    """The same checkpoint config at another path (a fine-tune of one base model: one shape,
    other weights)."""
    return str(shutil.copytree(model_dir, tmp_path / "fine-tune"))


@pytest.fixture
def deployments(
    redis_url: str, redis_client: Any, model_dir: str
) -> Iterator[Callable[..., TieringInstance]]:
    """Tiering instances of ``model_dir`` (or ``model=...``) under the ``namespace`` NAME,
    closed at teardown."""
    made: list[TieringInstance] = []

    def make(model: str | None = None, **model_kwargs: Any) -> TieringInstance:
        made.append(
            make_instance(
                model or model_dir,
                redis_url,
                namespace=NAME,
                model_kwargs={"dtype": "bfloat16", **model_kwargs},
            )
        )
        return made[-1]

    yield make
    for inst in made:
        inst.close()


@pytest.mark.parametrize(
    "variant",
    [
        {"revision": "fine-tuned-in-place"},
        {"hf_overrides": {"rope_theta": 20000.0}},
        {"quantization": "fp8_per_tensor"},
        {"dtype": "float16"},
        {"model": "fine-tune"},
    ],
    ids=["revision", "hf_overrides-rope_theta", "quantization", "model_dtype", "model-path"],
)
def test_one_namespace_name_on_two_deployments_never_mixes_their_kv(
    deployments: Callable[..., TieringInstance], other_model_dir: str, variant: dict[str, Any]
) -> None:
    """A deployment that cascaded four chunks under a name: another deployment under the same
    name that computes other KV (another revision, rope_theta, quantization, dtype, or another
    checkpoint of the same shape) finds none of them; a second instance of the first promotes
    every one byte for byte."""
    writer = deployments()
    keys = chunk_keys(7, CHUNKS)
    data = payloads(7, CHUNKS, writer.payload_bytes)
    writer.gpu_store(keys, data, writer.context())
    writer.settle()

    kwargs = dict(variant)
    model = other_model_dir if kwargs.pop("model", None) else None
    other = deployments(model, **kwargs)
    assert other.tier.keyspace.namespace.startswith(f"{NAME}.")
    assert other.tier.keyspace.namespace != writer.tier.keyspace.namespace
    ctx = other.context()
    assert other.lookup_until_settled(keys, ctx) == [LookupResult.MISS] * CHUNKS

    twin = deployments()
    assert twin.tier.keyspace.namespace == writer.tier.keyspace.namespace
    ctx = twin.context()
    assert twin.lookup_until_settled(keys, ctx) == [LookupResult.HIT] * CHUNKS
    assert twin.gpu_load(keys, ctx) == data


def test_cache_salt_keeps_tenants_apart_and_shares_within_a_tenant(
    redis_url: str, model_dir: str, instance: Callable[..., TieringInstance]
) -> None:
    """vLLM's real Scheduler over the tiering manager: a prompt another instance cascaded for
    tenant A is promoted for A's next request, and not at all for tenant B's with the same
    tokens."""
    harness = SchedulerHarness(redis_url, model_dir, extra_config=tiering_extra_config(redis_url))
    try:
        tokens = [3 + (i * 11) % 400 for i in range(CHUNKS * BLOCK + 3)]
        seen = harness.add_request(tokens, cache_salt="tenant-a")
        writer = instance()
        keys = [harness.offload_key(seen, g, c) for g in range(3) for c in range(CHUNKS)]
        data = payloads(3, len(keys), writer.payload_bytes)
        writer.gpu_store(keys, data, writer.context())  # type: ignore[arg-type]
        writer.settle()
        harness.run_until_scheduled(seen)

        hits = {}
        for tenant in ("tenant-b", "tenant-a"):
            req = harness.add_request(tokens, cache_salt=tenant)
            steps = harness.run_until_scheduled(req)
            hits[tenant] = len(tokens) - steps[-1].scheduled[req.request_id]
        assert hits == {"tenant-b": 0, "tenant-a": CHUNKS * BLOCK}
    finally:
        harness.close()


def test_tier_refuses_to_start_under_the_stock_connector_in_one_line(
    redis_url: str, model_dir: str
) -> None:
    """vLLM's stock OffloadingConnector builds the tier without vLLM's config, so the tier could
    not tell two deployments of one model path apart: it refuses, naming the connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    vllm_config = make_vllm_config(
        model_dir,
        redis_url,
        kv_connector="OffloadingConnector",
        kv_connector_module_path=None,
        extra_config=tiering_extra_config(redis_url),
    )
    vllm_config.kv_transfer_config.engine_id = "hma-tier-stock-connector"
    kv_cache_config = three_group_kv_cache_config(16, 1000, 3)
    with pytest.raises(ValueError) as refused:
        OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    message = str(refused.value)
    assert "\n" not in message
    assert "RedisOffloadingConnector" in message and "secondary tier" in message
    assert '"kv_connector_module_path": "hma_redis.connector"' in message
    # The documented connector builds it.
    vllm_config.kv_transfer_config.kv_connector = "RedisOffloadingConnector"
    vllm_config.kv_transfer_config.kv_connector_module_path = "hma_redis.connector"
    tiering_manager(vllm_config, kv_cache_config).shutdown()
