"""The kv-transfer-config users put in front of vLLM, for tests."""

from __future__ import annotations

from typing import Any

from hma_redis.tools.demo.engine import kv_transfer_config


def tier_config(redis_url: str, **extra: Any) -> dict[str, Any]:
    """The README's configuration, pointed at ``redis_url``."""
    return kv_transfer_config(redis_url, **extra)


def chunk_aligned_prefix(num_tokens: int, chunk_tokens: int) -> int:
    """The longest prefix vLLM can load: whole chunks, and at least one token left to compute."""
    return (num_tokens - 1) // chunk_tokens * chunk_tokens
