"""The kv-transfer-config users put in front of vLLM, for tests."""

from __future__ import annotations

from typing import Any


def tier_config(redis_url: str, **extra: Any) -> dict[str, Any]:
    """The README's configuration, pointed at ``redis_url``."""
    return {
        "kv_connector": "RedisOffloadingConnector",
        "kv_connector_module_path": "hma_redis.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "RedisOffloadingSpec",
            "spec_module_path": "hma_redis.spec",
            "redis_url": redis_url,
            **extra,
        },
    }


def chunk_aligned_prefix(num_tokens: int, chunk_tokens: int) -> int:
    """The longest prefix vLLM can load: whole chunks, and at least one token left to compute."""
    return (num_tokens - 1) // chunk_tokens * chunk_tokens
