"""Every store and every removal of the tier's chunks in one Redis deployment, for a fleet-wide
event publisher (``hma-redis events``).

:class:`KeyspaceFeed` subscribes to the keyspace notifications of every data node (each master
of a Cluster; the one server of a plain or Sentinel URL, found again after a failover) and turns
them into :class:`KeyChange` records: a chunk key written (``set``: the tier's ``SET NX``) or gone
(``del``, ``expired``, ``evicted``). What notifications cannot say is recovered with a
:class:`Resync`: the complete list of chunk keys present, read with ``SCAN``, which the consumer
compares with what it believes. One comes

* when the feed first subscribes, and after every reconnection (a change missed while the
  connection was down is in the list, not in the notifications);
* when a Cluster's set of masters changes (a failover, checked every ``rediscover_s``);
* when a node lost its data without a notification: Redis publishes nothing for ``FLUSHALL`` /
  ``FLUSHDB`` nor for a restart that forgets the data set. Each node holds a marker key
  (``<prefix>:events``; in a Cluster one per master, ``<prefix>:events{m<n>}`` in one of its
  slots) that the feed
  writes and reads every ``marker_check_s``; a marker gone without a notification of its own
  means the node's data is gone. For a deployment of one data node (plain URL, Sentinel) that
  resync has :attr:`Resync.cleared` set: everything is gone, then the list is what was written
  since. A Cluster master that lost its data is a plain resync (the other masters' chunks stay).

A marker that Redis evicts or someone deletes is announced like any key, and is written again
without a resync. Before a resync's ``SCAN`` every subscription is drained up to a ``PING`` (a
barrier on the pub/sub connection), so no notification older than the scan is applied after it.

The feed is driven by its consumer's thread (:meth:`KeyspaceFeed.poll`), holds no thread of its
own, and survives outages: a lost connection is logged once, retried with back-off, and ends in
a :class:`Resync`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis import reply_shapes
from hma_redis.core.redis.client import RedisClient, make_client
from hma_redis.core.redis.notifications import data_nodes, ensure_flags

logger = logging.getLogger(__name__)

# K: keyspace channels (the key is in the channel), $: string commands (SET), g: DEL / UNLINK,
# x: expired, e: evicted.
FEED_FLAGS = "K$gxe"
# "restore": RESTORE, and MIGRATE's target during a Cluster's slot migration.
STORE_EVENTS = frozenset({"set", "restore"})
REMOVAL_EVENTS = frozenset({"del", "expired", "evicted"})
_SCAN_COUNT = 1000
_RECONNECT_S = 0.5
_RECONNECT_MAX_S = 10.0
_BARRIER_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class KeyChange:
    """One chunk key written (``stored``) or removed, as a notification announced it."""

    key: str
    stored: bool


@dataclass(frozen=True)
class Resync:
    """Every chunk key present now (all masters); ``cleared``: the deployment's whole data set
    was lost first (``FLUSHALL``, a restart without persistence) and every belief is void."""

    keys: frozenset[str]
    cleared: bool
    reason: str


FeedItem = KeyChange | Resync


@dataclass
class _Node:
    """One subscribed data node."""

    name: str
    client: redis.Redis
    pubsub: Any
    marker: str
    marker_lost: bool = False  # a notification said the marker went: write it, no resync


class KeyspaceFeed:
    """Chunk stores and removals of one Redis deployment, scoped to ``prefix`` and one
    namespace (``namespace``) or all of them (None).

    :meth:`poll` is the only call that waits; it returns what happened since the last call, in
    the order the nodes announced it (per node). :attr:`connected` says whether every node is
    subscribed now.
    """

    def __init__(
        self,
        cfg: RedisTierConfig,
        *,
        namespace: str | None = None,
        marker_check_s: float = 0.5,
        rediscover_s: float = 5.0,
        allow_config_set: bool = True,
        client_factory: Callable[[RedisTierConfig], RedisClient] = make_client,
    ) -> None:
        self._cfg = cfg
        self._prefix = cfg.key_prefix
        self._block_pattern = f"{self._prefix}:{namespace or '*'}:g*"
        self._marker_check_s = marker_check_s
        self._rediscover_s = rediscover_s
        self._allow_config_set = allow_config_set
        self._client_factory = client_factory
        self._client: RedisClient | None = None
        self._nodes: list[_Node] = []
        self._ever_connected = False
        self._retry_at = 0.0
        self._delay = _RECONNECT_S
        self._next_marker_check = 0.0
        self._next_rediscover = 0.0
        self._outage_logged = False
        self.detail = "not connected yet"

    @property
    def connected(self) -> bool:
        return bool(self._nodes)

    def node_names(self) -> list[str]:
        """``host:port`` of every subscribed master (``""`` for the one server of a plain or
        Sentinel URL)."""
        return [node.name for node in self._nodes]

    def poll(self, timeout_s: float = 0.05) -> list[FeedItem]:
        """What happened since the last call, waiting up to ``timeout_s`` when nothing did.
        Never raises for an outage: it is logged once and the feed reconnects by itself."""
        try:
            return self._poll(timeout_s)
        except (RedisError, RedisClusterException, OSError) as exc:
            self._lost(exc)
            return []

    def namespace_info(self, namespace: str) -> dict[str, str] | None:
        """The ``<prefix>:<ns>:info`` hash (the namespace's fingerprint), or None when it is
        missing or Redis cannot be read now."""
        client = self._client
        if client is None:
            return None
        key = f"{self._prefix}:{namespace}:info"
        try:
            reply = reply_shapes.parsed("HGETALL", lambda: client.hgetall(key))
            fields = reply_shapes.text_map("HGETALL", reply)
        except (RedisError, RedisClusterException, OSError):
            return None
        return fields or None

    def close(self) -> None:
        """Close every connection."""
        self._drop_nodes()

    # ------------------------------------------------------------------ polling

    def _poll(self, timeout_s: float) -> list[FeedItem]:
        if not self._nodes:
            return self._connect(timeout_s)
        out: list[FeedItem] = []
        for node in self._nodes:
            self._drain(node, out)
        now = time.monotonic()
        if now >= self._next_rediscover and isinstance(self._client, RedisCluster):
            self._next_rediscover = now + self._rediscover_s
            if self._masters_changed():
                return [*out, self._resync(False, "the Cluster's masters changed", reconnect=True)]
        if now >= self._next_marker_check:
            self._next_marker_check = now + self._marker_check_s
            reset = self._check_markers(out)
            if reset is not None:
                out.append(reset)
        if not out:
            time.sleep(timeout_s)
        return out

    def _drain(self, node: _Node, out: list[FeedItem], until_pong: bool = False) -> None:
        """Move the node's waiting notifications to ``out``; with ``until_pong``, read until
        the reply to the ``PING`` sent before (the barrier)."""
        deadline = time.monotonic() + _BARRIER_TIMEOUT_S
        wait = 0.05 if until_pong else 0.0
        while True:
            message = reply_shapes.parsed(
                "PSUBSCRIBE", lambda: node.pubsub.get_message(timeout=wait)
            )
            if message is None:
                if not until_pong:
                    return
                if time.monotonic() > deadline:
                    raise reply_shapes.WrongReply("no PONG on the pub/sub connection")
                continue
            if not isinstance(message, dict):
                raise reply_shapes.WrongReply(f"a pub/sub message {message!r:.60}")
            if message.get("type") == "pong":
                if until_pong:
                    return
                continue
            if message.get("type") == "pmessage":
                self._on_message(node, message["channel"], message["data"], out)

    def _on_message(self, node: _Node, channel: Any, event: Any, out: list[FeedItem]) -> None:
        if not isinstance(channel, bytes | str) or not isinstance(event, bytes | str):
            raise reply_shapes.WrongReply(f"a pmessage of {channel!r:.40}: {event!r:.40}")
        name = event.decode(errors="replace") if isinstance(event, bytes) else event
        text = channel.decode(errors="replace") if isinstance(channel, bytes) else channel
        if ":" not in text:
            raise reply_shapes.WrongReply(f"a pmessage on channel {text!r:.60}")
        key = text.split(":", 1)[1]
        if key == node.marker:
            if name in REMOVAL_EVENTS:
                node.marker_lost = True
            return
        if name in STORE_EVENTS:
            out.append(KeyChange(key, True))
        elif name in REMOVAL_EVENTS:
            out.append(KeyChange(key, False))

    # ------------------------------------------------------------------ markers

    def _check_markers(self, out: list[FeedItem]) -> Resync | None:
        """Write back markers a notification said were removed; a marker gone without one
        means its node lost its data: a resync (``cleared`` for a one-node deployment)."""
        lost: list[_Node] = []
        for node in self._nodes:
            if node.marker_lost or not self._marker_exists(node):
                lost.append(node)
        if not lost:
            return None
        self._barrier(out)  # a removal notification for a marker may still be on its way
        flushed = [node for node in lost if not node.marker_lost]
        for node in lost:
            node.marker_lost = False
            self._write_marker(node)
        if not flushed:
            return None
        names = ", ".join(node.name or "the server" for node in flushed)
        cleared = len(self._nodes) == 1
        logger.info("hma_redis events: %s lost its data (FLUSHALL or a restart)", names)
        return self._resync(cleared, f"{names} lost its data (FLUSHALL or a restart)")

    def _marker_exists(self, node: _Node) -> bool:
        """Whether the node's marker is there (read with GET, not EXISTS: a read keeps it
        recent for an LRU / LFU eviction policy)."""
        reply = reply_shapes.parsed("GET", lambda: node.client.get(node.marker))
        if reply is not None and not isinstance(reply, bytes | str):
            raise reply_shapes.WrongReply(f"GET of the marker answered {reply!r:.60}")
        return reply is not None

    def _write_marker(self, node: _Node) -> bool:
        """Write the node's marker unless it exists; whether it existed."""
        token = uuid.uuid4().hex
        reply = reply_shapes.parsed("SET", lambda: node.client.set(node.marker, token, nx=True))
        return not reply_shapes.is_ok("SET", reply, nil=True)

    def _marker_key(self, name: str) -> str:
        """The marker of the node ``name``: in a Cluster, a key in one of its slots."""
        # Two parts (no ``<prefix>:<ns>:`` shape): no namespace of ``hma-redis info``.
        base = f"{self._prefix}:events"
        if not isinstance(self._client, RedisCluster):
            return base
        slots = {
            slot
            for slot, owners in self._client.nodes_manager.slots_cache.items()
            if owners and owners[0].name == name
        }
        for tag in range(1 << 20):
            key = f"{base}{{m{tag}}}"
            if key_slot(key.encode()) in slots:
                return key
        raise RedisClusterException(f"no slot found for the marker of {name}")

    # ------------------------------------------------------------------ (re)connecting

    def _connect(self, timeout_s: float) -> list[FeedItem]:
        if time.monotonic() < self._retry_at:
            time.sleep(timeout_s)
            return []
        self._client = self._client_factory(self._cfg)
        nodes = data_nodes(self._client)
        flushed = False
        for name, client in nodes.items():
            node = _Node(name, client, client.pubsub(), self._marker_key(name))
            self._nodes.append(node)
            self._check_flags(node)
            node.pubsub.psubscribe(self._channel(self._block_pattern), self._channel(node.marker))
            self._wait_subscribed(node, 2)
            existed = self._write_marker(node)
            flushed = flushed or not existed
        was_connected, self._ever_connected = self._ever_connected, True
        self._delay = _RECONNECT_S
        self._next_rediscover = time.monotonic() + self._rediscover_s
        self._next_marker_check = time.monotonic() + self._marker_check_s
        logger.info(
            "hma_redis events: subscribed to %d node(s) of %s",
            len(self._nodes),
            self._cfg.redacted_url,
        )
        self._outage_logged = False
        self.detail = f"subscribed to {len(self._nodes)} node(s)"
        cleared = was_connected and flushed and len(self._nodes) == 1
        reason = "reconnected" if was_connected else "started"
        if cleared:
            reason = "reconnected to a server that lost its data (a restart or FLUSHALL)"
        return [self._resync(cleared, reason)]

    def _check_flags(self, node: _Node) -> None:
        outcome = ensure_flags(node.client, self._allow_config_set, FEED_FLAGS)
        if not outcome.enabled:
            logger.warning(
                "hma_redis events: keyspace notifications are off on %s (%s): set "
                "notify-keyspace-events to include %r",
                node.name or self._cfg.redacted_url,
                outcome.error,
                FEED_FLAGS,
            )

    def _channel(self, pattern: str) -> str:
        return f"__keyspace@{self._cfg.db}__:{pattern}"

    def _wait_subscribed(self, node: _Node, count: int) -> None:
        deadline = time.monotonic() + max(self._cfg.read_timeout_s, 1.0)
        while count:
            message = reply_shapes.parsed(
                "PSUBSCRIBE", lambda: node.pubsub.get_message(timeout=0.1)
            )
            if isinstance(message, dict) and message.get("type") == "psubscribe":
                count -= 1
            elif time.monotonic() > deadline:
                raise reply_shapes.WrongReply("no PSUBSCRIBE confirmation")

    def _masters_changed(self) -> bool:
        probe = self._client_factory(self._cfg)
        try:
            names = set(data_nodes(probe))
        finally:
            probe.close()
        return names != set(self.node_names())

    def _lost(self, exc: BaseException) -> None:
        if not self._outage_logged:
            logger.warning(
                "hma_redis events: Redis unreachable (%s: %s); retrying in the background",
                type(exc).__name__,
                exc,
            )
            self._outage_logged = True
        self.detail = f"unreachable: {type(exc).__name__}"
        self._drop_nodes()
        self._retry_at = time.monotonic() + self._delay
        self._delay = min(self._delay * 2, _RECONNECT_MAX_S)

    def _drop_nodes(self) -> None:
        for node in self._nodes:
            with contextlib.suppress(RedisError, OSError):  # the connection is gone already
                node.pubsub.close()
        self._nodes = []
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ resync

    def _barrier(self, out: list[FeedItem]) -> None:
        """Apply every notification a node sent before now: PING each subscription, drain up
        to its PONG."""
        for node in self._nodes:
            node.pubsub.ping()
        for node in self._nodes:
            self._drain(node, out, until_pong=True)

    def _resync(self, cleared: bool, reason: str, reconnect: bool = False) -> Resync:
        """Every chunk key on every node (after a barrier); ``reconnect``: subscribe to the
        masters found now first."""
        if reconnect:
            self._drop_nodes()
            items = self._connect(0.0)
            assert isinstance(items[0], Resync)
            return Resync(items[0].keys, cleared, reason)
        stale: list[FeedItem] = []
        self._barrier(stale)  # older than the scan: the scan's list replaces them
        keys: set[str] = set()
        for node in self._nodes:
            for raw in node.client.scan_iter(match=self._block_pattern, count=_SCAN_COUNT):
                keys.add(raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw))
        return Resync(frozenset(keys), cleared, reason)
