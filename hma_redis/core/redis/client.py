"""Building redis-py clients for the tier: one function for every deployment.

:func:`make_client` gives a client with bounded timeouts and no hidden retries for a standalone
server (``redis://``, ``rediss://``, ``unix://``), a Redis Cluster (``redis+cluster://``) or the
master that Sentinels name (``redis+sentinel://``). The few places where redis-py's own behaviour
had to change (a cluster pipeline's re-sends, a sentinel pool that follows a failover, a packer
that never copies values, connections that a call past its deadline gives up) are subclasses
here, so nothing else reaches into redis-py.

:func:`bounded` gives a call a deadline: redis-py bounds each socket wait by
``read_timeout_s``, not a whole call, so a server that sends a byte just before every timeout
kept a lookup alive for seconds. Every connection the call takes from a pool made here (its
handshake included) is shut down when the deadline passes; the call then fails with
``redis.TimeoutError``. A bounded call may also bound the bytes of each reply it reads
(``max_reply_bytes``): a longer reply fails as unreadable as it arrives, before more of it is
held.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import redis
from redis._parsers.encoders import Encoder
from redis._parsers.hiredis import _HiredisParser
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.connection import AbstractConnection, PythonRespSerializer
from redis.exceptions import InvalidResponse, RedisClusterException, RedisError, ResponseError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from hma_redis.core.config import EndpointKind, RedisTierConfig
from hma_redis.core.deadline import Deadline
from hma_redis.core.redis import reply_shapes

logger = logging.getLogger(__name__)

RedisClient = redis.Redis | RedisCluster

_CLIENT_NUMBERS = itertools.count(1)
# Linux' TCP_CONGESTION socket option (None where Python does not define it).
_TCP_CONGESTION: int | None = getattr(socket, "TCP_CONGESTION", None)


def new_client_name() -> str:
    """A fresh name for the connections of one client, or of one store's clients:
    ``hma_redis-<pid>-<n>``, the process id and the n-th name the process gave out.

    Redis shows it in ``CLIENT LIST`` (``name=``), so an operator sees which process holds
    which connections, and a test counts one store's connections among everyone else's.
    """
    return f"hma_redis-{os.getpid()}-{next(_CLIENT_NUMBERS)}"


def _set_name(connection: AbstractConnection, name: str) -> None:
    """``CLIENT SETNAME`` on a connection that just connected; a refusal (an ACL without
    ``CLIENT``, a proxy) leaves it unnamed rather than unusable."""
    connection.send_command("CLIENT", "SETNAME", name, check_health=False)
    try:
        reply = connection.read_response()
    except ResponseError as exc:
        logger.debug("hma_redis: CLIENT SETNAME refused (%s); the connection stays unnamed", exc)
        return
    # Anything but OK is not a Redis answering (and the stream may be off by a reply): the
    # connection fails, as one that could not connect.
    reply_shapes.is_ok("CLIENT SETNAME", reply)


_congestion_warned: set[str] = set()


def _set_congestion(connection: AbstractConnection, congestion: str) -> None:
    """The TCP congestion control ``congestion`` on a connection that just connected (TCP
    only; "" leaves the system's). One warning per name where the kernel refuses it (not
    built, or not in ``net.ipv4.tcp_allowed_congestion_control``); the connection serves
    all the same, on the system's."""
    if not congestion or _TCP_CONGESTION is None:
        return
    sock = raw_socket(connection)
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, congestion.encode())
    except OSError as exc:
        if congestion not in _congestion_warned:
            _congestion_warned.add(congestion)
            logger.warning(
                "hma_redis: tcp_congestion %r is not available here (%s); value connections "
                "keep the system's congestion control",
                congestion,
                exc.strerror or exc,
            )


