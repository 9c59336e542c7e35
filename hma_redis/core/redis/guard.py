"""The guard every Redis call of a store goes through: its deadline, the circuit breaker
(outage vs refusal), the refusals' counters and rate-limited log, the call's latency."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.counters import PendingCounters
from hma_redis.core.deadline import Deadline, budget_s
from hma_redis.core.latency import LatencySamples, Operation
from hma_redis.core.redis.breaker import (
    CircuitBreaker,
    ErrorKind,
    JobOutcome,
    RateLimitedLog,
    classify,
    refusal_of,
)
from hma_redis.core.redis.client import (
    bounded,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Guard:
    """One store's guard. ``breaker``, ``counters`` and ``latency`` are the store's (the
    guard reports into them); thread safe."""

    def __init__(
        self,
        cfg: RedisTierConfig,
        breaker: CircuitBreaker,
        counters: PendingCounters,
        latency: LatencySamples,
        refusal_log_interval_s: float,
    ) -> None:
        self.cfg = cfg
        self.breaker = breaker
        self.counters = counters
        self.latency = latency
        self._refusal_log = RateLimitedLog(refusal_log_interval_s)
        self._stats_lock = threading.Lock()
        self.round_trips = 0

    def deadline(self, nbytes: int = 0, within: Deadline | None = None) -> Deadline:
        """The deadline of an operation moving ``nbytes`` that starts now, or ``within`` when
        that comes first."""
        return Deadline.after(budget_s(self.cfg.read_timeout_s, nbytes)).earliest(within)

    def run(
        self,
        command: str,
        call: Callable[[], _T],
        default: _T,
        deadline: Deadline | None = None,
        outcome: JobOutcome | None = None,
        operation: Operation | None = None,
        max_reply_bytes: int | None = None,
    ) -> _T:
        """Run ``call`` (one Redis round trip) under the breaker; every Redis call goes here.
        It must end by ``deadline`` (default: :meth:`deadline` of no bytes): past it, its
        connections are shut down (:func:`~hma_redis.core.redis.client.bounded`) and it counts as
        an outage (a timeout). With ``max_reply_bytes``, a reply longer than that is refused
        as it arrives (an outage too), before more of it is held.

        A reply of a shape the command never has in Redis
        (:class:`~hma_redis.core.redis.reply_shapes.WrongReply`) is an outage like an unreadable
        one: the call yields ``default`` and the breaker opens (it logs that once).

        While the breaker is open ``default`` at once, except for one probe per interval. An
        outage (see :func:`~hma_redis.core.redis.breaker.classify`) opens the breaker and yields
        ``default``. A refusal raised by the whole call (NOPERM, OOM, READONLY, another error
        reply) yields ``default`` too but proves the server answers: it is counted and logged
        (rate-limited) and the breaker stays (or becomes) closed. Exceptions that are not
        Redis errors (a caller's bug, a failed allocation) propagate. With ``outcome`` (one
        part of a job) the job was let through or not as a whole, and the breaker hears of
        the part only through the job's outcome.

        With ``operation``, the call's seconds go to :attr:`latency` when Redis answered it
        (refusals included; not when the breaker let nothing through or the call failed).
        """
        report = outcome if outcome is not None else self.breaker.job()
        if not report.allowed:
            return default
        started = time.perf_counter()
        try:
            with bounded(deadline or self.deadline(), max_reply_bytes):
                out = call()
        except (RedisError, OSError) as exc:
            out = default
            if classify(exc) is ErrorKind.OUTAGE:
                report.failed(exc)
            else:
                self.refused(command, exc, count=True)
                report.answered()
                self._record_latency(operation, started)
        else:
            report.answered()
            self._record_latency(operation, started)
        if outcome is None:
            report.settle()
        return out

    def _record_latency(self, operation: Operation | None, started: float) -> None:
        if operation is not None:
            self.latency.record(operation, time.perf_counter() - started)

    def refusal(self, command: str, reply: Any, count: bool = True) -> bool:
        """One reply of a pipelined call: True if it is a refusal (counted and logged), False
        if it is an answer. An outage error in a reply raises it, for the guard."""
        if not isinstance(reply, Exception):
            return False
        if classify(reply) is ErrorKind.OUTAGE:
            raise reply
        self.refused(command, reply, count)
        return True

    def refused(self, command: str, exc: BaseException, count: bool) -> None:
        """Count a refusal (``refused_<kind>``) and log it at most once per interval per
        command and kind, with the number held back since."""
        kind = refusal_of(exc)
        if count:
            self.counters.add(**{f"refused_{kind.value}": 1})
        held = self._refusal_log.admit(f"{command}:{kind.value}")
        if held is None:
            return
        logger.warning(
            "hma_redis: Redis at %s refused %s: %s (%s; %d more since the last report; the "
            "tier stays on; at most one report per %.0fs)",
            self.cfg.redacted_url,
            command,
            exc,
            kind.name,
            held,
            self._refusal_log.interval_s,
        )

    def count_round_trip(self) -> None:
        with self._stats_lock:
            self.round_trips += 1
