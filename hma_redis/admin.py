"""RedisAdmin: the Redis commands behind the ``hma-redis`` CLI (inspection and cleanup).

Built on :class:`~hma_redis.store.RedisBlockStore`'s client, so it connects exactly as the tier
does (timeouts, credentials, TLS). Unlike the store it does not degrade: every Redis failure
raises ``redis.RedisError`` for the CLI to report. It only ever iterates with ``SCAN`` (never
``KEYS``), pipelines per-key commands in batches, and deletes only keys under the configured
prefix. One Redis node: a cluster-mode server is reported by ``hma-redis doctor``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis
from redis.exceptions import ResponseError

from hma_redis.config import RedisTierConfig
from hma_redis.keys import parse_block_key
from hma_redis.store import RedisBlockStore

# Keys per pipelined batch (SCAN COUNT hint, per-key commands, UNLINK arguments): large enough
# to amortise round trips, small enough that no single command blocks Redis noticeably.
BATCH = 500
_GLOB_SPECIALS = "\\*?[]"
# A script with a shebang flags line, as the lookup path sends (needs Redis >= 7.0).
_FLAGS_PROBE = "#!lua flags=no-writes\nreturn 1\n"


@dataclass(frozen=True)
class KeyEntry:
    """One key as ``ls`` shows it."""

    key: str
    type: str  # "string", "hash", ...
    value_bytes: int | None  # STRLEN; None for non-strings
    memory_bytes: int | None  # MEMORY USAGE; None where the server refuses the command
    ttl_s: int | None  # None: no expiry


class KeyPage(NamedTuple):
    """One page of a SCAN: the keys found and the cursor to continue from (0: done)."""

    entries: list[KeyEntry]
    cursor: int


@dataclass
class GroupUsage:
    """What one KV group of a namespace holds."""

    keys: int = 0
    value_bytes: int = 0
    memory_bytes: int = 0

    def add(self, entry: KeyEntry) -> None:
        self.keys += 1
        self.value_bytes += entry.value_bytes or 0
        self.memory_bytes += entry.memory_bytes or 0


@dataclass
class NamespaceUsage:
    """Everything under ``<prefix>:<namespace>:``."""

    namespace: str
    info: dict[str, str] = field(default_factory=dict)  # the fingerprint; empty if missing
    stats: dict[str, str] = field(default_factory=dict)  # counters; empty if never written
    groups: dict[int, GroupUsage] = field(default_factory=dict)
    other_keys: int = 0  # keys that are neither blocks, info nor stats

    @property
    def total(self) -> GroupUsage:
        total = GroupUsage()
        for group in self.groups.values():
            total.keys += group.keys
            total.value_bytes += group.value_bytes
            total.memory_bytes += group.memory_bytes
        return total


@dataclass
class PrefixUsage:
    """The result of one pass over every key under the prefix."""

    namespaces: dict[str, NamespaceUsage]
    unrecognized_keys: int  # keys under the prefix that are not ``<prefix>:<ns>:...``


class RedisAdmin:
    """Read and clean up what hma_redis keeps under ``cfg.key_prefix`` on one Redis server."""

    def __init__(self, cfg: RedisTierConfig, store: RedisBlockStore | None = None) -> None:
        self.cfg = cfg
        self.store = store if store is not None else RedisBlockStore(cfg)
        client = self.store.client
        if not isinstance(client, redis.Redis):
            raise ValueError(
                "hma_redis: the hma-redis CLI works on one Redis node; for a Redis Cluster run it "
                "once per master with redis://host:port"
            )
        self.client: redis.Redis = client
        self.prefix = cfg.key_prefix

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ patterns

    def pattern(self, namespace: str | None = None, group: int | None = None) -> str:
        """A SCAN MATCH pattern under the prefix: everything, one namespace, one group."""
        base = glob_escape(self.prefix)
        ns = "*" if namespace is None else glob_escape(namespace)
        if group is not None:
            return f"{base}:{ns}:g{group}:*"
        return f"{base}:*" if namespace is None else f"{base}:{ns}:*"

    # ------------------------------------------------------------------ server

    def ping_seconds(self, count: int = 5) -> list[float]:
        """Round-trip times of ``count`` PINGs (the first opens the connection and is excluded)."""
        self.client.ping()
        times = []
        for _ in range(count):
            start = time.perf_counter()
            self.client.ping()
            times.append(time.perf_counter() - start)
        return times

    def info(self, section: str) -> dict[str, Any]:
        """``INFO <section>`` as redis-py parses it."""
        return dict(self.client.info(section))

    def config_get(self, name: str) -> str | None:
        """``CONFIG GET name``; None when the server refuses CONFIG (managed services, ACLs)."""
        try:
            reply = self.client.config_get(name)
        except ResponseError:
            return None
        value = reply.get(name)
        return None if value is None else _text(value)

    def probe_script_flags(self) -> None:
        """Run a ``#!lua flags=`` script as lookups do; raises ``ResponseError`` if refused."""
        self.client.eval(_FLAGS_PROBE, 0)

    # ------------------------------------------------------------------ reading keys

    def scan(self, pattern: str, count: int = BATCH) -> Iterator[list[bytes]]:
        """All keys matching ``pattern``, one SCAN reply at a time (never KEYS).

        SCAN's guarantee: every key present for the whole iteration is returned; a key may be
        returned twice while Redis resizes its table, so counts are exact only when idle.
        """
        cursor = 0
        while True:
            cursor, keys = self.client.scan(cursor=cursor, match=pattern, count=count)
            if keys:
                yield [_as_bytes(k) for k in keys]
            if int(cursor) == 0:
                return

    def page(self, pattern: str, cursor: int = 0, limit: int = 50) -> KeyPage:
        """Keys matching ``pattern`` from ``cursor`` on, with size and TTL, until at least
        ``limit`` were found or the scan ended.

        A page may hold a few more than ``limit`` keys: SCAN returns whole buckets, and cutting
        one would lose the rest, since a cursor cannot point inside a reply.
        """
        found: list[bytes] = []
        while True:
            cursor, keys = self.client.scan(cursor=cursor, match=pattern, count=limit)
            cursor = int(cursor)
            found.extend(_as_bytes(k) for k in keys)
            if cursor == 0 or len(found) >= limit:
                return KeyPage(self.describe(found), cursor)

    def describe(self, keys: Sequence[bytes | str]) -> list[KeyEntry]:
        """TYPE, STRLEN, MEMORY USAGE and TTL of ``keys``, pipelined; vanished keys are left out."""
        out: list[KeyEntry] = []
        for start in range(0, len(keys), BATCH):
            batch = keys[start : start + BATCH]
            pipe = self.client.pipeline(transaction=False)
            for key in batch:
                pipe.type(key)
                pipe.strlen(key)
                pipe.memory_usage(key)
                pipe.ttl(key)
            replies = pipe.execute(raise_on_error=False)
            for i, key in enumerate(batch):
                kind, strlen, memory, ttl = replies[4 * i : 4 * i + 4]
                _raise_unless_response_error(kind, strlen, memory, ttl)
                kind_text = _text(kind) if isinstance(kind, bytes | str) else "none"
                if kind_text == "none":
                    continue  # deleted or expired since SCAN returned it
                out.append(
                    KeyEntry(
                        key=_text(key),
                        type=kind_text,
                        value_bytes=strlen if kind_text == "string" else None,
                        memory_bytes=memory if isinstance(memory, int) else None,
                        ttl_s=ttl if isinstance(ttl, int) and ttl >= 0 else None,
                    )
                )
        return out

    def get(self, key: str) -> bytes | None:
        """The value of a string key; None if missing. Raises ``ResponseError`` for other types."""
        value = self.client.get(key)
        return None if value is None else _as_bytes(value)

    def key_type(self, key: str) -> str:
        return _text(self.client.type(key))

    def ttl(self, key: str) -> int | None:
        ttl = int(self.client.ttl(key))
        return ttl if ttl >= 0 else None

    def read_hash(self, key: str) -> dict[str, str]:
        return self.store.read_hash(key)

    def usage(self) -> PrefixUsage:
        """One SCAN over the whole prefix: per namespace its info, stats and per-group sizes.

        Namespaces are found from every key, not only from ``info`` hashes, so one whose info
        hash was evicted still shows up (with an empty fingerprint).
        """
        namespaces: dict[str, NamespaceUsage] = {}
        unrecognized = 0
        hashes: list[tuple[str, str, str]] = []  # (namespace, "info" | "stats", key)
        for keys in self.scan(self.pattern()):
            for entry in self.describe(keys):
                parts = entry.key.split(":")
                if len(parts) < 3 or parts[0] != self.prefix:
                    unrecognized += 1
                    continue
                ns = namespaces.setdefault(parts[1], NamespaceUsage(parts[1]))
                block = parse_block_key(entry.key)
                if block is not None and entry.type == "string":
                    ns.groups.setdefault(block.group, GroupUsage()).add(entry)
                elif len(parts) == 3 and parts[2] in ("info", "stats") and entry.type == "hash":
                    hashes.append((parts[1], parts[2], entry.key))
                else:
                    ns.other_keys += 1
        for ns_name, kind, key in hashes:
            setattr(namespaces[ns_name], kind, self.read_hash(key))
        ordered = dict(sorted(namespaces.items()))
        return PrefixUsage(ordered, unrecognized)

    # ------------------------------------------------------------------ deleting keys

    def purge(self, namespace: str | None, dry_run: bool = False) -> int:
        """UNLINK every key of ``namespace`` (None: every key under the prefix), in batches.

        Returns how many keys were unlinked (with ``dry_run``: how many match). Keys written
        while it runs may survive; a repeated purge catches them.
        """
        pattern = self.pattern(namespace)
        owned = f"{self.prefix}:".encode()
        count = 0
        for keys in self.scan(pattern):
            # Defence in depth: the pattern already confines SCAN to the prefix.
            mine = [k for k in keys if k.startswith(owned)]
            if dry_run:
                count += len(mine)
                continue
            for start in range(0, len(mine), BATCH):
                count += int(self.client.unlink(*mine[start : start + BATCH]))
        return count


def glob_escape(text: str) -> str:
    """``text`` as a literal inside a SCAN MATCH pattern."""
    return "".join(f"\\{c}" if c in _GLOB_SPECIALS else c for c in text)


def _text(value: bytes | str) -> str:
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else value


def _as_bytes(value: bytes | str) -> bytes:
    # The client is built without decode_responses, so replies are bytes; str keeps mypy honest.
    return value if isinstance(value, bytes) else value.encode()


def _raise_unless_response_error(*replies: object) -> None:
    """Per-key command errors (WRONGTYPE, MEMORY refused) are expected; anything else is not."""
    for reply in replies:
        if isinstance(reply, Exception) and not isinstance(reply, ResponseError):
            raise reply
