"""RedisBlockStore: the only place that speaks Redis commands.

Every operation is one pipelined round trip (per node, on a cluster), bounded by the configured
timeouts, guarded by a circuit breaker, and safe to call from many threads at once. Operations
that can degrade do: existence checks become misses, puts become FAILED, gets become ``None``.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any, TypeVar

import redis
from redis._parsers.encoders import Encoder
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import PythonRespSerializer
from redis.crc import key_slot
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from hma_redis.breaker import CircuitBreaker
from hma_redis.config import RedisTierConfig, endpoint_url

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

_T = TypeVar("_T")


class PutResult(Enum):
    STORED = "stored"  # newly written by this call
    EXISTED = "existed"  # already there (content-addressed: same bytes)
    FAILED = "failed"  # not written (Redis down, OOM, timeout, ...)


class RedisUnavailableError(ConnectionError):
    """Redis could not be reached at start-up (message carries the redacted URL)."""


def make_client(cfg: RedisTierConfig, zero_copy: bool = False) -> redis.Redis:
    """A redis-py client with bounded timeouts and no hidden retries.

    With ``zero_copy``, commands are packed by redis-py's pure-Python packer, which sends large
    values (memoryviews) as their own chunks, so a value is never copied on send; the default
    hiredis packer copies every argument into one buffer but packs many small arguments (a
    lookup's keys) much faster. Replies are parsed by hiredis either way.
    """
    kwargs: dict[str, Any] = {
        "username": cfg.username,
        "password": cfg.password,
        "db": cfg.db,
        "socket_timeout": cfg.read_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        "command_packer": PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode),
    }
    if cfg.tls:
        kwargs.update(
            ssl_ca_certs=cfg.tls_ca_file,
            ssl_certfile=cfg.tls_cert_file,
            ssl_keyfile=cfg.tls_key_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_verify else ssl.CERT_NONE,
            ssl_check_hostname=cfg.tls_verify,
        )
    pool = redis.BlockingConnectionPool.from_url(
        endpoint_url(cfg.url),
        max_connections=cfg.pool_size,
        timeout=cfg.connect_timeout_s + cfg.read_timeout_s,
        **kwargs,
    )
    return redis.Redis(connection_pool=pool)


class RedisBlockStore:
    """Batched, degradable access to block values and namespace metadata.

    Thread safe: redis-py's pool hands each call its own connection, and the breaker is locked.
    """

    def __init__(self, cfg: RedisTierConfig, client: redis.Redis | RedisCluster | None = None):
        self.cfg = cfg
        self.client = client if client is not None else make_client(cfg)
        # Values go through their own pool whose packer never copies them.
        self._bulk = self.client if client is not None else make_client(cfg, zero_copy=True)
        self.breaker = CircuitBreaker(cfg.redacted_url, cfg.retry_interval_s)
        self._is_cluster = isinstance(self.client, RedisCluster)
        self._stats_lock = threading.Lock()
        self.round_trips = 0

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
            for start in range(0, len(batch), _EXISTS_BATCH):
                part = batch[start : start + _EXISTS_BATCH]
                pipe.eval(_EXISTS_SCRIPT, len(part), *part)

        def collect(replies: list[Any], batch: Sequence[str]) -> list[bool]:
            flags: list[bool] = []
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
                flags.extend(bool(v) for v in reply)
            return flags

        result = self._guarded(keys, run, collect, default=False, by_slot=True)
        return result

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
            out: list[PutResult] = []
            for reply in replies:
                if isinstance(reply, ResponseError):
                    # e.g. OOM under maxmemory + noeviction: this key is not stored.
                    logger.debug("hma_redis: SET refused: %s", reply)
                    out.append(PutResult.FAILED)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    out.append(PutResult.STORED if reply else PutResult.EXISTED)
            return out

        return self._guarded(keys, run, collect, default=PutResult.FAILED, client=self._bulk)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` in one round trip (per node); ``None`` for missing or on failure."""
        if not keys:
            return []

        def run(pipe: Any, batch: Sequence[str]) -> None:
            for key in batch:
                pipe.get(key)

        def collect(replies: list[Any], batch: Sequence[str]) -> list[bytes | None]:
            out: list[bytes | None] = []
            for reply in replies:
                if isinstance(reply, ResponseError):
                    out.append(None)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    out.append(reply)
            return out

        return self._guarded(keys, run, collect, default=None)

    def delete(self, keys: Sequence[str]) -> int:
        """UNLINK ``keys`` (used to drop values that failed validation); 0 if Redis fails."""
        if not keys or not self.breaker.allow():
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.unlink(key)
            removed = sum(int(n) for n in pipe.execute())
        except RedisError as exc:
            self.breaker.record_failure(exc)
            return 0
        self.breaker.record_success()
        return removed

    # ------------------------------------------------------------------ metadata

    def write_info(self, info_key: str, fields: Mapping[str, str]) -> bool:
        """Record a namespace's fingerprint fields (idempotent). False if Redis is unavailable."""
        if not self.breaker.allow():
            return False
        try:
            self.client.hset(info_key, mapping=dict(fields))  # type: ignore[arg-type]
        except RedisError as exc:
            self.breaker.record_failure(exc)
            return False
        self.breaker.record_success()
        return True

    def read_hash(self, key: str) -> dict[str, str]:
        raw = self.client.hgetall(key)
        return {_text(k): _text(v) for k, v in raw.items()}

    def add_counters(self, key: str, deltas: Mapping[str, int]) -> None:
        """HINCRBY a batch of counters in one round trip; silently skipped while Redis is down."""
        deltas = {k: v for k, v in deltas.items() if v}
        if not deltas or not self.breaker.allow():
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, delta in deltas.items():
                pipe.hincrby(key, name, delta)
            pipe.execute()
        except RedisError as exc:
            self.breaker.record_failure(exc)
            return
        self.breaker.record_success()

    # ------------------------------------------------------------------ internals

    def _guarded(
        self,
        keys: Sequence[str],
        run: Callable[[Any, Sequence[str]], None],
        collect: Callable[[list[Any], Sequence[str]], list[_T]],
        default: _T,
        by_slot: bool = False,
        client: redis.Redis | RedisCluster | None = None,
    ) -> list[_T]:
        """Run ``run`` on one pipeline (cluster: one per node) and map replies back to ``keys``.

        Any connection error or timeout opens the breaker and yields ``default`` for every key.
        """
        if not self.breaker.allow():
            return [default] * len(keys)
        try:
            out = self._execute(client or self.client, keys, run, collect, by_slot)
        except RedisError as exc:
            self.breaker.record_failure(exc)
            return [default] * len(keys)
        self.breaker.record_success()
        return out

    def _execute(
        self,
        client: redis.Redis | RedisCluster,
        keys: Sequence[str],
        run: Callable[[Any, Sequence[str]], None],
        collect: Callable[[list[Any], Sequence[str]], list[_T]],
        by_slot: bool,
    ) -> list[_T]:
        with self._stats_lock:
            self.round_trips += 1
        if not self._is_cluster:
            pipe = client.pipeline(transaction=False)
            run(pipe, keys)
            return collect(pipe.execute(raise_on_error=False), keys)
        # Cluster: a script may only touch keys of one slot, so group by slot; redis-py's
        # cluster pipeline then sends one batch per node.
        groups: dict[int, list[int]] = defaultdict(list)
        for idx, key in enumerate(keys):
            groups[key_slot(key.encode()) if by_slot else 0].append(idx)
        pipe = client.pipeline()
        order: list[tuple[list[int], int]] = []
        for indices in groups.values():
            batch = [keys[i] for i in indices]
            before = len(pipe.command_stack)
            run(pipe, batch)
            order.append((indices, len(pipe.command_stack) - before))
        replies = pipe.execute(raise_on_error=False)
        out: list[Any] = [None] * len(keys)
        pos = 0
        for indices, count in order:
            values = collect(replies[pos : pos + count], [keys[i] for i in indices])
            pos += count
            for i, value in zip(indices, values, strict=True):
                out[i] = value
        return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def chunked(items: Sequence[_T], size: int) -> Iterable[Sequence[_T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
