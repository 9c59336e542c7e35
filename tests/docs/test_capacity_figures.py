"""docs/capacity.md's table "What Redis holds per token of prefix", row by row, against what
vLLM 0.32 itself makes of each model's public ``config.json``, on this CPU and without weights:
the layers' KV-cache specs and their page sizes, the block size a Hopper GPU runs, how vLLM's
hybrid allocator splits the layers into KV groups, and which chunks of a 4,096-token prompt
vLLM's offloading connector stores per group. Only the jemalloc rounding is the doc's own
(measured) rule, ``benchmarks.capacity_model.redis_bytes``. A cell vLLM contradicts fails here.

The VllmConfig is built on the CPU platform, which adjusts it for CPU kernels; the doc sizes a
GPU fleet, so those adjustments are undone and the GPU's block-size steps are run instead (see
:func:`_gpu_vllm_config`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

try:  # vLLM 0.33 moved it to the offloading config module (same signature)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_sliding_window_size_in_chunks,
    )
except ImportError:  # vLLM 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        get_sliding_window_size_in_chunks,
    )
from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
from vllm.model_executor.models import ModelRegistry
from vllm.platforms.interface import Platform
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import record_kv_cache_layout

try:  # vLLM 0.33 moved it to kv_cache_planning (same signature)
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from benchmarks.capacity_model import ENVELOPE, redis_bytes
from hma_redis.adapter.connector import RedisOffloadingConnector

CAPACITY_DOC = Path(__file__).parents[2] / "docs" / "capacity.md"
PROMPT_TOKENS = 4096
KIB, MIB = 1 << 10, 1 << 20

# The table's header, column for column: a renamed or moved column fails here, not silently.
COLUMNS = (
    "model (public config)",
    "KV groups (full / sliding or local / state)",
    "chunk tokens",
    "full-attention KiB/token",
    "sliding or local KiB/token (window)",
    "state per boundary",
    "payload of a 4,096-token prompt",
    "averaged per token",
    "values",
    "one value → taken in Redis",
    "Redis memory of the prompt",
)

# Layer types that vLLM's hybrid models build as attention (qwen3_next.py, lfm2.py:
# "full_attention"; granitemoehybrid.py: "attention"); any other type there is a state layer.
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "attention"})


@dataclass(frozen=True)
class PublicConfig:
    """The ``config.json`` fields vLLM reads for the KV cache, as the model's public config
    has them (written here: the tests run without the hub). ``label`` is the table row's
    first words, up to the colon."""

    label: str
    repo: str
    config: Mapping[str, Any]


MODELS = (
    PublicConfig(
        "Llama-3-8B",
        "meta-llama/Meta-Llama-3-8B",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "vocab_size": 128256,
            "torch_dtype": "bfloat16",
        },
    ),
    PublicConfig(
        # The language model of google/gemma-3-27b-it: its text_config, as Gemma3ForCausalLM
        # (the vision tower keeps no KV cache).
        "Gemma-3-27B",
        "google/gemma-3-27b-it (text_config)",
        {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_hidden_layers": 62,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "query_pre_attn_scalar": 168,
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "max_position_embeddings": 131072,
            "vocab_size": 262208,
            "torch_dtype": "bfloat16",
        },
    ),
    PublicConfig(
        "Qwen3-Next-80B-A3B",
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "full_attention_interval": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "intermediate_size": 5120,
            "partial_rotary_factor": 0.25,
            "max_position_embeddings": 262144,
            "vocab_size": 151936,
            "torch_dtype": "bfloat16",
        },
    ),
    PublicConfig(
        "DeepSeek-V3",
        "deepseek-ai/DeepSeek-V3 (without its fp8 weight quantization_config)",
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048,
            "intermediate_size": 18432,
            "first_k_dense_replace": 3,
            "n_group": 8,
            "topk_group": 4,
            "max_position_embeddings": 163840,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "vocab_size": 129280,
            "torch_dtype": "bfloat16",
        },
    ),
    PublicConfig(
        "LFM2-1.2B",
        "LiquidAI/LFM2-1.2B",
        {
            "architectures": ["Lfm2ForCausalLM"],
            "model_type": "lfm2",
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "conv_L_cache": 3,
            "conv_bias": False,
            "conv_dim": 2048,
            "block_dim": 2048,
            "block_ff_dim": 12288,
            "layer_types": [
                *("conv", "conv", "full_attention"),
                *("conv", "conv", "full_attention"),
                *("conv", "conv", "full_attention"),
                *("conv", "full_attention"),
                *("conv", "full_attention"),
                *("conv", "full_attention", "conv"),
            ],
            "max_position_embeddings": 128000,
            "vocab_size": 65536,
            "torch_dtype": "bfloat16",
        },
    ),
    PublicConfig(
        # The language model of meta-llama/Llama-4-Scout-17B-16E: its text_config, as
        # Llama4ForCausalLM. An empty no_rope_layers is transformers' default: every 4th layer
        # is a no-rope global layer.
        "Llama-4-Scout-17B-16E",
        "meta-llama/Llama-4-Scout-17B-16E (text_config)",
        {
            "architectures": ["Llama4ForCausalLM"],
            "model_type": "llama4_text",
            "hidden_size": 5120,
            "num_hidden_layers": 48,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "attention_chunk_size": 8192,
            "no_rope_layers": [],
            "num_local_experts": 16,
            "num_experts_per_tok": 1,
            "intermediate_size": 8192,
            "intermediate_size_mlp": 16384,
            "max_position_embeddings": 10485760,
            "vocab_size": 202048,
            "torch_dtype": "bfloat16",
        },
    ),
    PublicConfig(
        "granite-4.0-h-small",
        "ibm-granite/granite-4.0-h-small",
        {
            "architectures": ["GraniteMoeHybridForCausalLM"],
            "model_type": "granitemoehybrid",
            "hidden_size": 4096,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "layer_types": [
                *["mamba"] * 5 + ["attention"],
                *["mamba"] * 9 + ["attention"],
                *["mamba"] * 9 + ["attention"],
                *["mamba"] * 9 + ["attention"],
                *["mamba"] * 4,
            ],
            "mamba_n_heads": 128,
            "mamba_d_head": 64,
            "mamba_n_groups": 1,
            "mamba_d_state": 128,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 256,
            "num_local_experts": 72,
            "num_experts_per_tok": 10,
            "intermediate_size": 768,
            "shared_intermediate_size": 1536,
            "position_embedding_type": "nope",
            "max_position_embeddings": 131072,
            "vocab_size": 100352,
            "torch_dtype": "bfloat16",
        },
    ),
)


class GroupKind(Enum):
    """The table's three kinds of KV group."""

    FULL = "full"  # full attention, MLA
    WINDOWED = "sliding or local"  # sliding window, chunked local attention
    STATE = "state"  # MambaSpec: Gated DeltaNet, Mamba2, short conv


