"""Pins: chunks kept from eviction until a deadline.

A pinned chunk has no TTL (``PERSIST``), so under ``maxmemory-policy volatile-lru`` /
``volatile-lfu`` (which evict only keys with a TTL) Redis never evicts it, while every other
chunk keeps ``ttl_s`` and stays evictable. Each namespace records its pins in one sorted set,
``<prefix>:<ns>:pins`` (member: the chunk's Redis key; score: the pin's deadline, unix
seconds). A sweep gives every chunk whose deadline has passed its TTL back and removes it from
the set.

The chunk keys lie in other slots than the set on a Cluster, so nothing here is one atomic
script over both. The orders below keep a pin renewed concurrently with a sweep persistent:

* a pin adds (``ZADD ... GT``: a later deadline wins) *before* it ``PERSIST``\\ s;
* a sweep reads the members due (``ZRANGEBYSCORE``), ``EXPIRE``\\ s them, then removes, in one
  script on the set's slot, only those whose score is still due and returns the others (renewed
  meanwhile), which it ``PERSIST``\\ s again.

A renewal whose ``ZADD`` came before the script is returned by it and persisted after the
``EXPIRE``; one whose ``ZADD`` came after the script ``PERSIST``\\ s after it, so after the
``EXPIRE`` too. Either way the chunk ends without a TTL while its pin lasts.

These functions speak to a redis-py client directly and raise its errors: the tier calls them
through :class:`~hma_redis.core.store.RedisBlockStore` (its one guard), the CLI directly.
:class:`PinKeeper` does the tier's pins and sweeps on a thread of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# The request field that asks for a pin (in vLLM's ``kv_transfer_params``), in seconds.
PIN_PARAM = "hma_redis_pin_s"
# How often the tier sweeps, by default (option ``pin_sweep_interval_s``).
PIN_SWEEP_INTERVAL_S = 60.0
# Members one sweep round reads, expires and removes; a sweep runs rounds until none is due.
SWEEP_BATCH = 1000
# Chunks waiting for their pin at most; more are dropped (and said once): a pin is best effort.
MAX_PENDING_PINS = 1 << 16

# KEYS[1]: the pins set. ARGV[1]: now. ARGV[2..]: members the sweep expired. Removes those
# still due, returns those renewed meanwhile (a later score).
_REMOVE_DUE_SCRIPT = """
local now = tonumber(ARGV[1])
local renewed = {}
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score then
    if tonumber(score) <= now then
      redis.call('ZREM', KEYS[1], ARGV[i])
    else
      renewed[#renewed + 1] = ARGV[i]
    end
  end
end
return renewed
"""

# ``unpin --all``: every pin is due before this (year 5138).
EVERY_PIN = 1e11


@dataclass(frozen=True)
class SweepResult:
    """What one sweep did: chunks given their TTL back, pins found renewed meanwhile."""

    expired: int
    renewed: int


def pin(client: Any, pins_key: str, deadlines: Mapping[str, float]) -> None:
    """Record ``deadlines`` (chunk key -> unix seconds) in ``pins_key``, a later deadline
    winning, then make the chunks persistent. A chunk that does not exist yet stays listed
    until its deadline (the next sweep re-persists nothing for it: it is simply dropped)."""
    if not deadlines:
        return
    client.zadd(pins_key, dict(deadlines), gt=True)
    pipe = client.pipeline(transaction=False)
    for key in deadlines:
        pipe.persist(key)
    pipe.execute()


def sweep(
    client: Any,
    pins_key: str,
    ttl_s: int,
    now: float | None = None,
    batch: int = SWEEP_BATCH,
    max_rounds: int = 1000,
) -> SweepResult:
    """Give every chunk of ``pins_key`` whose deadline is ``now`` or earlier (default: the
    clock) its TTL (``EXPIRE ttl_s``) back and unlist it; pins renewed meanwhile stay (their
    chunks persistent). ``now=EVERY_PIN`` ends every pin. Raises redis-py's errors."""
    until = time.time() if now is None else now
    expired = renewed = 0
    for _ in range(max_rounds):
        due = [_text(m) for m in client.zrangebyscore(pins_key, "-inf", until, start=0, num=batch)]
        if not due:
            break
        pipe = client.pipeline(transaction=False)
        for key in due:
            pipe.expire(key, ttl_s)
        pipe.execute()
        back = [_text(m) for m in client.eval(_REMOVE_DUE_SCRIPT, 1, pins_key, repr(until), *due)]
        if back:
            pipe = client.pipeline(transaction=False)
            for key in back:
                pipe.persist(key)
            pipe.execute()
        expired += len(due) - len(back)
        renewed += len(back)
        if len(due) < batch or len(back) == len(due):
            break
    return SweepResult(expired, renewed)


def list_pins(client: Any, pins_key: str) -> list[tuple[str, float]]:
    """Every pin of ``pins_key`` as (chunk key, deadline), earliest deadline first."""
    return [(_text(m), float(s)) for m, s in client.zrange(pins_key, 0, -1, withscores=True)]


def parse_pin_seconds(value: object, max_s: int) -> int | None:
    """A request's pin in seconds, or None when it is not a positive int up to ``max_s``."""
    if type(value) is not int or value <= 0 or value > max_s:
        return None
    return value


class PinKeeper:
    """The tier's pins and sweeps, on a thread of its own: the scheduler never waits for them.

    :meth:`add` queues chunks (their deadlines merged, the later winning); :meth:`tick`, once
    per scheduler step, starts the next job when none runs: the queued pins, then a sweep when
    the last one started ``sweep_interval_s`` ago or more. ``pin_fn`` and ``sweep_fn`` are the
    store's guarded calls, which never raise for Redis' errors (an outage drops the batch: a
    pin is best effort, and the next sweep comes at its interval)."""

    def __init__(
        self,
        pin_fn: Callable[[Mapping[str, float]], bool],
        sweep_fn: Callable[[], SweepResult | None],
        sweep_interval_s: float = PIN_SWEEP_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pin_fn = pin_fn
        self._sweep_fn = sweep_fn
        self._interval_s = sweep_interval_s
        self._clock = clock
        self._pending: dict[str, float] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hma-pins")
        self._inflight: Future[None] | None = None
        self._swept_at: float | None = None
        self._said_full = False
        self.pinned = 0  # chunks whose pin Redis took
        self.dropped = 0  # chunks whose pin was dropped (queue full, Redis unreachable)

    def add(self, keys: Iterable[str], deadline: float) -> None:
        """Pin ``keys`` until ``deadline`` (unix seconds) at the next :meth:`tick`."""
        for key in keys:
            if key not in self._pending and len(self._pending) >= MAX_PENDING_PINS:
                self.dropped += 1
                self._say_full()
                continue
            self._pending[key] = max(deadline, self._pending.get(key, 0.0))

    def tick(self) -> None:
        """Start the next job (queued pins, then a sweep when one is due) unless one runs.
        Never blocks."""
        if self._inflight is not None and not self._inflight.done():
            return
        sweep_due = self._swept_at is None or self._clock() - self._swept_at >= self._interval_s
        if not self._pending and not sweep_due:
            return
        batch, self._pending = self._pending, {}
        if sweep_due:
            self._swept_at = self._clock()
        self._inflight = self._executor.submit(self._run, batch, sweep_due)

    def flush(self, timeout_s: float) -> None:
        """Send the queued pins and wait up to ``timeout_s`` for them (engine shutdown)."""
        self.wait(timeout_s)
        if self._pending:
            batch, self._pending = self._pending, {}
            self._inflight = self._executor.submit(self._run, batch, False)
        self.wait(timeout_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for the job in flight, if any (tests, shutdown); whether
        none runs any more."""
        inflight = self._inflight
        if inflight is None:
            return True
        done, _ = wait([inflight], timeout=timeout_s)
        return bool(done)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _run(self, batch: Mapping[str, float], sweep_due: bool) -> None:
        if batch:
            if self._pin_fn(batch):
                self.pinned += len(batch)
            else:
                self.dropped += len(batch)
        if sweep_due:
            result = self._sweep_fn()
            if result is not None and result.expired:
                logger.debug("hma_redis: %d pins ended (TTL given back)", result.expired)

    def _say_full(self) -> None:
        if self._said_full:
            return
        self._said_full = True
        logger.warning(
            "hma_redis: more than %d chunks wait for their pin; further pins are dropped "
            "(logged once)",
            MAX_PENDING_PINS,
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


__all__: Sequence[str] = (
    "EVERY_PIN",
    "PIN_PARAM",
    "PIN_SWEEP_INTERVAL_S",
    "PinKeeper",
    "SweepResult",
    "list_pins",
    "parse_pin_seconds",
    "pin",
    "sweep",
)
