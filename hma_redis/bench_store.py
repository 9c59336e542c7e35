"""Benchmark of :class:`~hma_redis.store.RedisBlockStore` against ``redis-benchmark``, in one run.

``hma-redis bench`` (:func:`main`) now runs the whole-tier benchmark, :mod:`hma_redis.bench_tier`;
this module's own table, the store calls alone, is :func:`store_main`.

Run ``python benchmarks/store_bench.py`` (under a minute) or add ``--quick`` (about ten seconds).
Without ``--url`` it starts its own ``redis-server`` on a free loopback port with persistence off
and stops it at the end. It prints one plain-text table:

- ``PING`` and ``exists()`` of 3 groups x 256 keys: microseconds per call (medians);
- ``put_if_absent`` and ``get`` of 1 MiB and 4 MiB values: ms per call and GB/s, for the store
  call alone and with :func:`hma_redis.codec.encode` / :func:`~hma_redis.codec.decode` (checksum
  verified) included, next to ``redis-benchmark -P <batch> -c 1 -d <size> -t get,set`` against the
  same server, which is what this Redis can do from one connection.

Every figure is the median over repetitions that interleave all measurements, so drift on a busy
machine hits each column alike. GB/s means 10^9 bytes of Redis values per second.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig, strip_userinfo
from hma_redis.core.keys import KeySpace, RedisKey
from hma_redis.core.store import PutResult, RedisBlockStore
from hma_redis.local_redis import redis_or_local

MIB = 1024 * 1024
GB = 1e9
# Blocks per chunk and layers per group of the synthetic values (body = size bytes exactly).
_BLOCKS = 16
_LAYERS = 4
_EXISTS_GROUPS = 3
_EXISTS_KEYS = 256


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    reps: int  # interleaved repetitions; every reported figure is a median over these
    calls: int  # store calls per value size and repetition
    batch: int  # values per store call, and redis-benchmark's -P
    rb_bytes: int  # bytes each redis-benchmark run moves per command (sets -n)
    lookup_reps: int  # PING / exists() samples
    sizes: tuple[int, ...] = (1 * MIB, 4 * MIB)

    def rb_requests(self, size: int) -> int:
        return max(4 * self.batch, self.rb_bytes // size)


FULL = Plan(reps=9, calls=5, batch=4, rb_bytes=256 * MIB, lookup_reps=300)
QUICK = Plan(reps=5, calls=3, batch=4, rb_bytes=128 * MIB, lookup_reps=100)


@dataclass
class Samples:
    """Seconds per call (or per redis-benchmark request), by measurement name."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.values.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.values[name])


# ---------------------------------------------------------------------------------- servers


def local_redis() -> AbstractContextManager[str]:
    """A throwaway ``redis-server`` on a free loopback port; yields its URL."""
    return redis_or_local(None)


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise SystemExit(
            f"{binary} not found on PATH (Debian: apt-get install -y redis-server redis-tools)"
        )
    return path


# ---------------------------------------------------------------------------------- redis-benchmark

# redis-benchmark (7.x) takes a password only as ``-a`` or inside ``-u URL``, on its command
# line, which every user of the host can read (``ps``, /proc/<pid>/cmdline); unlike redis-cli it
# ignores REDISCLI_AUTH. So it is never given one: against a server that needs a password its
# column is skipped, with this note.
PASSWORD_SKIP_NOTE = (
    "redis-benchmark skipped: it takes a password only on its command line, where other users "
    "of this host can read it; measure a Redis without a password for its column"
)


class RedisBenchmarkSkipped(Exception):
    """redis-benchmark cannot measure this server safely; the message says why."""