@dataclass(frozen=True)
class GroupFigures:
    """One KV group as hma_redis stores it: ``body`` bytes per value (the unpadded pages of
    the group's layers for one chunk) and the chunks of the prompt vLLM stores for it."""

    kind: GroupKind
    layers: int
    body: int
    tokens_per_chunk: int
    stored_chunks: int
    window: int | None

    @property
    def bytes_per_token(self) -> int:
        return self.body // self.tokens_per_chunk


@dataclass(frozen=True)
class Quantity:
    """A number as the doc prints it, with the slack its rounding allows (half a last digit)."""

    value: float
    slack: float

    def holds(self, actual: float) -> bool:
        return abs(self.value - actual) <= self.slack + 1e-9


def _gpu_backend(model_config: ModelConfig) -> type[AttentionBackend]:
    """The attention backend's class whose kernel block sizes vLLM aligns to on an H100/H200:
    FLASH_ATTN, and for MLA FLASH_ATTN_MLA (platforms/cuda.py ``_get_backend_priorities``,
    sm90). FLASH_ATTN_MLA needs vllm_flash_attn to import; TRITON_MLA declares the same
    kernel block sizes (``[MultipleOf(16)]``, mla/flashattn_mla.py) and stands in for it."""
    if model_config.use_mla:
        return AttentionBackendEnum.TRITON_MLA.get_class()
    return AttentionBackendEnum.FLASH_ATTN.get_class()


