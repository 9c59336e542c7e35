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
the server allows it; where it does not (an ACL without CONFIG, a managed Redis), the watcher
still listens, :attr:`RemovalWatcher.state` says why nothing may arrive, and ``hma-redis
doctor`` tells the operator which flags to set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from hma_redis.core.client import RedisClient, make_client
from hma_redis.core.config import RedisTierConfig

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


class NotificationState(Enum):
    """Whether removals can arrive."""

    ON = "on"  # the flags are set (found or set by us) and every node is subscribed
    NOT_ENABLED = "not_enabled"  # the flags are missing and CONFIG SET was not allowed
    UNREACHABLE = "unreachable"  # not subscribed yet (Redis down); retried in the background


@dataclass(frozen=True)
class FlagsOutcome:
    """What :func:`ensure_flags` found on one server."""

    before: str | None  # the flags CONFIG GET answered (None: refused)
    after: str | None  # the flags in force afterwards (None: unknown)
    error: str = ""  # why the flags could not be read or set

    @property
    def enabled(self) -> bool:
        return self.after is not None and not missing_flags(self.after)


def missing_flags(flags: str) -> str:
    """The flags of :data:`NEEDED_FLAGS` that ``flags`` (as CONFIG GET gives them) lacks."""
    expanded = flags.replace("A", _ALIAS_A)
    return "".join(f for f in NEEDED_FLAGS if f not in expanded)


def ensure_flags(client: redis.Redis, allow_config_set: bool = True) -> FlagsOutcome:
    """Make ``client``'s server publish what :class:`RemovalWatcher` needs, keeping every
    flag already set (other subscribers may rely on them). Never raises a Redis error: a
    refusal is returned in :attr:`FlagsOutcome.error` (the message carries no credentials)."""
    try:
        before = str(client.config_get("notify-keyspace-events").get("notify-keyspace-events", ""))
    except RedisError as exc:
        return FlagsOutcome(None, None, f"CONFIG GET refused: {exc}")
    missing = missing_flags(before)
    if not missing:
        return FlagsOutcome(before, before)
    if not allow_config_set:
        return FlagsOutcome(before, before, f"flags {missing!r} missing")
    try:
        client.config_set("notify-keyspace-events", before + missing)
    except RedisError as exc:
        return FlagsOutcome(before, before, f"CONFIG SET refused: {exc}")
    return FlagsOutcome(before, before + missing)


def data_nodes(client: RedisClient) -> list[redis.Redis]:
    """One client per server whose notifications matter: every master of a Cluster, else the
    one server ``client`` talks to (a Sentinel client follows the master)."""
    if isinstance(client, RedisCluster):
        nodes = client.get_primaries()
        return [n.redis_connection for n in nodes if n.redis_connection is not None]
    return [client]