def redis_benchmark_target(cfg: RedisTierConfig) -> list[str]:
    """Where ``redis-benchmark`` connects, as its options: ``-h``/``-p`` or ``-s``, ``--dbnum``,
    TLS files. Never a URL and never credentials, so nothing secret reaches its command line.

    Raises :class:`RedisBenchmarkSkipped` when the server needs a password, and ``SystemExit``
    (one line) for a deployment redis-benchmark does not measure (Cluster, Sentinel).
    """
    if cfg.topology.kind != "single":
        raise SystemExit(
            "bench: measures one Redis server: give its redis://, rediss:// or unix:// URL "
            "(for a cluster, one master's address)"
        )
    if cfg.password:
        raise RedisBenchmarkSkipped(PASSWORD_SKIP_NOTE)
    parts = urlsplit(strip_userinfo(cfg.url))
    if parts.scheme == "unix":
        target = ["-s", parts.path]
    else:
        target = ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
    if cfg.db:
        target += ["--dbnum", str(cfg.db)]
    if cfg.tls:
        target.append("--tls")
        files = (("--cacert", cfg.tls_ca_file), ("--cert", cfg.tls_cert_file))
        target += [arg for flag, path in files if path for arg in (flag, path)]
        if cfg.tls_key_file:
            target += ["--key", cfg.tls_key_file]
        if not cfg.tls_verify:
            target.append("--insecure")
    return target


def redis_benchmark_args(cfg: RedisTierConfig, plan: Plan, size: int) -> list[str]:
    """The ``redis-benchmark`` command line for one value size (see
    :func:`redis_benchmark_target`: no URL, no password)."""
    return [
        _require("redis-benchmark"),
        *redis_benchmark_target(cfg),
        "-P", str(plan.batch),
        "-c", "1",
        "-n", str(plan.rb_requests(size)),
        "-d", str(size),
        "-t", "get,set",
        "--csv",
    ]  # fmt: skip


def run_redis_benchmark(args: Sequence[str], timeout_s: float = 300.0) -> dict[str, float]:
    """Run it once; seconds per request for ``SET`` and ``GET`` (from ``--csv`` rps).

    Any failure (exit status, time-out, unparseable output) is ``SystemExit`` with one line.
    """
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"bench: redis-benchmark did not finish within {timeout_s:.0f} s"
        ) from None
    except OSError as exc:
        raise SystemExit(f"bench: cannot run redis-benchmark: {exc}") from None
    out = proc.stdout
    if proc.returncode != 0:
        said = proc.stderr.strip().splitlines() or out.strip().splitlines() or ["no output"]
        raise SystemExit(f"bench: redis-benchmark exited with status {proc.returncode}: {said[-1]}")
    rows = {row["test"]: float(row["rps"]) for row in csv.DictReader(out.splitlines())}
    if "SET" not in rows or "GET" not in rows:
        raise SystemExit(f"bench: unexpected redis-benchmark output: {' '.join(out.split())[:200]}")
    return {name: 1.0 / rps for name, rps in rows.items()}


def _shown_command(args: Sequence[str]) -> str:
    return " ".join([os.path.basename(args[0]), *args[1:]])


# ---------------------------------------------------------------------------------- store


class StoreBench:
    """Measures one store; keys live under ``<prefix>:bench-<pid>`` and are deleted afterwards."""

    def __init__(self, store: RedisBlockStore, plan: Plan) -> None:
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
            if flags != expected or self.store.round_trips != trips + 1:
                raise SystemExit("exists() gave wrong answers or took more than one round trip")
            samples.add("ping", t1 - t0)
            samples.add("exists", t2 - t1)

    def transfers(self, size: int, samples: Samples) -> None:
        """``calls`` puts then gets of ``batch`` fresh values of ``size`` bytes; one sample each."""
        body = self.bodies[size]
        encode_s = put_s = get_s = decode_s = 0.0
        written: list[list[RedisKey]] = []
        for _ in range(self.plan.calls):
            keys = self._new_keys(self.plan.batch)
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
            if any(b.body != body for b in blocks):
                raise SystemExit("get() returned different bytes than were put")
        calls = self.plan.calls
        samples.add(f"put {size}", put_s / calls)
        samples.add(f"put+encode {size}", (put_s + encode_s) / calls)
        samples.add(f"get {size}", get_s / calls)
        samples.add(f"get+decode {size}", (get_s + decode_s) / calls)
        self.store.delete([k for keys in written for k in keys])