def _named_connect(name: str, congestion: str = "") -> Callable[[AbstractConnection], None]:
    """redis-py's ``redis_connect_func`` for a plain or sentinel connection: the congestion
    control, its usual handshake (AUTH, SELECT, ...), then the name."""

    def connect(connection: AbstractConnection) -> None:
        _set_congestion(connection, congestion)
        # redis-py's handshake reads HELLO's map (and AUTH's status) without looking at its
        # shape: a reply of another one fails the connection, as an unreadable reply does.
        reply_shapes.parsed("HELLO", connection.on_connect)
        _set_name(connection, name)

    return connect


def _name_only(name: str, congestion: str = "") -> Callable[[AbstractConnection], None]:
    """The same for a cluster node's connection (``RedisCluster`` runs the handshake itself
    and then this)."""

    def connect(connection: AbstractConnection) -> None:
        _set_congestion(connection, congestion)
        _set_name(connection, name)

    return connect


def make_client(
    cfg: RedisTierConfig,
    zero_copy: bool = False,
    max_connections: int | None = None,
    client_name: str | None = None,
    congestion: str = "",
) -> RedisClient:
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

    ``max_connections`` (per node) replaces ``cfg.pool_size`` when larger: the transfer
    engine's jobs may each hold several connections (``connections_per_job``).

    Every connection it opens (data nodes, sentinels, pub/sub) is named ``client_name``
    (default: :func:`new_client_name`) with ``CLIENT SETNAME``. A data node's TCP connections
    run the congestion control ``congestion`` ("": the system's).
    """
    name = client_name or new_client_name()
    kwargs: dict[str, Any] = {
        "username": cfg.username,
        "password": cfg.password,
        "socket_timeout": cfg.read_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "health_check_interval": 0,
        **tls_options(cfg),
    }
    # Wait (bounded) for a free connection rather than fail when all are busy.
    pool_kwargs = {
        "max_connections": max(cfg.pool_size, max_connections or 0),
        "timeout": cfg.connect_timeout_s + cfg.read_timeout_s,
    }
    topo = cfg.endpoint
    if topo.kind is EndpointKind.CLUSTER:
        kwargs["redis_connect_func"] = _name_only(name, congestion)
        return _cluster_client(cfg, kwargs, pool_kwargs, zero_copy)
    kwargs["redis_connect_func"] = _named_connect(name, congestion)
    if zero_copy:
        kwargs["command_packer"] = _zero_copy_packer()
    if topo.kind is EndpointKind.SENTINEL:
        return _sentinel_client(cfg, kwargs, pool_kwargs)
    pool = _BoundedPool.from_url(
        cfg.endpoint.address, db=cfg.db, retry=Retry(NoBackoff(), 0), **pool_kwargs, **kwargs
    )
    # The client owns its pool: close() disconnects the pool's connections.
    return redis.Redis.from_pool(pool)


def tls_options(cfg: RedisTierConfig) -> dict[str, Any]:
    """redis-py's ``ssl_*`` connection options for ``cfg``'s TLS files and verification; none
    without TLS."""
    if not cfg.tls:
        return {}
    return {
        "ssl_ca_certs": cfg.tls_ca_file,
        "ssl_certfile": cfg.tls_cert_file,
        "ssl_keyfile": cfg.tls_key_file,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if cfg.tls_verify else ssl.CERT_NONE,
        "ssl_check_hostname": cfg.tls_verify,
    }


def _zero_copy_packer() -> PythonRespSerializer:
    return PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


def _cluster_client(
    cfg: RedisTierConfig, kwargs: dict[str, Any], pool_kwargs: dict[str, Any], zero_copy: bool
) -> RedisCluster:
    """A :class:`_BoundedCluster` over the URL's startup nodes, with blocking per-node pools."""
    topo = cfg.endpoint
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
        connection_pool_class=_BoundedPool,
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
      Every entry point the tier uses (commands, pipelines, and the node lookups the native
      path and the removal watcher make) discovers it first, or raises
      ``redis.ConnectionError`` while no node answers.
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

    def get_node_from_key(self, key: Any, replica: bool = False) -> Any:
        self._ensure_ready()
        return super().get_node_from_key(key, replica)

    def get_redis_connection(self, node: ClusterNode) -> redis.Redis:
        self._ensure_ready()
        return super().get_redis_connection(node)

    def get_primaries(self) -> list[ClusterNode]:
        self._ensure_ready()
        return super().get_primaries()

    def get_nodes(self) -> list[ClusterNode]:
        self._ensure_ready()
        return super().get_nodes()

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
    topo = cfg.endpoint
    assert topo.service is not None
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": cfg.read_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        "redis_connect_func": kwargs["redis_connect_func"],
    }
    if cfg.tls:
        sentinel_kwargs.update(ssl=True, **tls_options(cfg))
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


