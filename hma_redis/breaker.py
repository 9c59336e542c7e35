"""A small thread-safe circuit breaker: stop talking to a dead Redis, probe once per interval."""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum

logger = logging.getLogger(__name__)


class BreakerState(Enum):
    CLOSED = "closed"  # Redis answers: every call goes through.
    OPEN = "open"  # Redis failed: calls fail fast until the next probe.


class CircuitBreaker:
    """Guards calls to one Redis endpoint.

    Callers ask :meth:`allow` before a call and report the outcome with :meth:`record_success`
    or :meth:`record_failure`. While open, only one caller per ``interval_s`` is let through
    (the probe); everyone else degrades at once without touching the network. Each state
    change is logged exactly once.
    """

    def __init__(self, name: str, interval_s: float) -> None:
        self._name = name
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._next_probe = 0.0
        self.failures = 0
        self.openings = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    def allow(self) -> bool:
        if self._state is BreakerState.CLOSED:
            return True
        with self._lock:
            now = time.monotonic()
            if now < self._next_probe:
                return False
            # This caller is the probe; the next one waits another interval.
            self._next_probe = now + self._interval_s
            return True

    def record_success(self) -> None:
        if self._state is BreakerState.CLOSED:
            return
        with self._lock:
            if self._state is BreakerState.OPEN:
                self._state = BreakerState.CLOSED
                logger.warning("hma_redis: Redis at %s is reachable again", self._name)

    def record_failure(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self._next_probe = time.monotonic() + self._interval_s
            if self._state is BreakerState.OPEN:
                return
            self._state = BreakerState.OPEN
            self.openings += 1
        logger.warning(
            "hma_redis: Redis at %s failed (%s: %s); lookups are misses and stores are "
            "dropped; probing every %.1fs",
            self._name,
            type(exc).__name__,
            exc,
            self._interval_s,
        )
