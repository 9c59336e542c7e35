"""The transfer engine: chunks of KV pages <-> values of a medium, on threads, within a byte
budget; it sees the medium only through :mod:`hma_redis.core.medium`."""
