"""A real ``vllm serve`` with the tier: Prometheus metrics move, failures are counted, and a
SIGTERM stops the server within a bound with its chunks in Redis.

One server (start-up dominates: ~1-2 min on a 2-core CPU), a tiny random Llama without a
tokenizer (``--skip-tokenizer-init``; /v1/completions takes token-id prompts):

1. a prompt is computed: its chunks are stored, ``vllm:kv_offload_store_bytes`` equals the bytes
   now in Redis, the lookups were misses;
2. the server's own prefix cache is reset (``/reset_prefix_cache``) and the prompt is sent
   again: it is loaded from Redis (load bytes, chunk hits, external prefix-cache hits);
3. reset again, the prompt again, and its chunks are deleted while the worker waits to read
   them (the worker's test delay hook): the load fails, the request is recomputed and
   ``vllm:kv_offload_redis_load_failures`` counts it;
4. a new prompt, then SIGTERM right after its response (Redis writes paused for a second, so a
   store still in flight is held across the signal): the server exits within
   ``--shutdown-timeout`` plus teardown, and every chunk of the new prompt is in Redis.
   (vLLM's default ``--shutdown-timeout 0`` SIGKILLs the worker at once; with a timeout it
   drains, and the connector's shutdown flushes queued stores.)
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from vllm.v1.kv_offload.base import OffloadingCounterMetadata

from hma_redis.adapter.metrics import RedisMetricName, metric_definitions
from hma_redis.core.transfer.engine import TEST_LOAD_DELAY_ENV
from hma_redis.tools.demo.openai_example import VllmServer, fetch_metrics_text, random_prompt
from hma_redis.tools.devkit.tiny_models import MAX_POSITIONS, build_llama
from tests.support.dashboard import dashboard_queries

SHUTDOWN_TIMEOUT_S = 10  # vllm serve --shutdown-timeout: drain, then tear down
EXIT_BOUND_S = SHUTDOWN_TIMEOUT_S + 30  # plus process teardown on a busy 2-core machine
LOAD_DELAY_S = 1.5  # the worker sleeps this long before each load's GET
START_TIMEOUT_S = 600.0

R = RedisMetricName
STORE_BYTES = "vllm:kv_offload_store_bytes_total"
STORE_TIME = "vllm:kv_offload_store_time_total"
LOAD_BYTES = "vllm:kv_offload_load_bytes_total"
LOAD_TIME = "vllm:kv_offload_load_time_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


def total(name: str) -> str:
    return name + "_total"


def wait_for(
    server: VllmServer,
    ready: Callable[[dict[str, float]], bool],
    what: str,
    timeout_s: float = 30.0,
) -> dict[str, float]:
    """Scrape until ``ready(metrics)``; stats reach /metrics a step or two after the work."""
    deadline = time.monotonic() + timeout_s
    metrics = server.metrics()
    while not ready(metrics):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {timeout_s}s; metrics: {hma_view(metrics)}")
        time.sleep(0.2)
        metrics = server.metrics()
    return metrics


def hma_view(metrics: dict[str, float]) -> dict[str, float]:
    return {
        k: v
        for k, v in sorted(metrics.items())
        if k.startswith(("vllm:kv_offload_", "vllm:external_prefix_cache"))
    }


def chunk_keys(client: redis.Redis) -> list[bytes]:
    return sorted(k for k in client.scan_iter("hma:*:g*:*", count=1000))


def stored_bytes(client: redis.Redis) -> int:
    return sum(int(client.strlen(k)) for k in chunk_keys(client))


@pytest.mark.engine
def test_vllm_serve_metrics_failures_and_sigterm(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    model = build_llama(tmp_path / "llama")
    server = VllmServer(
        model,
        redis_url,
        extra_args=[
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--max-model-len", str(MAX_POSITIONS),
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        ],
        env={"VLLM_SERVER_DEV_MODE": "1", TEST_LOAD_DELAY_ENV: str(LOAD_DELAY_S)},
        log_path=tmp_path / "serve.log",
    )  # fmt: skip
    server.start()
    try:
        waited = server.wait_ready(START_TIMEOUT_S)
        print(f"vllm serve ready after {waited:.1f}s")
        run_scenario(server, redis_client)
    except BaseException:
        print(server.log_tail(8000))
        raise
    finally:
        server.stop()


def run_scenario(server: VllmServer, client: redis.Redis) -> None:
    # Every hma_redis metric is registered with vLLM's exporter from the spec class.
    text = fetch_metrics_text(server.url)
    for name, meta in metric_definitions().items():
        exposed = total(name) if isinstance(meta, OffloadingCounterMetadata) else name
        assert f"# HELP {exposed} " in text, f"{exposed} is not on /metrics"
    info = next(client.scan_iter("hma:*:info"))
    tokens_per_chunk = int(client.hget(info, "g0.tokens_per_chunk") or 0)
    assert tokens_per_chunk > 0

    # 1. Computed and stored.
    prompt = random_prompt(5 * tokens_per_chunk + 60, seed=1)
    num_chunks = len(prompt) // tokens_per_chunk
    server.complete(prompt, max_tokens=4)
    m1 = wait_for(
        server,
        lambda m: (
            len(chunk_keys(client)) == num_chunks and m.get(STORE_BYTES, 0) == stored_bytes(client)
        ),
        "the prompt's chunks stored and counted",
    )
    keys = chunk_keys(client)
    assert m1[STORE_TIME] > 0
    assert m1.get(LOAD_BYTES, 0) == 0
    assert m1[total(R.LOOKUPS)] >= 1
    assert m1[total(R.CHUNK_MISSES)] >= num_chunks
    assert m1.get(total(R.CHUNK_HITS), 0) == 0
    assert m1[total(R.CHUNK_QUERIES)] == m1[total(R.CHUNK_MISSES)]
    assert m1[R.AVAILABLE] == 1
    assert m1[total(R.STORED_CHUNKS)] == num_chunks  # worker-side counter, via the connector
    print("after the first request:", hma_view(m1))

    # 2. Loaded from Redis once the server's own prefix cache is gone.
    server.post("/reset_prefix_cache")
    server.complete(prompt, max_tokens=4)
    m2 = wait_for(server, lambda m: m.get(LOAD_BYTES, 0) > 0, "a load")
    assert m2[LOAD_BYTES] == m1[STORE_BYTES]  # the same chunks, header and all
    assert m2[LOAD_TIME] >= LOAD_DELAY_S  # the worker's test delay is inside the job
    assert m2[total(R.CHUNK_HITS)] >= num_chunks
    assert m2[EXTERNAL_HITS] == num_chunks * tokens_per_chunk
    assert m2.get(total(R.LOAD_FAILURES), 0) == 0
    assert m2[STORE_BYTES] == m1[STORE_BYTES]  # nothing stored twice
    assert m2[total(R.LOADED_CHUNKS)] == num_chunks
    print("after the second request:", hma_view(m2))
    # Looked up, stored and loaded: every metric the Grafana dashboard reads is on /metrics
    # (hma_redis' and vLLM's own; a series shows once it moved, the family at start-up), and
    # each operation's round trips were timed.
    text = fetch_metrics_text(server.url)
    for query in dashboard_queries():
        for name in query.metrics:
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            assert f"# HELP {name} " in text or f"# HELP {family} " in text, (query.panel, name)
    for operation in ("lookup", "load", "store"):
        assert f'operation="{operation}"' in text, operation

    # 3. The chunks vanish between lookup and load: recomputed, and counted.
    server.post("/reset_prefix_cache")
    done = threading.Event()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            server.complete(prompt, max_tokens=4)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    admitted_before = m2[EXTERNAL_HITS]
    sender = threading.Thread(target=send)
    sender.start()
    # Delete once the request is admitted with its Redis hit (at most a moment later): the
    # worker is then sleeping before its GET. (The manager answers this lookup from its cache
    # of recent answers, so no new Redis hit is counted.)
    seen = wait_until(
        lambda: server.metrics().get(EXTERNAL_HITS, 0) > admitted_before, LOAD_DELAY_S * 0.6
    )
    assert client.delete(*keys) == num_chunks
    print(f"chunks deleted {'after admission was seen' if seen else 'blindly'}")
    assert done.wait(120), "the request whose load failed never finished"
    sender.join()
    assert not errors, f"the request whose load failed was not recomputed: {errors[0]!r}"
    m3 = wait_for(
        server, lambda m: m.get(total(R.LOAD_FAILURES), 0) >= 1, "the load failure counted"
    )
    assert m3[total(R.LOAD_FAILURES)] == 1
    assert m3[R.AVAILABLE] == 1
    assert m3[total(R.LOAD_FAILED_CHUNKS)] == num_chunks
    print("after the failed load:", hma_view(m3))
    # The recompute stores the chunks again (the connector forgets them as offloaded).
    wait_for(server, lambda m: len(chunk_keys(client)) == num_chunks, "the chunks re-stored")

    # vLLM's CPU build runs the served worker in a process of its own: its idle steps are
    # bounded by idle_wait_ms (hma_redis.adapter.arrivals), as the worker says once.
    assert "idle engine steps: the engine core is in another process" in server.log_tail(200_000)

    # 4. SIGTERM while a store may still be in flight (Redis writes paused for a moment).
    before = set(chunk_keys(client))
    other = random_prompt(11 * tokens_per_chunk + 30, seed=2)
    server.complete(other, max_tokens=1)
    client.execute_command("CLIENT", "PAUSE", "1000", "WRITE")
    exit_s = server.terminate(timeout_s=EXIT_BOUND_S + 30)
    print(f"exited {exit_s:.1f}s after SIGTERM (rc {server.proc and server.proc.returncode})")
    assert exit_s <= EXIT_BOUND_S
    new = set(chunk_keys(client)) - before
    assert len(new) == len(other) // tokens_per_chunk, (
        f"{len(new)} of the new prompt's {len(other) // tokens_per_chunk} chunks in Redis"
    )
    flushed = [ln for ln in server.log_tail(200_000).splitlines() if "flushed" in ln]
    print("shutdown flush:", flushed or "no store was pending")


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False
