"""A router's side of ``hma-redis events``: a ZMQ subscriber that decodes every batch with
vLLM's own ``KVEventBatch``, a replay request, and the publisher run in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import redis
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from hma_redis.core.config import RedisTierConfig
from hma_redis.tools.devkit.local_redis import free_port
from hma_redis.tools.events.service import EventsOptions, EventsService

PROBE_NAMESPACE = "probe"


@dataclass
class Seen:
    """What a subscriber decoded, in order."""

    seqs: list[int] = field(default_factory=list)
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class KVSubscriber:
    """A SUB socket bound on a loopback port (the publisher connects to it, as vLLM's publisher
    does to a non-wildcard endpoint), decoding in a thread."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.seen = Seen()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            _topic, seq, payload = self._sub.recv_multipart()
            try:
                batch = self._decoder.decode(payload)
            except msgspec.DecodeError as exc:
                self.seen.errors.append(str(exc))
                continue
            with self._lock:
                self.seen.seqs.append(int.from_bytes(seq, "big"))
                self.seen.events.extend(batch.events)

    def events(self, namespace: str | None = None) -> list[object]:
        """Events so far (of ``namespace`` only: AllBlocksCleared and that namespace's)."""
        with self._lock:
            events = list(self.seen.events)
        if namespace is None:
            return events
        owner = f"hma_redis:{namespace}"
        return [e for e in events if isinstance(e, AllBlocksCleared) or e.ownership == owner]

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {self.events()[-10:]}")
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._ctx.term()


def replay(endpoint: str, start_seq: int, timeout_s: float = 10.0) -> list[tuple[int, object]]:
    """Ask the publisher's ROUTER for every batch from ``start_seq``: (seq, batch) pairs."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    out: list[tuple[int, object]] = []
    try:
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                raise AssertionError("no end-of-replay marker")
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()


class RunningPublisher:
    """An :class:`EventsService` publishing to ``subscriber`` from a thread."""

    def __init__(self, cfg: RedisTierConfig, subscriber: KVSubscriber, **options: object) -> None:
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        opts = {
            "endpoint": subscriber.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "marker_check_s": 0.2,
            "rediscover_s": 1.0,
            **options,
        }
        self.service = EventsService(cfg, EventsOptions(**opts))  # type: ignore[arg-type]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.service.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.service.close()


def wait_connected(client: redis.Redis | redis.RedisCluster, subscriber: KVSubscriber) -> None:
    """Write probe chunks (namespace ``probe``) until the subscriber hears one: from then on
    its subscription has reached the publisher (ZMQ drops what a PUB sends before that)."""
    deadline = time.monotonic() + 30
    n = 0
    # One group, one rank: a probe chunk is usable too (the usable view hears it).
    client.hset(f"hma:{PROBE_NAMESPACE}:info", mapping={"num_groups": "1", "world_size": "1"})
    while not subscriber.events(PROBE_NAMESPACE):
        if time.monotonic() > deadline:
            raise AssertionError("the subscriber never heard a probe chunk")
        client.set(f"hma:{PROBE_NAMESPACE}:g0:{n:064x}", b"x")
        n += 1
        time.sleep(0.2)
