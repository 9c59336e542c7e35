"""Removal notifications: which of the tier's values Redis evicted, expired or deleted.

Cache-aware routers learn what each instance can serve from vLLM's KV events. Stores are known
to the instance that makes them; removals happen inside Redis (``maxmemory`` eviction, a TTL,
``hma-redis purge``, a value unlinked because it failed validation). Redis announces them as
keyspace notifications, and :class:`RemovalWatcher` listens to them: one pub/sub connection per
data node (every master of a Cluster: notifications never leave the node that made them), one
background thread per connection, subscribed to the keyspace channels of one namespace's block
keys only (a pattern, matched by the server, so other tenants' keys never reach us). Removed
keys go into a bounded queue that the scheduler drains once per step, so removals cost no round
trip on any request's path.

Notifications are off in a default Redis (``notify-keyspace-events ""``). The watcher turns on
the flags it needs with ``CONFIG SET`` (merged with those already set, never removing any) when
the server allows it, each time it subscribes to a node (a restarted Redis forgets flags it
did not save); where it does not (an ACL without CONFIG, a managed Redis), the watcher still
listens, :attr:`RemovalWatcher.state` says why nothing may arrive, and ``hma-redis doctor``
tells the operator which flags to set. The masters of a Cluster are asked for again whenever a
node's connection drops (and every ``_REDISCOVER_S``), so a promoted master is watched too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis import reply_shapes
from hma_redis.core.redis.breaker import ErrorKind, classify
from hma_redis.core.redis.client import RedisClient, make_client

logger = logging.getLogger(__name__)

# The notify-keyspace-events flags the watcher needs: K (keyspace channels: the key is in the
# channel name, so a pattern filters by key), g (DEL / UNLINK), x (expired), e (evicted).
NEEDED_FLAGS = "Kgxe"
# What Redis' "A" flag stands for (CONFIG GET may answer with it).
_ALIAS_A = "g$lshzxetd"
# The events of the keyspace channel that mean "this value is gone".
REMOVAL_EVENTS = frozenset({"del", "expired", "evicted"})
# How long one wait for a message lasts (also how soon close() is noticed).
_POLL_S = 0.2
# After a lost connection, the next try waits this long (doubling up to the maximum).
_RECONNECT_S = 0.5
_RECONNECT_MAX_S = 10.0
# How often the watcher asks a Cluster for its masters without being woken by a lost node, and
# checks that a subscribed node's flags are still set.
_REDISCOVER_S = 10.0
_FLAGS_RECHECK_S = 30.0


class NotificationState(Enum):
    """Whether removals can arrive."""

    ON = "on"  # every master is subscribed and publishes removals (flags found or set by us)
    DEGRADED = "degraded"  # some masters are watched, others not (down, or their flags are off)
    NOT_ENABLED = "not_enabled"  # the flags are missing and CONFIG SET was not allowed
    UNREACHABLE = "unreachable"  # no node subscribed (Redis down); retried in the background


@dataclass(frozen=True)
class FlagsOutcome:
    """What :func:`ensure_flags` found on one server."""

    before: str | None  # the flags CONFIG GET answered (None: refused)
    after: str | None  # the flags in force afterwards (None: unknown)
    error: str = ""  # why the flags could not be read or set

    needed: str = NEEDED_FLAGS  # the flags asked for

    @property
    def enabled(self) -> bool:
        return self.after is not None and not missing_flags(self.after, self.needed)


def missing_flags(flags: str, needed: str = NEEDED_FLAGS) -> str:
    """The flags of ``needed`` that ``flags`` (as CONFIG GET gives them) lacks."""
    expanded = flags.replace("A", _ALIAS_A)
    return "".join(f for f in needed if f not in expanded)


def ensure_flags(
    client: redis.Redis, allow_config_set: bool = True, needed: str = NEEDED_FLAGS
) -> FlagsOutcome:
    """Make ``client``'s server publish ``needed`` (by default what :class:`RemovalWatcher`
    needs; :mod:`~hma_redis.core.redis.keyspace_feed` adds stores), keeping every
    flag already set (other subscribers may rely on them). A refusal (an ACL without CONFIG,
    a managed Redis) is returned in :attr:`FlagsOutcome.error` (the message carries no
    credentials); an outage (connection error, timeout, a reply of the wrong shape) raises, so
    the caller retries."""
    try:
        found = reply_shapes.parsed(
            "CONFIG GET", lambda: client.config_get("notify-keyspace-events")
        )
    except RedisError as exc:
        _raise_outage(exc)
        return FlagsOutcome(None, None, f"CONFIG GET refused: {exc}", needed)
    before = reply_shapes.text_map("CONFIG GET", found).get("notify-keyspace-events", "")
    missing = missing_flags(before, needed)
    if not missing:
        return FlagsOutcome(before, before, needed=needed)
    if not allow_config_set:
        return FlagsOutcome(before, before, f"flags {missing!r} missing", needed)
    try:
        done = client.config_set("notify-keyspace-events", before + missing)
    except RedisError as exc:
        _raise_outage(exc)
        return FlagsOutcome(before, before, f"CONFIG SET refused: {exc}", needed)
    reply_shapes.is_ok("CONFIG SET", done)
    return FlagsOutcome(before, before + missing, needed=needed)


def _raise_outage(exc: RedisError) -> None:
    if classify(exc) is ErrorKind.OUTAGE:
        raise exc


def _next_message(pubsub: Any) -> dict[str, Any] | None:
    """The pub/sub connection's next message (waiting up to ``_POLL_S``), or None; one that is
    no message of Redis' shape (redis-py cannot parse it) is
    :class:`~hma_redis.core.redis.reply_shapes.WrongReply`."""
    message = reply_shapes.parsed("PSUBSCRIBE", lambda: pubsub.get_message(timeout=_POLL_S))
    if message is not None and not isinstance(message, dict):
        raise reply_shapes.WrongReply(f"a pub/sub message {message!r:.60}")
    return message


def data_nodes(client: RedisClient) -> dict[str, redis.Redis]:
    """One client per server whose notifications matter, by ``host:port``: every master of a
    Cluster, else the one server ``client`` talks to (``""``; a Sentinel client follows the
    master). Raises ``RedisError`` while no node of a Cluster answers."""
    if not isinstance(client, RedisCluster):
        return {"": client}
    return {
        node.name: node.redis_connection
        for node in client.get_primaries()
        if node.redis_connection is not None
    }


@dataclass
class _NodeWatch:
    """One watched node: its thread, its stop flag and what it last found."""

    index: int
    client: redis.Redis
    owner: RedisClient  # the client that found the node (it owns the node's connections)
    stop: threading.Event
    thread: threading.Thread | None = None
    state: NotificationState = NotificationState.UNREACHABLE
    detail: str = "not subscribed yet"
    subscribed: bool = False


class RemovalWatcher:
    """Collects the names of removed keys matching ``pattern``, with bounded memory.

    ``start()`` returns at once; threads subscribe in the background and reconnect after an
    outage (with back-off), setting the flags again each time. :meth:`drain` is the
    consumer's only call on its hot path: it takes what arrived, never waits and never talks to
    Redis. When more than ``max_pending`` removals arrive between two drains, the oldest are
    dropped and :meth:`drain` reports the overflow, so the consumer can forget everything it
    believes instead of trusting a partial list; so does a node's lost connection, and a node
    subscribed after the first ones (removals before its subscription are unknown).
    :attr:`state` and :attr:`detail` say whether removals can arrive from every master.
    """

    def __init__(
        self,
        cfg: RedisTierConfig,
        pattern: str,
        *,
        max_pending: int = 65_536,
        allow_config_set: bool = True,
        client_factory: Callable[[RedisTierConfig], RedisClient] = make_client,
    ) -> None:
        self._cfg = cfg
        self._pattern = pattern
        self._allow_config_set = allow_config_set
        self._client_factory = client_factory
        self._pending: deque[str] = deque(maxlen=max_pending)
        self._overflowed = False
        self._lock = threading.Lock()
        # Held while the state is worked out and set (node threads report concurrently).
        self._state_lock = threading.Lock()
        self._stop = threading.Event()
        # Set by a node that lost its connection: the masters are asked for again.
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # The clients whose nodes are watched (a Cluster's masters are found by a new client
        # each time, so a refresh never touches the watched nodes' connections).
        self._clients: list[RedisClient] = []
        self._nodes: dict[str, _NodeWatch] = {}
        self._next_index = 0
        self.state = NotificationState.UNREACHABLE
        self.detail = "not started"
        self.received = 0
        self.dropped = 0

    @property
    def channel_pattern(self) -> str:
        """The keyspace-channel pattern subscribed on every node."""
        return f"__keyspace@{self._cfg.db}__:{self._pattern}"

    def start(self) -> RemovalWatcher:
        """Start the background subscriber (once); returns ``self``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hma-removals", daemon=True)
            self._thread.start()
        return self

    def wait_subscribed(self, timeout_s: float) -> bool:
        """Block until every node watched is subscribed (tests, start-up logs); False on
        timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                nodes = list(self._nodes.values())
            if nodes and all(node.subscribed for node in nodes):
                return True
            time.sleep(0.01)
        return False

    def watched_nodes(self) -> list[str]:
        """``host:port`` of every node watched now (a Cluster's masters; ``""`` for the one
        server of a standalone or Sentinel URL)."""
        with self._lock:
            return sorted(self._nodes)

    def drain(self, limit: int | None = None) -> tuple[list[str], bool]:
        """``(keys, overflowed)``: the removed keys that arrived since the last call, and
        whether some were dropped (the queue was full, a connection dropped). More than
        ``limit`` keys waiting is an overflow too: they are all dropped (none returned), so a
        flood costs the caller no more than ``limit`` keys' work."""
        with self._lock:
            if limit is not None and len(self._pending) > limit:
                self.dropped += len(self._pending)
                self._pending.clear()
                self._overflowed = True
            keys = list(self._pending)
            self._pending.clear()
            overflowed, self._overflowed = self._overflowed, False
        return keys, overflowed

    def close(self) -> None:
        """Stop the threads (within about one poll interval) and close the connections."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.stop.set()
        threads = [self._thread, *(node.thread for node in nodes)]
        for thread in threads:
            if thread is not None:
                thread.join(timeout=2 * _POLL_S + 1.0)
        for client in self._clients:
            client.close()

    # ------------------------------------------------------------------ background

    def _run(self) -> None:
        """Find the masters, watch each from its own thread, and (a Cluster) find them again
        whenever a node's connection drops or every ``_REDISCOVER_S``: a promoted master is
        watched, a node that is no master any more is not. A standalone or Sentinel server is
        found once; its thread reconnects by itself."""
        delay = _RECONNECT_S
        while not self._stop.is_set():
            client = self._client_factory(self._cfg)
            try:
                nodes = data_nodes(client)
            except (RedisError, RedisClusterException, OSError) as exc:
                client.close()
                if not self._nodes:
                    with self._state_lock:
                        detail = f"{type(exc).__name__}: {exc}"
                        self._set_state(NotificationState.UNREACHABLE, detail)
                self._stop.wait(delay)
                delay = min(delay * 2, _RECONNECT_MAX_S)
                continue
            delay = _RECONNECT_S
            self._watch_only(client, nodes)
            if not isinstance(client, RedisCluster):
                return
            self._wake.wait(_REDISCOVER_S)
            self._wake.clear()

    def _watch_only(self, client: RedisClient, nodes: dict[str, redis.Redis]) -> None:
        """Start a thread for each node not watched yet; stop those of nodes not listed; close
        the clients that no watched node belongs to any more."""
        first = not self._nodes
        with self._lock:
            gone = [self._nodes.pop(name) for name in list(self._nodes) if name not in nodes]
            added = [name for name in nodes if name not in self._nodes]
            for name in added:
                self._nodes[name] = _NodeWatch(
                    self._next_index, nodes[name], client, threading.Event()
                )
                self._next_index += 1
            owners = [watch.owner for watch in self._nodes.values()]
        for node in gone:
            node.stop.set()
        self._clients.append(client)
        for old in [c for c in self._clients if not any(c is o for o in owners)]:
            self._clients.remove(old)
            old.close()
        for name in added:
            watch = self._nodes[name]
            watch.thread = threading.Thread(
                target=self._watch_node,
                args=(watch, not first),
                name=f"hma-removals-{watch.index}",
                daemon=True,
            )
            watch.thread.start()
        if gone or added:
            logger.info(
                "hma_redis: removal notifications: watching %d node(s) (%d new, %d no longer "
                "masters)",
                len(nodes),
                len(added),
                len(gone),
            )
            self._update_state()

    def _watch_node(self, watch: _NodeWatch, late: bool) -> None:
        """Set the flags and subscribe on one node, queue its removals until it is stopped;
        after a lost connection, do both again with back-off. Removals the watcher may have
        missed (while the connection was down, or before a ``late`` node was subscribed) mark
        the queue overflowed, so the consumer forgets what it believes."""
        delay = _RECONNECT_S
        while not self._stopped(watch):
            pubsub = watch.client.pubsub()
            try:
                self._subscribe(watch, pubsub, late)
                delay = _RECONNECT_S
                self._listen(watch, pubsub)
            except (RedisError, OSError) as exc:
                if self._stopped(watch):
                    return  # no master any more (its client may be closed), or closing
                self._node_lost(watch, exc)
                late = True
                watch.stop.wait(delay)
                delay = min(delay * 2, _RECONNECT_MAX_S)
            finally:
                pubsub.close()

    def _stopped(self, watch: _NodeWatch) -> bool:
        return self._stop.is_set() or watch.stop.is_set()

    def _subscribe(self, watch: _NodeWatch, pubsub: Any, late: bool) -> None:
        """Check (and set) the node's flags, then subscribe; returns once the server has
        confirmed the subscription (from then on no removal on it is missed)."""
        self._check_flags(watch)
        pubsub.psubscribe(self.channel_pattern)
        while True:
            if self._stopped(watch):
                return
            message = _next_message(pubsub)
            if message is not None and message["type"] == "psubscribe":
                break
        watch.subscribed = True
        if late:
            with self._lock:
                self._overflowed = True
        self._update_state()

    def _listen(self, watch: _NodeWatch, pubsub: Any) -> None:
        """Queue the node's removals until it is stopped; check its flags now and then (an
        operator may have reset them)."""
        next_check = time.monotonic() + _FLAGS_RECHECK_S
        while not self._stopped(watch):
            message = _next_message(pubsub)
            if message is not None and message["type"] == "pmessage":
                self._on_message(message["channel"], message["data"])
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _FLAGS_RECHECK_S
                self._check_flags(watch)
                self._update_state()

    def _check_flags(self, watch: _NodeWatch) -> None:
        """Set ``watch``'s state from its node's flags (set with CONFIG SET where allowed);
        an outage raises."""
        outcome = ensure_flags(watch.client, self._allow_config_set)
        if outcome.enabled:
            changed = outcome.before != outcome.after
            watch.state = NotificationState.ON
            watch.detail = (
                f"notify-keyspace-events set to {outcome.after!r}"
                if changed
                else "notify-keyspace-events already on"
            )
            return
        watch.state = NotificationState.NOT_ENABLED
        watch.detail = outcome.error

    def _node_lost(self, watch: _NodeWatch, exc: BaseException) -> None:
        watch.subscribed = False
        watch.state = NotificationState.UNREACHABLE
        watch.detail = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._overflowed = True
        logger.info(
            "hma_redis: removal notifications from node %d lost (%s); resubscribing",
            watch.index,
            type(exc).__name__,
        )
        self._update_state()
        self._wake.set()  # a Cluster may have promoted a replica: ask for the masters again

    def _update_state(self) -> None:
        """The watcher's state from its nodes': ON only if every node is subscribed with its
        flags on; NOT_ENABLED or UNREACHABLE if every node is; DEGRADED for a mix."""
        with self._state_lock:
            self._work_out_state()

    def _work_out_state(self) -> None:
        with self._lock:
            nodes = list(self._nodes.values())
        if not nodes:
            return
        # A node counts only once its subscription is confirmed.
        states = [n.state if n.subscribed else NotificationState.UNREACHABLE for n in nodes]
        if len(set(states)) == 1:
            state = states[0]
            detail = nodes[0].detail
            if len(nodes) > 1:
                detail = f"{detail} (all {len(nodes)} nodes)"
        else:
            state = NotificationState.DEGRADED
            bad = [n for n, s in zip(nodes, states, strict=True) if s is not NotificationState.ON]
            detail = f"{len(bad)} of {len(nodes)} node(s) not watched: {bad[0].detail}"
        if NotificationState.NOT_ENABLED in states:
            detail += (
                f"; set notify-keyspace-events to include {NEEDED_FLAGS!r} so routers learn "
                "of evicted and expired chunks"
            )
        self._set_state(state, detail)

    def _set_state(self, state: NotificationState, detail: str) -> None:
        changed = state is not self.state
        self.state, self.detail = state, detail
        if not changed:
            return
        if state in (NotificationState.NOT_ENABLED, NotificationState.DEGRADED):
            logger.warning("hma_redis: removal events are %s: %s", state.value, detail)
        else:
            logger.info("hma_redis: removal notifications %s (%s)", state.value, detail)

    def _on_message(self, channel: Any, event: Any) -> None:
        """Queue the key of a removal event; a message that is no keyspace event of the
        pattern (its channel without the key, not text) is a
        :class:`~hma_redis.core.redis.reply_shapes.WrongReply`, as a lost connection for the
        node."""
        if not isinstance(channel, bytes | str) or not isinstance(event, bytes | str):
            raise reply_shapes.WrongReply(f"a pmessage of {channel!r:.40}: {event!r:.40}")
        name = event.decode(errors="replace") if isinstance(event, bytes) else event
        if name not in REMOVAL_EVENTS:
            return
        text = channel.decode(errors="replace") if isinstance(channel, bytes) else channel
        if ":" not in text:
            raise reply_shapes.WrongReply(f"a pmessage on channel {text!r:.60}")
        key = text.split(":", 1)[1]
        with self._lock:
            if len(self._pending) == self._pending.maxlen:
                self._overflowed = True
                self.dropped += 1
            self._pending.append(key)
            self.received += 1
