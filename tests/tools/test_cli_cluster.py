"""The ``hma-redis`` CLI on a real 3-master Redis Cluster and a real Sentinel setup (no mocks).

Both run with an ACL user whose credentials the URL carries (the cluster's ``default`` user is
switched off), so every command is also shown to reach every node it talks to with them.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.cli.main import main
from hma_redis.tools.devkit.cluster import LocalCluster, LocalSentinel
from tests.support.cli_run import FINGERPRINT, Run, assert_one_line_error, run_script, write_blocks
from tests.support.cluster_servers import started_cluster, started_sentinel
from tests.support.doc_examples import abridge_doctor, check_readme_example

USER, PASSWORD = "ops", "cli-cluster-s3cret"
OTHER_NS = "other-deployment"
FOREIGN = ("user:session:1", "user:session:2", "hmax:not-ours")
# 12 chunks in group 0 and 6 in group 1: spread over all three masters.
CHUNKS = [(0, 16)] * 12 + [(1, 8)] * 6


@dataclass(frozen=True)
class Tier:
    url: str
    ns: str
    blocks: list[str]
    other_blocks: list[str]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    server = started_cluster(USER, PASSWORD)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sentinel() -> Iterator[LocalSentinel]:
    setup = started_sentinel(USER, PASSWORD)
    yield setup
    setup.stop()


def _populate(url: str, foreign: redis.Redis | RedisCluster) -> Tier:
    """Real encoded blocks of two namespaces, their info and stats, and foreign keys."""
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": url}, env={}))
    try:
        ns = FINGERPRINT.namespace_id()
        keys = KeySpace("hma", ns)
        blocks = write_blocks(store, keys, CHUNKS)
        assert store.write_info(keys.info_key(), FINGERPRINT.info_fields())
        foreign.hset(keys.stats_key(), mapping={"lookups": 7, "hit_chunks": 5})
        other = KeySpace("hma", OTHER_NS)
        other_blocks = write_blocks(store, other, [(0, 16)] * 4)
        assert store.write_info(other.info_key(), {"model": "another-model"})
    finally:
        store.close()
    for key in FOREIGN:
        foreign.set(key, b"keep me")
    return Tier(url, ns, blocks, other_blocks)


@pytest.fixture
def on_cluster(cluster: LocalCluster) -> Iterator[Tier]:
    cluster.flushall()
    client = RedisCluster(host="127.0.0.1", port=cluster.ports[0], username=USER, password=PASSWORD)
    try:
        yield _populate(cluster.url, client)
    finally:
        client.close()


@pytest.fixture
def on_sentinel(sentinel: LocalSentinel) -> Iterator[Tier]:
    with sentinel.data_client(sentinel.master_port()) as client:
        client.flushall()
        yield _populate(sentinel.url, client)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Any:
    """Run ``hma-redis --url URL ARGS...`` in-process."""

    def run(url: str, *args: str) -> Run:
        code = main(["--url", url, *args])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


def _owners(cluster: LocalCluster, keys: list[str]) -> Counter[str]:
    """How many of ``keys`` each master holds, by ``127.0.0.1:<port>``."""
    owners = cluster.slot_owners()
    return Counter(f"127.0.0.1:{owners[key_slot(k.encode())]}" for k in keys)


def _node_keys(cluster: LocalCluster, pattern: str) -> set[str]:
    """Every key matching ``pattern`` on every master, read node by node."""
    found: set[str] = set()
    for client in cluster.clients():
        with client:
            found |= {k.decode() for k in client.scan_iter(match=pattern, count=1000)}
    return found


def _verdicts(doctor: dict[str, Any]) -> dict[tuple[str, str | None], str]:
    """``doctor --json``'s verdicts by (check, node)."""
    return {(c["check"], c["node"]): c["verdict"] for c in doctor["checks"]}


# ---------------------------------------------------------------------------------- cluster


