"""Running vLLM with the tier on a CPU: the demo (two engines share a Redis), the OpenAI-server
example, tiny random-weight models, a throwaway local redis-server, and the engine process they
and the tests run (``engine``)."""
