"""The Redis servers of the GPU check: one ``redis-server`` and a 3-shard Redis Cluster on
loopback ports, persistence off (``--save '' --appendonly no``), I/O threads matched to the host.

Both start from the ``redis-server`` on PATH (``scripts/gpu_check.sh`` puts the bundled binary
first there). The cluster is formed with ``CLUSTER ADDSLOTSRANGE`` and ``CLUSTER MEET`` from
redis-py rather than ``redis-cli --cluster create``, so the bundle carries one binary.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from hma_redis.tools.devkit.local_redis import LocalRedis, cluster_node_args, free_port

CLUSTER_SLOTS = 16384
_READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class IoThreads:
    """``io-threads`` of the single server and of each cluster shard.

    Redis' own guidance (redis.conf) is to leave cores free: 2-3 threads on 4 cores, 6 on 8, and
    rarely more than 8. Here the client (the transfer engine's threads and the GPU's copies)
    shares the host, so the servers together get about half of it: a quarter of the cores for
    the single server, an eighth for each of the three shards (16 cores: 4 and 2).
    """

    single: int
    shard: int

    @classmethod
    def for_host(cls, cores: int) -> IoThreads:
        return cls(single=max(1, min(8, cores // 4)), shard=max(1, min(4, cores // 8)))


def redis_version() -> str:
    """The version of the ``redis-server`` on PATH (``"7.0.15"``); RuntimeError without one."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found on PATH (scripts/gpu_check.sh puts it there)")
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    )
    found = re.search(r"v=(\d+\.\d+\.\d+)", out.stdout)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"redis-server --version failed: {(out.stdout + out.stderr).strip()}")
    return found.group(1)


def io_thread_args(threads: int, version: str) -> list[str]:
    """Server arguments for ``threads`` I/O threads (none for 1, Redis' default). Redis 7 only
    reads on those threads with ``io-threads-do-reads yes``; Redis 8 always does."""
    if threads <= 1:
        return []
    args = ["--io-threads", str(threads)]
    if int(version.split(".")[0]) < 8:
        args += ["--io-threads-do-reads", "yes"]
    return args


def start_single(io_threads: int, version: str) -> LocalRedis:
    """A started ``redis-server`` on a free loopback port (persistence off)."""
    return LocalRedis(extra_args=io_thread_args(io_threads, version)).start()


class LocalShards:
    """A Redis Cluster of ``shards`` primaries (no replicas) on loopback ports, each owning an
    equal range of slots; ready once every node reports ``cluster_state:ok``."""

    def __init__(self, shards: int, io_threads: int, version: str) -> None:
        self.shards = shards
        self._extra = io_thread_args(io_threads, version)
        self.nodes: list[LocalRedis] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis+cluster://{hosts}/"

    def start(self) -> LocalShards:
        """Start the nodes, assign the slots, join them and wait until the cluster is ok."""
        try:
            bus_ports = self._start_nodes()
            self._assign_slots()
            self._meet(bus_ports)
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_nodes(self) -> list[int]:
        ports: set[int] = set()
        while len(ports) < 2 * self.shards:
            ports.add(free_port())
        ordered = sorted(ports)
        bus_ports = ordered[1::2]
        for port, bus_port in zip(ordered[::2], bus_ports, strict=True):
            node = LocalRedis(
                port=port, extra_args=[*cluster_node_args(bus_port, 5000), *self._extra]
            )
            self.nodes.append(node)
            node.start()
        return bus_ports

    def _assign_slots(self) -> None:
        bounds = [CLUSTER_SLOTS * i // self.shards for i in range(self.shards + 1)]
        for node, first, end in zip(self.nodes, bounds, bounds[1:], strict=False):
            with _client(node.port) as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, end - 1)

    def _meet(self, bus_ports: Sequence[int]) -> None:
        """Every node meets every other: each learns the others' slots from their own replies
        at once instead of by gossip, which takes seconds."""
        for node in self.nodes:
            with _client(node.port) as client:
                for other, bus_port in zip(self.nodes, bus_ports, strict=True):
                    if other is not node:
                        client.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port, bus_port)

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not self._ok():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local cluster was not ok within {_READY_TIMEOUT_S}s")
            time.sleep(0.1)

    def _ok(self) -> bool:
        for node in self.nodes:
            with _client(node.port) as client:
                info = client.cluster("info")
            if info.get("cluster_state") != "ok":
                return False
            if int(info.get("cluster_known_nodes", 0)) != self.shards:
                return False
        return True

    def flushall(self) -> None:
        for node in self.nodes:
            with _client(node.port) as client:
                client.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=5)
