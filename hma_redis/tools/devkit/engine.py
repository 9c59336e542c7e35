"""Running vLLM for the demo, the OpenAI example, the benchmark scripts and the tests: the
kv-transfer-config that puts vLLM in front of the tier (the README's, in code), one set of CPU
engine defaults, and one engine process (a JSON job in, one result line out).

    python -m hma_redis.tools.devkit.engine < job.json      # prints RESULT_PREFIX + JSON

A job (:func:`run_job`) names a model, prompts of token ids and how many tokens to generate for
each; the process builds one ``vllm.LLM``, runs the prompts one at a time (greedy), empties the
engine's own prefix cache between them (so a prefix can come only from the tier), shuts the
engine down and prints what each prompt got. Every process is a new vLLM instance: the tier is
the only thing two runs share.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RESULT_PREFIX = "@@HMA_ENGINE_RESULT@@ "
STDERR_TAIL_CHARS = 3000

# vLLM on a CPU host, as every engine here runs (VLLM_CPU_KVCACHE_SPACE is read by the CPU build
# only: 1 GiB of KV cache, without it vLLM takes most of the RAM; no hub access).
CPU_ENGINE_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_COLOR": "0",
}
# ``vllm.LLM`` in a script: the engine core in the same process (~15 s to start, not ~40 s).
IN_PROCESS_ENGINE_ENV: dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# ``vllm.LLM`` arguments of every job (its ``llm_kwargs`` override them). Prompts are token ids,
# so no tokenizer; stats on, for each request's first-token latency.
LLM_DEFAULTS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "seed": 0,
    "enable_prefix_caching": True,
    "disable_log_stats": False,
}


def kv_transfer_config(redis_url: str | None, **extra: Any) -> dict[str, Any]:
    """``KVTransferConfig`` fields for hma_redis at ``redis_url``; ``extra`` goes to the tier's
    ``kv_connector_extra_config`` (e.g. ``read_timeout_s=1.0``). With ``redis_url`` None the
    config names no URL: the engine takes it from ``HMA_REDIS_URL`` in its environment (the
    way for a URL with a password to stay off command lines and out of vLLM's log)."""
    url = {} if redis_url is None else {"redis_url": redis_url}
    return {
        "kv_connector": "RedisOffloadingConnector",
        "kv_connector_module_path": "hma_redis.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "RedisOffloadingSpec",
            "spec_module_path": "hma_redis.spec",
            **url,
            **extra,
        },
    }


# ---------------------------------------------------------------------------------- in the engine


def run_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """Build one engine, run the job's prompts one at a time (greedy), shut the engine down.

    Job fields: ``model``; ``prompts`` (lists of token ids); ``max_tokens`` (one for every
    prompt, or a list with one per prompt); ``kv_transfer_config`` (``KVTransferConfig``
    fields, or None for no connector); ``max_model_len`` (2048); ``dtype`` ("auto");
    ``block_size`` (vLLM's default); ``reset_prefix_cache_between`` (True: the engine's own
    prefix cache is emptied before every prompt but the first); ``llm_kwargs`` (more
    ``vllm.LLM`` arguments); ``kv_transfer_params`` (None, or one dict or None per prompt: the
    request's ``kv_transfer_params``, e.g. ``{"hma_redis_pin_s": 600}``). Returns the result
    :func:`main` prints: per prompt its token ids, cached tokens, time to first token and wall
    time; start-up and shutdown seconds; the KV cache groups as the scheduler sees them.

    ``vllm.inputs.TokensPrompt`` is looked up when the job runs, so a caller may wrap it.
    """
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    cfg = job.get("kv_transfer_config")
    kwargs: dict[str, Any] = {
        **LLM_DEFAULTS,
        "model": job["model"],
        "max_model_len": job.get("max_model_len", 2048),
        "dtype": job.get("dtype", "auto"),
        "kv_transfer_config": KVTransferConfig(**cfg) if cfg else None,
    }
    if job.get("block_size") is not None:
        kwargs["block_size"] = job["block_size"]
    kwargs.update(job.get("llm_kwargs") or {})

    t0 = time.monotonic()
    llm = LLM(**kwargs)
    startup_s = time.monotonic() - t0

    prompts = job["prompts"]
    max_tokens = job["max_tokens"]
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    reset = bool(job.get("reset_prefix_cache_between", True))
    transfer_params = job.get("kv_transfer_params") or [None] * len(prompts)
    results: list[dict[str, Any]] = []
    for i, (prompt, budget, transfer) in enumerate(
        zip(prompts, budgets, transfer_params, strict=True)
    ):
        if reset and i > 0:
            llm.reset_prefix_cache()
        extra = {"kv_transfer_params": transfer} if transfer is not None else None
        params = SamplingParams(
            temperature=0.0, max_tokens=budget, ignore_eos=True, extra_args=extra
        )
        t1 = time.monotonic()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
        wall_s = time.monotonic() - t1
        metrics = out.metrics
        latency = getattr(metrics, "first_token_latency", 0.0) if metrics else 0.0
        results.append(
            {
                "token_ids": list(out.outputs[0].token_ids),
                "num_cached_tokens": int(out.num_cached_tokens or 0),
                "ttft_s": float(latency) if latency and latency > 0 else wall_s,
                "wall_s": wall_s,
                "finish_reason": out.outputs[0].finish_reason,
            }
        )

    payload: dict[str, Any] = {
        "results": results,
        "startup_s": startup_s,
        "block_size": int(llm.llm_engine.vllm_config.cache_config.block_size),
        "kv_cache": _kv_cache_info(llm),
    }
    t2 = time.monotonic()
    # Explicit, idempotent engine shutdown (scheduler + workers, KV connector included), so
    # connector teardown runs before interpreter exit rather than from a weakref finalizer.
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    payload["shutdown_s"] = time.monotonic() - t2
    return payload


