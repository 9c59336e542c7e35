"""The namespace of a deployment's KV bytes, one function for both modes.

A block hash says which tokens a chunk holds, not what its bytes look like: the namespace
must. :func:`deployment_fingerprint` derives it from the same inputs in the direct spec
(:class:`~hma_redis.adapter.spec.RedisOffloadingSpec`) and in the secondary tier of vLLM's
``TieringOffloadingSpec`` (:class:`~hma_redis.adapter.tiering.tier.RedisSecondaryTier`):
vLLM's offloading config, its model and cache config and its KV-cache groups, and the
``auth_key``'s id and the encryption key's. The modes differ only in the byte layout they
pass (the direct spec's KV-cache layout, the primary tier's row) and in :class:`Mode`'s suffix,
so a field that changes KV bytes cannot be known to one mode and missing from the other
(``tests/adapter/test_namespace_fields.py`` changes each field of docs/key-layout.md and
checks both modes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from enum import Enum
from typing import TYPE_CHECKING, Any

from vllm.config.utils import normalize_value
from vllm.logger import init_logger
from vllm.v1.kv_offload.config import OffloadingConfig

from hma_redis.core.codec import FORMAT_VERSION
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import GroupLayout, NamespaceFingerprint

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

logger = init_logger(__name__)

# ModelConfig fields that change KV bytes, besides model, revision, quantization and dtype
# (fingerprint fields of their own). vLLM's ModelConfig.compute_hash hashes them too, with much
# that changes only the compute graph; it leaves hf_overrides out because it hashes their
# effect on hf_config, which the workers may modify while they load the model (so a hash of it
# could differ between the scheduler and the workers).
MODEL_FACTORS = (
    "model_weights",
    "code_revision",
    "quantization_config",
    "hf_overrides",
    "model_impl",
    "disable_sliding_window",
)
# CacheConfig fields that change KV bytes (block sizes and the KV dtype are fingerprint fields).
CACHE_FACTORS = ("cache_dtype", "kv_cache_dtype_skip_layers", "sliding_window")
# The same for models with Mamba groups only: vLLM resolves them per host (on the CPU by the
# instruction set), and they would split the namespace of attention-only models for nothing.
# ``mamba_cache_mode`` decides which states a block holds (``align``: the state at the block's
# last token; ``all``: every step's), so two modes must not read each other's pages.
MAMBA_CACHE_FACTORS = ("mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_cache_mode")
# For Mamba groups too: the conv state's byte order in a page, (state_len, dim) or (dim,
# state_len), which vLLM takes from its VLLM_SSM_CONV_STATE_LAYOUT environment variable; the
# page size is the same either way, so only this factor tells the two apart.
CONV_STATE_LAYOUT = "conv_state_layout"
# The checkpoint's own config, read from disk (never from the live hf_config, see above).
_CHECKPOINT_CONFIG_FILES = ("config.json", "params.json")


class Mode(Enum):
    """How a deployment lays its KV out in Redis; the value is its namespace's suffix."""

    # RedisOffloadingSpec: one value per chunk, group and worker rank.
    DIRECT = ""
    # RedisSecondaryTier: one value per chunk and group, the primary tier's whole row.
    TIERING = ".tiering"


def deployment_fingerprint(
    config: OffloadingConfig,
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    *,
    kv_cache_layout: str,
    auth_key_id: str,
    encryption_key_id: str = "",
) -> NamespaceFingerprint:
    """Everything that makes KV bytes incompatible, for either mode.

    From vLLM's offloading config: the groups (chunk tokens, layers, bytes per block), the KV
    dtype, the parallel layout; from ``vllm_config``: the model's identity (name, revision,
    quantization, compute dtype, :func:`model_config_factors`) and the prefix-hash
    algorithm; from ``kv_cache_config``: each group's attention kind. ``kv_cache_layout`` is
    how the mode lays a chunk's bytes out (the direct spec: vLLM's KV-cache layout; the
    tiering tier: its primary row). The same inputs give the same fingerprint in every
    process; the scheduler and the workers derive it from fields the workers never modify.
    """
    bpc = config.cache.blocks_per_chunk
    parallel = config.parallel
    groups = tuple(
        GroupLayout(
            tokens_per_chunk=group.tokens_per_block * bpc,
            layer_names=group.layer_names,
            page_bytes=(config.worker_kv_bytes_per_block,),
            kind=group_kind(kv_cache_config.kv_cache_groups[group.group_id].kv_cache_spec),
        )
        for group in config.groups
    )
    model = vllm_config.model_config
    mamba = any(group.kind == "mamba" for group in groups)
    return NamespaceFingerprint(
        model=config.model.name,
        kv_dtype=config.model.dtype,
        groups=groups,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        world_size=parallel.world_size,
        dcp_size=parallel.dcp_size,
        pcp_size=parallel.pcp_size,
        hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
        kv_cache_layout=kv_cache_layout,
        revision=model.revision or "",
        quantization=model.quantization or "",
        model_dtype=str(model.dtype).removeprefix("torch."),
        model_config=model_config_factors(vllm_config, mamba),
        auth_key_id=auth_key_id,
        encryption_key_id=encryption_key_id,
        format_version=FORMAT_VERSION,
    )


