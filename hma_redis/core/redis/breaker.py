"""A small thread-safe circuit breaker: stop talking to a dead Redis, probe once per interval;
and what decides when it opens: which errors are outages and which are refusals."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from enum import Enum

from redis.exceptions import (
    ClusterDownError,
    DataError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

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

    def job(self) -> JobOutcome:
        """One outcome for the calls of a job, let through (or not) now as one call."""
        return JobOutcome(self, self.allow())

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
            "hma_redis: Redis at %s failed (%s); lookups are misses and stores are "
            "dropped; probing every %.1fs",
            self._name,
            describe(exc),
            self._interval_s,
        )


class JobOutcome:
    """The calls of one job (its parts, on their own connections and threads, and its
    batches), reported to the breaker as one call: the job is let through or not once, at
    :meth:`CircuitBreaker.job`; once one of its calls met an outage, the later ones are not let
    through (:attr:`allowed`); :meth:`settle`, once every call has finished, records one
    failure if any call met an outage, else one success if any got an answer. A call that
    succeeds thus never closes the breaker while another call of its job is failing."""

    def __init__(self, breaker: CircuitBreaker, allowed: bool) -> None:
        self._breaker = breaker
        self._allowed = allowed
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._answered = False

    @property
    def allowed(self) -> bool:
        """Whether a call of the job may go to Redis: the job was let through and none of its
        calls has met an outage yet."""
        return self._allowed and self._failure is None

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc

    def answered(self) -> None:
        self._answered = True

    def settle(self) -> None:
        """Report the job's outcome to the breaker (call once, after every part)."""
        if self._failure is not None:
            self._breaker.record_failure(self._failure)
        elif self._answered:
            self._breaker.record_success()


# ---------------------------------------------------------------------------------- error kinds


class ErrorKind(Enum):
    """What a failed Redis call says about the server."""

    OUTAGE = "outage"  # not reachable or not serving: the breaker opens
    REFUSAL = "refusal"  # a healthy server said no to this command: the tier stays on


class Refusal(Enum):
    """Refusals counted apart (``refused_<value>`` counters): healthy servers saying no."""

    NOPERM = "noperm"  # the ACL user may not run this command or touch this key
    OOM = "oom"  # maxmemory reached under noeviction
    READONLY = "readonly"  # a replica (or a demoted master) takes no writes
    OTHER = "other"  # any other command error (WRONGTYPE, ERR ...)


# Error-reply codes of a server that answers but does not serve data (yet): outages.
_OUTAGE_CODES = frozenset({"LOADING", "CLUSTERDOWN", "MASTERDOWN", "TRYAGAIN", "BUSY"})
_REFUSAL_CODES = {"NOPERM": Refusal.NOPERM, "OOM": Refusal.OOM, "READONLY": Refusal.READONLY}
# redis-py strips the code from the message of the errors it maps to classes.
_REFUSAL_CLASSES: tuple[tuple[type[ResponseError], Refusal], ...] = (
    (NoPermissionError, Refusal.NOPERM),
    (OutOfMemoryError, Refusal.OOM),
    (ReadOnlyError, Refusal.READONLY),
)


def classify(exc: BaseException) -> ErrorKind:
    """An outage (connection error, timeout, unreadable reply, a server loading or without a
    cluster) or a refusal (an error reply of a server that serves: NOPERM, OOM, READONLY,
    WRONGTYPE ...). Only outages may turn the tier off."""
    if isinstance(exc, ClusterDownError | TryAgainError):
        return ErrorKind.OUTAGE
    if isinstance(exc, ResponseError):
        code = str(exc).split(" ", 1)[0]
        return ErrorKind.OUTAGE if code in _OUTAGE_CODES else ErrorKind.REFUSAL
    if isinstance(exc, DataError):  # the client refused to send a command: not the server
        return ErrorKind.REFUSAL
    return ErrorKind.OUTAGE


# What a server that requires a password answers a client that gave none: under RESP3 (HELLO)
# and under RESP2 (NOAUTH, which redis-py words "Authentication required.").
_NO_PASSWORD_REPLIES = (
    "HELLO must be called with the client already authenticated",
    "NOAUTH",
    "Authentication required",
)
MISSING_PASSWORD = "Redis requires a password: set HMA_REDIS_PASSWORD or password_file"


def needs_password(exc: BaseException) -> bool:
    """True when ``exc`` is a server's refusal of a client that sent no password."""
    return any(reply in str(exc) for reply in _NO_PASSWORD_REPLIES)


def describe(exc: BaseException) -> str:
    """One line naming why a Redis call failed, for operators: :data:`MISSING_PASSWORD` when
    the server wants a password it did not get, else the error's type and text."""
    if needs_password(exc):
        return MISSING_PASSWORD
    return f"{type(exc).__name__}: {exc}"


def refusal_of(exc: BaseException) -> Refusal:
    """The kind of a refusal (see :func:`classify`)."""
    for cls, kind in _REFUSAL_CLASSES:
        if isinstance(exc, cls):
            return kind
    return _REFUSAL_CODES.get(str(exc).split(" ", 1)[0], Refusal.OTHER)


class RateLimitedLog:
    """Lets one message per kind through per ``interval_s``; counts the ones held back.

    A refusal repeats on every call until an operator acts (a full Redis, a wrong ACL): logging
    each would flood the log, logging only the first would hide that it goes on.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def admit(self, kind: str) -> int | None:
        """None: hold this one back (counted). Else log it now, with the returned number of
        messages of this kind held back since the last one logged."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(kind, now):
                self._held[kind] = self._held.get(kind, 0) + 1
                return None
            self._next[kind] = now + self.interval_s
            return self._held.pop(kind, 0)