def _kv_cache_info(llm: Any) -> dict[str, Any]:
    """KV cache groups as the scheduler sees them (reachable with the in-process engine only)."""
    info: dict[str, Any] = {"num_groups": None, "groups": [], "num_blocks": None}
    try:
        core = llm.llm_engine.engine_core.engine_core
        kv_cache_config = core.scheduler.kv_cache_config
    except AttributeError as exc:
        info["error"] = f"kv cache config not reachable: {exc}"
        return info
    info["num_blocks"] = int(kv_cache_config.num_blocks)
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        info["groups"].append(
            {
                "spec": type(spec).__name__,
                "block_size": int(spec.block_size),
                "page_size_bytes": int(spec.page_size_bytes),
                "sliding_window": getattr(spec, "sliding_window", None),
                "layers": list(group.layer_names),
            }
        )
    info["num_groups"] = len(info["groups"])
    return info


def emit_result(payload: Mapping[str, Any]) -> None:
    """Print the one result line a parent looks for."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main() -> int:
    """One job as JSON on stdin; its result line on stdout."""
    emit_result(run_job(json.loads(sys.stdin.read())))
    return 0


# ---------------------------------------------------------------------------------- the parent


class EngineProcessError(RuntimeError):
    """An engine process failed, timed out or printed no result; ``stderr`` is its stderr."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


@dataclass(frozen=True)
class ProcessOutput:
    """What an engine process left: its exit code (None: killed at its time-out) and output."""

    returncode: int | None
    stdout: str
    stderr: str


def engine_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process: :data:`CPU_ENGINE_ENV` and
    :data:`IN_PROCESS_ENGINE_ENV` where this process's environment does not say otherwise,
    then ``overrides``."""
    return {**CPU_ENGINE_ENV, **IN_PROCESS_ENGINE_ENV, **os.environ, **(overrides or {})}


def run_engine_process(
    job: Mapping[str, Any],
    env: Mapping[str, str],
    timeout_s: float | None = None,
    cwd: str | None = None,
) -> ProcessOutput:
    """Run ``job`` in a new interpreter (``python -m hma_redis.tools.devkit.engine``)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", __name__],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            env=dict(env),
            cwd=cwd,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        return ProcessOutput(None, "", err or "")
    return ProcessOutput(proc.returncode, proc.stdout, proc.stderr)


def parse_result(out: ProcessOutput, timeout_s: float | None = None) -> dict[str, Any]:
    """The result an engine process printed; :class:`EngineProcessError` (with its stderr
    tail) when it timed out, failed or printed anything but one result line."""
    if out.returncode is None:
        raise EngineProcessError(
            f"vLLM child timed out after {timeout_s or 0:.0f}s; stderr tail:\n{_tail(out.stderr)}",
            out.stderr,
        )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if out.returncode != 0 or len(lines) != 1:
        raise EngineProcessError(
            f"vLLM child failed (exit code {out.returncode}, {len(lines)} result lines); "
            f"stdout tail:\n{_tail(out.stdout, 1000)}\nstderr tail:\n{_tail(out.stderr)}",
            out.stderr,
        )
    result: dict[str, Any] = json.loads(lines[0][len(RESULT_PREFIX) :])
    return result


def run_engine(job: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """For scripts: run ``job`` in a new engine process (:func:`engine_env`); its result and its
    whole output (stdout and stderr). A failed engine ends the program with its stderr tail."""
    out = run_engine_process(job, engine_env())
    try:
        return parse_result(out), out.stdout + out.stderr
    except EngineProcessError as exc:
        sys.stderr.write(_tail(exc.stderr, 4000))
        raise SystemExit(f"engine process failed (exit code {out.returncode})") from None


def _tail(text: str, n: int = STDERR_TAIL_CHARS) -> str:
    return text[-n:]


if __name__ == "__main__":
    sys.exit(main())