class RemovalWatcher:
    """Collects the names of removed keys matching ``pattern``, with bounded memory.

    ``start()`` returns at once; threads subscribe in the background and reconnect after an
    outage (with back-off). :meth:`drain` is the consumer's only call on its hot path: it takes
    what arrived, never waits and never talks to Redis. When more than ``max_pending`` removals
    arrive between two drains the oldest are dropped and :meth:`drain` reports the overflow, so
    the consumer can forget everything it believes instead of trusting a partial list.
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
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._client: RedisClient | None = None
        self._subscribed: set[int] = set()
        self._node_threads: list[threading.Thread] = []
        self._nodes_total = 0
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
        if not self._threads:
            thread = threading.Thread(target=self._run, name="hma-removals", daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def wait_subscribed(self, timeout_s: float) -> bool:
        """Block until every node is subscribed (tests, start-up logs); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._nodes_total and len(self._subscribed) >= self._nodes_total:
                return True
            time.sleep(0.01)
        return False

    def drain(self, limit: int | None = None) -> tuple[list[str], bool]:
        """``(keys, overflowed)``: the removed keys that arrived since the last call (at most
        ``limit``), and whether some were dropped because the queue was full."""
        with self._lock:
            count = len(self._pending) if limit is None else min(limit, len(self._pending))
            keys = [self._pending.popleft() for _ in range(count)]
            overflowed, self._overflowed = self._overflowed, False
        return keys, overflowed

    def close(self) -> None:
        """Stop the threads (within about one poll interval) and close the connections."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2 * _POLL_S + 1.0)
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------------ background

    def _run(self) -> None:
        """Connect, check the flags on every node, then watch each node from its own thread."""
        delay = _RECONNECT_S
        while not self._stop.is_set():
            try:
                self._client = self._client_factory(self._cfg)
                nodes = data_nodes(self._client)
            except (RedisError, RedisClusterException, OSError) as exc:
                self._set_state(NotificationState.UNREACHABLE, f"{type(exc).__name__}: {exc}")
                self._stop.wait(delay)
                delay = min(delay * 2, _RECONNECT_MAX_S)
                continue
            break
        else:
            return
        self._check_flags(nodes)
        self._nodes_total = len(nodes)
        for index, node in enumerate(nodes):
            thread = threading.Thread(
                target=self._watch_node,
                args=(index, node),
                name=f"hma-removals-{index}",
                daemon=True,
            )
            self._node_threads.append(thread)
            thread.start()
        for thread in self._node_threads:
            thread.join()

    def _check_flags(self, nodes: Sequence[redis.Redis]) -> None:
        outcomes = [ensure_flags(node, self._allow_config_set) for node in nodes]
        bad = [o for o in outcomes if not o.enabled]
        if not bad:
            changed = [o for o in outcomes if o.before != o.after]
            self._set_state(
                NotificationState.ON,
                f"notify-keyspace-events set to {outcomes[0].after!r} on {len(changed)} node(s)"
                if changed
                else "notify-keyspace-events already on",
            )
            return
        self._set_state(
            NotificationState.NOT_ENABLED,
            f"{bad[0].error} on {len(bad)} of {len(nodes)} node(s); set notify-keyspace-events "
            f"to include {NEEDED_FLAGS!r} so routers learn of evicted and expired chunks",
        )
        logger.warning("hma_redis: removal events are off: %s", self.detail)

    def _set_state(self, state: NotificationState, detail: str) -> None:
        if state is not self.state:
            logger.info("hma_redis: removal notifications %s (%s)", state.value, detail)
        self.state, self.detail = state, detail

    def _watch_node(self, index: int, node: redis.Redis) -> None:
        """Subscribe on one node and queue its removals until :meth:`close`; after a lost
        connection, subscribe again (the keys removed meanwhile are not known: the queue is
        marked overflowed so the consumer forgets what it believes)."""
        delay = _RECONNECT_S
        while not self._stop.is_set():
            pubsub = node.pubsub()
            try:
                pubsub.psubscribe(self.channel_pattern)
                delay = _RECONNECT_S
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=_POLL_S)
                    if message is None:
                        continue
                    if message["type"] == "psubscribe":
                        # Confirmed by the server: from here on no removal is missed.
                        self._subscribed.add(index)
                    elif message["type"] == "pmessage":
                        self._on_message(message["channel"], message["data"])
            except (RedisError, OSError) as exc:
                self._subscribed.discard(index)
                with self._lock:
                    self._overflowed = True
                logger.info(
                    "hma_redis: removal notifications from node %d lost (%s); resubscribing",
                    index,
                    type(exc).__name__,
                )
                self._stop.wait(delay)
                delay = min(delay * 2, _RECONNECT_MAX_S)
            finally:
                pubsub.close()

    def _on_message(self, channel: bytes | str, event: bytes | str) -> None:
        name = event.decode() if isinstance(event, bytes) else event
        if name not in REMOVAL_EVENTS:
            return
        text = channel.decode() if isinstance(channel, bytes) else channel
        key = text.split(":", 1)[1]
        with self._lock:
            if len(self._pending) == self._pending.maxlen:
                self._overflowed = True
                self.dropped += 1
            self._pending.append(key)
            self.received += 1
