"""Where a load's time goes inside a running vLLM engine: one request's step-by-step timeline.

    .venv/bin/python benchmarks/in_engine_timeline.py                  # 4096 tokens, ~2 min
    .venv/bin/python benchmarks/in_engine_timeline.py --prompt-tokens 1024
    .venv/bin/python benchmarks/in_engine_timeline.py --repeats 2     # and two more prompts

An engine in its own process stores a prompt's KV in a private ``redis-server``; then a fresh
engine runs in this process (vLLM's engine core in-process) with timing wrappers around the
scheduler's steps, the manager's lookups, the worker's calls and the transfer job, and runs the
prompt twice: from Redis, then from its own prefix cache (and so on for each ``--repeats``
prompt, as the in-engine benchmark does). For each request it prints every event in order, in
ms since the request was handed to the engine, and the gap between the two requests' time to
first token (the in-engine benchmark's denominator).
Not a test: nothing is asserted but the tokens.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from e2e_bench import build_model  # type: ignore[import-not-found]
from in_engine_bench import parse_options  # type: ignore[import-not-found]

from hma_redis.tools.devkit import engine
from hma_redis.tools.devkit.local_redis import LocalRedis

VOCAB = 32000
EVENTS: list[tuple[float, str]] = []
_LOCK = threading.Lock()


def note(label: str, at: float | None = None) -> None:
    with _LOCK:
        EVENTS.append((time.perf_counter() if at is None else at, label))


def wrap(
    owner: Any, name: str, describe: Callable[[Any, tuple[Any, ...], Any, float], str | None]
) -> None:
    """Replace ``owner.name`` by a wrapper that notes ``describe(...)`` when the call returns."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        label = describe(args, kwargs, result, (time.perf_counter() - t0) * 1e3)
        if label is not None:
            note(label, t0)
        return result

    setattr(owner, name, wrapper)


def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from hma_redis.adapter.manager import RedisOffloadingManager
    from hma_redis.adapter.worker import RedisOffloadingWorker
    from hma_redis.core.redis import wire
    from hma_redis.core.transfer.engine import TransferEngine

    lookups: dict[str, int] = {}

    def lookup(args: Any, kwargs: Any, result: Any, ms: float) -> str | None:
        name = getattr(result, "name", str(result))
        lookups[name] = lookups.get(name, 0) + 1
        return None

    def schedule(args: Any, kwargs: Any, out: Any, ms: float) -> str | None:
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(lookups.items()))
        lookups.clear()
        tokens = out.total_num_scheduled_tokens
        waiting = len(args[0].waiting)
        if not tokens and not counts:
            return None
        return (
            f"schedule {ms:6.2f} ms: {tokens} tokens, {waiting} waiting; lookups: {counts or '-'}"
        )

    wrap(RedisOffloadingManager, "lookup", lookup)
    wrap(Scheduler, "schedule", schedule)
    wrap(
        RedisOffloadingManager,
        "on_schedule_end",
        lambda a, k, r, ms: f"manager.on_schedule_end {ms:6.2f} ms" if ms > 0.2 else None,
    )
    wrap(
        RedisOffloadingWorker,
        "submit_load",
        lambda a, k, r, ms: f"worker.submit_load {ms:6.2f} ms ({len(a[2].keys)} chunks)",
    )
    wrap(
        RedisOffloadingWorker,
        "get_finished",
        lambda a, k, r, ms: f"worker.get_finished -> {len(r)} job(s)" if r else None,
    )
    wrap(
        TransferEngine,
        "_run_load",
        lambda a, k, r, ms: f"transfer job (thread) {ms:6.2f} ms",
    )
    original = wire.native_load_values

    @functools.wraps(original)
    def native_load(*args: Any, **kwargs: Any) -> Any:
        # With its page faults and CPU: of this whole process (the engine idles meanwhile)
        # and of redis-server (its reply buffers).
        engine, server = (
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            SERVER[0].minor_faults(),
        )
        engine_cpu, server_cpu = _own_cpu_ms(), SERVER[0].cpu_ms()
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        ms = (time.perf_counter() - t0) * 1e3
        engine_cpu, server_cpu = _own_cpu_ms() - engine_cpu, SERVER[0].cpu_ms() - server_cpu
        engine = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - engine
        server = SERVER[0].minor_faults() - server
        note(
            f"  native load_values {ms:6.2f} ms ({len(result)} values; page faults: "
            f"{engine} here, {server} in redis-server; CPU: {engine_cpu:.1f} ms here, "
            f"{server_cpu:.1f} ms in redis-server)",
            t0,
        )
        return result

    wire.native_load_values = native_load  # type: ignore[assignment]
    wrap(
        UniProcExecutor,
        "execute_model",
        lambda a, k, r, ms: f"execute_model {ms:6.2f} ms" if ms > 0.5 else None,
    )


SERVER: list[LocalRedis] = []  # the private redis-server, once started


def _own_cpu_ms() -> float:
    """User + system CPU ms of this process so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * 1e3


def timeline(start: float, end: float) -> list[str]:
    with _LOCK:
        events = sorted(e for e in EVENTS if start <= e[0] <= end)
    return [f"  {(t - start) * 1e3:8.2f}  {label}" for t, label in events]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--tier-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=0, help="more prompts, each run twice")
    args = parser.parse_args()
    os.environ.update({**engine.CPU_ENGINE_ENV, **engine.IN_PROCESS_ENGINE_ENV})
    options = parse_options(args.tier_option)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(4, VOCAB) for _ in range(args.prompt_tokens)]
        for _ in range(1 + args.repeats)
    ]
    with tempfile.TemporaryDirectory(prefix="hma-timeline-") as workdir:
        model = build_model(os.path.join(workdir, "llama-1024x8"))
        server = LocalRedis().start()
        assert server.proc is not None
        SERVER.append(server)
        try:
            job = {
                "model": model,
                "prompts": prompts,
                "max_tokens": 4,
                "max_model_len": args.prompt_tokens + 512,
                "dtype": "float32",
                "kv_transfer_config": engine.kv_transfer_config(server.url, **options),
                "reset_prefix_cache_between": False,
            }
            print("storing the prompts' KV from an engine in its own process", file=sys.stderr)
            stored, _ = engine.run_engine(job)
            install()
            marks: list[float] = []
            from vllm import LLM

            generate = LLM.generate

            def marked(*a: Any, **kw: Any) -> Any:
                marks.append(time.perf_counter())
                return generate(*a, **kw)

            LLM.generate = marked  # type: ignore[method-assign]
            result = engine.run_job({**job, "prompts": [p for p in prompts for _ in "ab"]})
            marks.append(time.perf_counter())
        finally:
            server.stop()
    results = result["results"]
    for n, res in enumerate(results):
        if res["token_ids"] != stored["results"][n // 2]["token_ids"]:
            raise SystemExit(f"in_engine_timeline: request {n + 1} gave other tokens")
        label = "own prefix cache" if n % 2 else "from Redis"
        print(
            f"request {n + 1} (prompt {n // 2 + 1}, {label}): TTFT {res['ttft_s'] * 1e3:.1f} ms, "
            f"{res['num_cached_tokens']} cached tokens"
        )
        print("\n".join(timeline(marks[n], marks[n + 1])))
    for n in range(0, len(results), 2):
        gap = (results[n]["ttft_s"] - results[n + 1]["ttft_s"]) * 1e3
        print(f"prompt {n // 2 + 1}: TTFT gap (from Redis - own cache): {gap:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
