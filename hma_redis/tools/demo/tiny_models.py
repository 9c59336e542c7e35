"""Tiny random-weight models for engine tests (no hub access needed).

Each builder writes a ``transformers`` checkpoint (config, generation config, safetensors weights)
into a directory and returns its path. Weights are random but seeded, so two builds of the same
model are byte-identical and every vLLM instance that loads one computes the same thing. No
tokenizer is written: engines run with ``skip_tokenizer_init=True`` and prompt token ids.

Sizes are chosen for vLLM's CPU attention backend: head size 64 (one of its supported sizes),
float32 weights (the CPU backend runs fp32, bf16 and fp16; fp32 keeps greedy decoding stable).
"""

from __future__ import annotations

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

    ``overrides`` replace ``LlamaConfig`` fields (a larger model for a benchmark, say)."""
    config = LlamaConfig(**_common(**{"num_hidden_layers": 2, **overrides}))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return _save(model, path)


def build_gemma3(path: str | Path, sliding_window: int = 32) -> str:
    """Gemma3ForCausalLM (text only): 4 layers alternating sliding-window / full attention.

    vLLM builds two KV cache groups from it: one for the two sliding-window layers, one for the
    two full-attention layers (same page size, so the hybrid manager keeps them as two groups).
    """
    config = Gemma3TextConfig(
        **_common(
            num_hidden_layers=4,
            query_pre_attn_scalar=HEAD_DIM,
            sliding_window=sliding_window,
            layer_types=["sliding_attention", "full_attention"] * 2,
            # Untied: tied to the sqrt(hidden)-scaled embedding, a random Gemma repeats one token.
            tie_word_embeddings=False,
        )
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(SEED)
    model = Gemma3ForCausalLM(config).eval()
    return _save(model, path)
