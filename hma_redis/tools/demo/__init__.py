"""Running vLLM with the tier on a CPU: the demo (two engines share a Redis) and the
OpenAI-server example, on the development kit (:mod:`hma_redis.tools.devkit`)."""
