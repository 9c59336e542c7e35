"""The main job: two vLLM engines, one after the other in separate processes, share a Redis.

    python -m hma_redis.tools.demo.demo [--redis-url URL] [--model NAME_OR_PATH] [--hybrid]
                                        [--quick] [--prompt-tokens N] [--max-tokens N] [--seed N]

Engine A serves a long prompt it has never seen: it computes the prompt (cold prefill) and
stores its KV chunks in Redis. Engine B, a fresh process with an empty cache of its own, serves
the same prompt and loads those chunks instead of computing them. The demo prints, per engine,
the prompt tokens that came from Redis and the time to first token, and checks that B's greedy
output equals A's. Each engine first serves a short warm-up prompt, so neither engine's first
request pays one-time costs that the other's does not.

Without ``--redis-url`` a private ``redis-server`` is started and stopped. Without ``--model`` a
random-weight model is built on the fly: Llama-shaped and big enough that the cold prefill takes
seconds on a CPU (``--hybrid``: Gemma-3-style, sliding-window and full-attention layers, two KV
cache groups; ``--quick``: a small shape that runs in seconds, for tests).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from redis.exceptions import RedisError

from hma_redis.core.config import RedisTierConfig, redact_url
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.engine import (
    EngineProcessError,
    ProcessOutput,
    engine_env,
    kv_transfer_config,
    parse_result,
)
from hma_redis.tools.devkit.local_redis import redis_or_local
from hma_redis.tools.devkit.tiny_models import (
    DEMO_SHAPE,
    QUICK_SHAPE,
    VOCAB_SIZE,
    ModelShape,
    build_gemma3,
    build_llama,
)

WARMUP_TOKENS = 64
# The full prompt comes from Redis only up to the last whole chunk before its last token (vLLM
# always computes at least one token): 4096 + 1 tokens let all 4096 tokens of 32 chunks of 128
# come from Redis.
DEFAULT_PROMPT_TOKENS = 4097
QUICK_PROMPT_TOKENS = 1025
HYBRID_SLIDING_WINDOW = 512
HEARTBEAT_S = 15.0

# vLLM log lines that mark an engine's start-up phases, and what the demo says when one appears.
# (A vLLM release that words them differently only makes the demo quieter.)
_MILESTONES: tuple[tuple[str, str], ...] = (
    ("Starting to load model", "loading the model weights"),
    ("Loading out-of-tree offloading spec", "connecting the Redis tier"),
    ("init engine (profile, create kv cache, warmup model)", "ready; serving the prompts"),
)


@dataclass(frozen=True)
class PromptRun:
    """What one prompt got on one engine."""

    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    token_ids: list[int]


@dataclass(frozen=True)
class DemoModel:
    """The model both engines run and how to describe it."""

    path: str
    description: str
    kv_bytes_per_token: int | None


def main(argv: list[str] | None = None) -> int:
    """Run engine A, then engine B, print the comparison; 0 when B loaded the prompt from
    Redis and generated exactly A's tokens, 1 otherwise. A Redis the tier cannot use (down,
    wrong credentials, bad TLS files) ends the demo with 1 and the tier's own error before
    any engine starts."""
    args = _parser().parse_args(argv)
    prompt_tokens = args.prompt_tokens or (
        QUICK_PROMPT_TOKENS if args.quick else DEFAULT_PROMPT_TOKENS
    )
    # A new prompt every run unless --seed, so engine A computes it even when a shared Redis
    # (--redis-url) still holds an earlier run's chunks.
    rng = random.Random(args.seed)
    warmup = _random_prompt(rng, WARMUP_TOKENS)
    prompt = _random_prompt(rng, prompt_tokens)
    with (
        tempfile.TemporaryDirectory(prefix="hma-demo-") as workdir,
        redis_or_local(args.redis_url) as url,
    ):
        problem = redis_problem(url)
        if problem is not None:
            print(f"nothing reached Redis: {problem}")
            return 1
        model = _model(args, workdir)
        print(f"model: {model.description}")
        kv = _kv_size(model, prompt_tokens)
        print(f"Redis: {redact_url(url)}; one prompt of {prompt_tokens} random tokens{kv}")
        job = {
            "model": model.path,
            "prompts": [warmup, prompt],
            "max_tokens": args.max_tokens,
            "max_model_len": prompt_tokens + args.max_tokens + 16,
            "kv_transfer_config": kv_transfer_config(url),
        }
        runs = {name: _run_engine(name, job)[1] for name in ("A", "B")}
        problem = redis_problem(url) if runs["B"].num_cached_tokens == 0 else None
    return report(runs["A"], runs["B"], problem)


def redis_problem(url: str) -> str | None:
    """Why the tier cannot use the Redis at ``url``, in the tier's own words (its config
    validation or its connection error, the URL redacted); None when that Redis answers PING.
    The config comes from ``url`` and this process's environment, as the engines' does."""
    try:
        cfg = RedisTierConfig.from_extra_config({"redis_url": url}, env=os.environ)
    except ValueError as exc:
        return str(exc).removeprefix("hma_redis: ")
    try:
        store = RedisBlockStore(cfg)
    except (RedisError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        store.ping()
    except (RedisError, OSError) as exc:
        return str(exc).removeprefix("hma_redis: ")
    finally:
        store.close()
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hma_redis.tools.demo.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--redis-url", help="Redis to share (default: start a private redis-server)"
    )
    parser.add_argument(
        "--model", help="model name or path (default: a random-weight model built here)"
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="build a Gemma-3-style model (sliding-window + full attention, two KV cache groups)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small model and prompt (seconds, for tests)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        help=f"prompt length (default {DEFAULT_PROMPT_TOKENS}; --quick {QUICK_PROMPT_TOKENS})",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument(
        "--seed", type=int, help="seed of the random prompt (default: a new prompt every run)"
    )
    return parser


def _random_prompt(rng: random.Random, n: int) -> list[int]:
    # Token ids 0..3 are the random models' special tokens.
    return [rng.randrange(4, VOCAB_SIZE) for _ in range(n)]


def _model(args: argparse.Namespace, workdir: str) -> DemoModel:
    """The model the user named, or a random-weight one built in ``workdir``."""
    if args.model is not None:
        return DemoModel(args.model, args.model, None)
    shape: ModelShape = QUICK_SHAPE if args.quick else DEMO_SHAPE
    kind = "Gemma-3-style hybrid" if args.hybrid else "Llama-shaped"
    print(f"building a random-weight {kind} model ({shape.describe()}) ...", flush=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line for the build, not a progress bar per shard
    t0 = time.monotonic()
    path = os.path.join(workdir, f"{shape.name}-{'gemma3' if args.hybrid else 'llama'}")
    if args.hybrid:
        build_gemma3(path, sliding_window=HYBRID_SLIDING_WINDOW, **shape.overrides())
        kind += f" (sliding window {HYBRID_SLIDING_WINDOW} alternating with full attention)"
    else:
        build_llama(path, **shape.overrides())
    print(f"built in {time.monotonic() - t0:.1f} s", flush=True)
    return DemoModel(
        path, f"{kind}, {shape.describe()}, random weights", shape.kv_bytes_per_token()
    )


def _kv_size(model: DemoModel, prompt_tokens: int) -> str:
    if model.kv_bytes_per_token is None:
        return ""
    return f" (KV cache {model.kv_bytes_per_token * prompt_tokens / 2**20:.0f} MiB)"


# ------------------------------------------------------------------------------ one engine process


def _run_engine(name: str, job: Mapping[str, Any]) -> tuple[PromptRun, PromptRun]:
    """Run ``job`` in a fresh engine process, printing its start-up phases as they happen;
    the warm-up prompt's and the long prompt's results. A failed engine ends the program with
    its stderr tail."""
    print(
        f"engine {name}: starting a fresh vLLM process (importing torch and vLLM) ...", flush=True
    )
    t0 = time.monotonic()
    # vLLM logs to stdout by default: keep stdout for the result line, read the log on stderr.
    env = engine_env({"VLLM_LOGGING_STREAM": "ext://sys.stderr"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "hma_redis.tools.devkit.engine"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    out = _follow(name, proc, job, t0)
    try:
        result = parse_result(out)
    except EngineProcessError as exc:
        sys.stderr.write(exc.stderr[-4000:])
        raise SystemExit(f"engine {name} failed (exit code {out.returncode})") from None
    print(f"engine {name}: done ({time.monotonic() - t0:.1f} s)", flush=True)
    warmup, prompt = (
        PromptRun(len(p), r["num_cached_tokens"], r["ttft_s"], r["token_ids"])
        for p, r in zip(job["prompts"], result["results"], strict=True)
    )
    return warmup, prompt


def _follow(
    name: str, proc: subprocess.Popen[str], job: Mapping[str, Any], t0: float
) -> ProcessOutput:
    """Send ``job`` to the engine process, print a line per start-up phase (and a heartbeat
    when it is quiet) until it exits; everything it printed."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()
    stdout: list[str] = []
    stderr: list[str] = []
    lines: queue.Queue[str | None] = queue.Queue()
    readers = [
        threading.Thread(target=_collect, args=(proc.stdout, stdout, None), daemon=True),
        threading.Thread(target=_collect, args=(proc.stderr, stderr, lines), daemon=True),
    ]
    for reader in readers:
        reader.start()
    pending = list(_MILESTONES)
    phase = "starting"
    last = time.monotonic()
    for line in _lines_until_closed(lines):
        if line is None:
            if time.monotonic() - last >= HEARTBEAT_S:
                print(f"engine {name}: still {phase} ({time.monotonic() - t0:.0f} s)", flush=True)
                last = time.monotonic()
            continue
        for marker, says in pending:
            if marker in line:
                print(f"engine {name}: {says} ({time.monotonic() - t0:.1f} s)", flush=True)
                pending.remove((marker, says))
                phase = says.split(";")[-1].strip()
                last = time.monotonic()
                break
    for reader in readers:
        reader.join()
    return ProcessOutput(proc.wait(), "".join(stdout), "".join(stderr))