def namespace_name(cfg: RedisTierConfig, fingerprint: NamespaceFingerprint, mode: Mode) -> str:
    """The namespace: the fingerprint's id, after the operator's ``namespace`` name and a
    ``.`` when one is set, then the mode's suffix.

    A name alone could put two deployments whose KV bytes differ in one namespace, and the
    values' headers cannot tell them apart where only the weights differ (two fine-tunes of one
    base model have the same layout): one would load the other's KV and answer wrong. With the
    id, deployments share a named namespace exactly when they would share a computed one. The
    fingerprint holds the ``auth_key``'s id and the encryption key's, so instances with different
    shared secrets never meet either (each would find the other's values corrupt and delete
    them, or never be able to read them).
    """
    named = f"{cfg.namespace}." if cfg.namespace is not None else ""
    return f"{named}{fingerprint.namespace_id()}{mode.value}"


def group_kind(spec: KVCacheSpec) -> str:
    """A KV-cache group's attention kind as vLLM's group spec says it: ``full_attention``,
    ``sliding_window:<tokens>``, ``chunked_local_attention:<tokens>``, ``mamba``, else the
    spec's class name in snake case (``mla_attention``, ``cross_attention``, ...).

    A worker's group may hold one spec per layer (``UniformTypeKVCacheSpecs``) where the
    scheduler's holds the first of them: both sides name the first, so they agree.
    """
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window:{spec.sliding_window}"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"chunked_local_attention:{spec.attention_chunk_size}"
    if isinstance(spec, MambaSpec):
        return "mamba"
    if type(spec) is FullAttentionSpec:
        # Without the hybrid allocator, sliding-window layers are full-attention groups that
        # record their window.
        if spec.sliding_window is not None:
            return f"full_attention(sliding_window:{spec.sliding_window})"
        if spec.attention_chunk_size is not None:
            return f"full_attention(chunked_local_attention:{spec.attention_chunk_size})"
        return "full_attention"
    name = type(spec).__name__.removesuffix("Spec")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def model_config_factors(vllm_config: VllmConfig, mamba: bool = False) -> str:
    """Canonical JSON of the model and cache options that change KV bytes and have no
    fingerprint field of their own (docs/key-layout.md lists them); the Mamba cache dtypes,
    mode and conv-state layout only when the model has ``mamba`` groups.

    Read only from fields the workers never modify and from the checkpoint's config file on
    disk, so the scheduler and every worker derive the same text.
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    factors: dict[str, Any] = {name: _normalized(getattr(model, name)) for name in MODEL_FACTORS}
    cache_factors = CACHE_FACTORS + (MAMBA_CACHE_FACTORS if mamba else ())
    factors.update({name: _normalized(getattr(cache, name)) for name in cache_factors})
    if mamba:
        factors[CONV_STATE_LAYOUT] = conv_state_layout()
    factors["checkpoint_config"] = _checkpoint_config_digest(model)
    return json.dumps(factors, sort_keys=True, separators=(",", ":"), default=str)


def conv_state_layout() -> str:
    """vLLM's conv-state layout as its ``get_conv_state_layout`` resolves it (``SD`` unless
    VLLM_SSM_CONV_STATE_LAYOUT says ``DS``), read from the environment each call (vLLM's own
    function caches the first answer of the process)."""
    from vllm import envs

    return str(envs.VLLM_SSM_CONV_STATE_LAYOUT or "SD")


def _normalized(value: Any) -> Any:
    """vLLM's canonical, JSON-able form of a config value (as its config hashes use it); a
    function (``hf_overrides`` may be one) by its qualified name."""
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '?')}"
    return normalize_value(value)


def _checkpoint_config_digest(model: ModelConfig) -> str:
    """SHA-256 (16 hex digits) of the checkpoint's config file as canonical JSON; "" when there
    is none on this host (a Hub model not in the local cache is pinned by its revision)."""
    path = _checkpoint_config_path(model)
    if path is None:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError) as exc:
        logger.warning("hma_redis: cannot read the model's config %s: %s", path, exc)
        return ""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _checkpoint_config_path(model: ModelConfig) -> str | None:
    source = model.hf_config_path or model.model
    for name in _CHECKPOINT_CONFIG_FILES:
        if os.path.isdir(source):
            candidate = os.path.join(source, name)
            if os.path.isfile(candidate):
                return candidate
            continue
        cached = _hub_cached_file(source, name, model.revision)
        if cached is not None:
            return cached
    return None


def _hub_cached_file(repo_id: str, name: str, revision: str | None) -> str | None:
    """``name`` of a Hub repo from the local cache (never the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, name, revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return found if isinstance(found, str) else None
