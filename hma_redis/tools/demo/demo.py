"""The main job: two vLLM engines, one after the other in separate processes, share a Redis.

    python -m hma_redis.tools.demo.demo [--redis-url URL] [--model NAME_OR_PATH] [--prompt-tokens N]

Engine A serves a few long prompts and stores their KV chunks in Redis; engine B, a fresh
process, serves the same prompts and loads those chunks. For each engine the demo prints the
tokens served from Redis and the time to first token, and checks B's output equals A's.
Without ``--redis-url`` a private ``redis-server`` is started and stopped; without ``--model`` a
tiny random-weight hybrid model (sliding-window + full attention layers) is built on the fly.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from dataclasses import dataclass

from hma_redis.core.config import redact_url
from hma_redis.tools.demo.engine import kv_transfer_config, run_engine
from hma_redis.tools.demo.local_redis import redis_or_local


@dataclass(frozen=True)
class PromptRun:
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    token_ids: list[int]


def _run_engine(job: dict[str, object]) -> list[PromptRun]:
    """One fresh engine process for ``job``; what each prompt got."""
    result, _ = run_engine(job)
    prompts = job["prompts"]
    assert isinstance(prompts, list)
    return [
        PromptRun(len(prompt), r["num_cached_tokens"], r["ttft_s"], r["token_ids"])
        for prompt, r in zip(prompts, result["results"], strict=True)
    ]


def _model(name: str | None, workdir: str) -> str:
    if name is not None:
        return name
    from hma_redis.tools.demo.tiny_models import build_gemma3

    print("building a tiny random-weight Gemma-3-style model (sliding window + full attention)")
    return build_gemma3(os.path.join(workdir, "tiny-gemma3"), sliding_window=32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hma_redis.tools.demo.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--redis-url", help="Redis to share (default: start a private redis-server)"
    )
    parser.add_argument("--model", help="model name or path (default: a tiny model built here)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)

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
