"""The fleet-wide KV-event publisher: one per Redis deployment (``hma-redis events``).

It reads the deployment's keyspace through :class:`~hma_redis.core.redis.keyspace_feed.
KeyspaceFeed`, keeps what Redis holds in a :class:`~hma_redis.tools.events.chunks.ChunkTable`
and publishes the changes as vLLM ``KVEventBatch`` es through vLLM's own
``ZmqEventPublisher`` (PUB socket, 8-byte sequence numbers, a ROUTER socket that replays the
last ``buffer_steps`` batches to a late subscriber). A resync of the feed becomes the
differences from what was believed (``BlockRemoved`` for what went missing, ``BlockStored`` for
what appeared); one whose data set was lost becomes ``AllBlocksCleared`` followed by the
chunks present since.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import parse_block_key
from hma_redis.core.redis.keyspace_feed import FeedItem, KeyChange, KeyspaceFeed, Resync
from hma_redis.tools.events.batches import View, to_events
from hma_redis.tools.events.chunks import Change, ChunkTable, Layout

logger = logging.getLogger(__name__)

KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

# At most this many events go into one batch (a resync of a large Redis is split).
MAX_EVENTS_PER_BATCH = 1000
# How often a namespace whose info hash is missing is looked up again.
_LAYOUT_RETRY_S = 2.0


@dataclass(frozen=True)
class EventsOptions:
    """What ``hma-redis events`` is told on its command line."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = "tcp://*:5558"
    buffer_steps: int = 10_000
    topic: str = ""
    namespace: str | None = None
    view: View = View.GROUPS
    int_hashes: bool = True
    poll_s: float = 0.05
    marker_check_s: float = 0.5
    rediscover_s: float = 5.0


class EventsService:
    """Publishes one Redis deployment's chunk changes until :meth:`run`'s ``stop`` is set.

    :attr:`published_batches` counts the batches sent; :meth:`step` is one round (tests).
    """

    def __init__(self, cfg: RedisTierConfig, options: EventsOptions) -> None:
        self._options = options
        self._feed = KeyspaceFeed(
            cfg,
            namespace=options.namespace,
            marker_check_s=options.marker_check_s,
            rediscover_s=options.rediscover_s,
        )
        self._table = ChunkTable(cfg.key_prefix, options.namespace)
        # Namespaces seen whose info hash was not read yet, and when each is tried next.
        self._unknown: set[str] = set()
        self._layout_tries: dict[str, float] = {}
        self._publisher = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=options.endpoint,
            replay_endpoint=options.replay_endpoint,
            buffer_steps=options.buffer_steps,
            topic=options.topic,
        )
        self.published_batches = 0
        logger.info(
            "hma_redis events: publishing %s view of %s on %s (replay: %s)",
            options.view.value,
            f"namespace {options.namespace}" if options.namespace else "every namespace",
            options.endpoint,
            options.replay_endpoint or "off",
        )

    @property
    def table(self) -> ChunkTable:
        return self._table

    def nodes(self) -> list[str]:
        """The data nodes subscribed now (``host:port`` of each Cluster master)."""
        return self._feed.node_names()

    def run(self, stop: threading.Event) -> None:
        """Publish until ``stop`` is set; Redis outages are waited out (the feed retries)."""
        while not stop.is_set():
            self.step()

    def step(self) -> int:
        """One poll of the feed; the number of events published."""
        items = self._feed.poll(self._options.poll_s)
        if items:
            return self._publish(self._apply(items))
        if self._unknown:  # an info hash written after its namespace's chunks
            return self._publish(self._to_events(self._read_layouts()))
        return 0

    def close(self) -> None:
        """Flush what is queued, close the sockets and the Redis connections."""
        self._publisher.shutdown()
        self._feed.close()

    # ------------------------------------------------------------------ internals

    def _apply(self, items: list[FeedItem]) -> list[KVEvent]:
        """The events (vLLM's) of the feed's items, in order."""
        events: list[KVEvent] = []
        changes: list[Change] = []
        for item in items:
            if isinstance(item, KeyChange):
                changes += self._learn_layouts([item.key])
                changes += self._table.apply(item.key, item.stored)
                continue
            if item.cleared:
                events += self._to_events(changes)
                changes = []
                events.append(AllBlocksCleared())
                self._table.clear()
            changes += self._resync(item)
        return events + self._to_events(changes)

    def _resync(self, resync: Resync) -> list[Change]:
        logger.info(
            "hma_redis events: resync (%s): %d chunk keys in Redis, %d believed",
            resync.reason,
            len(resync.keys),
            len(self._table),
        )
        believed = self._table.keys()
        changes = self._learn_layouts(resync.keys - believed)
        for key in sorted(believed - resync.keys):
            changes += self._table.apply(key, False)
        for key in sorted(resync.keys - believed):
            changes += self._table.apply(key, True)
        return changes

    def _learn_layouts(self, keys: Iterable[str]) -> list[Change]:
        """Learn the layout of every namespace of ``keys`` not known yet."""
        for key in keys:
            parts = parse_block_key(key)
            if parts is not None and self._table.layout(parts.namespace) is None:
                self._unknown.add(parts.namespace)
        return self._read_layouts()

    def _read_layouts(self) -> list[Change]:
        """Read the info hash of each namespace whose layout is unknown (each at most every
        ``_LAYOUT_RETRY_S``): the changes the layouts found cause."""
        changes: list[Change] = []
        now = time.monotonic()
        for namespace in sorted(self._unknown):
            tried = namespace in self._layout_tries
            if now < self._layout_tries.get(namespace, 0.0):
                continue
            self._layout_tries[namespace] = now + _LAYOUT_RETRY_S
            fields = self._feed.namespace_info(namespace)
            layout = Layout.from_info(fields) if fields else None
            if layout is None:
                if not tried:
                    logger.info("hma_redis events: namespace %s has no info hash yet", namespace)
                continue
            self._unknown.discard(namespace)
            changes += self._table.set_layout(namespace, layout)
        return changes

    def _to_events(self, changes: list[Change]) -> list[KVEvent]:
        layouts = self._table.layouts()
        return list(to_events(changes, self._options.view, layouts, self._options.int_hashes))

    def _publish(self, events: list[KVEvent]) -> int:
        for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
            batch = KVEventBatch(
                ts=time.time(), events=events[start : start + MAX_EVENTS_PER_BATCH]
            )
            self._publisher.publish(batch)
            self.published_batches += 1
        return len(events)
