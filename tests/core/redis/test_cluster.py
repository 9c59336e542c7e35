"""The store and the transfer engine against a real 3-master Redis Cluster (no mocks).

The cluster runs with an ACL user and its ``default`` user switched off, so every test also
shows that the URL's credentials reach every node, including those found through CLUSTER SLOTS.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from hma_redis.core.config import EndpointKind, RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.breaker import BreakerState
from hma_redis.core.redis.store import RedisBlockStore, RedisUnavailableError
from hma_redis.tools.devkit.cluster import LocalCluster
from hma_redis.tools.devkit.local_redis import free_port
from tests.core.transfer.test_cpu_pages import FAULT_IDS, FAULTS, _unchanged_unless_landed, damage
from tests.support.cluster_servers import started_cluster
from tests.support.kv_pages import DST, HASHES, SRC, chunks, make_pages
from tests.support.redis_server import store_connections

USER, PASSWORD = "tier", "cluster-s3cret"
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    server = started_cluster(USER, PASSWORD)
    yield server
    server.stop()


@pytest.fixture
def clean(cluster: LocalCluster) -> LocalCluster:
    cluster.flushall()
    return cluster


def _store(url: str, stats_key: str | None = None, **overrides: object) -> RedisBlockStore:
    extra = {"redis_url": url, "read_timeout_s": READ_TIMEOUT_S, **overrides}
    return RedisBlockStore(RedisTierConfig.from_extra_config(extra, env={}), stats_key=stats_key)


def _keys(namespace: str, groups: int = 3, per_group: int = 40) -> list[str]:
    ks = KeySpace("hma", namespace)
    return [ks.block_key(g, i.to_bytes(8, "big")) for g in range(groups) for i in range(per_group)]


def _per_node(cluster: LocalCluster, keys: list[str]) -> Counter[int]:
    owners = cluster.slot_owners()
    return Counter(owners[key_slot(k.encode())] for k in keys)


def _stats(client: redis.Redis) -> dict[str, int]:
    """Read events and per-command calls, from one INFO call (itself one read event)."""
    info = client.info("stats", "commandstats")
    calls = {
        n.removeprefix("cmdstat_"): int(v["calls"]) for n, v in info.items() if n[:8] == "cmdstat_"
    }
    return {"reads": int(info["total_reads_processed"]), **calls}


@pytest.mark.parametrize(
    ("url", "hosts", "tls"),
    [
        ("redis+cluster://h1:7000,h2:7001/", (("h1", 7000), ("h2", 7001)), False),
        ("redis+cluster://h1", (("h1", 6379),), False),
        ("rediss+cluster://u:p%40ss@h1:7000,[::1]:7001/0", (("h1", 7000), ("::1", 7001)), True),
    ],
)
def test_cluster_url_forms(url: str, hosts: tuple[tuple[str, int], ...], tls: bool) -> None:
    cfg = RedisTierConfig.from_extra_config({"redis_url": url}, env={})
    assert cfg.endpoint.kind is EndpointKind.CLUSTER
    assert (cfg.endpoint.hosts, cfg.tls, cfg.db) == (hosts, tls, 0)
    if "@" in url:
        assert (cfg.username, cfg.password) == ("u", "p@ss")
        assert "p%40ss" not in cfg.redacted_url and "***@h1:7000,[::1]:7001" in cfg.redacted_url


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("redis+cluster://h1:7000/2", "db must be 0"),
        ("redis+cluster://u:pw@h1:7000,h2:99999/", "invalid host or port"),
        ("redis+cluster://u:pw@h1:7000,,h2/", "invalid host or port"),
        ("redis+cluster:///", "no host"),
    ],
)
def test_bad_cluster_urls_fail_with_one_redacted_line(url: str, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        RedisTierConfig.from_extra_config({"redis_url": url}, env={})
    assert ":pw@" not in str(info.value) and "\n" not in str(info.value)


def test_cluster_url_gives_a_cluster_client_with_the_tier_timeouts(clean: LocalCluster) -> None:
    store = _store(clean.url, connect_timeout_s=0.7, pool_size=3)
    try:
        assert isinstance(store.client, RedisCluster)
        store.ping()
        store.exists(_keys("opts"))  # connect to every node
        nodes = store.client.get_nodes()
        assert sorted(n.port for n in nodes) == sorted(clean.ports)
        for node in nodes:
            pool = node.redis_connection.connection_pool
            assert isinstance(pool, redis.BlockingConnectionPool)
            assert pool.max_connections == 3
            kwargs = pool.connection_kwargs
            assert kwargs["socket_timeout"] == READ_TIMEOUT_S
            assert kwargs["socket_connect_timeout"] == 0.7
            assert (kwargs["username"], kwargs["password"]) == (USER, PASSWORD)
            assert kwargs["retry"].get_retries() == 0
        assert store.client.retry.get_retries() == 0
        # Values go through connections whose packer never copies them.
        bulk_node = store._bulk.get_nodes()[0]
        connection_class = bulk_node.redis_connection.connection_pool.connection_class
        assert connection_class.__name__ == "ZeroCopyConnection"
    finally:
        store.close()


def test_exists_across_three_groups_returns_exact_flags(clean: LocalCluster) -> None:
    store = _store(clean.url)
    keys = _keys("flags")
    present = [k for i, k in enumerate(keys) if i % 3 == 0 or i % 7 == 1]
    assert set(store.put_if_absent([(k, b"v") for k in present])) == {PutResult.STORED}
    assert store.exists(keys) == [k in present for k in keys]
    # The keys really are spread over the three masters.
    assert all(n > 0 for n in _per_node(clean, present).values())
    assert len(_per_node(clean, present)) == 3
    store.close()


def test_a_lookup_is_one_round_trip_per_node_with_the_counters_riding_along(
    clean: LocalCluster,
) -> None:
    ks = KeySpace("hma", "trips")
    store = _store(clean.url, stats_key=ks.stats_key())
    keys = _keys("trips")
    store.put_if_absent([(k, b"v") for k in keys[::2]])
    store.exists(keys)  # every node's connection is open: no HELLO inside the measurement
    clients = clean.clients()
    store.counters.add(lookups=1, lookup_keys=len(keys))
    trips = store.round_trips
    before = [_stats(c) for c in clients]
    found = store.exists(keys)
    after = [_stats(c) for c in clients]
    assert found == [i % 2 == 0 for i in range(len(keys))]
    assert store.round_trips == trips + 1

    expected = _per_node(clean, keys)
    stats_port = clean.slot_owners()[key_slot(ks.stats_key().encode())]
    for client, b, a, port in zip(clients, before, after, clean.ports, strict=True):
        delta = {k: a.get(k, 0) - b.get(k, 0) for k in a}
        # One batch per node: usually one read event (the other one is our second INFO). TCP may
        # split the batch into a few reads on a loaded machine, but never one read per key.
        assert 1 <= delta["reads"] - 1 < max(4, expected[port] // 4), (port, delta)
        # One EXISTS per key that lives on this node, nothing else (no per-key GETKEYS).
        assert delta.get("exists", 0) == expected[port], (port, delta)
        assert delta.get("command|getkeys", 0) == 0, (port, delta)
        assert delta.get("hincrby", 0) == (2 if port == stats_port else 0), (port, delta)
        client.close()
    with clean.clients()[clean.ports.index(stats_port)] as client:
        counters = client.hgetall(ks.stats_key())
    assert counters == {b"lookups": b"1", b"lookup_keys": str(len(keys)).encode()}
    store.close()


def test_a_cluster_store_names_its_connections_on_every_master(clean: LocalCluster) -> None:
    store = _store(clean.url)
    try:
        keys = _keys("named")
        assert set(store.put_if_absent([(k, b"v") for k in keys])) == {PutResult.STORED}
        assert all(store.exists(keys))
        for client in clean.clients():
            with client:
                assert store_connections(client, store.client_name) >= 1
    finally:
        store.close()


def test_put_get_and_dedup(clean: LocalCluster) -> None:
    store = _store(clean.url)
    keys = _keys("values", per_group=20)
    values = {k: os.urandom(64 * 1024) for k in keys}
    # memoryviews go through the zero-copy packer of the bulk client.
    first = store.put_if_absent([(k, memoryview(v)) for k, v in values.items()])
    assert first == [PutResult.STORED] * len(keys)
    store.drop_value_connections()  # the next value call reconnects to every node it needs
    again = store.put_if_absent([(k, b"other") for k in keys[:10]] + [(keys[0] + "x", b"n")])
    assert again == [PutResult.EXISTED] * 10 + [PutResult.STORED]
    assert store.get([*keys, "hma:values:missing"]) == [*(values[k] for k in keys), None]
    assert store.delete(keys[:5]) == 5
    assert store.exists(keys[:6]) == [False] * 5 + [True]
    assert store.breaker.state is BreakerState.CLOSED
    store.close()


def test_buffered_pages_keep_storing_after_loads(clean: LocalCluster) -> None:
    """Pages the engine cannot address in place (a GPU's, here a strided CPU view) go through
    pooled buffers: buffers that served loads are reused by stores."""
    store = _store(clean.url)
    pages = make_pages(store, strided=True)
    try:
        assert pages.store_job(1, chunks(SRC)).ok
        assert pages.load_job(2, chunks(DST)).ok
        assert pages.moved(SRC, DST)
        others = tuple([h[:-1] + b"\xee" for h in group] for group in HASHES)  # same sizes
        assert pages.store_job(3, chunks(SRC, others)).ok
        totals = store.counters.snapshot()
        assert totals["stored_chunks"] == 8
        assert totals.get("store_failed_chunks", 0) == 0
        found = 0
        for client in clean.clients():
            with client:
                found += sum(1 for _ in client.scan_iter(match="hma:worker-test:g*"))
        assert found == 8
    finally:
        pages.close()
        store.close()


def test_a_resharded_slot_is_followed_by_redirection(clean: LocalCluster) -> None:
    store = _store(clean.url)
    keys = _keys("moved", groups=1, per_group=30)
    store.put_if_absent([(k, b"v") for k in keys])
    assert store.exists(keys) == [True] * len(keys)  # the client has cached the slot table
    slot = key_slot(keys[0].encode())
    owner = clean.slot_owners()[slot]
    target = next(p for p in clean.ports if p != owner)
    clean.move_slot(slot, target)

    assert store.exists(keys) == [True] * len(keys)
    assert store.get(keys[:1]) == [b"v"]
    new_key = next(
        k for k in (f"hma:moved:g0:{i:x}" for i in range(100000)) if key_slot(k.encode()) == slot
    )
    assert store.put_if_absent([(new_key, b"n")]) == [PutResult.STORED]
    with redis.Redis(port=target, username=USER, password=PASSWORD) as client:
        assert client.get(new_key) == b"n"
    assert store.breaker.state is BreakerState.CLOSED
    store.close()


def test_a_stalled_node_costs_at_most_two_timeouts_then_the_tier_recovers(
    clean: LocalCluster,
) -> None:
    store = _store(clean.url, retry_interval_s=0.5)
    keys = _keys("stall")
    store.put_if_absent([(k, b"v") for k in keys])
    assert store.exists(keys) == [True] * len(keys)
    node = clean.nodes[1]
    node.pause()
    try:
        t0 = time.monotonic()
        found = store.exists(keys)
        took = time.monotonic() - t0
        assert found == [False] * len(keys)
        assert store.breaker.state is BreakerState.OPEN
        # redis-py alone would re-send each of the node's ~40 commands with its own timeout.
        assert took < 2 * READ_TIMEOUT_S + 1.0, took
        assert store.put_if_absent([(keys[0], b"w")]) == [PutResult.FAILED]  # breaker: at once
    finally:
        node.resume()
    clean.wait_ok()
    deadline = time.monotonic() + 10
    while store.exists(keys) != [True] * len(keys):
        assert time.monotonic() < deadline, "the tier did not come back after the node resumed"
        time.sleep(0.2)
    assert store.breaker.state is BreakerState.CLOSED
    store.close()


def test_no_reachable_node_degrades_and_never_raises() -> None:
    # Ports nothing listens on: building the store works (as with a plain URL), every call
    # degrades, and ping() gives one clear, redacted line.
    hosts = ",".join(f"127.0.0.1:{free_port()}" for _ in range(3))
    url = f"redis+cluster://{USER}:{PASSWORD}@{hosts}/"
    store = _store(url, retry_interval_s=0.05, connect_timeout_s=0.2)
    assert store.exists(["hma:x:g0:00"]) == [False]
    time.sleep(0.06)
    assert store.put_if_absent([("hma:x:g0:00", b"v")]) == [PutResult.FAILED]
    time.sleep(0.06)
    assert store.get(["hma:x:g0:00"]) == [None]
    with pytest.raises(RedisUnavailableError) as info:
        store.ping()
    assert PASSWORD not in str(info.value) and "***" in str(info.value)
    store.close()


def test_native_jobs_run_node_by_node_and_read_back_on_the_python_path(
    clean: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a Cluster the C job and its pure-Python twin (``HMA_REDIS_NATIVE=0``) both send
    each node its own keys on a connection to that node; what one stores, the other reads
    back byte for byte."""
    store = _store(clean.url, stats_key="hma:stats:worker-test")
    native = make_pages(store)
    assert native.store.native and native.engine.loads_land_in_place
    monkeypatch.setenv("HMA_REDIS_NATIVE", "0")
    twin = _store(clean.url, stats_key="hma:stats:worker-test")
    python = make_pages(twin)
    assert not python.store.native
    try:
        assert native.store_job(1, chunks(SRC)).ok
        stored = [c.redis_key for c in chunks(SRC)]
        assert len(_per_node(clean, stored)) >= 2  # the job spanned nodes
        assert python.load_job(2, chunks(DST)).ok
        assert python.moved(SRC, DST)

        others = tuple([h[:-1] + b"\xdd" for h in group] for group in HASHES)
        assert python.store_job(3, chunks(SRC, others)).ok
        assert native.load_job(4, chunks(DST, others)).ok
        assert native.moved(SRC, DST)
        # Both stores' counters reach the stats key (on the stats key's node).
        store.flush()
        twin.flush()
        totals = {k: int(v) for k, v in store.read_hash("hma:stats:worker-test").items()}
        assert totals.get("stored_chunks", 0) >= 4 and totals.get("loaded_chunks", 0) >= 4
    finally:
        native.close()
        python.close()
        store.close()
        twin.close()


@pytest.mark.parametrize("path", ["native", "twin"])
def test_a_native_load_of_a_moved_key_fails_whole_then_the_next_one_succeeds(
    clean: LocalCluster,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slot resharded after the client learnt the slot table: the node answers MOVED, the
    job fails (its blocks are recomputed, never half-filled from a guess) and the next job,
    on the refreshed table, loads every byte."""
    if path == "twin":  # as TLS runs it
        monkeypatch.setenv("HMA_REDIS_NATIVE", "0")
    store = _store(clean.url)
    pages = make_pages(store)
    assert pages.store.native == (path == "native")
    try:
        assert pages.store_job(1, chunks(SRC)).ok
        assert pages.load_job(2, chunks(DST)).ok
        key = chunks(SRC)[0].redis_key
        slot = key_slot(key.encode())
        target = next(p for p in clean.ports if p != clean.slot_owners()[slot])
        clean.move_slot(slot, target)

        assert not pages.load_job(3, chunks(DST)).ok
        assert store.breaker.state is BreakerState.CLOSED  # a refusal, not an outage
        assert pages.load_job(4, chunks(DST)).ok
        assert pages.moved(SRC, DST)
    finally:
        pages.close()
        store.close()


@pytest.mark.parametrize("path", ["native", "twin"])
def test_native_loads_and_stores_follow_ask_while_a_slot_migrates(
    clean: LocalCluster, path: str, monkeypatch: pytest.MonkeyPatch, pieces: str
) -> None:
    """While a slot is MIGRATING its old owner answers ASK for keys it no longer (or never)
    held: a native load of a key already moved, and a native store of a new key, follow the
    ASK to the importing node (ASKING first) and succeed; nothing is counted as refused."""
    if path == "twin":  # as TLS runs it
        monkeypatch.setenv("HMA_REDIS_NATIVE", "0")
    store = _store(clean.url, stats_key="hma:stats:worker-test")
    pages = make_pages(store)
    assert pages.store.native == (path == "native")
    others = tuple([h[:-1] + b"\xee" for h in group] for group in HASHES)
    moved_key = chunks(SRC)[0].redis_key
    new_key = chunks(SRC, others)[0].redis_key
    migrating: list[tuple[int, int]] = []
    try:
        assert pages.store_job(1, chunks(SRC)).ok
        owners = clean.slot_owners()
        for key in (moved_key, new_key):
            slot = key_slot(key.encode())
            target = next(p for p in clean.ports if p != owners[slot])
            clean.begin_migration(slot, target)  # moves moved_key; new_key is not stored yet
            migrating.append((slot, target))

        assert pages.load_job(2, chunks(DST)).ok  # moved_key is on its new node only
        assert pages.moved(SRC, DST)
        assert pages.store_job(3, chunks(SRC, others)).ok
        assert pages.load_job(4, chunks(DST, others)).ok  # new_key went to the new node
        assert pages.moved(SRC, DST)
        for slot, target in migrating:
            with redis.Redis(port=target, username=USER, password=PASSWORD) as node:
                assert node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 1
        store.flush()
        totals = store.counters.totals
        assert not any(totals.get(f"refused_{kind}", 0) for kind in ("other", "noperm"))
        assert totals.get("store_failed_chunks", 0) == 0
    finally:
        for slot, target in migrating:
            clean.end_migration(slot, target)
        pages.close()
        store.close()


def test_a_cluster_down_at_start_serves_native_loads_and_stores_once_it_is_up() -> None:
    """A worker built while no node answers (the cluster starts after it): jobs fail while
    the cluster is down, then the native path finds the topology by itself and stores and
    loads every byte, without a restart."""
    later = LocalCluster(masters=3, username=USER, password=PASSWORD)
    store = _store(later.url, retry_interval_s=0.1, connect_timeout_s=0.2)
    pages = make_pages(store)
    assert pages.store.native
    try:
        assert not pages.load_job(1, chunks(DST)).ok
        later.start()
        deadline = time.monotonic() + 60
        job = 2
        while True:
            pages.store_job(job, chunks(SRC))
            if pages.load_job(job + 1, chunks(DST)).ok:
                break
            assert time.monotonic() < deadline, "the native path never recovered"
            job += 2
            time.sleep(0.2)
        assert pages.moved(SRC, DST)
        assert len(_per_node(later, [c.redis_key for c in chunks(SRC)])) >= 2
    finally:
        pages.close()
        store.close()
        later.stop()


@pytest.mark.parametrize("path", ["native", "twin"])
@pytest.mark.parametrize("fault", FAULTS, ids=FAULT_IDS)
def test_a_damaged_value_on_any_node_fails_the_load_and_leaves_its_pages_as_before_or_zero(
    clean: LocalCluster, path: str, fault: Any, monkeypatch: pytest.MonkeyPatch, pieces: str
) -> None:
    """Faults the way the world makes them, on a Cluster: the job's values spread over the
    nodes, each damaged in place (random bytes over the middle half, a NaN/Inf body, a cut
    value, another key's valid value, one deleted). The load fails whole, and every page holds
    what it held before or zeros: the node-by-node job never leaves a byte of a value that
    failed on one node in a page, whatever the other nodes answered. Damaged values are
    deleted, so a recompute's store can heal them."""
    store = _store(clean.url)
    if path == "twin":
        monkeypatch.setenv("HMA_REDIS_NATIVE", "0")
    pages = make_pages(store)
    client = RedisCluster(host="127.0.0.1", port=clean.ports[0], username=USER, password=PASSWORD)
    try:
        assert pages.store_job(1, chunks(SRC)).ok
        keys = [c.redis_key for c in chunks(SRC)]
        assert len(_per_node(clean, keys)) >= 2
        damage(client, keys, fault, random.Random(17))

        before = [t.clone() for t in pages.tensors]
        assert not pages.load_job(2, chunks(DST)).ok
        assert _unchanged_unless_landed(before, pages, DST), "a page holds bytes of a failed load"
        if fault != "one-missing":
            assert not any(client.exists(k) for k in keys), "a damaged value was kept"
    finally:
        client.close()
        pages.close()
        store.close()


def test_the_tenants_account_keeps_true_across_three_masters(clean: LocalCluster) -> None:
    """Per-tenant quotas on a Cluster: the account's scripts run on its hash's one slot while
    the chunks they name live on every master; removals and the reconcile check the chunks on
    their own nodes (one pipeline routed by key)."""
    space = KeySpace("hma", "quotas")
    cfg = RedisTierConfig.from_extra_config(
        {"redis_url": clean.url, "read_timeout_s": READ_TIMEOUT_S, "tenant_quotas": True}, env={}
    )
    store = RedisBlockStore(cfg, quota_space=space)
    keys = [space.block_key(0, i.to_bytes(8, "big")) for i in range(60)]
    assert len(_per_node(clean, keys)) == 3
    assert set(store.put_if_absent([(k, b"v" * 10) for k in keys])) == {PutResult.STORED}
    store.account_stored("aaaaaaaaaaaaaaaa", keys[:40], [10] * 40)
    store.account_stored("bbbbbbbbbbbbbbbb", keys[40:], [10] * 20)
    snapshot = store.quota_snapshot(["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"])
    assert snapshot is not None and dict(snapshot.used) == {
        "aaaaaaaaaaaaaaaa": 400,
        "bbbbbbbbbbbbbbbb": 200,
    }
    assert store.delete(keys[:10] + keys[50:]) == 20
    freed = store.account_removed(keys[:5])
    assert freed is not None and freed.records == 5
    done = store.reconcile_quota(0)
    while done is not None and done.cursor:
        done = store.reconcile_quota(done.cursor)
    snapshot = store.quota_snapshot(["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"])
    assert snapshot is not None and dict(snapshot.used) == {
        "aaaaaaaaaaaaaaaa": 300,
        "bbbbbbbbbbbbbbbb": 100,
    }
    store.close()
