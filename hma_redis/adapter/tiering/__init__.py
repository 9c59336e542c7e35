"""The second mode: Redis as a secondary tier behind vLLM's own CPU tier
(``TieringOffloadingSpec``). vLLM's primary tier takes the GPU copies; this tier moves chunks
between Redis and the primary's buffer on :mod:`hma_redis.core`.

layout (what a chunk looks like in the primary buffer, and the namespace that follows from it)
-> tier (the ``SecondaryTierManager``: lookups through the direct mode's manager, promotions and
cascades on the transfer engine).
"""
