"""Per-tenant byte quotas: the account of what each tenant stores, and its budget.

Redis has no ``maxmemory`` per key prefix, so the tier keeps the account itself, in one hash
per namespace, ``<prefix>:<ns>:tenants`` (:meth:`~hma_redis.core.keys.KeySpace.tenants_key`):

* field ``<chunk key>``: ``"<tenant> <bytes>"``, the tenant a stored chunk is counted against
  and its value's length (one record per chunk this tier stored, per rank);
* field ``=<tenant>``: the tenant's bytes, the sum of its records' bytes.

Both change only together, in one script on the hash's slot (:data:`_STORED_SCRIPT`,
:data:`_REMOVED_SCRIPT`), so ``=<tenant>`` is always exactly the sum of the tenant's records,
whatever runs concurrently: the account's only error is records that name chunks Redis no
longer holds (removals not yet applied) and chunks Redis holds that have no record (a worker
that died between its ``SET`` and its record). The key names carry no tenant and the layout of
the chunk keys is unchanged; a removed key is mapped to its tenant through its record.

* A store records only the chunks its ``SET NX`` wrote (``PutResult.STORED``, never one that
  existed): the record replaces any older one of the key (that key was absent, so the older
  record was stale).
* A removal (a keyspace notification: evicted, expired, deleted) drops the key's record and
  takes its bytes off, once: every instance's watcher hears every removal, and only the first
  script finds the record. Keys that exist again (stored anew since) are left out.
* :func:`reconcile_round` walks the records (``HSCAN``, bounded rounds) and drops those whose
  chunk is gone: lost notifications, removals while no instance listened, an expired key Redis
  dropped while loading its snapshot.
* ``FLUSHALL`` / ``FLUSHDB`` (no notifications) remove the hash with the chunks: the account
  is empty, as the namespace is.

Budgets live in ``<prefix>:<ns>:quotas`` (field: tenant id; value: bytes, ``-1`` for none),
written by ``hma-redis quota`` and read with the tenants' bytes every
``quota_refresh_interval_s`` by :class:`QuotaKeeper`, on a thread of its own.

These functions speak to a redis-py client directly and raise its errors: the tier calls them
through :class:`~hma_redis.core.redis.store.RedisBlockStore` (its one guard), the CLI directly.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hma_redis.core.keys import KeySpace
from hma_redis.core.redis import reply_shapes
from hma_redis.core.redis.background import BackgroundJob
from hma_redis.core.tenants import DEFAULT_TENANT

logger = logging.getLogger(__name__)

# The field prefix of a tenant's bytes (a chunk key starts with the key prefix: never "=").
USAGE_FIELD = "="
# A budget's value meaning "no budget" (an override that exempts a tenant from the default).
NO_BUDGET = -1
# Records one reconcile round reads (HSCAN COUNT) and checks (one EXISTS pipeline).
RECONCILE_BATCH = 512
# Rounds one reconcile job runs at most; the next job goes on from its cursor.
RECONCILE_MAX_ROUNDS = 64
# Tenants whose bytes the keeper reads (the most recently seen); others read as unknown.
MAX_TRACKED_TENANTS = 1024
# Removed keys waiting for their account at most; more mean a reconcile instead.
MAX_PENDING_REMOVALS = 1 << 16

# KEYS[1]: the tenants hash. ARGV[1]: the tenant. ARGV[2..]: chunk key, bytes pairs (chunks
# just written). Replaces each key's record (an older one is stale: the key was absent).
_STORED_SCRIPT = """
local h = KEYS[1]
local tenant = ARGV[1]
local function take(owner, bytes)
  local left = redis.call('HINCRBY', h, '=' .. owner, -bytes)
  if left <= 0 then redis.call('HDEL', h, '=' .. owner) end
end
local added = 0
for i = 2, #ARGV, 2 do
  local old = redis.call('HGET', h, ARGV[i])
  if old then
    local sp = string.find(old, ' ', 1, true)
    if sp then take(string.sub(old, 1, sp - 1), tonumber(string.sub(old, sp + 1)) or 0) end
  end
  redis.call('HSET', h, ARGV[i], tenant .. ' ' .. ARGV[i + 1])
  redis.call('HINCRBY', h, '=' .. tenant, ARGV[i + 1])
  added = added + tonumber(ARGV[i + 1])
