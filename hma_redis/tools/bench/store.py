"""Benchmark of :class:`~hma_redis.core.redis.store.RedisBlockStore` against
``redis-benchmark``, in one run (``hma-redis bench`` runs the whole-tier benchmark,
:mod:`hma_redis.tools.bench.tier`).

Run ``python benchmarks/store_bench.py`` (under a minute), ``--quick`` (about ten seconds) or
``--smoke`` (a few seconds: checks what it measures). Without ``--url`` it starts its own
``redis-server`` on a free loopback port with persistence off and stops it at the end. It
prints one plain-text table:

- ``PING`` and ``exists()`` of 3 groups x 256 keys: microseconds per call (medians);
- ``put_if_absent`` and ``get`` of 1 MiB and 4 MiB values: ms per call and GB/s, for the store
  call alone and with :func:`hma_redis.core.codec.encode` / :func:`~hma_redis.core.codec.decode`
  (checksum verified) included, next to ``redis-benchmark -P <depth> -c 1 -d <size> -t get,set``
  against the same server, which is what this Redis can do from one connection.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace, RedisKey
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.bench.common import (
    GB,
    MIB,
    Plan,
    Samples,
    add_plan_options,
    check,
    chosen_plan,
    redis_benchmark_plan,
    report_lines,
    run_redis_benchmark,
    server_config,
    server_version,
)

# Blocks per chunk and layers per group of the synthetic values (body = size bytes exactly).
_BLOCKS = 16
_LAYERS = 4
_EXISTS_GROUPS = 3
_EXISTS_KEYS = 256


@dataclass(frozen=True)
class StorePlan(Plan):
    """How much to measure; ``depth`` values per store call."""

    calls: int  # store calls per value size and repetition
    lookup_reps: int  # PING / exists() samples


SIZES = (1 * MIB, 4 * MIB)
FULL = StorePlan(reps=9, depth=4, rb_bytes=256 * MIB, sizes=SIZES, calls=5, lookup_reps=300)
QUICK = StorePlan(reps=5, depth=4, rb_bytes=128 * MIB, sizes=SIZES, calls=3, lookup_reps=100)
# rb_bytes so small that redis-benchmark runs its minimum (4 x depth requests) per size.
SMOKE = StorePlan(reps=1, depth=2, rb_bytes=1, sizes=SIZES, calls=1, lookup_reps=2)


# ---------------------------------------------------------------------------------- store


class StoreBench:
    """Measures one store; keys live under ``<prefix>:bench-<pid>`` and are deleted afterwards."""

    def __init__(self, store: RedisBlockStore, plan: StorePlan) -> None:
        self.store = store
        self.plan = plan
        self.keys = KeySpace(store.cfg.key_prefix, f"bench-{os.getpid()}")
        self.bodies = {size: os.urandom(size) for size in plan.sizes}
        self._serial = 0
        # Every block key of this run has the same length, so every value of a size too.
        probe = self._new_keys(1)[0]
        self.value_bytes = {size: codec.value_size(self.header(probe, size)) for size in plan.sizes}

    def _new_keys(self, count: int, group: int = 0) -> list[RedisKey]:
        keys = []
        for _ in range(count):
            self._serial += 1
            keys.append(self.keys.block_key(group, self._serial.to_bytes(32, "big")))
        return keys

    @staticmethod
    def header(key: str, size: int) -> codec.BlockHeader:
        page = size // (_BLOCKS * _LAYERS)
        return codec.BlockHeader(
            key=key, group=0, first_block=0, num_blocks=_BLOCKS, page_bytes=(page,) * _LAYERS
        )

    def add_lookup_keys(self) -> tuple[list[RedisKey], list[bool]]:
        """3 groups x 256 keys, every other one stored (tiny values); the keys and which exist."""
        keys = [k for g in range(_EXISTS_GROUPS) for k in self._new_keys(_EXISTS_KEYS, g)]
        tiny = [(k, codec.encode(self.header(k, _BLOCKS * _LAYERS), b"x" * 64)) for k in keys[::2]]
        _check_stored(self.store.put_if_absent(tiny))
        return keys, [i % 2 == 0 for i in range(len(keys))]

    def lookups(self, keys: list[RedisKey], expected: list[bool], samples: Samples) -> None:
        """``lookup_reps / reps`` pairs of PING and exists(keys); one sample each."""
        for _ in range(max(1, self.plan.lookup_reps // self.plan.reps)):
            t0 = time.perf_counter()
            self.store.ping()
            t1 = time.perf_counter()
            trips = self.store.round_trips
            flags = self.store.exists(keys)
            t2 = time.perf_counter()
            check(
                flags == expected and self.store.round_trips == trips + 1,
                "exists() gave wrong answers or took more than one round trip",
            )
            samples.add("ping", t1 - t0)
            samples.add("exists", t2 - t1)

    def transfers(self, size: int, samples: Samples) -> None:
        """``calls`` puts then gets of ``depth`` fresh values of ``size`` bytes; one sample each."""
        body = self.bodies[size]
        encode_s = put_s = get_s = decode_s = 0.0
        written: list[list[RedisKey]] = []
        for _ in range(self.plan.calls):
            keys = self._new_keys(self.plan.depth)
            t0 = time.perf_counter()
            items = [(k, codec.encode(self.header(k, size), body)) for k in keys]
            t1 = time.perf_counter()
            results = self.store.put_if_absent(items)
            t2 = time.perf_counter()
            _check_stored(results)
            encode_s += t1 - t0
            put_s += t2 - t1
            written.append(keys)
        for keys in written:
            t0 = time.perf_counter()
            values = self.store.get(keys)
            t1 = time.perf_counter()
            blocks = [
                codec.decode(_present(v), expected_key=k) for k, v in zip(keys, values, strict=True)
            ]
            t2 = time.perf_counter()
            get_s += t1 - t0
            decode_s += t2 - t1
            check(all(b.body == body for b in blocks), "get() returned other bytes than were put")
        calls = self.plan.calls
        samples.add(f"put {size}", put_s / calls)
        samples.add(f"put+encode {size}", (put_s + encode_s) / calls)
        samples.add(f"get {size}", get_s / calls)
        samples.add(f"get+decode {size}", (get_s + decode_s) / calls)
        self.store.delete([k for keys in written for k in keys])


def _present(value: bytes | None) -> bytes:
    check(value is not None, "get() missed a value that was just stored")
    assert value is not None
    return value


def _check_stored(results: Sequence[PutResult]) -> None:
    check(
        all(r is PutResult.STORED for r in results),
        f"put_if_absent did not store every value: {results}",
    )


# ---------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Report:
    samples: Samples
    value_bytes: dict[int, int]  # bytes of one stored value (envelope included) per body size
    rb_args: dict[int, list[str]]  # the redis-benchmark command per body size; {} if skipped
    redis_version: str
    notes: tuple[str, ...] = ()


def measure(cfg: RedisTierConfig, plan: StorePlan) -> Report:
    """Run every measurement, interleaved, against the Redis ``cfg`` names."""
    store = RedisBlockStore(dataclasses.replace(cfg, read_timeout_s=30.0))
    lookup_keys: list[RedisKey] = []
    try:
        store.ping()
        version = server_version(store.client)
        bench = StoreBench(store, plan)
        rb_args, notes = redis_benchmark_plan(cfg, plan)
        lookup_keys, expected = bench.add_lookup_keys()
        samples = Samples()
        warmup = Samples()
        bench.lookups(lookup_keys, expected, warmup)
        for size in plan.sizes:
            bench.transfers(size, warmup)
        for _ in range(plan.reps):
            bench.lookups(lookup_keys, expected, samples)
            for size in plan.sizes:
                if rb_args:
                    for name, per_request in run_redis_benchmark(rb_args[size]).items():
                        samples.add(f"rb {name} {size}", per_request)
                bench.transfers(size, samples)
        return Report(samples, bench.value_bytes, rb_args, version, notes)
    finally:
        store.delete(lookup_keys[::2])
        store.close()


def format_table(report: Report, plan: StorePlan) -> str:
    """The printed table: lookups in µs, then transfers per value size and operation."""
    samples = report.samples
    batch = plan.depth
    row = "{:<7}{:<20}{:>10} |{:>9}{:>7}{:>7} |{:>9}{:>7}{:>7}"
    lines = [
        f"{'lookups (one round trip each)':<40}{'median µs':>10}",
        f"{'  PING':<40}{samples.median('ping') * 1e6:>10.1f}",
        f"{f'  exists() {_EXISTS_GROUPS} groups x {_EXISTS_KEYS} keys':<40}"
        f"{samples.median('exists') * 1e6:>10.1f}",
        "",
        f"transfers: {batch} values per store call; redis-benchmark -P {batch} -c 1",
        f"{'':<17}{'redis-benchmark':>20} |{'store call only':>23} |{'with codec + CRC32C':>23}",
        row.format("value", "op", "GB/s", "ms/call", "GB/s", "ratio", "ms/call", "GB/s", "ratio"),
    ]
    for size in plan.sizes:
        value_bytes = report.value_bytes[size]
        for op, name, rb_name, with_codec in (
            ("put_if_absent", "put", "SET", "put+encode"),
            ("get", "get", "GET", "get+decode"),
        ):
            rb_name_size = f"rb {rb_name} {size}"
            rb_gbps = (
                size / samples.median(rb_name_size) / GB if rb_name_size in samples.values else None
            )
            store_s = samples.median(f"{name} {size}")
            codec_s = samples.median(f"{with_codec} {size}")
            store_gbps = batch * value_bytes / store_s / GB
            codec_gbps = batch * value_bytes / codec_s / GB
            lines.append(
                row.format(
                    f"{size // MIB} MiB",
                    f"{op} / {rb_name}",
                    "-" if rb_gbps is None else f"{rb_gbps:.2f}",
                    f"{store_s * 1e3:.2f}",
                    f"{store_gbps:.2f}",
                    "-" if rb_gbps is None else f"{store_gbps / rb_gbps:.2f}",
                    f"{codec_s * 1e3:.2f}",
                    f"{codec_gbps:.2f}",
                    "-" if rb_gbps is None else f"{codec_gbps / rb_gbps:.2f}",
                )
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The store-call table (``benchmarks/store_bench.py``); 0, or ``SystemExit`` if what it
    measured is wrong."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/store_bench.py",
        description="RedisBlockStore against redis-benchmark on the same Redis, in one run.",
    )
    add_plan_options(parser, quick_s=10, reps=FULL.reps)
    args = parser.parse_args(argv)
    plan = chosen_plan(parser, args, FULL, QUICK, SMOKE)
    started = time.perf_counter()
    load = os.getloadavg()[0]
    with server_config(None if args.url is None else RedisTierConfig(url=args.url)) as target:
        cfg, where = target
        report = measure(cfg, plan)
    print(f"hma_redis store benchmark: {report.redis_version}, {where}, {os.cpu_count()} CPUs")
    print(
        f"{plan.reps} interleaved repetitions; GB/s = 10^9 value bytes per second; "
        f"load average at start {load:.2f}"
    )
    for line in report_lines(report.rb_args, report.notes):
        print(line)
    print()
    print(format_table(report, plan))
    elapsed = time.perf_counter() - started
    print(f"\n(ratio = store GB/s / redis-benchmark GB/s; run took {elapsed:.1f} s)")
    if args.smoke:
        print("\nsmoke: every store call round-tripped its bytes and answered right")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
