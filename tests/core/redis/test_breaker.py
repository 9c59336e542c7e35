"""The circuit breaker's own bookkeeping and the error classification, on their own (no server:
what they decide depends only on the calls and exceptions they are given)."""

from __future__ import annotations

import types

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from hma_redis.core.redis import breaker as breaker_module
from hma_redis.core.redis.breaker import (
    BreakerState,
    CircuitBreaker,
    ErrorKind,
    Refusal,
    classify,
    refusal_of,
)


def test_openings_count_each_change_from_closed_to_open_not_each_failure() -> None:
    breaker = CircuitBreaker("redis://test", interval_s=3600.0)
    breaker.record_failure(RedisConnectionError("down"))
    breaker.record_failure(RedisConnectionError("still down"))  # while open: no new opening
    assert (breaker.state, breaker.failures, breaker.openings) == (BreakerState.OPEN, 2, 1)
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure(RedisConnectionError("down again"))
    assert (breaker.state, breaker.failures, breaker.openings) == (BreakerState.OPEN, 3, 2)


def test_an_error_reply_without_text_is_a_refusal_of_another_kind() -> None:
    empty = ResponseError("")
    assert classify(empty) is ErrorKind.REFUSAL
    assert refusal_of(empty) is Refusal.OTHER


def test_an_open_breaker_lets_one_probe_through_per_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The breaker reads the monotonic clock; a settable one stands in for it here."""
    now = [100.0]
    monkeypatch.setattr(breaker_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    breaker = CircuitBreaker("redis://test", interval_s=10.0)
    assert breaker.allow()  # closed: every call goes through
    breaker.record_failure(RedisConnectionError("down"))
    now[0] = 109.9
    assert not breaker.allow()
    now[0] = 110.0  # one interval after the failure: this caller is the probe
    assert breaker.allow()
    assert not breaker.allow()  # the next caller waits another interval
    now[0] = 119.9
    assert not breaker.allow()
    now[0] = 120.0
    assert breaker.allow()
