"""Loads and stores of one 32 MiB job through the two data paths, quiet and with a thread that
holds the GIL.

Paths: ``native`` (hma_redis.core.redis._wire, GIL released for the whole job) and ``python`` (its
pure-Python twin in hma_redis.core.redis.wire, the fallback for TLS and ``HMA_REDIS_NATIVE=0``).
Every load lands the values in the pages of a CPU "KV cache" (8 layers,
16 KiB pages, random block ids: one destination span per page) and checks them (CRC32C and the
header); every store sends the pages in place.

Repetitions are interleaved (path after path, then again) and the table shows medians in GB/s
of job bytes. The second table repeats everything while another Python thread spins holding the
GIL (``while not stop: x += 1``), as vLLM's step loop does while a request waits for its KV.

    .venv/bin/python benchmarks/fastpath_bench.py [--url redis://...] [--reps 7]
    .venv/bin/python benchmarks/fastpath_bench.py --connections 2 --window 1  # one thread, 2
    .venv/bin/python benchmarks/fastpath_bench.py --smoke   # bytes checked, both paths, fast

Benchmarks print tables; they assert nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from hma_redis.core import codec, medium
from hma_redis.core.codec import FORMAT_VERSION, BlockHeader
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis import wire
from hma_redis.core.redis.store import RedisBlockStore

try:
    from hma_redis.local_redis import LocalRedis
except ImportError:  # moved with the tools
    from hma_redis.tools.devkit.local_redis import LocalRedis  # type: ignore[no-redef]

MiB = 1 << 20
LAYERS = 8
PAGE = 16 * 1024
PATHS = ("native", "python")
_PREFIX = struct.Struct(">4sHHII32s")


@dataclass
class Setup:
    """One value size: the cache, the chunks (keys, block ids), headers and bodies."""

    value_bytes: int
    cache: list[bytearray]
    chunks: list[tuple[str, list[int]]]
    headers: list[BlockHeader]
    bodies: list[bytes]

    @classmethod
    def make(cls, value_bytes: int, job_bytes: int, tag: str) -> Setup:
        per_block = LAYERS * PAGE
        blocks = value_bytes // per_block
        count = max(1, job_bytes // value_bytes)
        total_blocks = 2 * blocks * count
        rng = random.Random(value_bytes)
        cache = [bytearray(total_blocks * PAGE) for _ in range(LAYERS)]
        free = list(range(total_blocks))
        rng.shuffle(free)
        chunks, headers, bodies = [], [], []
        for idx in range(count):
            ids, free = free[:blocks], free[blocks:]
            key = f"fpb:{tag}:{value_bytes}:{idx}"
            header = BlockHeader(key, 0, 0, blocks, (PAGE,) * LAYERS, "float16")
            chunks.append((key, ids))
            headers.append(header)
            bodies.append(rng.randbytes(header.body_bytes))
        return cls(value_bytes, cache, chunks, headers, bodies)

    @property
    def job_bytes(self) -> int:
        return sum(h.body_bytes for h in self.headers)

    def dests(self, ids: Sequence[int]) -> list[memoryview]:
        return [memoryview(layer)[b * PAGE : (b + 1) * PAGE] for layer in self.cache for b in ids]

    def clear(self) -> None:
        for layer in self.cache:
            layer[:] = bytes(len(layer))

    def fill(self) -> None:
        """Put every chunk's body in its pages (what a store then sends)."""
        for (_, ids), body in zip(self.chunks, self.bodies, strict=True):
            view = memoryview(body)
            for idx, dest in enumerate(self.dests(ids)):
                dest[:] = view[idx * PAGE : (idx + 1) * PAGE]

    def check(self) -> None:
        """Every chunk's pages hold its body (raises AssertionError otherwise)."""
        for (_, ids), body in zip(self.chunks, self.bodies, strict=True):
            landed = b"".join(bytes(v) for v in self.dests(ids))
            assert landed == body, "pages differ from the stored value"


# ------------------------------------------------------------------------------------- loads


def load_fast(setup: Setup, sock: wire.Sockets, native: bool, window: int) -> None:
    load = wire.native_load_values if native else wire.python_load_values
    heads = [bytearray(codec.PREFIX_BYTES + 256) for _ in setup.chunks]
    targets = [
        medium.LoadTarget(head, header.to_msgpack(), setup.dests(ids), None, 64 * MiB)
        for head, header, (_, ids) in zip(heads, setup.headers, setup.chunks, strict=True)
    ]
    commands = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k.encode()) for k, _ in setup.chunks]
    results = load(sock, commands, targets, 10.0, window)
    for result, head in zip(results, heads, strict=True):
        ok = result.status is medium.LoadStatus.OK and result.landed is medium.Landed.PAGES
        if not ok or not result.crc_ok or head[:4] != codec.MAGIC:
            raise RuntimeError(f"bad load: {result}")


# ------------------------------------------------------------------------------------- stores


def value_head(header: BlockHeader) -> bytearray:
    """The codec's prefix + header (no MAC), the CRC field left for the store job to fill."""
    packed = header.to_msgpack()
    prefix = _PREFIX.pack(codec.MAGIC, FORMAT_VERSION, 0, len(packed), 0, bytes(32))
    return bytearray(prefix + packed)


