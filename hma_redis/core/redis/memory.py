"""How full the tier's Redis is: ``used_memory`` and ``maxmemory`` of ``INFO memory``.

:class:`TierMemory` holds one reading of every data node (a Cluster's masters, or the one
server); :meth:`~hma_redis.core.redis.store.RedisBlockStore.memory` takes it, ``hma-redis info`` and
``doctor`` show it per node, and the scheduler reports the tier's sums as Prometheus gauges
through a :class:`MemoryPoller`, which asks at most once per interval and never on the
caller's thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from hma_redis.core.redis.reply_shapes import WrongReply

logger = logging.getLogger(__name__)

# The scheduler asks Redis for its memory figures at most this often.
MEMORY_POLL_INTERVAL_S = 10.0


class NodeMemory(NamedTuple):
    """One data node's figures, in bytes."""

    node: str  # "host:port" (a Cluster master) or the redacted URL (one server, Sentinel)
    used_bytes: int  # INFO memory's used_memory
    max_bytes: int  # INFO memory's maxmemory; 0: no limit


def node_memory(node: str, info: Any) -> NodeMemory:
    """``INFO memory`` of ``node`` (as redis-py parses it) as :class:`NodeMemory`; figures
    Redis never writes (``used_memory:12GB``, a negative one, a reply that is no section of
    fields) are :class:`~hma_redis.core.redis.reply_shapes.WrongReply`."""
    if not isinstance(info, Mapping):
        raise WrongReply(f"INFO memory of {node} answered {type(info).__name__}, not fields")
    used = _bytes_field(node, info, "used_memory")
    return NodeMemory(node, used, _bytes_field(node, info, "maxmemory"))


def _bytes_field(node: str, info: Mapping[str, Any], name: str) -> int:
    """A field of bytes (redis-py parses Redis' digits to int); 0 when absent."""
    value = info.get(name, 0)
    if type(value) is not int or value < 0:
        raise WrongReply(f"INFO memory of {node}: {name} is {value!r:.40}, not bytes")
    return value


@dataclass(frozen=True)
class TierMemory:
    """Every data node's figures, taken in one go."""

    nodes: tuple[NodeMemory, ...]

    @property
    def used_bytes(self) -> int:
        """Bytes Redis uses, summed over the nodes."""
        return sum(n.used_bytes for n in self.nodes)

    @property
    def max_bytes(self) -> int:
        """The nodes' maxmemory summed; 0 (no limit) when any node has none: the tier can then
        grow until that host runs out of memory, and no sum would be its limit."""
        if any(n.max_bytes == 0 for n in self.nodes):
            return 0
        return sum(n.max_bytes for n in self.nodes)


@dataclass(frozen=True)
class MemoryRefused:
    """No figures: Redis answered ``INFO`` with an error (NOPERM under the tier's ACL), or,
    with ``unreadable``, with figures Redis never writes (a proxy's ``used_memory:12GB``)."""

    reason: str
    unreadable: bool = False


MemoryReading = TierMemory | MemoryRefused | None  # None: Redis not reached (an outage)


class MemoryPoller:
    """The newest :class:`TierMemory`, fetched in the background at most once per
    ``interval_s``.

    :meth:`take` never waits on Redis: it starts a fetch on the poller's own thread when the
    last one started ``interval_s`` ago or more (and none is running), and hands over what a
    finished fetch found, once. A refusal is logged once, at INFO, and yields nothing: the
    gauges are then not reported, and the fetch is tried again each interval (an operator may
    grant ``+info`` while the engine runs).
    """

    def __init__(
        self,
        fetch: Callable[[], MemoryReading],
        interval_s: float = MEMORY_POLL_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._interval_s = interval_s
        self._clock = clock
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hma-memory")
        self._inflight: Future[MemoryReading] | None = None
        self._started_at: float | None = None
        self._said_refused = False

    def take(self) -> TierMemory | None:
        """Figures a fetch found since the last call, or None (none finished, Redis refused or
        was not reached). Starts the next fetch when one is due. Never blocks."""
        found = self._finished()
        if self._inflight is None and self._due():
            self._started_at = self._clock()
            self._inflight = self._executor.submit(self._fetch)
        return found

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the fetch in flight, if any (tests, shutdown)."""
        inflight = self._inflight
        if inflight is not None:
            inflight.exception(timeout=timeout_s)

    def close(self, timeout_s: float = 0.0) -> None:
        """Stop polling; a fetch in flight is waited for up to ``timeout_s`` first (the
        store's connections are closed next: a fetch still reading would meet a closed
        socket and report Redis failed)."""
        with contextlib.suppress(TimeoutError):
            self.wait(timeout_s)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _due(self) -> bool:
        return self._started_at is None or self._clock() - self._started_at >= self._interval_s

    def _finished(self) -> TierMemory | None:
        future = self._inflight
        if future is None or not future.done():
            return None
        self._inflight = None
        reading = future.result()  # the store's guard never raises for Redis' errors
        if isinstance(reading, MemoryRefused):
            self._say_refused(reading)
            return None
        return reading

    def _say_refused(self, refused: MemoryRefused) -> None:
        if self._said_refused:
            return
        self._said_refused = True
        if refused.unreadable:
            logger.info(
                "hma_redis: the server's INFO memory is not Redis' (%s): the used/max memory "
                "gauges are not reported",
                refused.reason,
            )
            return
        logger.info(
            "hma_redis: Redis refused INFO (%s): the used/max memory gauges are not reported; "
            "grant the tier's ACL user +info to have them (docs/security.md)",
            refused.reason,
        )
