"""hma_redis: a Redis-backed shared KV-cache tier for vLLM, for hybrid (multi-group) models.

``hma_redis.core`` is the engine-agnostic tier (no vLLM import), ``hma_redis.adapter`` plugs it
into vLLM, ``hma_redis.tools`` holds the CLI, benchmarks and demos (never imported by the
runtime). vLLM loads ``hma_redis.spec`` and ``hma_redis.connector`` (see docs/architecture.md).
"""