def store_fast(setup: Setup, sock: wire.Sockets, native: bool) -> None:
    store = wire.native_store_values if native else wire.python_store_values
    values = []
    for (key, ids), header in zip(setup.chunks, setup.headers, strict=True):
        head = value_head(header)
        size = len(head) + header.body_bytes
        framing = b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key.encode(), size)
        values.append(wire.StoreValue(framing, head, setup.dests(ids), b"\r\n$2\r\nNX\r\n"))
    results = store(sock, values, 10.0)
    if any(r.status is not wire.StoreStatus.STORED for r in results):
        raise RuntimeError(f"store failed: {results[:3]}")


# ------------------------------------------------------------------------------------- runner


@contextlib.contextmanager
def gil_spinner(active: bool) -> Iterator[None]:
    """A thread that holds the GIL whenever it runs, like vLLM's step loop."""
    if not active:
        yield
        return
    stop = [False]

    def spin() -> None:
        x = 0
        while not stop[0]:
            x += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop[0] = True
        thread.join()


class Bench:
    def __init__(self, url: str, window: int, connections: int = 1) -> None:
        parts = urlsplit(url)
        self.sock = [
            socket.create_connection((parts.hostname, parts.port or 6379), timeout=10)
            for _ in range(connections)
        ]
        self.store = RedisBlockStore(RedisTierConfig(url=url, read_timeout_s=10.0))
        self.window = window

    def unlink(self, setup: Setup) -> None:
        self.store.client.unlink(*[k for k, _ in setup.chunks])

    def put_all(self, setup: Setup) -> None:
        self.unlink(setup)
        for (key, _), header, body in zip(setup.chunks, setup.headers, setup.bodies, strict=True):
            self.store.client.set(key, bytes(codec.encode(header, body)))

    def run_load(self, path: str, setup: Setup) -> None:
        load_fast(setup, self.sock, path == "native", self.window)

    def run_store(self, path: str, setup: Setup) -> None:
        store_fast(setup, self.sock, path == "native")

    def timed(self, op: str, path: str, setup: Setup, spinning: bool) -> float:
        """GB/s of one repetition (setup and checks outside the timing)."""
        if op == "load":
            setup.clear()
        else:
            setup.fill()
            self.unlink(setup)
        with gil_spinner(spinning):
            started = time.perf_counter()
            (self.run_load if op == "load" else self.run_store)(path, setup)
            elapsed = time.perf_counter() - started
        if op == "load":
            setup.check()
        else:
            self.check_stored(setup)
        return setup.job_bytes / elapsed / 1e9

    def check_stored(self, setup: Setup) -> None:
        for (key, _), body in zip(setup.chunks, setup.bodies, strict=True):
            value = self.store.client.get(key)
            assert isinstance(value, bytes)
            assert codec.decode(value, expected_key=key).body == body, "stored value differs"


def run(args: argparse.Namespace, url: str) -> None:
    bench = Bench(url, args.window, args.connections)
    sizes = [256 * 1024] if args.smoke else [512 * 1024, 2 * MiB, 8 * MiB]
    job = 1 * MiB if args.smoke else args.job_mib * MiB
    reps = 1 if args.smoke else args.reps
    sys.setswitchinterval(args.switch_interval_ms / 1000)
    print(
        f"# fastpath_bench: job {job // MiB} MiB, {LAYERS} layers x {PAGE // 1024} KiB pages, "
        f"{reps} interleaved reps, medians; load window {args.window} per connection, "
        f"{args.connections} connection(s) per job; "
        f"switch interval {args.switch_interval_ms} ms"
    )
    print(f"# data path: {wire.describe()}")
    for spinning in (False, True):
        rows = []
        for size in sizes:
            setup = Setup.make(size, job, "s")
            for op in ("load", "store"):
                samples: dict[str, list[float]] = {p: [] for p in PATHS}
                if op == "load":
                    bench.put_all(setup)
                for _ in range(reps):
                    for path in PATHS:
                        samples[path].append(bench.timed(op, path, setup, spinning))
                rows.append((size, op, {p: statistics.median(s) for p, s in samples.items()}))
            bench.unlink(setup)
        title = "with a thread spinning on the GIL" if spinning else "quiet"
        print_table(title, rows)


def print_table(title: str, rows: list[tuple[int, str, dict[str, float]]]) -> None:
    print(f"\n## {title} (GB/s)")
    print(f"{'value':>8} {'op':>6} {'native':>8} {'python':>8} {'nat/py':>7}")
    for size, op, gbs in rows:
        label = f"{size // 1024} KiB" if size < MiB else f"{size // MiB} MiB"
        print(
            f"{label:>8} {op:>6} {gbs['native']:8.2f} {gbs['python']:8.2f} "
            f"{gbs['native'] / gbs['python']:7.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="Redis to use (default: a private redis-server)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--job-mib", type=int, default=32)
    parser.add_argument(
        "--window", type=int, default=2, help="GETs in flight per connection (0: all)"
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="connections one job spreads its values over (value i on connection i mod N)",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.5,
        help="sys.setswitchinterval for the run (the worker's gil_switch_interval_ms default)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny run, bytes checked")
    args = parser.parse_args()
    if not wire.available():
        raise SystemExit(f"native fast path unavailable: {wire.unavailable_reason()}")
    if args.url:
        run(args, args.url)
        return
    server = LocalRedis().start()
    try:
        run(args, server.url)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
