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

Only chunk keys of the set's own namespace are ever made persistent or given a TTL
(:meth:`~hma_redis.core.keys.KeySpace.is_block_key`): a member naming another namespace's chunk,
its ``info`` hash or any other key (one that is not even text included) is removed from the set
untouched, and counted (:attr:`SweepResult.dropped`).

Any API client can ask for a pin (vLLM's OpenAI server passes ``kv_transfer_params`` on), so a
pin may come with a budget: the set holds at most ``budget_bytes`` // (the largest chunk of the
batch, ``STRLEN``) members, checked and added in one script on the set's slot; chunks beyond it
stay unpinned (:attr:`PinResult.over_budget`), renewals of pins the set holds always pass.

These functions speak to a redis-py client directly and raise its errors: the tier calls them
through :class:`~hma_redis.core.redis.store.RedisBlockStore` (its one guard), the CLI directly.
:class:`PinKeeper` does the tier's pins and sweeps on a thread of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import reply_shapes
from hma_redis.core.redis.background import BackgroundJob

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

# KEYS[1]: the pins set. ARGV[1]: the most members it may hold (-1: no limit). ARGV[2..]:
# member, deadline pairs. A member the set holds is renewed (a later deadline wins); another is
# added while the set holds fewer than the limit. Returns the members left out.
_ADD_WITHIN_BUDGET_SCRIPT = """
local limit = tonumber(ARGV[1])
local held = redis.call('ZCARD', KEYS[1])
local over = {}
for i = 2, #ARGV, 2 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'GT', ARGV[i + 1], ARGV[i])
  elseif limit < 0 or held < limit then
    redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
    held = held + 1
  else
    over[#over + 1] = ARGV[i]
  end
end
return over
"""

# ``unpin --all``: every pin is due before this (year 5138).
EVERY_PIN = 1e11


@dataclass(frozen=True)
class SweepResult:
    """What one sweep did: chunks given their TTL back, pins found renewed meanwhile, members
    removed untouched because they are not chunk keys of the set's namespace."""

    expired: int
    renewed: int
    dropped: int = 0


@dataclass(frozen=True)
class PinResult:
    """What one :func:`pin` did: chunks pinned (or their pin renewed), chunks left unpinned
    because the namespace's budget is full, chunks not pinned because Redis holds no such
    chunk of the namespace (evicted, never stored, another key)."""

    pinned: int
    over_budget: int = 0
    missing: int = 0


def namespace_of(pins_key: str) -> KeySpace:
    """The namespace whose pins ``pins_key`` (``<prefix>:<ns>:pins``) records."""
    prefix, _, rest = pins_key.partition(":")
    namespace, _, tail = rest.rpartition(":")
    if not prefix or not namespace or tail != "pins" or ":" in namespace:
        raise ValueError(f"not a pins key: {pins_key!r}")
    return KeySpace(prefix, namespace)


def pin(
    client: Any, pins_key: str, deadlines: Mapping[str, float], budget_bytes: int | None = None
) -> PinResult:
    """Record ``deadlines`` (chunk key -> unix seconds) in ``pins_key``, a later deadline
    winning, then make the chunks persistent: only chunks of the set's namespace that Redis
    holds (``STRLEN``), and with ``budget_bytes`` only while the set holds at most
    ``budget_bytes`` of them (each counted as the batch's largest chunk). Renewals always
    pass; new pins beyond the budget are left out (and keep their TTL)."""
    keyspace = namespace_of(pins_key)
    keys = [key for key in deadlines if keyspace.is_block_key(key)]
    if not keys:
        return PinResult(0, missing=len(deadlines))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    sizes = [_size(reply) for reply in pipe.execute(raise_on_error=False)]
    held = {key: size for key, size in zip(keys, sizes, strict=True) if size > 0}
    missing = len(deadlines) - len(held)
    # The same round trips whether or not Redis holds the chunks (the order above holds).
    largest = max(held.values(), default=1)
    limit = -1 if budget_bytes is None else budget_bytes // largest
    args = [arg for key in held for arg in (key, repr(deadlines[key]))]
    left_out = client.eval(_ADD_WITHIN_BUDGET_SCRIPT, 1, pins_key, limit, *args)
    over = {_text(m) for m in reply_shapes.members("EVAL", left_out)}
    pinned = [key for key in held if key not in over]
    pipe = client.pipeline(transaction=False)
    for key in pinned:
        pipe.persist(key)
    pipe.execute()
    return PinResult(len(pinned), over_budget=len(held) - len(pinned), missing=missing)


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
    keyspace = namespace_of(pins_key)
    until = time.time() if now is None else now
    expired = renewed = dropped = 0
    for _ in range(max_rounds):
        found = client.zrangebyscore(pins_key, "-inf", until, start=0, num=batch)
        due = reply_shapes.members("ZRANGEBYSCORE", found)
        if not due:
            break
        chunks = [m for m in due if keyspace.is_block_key(m)]
        foreign = [m for m in due if not keyspace.is_block_key(m)]
        if foreign:  # never given a TTL or made persistent: only unlisted
            client.zrem(pins_key, *foreign)
        back = _expire_due(client, pins_key, ttl_s, until, chunks) if chunks else []
        expired += len(chunks) - len(back)
        renewed += len(back)
        dropped += len(foreign)
        if len(due) < batch or (not foreign and len(back) == len(chunks)):
            break
    return SweepResult(expired, renewed, dropped)


