"""The engine-agnostic tier: runs wherever torch and redis-py run, never imports vLLM.

config -> keys -> codec -> client -> store -> transfer, each module one step of that flow
(docs/architecture.md). ``tests/core/test_no_vllm.py`` holds the line: every module here
imports and moves KV pages with vLLM absent.
"""