end
return added
"""

# KEYS[1]: the tenants hash. ARGV: chunk keys gone from Redis. Drops each one's record and
# takes its bytes off its tenant; returns {records dropped, bytes taken off}.
_REMOVED_SCRIPT = """
local h = KEYS[1]
local dropped, freed = 0, 0
for i = 1, #ARGV do
  local old = redis.call('HGET', h, ARGV[i])
  if old then
    redis.call('HDEL', h, ARGV[i])
    dropped = dropped + 1
    local sp = string.find(old, ' ', 1, true)
    if sp then
      local owner = string.sub(old, 1, sp - 1)
      local bytes = tonumber(string.sub(old, sp + 1)) or 0
      local left = redis.call('HINCRBY', h, '=' .. owner, -bytes)
      if left <= 0 then redis.call('HDEL', h, '=' .. owner) end
      freed = freed + bytes
    end
  end
end
return {dropped, freed}
"""


@dataclass(frozen=True)
class Freed:
    """What applying removals did: records dropped, bytes taken off their tenants."""

    records: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class ReconcileRound:
    """One reconcile round: the cursor to go on from (0: the pass is complete), records
    checked, and what dropping the records of gone chunks freed."""

    cursor: int
    checked: int
    freed: Freed


@dataclass(frozen=True)
class QuotaSnapshot:
    """The tenants' bytes (of those asked about; absent: none) and every budget set."""

    used: Mapping[str, int]
    budgets: Mapping[str, int]


def record_stored(client: Any, tenants_key: str, tenant: str, sizes: Mapping[str, int]) -> int:
    """Count ``sizes`` (chunk key -> value bytes, chunks a ``SET NX`` just wrote) against
    ``tenant``; the bytes added."""
    if not sizes:
        return 0
    args = [arg for key, size in sizes.items() for arg in (key, int(size))]
    reply = client.eval(_STORED_SCRIPT, 1, tenants_key, tenant, *args)
    return reply_shapes.integer("EVAL", reply)


def record_removed(client: Any, tenants_key: str, keys: Sequence[str]) -> Freed:
    """Take the records of ``keys`` (removed from Redis, as notifications say) off the
    account, but for keys that exist again (``EXISTS``, one pipeline first: stored anew since
    the removal; their record is the new store's)."""
    if not keys:
        return Freed()
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    present = [reply_shapes.flag("EXISTS", r) for r in pipe.execute()]
    gone = [key for key, there in zip(keys, present, strict=True) if not there]
    if not gone:
        return Freed()
    reply = client.eval(_REMOVED_SCRIPT, 1, tenants_key, *gone)
    dropped, freed = reply_shapes.flags("EVAL", reply, 2, range(0, 1 << 62))
    return Freed(dropped, freed)


def reconcile_round(
    client: Any, keyspace: KeySpace, cursor: int = 0, count: int = RECONCILE_BATCH
) -> ReconcileRound:
    """Check one ``HSCAN`` page of the account's records (from ``cursor``) against the chunks
    Redis holds; drop the records of chunks gone. A record naming anything but a chunk key of
    the namespace is dropped too."""
    next_cursor, fields = reply_shapes.parsed(
        "HSCAN", lambda: client.hscan(keyspace.tenants_key(), cursor, count=count)
    )
    keys = [_text(f) for f in fields if not _text(f).startswith(USAGE_FIELD)]
    foreign = [k for k in keys if not keyspace.is_block_key(k)]
    chunks = [k for k in keys if keyspace.is_block_key(k)]
    freed = record_removed(client, keyspace.tenants_key(), chunks)
    if foreign:
        reply = client.eval(_REMOVED_SCRIPT, 1, keyspace.tenants_key(), *foreign)
        dropped, nbytes = reply_shapes.flags("EVAL", reply, 2, range(0, 1 << 62))
        freed = Freed(freed.records + dropped, freed.bytes + nbytes)
    return ReconcileRound(reply_shapes.integer("HSCAN", int(next_cursor)), len(keys), freed)


