"""Every input that changes KV bytes changes the namespace, in both modes.

One variant per fingerprint field and per ``model_config`` factor (the list of
docs/key-layout.md): each is built as vLLM builds it (a real ``VllmConfig``, vLLM's
``build_offloading_config``), then the direct spec and the secondary tier of vLLM's real
``TieringOffloadingSpec`` derive their namespaces inside the documented connector's context.
A field that one mode knows and the other leaves empty, or a field added to the fingerprint
without a variant here, fails this file.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hma_redis.adapter import namespace
from hma_redis.adapter.spec import RedisOffloadingSpec, failure_reporting_connector
from hma_redis.adapter.tiering.tier import RedisSecondaryTier
from hma_redis.core.keys import NamespaceFingerprint
from tests.support.scheduler_harness import (
    make_vllm_config,
    three_group_kv_cache_config,
    write_tiny_model_config,
)
from tests.support.tiering import tiering_extra_config

REPO_ROOT = Path(__file__).resolve().parents[2]
# Never contacted by the direct spec; the tier's one write of its info hash fails at once and
# only warns (a Redis that is down at start-up).
UNREACHABLE = "redis://127.0.0.1:1/0"
AUTH_KEY = "namespace-fields-secret-0123456789"


@dataclass
class Deployment:
    """One deployment's inputs: how to build its VllmConfig, KV-cache config and offloading
    config, and its environment."""

    model_dir: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    harness: dict[str, Any] = field(default_factory=dict)  # make_vllm_config's keywords
    cache: dict[str, Any] = field(default_factory=dict)  # CacheConfig fields set afterwards
    kv_cache_config: Callable[[], KVCacheConfig] = lambda: three_group_kv_cache_config(16, 1000, 3)
    offloading: Callable[[OffloadingConfig], OffloadingConfig] = lambda c: c
    env: dict[str, str] = field(default_factory=dict)

    def vllm_config(self) -> VllmConfig:
        vllm_config = make_vllm_config(
            self.model_dir,
            UNREACHABLE,
            model_kwargs={"dtype": "bfloat16", **self.model_kwargs},
            **self.harness,
        )
        for name, value in self.cache.items():
            setattr(vllm_config.cache_config, name, value)
        return vllm_config


def _fingerprints(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> dict[namespace.Mode, tuple[str, NamespaceFingerprint]]:
    """(namespace, fingerprint) of each mode for ``deployment``."""
    with monkeypatch.context() as env:
        env.delenv("HMA_REDIS_AUTH_KEY", raising=False)
        for name, value in deployment.env.items():
            env.setenv(name, value)
        vllm_config = deployment.vllm_config()
        kv_cache_config = deployment.kv_cache_config()
        direct_config = deployment.offloading(build_offloading_config(vllm_config, kv_cache_config))
        with (
            set_current_vllm_config(vllm_config),
            failure_reporting_connector(vllm_config, kv_cache_config),
        ):
            direct = RedisOffloadingSpec(direct_config)
            tier = _tier(direct_config, kv_cache_config)
    return {
        namespace.Mode.DIRECT: (direct.keyspace.namespace, direct.fingerprint),
        namespace.Mode.TIERING: tier,
    }


def _tier(
    direct_config: OffloadingConfig, kv_cache_config: KVCacheConfig
) -> tuple[str, NamespaceFingerprint]:
    """The namespace and fingerprint of the Redis tier of a real ``TieringOffloadingSpec`` over
    the same offloading config (only the extra config and the engine id differ)."""
    row_bytes = 4096 * len(kv_cache_config.kv_cache_groups) * 8
    config = replace(
        direct_config,
        extra_config=tiering_extra_config(UNREACHABLE, cpu_chunks=4)
        | {"cpu_bytes_to_use": 64 * row_bytes},
        engine_id=f"hma-ns-fields-{uuid.uuid4().hex[:12]}",
    )
    manager = TieringOffloadingSpec(config).get_manager()
    try:
        (tier,) = manager.secondary_tiers  # type: ignore[attr-defined]
        assert isinstance(tier, RedisSecondaryTier)
        return tier.keyspace.namespace, tier.fingerprint
    finally:
        manager.shutdown()


def _mamba_kv_cache_config() -> KVCacheConfig:
    """A full-attention group and a Mamba group (a Mamba2/attention hybrid's KV cache)."""
    base = three_group_kv_cache_config(16, 1000, 3)
    mamba = MambaSpec(block_size=16, shapes=((4, 8), (2, 4, 4)), dtypes=(torch.float32,) * 2)
    return KVCacheConfig(
        num_blocks=1000,
        kv_cache_tensors=[],
        kv_cache_groups=[
            base.kv_cache_groups[0],
            KVCacheGroupSpec(["model.layers.1.mixer"], mamba),
        ],
    )


def _parallel(**sizes: int) -> Callable[[OffloadingConfig], OffloadingConfig]:
    return lambda c: replace(c, parallel=replace(c.parallel, **sizes))


# The field of the fingerprint (or the factor inside ``model_config``) each variant changes,
# and how it changes it. Factors are named ``model_config.<factor>``.
def _variants(model_dir: str, other_model_dir: str) -> dict[str, Deployment]:
    d = Deployment
    mamba = _mamba_kv_cache_config
    return {
        "model": d(other_model_dir),
        "revision": d(model_dir, {"revision": "v2"}),
        "quantization": d(model_dir, {"quantization": "fp8_per_tensor"}),
        "model_dtype": d(model_dir, {"dtype": "float16"}),
        "auth_key_id": d(model_dir, env={"HMA_REDIS_AUTH_KEY": AUTH_KEY}),
        "encryption_key_id": d(model_dir, env={"HMA_REDIS_ENCRYPTION_KEY": AUTH_KEY}),
        "kv_dtype": d(
            model_dir, offloading=lambda c: replace(c, model=replace(c.model, dtype="float16"))
        ),
        "groups": d(model_dir, harness={"blocks_per_chunk": 2}),
        "tp_size": d(model_dir, offloading=_parallel(tp_size=2)),
        "pp_size": d(model_dir, offloading=_parallel(pp_size=2)),
        "world_size": d(model_dir, offloading=_parallel(world_size=2)),
        "dcp_size": d(model_dir, offloading=_parallel(dcp_size=2)),
        "pcp_size": d(model_dir, offloading=_parallel(pcp_size=2)),
        "hash_algo": d(model_dir, harness={"hash_algo": "sha256_cbor"}),
        "kv_cache_layout": d(model_dir, offloading=lambda c: replace(c, kv_cache_layout="HND")),
        "format_version": d(model_dir, env={"_FORMAT_VERSION": "99"}),
        "model_config.model_weights": d(model_dir, {"model_weights": "/elsewhere/weights"}),
        "model_config.code_revision": d(model_dir, {"code_revision": "c0ffee"}),
        "model_config.quantization_config": d(
            model_dir,
            {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}},
        ),
        "model_config.hf_overrides": d(model_dir, {"hf_overrides": {"rope_theta": 20000.0}}),
        "model_config.model_impl": d(model_dir, {"model_impl": "transformers"}),
        "model_config.disable_sliding_window": d(model_dir, {"disable_sliding_window": True}),
        "model_config.cache_dtype": d(model_dir, cache={"cache_dtype": "fp8_e5m2"}),
        "model_config.kv_cache_dtype_skip_layers": d(
            model_dir, cache={"kv_cache_dtype_skip_layers": ["0"]}
        ),
        "model_config.sliding_window": d(model_dir, cache={"sliding_window": 64}),
        "model_config.mamba_cache_dtype": d(
            model_dir, cache={"mamba_cache_dtype": "float16"}, kv_cache_config=mamba
        ),
        "model_config.mamba_ssm_cache_dtype": d(
            model_dir, cache={"mamba_ssm_cache_dtype": "float16"}, kv_cache_config=mamba
        ),
        "model_config.mamba_cache_mode": d(
            model_dir, cache={"mamba_cache_mode": "all"}, kv_cache_config=mamba
        ),
        "model_config.conv_state_layout": d(
            model_dir, env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}, kv_cache_config=mamba
        ),
        "model_config.checkpoint_config": d(str(Path(model_dir).parent / "rewritten")),
    }


