"""The project's development kit, shared by the demo, the benchmarks, the GPU tools and the
tests: a throwaway local ``redis-server`` and Redis Cluster (``local_redis``), tiny
random-weight models built in code (``tiny_models``), and the one vLLM engine process with the
CPU defaults they all run (``engine``). Never imported by the tier itself."""
