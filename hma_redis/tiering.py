"""The documented entry point vLLM's ``TieringOffloadingSpec`` loads by ``module_path``:
``hma_redis.tiering`` with ``type`` ``RedisSecondaryTier`` (implemented in
:mod:`hma_redis.adapter.tiering.tier`)."""

from hma_redis.adapter.tiering.tier import RedisSecondaryTier

__all__ = ["RedisSecondaryTier"]