def reconcile(client: Any, keyspace: KeySpace, max_rounds: int = 1 << 20) -> Freed:
    """A whole pass of :func:`reconcile_round` (the CLI's ``quota reconcile``, tests)."""
    cursor, records, nbytes = 0, 0, 0
    for _ in range(max_rounds):
        done = reconcile_round(client, keyspace, cursor)
        records += done.freed.records
        nbytes += done.freed.bytes
        cursor = done.cursor
        if cursor == 0:
            break
    return Freed(records, nbytes)


def snapshot(
    client: Any, tenants_key: str, quotas_key: str, tenants: Sequence[str]
) -> QuotaSnapshot:
    """The bytes of ``tenants`` and every budget (one pipeline: ``HMGET``, ``HGETALL``)."""
    pipe = client.pipeline(transaction=False)
    if tenants:
        pipe.hmget(tenants_key, [USAGE_FIELD + t for t in tenants])
    pipe.hgetall(quotas_key)
    replies = pipe.execute()
    used: dict[str, int] = {}
    if tenants:
        values = replies[0]
        if not isinstance(values, list) or len(values) != len(tenants):
            raise reply_shapes.WrongReply(
                f"HMGET answered {values!r:.80}, not {len(tenants)} values"
            )
        for tenant, value in zip(tenants, values, strict=True):
            nbytes = None if value is None else _bytes(value)
            if nbytes is not None:
                used[tenant] = nbytes
    return QuotaSnapshot(used, parse_budgets(_fields("HGETALL", replies[-1])))


def usage(client: Any, tenants_key: str) -> dict[str, int]:
    """Every tenant's bytes (``HSCAN MATCH =*`` over the account: the CLI, not the tier)."""
    out: dict[str, int] = {}
    for name, value in client.hscan_iter(tenants_key, match=USAGE_FIELD + "*", count=1000):
        nbytes = _bytes(value)
        if nbytes is not None:
            out[_text(name)[len(USAGE_FIELD) :]] = nbytes
    return out


def record_count(client: Any, tenants_key: str) -> int:
    """How many fields the account holds (records and per-tenant totals)."""
    return reply_shapes.integer("HLEN", client.hlen(tenants_key))


def budgets(client: Any, quotas_key: str) -> dict[str, int]:
    """Every budget the operator set (tenant -> bytes, or :data:`NO_BUDGET`)."""
    return parse_budgets(_fields("HGETALL", client.hgetall(quotas_key)))


def set_budget(client: Any, quotas_key: str, tenant: str, budget: int) -> None:
    """Set ``tenant``'s budget (bytes >= 0, or :data:`NO_BUDGET`)."""
    client.hset(quotas_key, tenant, str(budget))


def unset_budget(client: Any, quotas_key: str, tenant: str) -> bool:
    """Drop ``tenant``'s budget (the default applies again); whether it had one."""
    return reply_shapes.integer("HDEL", client.hdel(quotas_key, tenant)) == 1


def parse_budgets(fields: Mapping[str, str]) -> dict[str, int]:
    """Budgets from the quotas hash; values that are not an integer >= -1 are left out (and
    said, once per process)."""
    out: dict[str, int] = {}
    for tenant, text in fields.items():
        try:
            value = int(text)
        except ValueError:
            value = NO_BUDGET - 1
        if value < NO_BUDGET:
            _say_bad_budget(tenant, text)
            continue
        out[tenant] = value
    return out


def effective_budget(
    tenant: str, overrides: Mapping[str, int], default_budget: int | None
) -> int | None:
    """``tenant``'s budget in bytes, or None for none: the operator's override if set, else
    ``default_budget`` for a salted tenant (the default tenant has none unless set)."""
    if tenant in overrides:
        value = overrides[tenant]
        return None if value == NO_BUDGET else value
    return None if tenant == DEFAULT_TENANT else default_budget


_said_bad_budget = False


def _say_bad_budget(tenant: str, text: str) -> None:
    global _said_bad_budget
    if _said_bad_budget:
        return
    _said_bad_budget = True
    logger.warning(
        "hma_redis: the quotas hash holds %.40r for tenant %.40r, not bytes (an integer >= 0, "
        "or -1 for none); ignored (logged once)",
        text,
        tenant,
    )


