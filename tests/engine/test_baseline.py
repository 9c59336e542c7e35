"""Baseline for the engine tests: separate vLLM instances without a KV connector agree.

Later tier tests compare a run that loads KV from Redis with a run that computed it; that only
means something if two fresh engines on the same tiny model and prompts give the same greedy
tokens, and if a prefix-cache hit gives the same tokens as a full prefill.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_gemma3, build_llama
from tests.support.engine_runner import EngineRun, make_prompts, run_engines

pytestmark = pytest.mark.engine

PROMPT_LEN = 300
MAX_TOKENS = 8


def _describe(name: str, run: EngineRun) -> str:
    groups = ", ".join(
        f"{g.spec}(block={g.block_size}, window={g.sliding_window}, layers={len(g.layers)})"
        for g in run.kv_cache_groups
    )
    return (
        f"{name}: process {run.process_s:.1f}s, LLM() {run.startup_s:.1f}s, "
        f"shutdown {run.shutdown_s:.1f}s, block_size {run.block_size}, groups [{groups}], "
        f"ttft {[round(t, 3) for t in run.ttft_s]}, cached {run.num_cached_tokens}"
    )


def test_two_fresh_engines_agree_and_gemma_has_two_kv_groups(tmp_path: Path) -> None:
    llama = build_llama(tmp_path / "llama")
    gemma = build_gemma3(tmp_path / "gemma3", sliding_window=32)
    prompts = make_prompts(seed=0, n=2, length=PROMPT_LEN, vocab=VOCAB_SIZE)
    # The second instance also repeats the first prompt with its prefix cache kept: a local
    # prefix-cache hit must give the same tokens as the full prefill.
    repeat = [*prompts, prompts[0]]

    runs = run_engines(
        [
            {"model_dir": model, "prompts": p, "reset_prefix_cache_between": reset}
            for model in (llama, gemma)
            for p, reset in ((prompts, True), (repeat, False))
        ],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=None,
    )
    llama_a, llama_b, gemma_a, gemma_b = runs
    for name, run in zip(("llama#1", "llama#2", "gemma3#1", "gemma3#2"), runs, strict=True):
        print(_describe(name, run))

    for first, second in ((llama_a, llama_b), (gemma_a, gemma_b)):
        assert all(len(t) == MAX_TOKENS for t in first.token_ids)
        assert first.token_ids == second.token_ids[:2]
        assert second.token_ids[2] == first.token_ids[0]
        # No connector and a reset prefix cache: nothing cached except the local repeat.
        assert first.num_cached_tokens == [0, 0]
        assert second.num_cached_tokens[:2] == [0, 0]
        block = second.block_size
        assert second.num_cached_tokens[2] == (PROMPT_LEN - 1) // block * block
    # The prompts differ, so do the continuations (the models are not degenerate).
    assert llama_a.token_ids[0] != llama_a.token_ids[1]
    assert gemma_a.token_ids[0] != gemma_a.token_ids[1]

    assert llama_a.num_kv_cache_groups == 1
    assert gemma_a.num_kv_cache_groups == 2, gemma_a.kv_cache_groups
    specs = sorted(g.spec for g in gemma_a.kv_cache_groups)
    assert specs == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert "kv cache group sizes" in gemma_a.stderr
