"""CRC32C speed of each native path on a buffer in the cache: the folding loop (VPCLMULQDQ,
where the CPU has it), the 3-lane CRC-instruction loop and the portable table, GB/s (best of 5)
by buffer size. The data path's checksum runs on what it has just received or is about to send.

    .venv/bin/python benchmarks/crc_speed.py

Benchmarks print; they assert nothing about speed.
"""

from __future__ import annotations

import os
import time

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


if __name__ == "__main__":
    main()
