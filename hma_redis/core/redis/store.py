"""RedisBlockStore: the block API of the tier on Redis (implements
:class:`hma_redis.core.medium.BlockStore`): lookups and admission, the value jobs
(:mod:`hma_redis.core.redis.jobs`), namespace metadata, pins and memory, the counters.

Every operation is one pipelined round trip (per node, on a cluster), safe to call from many
threads at once, and bounded in time as a whole: each wait on a socket by ``read_timeout_s``,
the operation by a deadline (:func:`hma_redis.core.deadline.budget_s` of its bytes, or the
caller's ``deadline`` when that comes first); past it the operation fails as a timeout. Every
call goes through one guard (:class:`~hma_redis.core.redis.guard.Guard`) that tells outages
from refusals: an outage (connection error, timeout) opens the circuit breaker, so the tier is
off until a probe succeeds; a refusal (NOPERM, OOM, READONLY: a healthy server saying no) is counted
(``refused_*``) and logged at most once a minute per kind, and the tier stays on for everything
else. Operations that can degrade do: existence checks become misses, puts become FAILED, gets
become ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.counters import PendingCounters
from hma_redis.core.deadline import Deadline
from hma_redis.core.keys import KeySpace
from hma_redis.core.latency import LatencySamples, Operation
from hma_redis.core.medium import (
    BlockStore,
    LoadResult,
    LoadTarget,
    Pages,
    PutResult,
)
from hma_redis.core.redis import pins, quotas, reply_shapes, wire
from hma_redis.core.redis.breaker import (
    BreakerState,
    CircuitBreaker,
    ErrorKind,
    classify,
    describe,
)
from hma_redis.core.redis.client import (
    RedisClient,
    bounded,
    make_client,
    new_client_name,
    warm_pool,
)
from hma_redis.core.redis.guard import Guard
from hma_redis.core.redis.jobs import RedisJob, ValueJobs, put_result
from hma_redis.core.redis.memory import (
    MemoryReading,
    MemoryRefused,
    NodeMemory,
    TierMemory,
    node_memory,
)

__all__ = [
    "RedisBlockStore",
    "RedisJob",
    "RedisUnavailableError",
    "Sighting",
]

logger = logging.getLogger(__name__)

# One EVAL answers "which of these keys exist" for any number of keys: one command, one round
# trip, visible as a single call in INFO commandstats. EXISTS does not touch the LRU clock.
_EXISTS_SCRIPT = """#!lua flags=no-writes,allow-cross-slot-keys
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('EXISTS', key) end
return out
"""
# Keep single commands moderate so Redis never blocks long on one of them.
_EXISTS_BATCH = 4096
# Admission lookups (RedisBlockStore.exists_and_mark): per chunk its shards' keys, then its
# sighting marker. 1: every shard exists; else SET NX EX on the marker: 0 when this set it
# (first sighting), 2 when it was there (seen before).
_MARK_SCRIPT = """#!lua flags=allow-cross-slot-keys
local ttl, ranks = ARGV[1], tonumber(ARGV[2])
local out = {}
for c = 1, #KEYS / (ranks + 1) do
  local base = (c - 1) * (ranks + 1)
  local present = 1
  for r = 1, ranks do
    if redis.call('EXISTS', KEYS[base + r]) == 0 then present = 0 end
  end
  if present == 1 then
    out[c] = 1
  elseif redis.call('SET', KEYS[base + ranks + 1], '1', 'NX', 'EX', ttl) then
    out[c] = 0
  else
    out[c] = 2
  end
end
return out
"""
# The most bytes one reply to a lookup may take, as a reply line of the data path: a lookup's
# longest reply (one script's 4096 flags) is 16 KiB, so a longer one is not Redis answering,
# and a line without end is refused here instead of buffered until the call's deadline.
MAX_LOOKUP_REPLY = wire.MAX_REPLY_LINE
# A refusal of each kind is logged at most once per this many seconds (the rest are counted).
REFUSAL_LOG_INTERVAL_S = 60.0

_T = TypeVar("_T")


class Sighting(Enum):
    """An admission lookup's answer for one chunk (:meth:`RedisBlockStore.exists_and_mark`)."""

    PRESENT = "present"  # every shard is in Redis
    FIRST = "first"  # not in Redis, and no instance saw it within the marker TTL
    AGAIN = "again"  # not in Redis, but seen before: admitted for storing