# ---------------------------------------------------------------------------------- deadlines


class _Call:
    """One bounded call: the connections it has taken, shut down if it outlives its deadline,
    and the most bytes one reply it reads may take (None: no bound).

    The lock orders the watchdog against the calling thread: a connection is either given
    back before the deadline (untouched) or shut down and then, when given back, dropped, so
    a pooled connection is never shut down under its next user."""

    def __init__(self, deadline: Deadline, max_reply_bytes: int | None = None) -> None:
        self.deadline = deadline
        self.max_reply_bytes = max_reply_bytes
        self._lock = threading.Lock()
        self._connections: set[Any] = set()
        self.expired = False
        self._done = False

    def take(self, conn: Any) -> None:
        """``conn`` is about to be used (or connected) by the call. Past the deadline it is
        shut down, and one not connected yet is refused (``redis.TimeoutError``): the watchdog
        has already expired the call, so nothing would shut its new socket down."""
        with self._lock:
            if self._done:
                return
            self._connections.add(conn)
            if self.expired:
                _shut_down(conn)
                if conn._sock is None:
                    raise redis.TimeoutError("Redis did not finish the call within its deadline")

    def give_back(self, conn: Any) -> bool:
        """Forget ``conn``; whether it may have been shut down (so must be dropped)."""
        with self._lock:
            self._connections.discard(conn)
            return self.expired

    def expire(self) -> bool:
        """Shut down every connection of the call, unless it has ended; whether one of them
        was still connecting (no socket yet: the watchdog tries again shortly)."""
        with self._lock:
            if self._done:
                return False
            self.expired = True
            for conn in self._connections:
                _shut_down(conn)
            return any(conn._sock is None for conn in self._connections)

    def end(self) -> None:
        with self._lock:
            self._done = True


def raw_socket(conn: Any) -> socket.socket:
    """The socket of a connected redis-py connection (plain or TLS), for the data path's jobs,
    which read and write it directly between two replies. redis-py keeps it in a private
    attribute: this is the one place that knows."""
    sock = conn._sock
    if sock is None:
        raise redis.ConnectionError("hma_redis: the connection has no socket (not connected)")
    return cast(socket.socket, sock)


