"""The vLLM adapter: puts :mod:`hma_redis.core` behind vLLM's offloading API.

spec (the OffloadingSpec vLLM builds; namespace: the deployment's fingerprint) -> manager
(scheduler side: lookups batches them, stats counts each event once) / worker (each GPU worker,
onto the transfer engine) -> connector (failed loads recomputed, flushing shutdown); metrics
through vLLM's Prometheus hooks; types shared by them; compat holds the vLLM-version glue.
tiering: the second mode, a secondary tier of vLLM's ``TieringOffloadingSpec`` on the same core
(its lookups through the manager above, its transfers on the core's engine).
"""
