"""``hma-redis events``: the fleet-wide KV-event publisher for cache-aware routers.

:mod:`~hma_redis.tools.events.chunks` (what Redis holds; per-group and usable changes),
:mod:`~hma_redis.tools.events.batches` (the changes as vLLM's KV events) and
:mod:`~hma_redis.tools.events.service` (the loop: keyspace feed → table → ZMQ publisher).
Needs vLLM (its event classes and ``ZmqEventPublisher``); see docs/events.md.
"""
