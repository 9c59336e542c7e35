"""The kv-transfer-config that puts vLLM in front of the tier (the README's, in code)."""

from __future__ import annotations

from typing import Any


def kv_transfer_config(redis_url: str, **extra: Any) -> dict[str, Any]:
    """``KVTransferConfig`` fields for hma_redis at ``redis_url``; ``extra`` goes to the tier's
    ``kv_connector_extra_config`` (e.g. ``read_timeout_s=1.0``)."""
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
