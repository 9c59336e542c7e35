"""An engine step that computes nothing sleeps until a running load ends (``idle_wait_ms``)
instead of returning at once: vLLM's real scheduler and the connector's worker half over CPU KV
tensors and a real Redis (tests/support/connector_harness.py)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from hma_redis.adapter.connector import RedisConnectorMetadata
from hma_redis.core.transfer.engine import TEST_LOAD_DELAY_ENV
from tests.support.connector_harness import BLOCK_SIZE, ConnectorHarness

PROMPT_LEN = 5 * BLOCK_SIZE + 3
LOAD_DELAY_S = 0.4


def _load_steps(
    make: Callable[..., ConnectorHarness], idle_wait_ms: float
) -> list[tuple[bool, int, float]]:
    """Store a prompt from one instance, load it into another whose loads pause
    ``LOAD_DELAY_S``; per step of the second: (marked idle, tokens scheduled, seconds)."""
    prompt = [random.Random(3).randrange(4, 500) for _ in range(PROMPT_LEN)]
    first = make()
    first.add_request(prompt)
    first.run()
    second = make(extra_config={"idle_wait_ms": idle_wait_ms})
    req = second.add_request(prompt)
    steps: list[tuple[bool, int, float]] = []
    for _ in range(200):
        started = time.monotonic()
        record = second.step()
        meta = record.output.kv_connector_metadata
        assert isinstance(meta, RedisConnectorMetadata)
        steps.append(
            (meta.idle_step, record.output.total_num_scheduled_tokens, time.monotonic() - started)
        )
        if req.is_finished():
            assert record.bad_pages == []
            return steps
    raise AssertionError("the request did not finish")


def test_a_step_is_marked_idle_exactly_when_it_schedules_no_tokens(
    instance: Callable[..., ConnectorHarness], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, str(LOAD_DELAY_S))
    steps = _load_steps(instance, idle_wait_ms=50)
    assert all(idle == (tokens == 0) for idle, tokens, _ in steps)
    assert any(idle for idle, _, _ in steps) and any(not idle for idle, _, _ in steps)


def test_idle_steps_sleep_through_a_running_load_instead_of_spinning(
    instance: Callable[..., ConnectorHarness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the load runs the engine has nothing to compute: each idle step waits (up to
    idle_wait_ms), so the load's 0.4 s take a handful of steps, not one per 10 ms pause; with
    idle_wait_ms=0 the steps do not wait at all."""
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, str(LOAD_DELAY_S))
    waiting = _load_steps(instance, idle_wait_ms=100)
    idle_waiting = [s for idle, _, s in waiting if idle]
    # 0.4 s of load in steps of up to 0.1 s (+ the harness' 10 ms pause each): at most ~5
    # idle steps, and the step that saw the load end returned long before its bound.
    assert len(idle_waiting) <= 8, idle_waiting
    assert sum(idle_waiting) >= LOAD_DELAY_S * 0.5

    spinning = _load_steps(instance, idle_wait_ms=0)
    idle_spinning = [s for idle, _, s in spinning if idle]
    assert len(idle_spinning) > len(idle_waiting)
