"""Prompts that carry a ``cache_salt`` (for tests/engine/test_tenants.py).

:func:`hma_redis.tools.devkit.engine.run_job` builds each prompt as
``vllm.inputs.TokensPrompt(prompt_token_ids=...)`` and has no way to pass a salt.
:func:`install_salt` replaces ``vllm.inputs.TokensPrompt`` by a function that adds
``cache_salt`` from the environment variable ``HMA_TEST_CACHE_SALT`` (read when the prompt is
built, so each run has its own). The engine fork server's child (:mod:`tests.support.engine_child`)
installs it for a request with ``salted``: each run is still its own process and its own vLLM
instance, and the fork server itself is never patched. Not a test module.
"""

from __future__ import annotations

import os
from typing import Any

SALT_ENV = "HMA_TEST_CACHE_SALT"


def install_salt() -> None:
    import vllm.inputs

    original = vllm.inputs.TokensPrompt

    def salted_prompt(**kwargs: Any) -> Any:
        prompt = original(**kwargs)
        salt = os.environ.get(SALT_ENV)
        if salt:
            prompt["cache_salt"] = salt
        return prompt

    vllm.inputs.TokensPrompt = salted_prompt  # type: ignore[assignment,misc]