def test_info_sums_every_master_and_shows_each_share(on_cluster, cluster, cli):
    shares = _owners(cluster, on_cluster.blocks)
    assert len(shares) == 3  # the namespace really is spread over the three masters
    data = cli(on_cluster.url, "--json", "info").json()
    assert data["deployment"] == "Redis Cluster, 3 masters"
    assert sorted(data["nodes"]) == sorted(f"127.0.0.1:{p}" for p in cluster.ports)
    by_ns = {ns["namespace"]: ns for ns in data["namespaces"]}
    assert set(by_ns) == {on_cluster.ns, OTHER_NS}
    mine = by_ns[on_cluster.ns]
    assert mine["info"] == FINGERPRINT.info_fields()  # the info hash, from whichever master
    assert mine["stats"] == {"lookups": 7, "hit_chunks": 5}
    assert (mine["groups"]["0"]["keys"], mine["groups"]["1"]["keys"]) == (12, 6)
    assert {node: share["keys"] for node, share in mine["by_node"].items()} == dict(shares)
    assert mine["total"]["keys"] == sum(s["keys"] for s in mine["by_node"].values()) == 18
    assert data["unrecognized_keys"] == 0

    text = cli(on_cluster.url, "info", "--by-node")
    assert text.code == 0, text.err
    assert "(Redis Cluster, 3 masters), prefix 'hma': 2 namespaces" in text.out.splitlines()[0]
    section = text.out.split(f"namespace {on_cluster.ns}\n")[1].split("\nnamespace ")[0]
    node_rows = {
        line.split()[0]: int(line.split()[1])
        for line in section.splitlines()
        if line.strip().startswith("127.0.0.1:")
    }
    assert node_rows == dict(shares)
    assert "full attention" in section and "sliding window 512" in section


def test_ls_pages_through_every_master_exactly_once(on_cluster, cluster, cli):
    expected = _node_keys(cluster, "hma:*")
    owners = cluster.slot_owners()
    seen: list[str] = []
    cursor, pages = 0, 0
    while True:
        page = cli(on_cluster.url, "ls", "--limit", "4", "--cursor", str(cursor), "--json").json()
        for entry in page["keys"]:
            seen.append(entry["key"])
            assert entry["node"] == f"127.0.0.1:{owners[key_slot(entry['key'].encode())]}"
        pages += 1
        cursor = page["cursor"]
        if cursor == 0:
            break
    assert pages >= 3
    assert sorted(seen) == sorted(expected)  # both namespaces' blocks, info and stats; once each
    assert not any(k in FOREIGN for k in seen)
    text = cli(on_cluster.url, "ls", "--namespace", on_cluster.ns, "--group", "1", "--limit", "100")
    header = text.out.splitlines()[0].split()
    assert header == ["type", "value", "bytes", "memory", "ttl", "node", "key"]
    assert sum(1 for line in text.out.splitlines() if line.startswith("string")) == 6


def test_inspect_finds_a_block_on_any_master(on_cluster, cluster, cli):
    owners = cluster.slot_owners()
    one_per_master = {owners[key_slot(k.encode())]: k for k in on_cluster.blocks}
    assert len(one_per_master) == 3
    for key in one_per_master.values():
        data = cli(on_cluster.url, "--json", "inspect", key).json()
        assert data["valid"] and data["checksum_ok"] and data["key_matches"], data
    assert_one_line_error(cli(on_cluster.url, "inspect", f"hma:{on_cluster.ns}:g0:00"))


