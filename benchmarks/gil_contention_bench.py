"""Load jobs while another Python thread holds the GIL, as vLLM's step loop does while a request
waits for its KV: native vs Python data path, GIL switch interval 5 ms (Python's default) vs
0.5 ms (the tier's ``gil_switch_interval_ms``). Says whether the switch-interval trick still buys
anything once the data path runs without the GIL.

    .venv/bin/python benchmarks/gil_contention_bench.py [--job-mib 64] [--value-mib 4] [--reps 5]

A private ``redis-server`` is started; one transfer engine per path over CPU tensors (8 layers,
64 KiB pages: the in-engine benchmark's layout) stores one job, then loads it ``reps`` times
alone and with a busy thread (a pure-Python loop) at each switch interval. Every load is
checked byte for byte. Medians, GB/s of KV payload. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.transfer.engine import TransferEngine
from hma_redis.core.transfer.jobs import ChunkTransfer, JobResult, ValueFormat
from hma_redis.core.transfer.pages import LayerSource
from hma_redis.tools.devkit.local_redis import LocalRedis

LAYERS = 8
PAGE = 64 * 1024
MIB = 1 << 20
INTERVALS = {"5 ms": 0.005, "0.5 ms": 0.0005}


@contextmanager
def busy_thread(interval_s: float | None) -> Iterator[None]:
    """A thread that runs Python bytecode (holding the GIL) for the block, at this switch
    interval; None: no such thread."""
    if interval_s is None:
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(before)


class Rig:
    """One transfer engine on one data path over CPU KV tensors."""

    def __init__(self, url: str, native: bool, job_mib: int, value_mib: int) -> None:
        self.store = RedisBlockStore(RedisTierConfig(url=url), native=native)
        self.bpc = value_mib * MIB // (LAYERS * PAGE)
        self.blocks = job_mib * MIB // (LAYERS * PAGE) // self.bpc * self.bpc
        gen = torch.Generator().manual_seed(1)
        self.tensors = [
            torch.randint(-128, 128, (2 * self.blocks, PAGE), dtype=torch.int8, generator=gen)
            for _ in range(LAYERS)
        ]
        self.engine = TransferEngine(
            self.store,
            [[LayerSource.of(t, PAGE) for t in self.tensors]],
            ValueFormat(kv_dtype="int8"),
            blocks_per_chunk=self.bpc,
        )
        keys = KeySpace("hma", f"gil-bench-{'native' if native else 'python'}")
        self.keys = [
            keys.block_key(0, c.to_bytes(32, "big")) for c in range(self.blocks // self.bpc)
        ]
        self._job = 0
        check(self.run(self.chunks(0), self.engine.submit_store).ok, "the store failed")

    def chunks(self, base: int) -> list[ChunkTransfer]:
        return [
            ChunkTransfer(
                key, 0, 0, 0, tuple(range(base + i * self.bpc, base + (i + 1) * self.bpc))
            )
            for i, key in enumerate(self.keys)
        ]

    def run(self, chunks: list[ChunkTransfer], submit: Callable[..., None]) -> JobResult:
        self._job += 1
        submit(self._job, chunks)
        while True:
            for result in self.engine.finished():
                if result.job_id == self._job:
                    return result
            time.sleep(0.0005)

    def load_gbps(self, reps: int) -> float:
        seconds = []
        for _ in range(reps):
            for tensor in self.tensors:
                tensor[self.blocks :] = 0
            result = self.run(self.chunks(self.blocks), self.engine.submit_load)
            check(result.ok, "a load failed")
            seconds.append(result.seconds)
            check(
                all(torch.equal(t[: self.blocks], t[self.blocks :]) for t in self.tensors),
                "a load moved other bytes",
            )
        return self.blocks * LAYERS * PAGE / statistics.median(seconds) / 1e9

    def close(self) -> None:
        self.engine.shutdown()
        self.store.close()


def check(ok: bool, message: str) -> None:
    if not ok:
        raise SystemExit(f"gil_contention_bench: {message}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job-mib", type=int, default=64)
    parser.add_argument("--value-mib", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    server = LocalRedis().start()
    columns = ["alone", *(f"busy, {name}" for name in INTERVALS)]
    try:
        rigs = {
            "native": Rig(server.url, True, args.job_mib, args.value_mib),
            "python": Rig(server.url, False, args.job_mib, args.value_mib),
        }
        table: dict[str, list[float]] = {path: [] for path in rigs}
        for interval in (None, *INTERVALS.values()):
            with busy_thread(interval):
                for path, rig in rigs.items():
                    table[path].append(rig.load_gbps(args.reps))
        for rig in rigs.values():
            rig.close()
    finally:
        server.stop()
    print(
        f"load GB/s, {args.job_mib} MiB jobs of {args.value_mib} MiB values, median of "
        f"{args.reps}; busy = another thread running Python bytecode (holding the GIL)"
    )
    print(f"{'path':<8}" + "".join(f"{c:>16}" for c in columns))
    for path, values in table.items():
        print(f"{path:<8}" + "".join(f"{v:>16.2f}" for v in values))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
