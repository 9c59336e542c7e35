"""RedisAdmin: the Redis commands behind the ``hma-redis`` CLI (inspection and cleanup).

It connects with the tier's own client (:func:`hma_redis.core.redis.client.make_client`: same
timeouts, credentials and TLS) and sees the deployment as the tier does:

* one server (``redis://``, ``rediss://``, ``unix://``): one node;
* Redis Cluster (``redis+cluster://``): every master of the cluster's slot map. Node-wide
  commands (SCAN, INFO, CONFIG, CLUSTER INFO, the UNLINK of keys SCAN found) run on each master
  through the cluster client's own connection to it; commands on one key go through the
  cluster client, which routes them by slot;
* Redis Sentinel (``redis+sentinel://``): the master the sentinels name.

A purge finishes on a cluster whose slots move under it (keys UNLINKed where MOVED / ASK
send them), and refuses to start on a Sentinel service whose sentinels name different masters.

Unlike the store it does not degrade: every Redis failure raises ``redis.RedisError`` for the
CLI to report. It only ever iterates with ``SCAN`` (never ``KEYS``), pipelines per-key commands
in batches, and deletes only keys under the configured prefix.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, NoPermissionError, RedisError, ResponseError, TryAgainError
from redis.sentinel import SentinelConnectionPool

from hma_redis.core.config import EndpointKind, RedisTierConfig
from hma_redis.core.keys import KeySpace, parse_block_key
from hma_redis.core.redis import pins as pin_set
from hma_redis.core.redis import quotas as quota_account
from hma_redis.core.redis.client import make_client
from hma_redis.core.redis.memory import MemoryRefused, NodeMemory, TierMemory, node_memory

# Keys per pipelined batch (SCAN COUNT hint, per-key commands, UNLINK arguments): large enough
# to amortise round trips, small enough that no single command blocks Redis noticeably.
BATCH = 500
CLUSTER_SLOTS = 16384
_GLOB_SPECIALS = "\\*?[]"
# A script with a shebang flags line, as the lookup path sends (needs Redis >= 7.0).
_FLAGS_PROBE = "#!lua flags=no-writes\nreturn 1\n"
# A cluster node's answers for keys of a slot that is moving or has moved (MOVED is an
# AskError): the keys live, or may live, on another node now.
_SLOT_MOVING = (AskError, TryAgainError)


class PurgeRefused(Exception):
    """A purge that could delete on the wrong server; raised before anything is deleted."""


@dataclass(frozen=True)
class KeyEntry:
    """One key as ``ls`` shows it."""

    key: str
    type: str  # "string", "hash", ...
    value_bytes: int | None  # STRLEN; None for non-strings
    memory_bytes: int | None  # MEMORY USAGE; None where the server refuses the command
    ttl_s: int | None  # None: no expiry
    node: str = ""  # the server holding it ("host:port")
    pinned_until: float | None = None  # a pin's deadline (unix seconds); None: not pinned


@dataclass(frozen=True)
class PinEntry:
    """One pinned chunk as ``pins`` shows it."""

    namespace: str
    key: str
    deadline: float  # unix seconds


class KeyPage(NamedTuple):
    """One page of a SCAN: the keys found and the cursor to continue from (0: done)."""

    entries: list[KeyEntry]
    cursor: int


@dataclass
class GroupUsage:
    """What one KV group of a namespace (or one node's share of it) holds."""

    keys: int = 0
    value_bytes: int = 0
    memory_bytes: int = 0

    def add(self, entry: KeyEntry) -> None:
        self.keys += 1
        self.value_bytes += entry.value_bytes or 0
        self.memory_bytes += entry.memory_bytes or 0

    def merge(self, other: GroupUsage) -> None:
        self.keys += other.keys
        self.value_bytes += other.value_bytes
        self.memory_bytes += other.memory_bytes


@dataclass
class NamespaceUsage:
    """Everything under ``<prefix>:<namespace>:``."""

    namespace: str
    info: dict[str, str] = field(default_factory=dict)  # the fingerprint; empty if missing
    stats: dict[str, str] = field(default_factory=dict)  # counters; empty if never written
    groups: dict[int, GroupUsage] = field(default_factory=dict)
    other_keys: int = 0  # keys that are neither blocks, info nor stats
    # Block keys per node ("host:port"), every group together.
    by_node: dict[str, GroupUsage] = field(default_factory=dict)

    @property
    def total(self) -> GroupUsage:
        total = GroupUsage()
        for group in self.groups.values():
            total.merge(group)
        return total

    def merge(self, other: NamespaceUsage) -> None:
        """Add another node's share of the same namespace."""
        self.info.update(other.info)
        self.stats.update(other.stats)
        for group, usage in other.groups.items():
            self.groups.setdefault(group, GroupUsage()).merge(usage)
        for node, usage in other.by_node.items():
            self.by_node.setdefault(node, GroupUsage()).merge(usage)
        self.other_keys += other.other_keys


@dataclass
class PrefixUsage:
    """The result of one pass over every key under the prefix, on every node."""

    namespaces: dict[str, NamespaceUsage]
    unrecognized_keys: int  # keys under the prefix that are not ``<prefix>:<ns>:...``
    nodes: list[str] = field(default_factory=list)  # the servers scanned, in cursor order


@dataclass(frozen=True)
class GroupOrphans:
    """A sample of one KV group's values, and those no lookup can use: the same chunk has no
    value in some other group, and vLLM loads a chunk only where every group has it (the
    intersection). Exact when the sample is every key of the group."""

    group: int
    sampled_keys: int
    sampled_bytes: int
    orphaned_keys: int
    orphaned_bytes: int

    @property
    def fraction(self) -> float:
        """The orphaned share of the sampled value bytes (0 when nothing was sampled)."""
        return self.orphaned_bytes / self.sampled_bytes if self.sampled_bytes else 0.0


@dataclass(frozen=True)
class PurgeResult:
    """How many keys a purge unlinked (or, dry, would unlink), in total and per node."""

    count: int
    by_node: dict[str, int]


@dataclass(frozen=True)
class SentinelAnswer:
    """What one sentinel says about the service: its master's address, or why it did not say."""

    sentinel: str  # "host:port"
    master: str | None  # "host:port"; None when it did not answer
    error: str | None = None


class NodeAdmin:
    """Node-wide commands on one Redis server: SCAN, INFO, CONFIG, UNLINK of what SCAN found.

    ``router``: the cluster client, when the server is a cluster master (where a multi-key
    command must keep to one hash slot, and a key may have moved to another master).
    """

    def __init__(
        self, name: str, client: redis.Redis, prefix: str, router: RedisCluster | None = None
    ) -> None:
        self.name = name
        self.client = client
        self.prefix = prefix
        self.router = router

    @property
    def in_cluster(self) -> bool:
        return self.router is not None

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

    def memory(self) -> NodeMemory:
        """This server's ``used_memory`` and ``maxmemory`` (``INFO memory``)."""
        return node_memory(self.name, self.info("memory"))

    def cluster_info(self) -> dict[str, str]:
        """``CLUSTER INFO`` of this node as text fields (``cluster_state``, ...)."""
        reply = self.client.execute_command("CLUSTER INFO")
        if isinstance(reply, Mapping):
            return {_text(k): _text(str(v)) for k, v in reply.items()}
        return _parse_info_text(_text(reply))

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

    def scan_once(self, pattern: str, cursor: int, count: int) -> tuple[int, list[bytes]]:
        """One ``SCAN cursor MATCH pattern COUNT count``: the next cursor and the keys."""
        next_cursor, keys = self.client.scan(cursor=cursor, match=pattern, count=count)
        return int(next_cursor), [_as_bytes(k) for k in keys]

    def scan(self, pattern: str, count: int = BATCH) -> Iterator[list[bytes]]:
        """All keys matching ``pattern`` on this node, one SCAN reply at a time (never KEYS).

        SCAN's guarantee: every key present for the whole iteration is returned; a key may be
        returned twice while Redis resizes its table, so counts are exact only when idle.
        """
        cursor = 0
        while True:
            cursor, keys = self.scan_once(pattern, cursor, count)
            if keys:
                yield keys
            if cursor == 0:
                return

    def sample(self, pattern: str, limit: int) -> list[KeyEntry]:
        """At least ``limit`` keys matching ``pattern`` (fewer only if there are no more), from
        the start of a SCAN, described."""
        found: list[bytes] = []
        cursor = 0
        while True:
            cursor, keys = self.scan_once(pattern, cursor, limit)
            found.extend(keys)
            if cursor == 0 or len(found) >= limit:
                return self.describe(found)

    def describe(self, keys: Sequence[bytes | str]) -> list[KeyEntry]:
        """TYPE, STRLEN, MEMORY USAGE and TTL of ``keys``, pipelined; vanished keys are left out
        (so are keys a cluster moved to another node since SCAN returned them)."""
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
                    continue  # deleted, expired or moved since SCAN returned it
                out.append(
                    KeyEntry(
                        key=_text(key),
                        type=kind_text,
                        value_bytes=strlen if kind_text == "string" else None,
                        memory_bytes=memory if isinstance(memory, int) else None,
                        ttl_s=ttl if isinstance(ttl, int) and ttl >= 0 else None,
                        node=self.name,
                    )
                )
        return out

    def read_hash(self, key: str) -> dict[str, str]:
        raw = self.client.hgetall(key)
        return {_text(k): _text(v) for k, v in raw.items()}

    def usage(self, pattern: str) -> PrefixUsage:
        """One SCAN over ``pattern`` on this node: per namespace its info, stats and sizes."""
        namespaces: dict[str, NamespaceUsage] = {}
        unrecognized = 0
        hashes: list[tuple[str, str, str]] = []  # (namespace, "info" | "stats", key)
        for keys in self.scan(pattern):
            for entry in self.describe(keys):
                parts = entry.key.split(":")
                if len(parts) < 3 or parts[0] != self.prefix:
                    unrecognized += 1
                    continue
                ns = namespaces.setdefault(parts[1], NamespaceUsage(parts[1]))
                block = parse_block_key(entry.key)
                if block is not None and entry.type == "string":
                    ns.groups.setdefault(block.group, GroupUsage()).add(entry)
                    ns.by_node.setdefault(self.name, GroupUsage()).add(entry)
                elif len(parts) == 3 and parts[2] in ("info", "stats") and entry.type == "hash":
                    hashes.append((parts[1], parts[2], entry.key))
                else:
                    ns.other_keys += 1
        for ns_name, kind, key in hashes:
            setattr(namespaces[ns_name], kind, self.read_hash(key))
        return PrefixUsage(namespaces, unrecognized, [self.name])

    # ------------------------------------------------------------------ deleting keys

    def purge(self, pattern: str, owned: bytes, dry_run: bool) -> int:
        """UNLINK every key matching ``pattern`` that starts with ``owned``, in batches.

        Returns how many keys were unlinked (with ``dry_run``: how many match).
        """
        count = 0
        for keys in self.scan(pattern):
            # Defence in depth: the pattern already confines SCAN to the prefix.
            mine = [k for k in keys if k.startswith(owned)]
            if dry_run:
                count += len(mine)
                continue
            for start in range(0, len(mine), BATCH):
                count += self._unlink(mine[start : start + BATCH])
        return count

    def _unlink(self, keys: Sequence[bytes]) -> int:
        if not self.in_cluster:
            return int(self.client.unlink(*keys))
        # A cluster refuses a multi-key command across hash slots (CROSSSLOT): one UNLINK per
        # slot, all in one pipeline.
        by_slot: dict[int, list[bytes]] = {}
        for key in keys:
            by_slot.setdefault(key_slot(key), []).append(key)
        pipe = self.client.pipeline(transaction=False)
        for same_slot in by_slot.values():
            pipe.unlink(*same_slot)
        count, moving = 0, []
        replies = pipe.execute(raise_on_error=False)
        for same_slot, reply in zip(by_slot.values(), replies, strict=True):
            if isinstance(reply, _SLOT_MOVING):
                moving += same_slot
            elif isinstance(reply, Exception):
                raise reply
            else:
                count += int(reply)
        return count + self._unlink_routed(moving)

    def _unlink_routed(self, keys: Sequence[bytes]) -> int:
        """UNLINK ``keys`` (of slots being migrated, or moved since SCAN found them here) one
        by one through the cluster client, which follows MOVED and ASK to the node that holds
        each key now and refreshes its slot table."""
        if not keys:
            return 0
        assert self.router is not None
        pipe = self.router.pipeline(transaction=False)
        for key in keys:
            pipe.unlink(key)
        return sum(int(n) for n in pipe.execute())


class NodeError(RedisError):
    """A Redis error on one named server (``node``: ``host:port``) of a Cluster or Sentinel
    deployment; ``cause`` is the error itself."""

    def __init__(self, node: str, cause: RedisError) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.node = node
        self.cause = cause


class RedisAdmin:
    """Read and clean up what hma_redis keeps under ``cfg.key_prefix``, on every node of the
    deployment ``cfg`` names.

    The nodes are found on first use (:meth:`nodes`), so building one never touches the network.
    """

    def __init__(self, cfg: RedisTierConfig) -> None:
        self.cfg = cfg
        self.prefix = cfg.key_prefix
        self.kind = cfg.endpoint.kind
        self.client: redis.Redis | RedisCluster = make_client(cfg)
        self._nodes: list[NodeAdmin] | None = None

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ topology

    def nodes(self) -> list[NodeAdmin]:
        """The servers holding data: the server, every cluster master (ordered by address), or
        the sentinels' master. Raises ``RedisError`` when they cannot be found."""
        if self._nodes is None:
            self._nodes = self._discover()
        return self._nodes

    def _discover(self) -> list[NodeAdmin]:
        client = self.client
        if isinstance(client, RedisCluster):
            if getattr(client, "nodes_manager", None) is None:
                # No startup node answered when the client was built: the first command tries
                # again to build the slot map, and raises if still none answers. (Once it is
                # built, a dead master must not hide the others: no command is needed.)
                client.ping()
            masters = sorted(client.get_primaries(), key=lambda n: (n.host, int(n.port)))
            return [
                NodeAdmin(
                    _address(n.host, n.port), client.get_redis_connection(n), self.prefix, client
                )
                for n in masters
            ]
        pool = client.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            host, port = pool.get_master_address()
            return [NodeAdmin(_address(host, port), client, self.prefix)]
        return [NodeAdmin(self._single_name(), client, self.prefix)]

    def _single_name(self) -> str:
        assert isinstance(self.client, redis.Redis)
        kwargs = self.client.connection_pool.connection_kwargs
        if "path" in kwargs:
            return f"unix:{kwargs['path']}"
        return _address(kwargs.get("host", "?"), kwargs.get("port", "?"))

    def is_one_cluster_master(self) -> bool:
        """True when a one-server URL (``redis://``) reaches a node in cluster mode: it holds
        one master's share only. False when not, or when INFO is not allowed to tell."""
        if self.kind is not EndpointKind.SINGLE:
            return False
        try:
            cluster = self.nodes()[0].info("cluster")
        except ResponseError:  # NOPERM under a narrow ACL: nothing to tell
            return False
        return bool(int(cluster.get("cluster_enabled", 0)))

    @contextmanager
    def on(self, node: NodeAdmin) -> Iterator[None]:
        """A Redis error in the block is :class:`NodeError` naming ``node`` (on a Cluster or
        under Sentinel; one server's errors are the URL's)."""
        try:
            yield
        except NodeError:
            raise
        except RedisError as exc:
            if self.kind is EndpointKind.SINGLE:
                raise
            raise NodeError(node.name, exc) from exc

    def deployment(self) -> str:
        """What the CLI talks to, in words: ``one server``, ``Redis Cluster, 3 masters``, ...;
        with ``, db N`` when the database is not 0 (``--db`` overrides the URL's)."""
        nodes = self.nodes()
        if self.kind is EndpointKind.CLUSTER:
            return f"Redis Cluster, {len(nodes)} master{'' if len(nodes) == 1 else 's'}"
        db = f", db {self.cfg.db}" if self.cfg.db else ""
        if self.kind is EndpointKind.SENTINEL:
            return f"Sentinel service {self.cfg.endpoint.service!r}, master {nodes[0].name}{db}"
        return f"one server{db}"

    def memory(self) -> TierMemory | MemoryRefused:
        """Every data node's used and max memory; :class:`MemoryRefused` when the ACL user may
        not run ``INFO`` (other errors raise, naming the node)."""
        nodes = []
        for node in self.nodes():
            with self.on(node):
                try:
                    nodes.append(node.memory())
                except NoPermissionError as exc:
                    return MemoryRefused(str(exc))
        return TierMemory(tuple(nodes))

    def sentinel_answers(self) -> list[SentinelAnswer]:
        """Each sentinel of the URL asked for the master of the service (Sentinel only)."""
        assert isinstance(self.client, redis.Redis)
        pool = self.client.connection_pool
        service = self.cfg.endpoint.service
        assert isinstance(pool, SentinelConnectionPool) and service is not None
        answers = []
        for sentinel in pool.sentinel_manager.sentinels:
            kwargs = sentinel.connection_pool.connection_kwargs
            name = _address(kwargs.get("host", "?"), kwargs.get("port", "?"))
            try:
                reply = sentinel.sentinel_get_master_addr_by_name(service)
            except redis.RedisError as exc:
                answers.append(SentinelAnswer(name, None, f"{type(exc).__name__}: {exc}"))
                continue
            if not reply:
                answers.append(SentinelAnswer(name, None, f"does not know {service!r}"))
                continue
            answers.append(SentinelAnswer(name, _address(_text(reply[0]), reply[1])))
        return answers

    # ------------------------------------------------------------------ patterns

    def pattern(self, namespace: str | None = None, group: int | None = None) -> str:
        """A SCAN MATCH pattern under the prefix: everything, one namespace, one group."""
        base = glob_escape(self.prefix)
        ns = "*" if namespace is None else glob_escape(namespace)
        if group is not None:
            return f"{base}:{ns}:g{group}:*"
        return f"{base}:*" if namespace is None else f"{base}:{ns}:*"

    # ------------------------------------------------------------------ reading keys

    def page(self, pattern: str, cursor: int = 0, limit: int = 50) -> KeyPage:
        """Keys matching ``pattern`` from ``cursor`` on, with size and TTL, until at least
        ``limit`` were found or the scan of every node ended.

        The cursor walks the nodes in :meth:`nodes` order: ``node_cursor * len(nodes) + index``
        (one server: Redis' own cursor). It is valid while the cluster keeps its masters. A page
        may hold a few more than ``limit`` keys: SCAN returns whole buckets, and cutting one
        would lose the rest, since a cursor cannot point inside a reply.
        """
        nodes = self.nodes()
        index, node_cursor = cursor % len(nodes), cursor // len(nodes)
        found: dict[int, list[bytes]] = {}
        total = 0
        while True:
            with self.on(nodes[index]):
                node_cursor, keys = nodes[index].scan_once(pattern, node_cursor, limit)
            found.setdefault(index, []).extend(keys)
            total += len(keys)
            if node_cursor == 0:
                index += 1
                if index == len(nodes):
                    return KeyPage(self._describe(nodes, found), 0)
            if total >= limit:
                return KeyPage(self._describe(nodes, found), node_cursor * len(nodes) + index)

    def _describe(self, nodes: list[NodeAdmin], found: Mapping[int, list[bytes]]) -> list[KeyEntry]:
        entries = []
        for idx, keys in found.items():
            with self.on(nodes[idx]):
                entries += nodes[idx].describe(keys)
        return self.with_pins(entries)

    def with_pins(self, entries: list[KeyEntry]) -> list[KeyEntry]:
        """``entries`` with the deadline of each pinned chunk (one ZMSCORE per namespace)."""
        by_ns: dict[str, list[int]] = {}
        for idx, entry in enumerate(entries):
            parts = parse_block_key(entry.key)
            if parts is not None and parts.prefix == self.prefix:
                by_ns.setdefault(parts.namespace, []).append(idx)
        out = list(entries)
        for namespace, positions in by_ns.items():
            pins_key = KeySpace(self.prefix, namespace).pins_key()
            try:
                scores = self.client.zmscore(pins_key, [entries[i].key for i in positions])
            except NoPermissionError:  # an ACL without ZMSCORE: the TTLs as they are
                return entries
            for idx, score in zip(positions, scores, strict=True):
                if score is not None:
                    out[idx] = dataclasses.replace(entries[idx], pinned_until=float(score))
        return out

    # ------------------------------------------------------------------ pins

    def pinned_namespaces(self, namespace: str | None = None) -> list[str]:
        """``namespace`` when it has pins, else every namespace under the prefix that has (one
        SCAN per node)."""
        if namespace is not None:
            return (
                [namespace]
                if self.client.exists(KeySpace(self.prefix, namespace).pins_key())
                else []
            )
        found: set[str] = set()
        for node in self.nodes():
            with self.on(node):
                for keys in node.scan(f"{glob_escape(self.prefix)}:*:pins"):
                    found.update(_text(k).split(":")[1] for k in keys if _text(k).count(":") == 2)
        return sorted(found)

    def pins(self, namespace: str | None = None) -> list[PinEntry]:
        """Every pinned chunk (of ``namespace``, or of every namespace), earliest deadline
        first within a namespace."""
        return [
            PinEntry(ns, key, deadline)
            for ns in self.pinned_namespaces(namespace)
            for key, deadline in pin_set.list_pins(
                self.client, KeySpace(self.prefix, ns).pins_key()
            )
        ]

    def pin_count(self, namespace: str) -> int:
        return int(self.client.zcard(KeySpace(self.prefix, namespace).pins_key()))

    def unpin(
        self, namespaces: Sequence[str], ttl_s: int, every: bool
    ) -> dict[str, pin_set.SweepResult]:
        """End the pins of ``namespaces`` (only those past their deadline unless ``every``):
        their chunks get ``ttl_s`` back and leave the pins set."""
        now = pin_set.EVERY_PIN if every else None
        return {
            ns: pin_set.sweep(self.client, KeySpace(self.prefix, ns).pins_key(), ttl_s, now=now)
            for ns in namespaces
        }

    # ------------------------------------------------------------------ quotas

    def quota_namespaces(self, namespace: str | None = None) -> list[str]:
        """``namespace``, else every namespace under the prefix with a tenants' account or
        budgets (one SCAN per node)."""
        if namespace is not None:
            return [namespace]
        found: set[str] = set()
        for node in self.nodes():
            with self.on(node):
                for suffix in ("tenants", "quotas"):
                    for keys in node.scan(f"{glob_escape(self.prefix)}:*:{suffix}"):
                        found.update(
                            _text(k).split(":")[1] for k in keys if _text(k).count(":") == 2
                        )
        return sorted(found)

    def quota_usage(self, namespace: str) -> dict[str, int]:
        """Every tenant's bytes in ``namespace``'s account."""
        return quota_account.usage(self.client, KeySpace(self.prefix, namespace).tenants_key())

    def quota_budgets(self, namespace: str) -> dict[str, int]:
        """Every budget set in ``namespace`` (tenant -> bytes, or -1: none)."""
        return quota_account.budgets(self.client, KeySpace(self.prefix, namespace).quotas_key())

    def set_quota(self, namespace: str, tenant: str, budget: int) -> None:
        quota_account.set_budget(
            self.client, KeySpace(self.prefix, namespace).quotas_key(), tenant, budget
        )

    def unset_quota(self, namespace: str, tenant: str) -> bool:
        return quota_account.unset_budget(
            self.client, KeySpace(self.prefix, namespace).quotas_key(), tenant
        )

    def reconcile_quota(self, namespace: str) -> quota_account.Freed:
        """A whole reconcile pass of ``namespace``'s account."""
        return quota_account.reconcile(self.client, KeySpace(self.prefix, namespace))

    def get(self, key: str) -> bytes | None:
        """The value of a string key; None if missing. Raises ``ResponseError`` for other types."""
        value = self.client.get(key)
        return None if value is None else _as_bytes(value)

    def key_type(self, key: str) -> str:
        return _text(self.client.type(key))

    def ttl(self, key: str) -> int | None:
        ttl = int(self.client.ttl(key))
        return ttl if ttl >= 0 else None

    def usage(self) -> PrefixUsage:
        """One SCAN over the whole prefix on every node: per namespace its info, stats and
        per-group sizes, summed over the nodes (``by_node`` keeps each node's share).

        Namespaces are found from every key, not only from ``info`` hashes, so one whose info
        hash was evicted still shows up (with an empty fingerprint).
        """
        merged = PrefixUsage({}, 0, [])
        for node in self.nodes():
            with self.on(node):
                part = node.usage(self.pattern())
            merged.unrecognized_keys += part.unrecognized_keys
            merged.nodes.append(node.name)
            for name, ns in part.namespaces.items():
                merged.namespaces.setdefault(name, NamespaceUsage(name)).merge(ns)
        merged.namespaces = dict(sorted(merged.namespaces.items()))
        return merged

    # ------------------------------------------------------------------ the intersection

    def namespace_infos(self) -> dict[str, dict[str, str]]:
        """Every namespace with an info hash, and its fields (one SCAN per node)."""
        out: dict[str, dict[str, str]] = {}
        for node in self.nodes():
            for keys in node.scan(f"{glob_escape(self.prefix)}:*:info"):
                for key in keys:
                    parts = _text(key).split(":")
                    if len(parts) == 3 and node.client.type(key) in (b"hash", "hash"):
                        out[parts[1]] = node.read_hash(_text(key))
        return dict(sorted(out.items()))

    def orphans(
        self, namespace: str, groups: Sequence[int], sample: int = 1000
    ) -> dict[int, GroupOrphans]:
        """For each of ``groups``: at least ``sample`` of its keys (all when it has fewer; the
        start of a SCAN on each node in turn), and which of them lack a value for the same
        chunk (and rank) in another of ``groups``. The lookups of the matching keys are
        pipelined (the cluster client routes them by slot). Only meaningful when the groups
        have the same tokens per chunk (their chunks then share block hashes)."""
        out: dict[int, GroupOrphans] = {}
        for group in groups:
            entries = self._sample_group(namespace, group, sample)
            others = [g for g in groups if g != group]
            missing = self._missing_in_others(entries, group, others)
            orphaned = [e for e, gone in zip(entries, missing, strict=True) if gone]
            out[group] = GroupOrphans(
                group=group,
                sampled_keys=len(entries),
                sampled_bytes=sum(e.value_bytes or 0 for e in entries),
                orphaned_keys=len(orphaned),
                orphaned_bytes=sum(e.value_bytes or 0 for e in orphaned),
            )
        return out

    def _sample_group(self, namespace: str, group: int, sample: int) -> list[KeyEntry]:
        entries: list[KeyEntry] = []
        for node in self.nodes():
            if len(entries) >= sample:
                break
            found = node.sample(self.pattern(namespace, group), sample - len(entries))
            entries += [e for e in found if e.type == "string" and parse_block_key(e.key)]
        return entries

    def _missing_in_others(
        self, entries: Sequence[KeyEntry], group: int, others: Sequence[int]
    ) -> list[bool]:
        """Per entry: True when some group of ``others`` has no value for its chunk."""
        if not others or not entries:
            return [False] * len(entries)
        missing: list[bool] = []
        for start in range(0, len(entries), BATCH):
            batch = entries[start : start + BATCH]
            pipe = self.client.pipeline(transaction=False)
            for entry in batch:
                for other in others:
                    pipe.exists(_same_chunk(entry.key, group, other))
            replies = pipe.execute()
            for i in range(len(batch)):
                found = replies[i * len(others) : (i + 1) * len(others)]
                missing.append(not all(found))
        return missing

    # ------------------------------------------------------------------ deleting keys

    def purge(self, namespace: str | None, dry_run: bool = False) -> PurgeResult:
        """UNLINK every key of ``namespace`` (None: every key under the prefix) on every node.

        Returns how many keys were unlinked (with ``dry_run``: how many match), in total and per
        node. Keys written while it runs may survive; a repeated purge catches them. Every node
        is reached before the first key is deleted, so an unreachable master stops the purge
        before it starts rather than halfway. On a cluster, keys whose slot is being migrated,
        or moved since SCAN found them, are deleted where the cluster sends them. On Sentinel,
        every sentinel that answers must name the master the purge would run on, else
        :class:`PurgeRefused` (nothing deleted).
        """
        nodes = self.nodes()
        if self.kind is EndpointKind.SENTINEL:
            self._require_agreed_master(nodes[0].name)
        for node in nodes:
            with self.on(node):
                node.client.ping()
        pattern = self.pattern(namespace)
        owned = f"{self.prefix}:".encode()
        by_node = {}
        for node in nodes:
            with self.on(node):
                by_node[node.name] = node.purge(pattern, owned, dry_run)
        return PurgeResult(sum(by_node.values()), by_node)

    def _require_agreed_master(self, master: str) -> None:
        """:class:`PurgeRefused` unless the sentinels that answer all name ``master``: while
        they disagree (a failover under way, two deployments' sentinels under one service
        name) the server the purge reaches may not be the master the tier writes to."""
        answers = [a for a in self.sentinel_answers() if a.master is not None]
        if {a.master for a in answers} == {master}:
            return
        said = "; ".join(f"{a.sentinel} names {a.master}" for a in answers) or "none answers"
        raise PurgeRefused(
            f"purge refused: the sentinels do not agree that {master} is the master of "
            f"{self.cfg.endpoint.service!r} ({said}); nothing deleted"
        )


def _same_chunk(key: str, group: int, other: int) -> str:
    """The key of ``key``'s chunk (and rank) in group ``other``."""
    parts = key.split(":")
    assert parts[2] == f"g{group}"
    parts[2] = f"g{other}"
    return ":".join(parts)


def glob_escape(text: str) -> str:
    """``text`` as a literal inside a SCAN MATCH pattern."""
    return "".join(f"\\{c}" if c in _GLOB_SPECIALS else c for c in text)


def _address(host: object, port: object) -> str:
    host_text = _text(host) if isinstance(host, bytes | str) else str(host)
    return f"[{host_text}]:{port}" if ":" in host_text else f"{host_text}:{port}"


def _parse_info_text(text: str) -> dict[str, str]:
    """``name:value`` lines (CLUSTER INFO's reply) as a dict."""
    out = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip()] = value.strip()
    return out


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