def test_purge_deletes_on_every_master_with_the_same_guards(on_cluster, cluster, cli):
    ns_keys = _node_keys(cluster, f"hma:{on_cluster.ns}:*")
    assert len(ns_keys) == 18 + 2  # blocks, info, stats
    dry = cli(on_cluster.url, "--json", "purge", "--namespace", on_cluster.ns, "--dry-run").json()
    assert dry["matching"] == 20 and sum(dry["by_node"].values()) == 20
    assert len(dry["by_node"]) == 3

    refused = run_script("--url", on_cluster.url, "purge", "--namespace", on_cluster.ns)
    assert_one_line_error(refused)
    assert "--yes" in refused.err and PASSWORD not in refused.err
    bad = cli(on_cluster.url, "purge", "--namespace", "*", "--yes")
    assert_one_line_error(bad)
    assert bad.code == 2
    assert _node_keys(cluster, f"hma:{on_cluster.ns}:*") == ns_keys  # nothing deleted

    run = cli(on_cluster.url, "--json", "purge", "--namespace", on_cluster.ns, "--yes")
    assert run.code == 0, run.err
    assert run.json()["deleted"] == 20
    assert run.json()["by_node"] == dict(Counter(_owners(cluster, sorted(ns_keys))))
    assert _node_keys(cluster, f"hma:{on_cluster.ns}:*") == set()
    assert _node_keys(cluster, f"hma:{OTHER_NS}:*") == {
        *on_cluster.other_blocks,
        f"hma:{OTHER_NS}:info",
    }
    assert _node_keys(cluster, "*") - _node_keys(cluster, "hma:*") == set(FOREIGN)

    everything = cli(on_cluster.url, "purge", "--all", "--yes", "--by-node")
    assert everything.code == 0, everything.err
    assert "deleted 5 keys matching 'hma:*'" in everything.out
    assert _node_keys(cluster, "*") == set(FOREIGN)


def test_purge_finishes_while_a_slot_of_the_namespace_is_being_migrated(on_cluster, cluster, cli):
    """A reshard under way: of three keys in one slot, one already sits on the importing
    node (which answers MOVED for it) and two on the migrating one. The purge deletes all of
    the namespace, on both, and says so."""
    extra = [f"hma:{on_cluster.ns}:extra:{{tag}}:{i}".encode() for i in range(3)]
    slot = key_slot(extra[0])
    source = cluster.slot_owners()[slot]
    target = next(p for p in cluster.ports if p != source)
    with cluster.clients()[cluster.ports.index(source)] as client:
        for key in extra:
            client.set(key, b"x")
    ns_keys = _node_keys(cluster, f"hma:{on_cluster.ns}:*")
    assert len(ns_keys) == 18 + 2 + 3
    cluster.start_moving_slot(slot, target, extra[:1])
    try:
        with cluster.clients()[cluster.ports.index(target)] as client:
            # On the importing node, which does not own its slot yet (it answers MOVED).
            assert list(client.scan_iter(match=extra[0])) == [extra[0]]
        run = cli(on_cluster.url, "--json", "purge", "--namespace", on_cluster.ns, "--yes")
        assert run.code == 0, run.err
        assert run.json()["deleted"] == len(ns_keys)
        assert _node_keys(cluster, f"hma:{on_cluster.ns}:*") == set()
        assert _node_keys(cluster, f"hma:{OTHER_NS}:*") == {
            *on_cluster.other_blocks,
            f"hma:{OTHER_NS}:info",
        }
    finally:
        cluster.settle_slot(slot)


def test_info_and_doctor_show_each_masters_memory_and_their_sums(on_cluster, cluster, cli):
    nodes = [f"127.0.0.1:{p}" for p in sorted(cluster.ports)]
    limits = dict(zip(nodes, [64 << 20, 128 << 20, 192 << 20], strict=True))
    clients = cluster.clients()
    try:
        for client, limit in zip(clients, limits.values(), strict=True):
            client.config_set("maxmemory", limit)
        memory = cli(on_cluster.url, "--json", "info").json()["memory"]
        assert {n: m["max_bytes"] for n, m in memory["by_node"].items()} == limits
        assert memory["max_bytes"] == sum(limits.values())
        assert memory["used_bytes"] == sum(m["used_bytes"] for m in memory["by_node"].values())
        for client, node in zip(clients, nodes, strict=True):
            used = client.info("memory")["used_memory"]
            # Read a moment apart: client buffers and the CLI's own connections come and go.
            assert abs(memory["by_node"][node]["used_bytes"] - used) < 256 * 1024

        lines = cli(on_cluster.url, "info").out.splitlines()
        assert lines[1].startswith("Redis memory: used ") and "of max 384.0 MiB" in lines[1]
        assert lines[2].split() == ["node", "used", "bytes", "used", "max", "bytes", "max"]
        rows = {line.split()[0]: line.split() for line in lines[3:6]}
        assert {n: int(row[4]) for n, row in rows.items()} == limits
        doctor = cli(on_cluster.url, "--json", "doctor").json()["checks"]
        details = {c["node"]: c["detail"] for c in doctor if c["check"] == "maxmemory"}
        assert {n: d.split(" of max ")[1].split(" (")[0] for n, d in details.items()} == {
            nodes[0]: "64.0 MiB",
            nodes[1]: "128.0 MiB",
            nodes[2]: "192.0 MiB",
        }
    finally:
        for client in clients:
            client.config_set("maxmemory", 0)
            client.close()