def _present(value: bytes | None) -> bytes:
    if value is None:
        raise SystemExit("get() missed a value that was just stored")
    return value


def _check_stored(results: Sequence[PutResult]) -> None:
    if any(r is not PutResult.STORED for r in results):
        raise SystemExit(f"put_if_absent did not store every value: {results}")


# ---------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Report:
    samples: Samples
    value_bytes: dict[int, int]  # bytes of one stored value (envelope included) per body size
    rb_args: dict[int, list[str]]  # the redis-benchmark command per body size; {} if skipped
    redis_version: str
    notes: tuple[str, ...] = ()


def measure(cfg: RedisTierConfig, plan: Plan) -> Report:
    """Run every measurement, interleaved, against the Redis ``cfg`` names."""
    store = RedisBlockStore(dataclasses.replace(cfg, read_timeout_s=30.0))
    lookup_keys: list[RedisKey] = []
    try:
        store.ping()
        version = str(store.client.info("server")["redis_version"])
        bench = StoreBench(store, plan)
        notes: tuple[str, ...] = ()
        try:
            rb_args = {size: redis_benchmark_args(cfg, plan, size) for size in plan.sizes}
        except RedisBenchmarkSkipped as exc:
            rb_args, notes = {}, (str(exc),)
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


def format_table(report: Report, plan: Plan) -> str:
    """The printed table: lookups in µs, then transfers per value size and operation."""
    samples = report.samples
    batch = plan.batch
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
    """``hma-redis bench``: the tier benchmark, :mod:`hma_redis.bench_tier` (same options)."""
    from hma_redis import bench_tier

    return bench_tier.main(argv)


def store_main(argv: Sequence[str] | None = None) -> None:
    """This module's store-call table (``benchmarks/store_bench.py``)."""
    parser = argparse.ArgumentParser(
        description="RedisBlockStore against redis-benchmark on the same Redis, in one run."
    )
    parser.add_argument(
        "--url", help="Redis to measure (default: start a local redis-server, persistence off)"
    )
    parser.add_argument("--quick", action="store_true", help="a ~10 s smoke run")
    parser.add_argument("--reps", type=int, help="interleaved repetitions (default 9, quick 5)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.reps is not None:
        if args.reps < 1:
            parser.error("--reps must be at least 1")
        plan = dataclasses.replace(plan, reps=args.reps)
    started = time.perf_counter()
    load = os.getloadavg()[0]
    with _server(args.url) as (cfg, where):
        report = measure(cfg, plan)
    print(
        f"hma_redis store benchmark: Redis {report.redis_version}, {where}, {os.cpu_count()} CPUs"
    )
    print(
        f"{plan.reps} interleaved repetitions; GB/s = 10^9 value bytes per second; "
        f"load average at start {load:.2f}"
    )
    for args_of_size in report.rb_args.values():
        print(f"  {_shown_command(args_of_size)}")
    for note in report.notes:
        print(f"  {note}")
    print()
    print(format_table(report, plan))
    elapsed = time.perf_counter() - started
    print(f"\n(ratio = store GB/s / redis-benchmark GB/s; run took {elapsed:.1f} s)")


@contextmanager
def server_config(
    cfg: RedisTierConfig | None,
) -> Iterator[tuple[RedisTierConfig, str]]:
    """``cfg`` and its redacted URL; without one, a throwaway local ``redis-server``."""
    if cfg is not None:
        yield cfg, cfg.redacted_url
        return
    with local_redis() as local:
        yield RedisTierConfig(url=local), f"local redis-server at {local} (persistence off)"


def _server(url: str | None) -> AbstractContextManager[tuple[RedisTierConfig, str]]:
    return server_config(None if url is None else RedisTierConfig(url=url))