def _gpu_vllm_config(model_dir: Path) -> VllmConfig:
    """The VllmConfig a GPU engine with prefix caching and hma_redis would run, built on the
    CPU. The CPU platform's own changes (block 128, float32 SSM states on AVX-512 hosts) are
    undone; then the two steps of ``Platform.update_block_size_for_backend`` (the backend's
    preferred block, then the hybrid alignment that raises the attention block until its
    page holds a state) run with the GPU backend, since no layers exist to find it from."""
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=8192, max_model_len=8192, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
    )
    cache = config.cache_config
    cache.mamba_ssm_cache_dtype = "auto"
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    backend = _gpu_backend(config.model_config)
    cache.block_size = Platform._preferred_block_size_for_backends(
        [backend], CacheConfig.DEFAULT_BLOCK_SIZE, config
    )
    if config.model_config.is_hybrid:
        cache.mamba_block_size = cache.block_size  # MambaModelConfig, with the GPU's block
        Platform._align_hybrid_block_size(config, backend)
    # The layout the offloading connector asks for (and the engine core then records).
    record_kv_cache_layout(cache, RedisOffloadingConnector.get_required_kvcache_layout(config))
    return config


def _layer_spec(config: VllmConfig, layer: int) -> KVCacheSpec:
    """The spec vLLM's layer ``layer`` reports (``get_kv_cache_spec``), built as that layer
    builds it: which layer is which follows the model's code (gemma3.py layer_types,
    llama4.py no_rope_layers, the hybrids' layer_types; DeepSeek-V3: MLA everywhere)."""
    model, cache = config.model_config, config.cache_config
    hf = model.hf_text_config
    attention: dict[str, Any] = {
        "block_size": cache.block_size,
        "num_kv_heads": model.get_num_kv_heads(config.parallel_config),
        "head_size": model.get_head_size(),
        "dtype": model.dtype,
    }
    layer_type = (getattr(hf, "layer_types", None) or [None] * hf.num_hidden_layers)[layer]
    if model.use_mla:  # mla_attention.py MLAAttention.get_kv_cache_spec
        return MLAAttentionSpec(
            **{**attention, "num_kv_heads": 1},
            max_tp_shards=1,
            cache_dtype_str=cache.cache_dtype,
        )
    if model.is_hybrid and layer_type not in _ATTENTION_LAYER_TYPES:
        return _state_spec(config)
    if layer_type == "sliding_attention":
        return _sliding_spec(config, attention, hf.sliding_window)
    if getattr(hf, "attention_chunk_size", None) and hf.no_rope_layers[layer]:
        return ChunkedLocalAttentionSpec(**attention, attention_chunk_size=hf.attention_chunk_size)
    return FullAttentionSpec(**attention)


def _state_spec(config: VllmConfig) -> MambaSpec:
    """A Mamba-style layer's spec (mamba/abstract.py ``MambaBase.get_kv_cache_spec``), its
    shapes and dtypes from the model class, as vLLM's hybrid alignment computes them."""
    model, cache = config.model_config, config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    return MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(config)),
        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(config)),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_cache_mode=cache.mamba_cache_mode,
    )


def _sliding_spec(config: VllmConfig, attention: dict[str, Any], window: int) -> KVCacheSpec:
    """attention.py ``Attention.get_kv_cache_spec`` for a sliding-window layer: it picks its
    own block, the largest kernel block of the backend within the primary page."""
    backend = _gpu_backend(config.model_config)
    per_token = SlidingWindowSpec(**{**attention, "block_size": 1}, sliding_window=window)
    block = _largest_kernel_block_within(
        backend,
        per_token.real_page_size_bytes,
        per_token.real_page_size_bytes * attention["block_size"],
        attention["block_size"],
        per_token,
    )
    return SlidingWindowSpec(**{**attention, "block_size": block}, sliding_window=window)


