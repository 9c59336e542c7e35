"""One background job at a time, for the scheduler's keepers (pins, quotas).

The scheduler's thread starts a job with :meth:`BackgroundJob.submit` only when
:meth:`BackgroundJob.busy` says none runs, and never waits for it; a job that raised is logged,
at most once per interval, when the next one is about to start (:meth:`report_failure`), never
lost silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from hma_redis.core.redis.breaker import RateLimitedLog

logger = logging.getLogger(__name__)

FAILED_JOB_LOG_INTERVAL_S = 60.0


class BackgroundJob:
    """A thread of its own running one job at a time. A failure is logged on ``log`` (the
    keeper's logger) as "a <what> job failed (...; <consequence>)": ``consequence`` says what
    it means for the user."""

    def __init__(
        self, thread_name: str, what: str, consequence: str, log: logging.Logger = logger
    ) -> None:
        self._log = log
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._inflight: Future[None] | None = None
        self._failed_log = RateLimitedLog(FAILED_JOB_LOG_INTERVAL_S)
        self._what = what
        self._consequence = consequence

    def busy(self) -> bool:
        """Whether a job runs now."""
        return self._inflight is not None and not self._inflight.done()

    def submit(self, job: Callable[..., None], *args: Any) -> None:
        """Start ``job(*args)``; the caller has checked :meth:`busy`."""
        self._inflight = self._executor.submit(job, *args)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for the job in flight, if any (tests, shutdown); whether
        none runs any more."""
        inflight = self._inflight
        if inflight is None:
            return True
        done, _ = wait([inflight], timeout=timeout_s)
        return bool(done)

    def failure(self) -> BaseException | None:
        """The exception the last finished job raised (None: it did not, or none ran)."""
        done = self._inflight
        if done is None or not done.done() or done.cancelled():
            return None
        return done.exception()

    def report_failure(self) -> None:
        """Log the last job's exception, if it raised one (at most once per interval)."""
        done = self._inflight
        if done is None or done.cancelled() or done.exception() is None:
            return
        self._inflight = None
        held = self._failed_log.admit("job")
        if held is not None:
            self._log.warning(
                "hma_redis: a %s job failed (%d more since the last report; %s)",
                self._what,
                held,
                self._consequence,
                exc_info=done.exception(),
            )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
