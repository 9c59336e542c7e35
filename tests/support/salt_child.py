"""Engine runs whose prompts carry a ``cache_salt`` (for tests/engine/test_tenants.py):
``python -m tests.support.salt_child``.

:func:`hma_redis.tools.devkit.engine.run_job` builds each prompt as
``vllm.inputs.TokensPrompt(prompt_token_ids=...)`` and has no way to pass a salt. This wraps
it: it replaces ``vllm.inputs.TokensPrompt`` by a function that adds ``cache_salt`` from the
environment variable ``HMA_TEST_CACHE_SALT`` (read when the prompt is built, so each run has its
own), imports torch and vLLM once, and then runs each request of a JSON list read from stdin in
a freshly **forked** process, one after the other, exactly like the fork server
(:mod:`tests.support.engine_child`) does: every run is its own process and its own vLLM
instance (the parent never builds an engine), with its stdout/stderr in the files the request
names. For each request it prints one line ``{"returncode": N}`` and stops at the first failure.

Request format: ``{"job": <run_job job>, "env": {...}, "cwd": ..., "stdout_path": ...,
"stderr_path": ...}``. Not a test module.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

from tests.support import engine_child

SALT_ENV = "HMA_TEST_CACHE_SALT"


def _install_salt() -> None:
    import vllm.inputs

    original = vllm.inputs.TokensPrompt

    def salted_prompt(**kwargs: Any) -> Any:
        prompt = original(**kwargs)
        salt = os.environ.get(SALT_ENV)
        if salt:
            prompt["cache_salt"] = salt
        return prompt

    vllm.inputs.TokensPrompt = salted_prompt  # type: ignore[assignment,misc]


def main() -> int:
    requests = json.loads(sys.stdin.read())
    for name in engine_child.PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the forked run imports it again and reports the real error
            sys.stderr.write(f"salt child: preloading {name} failed: {exc!r}\n")
    _install_salt()
    for request in requests:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            engine_child.run_forked(request)  # never returns
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        sys.stdout.write(json.dumps({"returncode": code}) + "\n")
        sys.stdout.flush()
        if code != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
