"""The kv-transfer-config users put in front of vLLM, for tests."""

from __future__ import annotations

from typing import Any

from hma_redis.tools.devkit.engine import kv_transfer_config
from tests.support.engine_runner import EngineRun


def tier_config(redis_url: str, **extra: Any) -> dict[str, Any]:
    """The README's configuration, pointed at ``redis_url``."""
    return kv_transfer_config(redis_url, **extra)


def chunk_aligned_prefix(num_tokens: int, chunk_tokens: int) -> int:
    """The longest prefix vLLM can load: whole chunks, and at least one token left to compute."""
    return (num_tokens - 1) // chunk_tokens * chunk_tokens


def assert_loaded_from_the_tier(run: EngineRun, prompts: list[list[int]]) -> None:
    """Every prompt's chunk-aligned prefix (at least 90 % of it) came from Redis."""
    for result, prompt in zip(run.results, prompts, strict=True):
        aligned = chunk_aligned_prefix(len(prompt), run.block_size)
        assert result.num_cached_tokens > 0 and result.num_cached_tokens >= 0.9 * aligned, (
            result.num_cached_tokens,
            aligned,
            run.stderr_tail,
        )
