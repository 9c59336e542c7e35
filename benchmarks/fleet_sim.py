"""Simulated schedulers of a fleet against one redis-server and a 3-master local Cluster.

Each of N processes plays one engine's scheduler, closed loop (as fast as Redis answers): per
step it takes ``requests_per_step`` new requests, asks which of their chunk keys exist (all
groups, one ``RedisBlockStore.exists`` call: the manager's one round trip per step), then stores
every missing chunk with ``SET NX`` (``RedisBlockStore.put_if_absent``). A request is a system
prompt drawn Zipf-like from ``prompts`` (the same keys in every process: what a fleet shares)
followed by a few chunks of its own. A key another process stored between this one's lookup and
its store comes back EXISTED: a duplicate store Redis skipped.

Prints one Markdown table: per target and N, lookups (round trips) and keys per second, keys/s
per shard, p50 / p99 lookup round trip, stores and duplicates skipped, the CPU of each
redis-server and of the clients (percent of one core), and what saturates.

Run from the repository root: ``python -m benchmarks.fleet_sim [--processes 1 2 4 8 16]``.
Values are small (``--value-bytes``, 1 KiB) so memory stays small: the lookup path does not
depend on value size, and bytes per second per shard come from ``benchmarks/store_bench.py``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import redis

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.cluster import LocalCluster
from hma_redis.tools.devkit.local_redis import LocalRedis

NAMESPACE = "fleet-sim"
LATENCY_SAMPLES = 50_000  # per process, at most


@dataclass(frozen=True)
class Workload:
    """What each simulated scheduler asks for."""

    chunk_tokens: int = 256
    groups: int = 2
    prompts: int = 2000
    zipf_s: float = 1.1
    prefix_tokens: tuple[int, int] = (1024, 8192)
    own_chunks: tuple[int, int] = (1, 4)
    requests_per_step: int = 2
    value_bytes: int = 1024

    def prefix_chunks(self, prompt: int) -> int:
        """Chunks of system prompt ``prompt`` (fixed per prompt, the same in every process)."""
        lo, hi = self.prefix_tokens
        return random.Random(prompt).randrange(lo, hi) // self.chunk_tokens


@dataclass
class Tally:
    """One process's counts (sent back to the parent)."""

    steps: int = 0
    keys: int = 0
    hits: int = 0
    stored: int = 0
    duplicates: int = 0
    failed: int = 0
    cpu_s: float = 0.0
    latencies: list[float] | None = None


def _hex(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


@functools.cache
def _prefix_hashes(work: Workload, prompt: int) -> list[bytes]:
    return [_hex(prompt, i) for i in range(work.prefix_chunks(prompt))]


def _request_keys(
    work: Workload, keys: KeySpace, rng: random.Random, weights: list[float]
) -> list[str]:
    (prompt,) = rng.choices(range(work.prompts), weights)
    own = rng.randrange(*work.own_chunks)
    hashes = _prefix_hashes(work, prompt) + [_hex(rng.random(), i) for i in range(own)]
    return [keys.block_key(g, h) for g in range(work.groups) for h in hashes]


def _scheduler(url: str, work: Workload, seconds: float, seed: int, out: mp.Queue) -> None:
    store = RedisBlockStore(RedisTierConfig(url=url, read_timeout_s=10.0))
    keys = KeySpace("hma", NAMESPACE)
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** work.zipf_s for r in range(work.prompts)]
    value = bytes(work.value_bytes)
    tally, latencies = Tally(), []
    cpu0 = time.process_time()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        batch = [
            k
            for _ in range(work.requests_per_step)
            for k in _request_keys(work, keys, rng, weights)
        ]
        t0 = time.perf_counter()
        found = store.exists(batch)
        if len(latencies) < LATENCY_SAMPLES:
            latencies.append(time.perf_counter() - t0)
        tally.steps += 1
        tally.keys += len(batch)
        tally.hits += sum(found)
        missing = list(dict.fromkeys(k for k, f in zip(batch, found, strict=True) if not f))
        for result in store.put_if_absent([(k, value) for k in missing]):
            tally.stored += result is PutResult.STORED
            tally.duplicates += result is PutResult.EXISTED
            tally.failed += result is PutResult.FAILED
    tally.cpu_s = time.process_time() - cpu0
    tally.latencies = latencies
    store.close()
    out.put(tally)