@dataclass
class QuotaCounts:
    """What the keeper did, cumulative (read them, never write them)."""

    refreshes: int = 0
    refresh_failures: int = 0
    removals_applied: int = 0
    bytes_freed: int = 0
    reconciled_records: int = 0
    dropped_removals: int = 0
    reconcile_passes: int = 0
    stale_records: int = 0


class QuotaKeeper:
    """The scheduler's view of the tenants' bytes and budgets, kept off its thread.

    :meth:`note` says a tenant is asked about; :meth:`over_budget` answers from the last
    snapshot (at most ``refresh_s`` old while Redis answers), never a round trip;
    :meth:`removed` queues removed chunk keys; :meth:`tick`, once per scheduler step, starts
    the next job when none runs: the removals queued, a snapshot when ``refresh_s`` passed, a
    reconcile round when ``reconcile_s`` passed (or one was asked for). The callables are the
    store's guarded calls, which never raise for Redis' errors (None: the call failed)."""

    def __init__(
        self,
        snapshot_fn: Callable[[Sequence[str]], QuotaSnapshot | None],
        removed_fn: Callable[[Sequence[str]], Freed | None],
        reconcile_fn: Callable[[int], ReconcileRound | None],
        default_budget: int | None,
        refresh_s: float,
        reconcile_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshot_fn = snapshot_fn
        self._removed_fn = removed_fn
        self._reconcile_fn = reconcile_fn
        self._default_budget = default_budget
        self._refresh_s = refresh_s
        self._reconcile_s = reconcile_s
        self._clock = clock
        self._tenants: OrderedDict[str, None] = OrderedDict()
        self._snapshot = QuotaSnapshot({}, {})
        self._pending_removals: dict[str, None] = {}
        self._refreshed_at: float | None = None
        self._reconciled_at = clock()
        self._reconcile_cursor: int | None = None  # None: no pass under way
        self._job = BackgroundJob(
            "hma-quotas",
            "quota",
            "the tenants' bytes may be stale until one succeeds",
            logger,
        )
        self.counts = QuotaCounts()

    # ------------------------------------------------------------------ scheduler thread

    def start(self) -> QuotaKeeper:
        """Take the first snapshot now (the budgets, before the first request's stores);
        returns at once."""
        self.tick()
        return self

    def note(self, tenant: str) -> None:
        """``tenant`` has a request: its bytes are read from the next snapshot on."""
        self._tenants[tenant] = None
        self._tenants.move_to_end(tenant)
        while len(self._tenants) > MAX_TRACKED_TENANTS:
            self._tenants.popitem(last=False)

    @property
    def snapshot(self) -> QuotaSnapshot:
        """The last snapshot taken (empty before the first)."""
        return self._snapshot

    def budget(self, tenant: str) -> int | None:
        """``tenant``'s budget in bytes (None: none), as of the last snapshot."""
        return effective_budget(tenant, self._snapshot.budgets, self._default_budget)

    def used(self, tenant: str) -> int:
        """``tenant``'s bytes as of the last snapshot (0 before its first)."""
        return self._snapshot.used.get(tenant, 0)

    def over_budget(self, tenant: str) -> bool:
        """Whether ``tenant`` holds its budget or more (as of the last snapshot)."""
        budget = self.budget(tenant)
        return budget is not None and self.used(tenant) >= budget

    def removed(self, keys: Iterable[str]) -> None:
        """Queue chunk keys Redis removed; their records go at the next :meth:`tick`. Past
        :data:`MAX_PENDING_REMOVALS` the rest is dropped and a reconcile asked for."""
        for key in keys:
            if len(self._pending_removals) >= MAX_PENDING_REMOVALS:
                self.counts.dropped_removals += 1
                self.reconcile_soon()
                continue
            self._pending_removals[key] = None

    def reconcile_soon(self) -> None:
        """Removals were lost (the watcher overflowed): start a reconcile pass at the next
        :meth:`tick`."""
        self._reconciled_at = self._clock() - self._reconcile_s

    def tick(self) -> None:
        """Start the next job unless one runs. Never blocks."""
        if self._job.busy():
            return
        self._job.report_failure()
        now = self._clock()
        refresh = self._refreshed_at is None or now - self._refreshed_at >= self._refresh_s
        reconcile = self._reconcile_cursor is not None or now - self._reconciled_at >= (
            self._reconcile_s
        )
        removals, self._pending_removals = list(self._pending_removals), {}
        if not (refresh or reconcile or removals):
            return
        if refresh:
            self._refreshed_at = now
        if reconcile and self._reconcile_cursor is None:
            self._reconciled_at = now
            self._reconcile_cursor = 0
        tenants = list(self._tenants) if refresh else None
        self._job.submit(self._run, removals, tenants, reconcile)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for the job in flight (tests, shutdown); whether none
        runs any more."""
        return self._job.wait(timeout_s)

    def close(self) -> None:
        self._job.close()

    # ------------------------------------------------------------------ the keeper's thread

    def _run(self, removals: list[str], tenants: list[str] | None, reconcile: bool) -> None:
        if removals:
            freed = self._removed_fn(removals)
            if freed is not None:
                self.counts.removals_applied += freed.records
                self.counts.bytes_freed += freed.bytes
            else:
                self.reconcile_soon()  # the records stay: a reconcile finds them
        if reconcile:
            self._reconcile_once()
        if tenants is not None:
            taken = self._snapshot_fn(tenants)
            if taken is None:
                self.counts.refresh_failures += 1
            else:
                self._snapshot = taken
                self.counts.refreshes += 1

    def _reconcile_once(self) -> None:
        """Up to :data:`RECONCILE_MAX_ROUNDS` rounds of the pass under way."""
        cursor = self._reconcile_cursor or 0
        for _ in range(RECONCILE_MAX_ROUNDS):
            done = self._reconcile_fn(cursor)
            if done is None:
                return  # Redis failed: the pass goes on from here at the next tick
            self.counts.reconciled_records += done.checked
            self.counts.stale_records += done.freed.records
            self.counts.bytes_freed += done.freed.bytes
            cursor = done.cursor
            if cursor == 0:
                self._reconcile_cursor = None
                self.counts.reconcile_passes += 1
                if done.freed.records:
                    logger.debug(
                        "hma_redis: reconcile dropped %d stale records", done.freed.records
                    )
                return
        self._reconcile_cursor = cursor


def _fields(command: str, reply: Any) -> dict[str, str]:
    """A hash's fields as text (bytes that are not UTF-8 escaped: such a budget is then not
    bytes, and ignored, rather than an outage of the call); a reply that is no map is
    :class:`~hma_redis.core.redis.reply_shapes.WrongReply`."""
    if not isinstance(reply, Mapping) or not all(
        isinstance(x, bytes | str) for pair in reply.items() for x in pair
    ):
        raise reply_shapes.WrongReply(f"{command} answered {reply!r:.80}, not a map of strings")
    return {_text(k): _text(v) for k, v in reply.items()}


def _text(value: bytes | str) -> str:
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else value


def _bytes(value: object) -> int | None:
    """A tenant's bytes as the account holds them (an integer), or None for anything else
    (written by hand, say: left out and said once; never an outage of the call, which would
    open the store's breaker and stop the lookups with it)."""
    try:
        return int(_text(value))  # type: ignore[arg-type]
    except (TypeError, ValueError, UnicodeDecodeError):
        _say_bad_usage(value)
        return None


_said_bad_usage = False


def _say_bad_usage(value: object) -> None:
    global _said_bad_usage
    if _said_bad_usage:
        return
    _said_bad_usage = True
    logger.warning(
        "hma_redis: the tenants' account holds %.40r as a tenant's bytes, not an integer; "
        "that tenant reads as holding none (logged once; hma-redis quota reconcile does not "
        "repair it: delete the field)",
        value,
    )


__all__: Sequence[str] = (
    "NO_BUDGET",
    "Freed",
    "QuotaKeeper",
    "QuotaSnapshot",
    "ReconcileRound",
    "budgets",
    "effective_budget",
    "parse_budgets",
    "reconcile",
    "reconcile_round",
    "record_removed",
    "record_stored",
    "set_budget",
    "snapshot",
    "unset_budget",
    "usage",
)
