"""Child process for ``engine_runner``: one vLLM instance, one JSON job, one JSON result line.

Two ways to run it:

* ``python tests/_engine_child.py`` reads one job as JSON from stdin, builds ``vllm.LLM``, runs
  the prompts one at a time (greedy), prints ``RESULT_PREFIX + json`` on stdout and exits after a
  clean engine shutdown. vLLM's log goes to stderr (``VLLM_LOGGING_STREAM``).
* ``python tests/_engine_child.py --serve`` is a fork server: it imports torch and vLLM once
  (most of an engine's start-up time on a small CPU), then for each job line on stdin forks a
  fresh child that runs the job exactly as above with its stdout/stderr sent to the files the
  job names. The server never builds an engine itself, so each forked child is a new vLLM
  instance; it only skips the interpreter start and the imports.

Not a test module (pytest does not collect it).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

RESULT_PREFIX = "@@HMA_ENGINE_RESULT@@ "
READY_LINE = "@@HMA_FORKSERVER_READY@@"

# What the fork server imports before forking: the slow part of an engine's start-up. Only
# libraries, nothing that builds state for an engine (no hma_redis: children import it fresh).
_PRELOAD = (
    "torch",
    "transformers",
    "vllm",
    "vllm.config",
    "vllm.inputs",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.gemma3",
)


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


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Build one engine, run the job's prompts one at a time, shut the engine down."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    cfg = job.get("kv_transfer_config")
    kwargs: dict[str, Any] = {
        "model": job["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": job.get("max_model_len", 2048),
        "seed": 0,
        "dtype": job.get("dtype", "float32"),
        "enable_prefix_caching": True,
        "disable_log_stats": False,  # RequestOutput.metrics (first-token latency) needs stats
        "kv_transfer_config": KVTransferConfig(**cfg) if cfg else None,
    }
    if job.get("block_size") is not None:
        kwargs["block_size"] = job["block_size"]
    kwargs.update(job.get("llm_kwargs") or {})

    t0 = time.monotonic()
    llm = LLM(**kwargs)
    startup_s = time.monotonic() - t0

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    reset = bool(job.get("reset_prefix_cache_between", True))
    results: list[dict[str, Any]] = []
    for i, prompt in enumerate(job["prompts"]):
        if reset and i > 0:
            llm.reset_prefix_cache()
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


def _emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main() -> int:
    _emit(run_job(json.loads(sys.stdin.read())))
    return 0


def _forked_child(request: dict[str, Any]) -> None:
    """In the forked child: redirect stdio, take the job's environment, run it, exit."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, path in ((1, request["stdout_path"]), (2, request["stderr_path"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request.get("cwd") or os.getcwd())
        _emit(run_job(request["job"]))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        # What a normal interpreter exit does, in order: wait for non-daemon threads, run atexit
        # handlers, flush. (A forked child must not return into the server's loop.)
        try:
            for t in threading.enumerate():
                if t is not threading.current_thread() and not t.daemon:
                    t.join()
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
            code = code or 1
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def serve() -> int:
    """Fork server loop: one JSON request per stdin line, two reply lines per request."""
    t0 = time.monotonic()
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a child imports it again and reports the real error
            sys.stderr.write(f"fork server: preloading {name} failed: {exc!r}\n")

    sys.stderr.write(f"fork server imports took {time.monotonic() - t0:.1f}s\n")
    sys.stderr.flush()
    reply = sys.stdout
    reply.write(READY_LINE + "\n")
    reply.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _forked_child(request)  # never returns
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        sys.exit(serve())
    sys.exit(main())
