"""The documented entry point vLLM loads by ``spec_module_path``: ``hma_redis.spec`` with
``spec_name`` ``RedisOffloadingSpec`` (implemented in :mod:`hma_redis.adapter.spec`)."""

from hma_redis.adapter.spec import RedisOffloadingSpec

__all__ = ["RedisOffloadingSpec"]
