"""RedisOffloadingConnector's reports and its exit, through vLLM's real Scheduler and the worker
connector over CPU KV tensors and a real Redis (tests/support/connector_harness.py): the
worker-side stats vLLM ships to the scheduler (chunks stored, loaded, failed: exact deltas), and
the stores an in-process engine queued in its last step reaching Redis when the process exits
without anyone shutting the connector down. (The connector's recompute and shutdown flush:
tests/adapter/test_connector_fast.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from hma_redis.adapter.metrics import RedisMetricName
from hma_redis.core.config import MAX_IDLE_WAIT_MS
from hma_redis.core.transfer.engine import TEST_LOAD_DELAY_ENV
from tests.adapter.test_connector_fast import (
    NUM_BLOCKS,
    PROMPT_LEN,
    _computed,
    _corrupt,
    _prompt,
    _store_prompt,
)
from tests.support.connector_harness import BLOCK_SIZE, ConnectorHarness

R = RedisMetricName
REPO = Path(__file__).resolve().parents[2]
# Each load of the idle-wait test pauses this long before its GETs (a slow Redis).
LOAD_DELAY_S = 0.6


def _block_keys(client: redis.Redis) -> list[bytes]:
    """Every chunk key in Redis (all KV groups of all prompts)."""
    return [k for k in client.scan_iter("hma:*:g*")]


def _worker_stats(harness: ConnectorHarness) -> dict[str, int | float] | None:
    """What the model runner takes from the worker connector after a step (the delta since
    the last call), reduced as vLLM's stats logger reduces it."""
    stats = harness.worker.get_kv_connector_stats()
    return None if stats is None else stats.reduce()


def _counters(reduced: dict[str, int | float] | None) -> dict[str, int | float]:
    """The counters of a reduced report (the round-trip histogram left out)."""
    return {k: v for k, v in (reduced or {}).items() if not k.startswith(R.ROUND_TRIP_SECONDS)}


def _round_trips(reduced: dict[str, int | float] | None) -> dict[str, int | float]:
    """Redis calls timed, by operation, in a reduced report."""
    prefix, suffix = f"{R.ROUND_TRIP_SECONDS}:('", "',)_count"
    return {
        k.removeprefix(prefix).removesuffix(suffix): v
        for k, v in (reduced or {}).items()
        if k.startswith(prefix) and k.endswith(suffix)
    }


def test_worker_stats_count_the_chunks_stored_then_loaded(
    instance: Callable[..., ConnectorHarness],
    redis_client: redis.Redis,
) -> None:
    """The first instance reports one stored chunk per key it wrote (every KV group), once;
    the second, which loads the prompt, one loaded chunk per key."""
    first = instance()
    assert _worker_stats(first) is None  # nothing happened yet
    _store_prompt(first, _prompt(11))
    stored = len(_block_keys(redis_client))
    assert stored > NUM_BLOCKS  # the sliding-window and second full-attention groups too
    reported = _worker_stats(first)
    assert _counters(reported) == {R.STORED_CHUNKS: stored}
    # The store job's SETs, timed as a store (no EXISTS: the scheduler's lookup has just
    # answered MISS for these chunks); no lookup on a worker.
    assert set(_round_trips(reported)) == {"store"} and _round_trips(reported)["store"] >= 1
    assert _worker_stats(first) is None  # a delta: reported once

    second = instance()
    req = second.add_request(_prompt(11))
    second.run()
    assert len(second.load_jobs_of[req.request_id]) == 1
    reported = _worker_stats(second)
    assert _counters(reported) == {R.LOADED_CHUNKS: stored}
    assert _round_trips(reported).get("load", 0) >= 1


def test_worker_stats_count_a_failed_load_and_the_chunks_stored_again(
    instance: Callable[..., ConnectorHarness],
    redis_client: redis.Redis,
) -> None:
    """A load that meets one corrupt chunk fails whole: every chunk of the job counts as
    failed, nothing as loaded; the recompute stores the dropped chunk again and finds the
    others present."""
    keys = _store_prompt(instance(), _prompt(12))
    total = len(_block_keys(redis_client))
    _corrupt(redis_client, keys[2])

    second = instance()
    req = second.add_request(_prompt(12))
    steps = second.run()
    assert any(req.request_id in step.failed_recving for step in steps)
    assert _counters(_worker_stats(second)) == {
        R.LOAD_FAILED_CHUNKS: total,
        R.STORED_CHUNKS: 1,
        R.STORE_EXISTED_CHUNKS: total - 1,
    }


# The child: an in-process engine's last step (a prefill whose stores vLLM queues for the next
# step), then a normal interpreter exit; nobody calls shutdown().
_CHILD = """
import sys
from tests.support.connector_harness import ConnectorHarness

url, model_dir, prompt = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
harness = ConnectorHarness(url, model_dir)
req = harness.add_request(prompt)
step = harness.step()
while req.request_id not in step.scheduled:
    step = harness.step()
assert req.is_finished() and step.store_jobs, "the prefill's stores were not queued"
"""


def test_stores_queued_in_the_last_step_reach_redis_when_the_process_exits(
    instance: Callable[..., ConnectorHarness],
    redis_client: redis.Redis,
    redis_url: str,
    model_dir: str,
) -> None:
    """vLLM does not always shut its connectors down (an in-process engine at interpreter
    exit): the worker connector's exit hook submits the queued stores and flushes them, so
    the next instance loads the prompt instead of recomputing it."""
    prompt = _prompt(13)
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, redis_url, model_dir, ",".join(map(str, prompt))],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert len(_block_keys(redis_client)) > NUM_BLOCKS

    second = instance()
    req = second.add_request(prompt)
    steps = second.run()
    assert not any(step.failed_recving for step in steps)
    assert _computed(steps, req.request_id)[0] == PROMPT_LEN - NUM_BLOCKS * BLOCK_SIZE


def test_a_step_that_computes_tokens_never_waits_for_a_running_load(
    instance: Callable[..., ConnectorHarness],
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``idle_wait_ms`` is for steps with nothing to compute: while one request's load runs,
    another request keeps decoding a token per step at the loop's own pace (a step that
    waited would stretch each step to the idle bound and starve the decode)."""
    prompt = _prompt(14)
    _store_prompt(instance(), prompt)
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, str(LOAD_DELAY_S))
    second = instance(extra_config={"idle_wait_ms": MAX_IDLE_WAIT_MS})
    busy = second.add_request(_prompt(15), max_tokens=200)
    while busy.request_id not in second.step().scheduled:
        pass
    loading = second.add_request(prompt)
    busy_steps, in_flight = 0, False
    for _ in range(200):
        record = second.step()
        in_flight |= any(job.req_id == loading.request_id for job in record.load_jobs.values())
        if loading.request_id in record.finished_recving:
            break
        if in_flight:
            assert record.scheduled.get(busy.request_id) == 1  # a decode step, not idle
            busy_steps += 1
    assert in_flight and not record.failed_recving
    # The load takes LOAD_DELAY_S; steps that waited up to MAX_IDLE_WAIT_MS each would fit
    # about LOAD_DELAY_S / MAX_IDLE_WAIT_MS = 6 of them in it, free-running steps many more.
    assert busy_steps >= 3 * LOAD_DELAY_S / (MAX_IDLE_WAIT_MS / 1e3), busy_steps
