"""How long the store's Redis calls take, by what they were for, kept until someone asks.

The store times each call Redis answered (:meth:`LatencySamples.record`); the adapter drains the
samples into a Prometheus histogram once per report (:meth:`LatencySamples.take`). Calls that
failed (connection errors, timeouts) are not samples: they are counted as errors, and a
timed-out call's "latency" would only repeat the deadline.
"""

from __future__ import annotations

import threading
from collections import deque
from enum import Enum

# Samples kept per operation between two reports. Nobody may drain them (vLLM started with
# --disable-log-stats), so the oldest are dropped past this: memory stays bounded.
MAX_SAMPLES = 4096


class Operation(Enum):
    """What a Redis call was for (the ``operation`` label of the histogram)."""

    LOOKUP = "lookup"  # the scheduler's EXISTS batch, admission marks included
    LOAD = "load"  # GETs of a load job
    STORE = "store"  # SET NX of a store job, and the EXISTS it sends first


class LatencySamples:
    """Thread-safe, bounded seconds per :class:`Operation`, waiting to be reported."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._lock = threading.Lock()
        self._samples = {op: deque[float](maxlen=max_samples) for op in Operation}

    def record(self, operation: Operation, seconds: float) -> None:
        """One call of ``operation`` that Redis answered, after ``seconds``."""
        with self._lock:
            self._samples[operation].append(seconds)

    def take(self) -> dict[Operation, list[float]]:
        """Every sample since the last call, by operation (operations without any left out)."""
        with self._lock:
            out = {op: list(samples) for op, samples in self._samples.items() if samples}
            for samples in self._samples.values():
                samples.clear()
        return out
