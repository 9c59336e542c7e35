"""``hma-redis events`` against real Redis servers: every store and removal of the tier's chunks
(written here as the tier writes them: ``SET NX`` of ``<prefix>:<ns>:g<group>:<hash>``) reaches
a subscriber built on vLLM's own event classes exactly once; FLUSHALL and a restart are one
``AllBlocksCleared``; outages and a Cluster failover lose nothing and repeat nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from vllm.distributed.kv_events import MEDIUM_STORAGE, AllBlocksCleared, BlockStored
from vllm.v1.kv_offload.base import Locality

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.client import make_client
from hma_redis.tools.devkit.cluster import LocalCluster, LocalSentinel
from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.events.batches import View, block_hash
from tests.support.kv_subscriber import KVSubscriber, RunningPublisher, replay, wait_connected
from tests.support.tcp_proxy import BreakingProxy

NS = "ns1"


def _hash(n: int) -> str:
    return f"{n:064x}"


def _key(group: int, n: int, rank: int | None = None, ns: str = NS) -> str:
    return f"hma:{ns}:g{group}:{_hash(n)}" + ("" if rank is None else f":r{rank}")


def _info(client: redis.Redis | redis.RedisCluster, groups: int = 2, world: int = 1) -> None:
    fields = {"num_groups": str(groups), "world_size": str(world), "g0.kind": "full_attention"}
    if groups > 1:
        fields["g1.kind"] = "sliding_window:32"
    client.hset(f"hma:{NS}:info", mapping=fields)


def _counts(sub: KVSubscriber) -> dict[tuple[str, int, int | None], int]:
    """(kind, hash, group) -> how often the subscriber heard it, for namespace NS."""
    out: dict[tuple[str, int, int | None], int] = {}
    for event in sub.events(NS):
        if isinstance(event, AllBlocksCleared):
            out[("cleared", 0, None)] = out.get(("cleared", 0, None), 0) + 1
            continue
        kind = "stored" if isinstance(event, BlockStored) else "removed"
        for h in event.block_hashes:
            assert isinstance(h, int)
            ident = (kind, h, event.group_idx)
            out[ident] = out.get(ident, 0) + 1
    return out


def _h(n: int) -> int:
    return int(block_hash(_hash(n), True))


@pytest.fixture
def subscriber() -> Iterator[KVSubscriber]:
    sub = KVSubscriber()
    yield sub
    sub.close()


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    srv = LocalRedis().start()
    yield srv
    srv.stop()


def _publisher(url: str, sub: KVSubscriber, **options: object) -> RunningPublisher:
    return RunningPublisher(RedisTierConfig(url=url), sub, **options)


def test_stores_deletes_expiries_and_flushall_each_reach_the_router_once(
    server: LocalRedis, subscriber: KVSubscriber
) -> None:
    client = redis.Redis.from_url(server.url)
    _info(client)
    pub = _publisher(server.url, subscriber)
    try:
        wait_connected(client, subscriber)
        for n in (1, 2, 3):
            for group in (0, 1):
                assert client.set(_key(group, n), b"v", nx=True)
        assert not client.set(_key(0, 1), b"v", nx=True)  # SET NX of a key there: no event
        client.set(_key(0, 4), b"v", px=300)  # expires
        client.delete(_key(1, 2))
        subscriber.wait_for("the expiry", lambda: ("removed", _h(4), 0) in _counts(subscriber))
        client.flushall()
        subscriber.wait_for("the flush", lambda: ("cleared", 0, None) in _counts(subscriber))
        _info(client)
        client.set(_key(0, 5), b"v", nx=True)  # after the flush
        subscriber.wait_for(
            "a store after the flush", lambda: ("stored", _h(5), 0) in _counts(subscriber)
        )
        time.sleep(1.0)  # several marker checks: a flush is announced once
    finally:
        pub.close()
        client.close()
    counts = _counts(subscriber)
    assert not subscriber.seen.errors
    assert counts == {
        **{("stored", _h(n), g): 1 for n in (1, 2, 3) for g in (0, 1)},
        ("stored", _h(4), 0): 1,
        ("removed", _h(4), 0): 1,
        ("removed", _h(2), 1): 1,
        ("cleared", 0, None): 1,
        ("stored", _h(5), 0): 1,
    }
    assert subscriber.seen.seqs == list(range(len(subscriber.seen.seqs)))
    stored = [e for e in subscriber.events(NS) if isinstance(e, BlockStored)]
    assert {(e.medium, e.locality, tuple(e.token_ids), e.block_size) for e in stored} == {
        (MEDIUM_STORAGE, Locality.REMOTE.value, (), 0)  # what the engines send for the tier
    }
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored}
    assert kinds == {(0, "full_attention", None), (1, "sliding_window", 32)}


def test_the_usable_view_announces_a_chunk_once_every_group_and_rank_holds_it(
    server: LocalRedis, subscriber: KVSubscriber
) -> None:
    client = redis.Redis.from_url(server.url)
    _info(client, groups=2, world=2)
    pub = _publisher(server.url, subscriber, view=View.USABLE)
    try:
        wait_connected(client, subscriber)
        for group, rank in ((0, 0), (0, 1), (1, 0)):
            client.set(_key(group, 7, rank), b"v")
        client.set(_key(0, 8, 0), b"v")
        time.sleep(1.0)
        assert _counts(subscriber) == {}, "a chunk not held by every group and rank is usable"
        client.set(_key(1, 7, 1), b"v")
        subscriber.wait_for("usable", lambda: ("stored", _h(7), None) in _counts(subscriber))
        client.delete(_key(0, 7, 1))  # one rank of one group gone: no longer usable
        subscriber.wait_for("unusable", lambda: ("removed", _h(7), None) in _counts(subscriber))
        client.delete(_key(1, 7, 0))
        time.sleep(0.5)
    finally:
        pub.close()
        client.close()
    assert _counts(subscriber) == {("stored", _h(7), None): 1, ("removed", _h(7), None): 1}


def test_chunks_stored_before_their_namespace_info_become_usable_once_it_is_written(
    server: LocalRedis, subscriber: KVSubscriber
) -> None:
    client = redis.Redis.from_url(server.url)
    pub = _publisher(server.url, subscriber, view=View.USABLE)
    try:
        wait_connected(client, subscriber)
        client.set(_key(0, 3), b"v")
        client.set(_key(1, 3), b"v")
        time.sleep(0.5)
        assert _counts(subscriber) == {}  # no layout: nothing is known to be usable
        _info(client, groups=2)
        subscriber.wait_for("usable", lambda: ("stored", _h(3), None) in _counts(subscriber))
        time.sleep(0.5)
    finally:
        pub.close()
        client.close()
    assert _counts(subscriber) == {("stored", _h(3), None): 1}


def test_maxmemory_evictions_reach_the_router_once_each(subscriber: KVSubscriber) -> None:
    srv = LocalRedis(extra_args=["--maxmemory-policy", "allkeys-lru"]).start()
    client = redis.Redis.from_url(srv.url)
    client.config_set("notify-keyspace-events", "Ee")  # the test's own record (keyevents)
    watch = client.pubsub()
    watch.subscribe("__keyevent@0__:evicted")
    _info(client, groups=1)
    pub = _publisher(srv.url, subscriber)
    evicted: set[int] = set()
    try:
        wait_connected(client, subscriber)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 2_000_000)
        for n in range(100, 160):
            client.set(_key(0, n), b"x" * 100_000)
        while (message := watch.get_message(timeout=0.5)) is not None:
            key = message["data"].decode() if message["type"] == "message" else ""
            if key.startswith(f"hma:{NS}:g0:"):
                evicted.add(int(key.rsplit(":", 1)[1], 16))
        assert len(evicted) > 10, evicted

        def removed() -> set[int]:
            return {h for kind, h, _ in _counts(subscriber) if kind == "removed"}

        subscriber.wait_for("every eviction", lambda: removed() >= evicted)
        time.sleep(0.5)
    finally:
        pub.close()
        watch.close()
        client.close()
        srv.stop()
    counts = _counts(subscriber)
    assert {h for kind, h, _ in counts if kind == "removed"} == evicted
    assert {h for kind, h, _ in counts if kind == "stored"} == set(range(100, 160))
    assert all(n == 1 for n in counts.values()), counts


def test_a_restart_is_one_all_blocks_cleared_and_the_publisher_recovers(
    subscriber: KVSubscriber,
) -> None:
    srv = LocalRedis().start()
    client = redis.Redis.from_url(srv.url)
    _info(client)
    pub = _publisher(srv.url, subscriber)
    try:
        wait_connected(client, subscriber)
        client.set(_key(0, 1), b"v")
        subscriber.wait_for("a store", lambda: ("stored", _h(1), 0) in _counts(subscriber))
        srv.kill()
        time.sleep(1.5)  # an outage: the publisher retries
        srv.start()
        client = redis.Redis.from_url(srv.url)
        _info(client)
        client.set(_key(0, 2), b"v")
        subscriber.wait_for(
            "a store after the restart", lambda: ("stored", _h(2), 0) in _counts(subscriber), 30
        )
        time.sleep(1.0)
    finally:
        pub.close()
        client.close()
        srv.stop()
    assert _counts(subscriber) == {
        ("stored", _h(1), 0): 1,
        ("cleared", 0, None): 1,
        ("stored", _h(2), 0): 1,
    }
    assert subscriber.seen.seqs == list(range(len(subscriber.seen.seqs)))


def test_changes_made_while_the_connection_was_cut_arrive_after_it_heals(
    server: LocalRedis, subscriber: KVSubscriber
) -> None:
    """A network outage without a restart: what changed meanwhile comes from the resync (no
    AllBlocksCleared: the data set was never lost)."""
    proxy = BreakingProxy(server.port)
    client = redis.Redis.from_url(server.url)
    _info(client)
    pub = _publisher(proxy.url, subscriber)
    try:
        wait_connected(client, subscriber)
        client.set(_key(0, 1), b"v")
        client.set(_key(0, 2), b"v")
        subscriber.wait_for("the stores", lambda: ("stored", _h(2), 0) in _counts(subscriber))
        proxy.limit, proxy.mode = 0, "close"
        client.client_kill_filter(_type="pubsub")
        client.client_kill_filter(_type="normal", skipme=True)
        time.sleep(0.5)
        client.delete(_key(0, 1))
        client.set(_key(0, 3), b"v")
        time.sleep(1.0)
        proxy.limit = None
        subscriber.wait_for("the resync", lambda: ("stored", _h(3), 0) in _counts(subscriber), 30)
        time.sleep(0.5)
    finally:
        pub.close()
        client.close()
        proxy.close()
    assert _counts(subscriber) == {
        ("stored", _h(1), 0): 1,
        ("stored", _h(2), 0): 1,
        ("removed", _h(1), 0): 1,
        ("stored", _h(3), 0): 1,
    }


def test_a_late_subscriber_replays_every_batch_from_sequence_zero(
    server: LocalRedis, subscriber: KVSubscriber
) -> None:
    client = redis.Redis.from_url(server.url)
    _info(client)
    pub = _publisher(server.url, subscriber)
    try:
        wait_connected(client, subscriber)
        client.set(_key(0, 9), b"v")
        subscriber.wait_for("a store", lambda: ("stored", _h(9), 0) in _counts(subscriber))
        replayed = replay(pub.replay_endpoint, 0)
    finally:
        pub.close()
        client.close()
    assert [seq for seq, _ in replayed] == subscriber.seen.seqs
    events = [e for _, batch in replayed for e in batch.events]  # type: ignore[attr-defined]
    assert events == subscriber.events()


def test_a_cluster_failover_repeats_nothing_and_a_flush_removes_every_chunk(
    subscriber: KVSubscriber,
) -> None:
    cluster = LocalCluster(masters=3, replicas=1, node_timeout_ms=2000).start()
    client = make_client(RedisTierConfig(url=cluster.url))
    _info(client)
    pub = _publisher(cluster.url, subscriber)
    try:
        wait_connected(client, subscriber)
        for n in range(1, 31):
            client.set(_key(0, n), b"v")
        subscriber.wait_for("30 stores", lambda: len(_counts(subscriber)) == 30)
        cluster.wait_ok()
        old = cluster.ports[0]
        promoted = cluster.replica_of(old)
        cluster.failover(promoted)
        subscriber.wait_for(
            "the publisher to subscribe to the promoted master",
            lambda: f"127.0.0.1:{promoted}" in pub.service.nodes(),
        )
        assert f"127.0.0.1:{old}" not in pub.service.nodes()
        client.close()
        client = make_client(RedisTierConfig(url=cluster.url))
        for n in range(31, 61):
            client.set(_key(0, n), b"v")
        client.delete(_key(0, 1), _key(0, 2))
        subscriber.wait_for("60 stores", lambda: len(_counts(subscriber)) == 62, 30)
        assert _counts(subscriber) == {
            **{("stored", _h(n), 0): 1 for n in range(1, 61)},
            ("removed", _h(1), 0): 1,
            ("removed", _h(2), 0): 1,
        }
        # FLUSHALL on every master: each master's chunks are removed (other masters' would
        # stay valid, so a Cluster's flush is no AllBlocksCleared).
        client.flushall()
        subscriber.wait_for("every removal", lambda: len(_counts(subscriber)) == 120, 30)
        time.sleep(1.0)
    finally:
        pub.close()
        client.close()
        cluster.stop()
    assert _counts(subscriber) == {
        (kind, _h(n), 0): 1 for n in range(1, 61) for kind in ("stored", "removed")
    }


def test_a_sentinel_failover_repeats_nothing_and_loses_nothing(subscriber: KVSubscriber) -> None:
    """The publisher follows the master the sentinel names; the promoted replica holds the same
    chunks (and the marker): a resync with no difference, then its own stores."""
    sentinel = LocalSentinel().start()
    master = sentinel.data_client(sentinel.master_port())
    _info(master)
    pub = _publisher(sentinel.url, subscriber)
    try:
        wait_connected(master, subscriber)
        for n in range(1, 11):
            master.set(_key(0, n), b"v")
        subscriber.wait_for("10 stores", lambda: len(_counts(subscriber)) == 10)
        sentinel.wait_replicated()
        master.close()
        master = sentinel.data_client(sentinel.failover())
        for n in range(11, 21):
            master.set(_key(0, n), b"v")
        subscriber.wait_for("20 stores", lambda: len(_counts(subscriber)) == 20, 30)
        time.sleep(1.0)
    finally:
        pub.close()
        master.close()
        sentinel.stop()
    assert _counts(subscriber) == {("stored", _h(n), 0): 1 for n in range(1, 21)}