def test_doctor_checks_every_master_and_the_cluster_state(on_cluster, cluster, cli):
    run = cli(on_cluster.url, "--json", "doctor")
    data = run.json()
    verdicts = _verdicts(data)
    nodes = [f"127.0.0.1:{p}" for p in sorted(cluster.ports)]
    assert verdicts[("masters", None)] == "OK"
    for node in nodes:
        for check in ("connectivity", "version", "scripts", "cluster", "persistence"):
            assert verdicts[(check, node)] == "OK", (check, node, data)
        assert (("maxmemory", node)) in verdicts
    assert data["failed"] is False and run.code == 0
    text = cli(on_cluster.url, "doctor").out
    cluster_lines = [line for line in text.splitlines() if line.split()[1] == "cluster"]
    assert len(cluster_lines) == 3
    assert all("cluster_state:ok, 16384/16384 slots assigned, 0 failed" in x for x in cluster_lines)
    assert PASSWORD not in text


def test_a_dead_master_fails_doctor_and_stops_purge_before_it_starts(cli):
    try:
        broken = LocalCluster(masters=3, node_timeout_ms=1000).start()
    except RuntimeError as exc:
        pytest.fail(f"no Redis Cluster for the tests: {exc}", pytrace=False)
    try:
        client = RedisCluster(host="127.0.0.1", port=broken.ports[0])
        tier = _populate(broken.url, client)
        client.close()
        dead = broken.nodes[1]
        dead_name = f"127.0.0.1:{dead.port}"
        dead.stop()
        survivors = _node_keys_alive(broken, dead.port)

        purge = cli(tier.url, "purge", "--all", "--yes")
        assert_one_line_error(purge)
        assert _node_keys_alive(broken, dead.port) == survivors  # nothing deleted anywhere
        info = cli(tier.url, "info")
        assert_one_line_error(info)
        for run in (purge, info, cli(tier.url, "ls")):  # each names the node that failed
            assert f"master {dead_name}" in run.err, run.err

        deadline = time.monotonic() + 30
        while True:
            run = cli(tier.url, "--json", "doctor")
            verdicts = _verdicts(run.json())
            alive = [f"127.0.0.1:{p}" for p in broken.ports if p != dead.port]
            if all(verdicts.get(("cluster", n)) == "FAIL" for n in alive):
                break
            assert time.monotonic() < deadline, run.out
            time.sleep(0.5)
        assert run.code == 1
        assert verdicts[("connectivity", dead_name)] == "FAIL"
        assert all(verdicts[("connectivity", n)] == "OK" for n in alive)
        detail = next(c["detail"] for c in run.json()["checks"] if c["node"] == alive[0]
                      and c["check"] == "cluster")  # fmt: skip
        assert "cluster_state:fail" in detail
    finally:
        broken.stop()


def test_no_cluster_node_answering_is_one_line_and_a_doctor_fail(cli):
    from hma_redis.tools.devkit.local_redis import free_port

    url = f"redis+cluster://{USER}:{PASSWORD}@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/"
    for command in (["info"], ["ls"], ["purge", "--all", "--yes"], ["inspect", "hma:x:g0:00"]):
        run = cli(url, *command)
        assert_one_line_error(run)
        assert "no Redis Cluster node answered" in run.err and PASSWORD not in run.err
    doctor = cli(url, "doctor")
    assert doctor.code == 1
    assert doctor.out.splitlines()[-1].startswith("FAIL  connectivity")