def _unpadded_page(spec: KVCacheSpec) -> int:
    """Bytes of one block of one layer as the offloading worker hands them to hma_redis
    (offloading/worker.py: the unpadded page; a state's padding is not stored)."""
    if isinstance(spec, AttentionSpec):
        return spec.unpadded_page_size_bytes
    assert isinstance(spec, MambaSpec), spec
    return replace(spec, page_size_padded=None).page_size_bytes


def _kind(spec: KVCacheSpec, tokens_per_chunk: int) -> GroupKind:
    """The doc's group kinds, from the offloading scheduler's own test
    (``get_sliding_window_size_in_chunks``: None for full attention, 1 for a state)."""
    if get_sliding_window_size_in_chunks(spec, tokens_per_chunk) is None:
        return GroupKind.FULL
    return GroupKind.STATE if isinstance(spec, MambaSpec) else GroupKind.WINDOWED


def _stored_chunks(
    config: VllmConfig, group: KVCacheGroupSpec, alignment_tokens: int | None
) -> int:
    """Chunks of the group that vLLM's offloading scheduler stores for one finished prompt of
    PROMPT_TOKENS tokens, one block per chunk (``_build_store_jobs``): the whole chunks of
    the prompt, thinned by the group manager's ``reachable_block_mask`` (a sliding window keeps
    the window before the replay boundary, a state group the state at it)."""
    spec = group.kv_cache_spec
    chunks = PROMPT_TOKENS // spec.block_size
    retention = config.cache_config.prefix_cache_retention_interval
    manager = KVCacheSpecRegistry.get_manager_class(spec)
    assert manager is not None
    mask = manager.reachable_block_mask(
        start_block=0,
        end_block=chunks,
        alignment_tokens=alignment_tokens,
        kv_cache_spec=spec,
        use_eagle=False,
        retention_interval=retention,
        reachable_boundaries=(PROMPT_TOKENS - 1,) if retention is not None else (),
        final_segment_end_block=chunks,
    )
    return chunks if mask is None else sum(mask)


def vllm_groups(model_dir: Path) -> list[GroupFigures]:
    """What vLLM makes of the config.json in ``model_dir``, group by group."""
    config = _gpu_vllm_config(model_dir)
    layers = config.model_config.hf_text_config.num_hidden_layers
    specs = {f"model.layers.{i}.attn": _layer_spec(config, i) for i in range(layers)}
    groups = get_kv_cache_groups(config, dict(specs))
    kinds = [_kind(g.kv_cache_spec, g.kv_cache_spec.block_size) for g in groups]
    full_chunk = {
        g.kv_cache_spec.block_size
        for g, k in zip(groups, kinds, strict=True)
        if k is GroupKind.FULL
    }
    alignment = full_chunk.pop() if len(full_chunk) == 1 else None  # SchedulerOffloadConfig
    return [
        GroupFigures(
            kind=kind,
            layers=len(group.layer_names),
            body=sum(_unpadded_page(specs[name]) for name in group.layer_names),
            tokens_per_chunk=group.kv_cache_spec.block_size,
            stored_chunks=_stored_chunks(config, group, alignment),
            window=_window(group.kv_cache_spec),
        )
        for group, kind in zip(groups, kinds, strict=True)
    ]


def _window(spec: KVCacheSpec) -> int | None:
    if isinstance(spec, SlidingWindowSpec):
        return spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return spec.attention_chunk_size
    return None


