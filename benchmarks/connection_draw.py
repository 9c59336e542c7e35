"""The same load job on one pair of connections after another: each pair's median GB/s.

Stores ``--count`` values of ``--size`` bytes (a 48-byte prefix announcing an empty header,
then random bytes), then for each of ``--pairs`` rounds opens two new connections and runs
``--jobs`` C load jobs of all the values into the same contiguous buffers (a thread per
connection, as the worker's jobs), each after ``--idle-ms`` asleep, and prints the round's
median. On a small host the rounds split into a fast and a slow group that last a
connection's life; ``hma-redis bench`` therefore opens new value connections before each
repetition, as LMCache's peer starts a process per repetition.

    .venv/bin/python benchmarks/connection_draw.py --url redis://127.0.0.1:6379/0

Benchmarks print; they assert nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from urllib.parse import urlsplit

import redis

from hma_redis.core import codec
from hma_redis.core.medium import Landed, LoadTarget
from hma_redis.core.redis import wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="a Redis to use (keys draw:<pid>:*)")
    parser.add_argument("--size", type=int, default=512 * 1024)
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--idle-ms", type=float, default=20.0)
    args = parser.parse_args()
    parts = urlsplit(args.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    client = redis.Redis.from_url(args.url)
    keys = [f"draw:{os.getpid()}:{i}" for i in range(args.count)]
    for key in keys:
        client.set(key, bytes(codec.PREFIX_BYTES) + os.urandom(args.size))
    commands = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k.encode()) for k in keys]
    buffers = [bytearray(args.size) for _ in keys]
    targets = [
        LoadTarget(bytearray(64), b"", [memoryview(b)], None, codec.PREFIX_BYTES + args.size)
        for b in buffers
    ]
    job_bytes = args.size * args.count
    print(f"{args.url}; {args.jobs} loads of {job_bytes >> 20} MiB per pair of new connections")
    medians: list[float] = []
    try:
        for _ in range(args.pairs):
            socks = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
            seconds: list[float] = []
            try:
                for _ in range(args.jobs):
                    time.sleep(args.idle_ms / 1e3)
                    started = time.perf_counter()
                    results = wire.load_values(socks, commands, targets, 10.0)
                    seconds.append(time.perf_counter() - started)
                    assert all(r.landed is Landed.PAGES for r in results)
            finally:
                for sock in socks:
                    sock.close()
            medians.append(job_bytes / statistics.median(seconds[2:]) / 1e9)
        print("GB/s by pair:", " ".join(f"{m:.2f}" for m in medians))
    finally:
        client.delete(*keys)


if __name__ == "__main__":
    main()