def _node_keys_alive(cluster: LocalCluster, dead_port: int) -> set[str]:
    found: set[str] = set()
    for port in cluster.ports:
        if port == dead_port:
            continue
        with redis.Redis(port=port, socket_timeout=5) as client:
            found |= {k.decode() for k in client.scan_iter(count=1000)}
    return found


def test_the_readme_session_is_what_the_cli_prints_on_a_cluster(on_cluster, cli):
    """The README's session (regenerated from a real run on a cluster) has the shape of what the
    CLI prints: the fingerprint labels, the sizes and per-node table headers of ``info``, the
    ``ls`` header and the check names of ``doctor``."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    session = readme.read_text().split("## Operating it")[1].split("\n## ")[0]
    session_lines = [line.split() for line in session.splitlines()]
    info = cli(on_cluster.url, "info", "--by-node").out
    for label in ("model", "revision", "kv dtype", "layout", "parallel", "hash", "format"):
        assert re.search(rf"^  {label} +\S", session, re.M), label
        assert re.search(rf"^  {label} +\S", info, re.M), label
    for first in (["group", "attention"], ["node", "keys"]):
        header = next(line for line in info.splitlines() if line.split()[:2] == first)
        assert header.split() in session_lines
    ls_header = cli(on_cluster.url, "ls", "--limit", "1").out.splitlines()[0]
    assert ls_header.split() in session_lines
    doctor = cli(on_cluster.url, "doctor").out
    names = {line.split()[1] for line in doctor.splitlines()}
    shown = {line[1] for line in session_lines if line and line[0] in ("OK", "WARN", "FAIL")}
    assert len(shown) >= 10 and shown <= names


def test_the_readme_doctor_example_is_what_doctor_prints_on_a_cluster(on_cluster, cli, monkeypatch):
    """The README's doctor session, check by check, verdicts and wording, is what doctor prints
    on a 3-master cluster under an ACL user (addresses and numbers aside), run as an operator's
    shell would be: without the test suite's PYTHONHASHSEED."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    check_readme_example("doctor", abridge_doctor(cli(on_cluster.url, "doctor").out))


def test_the_readme_purge_example_is_what_a_dry_run_prints_on_a_cluster(on_cluster, cli):
    command = ["purge", "--namespace", on_cluster.ns, "--dry-run", "--by-node"]
    check_readme_example(" ".join(command), cli(on_cluster.url, *command).out)


# ---------------------------------------------------------------------------------- sentinel


def test_every_command_works_on_the_master_the_sentinels_name(on_sentinel, sentinel, cli):
    master = f"127.0.0.1:{sentinel.master_port()}"
    data = cli(on_sentinel.url, "--json", "info").json()
    assert data["deployment"] == f"Sentinel service 'hma-test', master {master}"
    assert data["nodes"] == [master]
    mine = next(ns for ns in data["namespaces"] if ns["namespace"] == on_sentinel.ns)
    assert (mine["groups"]["0"]["keys"], mine["groups"]["1"]["keys"]) == (12, 6)
    assert mine["info"] == FINGERPRINT.info_fields()
    text = cli(on_sentinel.url, "info").out
    assert f"(Sentinel service 'hma-test', master {master})" in text.splitlines()[0]

    listed = cli(on_sentinel.url, "--json", "ls", "--limit", "1000").json()
    assert len(listed["keys"]) == 18 + 2 + 4 + 1 and listed["cursor"] == 0
    assert cli(on_sentinel.url, "--json", "inspect", on_sentinel.blocks[0]).json()["valid"]

    doctor = cli(on_sentinel.url, "--json", "doctor").json()
    checks = {(c["check"], c["node"]): c for c in doctor["checks"]}
    assert checks[("sentinels", None)]["verdict"] == "OK"
    assert f"1/1 name {master} master of 'hma-test'" in checks[("sentinels", None)]["detail"]
    assert checks[("role", master)]["verdict"] == "OK"
    assert "1 connected replica" in checks[("role", master)]["detail"]
    assert checks[("connectivity", master)]["verdict"] == "OK"
    assert checks[("cluster", master)]["verdict"] == "OK"

    purged = cli(on_sentinel.url, "--json", "purge", "--namespace", on_sentinel.ns, "--yes")
    assert purged.json() == {
        "pattern": f"hma:{on_sentinel.ns}:*",
        "dry_run": False,
        "deleted": 20,
        "by_node": {master: 20},
    }
    with sentinel.data_client(sentinel.master_port()) as client:
        assert list(client.scan_iter(match=f"hma:{on_sentinel.ns}:*")) == []
        assert client.exists(*FOREIGN) == len(FOREIGN)