def _expire_due(
    client: Any, pins_key: str, ttl_s: int, until: float, chunks: Sequence[bytes | str]
) -> list[bytes | str]:
    """Give ``chunks`` (due, of the set's namespace) their TTL back and unlist those still
    due; persist again, and return, those renewed meanwhile."""
    pipe = client.pipeline(transaction=False)
    for key in chunks:
        pipe.expire(key, ttl_s)
    pipe.execute()
    kept = client.eval(_REMOVE_DUE_SCRIPT, 1, pins_key, repr(until), *chunks)
    given = set(chunks)
    # The script returns only members it was given: anything else is not persisted.
    back = [m for m in reply_shapes.members("EVAL", kept) if m in given]
    if back:
        pipe = client.pipeline(transaction=False)
        for key in back:
            pipe.persist(key)
        pipe.execute()
    return back


def list_pins(client: Any, pins_key: str) -> list[tuple[str, float]]:
    """Every pin of ``pins_key`` as (chunk key, deadline), earliest deadline first; members
    that are not chunk keys of its namespace are left out (the next sweep removes them)."""
    keyspace = namespace_of(pins_key)
    found = reply_shapes.parsed("ZRANGE", lambda: client.zrange(pins_key, 0, -1, withscores=True))
    return [
        (_text(m), s)
        for m, s in reply_shapes.scored_members("ZRANGE", found)
        if keyspace.is_block_key(m)
    ]


def parse_pin_seconds(value: object) -> int | None:
    """A request's pin in seconds: a positive int (of any size: the caller shortens it to
    its longest pin), or None for anything else."""
    if type(value) is not int or value <= 0:
        return None
    return value


class PinKeeper:
    """The tier's pins and sweeps, on a thread of its own: the scheduler never waits for them.

    :meth:`add` queues chunks (their deadlines merged, the later winning); :meth:`tick`, once
    per scheduler step, starts the next job when none runs: the queued pins, then a sweep when
    the last one started ``sweep_interval_s`` ago or more. ``pin_fn`` and ``sweep_fn`` are the
    store's guarded calls, which never raise for Redis' errors (an outage drops the batch: a
    pin is best effort, and the next sweep comes at its interval); a job that raises all the
    same is logged (rate-limited) at the next :meth:`tick`, never lost silently."""

    def __init__(
        self,
        pin_fn: Callable[[Mapping[str, float]], PinResult | None],
        sweep_fn: Callable[[], SweepResult | None],
        sweep_interval_s: float = PIN_SWEEP_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pin_fn = pin_fn
        self._sweep_fn = sweep_fn
        self._interval_s = sweep_interval_s
        self._clock = clock
        self._pending: dict[str, float] = {}
        self._job = BackgroundJob(
            "hma-pins", "pin or sweep", "pins may outlive their deadline until one succeeds", logger
        )
        self._swept_at: float | None = None
        self._said_full = False
        self._said_foreign = False
        self.pinned = 0  # chunks whose pin Redis took
        self.dropped = 0  # chunks whose pin was dropped (queue full, Redis unreachable)
        self.over_budget = 0  # chunks left unpinned: the namespace's pin budget was full

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
        if self._job.busy():
            return
        self._job.report_failure()
        sweep_due = self._swept_at is None or self._clock() - self._swept_at >= self._interval_s
        if not self._pending and not sweep_due:
            return
        batch, self._pending = self._pending, {}
        if sweep_due:
            self._swept_at = self._clock()
        self._job.submit(self._run, batch, sweep_due)

    def flush(self, timeout_s: float) -> None:
        """Send the queued pins and wait up to ``timeout_s`` for them (engine shutdown)."""
        self.wait(timeout_s)
        if self._pending:
            batch, self._pending = self._pending, {}
            self._job.submit(self._run, batch, False)
        self.wait(timeout_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for the job in flight, if any (tests, shutdown); whether
        none runs any more."""
        return self._job.wait(timeout_s)

    def failure(self) -> BaseException | None:
        """The exception the last finished job raised, if any (tests)."""
        return self._job.failure()

    def close(self) -> None:
        self._job.close()

    def _run(self, batch: Mapping[str, float], sweep_due: bool) -> None:
        if batch:
            pinned = self._pin_fn(batch)
            if pinned is None:
                self.dropped += len(batch)
            else:
                self.pinned += pinned.pinned
                self.over_budget += pinned.over_budget
        if sweep_due:
            result = self._sweep_fn()
            if result is not None and result.expired:
                logger.debug("hma_redis: %d pins ended (TTL given back)", result.expired)
            if result is not None and result.dropped:
                self._say_foreign(result.dropped)

    def _say_foreign(self, count: int) -> None:
        if self._said_foreign:
            return
        self._said_foreign = True
        logger.warning(
            "hma_redis: %d members of the namespace's pins set were not chunk keys of the "
            "namespace; removed from the set without touching the keys they name (logged once)",
            count,
        )

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
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else value


def _size(reply: object) -> int:
    """``STRLEN``'s reply as a size: 0 for anything but a positive integer (an error reply for
    a key of another type, say)."""
    return reply if type(reply) is int and reply > 0 else 0


__all__: Sequence[str] = (
    "EVERY_PIN",
    "PIN_PARAM",
    "PIN_SWEEP_INTERVAL_S",
    "PinKeeper",
    "PinResult",
    "SweepResult",
    "list_pins",
    "namespace_of",
    "parse_pin_seconds",
    "pin",
    "sweep",
)