_SIGHTINGS = {0: Sighting.FIRST, 1: Sighting.PRESENT, 2: Sighting.AGAIN}


def _first_or_again(first: bool) -> Sighting:
    return Sighting.FIRST if first else Sighting.AGAIN


class RedisUnavailableError(ConnectionError):
    """Redis could not be reached at start-up (message carries the redacted URL)."""


class RedisBlockStore(BlockStore[RedisJob]):
    """Batched, degradable access to block values and namespace metadata.

    ``native``: the value calls' data path, chosen here once: None runs the C job wherever it
    can serve the connections and its pure-Python twin elsewhere (:attr:`native` says which),
    False the twin everywhere; True requires the C job (``ValueError`` where it cannot run).

    Thread safe: redis-py's pool hands each call its own connection, and the breaker is locked.
    """

    def __init__(
        self,
        cfg: RedisTierConfig,
        client: RedisClient | None = None,
        stats_key: str | None = None,
        refusal_log_interval_s: float = REFUSAL_LOG_INTERVAL_S,
        native: bool | None = None,
        quota_space: KeySpace | None = None,
    ):
        """``quota_space``: the namespace whose per-tenant account stores update (option
        ``tenant_quotas``; None: no account is kept)."""
        self.cfg = cfg
        self.quota_space = quota_space
        # The connections of both pools carry this name (CLIENT LIST shows which are the
        # store's); a client handed in keeps its own (None here).
        self.client_name = new_client_name() if client is None else None
        self.client = (
            client if client is not None else make_client(cfg, client_name=self.client_name)
        )
        # Values go through their own pool whose packer never copies them.
        self._bulk = (
            self.client
            if client is not None
            else make_client(
                cfg,
                zero_copy=True,
                max_connections=bulk_connections(cfg),
                client_name=self.client_name,
                congestion=cfg.tcp_congestion,
            )
        )
        self.breaker = CircuitBreaker(cfg.redacted_url, cfg.retry_interval_s)
        self._is_cluster = isinstance(self.client, RedisCluster)
        # Counter deltas for ``stats_key``, delivered on the store's next pipelined call.
        self.stats_key = stats_key
        self.counters = PendingCounters()
        # Seconds of the calls Redis answered, by operation (drained by the metrics).
        self.latency = LatencySamples()
        self._guard = Guard(cfg, self.breaker, self.counters, self.latency, refusal_log_interval_s)
        #: The value jobs, on the bulk pool, on the data path chosen here.
        self.values = ValueJobs(cfg, self._bulk, self._guard, native)

    @property
    def native(self) -> bool:
        """Whether value calls run the C job (else its pure-Python twin)."""
        return self.values.native

    @property
    def native_reason(self) -> str | None:
        """Why value calls do not run the C job, or None."""
        return self.values.native_reason

    @property
    def round_trips(self) -> int:
        """Round trips made so far (every guarded call counts its own)."""
        return self._guard.round_trips

    # ------------------------------------------------------------------ health

    def ping(self) -> None:
        """Raise :class:`RedisUnavailableError` (URL redacted) unless Redis answers PING."""
        try:
            self.client.ping()
        except (RedisError, OSError) as exc:
            raise RedisUnavailableError(
                f"hma_redis: cannot reach Redis at {self.cfg.redacted_url}: {describe(exc)}"
            ) from None

    def close(self) -> None:
        self.client.close()
        if self._bulk is not self.client:
            self._bulk.close()

    def drop_value_connections(self) -> None:
        """Close the value jobs' idle connections (a job in flight keeps its own); the next job
        opens new ones. For benchmarks: on a small host a connection's speed is a draw that lasts
        its life (docs/performance.md), so repetitions that each meet new connections sample that
        draw as a peer that starts a fresh process per repetition does."""
        if isinstance(self._bulk, RedisCluster):
            for node in self._bulk.get_nodes():
                if node.redis_connection is not None:
                    node.redis_connection.connection_pool.disconnect(inuse_connections=False)
        else:
            self._bulk.connection_pool.disconnect(inuse_connections=False)

    # ------------------------------------------------------------------ blocks

    def exists(
        self,
        keys: Sequence[str],
        deadline: Deadline | None = None,
        operation: Operation = Operation.LOOKUP,
    ) -> list[bool]:
        """Which of ``keys`` exist, in one round trip (per node). All ``False`` if Redis fails
        (or does not answer by the operation's deadline). ``operation``: what the call's time
        is a sample of (a store job's check before it stores is part of the store)."""
        if not keys:
            return []

        def run(pipe: Any, batch: Sequence[str]) -> None:
            if self._is_cluster:
                # A script's keys must share one slot and ours almost never do (and redis-py's
                # cluster pipeline asks the server for an EVAL's keys with COMMAND GETKEYS, one
                # extra round trip per script). One EXISTS per key instead: redis-py still
                # sends the whole batch to each node in one round trip.
                for key in batch:
                    pipe.exists(key)
                return
            for start in range(0, len(batch), _EXISTS_BATCH):
                part = batch[start : start + _EXISTS_BATCH]
                pipe.eval(_EXISTS_SCRIPT, len(part), *part)

        def collect(replies: list[Any], batch: Sequence[str]) -> list[bool]:
            if self._is_cluster:
                return [self._exists_flag(reply) for reply in replies]
            flags: list[bool] = []
            for idx, reply in enumerate(replies):
                size = len(batch[idx * _EXISTS_BATCH : (idx + 1) * _EXISTS_BATCH])
                if self._guard.refusal("EVAL", reply):
                    # Refused (e.g. an ACL without these keys): misses, Redis itself is fine.
                    flags.extend([False] * size)
                else:
                    flags.extend(v == 1 for v in reply_shapes.flags("EVAL", reply, size, (0, 1)))
            return flags

        within = self._guard.deadline(0, deadline)
        return self._guarded(
            "EXISTS",
            keys,
            run,
            collect,
            default=False,
            deadline=within,
            operation=operation,
            max_reply_bytes=MAX_LOOKUP_REPLY,
        )

    def exists_and_mark(
        self, chunks: Sequence[Sequence[str]], markers: Sequence[str], marker_ttl_s: int
    ) -> list[Sighting]:
        """Admission lookups (``admission: second_sighting``), in ONE round trip (per node).

        ``chunks[i]`` are the keys of one chunk (every rank's shard); ``markers[i]`` its
        sighting marker. A chunk whose keys all exist is PRESENT; otherwise its marker is set
        with ``SET NX EX marker_ttl_s``: FIRST when this set it, AGAIN when it was there (some
        instance saw the chunk before, within the TTL). Redis down or refusing: FIRST for every
        chunk (nothing is admitted on a guess). On a Cluster the markers ride in the same
        pipeline as the EXISTS, so a PRESENT chunk's marker is set too (unread; it expires).
        Added by the admission work (issue 14), apart from :meth:`exists` so the plain lookup
        path is unchanged.
        """
        if not chunks:
            return []
        flat = [key for keys in chunks for key in keys]
        ranks = len(chunks[0])
        ttl = str(marker_ttl_s)

        def run(pipe: Any, batch: Sequence[str]) -> None:
            if self._is_cluster:
                # Per-key commands (see exists()); the markers ride in the same pipeline.
                for key in flat:
                    pipe.exists(key)
                for marker in markers:
                    pipe.set(marker, b"1", nx=True, ex=marker_ttl_s)
                return
            step = max(1, _EXISTS_BATCH // (ranks + 1))
            for start in range(0, len(chunks), step):
                keys: list[str] = []
                for idx in range(start, min(start + step, len(chunks))):
                    keys += [*chunks[idx], markers[idx]]
                pipe.eval(_MARK_SCRIPT, len(keys), *keys, ttl, str(ranks))

        def collect(replies: list[Any], batch: Sequence[str]) -> list[Sighting]:
            if self._is_cluster:
                found = [self._exists_flag(r) for r in replies[: len(flat)]]
                sets = replies[len(flat) :]
                out = []
                for idx, reply in enumerate(sets):
                    there = all(found[idx * ranks : (idx + 1) * ranks])
                    refused = self._guard.refusal("SET", reply)
                    first = refused or reply_shapes.is_ok("SET", reply, nil=True)
                    out.append(Sighting.PRESENT if there else _first_or_again(first))
                return out
            codes: list[Sighting] = []
            step = max(1, _EXISTS_BATCH // (ranks + 1))
            for idx, reply in enumerate(replies):
                size = len(chunks[idx * step : (idx + 1) * step])
                if self._guard.refusal("EVAL", reply):
                    codes.extend([Sighting.FIRST] * size)
                else:
                    codes.extend(
                        _SIGHTINGS[v] for v in reply_shapes.flags("EVAL", reply, size, _SIGHTINGS)
                    )
            return codes

        # The guard's default is per key of ``batch``: pass one pseudo-key per chunk.
        return self._guarded(
            "EVAL",
            markers,
            run,
            collect,
            default=Sighting.FIRST,
            operation=Operation.LOOKUP,
            max_reply_bytes=MAX_LOOKUP_REPLY,
        )

    def _exists_flag(self, reply: Any) -> bool:
        """One cluster EXISTS reply as a flag (refusals are misses, outages and replies of
        another shape raise)."""
        return False if self._guard.refusal("EXISTS", reply) else reply_shapes.flag("EXISTS", reply)

    def put_if_absent(
        self,
        items: Sequence[tuple[str, bytes | memoryview]],
        ttl_s: int | None = None,
        deadline: Deadline | None = None,
    ) -> list[PutResult]:
        """``SET key value NX [EX ttl]`` for every item in one round trip (per node).

        Content-addressed values are immutable, so an existing key is left alone (EXISTED).
        A value is written whole or not at all; nothing partial ever becomes visible.
        """
        if not items:
            return []
        ttl = ttl_s if ttl_s is not None else self.cfg.ttl_s
        values = dict(items)
        keys = [k for k, _ in items]

        def run(pipe: Any, batch: Sequence[str]) -> None:
            for key in batch:
                pipe.set(key, values[key], nx=True, ex=ttl)

        def collect(replies: list[Any], batch: Sequence[str]) -> list[PutResult]:
            return [put_result(self._guard, reply) for reply in replies]

        nbytes = sum(memoryview(value).nbytes for _, value in items)
        return self._guarded(
            "SET",
            keys,
            run,
            collect,
            default=PutResult.FAILED,
            client=self._bulk,
            deadline=self._guard.deadline(nbytes, deadline),
            operation=Operation.STORE,
        )

    def get(self, keys: Sequence[str], deadline: Deadline | None = None) -> list[bytes | None]:
        """Values of ``keys`` in one round trip (per node); ``None`` for missing or on failure."""
        if not keys:
            return []

        def run(pipe: Any, batch: Sequence[str]) -> None:
            for key in batch:
                pipe.get(key)

        def collect(replies: list[Any], batch: Sequence[str]) -> list[bytes | None]:
            return [None if self._guard.refusal("GET", reply) else reply for reply in replies]

        within = self._guard.deadline(0, deadline)
        return self._guarded(
            "GET", keys, run, collect, default=None, deadline=within, operation=Operation.LOAD
        )

    def delete(self, keys: Sequence[str]) -> int:
        """UNLINK ``keys`` (used to drop values that failed validation); 0 if Redis fails."""
        if not keys:
            return 0

        def unlink() -> int:
            self._guard.count_round_trip()
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.unlink(key)
            replies = pipe.execute(raise_on_error=False)
            return sum(
                0 if self._guard.refusal("UNLINK", n) else reply_shapes.integer("UNLINK", n, (0, 1))
                for n in replies
            )

        return self._guard.run("UNLINK", unlink, 0)

    # ------------------------------------------------------------------ value jobs

    def describe(self) -> str:
        return self.values.describe()

    def announce(self, line: str) -> None:
        self.values.announce(line)

    @property
    def lands_in_place(self) -> bool:
        return self.values.lands_in_place

    def start_job(self, nbytes: int, since: float) -> RedisJob:
        return self.values.start_job(nbytes, since)

    def warm_up(self, parts: int) -> int:
        return self.values.warm_up(parts)

    def warm_lookups(self) -> int:
        """:meth:`warm_up` for the connection lookups use (one per pool)."""
        with bounded(self._guard.deadline()):
            return warm_pool(self.client, 1)

    def load_values(
        self, keys: Sequence[str], targets: Sequence[LoadTarget], job: RedisJob | None = None
    ) -> list[LoadResult] | None:
        """:meth:`ValueJobs.load_values <hma_redis.core.redis.jobs.ValueJobs.load_values>`."""
        return self.values.load_values(keys, targets, job)

    def put_values(
        self,
        keys: Sequence[str],
        heads: Sequence[Any],
        bodies: Sequence[Sequence[Any] | Pages],
        job: RedisJob | None = None,
        *,
        ttl_s: int | None = None,
    ) -> list[PutResult]:
        """:meth:`ValueJobs.put_values <hma_redis.core.redis.jobs.ValueJobs.put_values>`."""
        return self.values.put_values(keys, heads, bodies, job, ttl_s=ttl_s)

    # ------------------------------------------------------------------ metadata

    def write_info(self, info_key: str, fields: Mapping[str, str]) -> bool:
        """Record a namespace's fingerprint fields (idempotent). False only if Redis is
        unavailable; a refusal (an ACL without HSET, a full Redis) is counted and logged by
        the store, and True says that Redis answered."""

        def hset() -> None:
            self._guard.count_round_trip()
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(info_key, mapping=dict(fields))  # type: ignore[arg-type]
            self._guard.refusal("HSET", pipe.execute(raise_on_error=False)[0])

        self._guard.run("HSET", hset, None)
        # Redis answered unless the breaker is open now: a refusal leaves it closed, also one
        # of the whole call (e.g. an ACL without SELECT), which the guard turns into None.
        return self.breaker.state is BreakerState.CLOSED

    def pin(
        self, pins_key: str, deadlines: Mapping[str, float], budget_bytes: int | None = None
    ) -> pins.PinResult | None:
        """Pin chunks (chunk key -> deadline, unix seconds) in ``pins_key``, within
        ``budget_bytes`` when given: see :func:`hma_redis.core.redis.pins.pin`. None when Redis
        failed or refused (nothing raised)."""
        if not deadlines:
            return pins.PinResult(0)

        def call() -> pins.PinResult:
            self._guard.count_round_trip()
            return pins.pin(self.client, pins_key, deadlines, budget_bytes)

        return self._guard.run("ZADD", call, None)

    def sweep_pins(
        self, pins_key: str, ttl_s: int, max_rounds: int = 100
    ) -> pins.SweepResult | None:
        """End the pins of ``pins_key`` whose deadline has passed (:func:`hma_redis.core.redis.pins.
        sweep`), one round of at most ``pins.SWEEP_BATCH`` pins per guarded call (each within
        the guard's deadline); None when Redis failed or refused (the next sweep tries
        again)."""
        expired = renewed = dropped = 0
        for _ in range(max_rounds):

            def call() -> pins.SweepResult:
                self._guard.count_round_trip()
                return pins.sweep(self.client, pins_key, ttl_s, max_rounds=1)

            result = self._guard.run("EVAL", call, None)
            if result is None:
                return None
            expired += result.expired
            renewed += result.renewed
            dropped += result.dropped
            if result.expired + result.renewed + result.dropped < pins.SWEEP_BATCH:
                break
        return pins.SweepResult(expired, renewed, dropped)

    # ------------------------------------------------------------------ quotas

    def account_stored(self, owner: str, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """Count chunks a put just wrote (``PutResult.STORED``) against tenant ``owner`` in
        the namespace's account (:func:`hma_redis.core.redis.quotas.record_stored`); nothing
        without ``quota_space``. Best effort: a failure is the guard's (counted, logged), the
        chunk stays unaccounted (docs/operations.md states the bound)."""
        space = self.quota_space
        if space is None or not keys:
            return
        sizes_of = dict(zip(keys, sizes, strict=True))

        def call() -> int:
            self._guard.count_round_trip()
            return quotas.record_stored(self.client, space.tenants_key(), owner, sizes_of)

        self._guard.run("EVAL", call, None)

    def account_removed(self, keys: Sequence[str]) -> quotas.Freed | None:
        """Take removed chunks off the account (:func:`hma_redis.core.redis.quotas.
        record_removed`); None when Redis failed or refused, or without ``quota_space``."""
        space = self.quota_space
        if space is None:
            return None

        def call() -> quotas.Freed:
            self._guard.count_round_trip()
            return quotas.record_removed(self.client, space.tenants_key(), keys)

        return self._guard.run("EVAL", call, None)

    def quota_snapshot(self, tenants: Sequence[str]) -> quotas.QuotaSnapshot | None:
        """The bytes of ``tenants`` and every budget (one round trip); None when Redis
        failed or refused, or without ``quota_space``."""
        space = self.quota_space
        if space is None:
            return None

        def call() -> quotas.QuotaSnapshot:
            self._guard.count_round_trip()
            return quotas.snapshot(self.client, space.tenants_key(), space.quotas_key(), tenants)

        return self._guard.run("HMGET", call, None)

    def reconcile_quota(self, cursor: int) -> quotas.ReconcileRound | None:
        """One reconcile round of the account from ``cursor`` (:func:`hma_redis.core.redis.
        quotas.reconcile_round`); None when Redis failed or refused."""
        space = self.quota_space
        if space is None:
            return None

        def call() -> quotas.ReconcileRound:
            self._guard.count_round_trip()
            return quotas.reconcile_round(self.client, space, cursor)

        return self._guard.run("HSCAN", call, None)

    def memory(self) -> MemoryReading:
        """``used_memory`` and ``maxmemory`` of every data node (each Cluster master, in turn;
        one ``INFO memory`` each), under the guard like every call: None while Redis is not
        reached (an outage opens the breaker; an open breaker sends nothing).

        A refusal (NOPERM: the tier's recommended ACL has no ``+info``) is
        :class:`MemoryRefused`, neither logged nor counted as ``refused_*`` here: the figures
        are optional, and the caller says once that they are missing."""

        def info() -> TierMemory | MemoryRefused:
            try:
                return TierMemory(tuple(self._node_memory()))
            except reply_shapes.WrongReply as exc:
                # Figures Redis does not write (a proxy's ``used_memory:12GB``): none, as
                # when refused; the server answers, and lookups need not stop for it.
                return MemoryRefused(str(exc), unreadable=True)
            except ResponseError as exc:
                if classify(exc) is ErrorKind.OUTAGE:
                    raise
                return MemoryRefused(str(exc))

        return self._guard.run("INFO", info, None)

    def _node_memory(self) -> list[NodeMemory]:
        if not isinstance(self.client, RedisCluster):
            self._guard.count_round_trip()
            reply = reply_shapes.parsed("INFO", lambda: self.client.info("memory"))
            return [node_memory(self.cfg.redacted_url, reply)]
        out = []
        for node in sorted(self.client.get_primaries(), key=lambda n: (n.host, int(n.port))):
            self._guard.count_round_trip()
            client = self.client.get_redis_connection(node)

            def info(on: redis.Redis = client) -> Any:
                return on.info("memory")

            reply = reply_shapes.parsed("INFO", info)
            out.append(node_memory(f"{node.host}:{node.port}", reply))
        return out

    def read_hash(self, key: str) -> dict[str, str]:
        """The fields of the hash ``key`` (``HGETALL``; e.g. a namespace's info hash). Redis'
        errors raise, as does a reply that is no map of UTF-8 strings
        (:class:`~hma_redis.core.redis.reply_shapes.WrongReply`)."""
        raw = reply_shapes.parsed("HGETALL", lambda: self.client.hgetall(key))
        return reply_shapes.text_map("HGETALL", raw)

    def flush(self) -> None:
        """Deliver pending counter deltas now (one round trip); kept for later if Redis fails
        (dropped if Redis refuses them: they would be refused again)."""
        pending = self.counters.take() if self.stats_key is not None else {}
        if not pending:
            return

        delivered = self._guard.run(
            "HINCRBY", lambda: self._send_counters(self.client, pending), False
        )
        # Refused as a whole (the guard's default, breaker still closed): dropped.
        if not delivered and self.breaker.state is not BreakerState.CLOSED:
            self.counters.restore(pending)

    def _send_counters(self, client: RedisClient, pending: Mapping[str, int]) -> bool:
        """Counter deltas as one pipeline of HINCRBYs on ``client`` (one round trip)."""
        self._guard.count_round_trip()
        pipe = client.pipeline(transaction=False)
        self._append_counters(pipe, pending)
        self._check_counter_replies(pipe.execute(raise_on_error=False))
        return True

    def _append_counters(self, pipe: Any, pending: Mapping[str, int]) -> None:
        for name, delta in pending.items():
            pipe.hincrby(self.stats_key, name, delta)

    def _check_counter_replies(self, replies: Sequence[Any]) -> None:
        """Counter increments that rode along: an outage raises; a refusal is logged, not
        counted (counting it would make the next round trip carry a counter to refuse)."""
        for reply in replies:
            if not self._guard.refusal("HINCRBY", reply, count=False):
                reply_shapes.integer("HINCRBY", reply)

    # ------------------------------------------------------------------ the guard

    def _guarded(
        self,
        command: str,
        keys: Sequence[str],
        run: Callable[[Any, Sequence[str]], None],
        collect: Callable[[list[Any], Sequence[str]], list[_T]],
        default: _T,
        client: RedisClient | None = None,
        deadline: Deadline | None = None,
        operation: Operation | None = None,
        max_reply_bytes: int | None = None,
    ) -> list[_T]:
        """Run ``run`` on one pipeline (cluster: one per node) and map replies back to ``keys``,
        under the guard (an outage, no answer by the deadline, or a reply of the wrong shape
        yields ``default`` for every key)."""
        return self._guard.run(
            command,
            lambda: self._execute(client or self.client, keys, run, collect),
            [default] * len(keys),
            deadline,
            operation=operation,
            max_reply_bytes=max_reply_bytes,
        )

    def _execute(
        self,
        client: RedisClient,
        keys: Sequence[str],
        run: Callable[[Any, Sequence[str]], None],
        collect: Callable[[list[Any], Sequence[str]], list[_T]],
    ) -> list[_T]:
        self._guard.count_round_trip()
        pending = self.counters.take() if self.stats_key is not None else {}
        try:
            return self._execute_with(client, keys, run, collect, pending)
        except BaseException:
            self.counters.restore(pending)
            raise

    def _execute_with(
        self,
        client: RedisClient,
        keys: Sequence[str],
        run: Callable[[Any, Sequence[str]], None],
        collect: Callable[[list[Any], Sequence[str]], list[_T]],
        pending: Mapping[str, int],
    ) -> list[_T]:
        # On a cluster, redis-py's pipeline routes each command by its key, sends each node its
        # commands in one round trip (the counters go to the stats key's node) and returns the
        # replies in command order, as a plain pipeline does.
        pipe = client.pipeline(transaction=False)
        run(pipe, keys)
        self._append_counters(pipe, pending)
        replies = pipe.execute(raise_on_error=False)
        split = len(replies) - len(pending)
        out = collect(replies[:split], keys)
        self._check_counter_replies(replies[split:])
        return out


def bulk_connections(cfg: RedisTierConfig) -> int:
    """Connections the bulk pool may need at once: every load and store thread of a transfer
    engine built from ``cfg``, each with ``connections_per_job`` parts of
    ``connections_per_thread`` connections, and one more."""
    threads = cfg.io_threads + max(1, cfg.io_threads // 2)
    return threads * cfg.connections_per_job * cfg.connections_per_thread + 1
