"""Helpers of the tests, imported as ``tests.support.<module>`` (pytest's ``pythonpath`` is the
repository root): real Redis servers (single, Cluster, Sentinel, TLS), a TCP proxy that breaks
connections, KV pages for the transfer engine, harnesses that drive vLLM's real scheduler and
connector, and the runner of engine processes."""
