"""What the tier benchmark (:mod:`~hma_redis.tools.bench.tier`) and the store benchmark
(:mod:`~hma_redis.tools.bench.store`) share: the plan, the samples, ``redis-benchmark`` (run
against the same server, never given a URL or a password) and the server to measure.

Every figure of either benchmark is a median over repetitions that interleave all
measurements, so load from other processes hits each column alike. GB/s means 10^9 bytes per
second.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hma_redis.core.config import EndpointKind, RedisTierConfig
from hma_redis.tools.devkit.local_redis import redis_or_local

KIB = 1024
MIB = 1024 * KIB
GB = 1e9
# The longest a benchmark sleeps in one wait for its own jobs (woken at once when one ends).
WAIT_SLICE_S = 0.05

# benchmarks/lmcache_peer.py, run by the Python of a separate venv that has LMCache.
LMCACHE_PEER = Path(__file__).resolve().parents[3] / "benchmarks" / "lmcache_peer.py"
# lmcache_peer.py's exit status when the installed LMCache has no multiprocess mode.
NO_MP_MODE_STATUS = 2
# benchmarks/mooncake_peer.py, run by the Python of a separate venv that has Mooncake Store.
MOONCAKE_PEER = LMCACHE_PEER.with_name("mooncake_peer.py")

_T = TypeVar("_T")
_P = TypeVar("_P", bound="Plan")

# redis-benchmark (7.x) takes a password only as ``-a`` or inside ``-u URL``, on its command
# line, which every user of the host can read (``ps``, /proc/<pid>/cmdline); unlike redis-cli it
# ignores REDISCLI_AUTH. So it is never given one: against a server that needs a password its
# column is skipped, with this note.
PASSWORD_SKIP_NOTE = (
    "redis-benchmark skipped: it takes a password only on its command line, where other users "
    "of this host can read it; measure a Redis without a password for its column"
)


class BenchError(SystemExit):
    """What was measured is wrong (not merely slow), or the benchmark cannot run."""


class RedisBenchmarkSkipped(Exception):
    """redis-benchmark cannot measure this server safely; the message says why."""


def check(ok: bool, message: str) -> None:
    """Stop the benchmark (:class:`BenchError`, one line) unless ``ok``."""
    if not ok:
        raise BenchError(f"bench: {message}")


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    reps: int  # interleaved repetitions; every figure is a median over these
    depth: int  # values per pipelined call, and redis-benchmark's -P
    rb_bytes: int  # bytes one redis-benchmark run moves per command; 0 skips redis-benchmark
    sizes: tuple[int, ...]  # value sizes measured

    def rb_requests(self, size: int) -> int:
        """redis-benchmark's ``-n`` for values of ``size`` bytes (at least 4 x ``depth``)."""
        return max(4 * self.depth, self.rb_bytes // size)


@dataclass(frozen=True)
class Cost:
    """What one sample cost besides its time: the client's CPU seconds (user + system, every
    thread of its process), redis-server's CPU seconds (``INFO cpu``: ``used_cpu_user`` +
    ``used_cpu_sys``, its I/O threads included) and the commands Redis ran for it
    (``INFO commandstats`` calls, the meter's own INFO left out)."""

    client_cpu_s: float
    server_cpu_s: float
    commands: int
    # System calls per name (hma_redis.tools.bench.syscalls), in a counting run only.
    syscalls: dict[str, int] | None = None
    # Bytes copied and moved through the kernel (hma_redis.tools.bench.copies), in a counting
    # run with the copy counter preloaded only.
    copies: dict[str, int] | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cost:
        return cls(
            float(data["client_cpu_s"]),
            float(data["server_cpu_s"]),
            int(data["commands"]),
            data.get("syscalls"),
            data.get("copies"),
        )


def process_cpu_s() -> float:
    """CPU seconds (user + system) of this process's threads so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_counters(client: Any) -> tuple[float, int]:
    """redis-server's CPU seconds and the calls of every command so far (one ``INFO cpu
    commandstats``; ``client`` a redis-py client of that server)."""
    text = client.execute_command("INFO", "cpu", "commandstats")
    if isinstance(text, bytes):
        text = text.decode()
    if isinstance(text, dict):  # a client that parses INFO itself
        cpu = float(text.get("used_cpu_user", 0)) + float(text.get("used_cpu_sys", 0))
        calls = sum(int(v.get("calls", 0)) for k, v in text.items() if k.startswith("cmdstat_"))
        return cpu, calls
    cpu, calls = 0.0, 0
    for line in str(text).splitlines():
        if line.startswith(("used_cpu_user:", "used_cpu_sys:")):
            cpu += float(line.split(":", 1)[1])
        elif line.startswith("cmdstat_"):
            fields = dict(f.split("=", 1) for f in line.split(":", 1)[1].split(","))
            calls += int(fields.get("calls", 0))
    return cpu, calls


class Meter:
    """:class:`Cost` of a span of this process's work against one Redis:
    ``started = meter.start()`` ... ``cost = meter.stop(started)``. With ``counter`` set (a
    :class:`~hma_redis.tools.bench.syscalls.SyscallCounter`: the counting run) the span's
    system calls too, and with ``copies`` (a :class:`~hma_redis.tools.bench.copies.CopyCounter`)
    its bytes copied."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.counter: Any = None
        self.copies: Any = None

    def start(self) -> tuple[float, float, int]:
        cpu, calls = server_counters(self.client)
        if self.counter is not None:  # after the INFO: its calls are not the span's
            self.counter.begin()
        if self.copies is not None:  # after strace attached: a quiet process, nothing copied
            self.copies.begin()
        return process_cpu_s(), cpu, calls

    def stop(self, started: tuple[float, float, int]) -> Cost:
        mine = process_cpu_s()
        copies = self.copies.end() if self.copies is not None else None
        syscalls = self.counter.end() if self.counter is not None else None
        cpu, calls = server_counters(self.client)
        # The INFO of start() is counted by the INFO here; this one's own call is not yet.
        return Cost(mine - started[0], cpu - started[1], calls - started[2] - 1, syscalls, copies)


