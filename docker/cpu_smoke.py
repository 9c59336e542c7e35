"""Smoke run of docker/compose.cpu.yaml: Redis and two vLLM servers in containers on the CPU.

    .venv/bin/python docker/cpu_smoke.py [--keep]

Builds a tiny random-weight hybrid model (Gemma3-style: sliding-window and full-attention
layers, two KV cache groups) on the host, starts the compose project with it (podman-compose, or
``docker compose`` where Docker runs), sends one long prompt to server A and then to server B,
and checks that B loaded from Redis what A stored (vLLM's own counters on B's /metrics) and that
both continued the prompt with the same tokens. The images must exist (docker/README.md,
"On the CPU"); a run takes a few minutes, so it is not part of the test suite. Exit status 0
when B loaded A's KV and the outputs match.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import redis

from hma_redis.tools.demo.openai_example import random_prompt, scrape_metrics
from hma_redis.tools.devkit.local_redis import free_port
from hma_redis.tools.devkit.tiny_models import build_gemma3

COMPOSE_FILE = Path(__file__).resolve().parent / "compose.cpu.yaml"
PROJECT = "hma-redis-cpu-smoke"
HITS = "vllm:external_prefix_cache_hits_total"
STORED = "vllm:kv_offload_store_bytes_total"


def compose_tool() -> list[str]:
    return ["podman-compose"] if shutil.which("podman-compose") else ["docker", "compose"]


def compose(env: dict[str, str], *args: str) -> None:
    """Run the compose tool on compose.cpu.yaml; its output is shown only when it fails."""
    cmd = [*compose_tool(), "-p", PROJECT, "-f", str(COMPOSE_FILE), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")


def wait_ready(url: str, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except OSError:
            time.sleep(1.0)
    raise SystemExit(f"{url} not ready after {timeout_s:.0f}s (see the compose project's logs)")


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy completion of token ids; returns the generated token ids and the seconds taken."""
    body = {
        "model": "/model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as resp:
        reply = json.load(resp)
    return list(reply["choices"][0]["token_ids"]), time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="leave the containers running")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    # SIGTERM (timeout, Ctrl-C's cousin) still takes the compose project down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    workdir = Path(tempfile.mkdtemp(prefix="hma-cpu-smoke-"))
    ports = {"REDIS_HOST_PORT": free_port(), "PORT_A": free_port(), "PORT_B": free_port()}
    env = {**os.environ, "MODEL_DIR": build_gemma3(workdir / "tiny-gemma3")}
    env.update({name: str(port) for name, port in ports.items()})
    url_a, url_b = (f"http://127.0.0.1:{ports[p]}" for p in ("PORT_A", "PORT_B"))
    try:
        compose(env, "up", "-d")
        for name, url in (("A", url_a), ("B", url_b)):
            print(f"server {name}: ready after {wait_ready(url, args.start_timeout):.0f}s")
        prompt = random_prompt(args.prompt_tokens, seed=7)
        out_a, secs_a = complete(url_a, prompt, 8)
        time.sleep(2.0)  # A's stores are asynchronous: let them land
        keys = redis.Redis(port=ports["REDIS_HOST_PORT"]).dbsize()
        out_b, secs_b = complete(url_b, prompt, 8)
        stored = scrape_metrics(url_a).get(STORED, 0.0)
        hits = scrape_metrics(url_b).get(HITS, 0.0)
        print(f"A: {secs_a:.2f}s, stored {stored:.0f} bytes ({keys} Redis keys)")
        print(f"B: {secs_b:.2f}s, {hits:.0f} of {len(prompt)} prompt tokens loaded from Redis")
        print(f"same output: {out_a == out_b} ({out_a} / {out_b})")
        return 0 if hits > 0 and out_a == out_b else 1
    finally:
        if not args.keep:
            compose(env, "down")
            if compose_tool() == ["podman-compose"]:  # podman-compose 1.0 leaves the network
                subprocess.run(
                    ["podman", "network", "rm", "-f", f"{PROJECT}_default"],
                    capture_output=True,
                    check=False,
                )
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