@dataclass(frozen=True)
class RowFigures:
    """One table row's figures, from vLLM's groups (``value_sizes``: each distinct value
    size, body + envelope, with what Redis takes for it)."""

    groups: tuple[int, int, int]  # full / windowed / state
    chunk_tokens: frozenset[int]
    full_per_token: int
    windowed_per_token: int
    windows: frozenset[int]
    state_per_boundary: int
    payload: int
    values: int
    value_sizes: frozenset[tuple[int, int]]
    redis_memory: int


def row_figures(groups: Sequence[GroupFigures]) -> RowFigures:
    """The row's figures; Redis memory by the doc's jemalloc rule
    (``benchmarks.capacity_model.redis_bytes``) on each value, body + envelope."""

    def of(kind: GroupKind) -> list[GroupFigures]:
        return [g for g in groups if g.kind is kind]

    return RowFigures(
        groups=(len(of(GroupKind.FULL)), len(of(GroupKind.WINDOWED)), len(of(GroupKind.STATE))),
        chunk_tokens=frozenset(g.tokens_per_chunk for g in groups),
        full_per_token=sum(g.bytes_per_token for g in of(GroupKind.FULL)),
        windowed_per_token=sum(g.bytes_per_token for g in of(GroupKind.WINDOWED)),
        windows=frozenset(g.window for g in of(GroupKind.WINDOWED) if g.window is not None),
        state_per_boundary=sum(g.body for g in of(GroupKind.STATE)),
        payload=sum(g.stored_chunks * g.body for g in groups),
        values=sum(g.stored_chunks for g in groups),
        value_sizes=frozenset((g.body + ENVELOPE, redis_bytes(g.body + ENVELOPE)) for g in groups),
        redis_memory=sum(g.stored_chunks * redis_bytes(g.body + ENVELOPE) for g in groups),
    )


# --- the doc's side ----------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KiB": KIB, "MiB": MIB, "GiB": 1 << 30}
_NUMBER = r"(\d[\d,]*(?:\.\d+)?)"


def _quantity(text: str, unit: str = "") -> Quantity:
    """``"37.7 MiB"`` → 37.7 MiB in bytes, give or take half of its last digit."""
    match = re.fullmatch(_NUMBER + r"\s*(B|KiB|MiB|GiB)?", text.strip().strip("*").strip())
    assert match, f"not a quantity: {text!r}"
    digits, own_unit = match.group(1).replace(",", ""), match.group(2) or unit
    decimals = len(digits.partition(".")[2])
    scale = _UNITS[own_unit]
    return Quantity(float(digits) * scale, 0.5 * 10**-decimals * scale)