@dataclass
class Samples:
    """Seconds per sample by measurement name, the most round trips one sample took, and
    what each sample cost (:class:`Cost`) where it was metered."""

    values: dict[str, list[float]] = field(default_factory=dict)
    round_trips: dict[str, int] = field(default_factory=dict)
    costs: dict[str, list[Cost]] = field(default_factory=dict)

    def add(
        self, name: str, seconds: float, round_trips: int | None = None, cost: Cost | None = None
    ) -> None:
        self.values.setdefault(name, []).append(seconds)
        if round_trips is not None:
            self.round_trips[name] = max(self.round_trips.get(name, 0), round_trips)
        if cost is not None:
            self.costs.setdefault(name, []).append(cost)

    def median_cost(self, name: str) -> Cost | None:
        """The median of each cost field over the metered samples of ``name``, or None."""
        costs = self.costs.get(name)
        if not costs:
            return None
        counted = [c.syscalls for c in costs if c.syscalls is not None]
        copied = [c.copies for c in costs if c.copies is not None]
        return Cost(
            statistics.median(c.client_cpu_s for c in costs),
            statistics.median(c.server_cpu_s for c in costs),
            int(statistics.median(c.commands for c in costs)),
            counted[-1] if counted else None,
            copied[-1] if copied else None,
        )

    def median(self, name: str) -> float:
        return statistics.median(self.values[name])

    def has(self, name: str) -> bool:
        return name in self.values


def add_plan_options(parser: argparse.ArgumentParser, quick_s: int, reps: int) -> None:
    """``--url``, ``--quick`` (about ``quick_s`` seconds), ``--smoke`` and ``--reps`` (default
    ``reps``): the options both benchmarks take."""
    parser.add_argument("--url", help="Redis to measure (default: start a local redis-server)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_true", help=f"fewer, smaller repetitions (~{quick_s} s)"
    )
    mode.add_argument(
        "--smoke", action="store_true", help="a few seconds: check correctness, not speed"
    )
    parser.add_argument("--reps", type=int, help=f"interleaved repetitions (default {reps})")


def chosen_plan(
    parser: argparse.ArgumentParser, args: argparse.Namespace, full: _P, quick: _P, smoke: _P
) -> _P:
    """The plan :func:`add_plan_options`' options ask for (``--reps`` must be at least 1)."""
    plan = smoke if args.smoke else quick if args.quick else full
    if args.reps is None:
        return plan
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return dataclasses.replace(plan, reps=args.reps)


