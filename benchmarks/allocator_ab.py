"""Redis's allocator settings, A/B: the same store and load jobs against two private servers that
differ only in ``MALLOC_CONF`` (jemalloc's options), interleaved in one run.

    .venv/bin/python benchmarks/allocator_ab.py                       # dirty_decay_ms:-1, ~1 min
    .venv/bin/python benchmarks/allocator_ab.py --malloc-conf dirty_decay_ms:-1 --jobs 40

Both servers run with ``--maxmemory`` and ``allkeys-lru`` and are filled past it before anything
is timed: a shared tier's steady state, where every store evicts older values and the memory
they held is what the new ones get. For each value size, each job stores 16 MiB of values under
fresh keys (``SET ... NX``, a 64-byte head before each body, two connections: the C store job of
the data path) and then reads them back with one whole ``GET`` each on one connection (what a
Valkey, or a Redis with ``HMA_REDIS_PIECE_BYTES=0``, is asked); A's and B's jobs alternate. Per
job: wall ms, redis-server CPU ms (its threads' scheduler ns) and its minor page faults.

``MALLOC_CONF`` reaches a ``redis-server`` linked against the system's jemalloc (Debian's
package: ``ldd $(which redis-server) | grep jemalloc``); the script reads ``MEMORY MALLOC-STATS``
of server B and stops unless every option shows there. Not a test: nothing is asserted but
the bytes.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import redis

from hma_redis.core.redis import wire
from hma_redis.tools.devkit.local_redis import LocalRedis

JOB_BYTES = 16 << 20
HEAD_BYTES = 64
SIZES = (512 << 10, 2 << 20, 8 << 20)


@dataclass
class Server:
    """One private server, its two sockets and its samples per size: (store ms, store CPU ms,
    store faults, GET ms, GET CPU ms, GET faults)."""

    label: str
    local: LocalRedis
    serial: int = 0
    samples: dict[int, list[tuple[float, ...]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.client = redis.Redis(port=self.local.port)
        self.socks = [socket.create_connection(("127.0.0.1", self.local.port)) for _ in range(2)]
        for sock in self.socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _counts(self) -> tuple[float, int]:
        return self.local.cpu_ms(), self.local.minor_faults()

    def _since(self, before: tuple[float, int]) -> tuple[float, int]:
        """The server's CPU ms and page faults since ``before`` (:meth:`_counts`)."""
        return self.local.cpu_ms() - before[0], self.local.minor_faults() - before[1]

    def job(self, size: int, bodies: list[np.ndarray], rbuf: memoryview) -> tuple[float, ...]:
        keys, values = [], []
        for body in bodies:
            self.serial += 1
            key = f"alloc-ab:{os.getpid()}:{self.serial}".encode()
            keys.append(key)
            framing = b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
                len(key),
                key,
                HEAD_BYTES + size,
            )
            head = bytearray(HEAD_BYTES)
            values.append(wire.StoreValue(framing, head, [memoryview(body)], b"\r\n$2\r\nNX\r\n"))
        server, t0 = self._counts(), time.perf_counter()
        results = wire.store_values(self.socks, values, 10.0)
        store = ((time.perf_counter() - t0) * 1e3, *self._since(server))
        if not all(r.status is wire.StoreStatus.STORED for r in results):
            raise SystemExit(f"allocator_ab: a store was refused on {self.label}: {results[:1]}")
        server, t0 = self._counts(), time.perf_counter()
        got = self._get_all(keys, rbuf)
        load = ((time.perf_counter() - t0) * 1e3, *self._since(server))
        for i, body in enumerate(bodies):
            value = got[i]
            if value is not None and value[HEAD_BYTES:] != memoryview(body):
                raise SystemExit(f"allocator_ab: {self.label} returned other bytes")
        return (*store, *load)

    def _get_all(self, keys: list[bytes], rbuf: memoryview) -> list[memoryview | None]:
        """GET every key (pipelined, one socket); each value as a view into ``rbuf``, or None
        where the key was evicted already (an LRU clock of one second cannot tell it from
        older ones)."""
        sock = self.socks[0]
        sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys))
        filled = pos = 0
        out: list[memoryview | None] = []
        while len(out) < len(keys):
            end = bytes(rbuf[pos:filled]).find(b"\r\n")
            if end < 0:
                filled += sock.recv_into(rbuf[filled:])
                continue
            length = int(bytes(rbuf[pos + 1 : pos + end]))
            start = pos + end + 2
            if length < 0:
                out.append(None)
                pos = start
                continue
            while filled < start + length + 2:
                filled += sock.recv_into(rbuf[filled:])
            out.append(rbuf[start : start + length])
            pos = start + length + 2
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--malloc-conf", default="dirty_decay_ms:-1", help="server B's")
    parser.add_argument("--jobs", type=int, default=24, help="timed jobs per server and size")
    parser.add_argument("--maxmemory", default="512mb", help="each server's --maxmemory")
    args = parser.parse_args()
    lru = ["--maxmemory", args.maxmemory, "--maxmemory-policy", "allkeys-lru"]
    servers = [
        Server("A (default)", LocalRedis(extra_args=lru).start()),
        Server(
            f"B ({args.malloc_conf})",
            LocalRedis(extra_args=lru, env={"MALLOC_CONF": args.malloc_conf}).start(),
        ),
    ]
    try:
        stats = servers[1].client.execute_command("MEMORY MALLOC-STATS")
        stats = stats.decode() if isinstance(stats, bytes) else str(stats)
        for option in args.malloc_conf.split(","):
            name, _, value = option.partition(":")
            if f"opt.{name}: {value}" not in stats:
                raise SystemExit(
                    f"allocator_ab: server B does not show opt.{name}: {value} in MEMORY "
                    "MALLOC-STATS: its redis-server is not linked against a jemalloc that "
                    "reads MALLOC_CONF"
                )
        rng = np.random.default_rng(0)
        rbuf = memoryview(bytearray(JOB_BYTES + JOB_BYTES // 64 + 4096))
        maxmemory = int(servers[0].client.config_get("maxmemory")["maxmemory"])
        for size in SIZES:
            count = JOB_BYTES // size
            bodies = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]
            for server in servers:  # past maxmemory: from here every store evicts
                for _ in range(2 * maxmemory // JOB_BYTES + 2):
                    server.job(size, bodies, rbuf)
            for j in range(args.jobs):
                for server in servers if j % 2 == 0 else servers[::-1]:
                    server.samples.setdefault(size, []).append(server.job(size, bodies, rbuf))
        print(report(servers, args))
    finally:
        for server in servers:
            server.local.stop()
    return 0


def report(servers: list[Server], args: argparse.Namespace) -> str:
    a, b = servers
    lines = [
        f"redis-server allocator A/B: {a.label} vs {b.label}; {os.cpu_count()} CPUs; "
        f"--maxmemory {args.maxmemory} allkeys-lru, filled first; {args.jobs} interleaved jobs "
        f"of {JOB_BYTES >> 20} MiB per server and size (medians); server CPU in s per GB",
        "",
        f"{'':14}{'A ms':>8}{'B ms':>8}{'A/B':>6}{'A cpu':>8}{'B cpu':>8}"
        f"{'A faults':>10}{'B faults':>10}",
    ]
    for size in SIZES:
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        for op, base in (("store", 0), ("GET", 3)):
            ma, mb = (
                [statistics.median(s[base + i] for s in server.samples[size]) for i in range(3)]
                for server in servers
            )
            gb = JOB_BYTES / 1e9
            lines.append(
                f"{op + ' ' + label:14}{ma[0]:8.2f}{mb[0]:8.2f}{ma[0] / mb[0]:6.2f}"
                f"{ma[1] / 1e3 / gb:8.3f}{mb[1] / 1e3 / gb:8.3f}{ma[2]:10.0f}{mb[2]:10.0f}"
            )
    lines.append("A/B above 1: B's jobs were faster.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