# What each variant is compared with: the base deployment, or (Mamba factors) the base with the
# Mamba group, whose factors include the Mamba dtypes.
def _base_of(name: str, model_dir: str) -> Deployment:
    if name.startswith(("model_config.mamba_", "model_config.conv_state")):
        return Deployment(model_dir, kv_cache_config=_mamba_kv_cache_config)
    return Deployment(model_dir)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The tiny model, a copy of it at another path, and (``rewritten``) a copy at the first
    path's sibling whose config.json differs in one value: the checkpoint replaced in place
    is compared with the original by path below."""
    root = tmp_path_factory.mktemp("ns-fields")
    model_dir = write_tiny_model_config(root / "tiny")
    other = shutil.copytree(model_dir, root / "tiny-copy")
    rewritten = Path(shutil.copytree(model_dir, root / "rewritten"))
    config = json.loads((rewritten / "config.json").read_text())
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    (rewritten / "config.json").write_text(json.dumps(config))
    yield str(model_dir), str(other)


def _field(fingerprint: NamespaceFingerprint, name: str) -> Any:
    if name.startswith("model_config."):
        return json.loads(fingerprint.model_config).get(name.removeprefix("model_config."))
    return getattr(fingerprint, name)


def _format_version_patch(deployment: Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    version = deployment.env.pop("_FORMAT_VERSION", None)
    if version is not None:
        monkeypatch.setattr(namespace, "FORMAT_VERSION", int(version))


FIELD_NAMES = sorted(
    [f.name for f in dataclasses.fields(NamespaceFingerprint)]
    + [
        f"model_config.{factor}"
        for factor in (
            *namespace.MODEL_FACTORS,
            *namespace.CACHE_FACTORS,
            *namespace.MAMBA_CACHE_FACTORS,
            namespace.CONV_STATE_LAYOUT,
            "checkpoint_config",
        )
    ]
)
# Fields that are containers of the factors above, not inputs of their own.
CONTAINERS = {"model_config"}


def test_every_field_has_a_variant_and_a_line_in_the_key_layout_docs(
    model_dirs: tuple[str, str],
) -> None:
    """The variants below cover every fingerprint field and factor, and docs/key-layout.md
    names each of them: a field added to the fingerprint or a factor added to the list
    without a variant (or without documentation) fails here."""
    variants = _variants(*model_dirs)
    assert set(variants) == set(FIELD_NAMES) - CONTAINERS
    docs = (REPO_ROOT / "docs" / "key-layout.md").read_text()
    section = docs[docs.index("## What makes a namespace") : docs.index("## `info`")]
    for name in FIELD_NAMES:
        assert re.search(rf"`{re.escape(name.split('.')[-1])}`", section), name


@pytest.mark.parametrize("name", sorted(set(FIELD_NAMES) - CONTAINERS))
def test_changing_a_field_changes_the_namespace_in_both_modes(
    name: str, model_dirs: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two deployments that differ only in ``name`` (as far as vLLM lets them) get other
    namespaces, named or not, in the direct mode and in the tiering mode, and the field itself
    differs in both modes' fingerprints (it is an input of each, not a side effect)."""
    model_dir = model_dirs[0]
    variant = _variants(*model_dirs)[name]
    base = _base_of(name, model_dir)
    _format_version_patch(base, monkeypatch)
    before = _fingerprints(base, monkeypatch)
    _format_version_patch(variant, monkeypatch)
    after = _fingerprints(variant, monkeypatch)
    for mode in namespace.Mode:
        (ns_before, fp_before), (ns_after, fp_after) = before[mode], after[mode]
        assert ns_before != ns_after, (mode, name)
        assert _field(fp_before, name) != _field(fp_after, name), (mode, name)
        assert ns_before.endswith(mode.value) and ns_after.endswith(mode.value)
    assert before[namespace.Mode.DIRECT][0] != before[namespace.Mode.TIERING][0]


def test_the_same_deployment_gets_the_same_namespace_in_each_mode(
    model_dirs: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id is a function of the inputs: a second build of one deployment agrees with the
    first in each mode, and both modes carry the same model identity."""
    first = _fingerprints(Deployment(model_dirs[0], {"revision": "v7"}), monkeypatch)
    second = _fingerprints(Deployment(model_dirs[0], {"revision": "v7"}), monkeypatch)
    assert first == second
    direct, tiering = first[namespace.Mode.DIRECT][1], first[namespace.Mode.TIERING][1]
    assert dataclasses.replace(tiering, kv_cache_layout=direct.kv_cache_layout) == direct
