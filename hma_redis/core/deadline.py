"""Deadlines: how long one Redis operation, or one transfer job, may take in all.

``read_timeout_s`` bounds each wait on a socket; it does not bound an operation: a server that
sends one byte just before every timeout keeps a call alive for as long as it likes. Every
operation therefore also gets a deadline, from the same setting and its size:

    budget = (round_trips + 1) x read_timeout_s + bytes / MIN_RATE_BYTES_S

One round trip (a lookup, a load's GETs, a store's SETs) may take two read timeouts plus its
bytes at :data:`MIN_RATE_BYTES_S`; a transfer job (an EXISTS and the SETs of a store, a load
and the second pass of its odd values) gets one read timeout more, counted from when it was
submitted. Past its deadline an operation fails like a timeout (``TimeoutError``): a lookup is
a miss, a load is recomputed, a store is dropped, and the circuit breaker opens.

The data paths (:mod:`hma_redis.core.redis.wire`, C and Python) take a wait and a budget of at
most :data:`MAX_WAIT_S` and count waits in whole milliseconds (:data:`MIN_WAIT_S`): a budget is
capped at the former, and ``read_timeout_s`` is accepted only where its operations' budgets fit
(:data:`MAX_READ_TIMEOUT_S`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# The slowest transfer rate an operation may run at: 16 MiB/s (128 Mbit/s). Slower than that a
# KV cache tier is slower than recomputing the KV cache on any accelerator vLLM runs on, and a
# server that slow is treated as failing. Loopback and LAN Redis move 1 GiB/s and more.
MIN_RATE_BYTES_S = 16 << 20
# The longest wait, and the longest budget, the data paths take: the C job's poll() takes int
# milliseconds, and a wait of more than a day is a hang, not a timeout.
MAX_WAIT_S = 86400.0
# The shortest wait they tell apart from none: the C job waits whole milliseconds (a shorter
# timeout rounds to 0 below a microsecond: poll() returns at once and every job fails).
MIN_WAIT_S = 0.001
# Round trips of one operation, the data paths' call (see budget_s).
OPERATION_ROUND_TRIPS = 1
# The longest read_timeout_s whose operations' budgets fit MAX_WAIT_S before their bytes.
MAX_READ_TIMEOUT_S = MAX_WAIT_S / (OPERATION_ROUND_TRIPS + 1)


def budget_s(
    read_timeout_s: float, nbytes: int = 0, round_trips: int = OPERATION_ROUND_TRIPS
) -> float:
    """The most seconds an operation of ``round_trips`` round trips moving ``nbytes`` may take
    (see the module docstring), at most :data:`MAX_WAIT_S` (what the data paths take)."""
    seconds = (round_trips + 1) * read_timeout_s + max(0, nbytes) / MIN_RATE_BYTES_S
    return min(seconds, MAX_WAIT_S)


@dataclass(frozen=True)
class Deadline:
    """A point in ``time.monotonic()`` time by which an operation must have finished."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left (negative once passed)."""
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def earliest(self, other: Deadline | None) -> Deadline:
        """This deadline or ``other``, whichever comes first."""
        return self if other is None or self.at <= other.at else other

    def wait_s(self, timeout_s: float) -> float:
        """How long the next wait on a socket may last: ``timeout_s`` or what is left, whichever
        is shorter. ``TimeoutError`` once the deadline has passed."""
        left = self.remaining()
        if left <= 0:
            raise TimeoutError("Redis did not finish the operation within its deadline")
        return min(timeout_s, left)