def timed(fn: Callable[[], _T]) -> tuple[float, _T]:
    """``fn()``'s wall time in seconds, and its result."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# ---------------------------------------------------------------------------------- servers


def require_lmcache_python(python: str, cfg: RedisTierConfig) -> None:
    """``SystemExit`` (one line) unless LMCache's peer can run with ``python`` against ``cfg``:
    the peer script is here, ``python`` is an executable, and the Redis needs no password (the
    peer takes the URL on its command line, where other users can read it)."""
    if cfg.password:
        raise SystemExit(
            "bench: --lmcache-python needs a Redis without a password: LMCache's peer takes "
            "the URL (and its password) on its command line, where other users can read it"
        )
    if not LMCACHE_PEER.is_file():
        raise SystemExit(f"bench: {LMCACHE_PEER} not found (run from a source checkout)")
    if not os.access(python, os.X_OK):
        raise SystemExit(f"bench: --lmcache-python {python} is not an executable")


def peer_outcome(connector: str, proc: subprocess.CompletedProcess[str]) -> tuple[str, bool]:
    """An LMCache peer run's last stderr line (why it failed, if it did) and whether it ended
    because the installed LMCache has no MP mode (``connector`` "mp" only): then the line is
    that reason without the peer's prefix."""
    why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    if connector == "mp" and proc.returncode == NO_MP_MODE_STATUS:
        return why.removeprefix("lmcache_peer: mp: "), True
    return why, False


def require_mooncake_python(python: str) -> None:
    """``SystemExit`` (one line) unless Mooncake's peer can run with ``python``: the peer
    script is here and ``python`` is an executable. The peer starts its own Mooncake servers
    and never sees the Redis measured."""
    if not MOONCAKE_PEER.is_file():
        raise SystemExit(f"bench: {MOONCAKE_PEER} not found (run from a source checkout)")
    if not os.access(python, os.X_OK):
        raise SystemExit(f"bench: --mooncake-python {python} is not an executable")


def require_single_server(cfg: RedisTierConfig) -> None:
    """``SystemExit`` (one line) for a deployment the benchmarks do not measure."""
    if cfg.endpoint.kind is not EndpointKind.SINGLE:
        raise BenchError(
            "bench: measures one Redis server: give its redis://, rediss:// or unix:// URL "
            "(for a cluster, one master's address)"
        )


def server_version(client: Any) -> str:
    """The server's name and version as its INFO says: ``Redis 7.0.15``, ``Valkey 9.1.2``."""
    info = client.info("server")
    if "valkey_version" in info:
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info['redis_version']}"


@contextmanager
def server_config(cfg: RedisTierConfig | None) -> Iterator[tuple[RedisTierConfig, str]]:
    """``cfg`` and its redacted URL; without one, a throwaway local ``redis-server``
    (persistence off), stopped when the block ends."""
    if cfg is not None:
        yield cfg, cfg.redacted_url
        return
    with redis_or_local(None) as local:
        yield RedisTierConfig(url=local), f"local redis-server at {local} (persistence off)"


# ---------------------------------------------------------------------------------- redis-benchmark


def redis_benchmark_target(cfg: RedisTierConfig) -> list[str]:
    """Where ``redis-benchmark`` connects, as its options: ``-h``/``-p`` or ``-s``, ``--dbnum``,
    TLS files. Never a URL and never credentials, so nothing secret reaches its command line.

    Raises :class:`RedisBenchmarkSkipped` when the server needs a password, and ``SystemExit``
    (one line) for a deployment redis-benchmark does not measure (Cluster, Sentinel).
    """
    require_single_server(cfg)
    if cfg.password:
        raise RedisBenchmarkSkipped(PASSWORD_SKIP_NOTE)
    endpoint = cfg.endpoint
    if endpoint.socket_path is not None:
        target = ["-s", endpoint.socket_path]
    else:
        ((host, port),) = endpoint.hosts
        target = ["-h", host, "-p", str(port)]
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
    """``redis-benchmark -P depth -c 1 -n N -d size -t get,set --csv`` against ``cfg``'s
    server (see :func:`redis_benchmark_target`: no URL, no password)."""
    target = redis_benchmark_target(cfg)
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise BenchError(
            "bench: redis-benchmark not found on PATH (Debian: apt-get install redis-tools)"
        )
    return [
        binary, *target,
        "-P", str(plan.depth), "-c", "1",
        "-n", str(plan.rb_requests(size)), "-d", str(size),
        "-t", "get,set", "--csv",
    ]  # fmt: skip


