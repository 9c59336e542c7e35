"""A store's value jobs: every key's GET (a load) or SET NX (a store) of a transfer job in one
call of the wire code per connection, the C job or its pure-Python twin (the data path, chosen
once when the store is built); on a Cluster each node's keys on connections to that node, ASK
followed, MOVED a refusal that refreshes the slot table."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.deadline import Deadline, budget_s
from hma_redis.core.latency import Operation
from hma_redis.core.medium import (
    LoadResult,
    LoadStatus,
    LoadTarget,
    MediumJob,
    Pages,
    PutResult,
    body_bytes,
)
from hma_redis.core.redis import reply_shapes, wire
from hma_redis.core.redis.breaker import (
    ErrorKind,
    JobOutcome,
    classify,
)
from hma_redis.core.redis.client import (
    RedisClient,
    bounded,
    raw_socket,
    warm_pool,
)
from hma_redis.core.redis.guard import Guard

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R", bound="_JobResult")


class RedisJob(MediumJob):
    """A transfer job's value calls on Redis (:meth:`RedisBlockStore.start_job`): their
    deadline and the breaker's one outcome for them."""

    def __init__(self, deadline: Deadline, outcome: JobOutcome) -> None:
        self.deadline = deadline
        self.outcome = outcome

    def settle(self) -> None:
        self.outcome.settle()


class _JobResult(Protocol):
    """A value job's result for one key (:class:`LoadResult`, ``wire.StoreResult``)."""

    @property
    def error(self) -> str | None: ...


