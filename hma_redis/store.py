"""RedisBlockStore: the only place that speaks Redis commands.

Every operation is one pipelined round trip (per node, on a cluster), bounded by the configured
timeouts, and safe to call from many threads at once. Every call goes through one guard
(:meth:`RedisBlockStore._guard`) that tells outages from refusals: an outage (connection error,
timeout) opens the circuit breaker, so the tier is off until a probe succeeds; a refusal (NOPERM,
OOM, READONLY: a healthy server saying no) is counted (``refused_*``) and logged at most once a
minute per kind, and the tier stays on for everything else. Operations that can degrade do:
existence checks become misses, puts become FAILED, gets become ``None``.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import redis
from redis._parsers.encoders import Encoder
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.connection import PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, RedisClusterException, RedisError, ResponseError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from hma_redis.breaker import CircuitBreaker, ErrorKind, RateLimitedLog, classify, refusal_of
from hma_redis.config import RedisTierConfig, endpoint_url
from hma_redis.counters import PendingCounters

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
# Bytes read at a time while looking for a reply's first line (bodies go straight to buffers).
_LINE_READ = 4096
# GETs in flight on a bulk read (see RedisBlockStore.get_into).
_GET_WINDOW = 2
# Buffers per sendmsg call (Linux' IOV_MAX is 1024).
_IOV_MAX = 1024
# Bytes received at a time into scratch memory when a value too long to accept is dropped.
_DISCARD_PIECE = 256 * 1024
# A refusal of each kind is logged at most once per this many seconds (the rest are counted).
REFUSAL_LOG_INTERVAL_S = 60.0

_T = TypeVar("_T")


class PutResult(Enum):
    STORED = "stored"  # newly written by this call
    EXISTED = "existed"  # already there (content-addressed: same bytes)
    FAILED = "failed"  # not written (Redis down, OOM, timeout, ...)


@dataclass(frozen=True)
class OversizedValue:
    """What :meth:`RedisBlockStore.get_into` returns for a value longer than its bound: the value
    was not received (its bytes were dropped as they arrived)."""

    nbytes: int  # its length (on a cluster: at least this many bytes)


class RedisUnavailableError(ConnectionError):
    """Redis could not be reached at start-up (message carries the redacted URL)."""


def make_client(cfg: RedisTierConfig, zero_copy: bool = False) -> redis.Redis | RedisCluster:
    """A redis-py client with bounded timeouts and no hidden retries.

    ``redis://``, ``rediss://`` and ``unix://`` give one ``redis.Redis``; ``redis+cluster://``
    a ``RedisCluster`` (startup nodes from the URL, slots discovered from them);
    ``redis+sentinel://`` a ``redis.Redis`` on the master that the sentinels name, found again
    after a failover. Credentials, timeouts, TLS options and the pool size apply to every
    connection to a data node, whichever the form.

    With ``zero_copy``, commands are packed by redis-py's pure-Python packer, which sends large
    values (memoryviews) as their own chunks, so a value is never copied on send; the default
    hiredis packer copies every argument into one buffer but packs many small arguments (a
    lookup's keys) much faster. Replies are parsed by hiredis either way.
    """
    kwargs: dict[str, Any] = {
        "username": cfg.username,
        "password": cfg.password,
        "socket_timeout": cfg.read_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "health_check_interval": 0,
    }
    if cfg.tls:
        kwargs.update(
            ssl_ca_certs=cfg.tls_ca_file,
            ssl_certfile=cfg.tls_cert_file,
            ssl_keyfile=cfg.tls_key_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_verify else ssl.CERT_NONE,
            ssl_check_hostname=cfg.tls_verify,
        )
    # Wait (bounded) for a free connection rather than fail when all are busy.
    pool_kwargs = {
        "max_connections": cfg.pool_size,
        "timeout": cfg.connect_timeout_s + cfg.read_timeout_s,
    }
    topo = cfg.topology
    if topo.kind == "cluster":
        return _cluster_client(cfg, kwargs, pool_kwargs, zero_copy)
    if zero_copy:
        kwargs["command_packer"] = _zero_copy_packer()
    if topo.kind == "sentinel":
        return _sentinel_client(cfg, kwargs, pool_kwargs)
    pool = redis.BlockingConnectionPool.from_url(
        endpoint_url(cfg.url), db=cfg.db, retry=Retry(NoBackoff(), 0), **pool_kwargs, **kwargs
    )
    return redis.Redis(connection_pool=pool)


def _zero_copy_packer() -> PythonRespSerializer:
    return PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


def _cluster_client(
    cfg: RedisTierConfig, kwargs: dict[str, Any], pool_kwargs: dict[str, Any], zero_copy: bool
) -> RedisCluster:
    """A :class:`_BoundedCluster` over the URL's startup nodes, with blocking per-node pools."""
    topo = cfg.topology
    (first_host, first_port), *others = topo.hosts
    if zero_copy:
        base = redis.SSLConnection if topo.tls else redis.Connection
        kwargs["connection_class"] = _zero_copy_connection(base)
    elif topo.tls:
        kwargs["connection_class"] = redis.SSLConnection
    # Only a client built from a URL creates its node pools with ``connection_pool_class``;
    # the URL carries just the first startup node (everything else is a keyword).
    host = f"[{first_host}]" if ":" in first_host else first_host
    return _BoundedCluster(
        url=f"redis://{host}:{first_port}",
        startup_nodes=[ClusterNode(h, p) for h, p in others],
        # One attempt per command: a failed node opens the breaker. MOVED / ASK / TRYAGAIN
        # replies are still followed (they are answers, not failures).
        retry=Retry(NoBackoff(), 0),
        connection_pool_class=redis.BlockingConnectionPool,
        **pool_kwargs,
        **kwargs,
    )


class _BoundedCluster(RedisCluster):
    """``RedisCluster`` whose failures are bounded in time and always ``RedisError``.

    * redis-py's cluster pipeline re-sends, one at a time, every command of a batch whose node
      failed, each with its own timeout and topology refresh: one stalled node made a 50-key
      lookup take 50 read timeouts. Here, once one re-send fails on a connection error or a
      timeout, the rest of the batch fails at once (MOVED / ASK re-sends are unaffected).
    * "no node reachable" is ``RedisClusterException``, which is not a ``RedisError``: it
      becomes ``redis.ConnectionError``, so the store's breaker handles it like any outage.
    * Built while no node answers, the client does not fail: the topology is discovered on
      first use (the store's breaker paces the attempts), as a plain client connects lazily.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._init_kwargs = kwargs
        self._init_lock = threading.RLock()  # redis-py's __init__ calls back into us
        self._initializing = False
        self._ready = False
        with contextlib.suppress(redis.ConnectionError):
            self._ensure_ready()

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        with self._init_lock:
            if self._ready or self._initializing:
                return
            kwargs = dict(self._init_kwargs)
            kwargs["startup_nodes"] = list(kwargs["startup_nodes"])  # redis-py appends to it
            self._initializing = True
            try:
                super().__init__(**kwargs)
            except RedisClusterException as exc:
                raise redis.ConnectionError(f"no Redis Cluster node answered: {exc}") from None
            finally:
                self._initializing = False
            self._ready = True

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        self._ensure_ready()
        try:
            return super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise redis.ConnectionError(f"Redis Cluster: {exc}") from exc

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        self._ensure_ready()
        pipe = super().pipeline(transaction, shard_hint)
        pipe.__class__ = _BoundedClusterPipeline
        assert isinstance(pipe, _BoundedClusterPipeline)
        pipe.fail_fast_resends()
        return pipe

    def close(self) -> None:
        if self._ready:
            super().close()


class _BoundedClusterPipeline(ClusterPipeline):
    """The pipeline of :class:`_BoundedCluster` (see there)."""

    def fail_fast_resends(self) -> None:
        resend = self.parent_execute_command
        failed: list[RedisError] = []

        def resend_unless_failed(*args: Any, **options: Any) -> Any:
            if failed:
                raise failed[0]
            try:
                return resend(*args, **options)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                failed.append(exc)
                raise

        self.parent_execute_command = resend_unless_failed

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            return super().execute(raise_on_error)
        except RedisClusterException as exc:
            raise redis.ConnectionError(f"Redis Cluster: {exc}") from exc


def _sentinel_client(
    cfg: RedisTierConfig, kwargs: dict[str, Any], pool_kwargs: dict[str, Any]
) -> redis.Redis:
    """The master of ``service`` as the sentinels name it; re-asked after every failover."""
    topo = cfg.topology
    assert topo.service is not None
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": cfg.read_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    if cfg.tls:
        sentinel_kwargs.update(
            ssl=True, **{k: v for k, v in kwargs.items() if k.startswith("ssl_")}
        )
    sentinel = Sentinel(list(topo.hosts), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(
        topo.service,
        connection_pool_class=_BlockingSentinelPool,
        recheck_s=cfg.retry_interval_s,
        db=cfg.db,
        retry=Retry(NoBackoff(), 0),
        ssl=cfg.tls,
        **pool_kwargs,
        **kwargs,
    )


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """The master's pool: waits (bounded) for a free connection, like the other pools, and
    asks the sentinels for the master's address at most once per ``recheck_s``.

    redis-py asks only when it opens a connection (or when a write meets READONLY), so after a
    ``SENTINEL FAILOVER`` pooled connections kept writing to the old master, which still
    accepts writes until the sentinels demote it (we measured > 10 s): writes that its resync
    then throws away. Re-asking closes idle connections to an old master and retires busy ones
    when they come back, so the tier follows a failover within ``recheck_s`` of it.
    """

    def __init__(self, *args: Any, recheck_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recheck_s = recheck_s
        self._next_check = time.monotonic() + recheck_s

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self._recheck_s  # one caller per interval asks
            with contextlib.suppress(RedisError):  # sentinels away: the master may be fine
                self.get_master_address()
        return super().get_connection(*args, **kwargs)


def _zero_copy_connection(base: type[redis.Connection]) -> type[redis.Connection]:
    class ZeroCopyConnection(base):  # type: ignore[valid-type,misc]
        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("command_packer", _zero_copy_packer())
            super().__init__(**kwargs)

    return ZeroCopyConnection


class RedisBlockStore:
    """Batched, degradable access to block values and namespace metadata.

    Thread safe: redis-py's pool hands each call its own connection, and the breaker is locked.
    """

    def __init__(
        self,
        cfg: RedisTierConfig,
        client: redis.Redis | RedisCluster | None = None,
        stats_key: str | None = None,
        refusal_log_interval_s: float = REFUSAL_LOG_INTERVAL_S,
    ):
        self.cfg = cfg
        self.client = client if client is not None else make_client(cfg)
        # Values go through their own pool whose packer never copies them.
        self._bulk = self.client if client is not None else make_client(cfg, zero_copy=True)
        self.breaker = CircuitBreaker(cfg.redacted_url, cfg.retry_interval_s)
        self._is_cluster = isinstance(self.client, RedisCluster)
        self._stats_lock = threading.Lock()
        self.round_trips = 0
        # Counter deltas for ``stats_key``, delivered on the store's next round trip.
        self.stats_key = stats_key
        self.counters = PendingCounters()
        self._refusal_log = RateLimitedLog(refusal_log_interval_s)

    # ------------------------------------------------------------------ health

    def ping(self) -> None:
        """Raise :class:`RedisUnavailableError` (URL redacted) unless Redis answers PING."""
        try:
            self.client.ping()
        except RedisError as exc:
            raise RedisUnavailableError(
                f"hma_redis: cannot reach Redis at {self.cfg.redacted_url}: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def close(self) -> None:
        self.client.close()
        if self._bulk is not self.client:
            self._bulk.close()

    # ------------------------------------------------------------------ blocks

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` exist, in one round trip (per node). All ``False`` if Redis fails."""
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
                if self._refusal("EVAL", reply):
                    # Refused (e.g. an ACL without these keys): misses, Redis itself is fine.
                    flags.extend(
                        [False] * len(batch[idx * _EXISTS_BATCH : (idx + 1) * _EXISTS_BATCH])
                    )
                else:
                    flags.extend(bool(v) for v in reply)
            return flags

        return self._guarded("EXISTS", keys, run, collect, default=False)

    def _exists_flag(self, reply: Any) -> bool:
        """One cluster EXISTS reply as a flag (refusals are misses, outages raise)."""
        return False if self._refusal("EXISTS", reply) else bool(reply)

    def put_if_absent(
        self, items: Sequence[tuple[str, bytes | memoryview]], ttl_s: int | None = None
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

        return self._guarded("SET", keys, run, collect, default=PutResult.FAILED, client=self._bulk)

    def put_parts_if_absent(
        self,
        keys: Sequence[str],
        parts: Callable[[int], Sequence[memoryview]],
        ttl_s: int | None = None,
    ) -> list[PutResult]:
        """:meth:`put_if_absent` of values given as pieces, sent without joining them.

        ``parts(i)`` gives the pieces of ``keys[i]``'s value (the codec's prefix and header,
        then pages read in place from the KV cache). It is called just before that value is
        sent, so building the next value overlaps Redis reading the previous one. The pieces
        go to the socket in one ``sendmsg`` (``writev``): the kernel copies them straight from
        where they are, so a store makes no copy of its own. Every SET is sent before the first
        reply is read (one round trip). TLS sockets send piece by piece; a Cluster joins each
        value and uses :meth:`put_if_absent`.
        """
        if not keys:
            return []
        if self._is_cluster:
            joined = [(key, b"".join(parts(idx))) for idx, key in enumerate(keys)]
            return self.put_if_absent(joined, ttl_s)
        ttl = ttl_s if ttl_s is not None else self.cfg.ttl_s
        tail = b"\r\n$2\r\nNX\r\n"
        if ttl:
            tail += b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl)), ttl)

        def body(conn: Any, replies: _RawReplies) -> list[PutResult]:
            for idx, key in enumerate(keys):
                value = parts(idx)
                raw_key = key.encode()
                head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
                    6 if ttl else 4,
                    len(raw_key),
                    raw_key,
                    sum(part.nbytes for part in value),
                )
                _send_all(conn._sock, [memoryview(head), *value, memoryview(tail)])
            return [self._put_result(replies.read(_no_bulk)) for _ in keys]

        return self._streamed("SET", body, [PutResult.FAILED] * len(keys))

    def _put_result(self, reply: Any) -> PutResult:
        """One SET NX reply: OK, nil (the key existed), or a refusal (e.g. OOM under
        maxmemory + noeviction: this key is not stored)."""
        if self._refusal("SET", reply):
            return PutResult.FAILED
        return PutResult.STORED if reply else PutResult.EXISTED

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` in one round trip (per node); ``None`` for missing or on failure."""
        if not keys:
            return []

        def run(pipe: Any, batch: Sequence[str]) -> None:
            for key in batch:
                pipe.get(key)

        def collect(replies: list[Any], batch: Sequence[str]) -> list[bytes | None]:
            return [None if self._refusal("GET", reply) else reply for reply in replies]

        return self._guarded("GET", keys, run, collect, default=None)

    def get_into(
        self,
        keys: Sequence[str],
        alloc: Callable[[int], memoryview],
        on_value: Callable[[int, memoryview], None] | None = None,
        max_bytes: Sequence[int] | None = None,
    ) -> list[memoryview | OversizedValue | None]:
        """Like :meth:`get` (one round trip; ``None`` for missing, refused, or all if Redis
        fails), but each value is received straight into ``alloc(nbytes)``: one copy, where
        redis-py + hiredis make three (its read buffer, hiredis' buffer, a new ``bytes``).
        Every value returned lives in memory that ``alloc`` gave, whatever the topology.

        With ``max_bytes``, a value longer than ``max_bytes[i]`` is never held whole: ``alloc``
        is not asked for it, its bytes are received in bounded pieces and dropped, and it comes
        back as :class:`OversizedValue`. A bad value under a key thus never makes the caller
        allocate more than it bounded.

        Only ``_GET_WINDOW`` GETs are in flight, one more is sent as each value arrives: sending
        them all at once makes Redis build every reply in its output buffer before the socket
        drains it (measured 2x slower at 512 KiB and 2 MiB). ``on_value(index, value)`` runs as
        each value arrives, while Redis already sends the next one; it does not make the value
        final: if Redis fails later in the call, every key still comes back ``None``.
        Cluster: redis-py's GET (GETRANGE up to the bound with ``max_bytes``), each value then
        copied into ``alloc``'d memory.
        """
        if not keys:
            return []
        if self._is_cluster:
            return self._get_into_cluster(keys, alloc, on_value, max_bytes)

        def body(conn: Any, replies: _RawReplies) -> list[memoryview | OversizedValue | None]:
            first = [("GET", key) for key in keys[:_GET_WINDOW]]
            conn.send_packed_command(conn.pack_commands(first), check_health=False)
            out: list[memoryview | OversizedValue | None] = []
            for idx in range(len(keys)):
                reply = replies.read(alloc, None if max_bytes is None else max_bytes[idx])
                if idx + _GET_WINDOW < len(keys):
                    command = conn.pack_command("GET", keys[idx + _GET_WINDOW])
                    conn.send_packed_command(command, check_health=False)
                if self._refusal("GET", reply):
                    reply = None
                elif isinstance(reply, bytes):
                    raise InvalidResponse(f"unexpected reply to GET: {reply[:40]!r}")
                elif isinstance(reply, memoryview) and on_value is not None:
                    on_value(idx, reply)
                assert not isinstance(reply, ResponseError | bytes)
                out.append(reply)
            return out

        return self._streamed("GET", body, [None] * len(keys))

    def _get_into_cluster(
        self,
        keys: Sequence[str],
        alloc: Callable[[int], memoryview],
        on_value: Callable[[int, memoryview], None] | None,
        max_bytes: Sequence[int] | None,
    ) -> list[memoryview | OversizedValue | None]:
        """:meth:`get_into` through redis-py's cluster pipeline: values arrive as ``bytes`` and
        are copied into ``alloc``'d memory (the caller may write to and reuse it)."""
        fetched = self.get(keys) if max_bytes is None else self._get_bounded(keys, max_bytes)
        out: list[memoryview | OversizedValue | None] = []
        for idx, value in enumerate(fetched):
            if not isinstance(value, bytes):
                out.append(value)
                continue
            buffer = alloc(len(value))
            buffer[:] = value
            if on_value is not None:
                on_value(idx, buffer)
            out.append(buffer)
        return out

    def _get_bounded(
        self, keys: Sequence[str], max_bytes: Sequence[int]
    ) -> list[bytes | OversizedValue | None]:
        """Values of ``keys`` (one round trip per node), none read past ``max_bytes[i] + 1``
        bytes: GETRANGE stops there, and EXISTS tells a missing key from an empty value."""

        def run(pipe: Any, batch: Sequence[str]) -> None:
            for key, limit in zip(batch, max_bytes, strict=True):
                pipe.exists(key)
                pipe.getrange(key, 0, limit)  # one byte past the bound shows it is over

        def collect(
            replies: list[Any], batch: Sequence[str]
        ) -> list[bytes | OversizedValue | None]:
            out: list[bytes | OversizedValue | None] = []
            for limit, there, value in zip(max_bytes, replies[::2], replies[1::2], strict=True):
                refused = [self._refusal("EXISTS", there), self._refusal("GETRANGE", value)]
                if any(refused) or not there:
                    out.append(None)
                elif len(value) > limit:
                    out.append(OversizedValue(len(value)))
                else:
                    out.append(value)
            return out

        return self._guarded("GET", keys, run, collect, default=None)

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
            return sum(0 if self._refusal("UNLINK", n) else int(n) for n in replies)

        return self._guard("UNLINK", unlink, 0)

    # ------------------------------------------------------------------ metadata

    def write_info(self, info_key: str, fields: Mapping[str, str]) -> bool:
        """Record a namespace's fingerprint fields (idempotent). False only if Redis is
        unavailable; a refusal (an ACL without HSET, a full Redis) is counted and logged by
        the store, and True says that Redis answered."""

        def hset() -> bool:
            self._count_round_trip()
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(info_key, mapping=dict(fields))  # type: ignore[arg-type]
            self._refusal("HSET", pipe.execute(raise_on_error=False)[0])
            return True

        return self._guard("HSET", hset, False)

    def read_hash(self, key: str) -> dict[str, str]:
        raw = self.client.hgetall(key)
        return {_text(k): _text(v) for k, v in raw.items()}

    def flush_counters(self) -> None:
        """Deliver pending counter deltas now (one round trip); kept for later if Redis fails
        (dropped if Redis refuses them: they would be refused again)."""
        pending = self.counters.take() if self.stats_key is not None else {}
        if not pending:
            return

        def deliver() -> bool:
            self._count_round_trip()
            pipe = self.client.pipeline(transaction=False)
            self._append_counters(pipe, pending)
            self._check_counter_replies(pipe.execute(raise_on_error=False))
            return True

        if not self._guard("HINCRBY", deliver, False):
            self.counters.restore(pending)

    def _append_counters(self, pipe: Any, pending: Mapping[str, int]) -> None:
        for name, delta in pending.items():
            pipe.hincrby(self.stats_key, name, delta)

    def _check_counter_replies(self, replies: Sequence[Any]) -> None:
        """Counter increments that rode along: an outage raises; a refusal is logged, not
        counted (counting it would make the next round trip carry a counter to refuse)."""
        for reply in replies:
            self._refusal("HINCRBY", reply, count=False)

    # ------------------------------------------------------------------ the guard

    def _guard(self, command: str, call: Callable[[], _T], default: _T) -> _T:
        """Run ``call`` (one Redis round trip) under the breaker; every Redis call goes here.

        While the breaker is open ``default`` at once, except for one probe per interval. An
        outage (see :func:`~hma_redis.breaker.classify`) opens the breaker and yields
        ``default``. A refusal raised by the whole call (NOPERM, OOM, READONLY, another error
        reply) yields ``default`` too but proves the server answers: it is counted and logged
        (rate-limited) and the breaker stays (or becomes) closed. Exceptions that are not
        Redis errors (a caller's bug, a failed allocation) propagate.
        """
        if not self.breaker.allow():
            return default
        try:
            out = call()
        except (RedisError, OSError) as exc:
            if classify(exc) is ErrorKind.OUTAGE:
                self.breaker.record_failure(exc)
                return default
            self._refused(command, exc, count=True)
            out = default
        self.breaker.record_success()
        return out

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

    def _streamed(self, command: str, body: Callable[[Any, _RawReplies], _T], default: _T) -> _T:
        """Run ``body`` on one connection of the bulk pool, replies read by :class:`_RawReplies`,
        under :meth:`_guard` (an outage opens the breaker and yields ``default``)."""
        return self._guard(command, lambda: self._on_bulk_connection(body), default)

    def _on_bulk_connection(self, body: Callable[[Any, _RawReplies], _T]) -> _T:
        """Pending counter deltas go first on the same connection (same round trip). Any
        exception resets the connection (it may stop inside a reply) and propagates."""
        self._count_round_trip()
        assert isinstance(self._bulk, redis.Redis)
        pool = self._bulk.connection_pool
        pending = self.counters.take() if self.stats_key is not None else {}
        replies: _RawReplies | None = None
        conn = None
        try:
            conn = pool.get_connection()
            replies = _RawReplies(
                conn, skip=len(pending), on_skipped=lambda r: self._check_counter_replies([r])
            )
            if pending:
                counters = [("HINCRBY", self.stats_key, n, d) for n, d in pending.items()]
                conn.send_packed_command(conn.pack_commands(counters), check_health=False)
            return body(conn, replies)
        except BaseException:
            if conn is not None:
                conn.disconnect()
            if replies is None or replies.skip:
                self.counters.restore(pending)
            raise
        finally:
            if conn is not None:
                pool.release(conn)

    def _guarded(
        self,
        command: str,
        keys: Sequence[str],
        run: Callable[[Any, Sequence[str]], None],
        collect: Callable[[list[Any], Sequence[str]], list[_T]],
        default: _T,
        client: redis.Redis | RedisCluster | None = None,
    ) -> list[_T]:
        """Run ``run`` on one pipeline (cluster: one per node) and map replies back to ``keys``,
        under :meth:`_guard` (an outage yields ``default`` for every key)."""
        return self._guard(
            command,
            lambda: self._execute(client or self.client, keys, run, collect),
            [default] * len(keys),
        )

    def _execute(
        self,
        client: redis.Redis | RedisCluster,
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
        client: redis.Redis | RedisCluster,
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


def _send_all(sock: Any, parts: Sequence[memoryview]) -> None:
    """Send ``parts`` back to back: ``sendmsg`` (scatter-gather, no joining) where the socket
    has it, TLS piece by piece."""
    if sock is None:
        raise RedisConnectionError("connection closed")
    if isinstance(sock, ssl.SSLSocket):
        for part in parts:
            sock.sendall(part)
        return
    pending = [part for part in parts if part.nbytes]  # sendmsg of only empty parts sends 0
    first = 0
    while first < len(pending):
        sent = sock.sendmsg(pending[first : first + _IOV_MAX])
        while sent:
            size = pending[first].nbytes
            if sent < size:
                pending[first] = pending[first][sent:]
                break
            sent -= size
            first += 1


def _no_bulk(nbytes: int) -> memoryview:
    raise InvalidResponse(f"unexpected {nbytes}-byte bulk reply")


class _RawReplies:
    """Replies to GET, SET and HINCRBY (RESP2 or RESP3) read from a redis-py connection's
    socket, bypassing its parser.

    A bulk string is received by ``recv_into`` straight into the caller's buffer; reply lines
    are read in small pieces, so little of a body passes through Python ``bytes``. The first
    ``skip`` replies (counter increments sent ahead) are read and handed to ``on_skipped``.
    """

    def __init__(
        self, conn: Any, skip: int = 0, on_skipped: Callable[[Any], None] | None = None
    ) -> None:
        self._conn = conn
        self._buf = b""
        self.skip = skip
        self._on_skipped = on_skipped

    def _recv(self) -> bytes:
        sock = self._conn._sock
        if sock is None:
            raise RedisConnectionError("connection closed")
        chunk: bytes = sock.recv(_LINE_READ)
        if not chunk:
            raise RedisConnectionError("Connection closed by server")
        return chunk

    def read(
        self, alloc: Callable[[int], memoryview], max_bytes: int | None = None
    ) -> memoryview | bytes | ResponseError | OversizedValue | None:
        """The next reply: a bulk string (in ``alloc``'d memory), a line, an error or None.
        A bulk string longer than ``max_bytes`` is received in bounded pieces and dropped
        (:class:`OversizedValue`): ``alloc`` is never asked for it."""
        while self.skip:
            skipped = self._read(_no_bulk, None)
            self.skip -= 1
            if self._on_skipped is not None:
                self._on_skipped(skipped)
        return self._read(alloc, max_bytes)

    def _read(
        self, alloc: Callable[[int], memoryview], max_bytes: int | None
    ) -> memoryview | bytes | ResponseError | OversizedValue | None:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._buf += self._recv()
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return ResponseError(rest.decode(errors="replace"))
        if kind in (b"+", b":"):
            return rest
        if kind == b"_":  # RESP3 null (redis-py 8 negotiates RESP3 where the server has it)
            return None
        if kind != b"$":
            raise InvalidResponse(f"unexpected reply {line[:40]!r}")
        try:
            nbytes = int(rest)
        except ValueError:
            raise InvalidResponse(f"bad bulk length {line[:40]!r}") from None
        if nbytes < 0:
            return None
        out: memoryview | OversizedValue
        if max_bytes is not None and nbytes > max_bytes:
            out = OversizedValue(nbytes)
            self._drop(nbytes)
        else:
            out = alloc(nbytes)
            self._receive(nbytes, out)
        while len(self._buf) < 2:
            self._buf += self._recv()
        if self._buf[:2] != b"\r\n":
            raise InvalidResponse("bulk string not terminated by CRLF")
        self._buf = self._buf[2:]
        return out

    def _receive(self, nbytes: int, into: memoryview) -> None:
        """The next ``nbytes`` of the stream, into ``into``."""
        have = min(nbytes, len(self._buf))
        into[:have] = memoryview(self._buf)[:have]
        self._buf = self._buf[have:]
        while have < nbytes:
            have += self._recv_into(into[have:], nbytes - have)

    def _drop(self, nbytes: int) -> None:
        """Skip the next ``nbytes`` of the stream, received into a scratch buffer of at most
        ``_DISCARD_PIECE`` bytes: a value too long to accept is never held whole."""
        have = min(nbytes, len(self._buf))
        self._buf = self._buf[have:]
        scratch = memoryview(bytearray(min(_DISCARD_PIECE, nbytes - have)))
        while have < nbytes:
            have += self._recv_into(scratch, min(nbytes - have, scratch.nbytes))

    def _recv_into(self, target: memoryview, nbytes: int) -> int:
        got: int = self._conn._sock.recv_into(target, nbytes)
        if not got:
            raise RedisConnectionError("Connection closed by server")
        return got


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def chunked(items: Sequence[_T], size: int) -> Iterable[Sequence[_T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