def redis_benchmark_plan(
    cfg: RedisTierConfig, plan: Plan
) -> tuple[dict[int, list[str]], tuple[str, ...]]:
    """The redis-benchmark command per value size, and notes for the report: no commands
    (and a note saying why) when redis-benchmark must not measure this server, none at all
    when the plan skips it."""
    if not plan.rb_bytes:
        return {}, ()
    try:
        return {size: redis_benchmark_args(cfg, plan, size) for size in plan.sizes}, ()
    except RedisBenchmarkSkipped as exc:
        return {}, (str(exc),)


def run_redis_benchmark(args: Sequence[str], timeout_s: float = 300.0) -> dict[str, float]:
    """Run it once; seconds per request for ``SET`` and ``GET`` (from ``--csv`` rps).

    Any failure (exit status, time-out, unparseable output) is ``SystemExit`` with one line.
    """
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchError(
            f"bench: redis-benchmark did not finish within {timeout_s:.0f} s"
        ) from None
    except OSError as exc:
        raise BenchError(f"bench: cannot run redis-benchmark: {exc}") from None
    out = proc.stdout
    if proc.returncode != 0:
        said = proc.stderr.strip().splitlines() or out.strip().splitlines() or ["no output"]
        raise BenchError(f"bench: redis-benchmark exited with status {proc.returncode}: {said[-1]}")
    rows = {row["test"]: float(row["rps"]) for row in csv.DictReader(out.splitlines())}
    if "SET" not in rows or "GET" not in rows:
        raise BenchError(f"bench: unexpected redis-benchmark output: {' '.join(out.split())[:200]}")
    return {name: 1.0 / rps for name, rps in rows.items()}


def shown_command(args: Sequence[str]) -> str:
    """A redis-benchmark command line as the report prints it (binary without its path)."""
    return " ".join([os.path.basename(args[0]), *args[1:]])


def report_lines(rb_args: dict[int, list[str]], notes: Sequence[str]) -> list[str]:
    """The report's lines naming each redis-benchmark command run, then the notes."""
    return [f"  {shown_command(args)}" for args in rb_args.values()] + [f"  {n}" for n in notes]


# The benchmarks' KV cache: LAYERS pages of PAGE_BYTES per block, int8 (the bytes are what
# matters, not the dtype), one KV group.
LAYERS = 8
PAGE_BYTES = 16 * 1024
KV_DTYPE = "bench-int8"


class OffloadKeys:
    """Distinct offload keys of group 0, in the order they are asked for."""

    def __init__(self) -> None:
        self._serial = 0

    def take(self, count: int) -> list[bytes]:
        from vllm.v1.kv_offload.base import make_offload_key

        keys: list[bytes] = []
        for _ in range(count):
            self._serial += 1
            keys.append(make_offload_key(self._serial.to_bytes(32, "big"), 0))
        return keys


@dataclass
class BenchKVCache:
    """A KV cache of random bytes (``tensors``, and ``arrays``: numpy views of them) and one
    worker per value size over it, on ``store``."""

    tensors: list[Any]
    arrays: list[Any]
    workers: dict[int, Any]


def bench_kv_cache(
    cfg: RedisTierConfig,
    store: Any,
    keyspace: Any,
    num_blocks: int,
    sizes: Sequence[int],
    **worker_options: Any,
) -> BenchKVCache:
    """Random KV pages (seeded) and a :class:`RedisOffloadingWorker` per value size, whose
    chunks are ``size`` bytes of KV (``worker_options``: e.g. ``connections_per_job``)."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from hma_redis.adapter.worker import RedisOffloadingWorker

    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(-128, 128, (num_blocks, PAGE_BYTES), dtype=torch.int8, generator=gen)
        for _ in range(LAYERS)
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE_BYTES) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE_BYTES) for i in range(LAYERS)]],
    )
    workers = {
        size: RedisOffloadingWorker(
            store=store,
            keyspace=keyspace,
            rank=0,
            kv_caches=caches,
            group_ids=[0],
            blocks_per_chunk=size // (LAYERS * PAGE_BYTES),
            kv_dtype=KV_DTYPE,
            io_threads=cfg.io_threads,
            max_inflight_bytes=cfg.max_inflight_bytes,
            shutdown_timeout_s=1.0,
            auth_key=cfg.auth_key,
            encryption_key=cfg.encryption_key,
            encryption_key_previous=cfg.encryption_key_previous,
            idle_wait_s=cfg.idle_wait_ms / 1e3,
            **worker_options,
        )
        for size in sizes
    }
    return BenchKVCache(tensors, [t.numpy() for t in tensors], workers)