def doc_table() -> dict[str, dict[str, str]]:
    """The table's rows by label (the first cell up to its colon), cells by column."""
    lines = CAPACITY_DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| model (public config)"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    assert tuple(header) == COLUMNS, f"docs/capacity.md's table has columns {header}"
    rows: dict[str, dict[str, str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0].split(":")[0]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def _pairs(text: str) -> set[tuple[Quantity, Quantity]]:
    """``"1.25 → 1.50 MiB (full); 192 → 224 KiB (state)"`` → its (value, taken) pairs."""
    found = re.findall(_NUMBER + r"\s*→\s*" + _NUMBER + r"\s*(KiB|MiB)", text)
    assert found and len(found) == text.count("→"), f"each '→' needs 'a → b KiB|MiB': {text!r}"
    return {(_quantity(a, unit), _quantity(b, unit)) for a, b, unit in found}


def mismatches(cells: Mapping[str, str], vllm: RowFigures) -> list[str]:
    """The cells of one row that vLLM's figures contradict, each with vLLM's figure."""
    c = [cells[column] for column in COLUMNS]
    checks: list[tuple[int, bool, object]] = [
        (1, tuple(int(n) for n in c[1].split("/")) == vllm.groups, vllm.groups),
        (2, {_quantity(c[2]).value} == vllm.chunk_tokens, set(vllm.chunk_tokens)),
        (3, _absent_or(c[3], "KiB").holds(vllm.full_per_token), vllm.full_per_token / KIB),
        (4, _windowed_holds(c[4], vllm), (vllm.windowed_per_token / KIB, set(vllm.windows))),
        (5, _absent_or(c[5], "MiB").holds(vllm.state_per_boundary), _mib(vllm.state_per_boundary)),
        (6, _quantity(c[6], "MiB").holds(vllm.payload), _mib(vllm.payload)),
        (
            7,
            _quantity(c[7], "KiB").holds(vllm.payload / PROMPT_TOKENS),
            vllm.payload / PROMPT_TOKENS / KIB,
        ),
        (8, _quantity(c[8]).holds(vllm.values), vllm.values),
        (9, _pairs_hold(c[9], vllm.value_sizes), sorted(map(_mib_pair, vllm.value_sizes))),
        (10, _quantity(c[10], "MiB").holds(vllm.redis_memory), _mib(vllm.redis_memory)),
    ]
    return [f"{COLUMNS[i]}: doc {c[i]!r}, vLLM {figure}" for i, ok, figure in checks if not ok]


def _absent_or(text: str, unit: str) -> Quantity:
    """A cell's figure; "–" is none (0)."""
    return Quantity(0, 0) if text == "–" else _quantity(text, unit)


def _windowed_holds(text: str, vllm: RowFigures) -> bool:
    """``"416 (1,024 tokens)"`` against the windowed groups' KiB per token and window."""
    if text == "–":
        return vllm.windowed_per_token == 0
    match = re.fullmatch(_NUMBER + r" \(" + _NUMBER + r" tokens\)", text)
    assert match, f"not 'KiB/token (window tokens)': {text!r}"
    window = _quantity(match.group(2)).value
    per_token = _quantity(match.group(1), "KiB")
    return per_token.holds(vllm.windowed_per_token) and vllm.windows == {window}


def _pairs_hold(text: str, actual: frozenset[tuple[int, int]]) -> bool:
    """Every distinct value size of the row is in the cell, and the cell names no other."""
    doc = _pairs(text)
    covered = all(any(a.holds(v) and b.holds(t) for a, b in doc) for v, t in actual)
    named = all(any(a.holds(v) and b.holds(t) for v, t in actual) for a, b in doc)
    return covered and named


def _mib(size: float) -> str:
    return f"{size / MIB:.3f} MiB"


def _mib_pair(pair: tuple[int, int]) -> str:
    return f"{pair[0] / MIB:.3f} → {pair[1] / MIB:.3f} MiB"


# --- tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table() -> dict[str, dict[str, str]]:
    return doc_table()


def test_every_row_of_the_table_is_checked_against_vllm(table: dict[str, dict[str, str]]) -> None:
    assert sorted(table) == sorted(model.label for model in MODELS)


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.label)
def test_the_row_says_what_vllm_computes_from_the_public_config(
    model: PublicConfig, table: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(model.config))
    wrong = mismatches(table[model.label], row_figures(vllm_groups(tmp_path)))
    assert not wrong, f"{model.label} ({model.repo}):\n  " + "\n  ".join(wrong)


def test_a_figure_vllm_contradicts_is_found(
    table: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    """The check can fail: the Gemma-3 row with a window one chunk wider, one value more and
    a value size vLLM never makes is caught in exactly those three cells."""
    gemma = next(model for model in MODELS if model.label == "Gemma-3-27B")
    (tmp_path / "config.json").write_text(json.dumps(gemma.config))
    vllm = row_figures(vllm_groups(tmp_path))
    cells = dict(table[gemma.label])
    cells[COLUMNS[4]] = cells[COLUMNS[4]].replace("1,024 tokens", "1,040 tokens")
    cells[COLUMNS[8]] = str(int(cells[COLUMNS[8]].replace(",", "")) + 1)
    cells[COLUMNS[9]] += "; 2.00 → 2.50 MiB"
    found = {line.partition(":")[0] for line in mismatches(cells, vllm)}
    assert found == {COLUMNS[4], COLUMNS[8], COLUMNS[9]}
