"""The main job: two vLLM engines, one after the other in separate processes, share a Redis.

    python -m hma_redis.demo [--redis-url URL] [--model NAME_OR_PATH] [--prompt-tokens N]

Engine A serves a few long prompts and stores their KV chunks in Redis; engine B, a fresh
process, serves the same prompts and loads those chunks. For each engine the demo prints the
tokens served from Redis and the time to first token, and checks B's output equals A's.
Without ``--redis-url`` a private ``redis-server`` is started and stopped; without ``--model`` a
tiny random-weight hybrid model (sliding-window + full attention layers) is built on the fly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from hma_redis.core.config import redact_url
from hma_redis.local_redis import redis_or_local
from hma_redis.vllm_config import kv_transfer_config

_RESULT = "@@HMA_DEMO@@ "


@dataclass(frozen=True)
class PromptRun:
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    token_ids: list[int]


def _child(job: dict[str, Any]) -> None:
    """Run inside a fresh process: one engine, the prompts one at a time, greedy."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=job["max_model_len"],
        seed=0,
        enable_prefix_caching=True,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(**job["kv_transfer_config"]),
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    runs = []
    for prompt in job["prompts"]:
        llm.reset_prefix_cache()  # hits must come from Redis, not this engine's own cache
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - started
        metrics = out.metrics
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        runs.append(
            PromptRun(len(prompt), out.num_cached_tokens or 0, ttft or elapsed,
                      list(out.outputs[0].token_ids)).__dict__
        )  # fmt: skip
    print(_RESULT + json.dumps(runs), flush=True)
    del llm


def _run_engine(job: dict[str, Any]) -> list[PromptRun]:
    result, _ = run_engine_process(["-m", "hma_redis.demo", "--child", json.dumps(job)], _RESULT)
    return [PromptRun(**r) for r in result]


def run_engine_process(args: list[str], marker: str) -> tuple[Any, str]:
    """Run ``python ARGS`` as one vLLM engine process (CPU settings unless the environment sets
    them) and return the JSON it printed after ``marker``, and its whole output. A failed engine
    ends the program with its stderr tail."""
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
    }
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"engine process failed (exit code {proc.returncode})")
    return json.loads(lines[-1][len(marker) :]), proc.stdout + proc.stderr


def _model(name: str | None, workdir: str) -> str:
    if name is not None:
        return name
    from hma_redis.tiny_models import build_gemma3

    print("building a tiny random-weight Gemma-3-style model (sliding window + full attention)")
    return build_gemma3(os.path.join(workdir, "tiny-gemma3"), sliding_window=32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hma_redis.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--redis-url", help="Redis to share (default: start a private redis-server)"
    )
    parser.add_argument("--model", help="model name or path (default: a tiny model built here)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0

    rng = random.Random(0)
    prompts = [
        [rng.randrange(4, 500) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)
    ]
    with (
        tempfile.TemporaryDirectory(prefix="hma-demo-") as workdir,
        redis_or_local(args.redis_url) as url,
    ):
        model = _model(args.model, workdir)
        job = {
            "model": model,
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "max_model_len": max(2048, args.prompt_tokens + args.max_tokens + 16),
            "kv_transfer_config": kv_transfer_config(url),
        }
        print(f"Redis: {redact_url(url)}; {len(prompts)} prompts of {args.prompt_tokens} tokens")
        results = {}
        for name in ("A", "B"):
            print(f"engine {name}: starting a fresh vLLM process ...", flush=True)
            results[name] = _run_engine(job)
    _report(results)
    same = all(a.token_ids == b.token_ids for a, b in zip(results["A"], results["B"], strict=True))
    print(f"engine B's tokens identical to engine A's: {'yes' if same else 'NO'}")
    return 0 if same else 1


def _report(results: dict[str, list[PromptRun]]) -> None:
    print()
    print("engine  prompt  prompt tokens  tokens from Redis  time to first token")
    for name, runs in results.items():
        for idx, run in enumerate(runs):
            print(
                f"{name:>6}  {idx:>6}  {run.num_prompt_tokens:>13}  {run.num_cached_tokens:>17}"
                f"  {run.ttft_s * 1000:>16.1f} ms"
            )
    print()


if __name__ == "__main__":
    sys.exit(main())
