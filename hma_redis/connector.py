"""The documented entry point vLLM loads by ``kv_connector_module_path``: ``hma_redis.connector``
with ``kv_connector`` ``RedisOffloadingConnector`` (implemented in
:mod:`hma_redis.adapter.connector`)."""

from hma_redis.adapter.connector import RedisOffloadingConnector

__all__ = ["RedisOffloadingConnector"]
