"""RedisBlockStore: the block API, the only place that speaks Redis commands for the tier.

Every operation is one pipelined round trip (per node, on a cluster), safe to call from many
threads at once, and bounded in time as a whole: each wait on a socket by ``read_timeout_s``,
the operation by a deadline (:func:`hma_redis.core.deadline.budget_s` of its bytes, or the
caller's ``deadline`` when that comes first); past it the operation fails as a timeout. Every
call goes through one guard (:meth:`RedisBlockStore._guard`) that tells outages from refusals:
an outage (connection error, timeout) opens the circuit breaker, so the tier is off until a
probe succeeds; a refusal (NOPERM, OOM, READONLY: a healthy server saying no) is counted
(``refused_*``) and logged at most once a minute per kind, and the tier stays on for everything
else. Operations that can degrade do: existence checks become misses, puts become FAILED, gets
become ``None``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any, Protocol, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.counters import PendingCounters
from hma_redis.core.deadline import Deadline, budget_s
from hma_redis.core.latency import LatencySamples, Operation
from hma_redis.core.medium import (
    BlockStore,
    LoadResult,
    LoadStatus,
    LoadTarget,
    MediumJob,
    Pages,
    PutResult,
    body_bytes,
)
from hma_redis.core.redis import pins, reply_shapes, wire
from hma_redis.core.redis.breaker import (
    BreakerState,
    CircuitBreaker,
    ErrorKind,
    JobOutcome,
    RateLimitedLog,
    classify,
    describe,
    refusal_of,
)
from hma_redis.core.redis.client import (
    RedisClient,
    bounded,
    make_client,
    new_client_name,
    raw_socket,
)
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
_R = TypeVar("_R", bound="_JobResult")


class _JobResult(Protocol):
    """A value job's result for one key (:class:`LoadResult`, ``wire.StoreResult``)."""

    @property
    def error(self) -> str | None: ...


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