def test_purge_refuses_when_the_sentinels_name_different_masters(on_sentinel, sentinel, cli):
    """Two sentinels, each naming its own master for the service: purge (also a dry run)
    exits 1 with one line and deletes nothing on either."""
    other = started_sentinel(USER, PASSWORD)
    try:
        with other.data_client(other.master_port()) as client:
            _populate(other.url, client)
        url = (
            f"redis+sentinel://{USER}:{PASSWORD}@127.0.0.1:{sentinel.sentinel_port},"
            f"127.0.0.1:{other.sentinel_port}/{sentinel.service}/0"
        )
        masters = sorted(f"127.0.0.1:{s.master_port()}" for s in (sentinel, other))
        for extra in ([], ["--dry-run"]):
            run = cli(url, "purge", "--namespace", on_sentinel.ns, "--yes", *extra)
            assert_one_line_error(run)
            assert run.code == 1 and run.out == ""
            assert "sentinels do not agree" in run.err and "nothing deleted" in run.err
            assert all(master in run.err for master in masters), run.err
            assert PASSWORD not in run.err
        for setup in (sentinel, other):
            with setup.data_client(setup.master_port()) as client:
                assert len(list(client.scan_iter(match=f"hma:{on_sentinel.ns}:*"))) == 20
    finally:
        other.stop()


def test_doctor_fails_when_no_sentinel_answers(cli):
    from hma_redis.tools.devkit.local_redis import free_port

    url = f"redis+sentinel://{USER}:{PASSWORD}@127.0.0.1:{free_port()}/hma-test"
    run = cli(url, "doctor", "--connect-timeout", "0.5")
    assert run.code == 1
    lines = {line.split()[1]: line for line in run.out.splitlines()}
    assert lines["sentinels"].startswith("FAIL") and lines["connectivity"].startswith("FAIL")
    assert PASSWORD not in run.out + run.err
    assert_one_line_error(cli(url, "info", "--connect-timeout", "0.5"))


def test_info_follows_a_sentinel_failover(cli):
    setup = started_sentinel(USER, PASSWORD)
    try:
        with setup.data_client(setup.master_port()) as client:
            tier = _populate(setup.url, client)
        setup.wait_replicated()
        old = setup.master_port()
        new = setup.failover()
        assert new != old
        # The sentinel's master table (which redis-py reads) switches a moment after
        # get-master-addr-by-name (which the helper reads) does.
        deadline = time.monotonic() + 15
        while (data := cli(tier.url, "--json", "info").json())["nodes"] != [f"127.0.0.1:{new}"]:
            assert time.monotonic() < deadline, data["nodes"]
            time.sleep(0.2)
        mine = next(ns for ns in data["namespaces"] if ns["namespace"] == tier.ns)
        assert mine["total"]["keys"] == 18
    finally:
        setup.stop()


def test_a_redis_url_at_one_cluster_master_is_refused_with_the_cluster_url(
    on_cluster, cluster, cli
):
    port = cluster.ports[0]
    for command in (["info"], ["ls"], ["purge", "--all", "--yes"]):
        run = cli(f"redis://{USER}:{PASSWORD}@127.0.0.1:{port}/0", *command)
        assert_one_line_error(run)
        assert run.code == 2
        assert "one master of a Redis Cluster" in run.err
        assert f"use redis+cluster://127.0.0.1:{port}/ to reach every master" in run.err
    # Nothing was deleted on that master.
    assert _node_keys(cluster, "hma:*") >= set(on_cluster.blocks)
