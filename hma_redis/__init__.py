"""hma_redis: a Redis-backed shared KV-cache tier for vLLM, for hybrid (multi-group) models."""

from hma_redis.config import RedisTierConfig

FORMAT_VERSION = 2

__all__ = ["FORMAT_VERSION", "RedisTierConfig"]
