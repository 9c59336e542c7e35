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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
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
