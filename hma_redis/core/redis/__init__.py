"""The Redis medium: the only part of hma_redis that speaks Redis (redis-py clients, the
value jobs' wire code in C and its pure-Python twin, the store that implements
:class:`hma_redis.core.medium.BlockStore`, the breaker, pins, memory, notifications)."""