def _shut_down(conn: Any) -> None:
    """Wake whoever waits on ``conn``'s socket (recv returns EOF); the socket stays open for
    redis-py to close (closing it under a waiting thread could hand its fd to another)."""
    sock = conn._sock
    if sock is not None:
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Watchdog:
    """One daemon thread that expires calls at their deadlines."""

    _RETRY_S = 0.01  # a call whose connection was still connecting is expired again after this

    def __init__(self) -> None:
        self._start()
        # A forked child has no watchdog thread (nor the parent's calls): it starts its own.
        os.register_at_fork(after_in_child=self._start)

    def _start(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[tuple[float, int, _Call]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, call: _Call, at: float) -> None:
        with self._cond:
            heapq.heappush(self._queue, (at, next(self._order), call))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hma-deadlines", daemon=True)
                self._thread.start()
            if self._queue[0][2] is call:  # it expires first: the thread must wake earlier
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue or self._queue[0][0] > time.monotonic():
                    wait = self._queue[0][0] - time.monotonic() if self._queue else None
                    self._cond.wait(wait)
                _, _, call = heapq.heappop(self._queue)
            if call.expire():
                self.watch(call, time.monotonic() + self._RETRY_S)


_WATCHDOG = _Watchdog()
_current = threading.local()


@contextlib.contextmanager
def bounded(deadline: Deadline, max_reply_bytes: int | None = None) -> Iterator[None]:
    """Run the block as one call that must end by ``deadline``: connections it takes from the
    tier's pools are shut down then, and a Redis or socket error after that is raised as
    ``redis.TimeoutError``. Calls nest (the inner one's connections follow its deadline).

    With ``max_reply_bytes``, a reply (read on the calling thread from a connection of those
    pools) that has taken more than that many bytes and is not complete fails the call with
    ``redis.exceptions.InvalidResponse`` (an outage), having held at most one more receive."""
    call = _Call(deadline, max_reply_bytes)
    outer = getattr(_current, "call", None)
    _current.call = call
    _WATCHDOG.watch(call, deadline.at)
    try:
        yield
    except (RedisError, OSError) as exc:
        if call.expired:
            raise redis.TimeoutError("Redis did not finish the call within its deadline") from exc
        raise
    finally:
        call.end()
        _current.call = outer


class _ReplyBoundParser(_HiredisParser):
    """redis-py's hiredis parser, counting the bytes received for the reply being read: past
    the calling thread's bounded call's ``max_reply_bytes`` (see :func:`bounded`), an
    incomplete reply fails instead of being received further."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        self._reply_bytes = 0
        return super().read_response(*args, **kwargs)

    def read_from_socket(self, *args: Any, **kwargs: Any) -> Any:
        call = getattr(_current, "call", None)
        bound = call.max_reply_bytes if call is not None else None
        received = getattr(self, "_reply_bytes", 0)
        if bound is not None and received > bound:
            # Every byte of this read_response so far belongs to the reply still incomplete.
            raise InvalidResponse(f"a reply of more than {bound} bytes")
        reader = self._reader
        before = reader.len() if reader is not None else 0
        got = super().read_from_socket(*args, **kwargs)
        if reader is not None:  # hiredis appends what it is fed (it compacts only in gets)
            self._reply_bytes = received + reader.len() - before
        return got


class _BoundedPoolMixin:
    """Pool behaviour for :func:`bounded`: each connection joins the calling thread's bounded
    call when it connects (before its handshake) and leaves it when given back; its replies
    are read by :class:`_ReplyBoundParser` (where redis-py reads them with hiredis)."""

    def make_connection(self) -> Any:
        conn = super().make_connection()  # type: ignore[misc]
        if type(conn._parser) is _HiredisParser:
            conn.set_parser(_ReplyBoundParser)
        # Every use of a pooled connection goes through connect_check_health (a no-op once
        # connected): connect() calls it, and so does a send on a connection without a
        # socket (redis-py reconnects there without connect()); older releases have only
        # connect().
        name = "connect_check_health" if hasattr(conn, "connect_check_health") else "connect"
        connect = getattr(conn, name)

        def connect_within_call(*args: Any, **kwargs: Any) -> Any:
            call = getattr(_current, "call", None)
            if call is not None:
                call.take(conn)
            return connect(*args, **kwargs)

        setattr(conn, name, connect_within_call)
        return conn

    def release(self, connection: Any) -> None:
        call = getattr(_current, "call", None)
        if call is not None and call.give_back(connection):
            connection.disconnect()
        super().release(connection)  # type: ignore[misc]


class _BoundedPool(_BoundedPoolMixin, redis.BlockingConnectionPool):
    """A blocking pool whose connections follow :func:`bounded` calls."""


class _BlockingSentinelPool(
    _BoundedPoolMixin, SentinelConnectionPool, redis.BlockingConnectionPool
):
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


def warm_pool(client: RedisClient, connections: int) -> int:
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
