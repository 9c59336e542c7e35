"""End to end on the CPU: time to first token from Redis vs cold prefill, and decode throughput
with the tier on vs off at 0 % hits (issue 6, part f).

    .venv/bin/python benchmarks/e2e_bench.py [--prompt-tokens 4096] [--repeats 3]

A random-weight Llama-shaped model (hidden 1024, 8 layers, 16 query / 8 KV heads of 64, fp32) is
built in a temporary directory; a private ``redis-server`` is started. Three vLLM engines run one
after the other, each in its own process (VLLM_CPU_KVCACHE_SPACE=1, in-process engine core):

- ``off``: no tier. Three decode runs (new prompts, so 0 % hits), then the 4k-token prompt
  ``repeats`` times (prefix cache reset in between: cold prefill every time).
- ``A``: tier on, empty Redis. The same decode runs (tier on, 0 % hits: lookups and stores run,
  nothing is loaded), then the prompt once (its chunks are stored).
- ``B``: tier on, a new engine. The prompt ``repeats`` times with the prefix cache reset before
  each: every time its KV comes from Redis.

It prints TTFT (median), B's TTFT / cold prefill, decode tokens/s off vs on, and checks that B's
tokens equal the cold run's (greedy). A few minutes on 2 cores; nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Any

from hma_redis.tools.devkit import engine
from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import build_llama

DECODE_PROMPT_TOKENS = 64
DECODE_TOKENS = 96


def build_model(path: str) -> str:
    """The benchmark's model: tiny_models' Llama, scaled up (random weights, fp32)."""
    return build_llama(
        path,
        seed=0,
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def run_engine(run: dict[str, Any]) -> dict[str, Any]:
    """One engine process (:mod:`hma_redis.tools.devkit.engine`): the decode prompts, then the
    prompt ``repeats`` times (the engine's prefix cache is emptied before each)."""
    decode, repeats = run["decode_prompts"], run["repeats"]
    job = {
        "model": run["model"],
        "prompts": [*decode, *[run["prompt"]] * repeats],
        "max_tokens": [DECODE_TOKENS] * len(decode) + [4] * repeats,
        "max_model_len": run["max_model_len"],
        "dtype": "float32",
        "kv_transfer_config": run["kv_transfer_config"],
    }
    result, log = engine.run_engine(job)
    done = result["results"]
    return {
        "decode": [
            {"tok_s": (len(r["token_ids"]) - 1) / max(1e-9, r["wall_s"] - r["ttft_s"])}
            for r in done[: len(decode)]
        ],
        "prefill": [
            {"ttft_s": r["ttft_s"], "cached": r["num_cached_tokens"], "tokens": r["token_ids"]}
            for r in done[len(decode) :]
        ],
        "log_tail": [ln for ln in log.splitlines() if "hma_redis: worker rank" in ln][-1:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--decode-rounds",
        type=int,
        default=0,
        help="instead: N rounds of two decode-only engines, tier off then on (engine order bias)",
    )
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(4, 32000) for _ in range(args.prompt_tokens)]
    decode_prompts = [[rng.randrange(4, 32000) for _ in range(DECODE_PROMPT_TOKENS)] for _ in "abc"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hma-e2e-") as workdir:
        model = build_model(os.path.join(workdir, "llama-1024x8"))
        server = LocalRedis().start()
        try:
            base = {
                "model": model,
                "prompt": prompt,
                "decode_prompts": decode_prompts,
                "max_model_len": args.prompt_tokens + 512,
                "repeats": args.repeats,
            }
            tier = engine.kv_transfer_config(server.url)
            if args.decode_rounds:
                decode_ab(base, tier, args.decode_rounds)
                return
            runs = {
                "off": run_engine({**base, "kv_transfer_config": None}),
                "A": run_engine({**base, "kv_transfer_config": tier, "repeats": 1}),
                "B": run_engine({**base, "kv_transfer_config": tier, "decode_prompts": []}),
            }
        finally:
            server.stop()
    report(runs, args, time.perf_counter() - started)


def decode_ab(base: dict[str, Any], tier: dict[str, Any], rounds: int) -> None:
    """Decode tokens/s of fresh engines, tier off and on alternately (0 % hits: new prompts)."""
    speeds: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for name, cfg in (("off", None), ("on", tier)):
            run = run_engine({**base, "kv_transfer_config": cfg, "repeats": 0})
            speeds[name].append(statistics.median(d["tok_s"] for d in run["decode"]))
    off, on = statistics.median(speeds["off"]), statistics.median(speeds["on"])
    print(f"decode tok/s per engine, off {[round(v, 2) for v in speeds['off']]}, "
          f"on {[round(v, 2) for v in speeds['on']]}")  # fmt: skip
    print(f"medians: off {off:.2f}, on {on:.2f}, on/off {on / off:.3f}")


def report(runs: dict[str, dict[str, Any]], args: argparse.Namespace, seconds: float) -> None:
    def ttft(name: str) -> float:
        return statistics.median(p["ttft_s"] for p in runs[name]["prefill"])

    def tok_s(name: str) -> float:
        return statistics.median(d["tok_s"] for d in runs[name]["decode"])

    cold, warm = ttft("off"), ttft("B")
    same = all(p["tokens"] == runs["off"]["prefill"][0]["tokens"] for p in runs["B"]["prefill"])
    cached = [p["cached"] for p in runs["B"]["prefill"]]
    load = os.getloadavg()[0]
    print(f"end to end, {os.cpu_count()} CPUs, load average {load:.2f}, {seconds:.0f} s")
    print(f"prompt {args.prompt_tokens} tokens, TTFT medians of {args.repeats}")
    print(f"  cold prefill (tier off)          {cold * 1e3:10.1f} ms")
    print(f"  first engine, tier on (stores)   {ttft('A') * 1e3:10.1f} ms")
    print(f"  second engine, KV from Redis     {warm * 1e3:10.1f} ms   tokens from Redis {cached}")
    print(f"  ratio from Redis / cold          {warm / cold:10.3f}      (target <= 0.03)")
    print(f"  second engine's tokens == cold run's: {'yes' if same else 'NO'}")
    off, on = tok_s("off"), tok_s("A")
    print(f"decode, {DECODE_TOKENS} tokens after a {DECODE_PROMPT_TOKENS}-token prompt, 0 % hits")
    print(f"  tier off {off:.2f} tok/s, tier on {on:.2f} tok/s, on/off {on / off:.3f} (>= 0.97?)")
    for name, run in runs.items():
        for line in run["log_tail"]:
            print(f"  [{name}] {line[-160:]}")


if __name__ == "__main__":
    main()
