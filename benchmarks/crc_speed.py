"""CRC32C speed of each native path on a buffer in the cache: the folding loop (VPCLMULQDQ,
where the CPU has it), the 3-lane CRC-instruction loop and the portable table, GB/s (best of 5)
by buffer size. The data path's checksum runs on what it has just received or is about to send.

Then a store's case: a load checksums bytes the kernel has just written into the cache, but a
store checksums KV pages nobody has read lately. The second table times the data path's CRC32C
over a 512 KiB value made of 32 pages of 16 KiB at random places of a 1 GiB buffer (cold: out
of every cache), over the same 32 pages again (hot), and a ``memcpy`` of cold pages of the same
shape into one buffer (what the memory itself gives one core), medians of 5 rounds of 300
values.

    .venv/bin/python benchmarks/crc_speed.py

Benchmarks print; they assert nothing about speed.
"""

from __future__ import annotations

import os
import random
import statistics
import time

import numpy as np

from hma_redis.core.redis import _wire

SIZES = (4096, 16384, 72 * 1024, 512 * 1024, 16 << 20)


def gbps(fn: object, data: bytes) -> float:
    """Best of 5 runs of ``fn(data)`` over about 64 MiB each, in GB/s."""
    reps = max(3, (64 << 20) // len(data))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn(data)  # type: ignore[operator]
        best = min(best, (time.perf_counter() - start) / reps)
    return len(data) / best / 1e9


def main() -> None:
    print(f"crc32c runs on: {_wire.crc_engine() or 'the portable table'}")
    print(f"{'bytes':>10} {'crc32c':>9} {'no fold':>9} {'table':>9}   GB/s")
    for size in SIZES:
        data = os.urandom(size)
        best, no_fold = gbps(_wire.crc32c, data), gbps(_wire._crc32c_no_fold, data)
        table = gbps(_wire._crc32c_portable, data)
        print(f"{size:>10} {best:>9.1f} {no_fold:>9.1f} {table:>9.1f}")
    cold_pages()


PAGE = 16 << 10
VALUE = 512 << 10


def cold_pages() -> None:
    memory = np.ones(1 << 30, dtype=np.uint8)  # touched: no page faults below
    pages = len(memory) // PAGE
    rng = random.Random(0)

    def values(count: int) -> list[list[memoryview]]:
        return [
            [memoryview(memory[p * PAGE : (p + 1) * PAGE]) for p in rng.sample(range(pages), 32)]
            for _ in range(count)
        ]

    def rate(run: object, batch: list[list[memoryview]]) -> float:
        start = time.perf_counter()
        for value in batch:
            run(value)  # type: ignore[operator]
        return len(batch) * VALUE / (time.perf_counter() - start) / 1e9

    into = bytearray(VALUE)

    def copy(value: list[memoryview]) -> None:
        for i, page in enumerate(value):
            into[i * PAGE : (i + 1) * PAGE] = page

    hot = values(1) * 300
    rounds: dict[str, list[float]] = {"cold": [], "hot": [], "copy": []}
    for _ in range(5):
        rounds["cold"].append(rate(_wire.crc32c_parts, values(300)))
        rounds["hot"].append(rate(_wire.crc32c_parts, hot))
        rounds["copy"].append(rate(copy, values(300)))
    cold, warm, copied = (statistics.median(rounds[k]) for k in ("cold", "hot", "copy"))
    print("\n512 KiB values of 32 pages of 16 KiB, GB/s (median of 5 rounds of 300 values):")
    print(f"crc32c cold {cold:.1f}, hot {warm:.1f} (cold / hot {cold / warm:.2f}); ", end="")
    print(f"memcpy of cold pages {copied:.1f}")


if __name__ == "__main__":
    main()