def _collect(stream: IO[str], into: list[str], lines: queue.Queue[str | None] | None) -> None:
    """Read ``stream`` to its end into ``into``, each line also to ``lines``; then None there."""
    for line in stream:
        into.append(line)
        if lines is not None:
            lines.put(line)
    if lines is not None:
        lines.put(None)


def _lines_until_closed(lines: queue.Queue[str | None]) -> Iterator[str | None]:
    """The lines of ``lines`` until its closing None; None each second nothing arrives."""
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            yield None
            continue
        if line is None:
            return
        yield line


# ---------------------------------------------------------------------------------- the verdict


def report(a: PromptRun, b: PromptRun, redis_error: str | None = None) -> int:
    """Print both engines' results and the one-line verdict; the exit code. ``redis_error``
    is why the tier could not use Redis (checked after the runs when B loaded nothing): then
    nothing is claimed stored, and the verdict is that error."""
    same = a.token_ids == b.token_ids
    stored = "nothing reached Redis" if redis_error else "stored to Redis"
    print()
    print(
        f"engine A: {a.num_cached_tokens} of {a.num_prompt_tokens} prompt tokens from Redis "
        f"(cold prefill, {stored}), time to first token {a.ttft_s:.2f} s"
    )
    speedup = a.ttft_s / b.ttft_s if b.ttft_s > 0 else float("inf")
    times = f"{speedup:.0f}" if speedup >= 10 else f"{speedup:.1f}"
    print(
        f"engine B: {b.num_cached_tokens} of {b.num_prompt_tokens} prompt tokens from Redis, "
        f"time to first token {b.ttft_s:.2f} s vs {a.ttft_s:.2f} s cold "
        f"({times}× faster), tokens {'identical' if same else 'DIFFER'}"
    )
    if a.num_cached_tokens:
        print("engine A found part of the prompt in Redis already: its time is not a cold one")
    if not same:
        print("engine B's output differs from engine A's: that is a bug, please report it")
        return 1
    if redis_error is not None:
        print(f"nothing reached Redis: {redis_error}")
        return 1
    if b.num_cached_tokens == 0:
        print("engine B loaded nothing from Redis: is PYTHONHASHSEED or the Redis URL different?")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
