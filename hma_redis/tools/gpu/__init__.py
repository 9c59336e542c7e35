"""The GPU check (``python -m hma_redis.tools.gpu.check``): the transfer engine on a CUDA KV
cache shaped like Llama-3-8B, against a local Redis and a local 3-shard Redis Cluster, printing
one table (correctness, GB/s per connection count, load timing, compute-stream overlap).

Imports torch, redis-py and :mod:`hma_redis.core` only (never vLLM), so it runs on an offline GPU
host from the bundle that ``scripts/gpu_bundle.sh`` builds (``scripts/gpu_check.sh`` runs it
there; docs/gpu.md). ``--device cpu`` runs the same checks on a small CPU KV cache in seconds
(tests/tools/test_gpu_check.py).
"""