@dataclass
class Row:
    target: str
    shards: int
    processes: int
    seconds: float
    tally: Tally
    server_cpu: list[float]  # percent of one core, per shard, over ``wall``
    wall: float  # from the first process's start to the last one's report
    client_cpu: float  # percent of one core, all processes together
    machine_cpu: float  # percent of the whole machine

    def line(self) -> str:
        t, s = self.tally, self.seconds
        lat = sorted(t.latencies or [0.0])
        p50 = lat[len(lat) // 2] * 1e3
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3
        keys_s = t.keys / s
        attempts = t.stored + t.duplicates + t.failed
        hit = t.hits / max(t.keys, 1)
        return (
            f"| {self.target} | {self.processes} | {t.steps / s:,.0f} | {keys_s:,.0f} "
            f"| {keys_s / self.shards:,.0f} | {p50:.2f} / {p99:.2f} | {hit:.0%} "
            f"| {t.stored / s:,.0f} | {t.duplicates} ({t.duplicates / max(attempts, 1):.1%}) "
            f"| {t.failed} | {' / '.join(f'{c:.0f}' for c in self.server_cpu)} "
            f"| {self.server_us_per_key():.2f} | {self.client_cpu:.0f} | {self.machine_cpu:.0f} "
            f"| {self.saturates()} |"
        )

    def server_us_per_key(self) -> float:
        """redis-server CPU (all shards) per key looked up, stores included: a shard's
        ceiling is about 10^6 / this keys/s."""
        cpu_s = sum(self.server_cpu) / 100 * self.wall
        return 1e6 * cpu_s / max(self.tally.keys, 1)

    def saturates(self) -> str:
        cores = psutil.cpu_count() or 1
        if max(self.server_cpu) >= 90:
            return "redis-server CPU"
        if self.machine_cpu >= 90:
            return f"machine CPU ({cores} cores: clients + servers)"
        return "neither (clients wait on round trips)"


HEADER = (
    "| target | N | lookups/s | keys/s | keys/s per shard | lookup RTT p50 / p99 ms | hit "
    "| stores/s | duplicate stores skipped | failed | redis-server CPU % (per shard) "
    "| server CPU µs per key | client CPU % | machine CPU % | saturates |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _cpu_s(procs: Sequence[psutil.Process]) -> list[float]:
    return [sum(p.cpu_times()[:2]) for p in procs]


def measure(
    target: str, url: str, servers: Sequence[psutil.Process], n: int, work: Workload, seconds: float
) -> Row:
    """Run ``n`` simulated schedulers for ``seconds`` against ``url``."""
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=_scheduler, args=(url, work, seconds, 1000 + i, out)) for i in range(n)
    ]
    cpu0 = _cpu_s(servers)
    psutil.cpu_percent()
    t0 = time.monotonic()
    for p in procs:
        p.start()
    tallies = [out.get(timeout=seconds + 120) for _ in procs]
    wall = time.monotonic() - t0
    machine = psutil.cpu_percent()
    cpu1 = _cpu_s(servers)
    for p in procs:
        p.join()
    total = Tally(latencies=[])
    for t in tallies:
        for name in ("steps", "keys", "hits", "stored", "duplicates", "failed", "cpu_s"):
            setattr(total, name, getattr(total, name) + getattr(t, name))
        total.latencies += t.latencies or []  # type: ignore[operator]
    return Row(
        target=target,
        shards=len(servers),
        processes=n,
        seconds=seconds,
        tally=total,
        server_cpu=[100 * (b - a) / wall for a, b in zip(cpu0, cpu1, strict=True)],
        wall=wall,
        client_cpu=100 * total.cpu_s / seconds,
        machine_cpu=machine,
    )


def _bound(clients: Sequence[redis.Redis], maxmemory: str) -> None:
    for client in clients:
        client.config_set("maxmemory", maxmemory)
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.flushall()


@contextmanager
def single(maxmemory: str) -> Iterator[tuple[str, list[psutil.Process], list[redis.Redis]]]:
    server = LocalRedis().start()
    try:
        assert server.proc is not None
        clients = [redis.Redis(port=server.port)]
        _bound(clients, maxmemory)
        yield server.url, [psutil.Process(server.proc.pid)], clients
    finally:
        server.stop()


@contextmanager
def cluster(maxmemory: str) -> Iterator[tuple[str, list[psutil.Process], list[redis.Redis]]]:
    nodes = LocalCluster().start()
    try:
        clients = nodes.clients()
        _bound(clients, maxmemory)
        procs = [psutil.Process(n.proc.pid) for n in nodes.nodes if n.proc is not None]
        yield nodes.url, procs, clients
    finally:
        nodes.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--targets", nargs="+", default=["single", "cluster"])
    parser.add_argument("--maxmemory", default="256mb")
    parser.add_argument("--value-bytes", type=int, default=Workload.value_bytes)
    parser.add_argument("--requests-per-step", type=int, default=Workload.requests_per_step)
    args = parser.parse_args(argv)
    work = Workload(value_bytes=args.value_bytes, requests_per_step=args.requests_per_step)
    mean_keys = statistics.mean(
        work.groups * (work.prefix_chunks(p) + sum(work.own_chunks) / 2)
        for p in range(work.prompts)
    )
    print(
        f"workload: {work}; ~{mean_keys * work.requests_per_step:.0f} keys per lookup; "
        f"{psutil.cpu_count()} CPU cores\n"
    )
    print(HEADER)
    for target in args.targets:
        start = single if target == "single" else cluster
        with start(args.maxmemory) as (url, servers, clients):
            for n in args.processes:
                for client in clients:
                    client.flushall()
                print(measure(target, url, servers, n, work, args.seconds).line(), flush=True)
            evicted = sum(int(c.info("stats")["evicted_keys"]) for c in clients)
            print(f"<!-- {target}: evicted keys over its runs: {evicted} -->", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