class RedisJob(MediumJob):
    """A transfer job's value calls on Redis (:meth:`RedisBlockStore.start_job`): their
    deadline and the breaker's one outcome for them."""

    def __init__(self, deadline: Deadline, outcome: JobOutcome) -> None:
        self.deadline = deadline
        self.outcome = outcome

    def settle(self) -> None:
        self.outcome.settle()


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
    ):
        self.cfg = cfg
        reason = _native_unavailable_reason(cfg)
        if native is False:
            reason = "the Python path was asked for"
        elif native and reason is not None:
            raise ValueError(f"hma_redis: the native data path cannot run: {reason}")
        #: Whether value calls run the C job (else its pure-Python twin); why not, if not.
        self.native = reason is None
        self.native_reason = reason
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
        self._stats_lock = threading.Lock()
        self.round_trips = 0
        # Counter deltas for ``stats_key``, delivered on the store's next round trip.
        self.stats_key = stats_key
        self.counters = PendingCounters()
        # Seconds of the calls Redis answered, by operation (drained by the metrics).
        self.latency = LatencySamples()
        self._refusal_log = RateLimitedLog(refusal_log_interval_s)
        # A value job on a Cluster met MOVED/ASK: refresh the slot table after it.
        self._slots_stale = False

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
                if self._refusal("EVAL", reply):
                    # Refused (e.g. an ACL without these keys): misses, Redis itself is fine.
                    flags.extend([False] * size)
                else:
                    flags.extend(v == 1 for v in reply_shapes.flags("EVAL", reply, size, (0, 1)))
            return flags

        within = self._deadline(0, deadline)
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
                    refused = self._refusal("SET", reply)
                    first = refused or reply_shapes.is_ok("SET", reply, nil=True)
                    out.append(Sighting.PRESENT if there else _first_or_again(first))
                return out
            codes: list[Sighting] = []
            step = max(1, _EXISTS_BATCH // (ranks + 1))
            for idx, reply in enumerate(replies):
                size = len(chunks[idx * step : (idx + 1) * step])
                if self._refusal("EVAL", reply):
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
        return False if self._refusal("EXISTS", reply) else reply_shapes.flag("EXISTS", reply)

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
            return [self._put_result(reply) for reply in replies]

        nbytes = sum(memoryview(value).nbytes for _, value in items)
        return self._guarded(
            "SET",
            keys,
            run,
            collect,
            default=PutResult.FAILED,
            client=self._bulk,
            deadline=self._deadline(nbytes, deadline),
            operation=Operation.STORE,
        )

    def _put_result(self, reply: Any) -> PutResult:
        """One SET NX reply: OK, nil (the key existed), or a refusal (e.g. OOM under
        maxmemory + noeviction: this key is not stored)."""
        if self._refusal("SET", reply):
            return PutResult.FAILED
        return PutResult.STORED if reply else PutResult.EXISTED

    def get(self, keys: Sequence[str], deadline: Deadline | None = None) -> list[bytes | None]:
        """Values of ``keys`` in one round trip (per node); ``None`` for missing or on failure."""
        if not keys:
            return []

        def run(pipe: Any, batch: Sequence[str]) -> None:
            for key in batch:
                pipe.get(key)

        def collect(replies: list[Any], batch: Sequence[str]) -> list[bytes | None]:
            return [None if self._refusal("GET", reply) else reply for reply in replies]

        within = self._deadline(0, deadline)
        return self._guarded(
            "GET", keys, run, collect, default=None, deadline=within, operation=Operation.LOAD
        )

    def delete(self, keys: Sequence[str]) -> int:
        """UNLINK ``keys`` (used to drop values that failed validation); 0 if Redis fails."""
        if not keys:
            return 0

        def unlink() -> int:
            self._count_round_trip()
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.unlink(key)
            replies = pipe.execute(raise_on_error=False)
            return sum(
                0 if self._refusal("UNLINK", n) else reply_shapes.integer("UNLINK", n, (0, 1))
                for n in replies
            )

        return self._guard("UNLINK", unlink, 0)

    # ------------------------------------------------------------------ value jobs

    def describe(self) -> str:
        """The data path of :meth:`load_values` / :meth:`put_values`: the C job and its CRC32C
        (instructions or a table), or the pure-Python twin and why; and how many connections
        one call spreads its values over at most."""
        if self.native:
            crc = "SSE4.2" if wire.hardware_crc() else "a portable table"
            which = f"native, GIL released (CRC32C by {crc})"
        else:
            which = f"pure Python ({self.native_reason})"
        return f"{which}, up to {self.cfg.connections_per_thread} connection(s) per thread"

    def announce(self, line: str) -> None:
        """Log a transfer engine's ``line`` about the data path (:func:`wire.announce`)."""
        wire.announce(line)

    @property
    def lands_in_place(self) -> bool:
        """The C job receives a value's body straight into the pages its target names; the
        twin can too, but only the C job is trusted to (see the transfer engine)."""
        return self.native

    def start_job(self, nbytes: int, since: float) -> RedisJob:
        """A job of value calls moving ``nbytes``, submitted at ``since``: its deadline is
        :func:`~hma_redis.core.deadline.budget_s` of those bytes over two round trips from
        ``since``; the breaker lets it through (or not) now, as one call."""
        seconds = budget_s(self.cfg.read_timeout_s, nbytes, round_trips=2)
        return RedisJob(Deadline(since + seconds), self.breaker.job())

    def warm_up(self, parts: int) -> int:
        """Open up to ``parts`` × ``connections_per_thread`` connections of the bulk pool
        (of each Cluster primary's pool) ahead of the first job, so that a fresh engine's first
        load does not wait for them (connect, HELLO, AUTH, SELECT). Best effort, outside the
        breaker: an error stops it quietly and the jobs open what they need, as they always
        could. Returns how many connections it opened or found open. Bounded like every call
        (by :meth:`_deadline`: a server that drips its handshake holds it no longer), so
        whatever queues behind it waits at most that."""
        with bounded(self._deadline()):
            return _warm(self._bulk, parts * self.cfg.connections_per_thread)

    def warm_lookups(self) -> int:
        """:meth:`warm_up` for the connection lookups use (one per pool)."""
        with bounded(self._deadline()):
            return _warm(self.client, 1)

    def load_values(
        self, keys: Sequence[str], targets: Sequence[LoadTarget], job: RedisJob | None = None
    ) -> list[LoadResult] | None:
        """``GET`` every key into its target, the whole job in one call of
        :func:`wire.load_values` per connection (values land where the targets say,
        CRC32C computed as they arrive; nothing is validated beyond that): the C job with the
        GIL released, or its pure-Python twin (:attr:`native`). Same bytes either way.

        On a Cluster the keys are grouped by the node that serves their slot, each group on a
        connection to that node; ASK is followed, MOVED is a refusal and refreshes the slot
        table (:meth:`_on_job_connections`). An error reply is a refusal (counted and logged;
        its result stays ``ERROR``) unless it is an outage. None when Redis failed (outage:
        the breaker opens) or the breaker is open. ``job``: the transfer job this call is a
        part of (:meth:`start_job`); without one the call is a job of its own.
        """
        if not keys:
            return []
        commands = [_get_command(key) for key in keys]
        deadline, outcome = _of_job(job)
        within = self._deadline(sum(t.max_len for t in targets), deadline)
        lanes = self._lanes(max((target.max_len for target in targets), default=0), len(keys))

        def body(sock: Any, idx: Sequence[int]) -> list[LoadResult]:
            return wire.load_values(
                sock,
                [commands[i] for i in idx],
                [targets[i] for i in idx],
                self.cfg.read_timeout_s,
                budget_s=within.remaining(),
                native=self.native,
            )

        def load() -> list[LoadResult]:
            results = self._on_job_connections(keys, body, lanes)
            for result in results:
                if result.status is LoadStatus.ERROR:
                    self._job_error("GET", result.error)
            return results

        return self._guard("GET", load, None, within, outcome, Operation.LOAD)

    def put_values(
        self,
        keys: Sequence[str],
        heads: Sequence[Any],
        bodies: Sequence[Sequence[Any] | Pages],
        job: RedisJob | None = None,
        *,
        ttl_s: int | None = None,
    ) -> list[PutResult]:
        """``SET key value NX [EX ttl]`` for every key, in one call of
        :func:`wire.store_values` per connection: the C job with the GIL released, or its
        pure-Python twin (as :meth:`load_values`; a Cluster likewise, per node).

        A value is ``heads[i]`` (the codec's prefix and header, every field filled but the
        CRC32C, which is computed over header and body and written into the head here) then
        ``bodies[i]``'s pieces, sent in place (``sendmsg``; TLS piece by piece). Results as
        :meth:`put_if_absent`. ``job`` as for :meth:`load_values`; ``ttl_s`` (default: the
        config's) the values' TTL.
        """
        if not keys:
            return []
        ttl = ttl_s if ttl_s is not None else self.cfg.ttl_s
        tail = b"\r\n$2\r\nNX\r\n"
        if ttl:
            tail += b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl)), ttl)
        values = []
        total = largest = 0
        for key, head, body in zip(keys, heads, bodies, strict=True):
            raw_key = key.encode()
            size = memoryview(head).nbytes + body_bytes(body)
            total += size
            largest = max(largest, size)
            framing = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
                6 if ttl else 4,
                len(raw_key),
                raw_key,
                size,
            )
            values.append(wire.StoreValue(framing, head, body, tail))

        deadline, outcome = _of_job(job)
        within = self._deadline(total, deadline)
        lanes = self._lanes(largest, len(keys))

        def send(sock: Any, idx: Sequence[int]) -> list[wire.StoreResult]:
            return wire.store_values(
                sock,
                [values[i] for i in idx],
                self.cfg.read_timeout_s,
                budget_s=within.remaining(),
                native=self.native,
            )

        def store() -> list[PutResult]:
            return [self._store_result(r) for r in self._on_job_connections(keys, send, lanes)]

        default = [PutResult.FAILED] * len(keys)
        return self._guard("SET", store, default, within, outcome, Operation.STORE)

    def _job_error(self, command: str, error: str | None) -> None:
        """An error reply to one GET of a load job: a refusal (counted, logged)."""
        self._refusal(command, self._job_reply_error(error))

    def _job_reply_error(self, error: str | None) -> ResponseError:
        """An error reply of a value job as redis-py's exception; a Cluster key that moved
        (MOVED, ASK) also marks the slot table stale."""
        text = error or ""
        self._slots_stale = self._slots_stale or text.startswith(("MOVED", "ASK"))
        return ResponseError(text)

    def _store_result(self, result: wire.StoreResult) -> PutResult:
        if result.status is wire.StoreStatus.ERROR:
            return self._put_result(self._job_reply_error(result.error))
        stored = result.status is wire.StoreStatus.STORED
        return PutResult.STORED if stored else PutResult.EXISTED

    # ------------------------------------------------------------------ metadata

    def write_info(self, info_key: str, fields: Mapping[str, str]) -> bool:
        """Record a namespace's fingerprint fields (idempotent). False only if Redis is
        unavailable; a refusal (an ACL without HSET, a full Redis) is counted and logged by
        the store, and True says that Redis answered."""

        def hset() -> None:
            self._count_round_trip()
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(info_key, mapping=dict(fields))  # type: ignore[arg-type]
            self._refusal("HSET", pipe.execute(raise_on_error=False)[0])

        self._guard("HSET", hset, None)
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
            self._count_round_trip()
            return pins.pin(self.client, pins_key, deadlines, budget_bytes)

        return self._guard("ZADD", call, None)

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
                self._count_round_trip()
                return pins.sweep(self.client, pins_key, ttl_s, max_rounds=1)

            result = self._guard("EVAL", call, None)
            if result is None:
                return None
            expired += result.expired
            renewed += result.renewed
            dropped += result.dropped
            if result.expired + result.renewed + result.dropped < pins.SWEEP_BATCH:
                break
        return pins.SweepResult(expired, renewed, dropped)

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

        return self._guard("INFO", info, None)

    def _node_memory(self) -> list[NodeMemory]:
        if not isinstance(self.client, RedisCluster):
            self._count_round_trip()
            reply = reply_shapes.parsed("INFO", lambda: self.client.info("memory"))
            return [node_memory(self.cfg.redacted_url, reply)]
        out = []
        for node in sorted(self.client.get_primaries(), key=lambda n: (n.host, int(n.port))):
            self._count_round_trip()
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

        delivered = self._guard("HINCRBY", lambda: self._send_counters(self.client, pending), False)
        # Refused as a whole (the guard's default, breaker still closed): dropped.
        if not delivered and self.breaker.state is not BreakerState.CLOSED:
            self.counters.restore(pending)

    def _send_counters(self, client: RedisClient, pending: Mapping[str, int]) -> bool:
        """Counter deltas as one pipeline of HINCRBYs on ``client`` (one round trip)."""
        self._count_round_trip()
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
            if not self._refusal("HINCRBY", reply, count=False):
                reply_shapes.integer("HINCRBY", reply)

    # ------------------------------------------------------------------ the guard

    def _deadline(self, nbytes: int = 0, within: Deadline | None = None) -> Deadline:
        """The deadline of an operation moving ``nbytes`` that starts now, or ``within`` when
        that comes first."""
        return Deadline.after(budget_s(self.cfg.read_timeout_s, nbytes)).earliest(within)

    def _guard(
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
        It must end by ``deadline`` (default: :meth:`_deadline` of no bytes): past it, its
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
            with bounded(deadline or self._deadline(), max_reply_bytes):
                out = call()
        except (RedisError, OSError) as exc:
            out = default
            if classify(exc) is ErrorKind.OUTAGE:
                report.failed(exc)
            else:
                self._refused(command, exc, count=True)
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

    def _refusal(self, command: str, reply: Any, count: bool = True) -> bool:
        """One reply of a pipelined call: True if it is a refusal (counted and logged), False
        if it is an answer. An outage error in a reply raises it, for the guard."""
        if not isinstance(reply, Exception):
            return False
        if classify(reply) is ErrorKind.OUTAGE:
            raise reply
        self._refused(command, reply, count)
        return True

    def _refused(self, command: str, exc: BaseException, count: bool) -> None:
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

    def _count_round_trip(self) -> None:
        with self._stats_lock:
            self.round_trips += 1

    def _lanes(self, largest: int, count: int) -> int:
        """Connections a value job of ``count`` values (the largest ``largest`` bytes) runs on
        (:func:`wire.job_connections` of ``connections_per_thread``)."""
        return wire.job_connections(largest, count, self.cfg.connections_per_thread)

    def _on_job_connections(
        self, keys: Sequence[str], body: Callable[[Any, Sequence[int]], list[_R]], lanes: int = 1
    ) -> list[_R]:
        """``body(sockets, positions)`` for the positions of ``keys``, its results back in key
        order. One server: every position on ``lanes`` connections. A Cluster: the positions
        grouped by the node that serves their slot, each group on up to ``lanes`` connections
        to its node, one node after the other; a key whose slot is migrating and that answered
        ASK is sent again to the node named, after ``ASKING`` (:meth:`_follow_asks`). A key
        that moved answers MOVED: an error result, a refusal, so the job fails and is
        recomputed, and the slot table is refreshed for the next job."""
        if not isinstance(self._bulk, RedisCluster):
            pool = self._bulk.connection_pool
            return self._on_job_connection(
                pool, lambda socks: body(socks, range(len(keys))), lanes=lanes
            )
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for idx, key in enumerate(keys):
            node = self._bulk.get_node_from_key(key)
            by_node.setdefault(node.name, (node, []))[1].append(idx)
        out: list[_R | None] = [None] * len(keys)
        try:
            for node, positions in by_node.values():

                def run(sock: Any, on_node: Sequence[int] = positions) -> list[_R]:
                    return body(sock, on_node)

                pool = self._bulk.get_redis_connection(node).connection_pool
                on = min(lanes, len(positions))
                results = self._on_job_connection(pool, run, lanes=on)
                for idx, result in zip(positions, results, strict=True):
                    out[idx] = result
            self._follow_asks(out, body)  # type: ignore[arg-type,type-var]  # all filled
            # A key still redirected (MOVED, an ASK not followed): the slot table is stale.
            moved = any((r.error or "").startswith(("MOVED", "ASK")) for r in out if r)
            self._slots_stale = self._slots_stale or moved
        finally:
            if self._slots_stale:
                self._slots_stale = False
                # Best effort: redis-py refreshes it on its own MOVED replies too.
                with contextlib.suppress(RedisError, RedisClusterException):
                    self._bulk.nodes_manager.initialize()
        return out  # type: ignore[return-value]  # every position was filled

    def _follow_asks(self, out: list[_R], body: Callable[[Any, Sequence[int]], list[_R]]) -> None:
        """Each position of ``out`` that answered ``ASK <slot> <host>:<port>`` (its slot is
        being migrated and the key is, or is to be, on that node), run again by ``body`` on a
        connection to that node, right after ``ASKING``: it admits one command, so one key at
        a time. An ASK to a node the client does not know stays an error (a refusal)."""
        assert isinstance(self._bulk, RedisCluster)
        for idx, result in enumerate(out):
            node = self._ask_target(result.error)
            if node is None:
                continue
            pool = self._bulk.get_redis_connection(node).connection_pool

            def again(socks: Any, at: int = idx) -> list[_R]:
                return body(socks, [at])

            (out[idx],) = self._on_job_connection(pool, again, asking=True)

    def _ask_target(self, error: str | None) -> Any:
        """The node an ``ASK`` error reply names, or None (not an ASK, or an unknown node)."""
        if not error or not error.startswith("ASK "):
            return None
        assert isinstance(self._bulk, RedisCluster)
        fields = error.split()
        if len(fields) != 3 or ":" not in fields[2]:
            return None
        host, port = fields[2].rsplit(":", 1)
        if not port.isdigit():
            return None
        return self._bulk.get_node(host=host.strip("[]"), port=int(port))

    def _on_job_connection(
        self,
        pool: Any,
        body: Callable[[list[Any]], _T],
        asking: bool = False,
        lanes: int = 1,
    ) -> _T:
        """Run ``body(sockets)`` on ``lanes`` connections of ``pool``, which nothing else reads
        while it runs (a value job carries no counters: they ride along on lookups and
        :meth:`flush`, never before a load's GETs); with ``asking`` (one connection),
        ``ASKING`` goes first (Cluster: the next command may use a slot the node is importing).
        A connection holding
        bytes nobody asked for (a push message) is reconnected first, so the job starts at a
        reply boundary. Any exception drops every one of the connections (a stream may stop
        inside a reply) and propagates."""
        self._count_round_trip()
        conns: list[Any] = []
        try:
            for _ in range(lanes):
                conns.append(pool.get_connection())
                if conns[-1].can_read(timeout=0):
                    conns[-1].disconnect()
                    conns[-1].connect()
            if asking:
                conns[0].send_command("ASKING")
                conns[0].read_response()
            return body([raw_socket(conn) for conn in conns])
        except BaseException:
            for conn in conns:
                conn.disconnect()
            raise
        finally:
            for conn in conns:
                pool.release(conn)

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
        under :meth:`_guard` (an outage, no answer by the deadline, or a reply of the wrong
        shape, yields ``default`` for every key)."""
        return self._guard(
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
        self._count_round_trip()
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


def _of_job(job: RedisJob | None) -> tuple[Deadline | None, JobOutcome | None]:
    """A value call's deadline and breaker outcome: its job's, or none (a job of its own)."""
    return (None, None) if job is None else (job.deadline, job.outcome)


def _native_unavailable_reason(cfg: RedisTierConfig) -> str | None:
    """Why value calls cannot run the C job, or None. It needs the built extension (not
    disabled by ``HMA_REDIS_NATIVE=0``) and plain connections (standalone, unix socket,
    Sentinel's master, or each node of a Cluster): TLS stays in Python's ``ssl``."""
    reason = wire.unavailable_reason()
    if reason is None and cfg.tls:
        return "TLS connections stay in Python's ssl"
    return reason


def _warm(client: RedisClient, connections: int) -> int:
    """Open up to ``connections`` connections of ``client``'s pool, or of each Cluster
    primary's pool, and give them back; how many were open then. Errors end it quietly."""
    if isinstance(client, RedisCluster):
        try:
            pools = [client.get_redis_connection(n).connection_pool for n in client.get_primaries()]
        except (RedisError, RedisClusterException, OSError):
            return 0
    else:
        pools = [client.connection_pool]
    ready = 0
    for pool in pools:
        held: list[Any] = []
        try:
            for _ in range(connections):
                held.append(pool.get_connection())  # connects it
        except (RedisError, OSError) as exc:
            logger.debug("hma_redis: opening connections ahead of use stopped: %s", exc)
        finally:
            ready += len(held)
            for conn in held:
                pool.release(conn)
    return ready


def bulk_connections(cfg: RedisTierConfig) -> int:
    """Connections the bulk pool may need at once: every load and store thread of a transfer
    engine built from ``cfg``, each with ``connections_per_job`` parts of
    ``connections_per_thread`` connections, and one more."""
    threads = cfg.io_threads + max(1, cfg.io_threads // 2)
    return threads * cfg.connections_per_job * cfg.connections_per_thread + 1


def _get_command(key: str) -> bytes:
    raw = key.encode()
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(raw), raw)
