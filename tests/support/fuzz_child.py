"""A long-lived engine for the fault fuzz (:mod:`tests.support.fault_fuzz`).

``python -m tests.support.fuzz_child '<job json>'`` (or a child of the engine fork server,
:mod:`tests.support.engine_child`, over a loopback connection) builds one engine (job fields as
:func:`hma_redis.tools.devkit.engine.run_job`: ``model``, ``dtype``, ``kv_transfer_config``,
``llm_kwargs``), prints
``READY_LINE``, then serves one JSON request per stdin line, ``{"prompts": [[ids]], "max_tokens":
n}``, with one JSON reply line: per prompt its greedy token ids, the logprob of each, and the
tokens that came from the KV connector. The engine's own prefix cache is emptied before every
prompt, so every cached token comes from the tier; with the job's ``reset_connector`` the
connector's own cache too (a tiering engine's CPU tier: its tokens then come from Redis). EOF
shuts the engine down.

Not a test module (pytest does not collect it).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

from hma_redis.tools.devkit.engine import LLM_DEFAULTS

READY_LINE = "@@HMA_FUZZ_ENGINE_READY@@"


def _serve(llm: Any, request: dict[str, Any], reset_connector: bool) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=True, logprobs=1
    )
    results = []
    for prompt in request["prompts"]:
        llm.reset_prefix_cache(reset_connector=reset_connector)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        completion = out.outputs[0]
        logprobs = [
            float(step[token].logprob)
            for token, step in zip(completion.token_ids, completion.logprobs or [], strict=True)
        ]
        results.append(
            {
                "token_ids": list(completion.token_ids),
                "logprobs": logprobs,
                "num_cached_tokens": int(out.num_cached_tokens or 0),
            }
        )
    return {"results": results}


def serve_job(job: dict[str, Any], reader: TextIO, writer: TextIO) -> None:
    """Build the job's engine, write ``READY_LINE``, then answer each request line of
    ``reader`` with one line on ``writer`` until ``reader`` ends; shut the engine down."""
    if "kv_cache_memory_bytes" in job.get("llm_kwargs", {}):
        # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE (whole GiB) override the job's size.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    cfg = job.get("kv_transfer_config")
    llm = LLM(
        **LLM_DEFAULTS,
        model=job["model"],
        max_model_len=job.get("max_model_len", 2048),
        dtype=job.get("dtype", "auto"),
        kv_transfer_config=KVTransferConfig(**cfg) if cfg else None,
        **job.get("llm_kwargs", {}),
    )
    writer.write(READY_LINE + "\n")
    writer.flush()
    for line in reader:
        if line.strip():
            request = json.loads(line)
            writer.write(json.dumps(_serve(llm, request, bool(job.get("reset_connector")))) + "\n")
            writer.flush()
    llm.llm_engine.engine_core.shutdown()


def main() -> int:
    serve_job(json.loads(sys.argv[1]), sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