class ValueJobs:
    """The value calls of one store over its bulk client, reported through its guard.

    ``native``: None runs the C job wherever it can serve the connections and its pure-Python
    twin elsewhere (:attr:`native` says which, :attr:`native_reason` why not), False the twin
    everywhere; True requires the C job (``ValueError`` where it cannot run)."""

    def __init__(
        self, cfg: RedisTierConfig, bulk: RedisClient, guard: Guard, native: bool | None
    ) -> None:
        reason = _native_unavailable_reason(cfg)
        if native is False:
            reason = "the Python path was asked for"
        elif native and reason is not None:
            raise ValueError(f"hma_redis: the native data path cannot run: {reason}")
        self.cfg = cfg
        self._bulk = bulk
        self._guard = guard
        #: Whether value calls run the C job (else its pure-Python twin); why not, if not.
        self.native = reason is None
        self.native_reason = reason
        # A value job on a Cluster met MOVED/ASK: refresh the slot table after it.
        self._slots_stale = False
        # Whether the server copies a GET's whole value into its reply (Redis), so that large
        # values are read in pieces; learnt on the first job that may read them so (None: not
        # yet).
        self._copies_replies: bool | None = None

    def describe(self) -> str:
        """The data path of :meth:`load_values` / :meth:`put_values`: the C job and its CRC32C
        (instructions or a table), or the pure-Python twin and why; and how many connections
        one call spreads its values over at most."""
        if self.native:
            crc = wire.crc_engine() or "a portable table"
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
        return RedisJob(Deadline(since + seconds), self._guard.breaker.job())

    def warm_up(self, parts: int) -> int:
        """Open up to ``parts`` × ``connections_per_thread`` connections of the bulk pool
        (of each Cluster primary's pool) ahead of the first job, so that a fresh engine's first
        load does not wait for them (connect, HELLO, AUTH, SELECT). Best effort, outside the
        breaker: an error stops it quietly and the jobs open what they need, as they always
        could. Returns how many connections it opened or found open. Bounded like every call
        (by the guard's deadline: a server that drips its handshake holds it no longer), so
        whatever queues behind it waits at most that."""
        with bounded(self._guard.deadline()):
            return warm_pool(self._bulk, parts * self.cfg.connections_per_thread)

    def load_values(
        self, keys: Sequence[str], targets: Sequence[LoadTarget], job: RedisJob | None = None
    ) -> list[LoadResult] | None:
        """``GET`` every key into its target (in a job whose largest target exceeds
        :data:`wire.PIECED_ABOVE`, in pieces of :data:`wire.PIECE_BYTES`: ``STRLEN`` then
        ``GETRANGE`` commands; after ``ASKING``, a GET), the whole job in one call of
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
        deadline, outcome = _of_job(job)
        within = self._guard.deadline(sum(t.max_len for t in targets), deadline)
        largest = max((target.max_len for target in targets), default=0)
        lanes = self._lanes(largest, len(keys), load=True)
        piece_bytes = self._piece_bytes(largest)

        def body(sock: Any, idx: Sequence[int], pieces: int = piece_bytes) -> list[LoadResult]:
            return wire.load_values(
                sock,
                [wire.load_command(keys[i], targets[i].max_len, pieces) for i in idx],
                [targets[i] for i in idx],
                self.cfg.read_timeout_s,
                budget_s=within.remaining(),
                native=self.native,
                piece_bytes=pieces,
            )

        def asked(sock: Any, idx: Sequence[int]) -> list[LoadResult]:
            return body(sock, idx, 0)  # ASKING admits one command: a GET

        def load() -> list[LoadResult]:
            results = self._on_job_connections(keys, body, lanes, asked)
            for result in results:
                if result.status is LoadStatus.ERROR:
                    self._job_error("GET", result.error)
                    if piece_bytes and (result.error or "").startswith("NOPERM"):
                        self._pieces_refused()
            return results

        return self._guard.run("GET", load, None, within, outcome, Operation.LOAD)

    def _piece_bytes(self, largest: int) -> int:
        """The pieces a load job whose largest target is ``largest`` bytes reads its values in
        (0: GETs): :func:`wire.piece_bytes_for`, on a server that copies a GET's whole value
        into its reply. ``HMA_REDIS_PIECE_BYTES`` decides alone where it is set."""
        piece = wire.piece_bytes_for(largest)
        if not piece or wire.PIECES_ENV in os.environ:
            return piece
        if self._copies_replies is None:
            self._copies_replies = self._guard.run("INFO", self._server_copies_replies, None)
        return piece if self._copies_replies is not False else 0

    def _pieces_refused(self) -> None:
        """A value read in pieces was refused (NOPERM: the user may not run STRLEN or
        GETRANGE): this store's jobs read every value with one GET from now on, and say so
        once. The job that met it failed (its chunks are recomputed)."""
        if self._copies_replies is False:
            return
        self._copies_replies = False
        logger.warning(
            "hma_redis: Redis refused STRLEN or GETRANGE (NOPERM), which read values over %d "
            "MiB in pieces; they are read with one GET each from now on (slower for values of "
            "2 MiB and more). Grant the tier's user +strlen +getrange (docs/security.md)",
            wire.PIECED_ABOVE >> 20,
        )

    def _server_copies_replies(self) -> bool:
        """Whether the server copies a GET's whole value into its reply: Redis does (and its
        jemalloc maps a reply buffer of 8 MiB or more afresh each time, and a reply buffer of
        a few MiB leaves the core's cache: 2 and 8 MiB values loaded faster in pieces); Valkey,
        whose ``INFO server`` says ``server_name:valkey``, writes large values from the value
        itself (Valkey 9.1: 8 MiB values loaded 1.3x as fast with one GET each;
        docs/performance.md). An INFO refused (no ``+info``) or of an odd
        shape: Redis' rule. One round trip, once per store (on a Cluster, to one node)."""
        self._guard.count_round_trip()
        try:
            node = self._bulk
            if isinstance(node, RedisCluster):
                node = node.get_redis_connection(node.get_random_node())
            info = reply_shapes.parsed("INFO", lambda: node.info("server"))
        except (reply_shapes.WrongReply, RedisClusterException):
            return True
        except ResponseError as exc:
            if classify(exc) is ErrorKind.OUTAGE:
                raise
            return True
        name = info.get("server_name", "") if isinstance(info, dict) else ""
        return str(name).lower() != "valkey"

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
        within = self._guard.deadline(total, deadline)
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
        return self._guard.run("SET", store, default, within, outcome, Operation.STORE)

    def _job_error(self, command: str, error: str | None) -> None:
        """An error reply to one GET of a load job: a refusal (counted, logged)."""
        self._guard.refusal(command, self._job_reply_error(error))

    def _job_reply_error(self, error: str | None) -> ResponseError:
        """An error reply of a value job as redis-py's exception; a Cluster key that moved
        (MOVED, ASK) also marks the slot table stale."""
        text = error or ""
        self._slots_stale = self._slots_stale or text.startswith(("MOVED", "ASK"))
        return ResponseError(text)

    def _store_result(self, result: wire.StoreResult) -> PutResult:
        if result.status is wire.StoreStatus.ERROR:
            return put_result(self._guard, self._job_reply_error(result.error))
        stored = result.status is wire.StoreStatus.STORED
        return PutResult.STORED if stored else PutResult.EXISTED

    def _lanes(self, largest: int, count: int, load: bool = False) -> int:
        """Connections a value job of ``count`` values (the largest ``largest`` bytes) runs on
        (:func:`wire.job_connections` of ``connections_per_thread``; a load on the C job reads
        each connection on a thread of its own)."""
        return wire.job_connections(
            largest, count, self.cfg.connections_per_thread, load and self.native
        )

    def _on_job_connections(
        self,
        keys: Sequence[str],
        body: Callable[[Any, Sequence[int]], list[_R]],
        lanes: int = 1,
        asked: Callable[[Any, Sequence[int]], list[_R]] | None = None,
    ) -> list[_R]:
        """``body(sockets, positions)`` for the positions of ``keys``, its results back in key
        order. One server: every position on ``lanes`` connections. A Cluster: the positions
        grouped by the node that serves their slot, each group on up to ``lanes`` connections
        to its node, one node after the other; a key whose slot is migrating and that answered
        ASK is sent again to the node named, after ``ASKING``, by ``asked`` (default: ``body``;
        its commands must be one per key) (:meth:`_follow_asks`). A key
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
            self._follow_asks(out, asked or body)  # type: ignore[arg-type,type-var]  # all filled
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
        self._guard.count_round_trip()
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


def put_result(guard: Guard, reply: Any) -> PutResult:
    """One SET NX reply: OK, nil (the key existed), or a refusal (e.g. OOM under maxmemory +
    noeviction: this key is not stored)."""
    if guard.refusal("SET", reply):
        return PutResult.FAILED
    return PutResult.STORED if reply else PutResult.EXISTED


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
