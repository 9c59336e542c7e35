"""The tier's data path against ``redis-benchmark``, plain redis-py and (optionally) LMCache's
Redis connectors, in one run.

    hma-redis bench [--quick | --smoke] [--url URL] [--reps N] [--plot PNG] [--json FILE]
                    [--lmcache-python PYTHON] [--mooncake-python PYTHON] [--connections N]
                    [--python-path] [--concurrency N,N,...]
    python benchmarks/tier_bench.py ...              (the same)

Without ``--url`` it starts its own ``redis-server`` on a free loopback port (persistence off) and
stops it at the end. For each value size (512 KiB, 2 MiB, 8 MiB) it measures, interleaved:

- ``redis-benchmark -P 4 -c 1 -d SIZE -t get,set``: what this Redis does for one C client;
- plain redis-py (hiredis parser and packer, as ``redis.Redis.from_url`` builds it): ``SET`` and
  ``GET`` pipelined 4 deep over a job's worth of values, every value read back compared;
- with ``--lmcache-python``: LMCache's ``redis://`` and native ``resp://`` connectors
  (``benchmarks/lmcache_peer.py`` run by that interpreter: a separate venv with LMCache; never
  in CI), ``batched_put`` and ``batched_get`` of a job's worth of values, every byte checked;
  and its multiprocess mode's Redis L2 adapter (column ``lmc-mp``; where the release has no MP
  mode, a note says why the column is absent);
- with ``--mooncake-python``: Mooncake Store over TCP on this host (``benchmarks/mooncake_peer.py``
  run by that interpreter: a separate venv with Mooncake; never in CI), its own master and a
  process holding the values, ``batch_put_from`` and ``batch_get_into`` of a job's worth of values
  from and into registered buffers, every byte checked;
- the real worker (:class:`~hma_redis.adapter.worker.RedisOffloadingWorker`) on CPU KV-cache
  tensors (8 layers of ``(num_blocks, 16 KiB)`` int8, ``blocks_per_chunk`` 4 / 16 / 64 for the
  three sizes), on the data path the transfer engine picks (native where it can: the header
  line says which; ``--connections N`` sets ``connections_per_job``, ``--connections-per-thread
  N`` ``connections_per_thread``): one ``submit_store`` job
  of fresh keys, as the manager sends one after its lookup answered MISS (no EXISTS check;
  CRC32C over the pages at scattered block ids, in place -> SET NX sent from the KV cache by
  ``sendmsg``) and one ``submit_load`` job (GETs whose values are received
  straight into the pages at other block ids, CRC32C as they arrive; the same on the C job's
  pure-Python twin), timed from submit until ``get_finished`` reports the job; the loaded
  blocks are compared with the stored ones byte for byte. ``--python-path`` measures the twin
  too (column ``hma-python``);
- the second mode (column ``hma-tier``, :mod:`hma_redis.tools.bench.tiering`): hma_redis as
  the Redis secondary tier of vLLM's ``TieringOffloadingSpec``, one cascade job (primary rows ->
  Redis) and one promotion job (Redis -> other primary rows) of the same bytes, chunks as large
  as the values, timed from submit until ``get_finished_jobs`` reports the job, rows compared.

``--concurrency 1,4,16`` measures instead N jobs in flight at once on one transfer engine,
loads and stores mixed, against LMCache's ``resp://`` client and its MP mode's Redis L2
adapter doing the same (:mod:`hma_redis.tools.bench.concurrency`).

Then lookups for a 32k-token prompt over 3 KV groups (256 chunks of 128 tokens each, half of them
present): one ``PING``, one :meth:`~hma_redis.core.redis.store.RedisBlockStore.exists` of the 768
keys, and one scheduler step of :class:`~hma_redis.adapter.manager.RedisOffloadingManager` (768
``lookup`` calls, ``on_schedule_end``, 768 ``lookup`` calls that now answer), each with its
count of Redis round trips.

Every figure is a median over repetitions that interleave all measurements, so load from other
processes hits each column alike. GB/s = 10^9 payload bytes per second (the KV bytes for the
worker, the value bytes for the others). ``--smoke`` runs every measured path once on small jobs
and checks what it measures is correct (bytes round-trip equal, lookups answer right, one round
trip per step), with ``redis-benchmark`` run on a few requests per size only; it runs the worker
on both data paths (native and Python) and checks every value each stored byte for byte against
the codec's encoding of the pages.

The connection (``--url``; with ``hma-redis bench`` also ``--password``, ``--username`` and the
TLS options, as for the other commands) reaches every client as a config, never on a command
line: ``redis-benchmark`` gets ``-h``/``-p`` (or ``-s``) and no credentials, and against a
server that needs a password its column is skipped (it reads a password only from its command
line, where other users can see it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import redis
import torch

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.client import tls_options
from hma_redis.tools.bench import copies
from hma_redis.tools.bench.common import (
    GB,
    KIB,
    KV_DTYPE,
    LAYERS,
    LMCACHE_PEER,
    MIB,
    MOONCAKE_PEER,
    PAGE_BYTES,
    WAIT_SLICE_S,
    BenchError,
    Cost,
    Meter,
    OffloadKeys,
    Plan,
    Samples,
    add_plan_options,
    bench_kv_cache,
    check,
    chosen_plan,
    peer_outcome,
    redis_benchmark_plan,
    report_lines,
    require_lmcache_python,
    require_mooncake_python,
    require_single_server,
    run_redis_benchmark,
    server_config,
    server_version,
    timed,
)
from hma_redis.tools.bench.concurrency import (
    ConcurrencyReport,
    concurrency_plan,
    format_concurrency,
    measure_concurrency,
    parse_levels,
)
from hma_redis.tools.bench.tiering import TieringBench

SIZES = (512 * KIB, 2 * MIB, 8 * MIB)
# Lookups: a 32k-token prompt in chunks of 128 tokens, over 3 KV groups.
PROMPT_TOKENS = 32768
CHUNK_TOKENS = 128
GROUPS = 3
CLIENTS = (
    "redis-benchmark",
    "redis-py",
    "lmcache-redis",
    "lmcache-resp",
    "lmcache-mp",
    "mooncake",
    "hma-python",
    "hma_redis",
    "hma-aead",
    "hma-tiering",
)
OPS = ("load", "store")
# The tables' rows: ``reload`` is the same job loaded again at once (a load after a load); the
# ``load`` row is the job's first load, right after its store.
TABLE_OPS = ("load", "reload", "store")
LMCACHE_CONNECTORS = ("redis", "resp", "mp")


@dataclass(frozen=True)
class TierPlan(Plan):
    """How much to measure; ``depth`` is the redis-py pipeline's depth too."""

    job_bytes: int  # KV payload per worker job and per redis-py batch (a multiple of 8 MiB)
    lookup_samples: int  # PING / exists / manager-step samples per repetition


FULL = TierPlan(
    reps=7, depth=4, rb_bytes=128 * MIB, sizes=SIZES, job_bytes=32 * MIB, lookup_samples=10
)
QUICK = TierPlan(
    reps=3, depth=4, rb_bytes=64 * MIB, sizes=SIZES, job_bytes=16 * MIB, lookup_samples=5
)
# rb_bytes so small that redis-benchmark runs its minimum (4 x depth requests) per size.
SMOKE = TierPlan(reps=1, depth=4, rb_bytes=1, sizes=SIZES, job_bytes=8 * MIB, lookup_samples=2)


# ---------------------------------------------------------------------------------- (b)


class RedisPyBench:
    """Plain redis-py as users would write it: SET / GET of raw values, pipelined ``depth``.
    A job's values are distinct (``job_bytes`` of them per size), as a KV cache's blocks are:
    sending the same few values again and again would send them from the CPU's cache, which
    no other client here gets (hma_redis reads a job's pages from the whole KV cache)."""

    def __init__(self, cfg: RedisTierConfig, plan: TierPlan, prefix: str) -> None:
        self.client = redis_py_client(cfg)
        self.meter = Meter(self.client)
        self.plan = plan
        self.prefix = prefix
        rng = random.Random(1)
        self.values = {
            size: [rng.randbytes(size) for _ in range(plan.job_bytes // size)] for size in SIZES
        }
        self._serial = 0

    def run(self, size: int, samples: Samples) -> None:
        count = self.plan.job_bytes // size
        depth = self.plan.depth
        values = self.values[size]
        self._serial += 1
        keys = [f"{self.prefix}:py:{self._serial}:{i}" for i in range(count)]

        def put() -> None:
            for start in range(0, count, depth):
                pipe = self.client.pipeline(transaction=False)
                for i in range(start, min(count, start + depth)):
                    pipe.set(keys[i], values[i])
                check(all(pipe.execute()), "redis-py SET failed")

        def get() -> list[bytes]:
            out: list[bytes] = []
            for start in range(0, count, depth):
                pipe = self.client.pipeline(transaction=False)
                for key in keys[start : start + depth]:
                    pipe.get(key)
                out.extend(pipe.execute())
            return out

        started = self.meter.start()
        put_s, _ = timed(put)
        put_cost = self.meter.stop(started)
        started = self.meter.start()
        get_s, got = timed(get)
        get_cost = self.meter.stop(started)
        check(
            got == values,
            f"redis-py GET returned other bytes than SET wrote ({size} B values)",
        )
        self.client.unlink(*keys)
        samples.add(f"redis-py store {size}", put_s, -(-count // depth), put_cost)
        samples.add(f"redis-py load {size}", get_s, -(-count // depth), get_cost)

    def fresh_connections(self) -> None:
        """The next batches run on a new connection (see :func:`_warm_then_timed`)."""
        self.client.connection_pool.disconnect()

    def close(self) -> None:
        self.client.close()


def redis_py_client(cfg: RedisTierConfig) -> redis.Redis:
    """Plain redis-py as a user would build it for ``cfg`` (``Redis.from_url``: hiredis parser
    and packer), with the config's credentials, database and TLS files."""
    return redis.Redis.from_url(
        cfg.endpoint.address,
        username=cfg.username,
        password=cfg.password,
        db=cfg.db,
        socket_timeout=60,
        **tls_options(cfg),
    )


# ---------------------------------------------------------------------------------- (c)


class LMCachePeer:
    """LMCache's ``redis://`` and ``resp://`` (native, 2 threads) connectors and its MP mode's
    Redis L2 adapter (2 workers), the peers users would pick instead:
    ``benchmarks/lmcache_peer.py`` run by ``python``, the interpreter of a separate venv with
    LMCache installed (optional; never in CI). Each sample is one put and one get of a job's
    worth of fresh values, after one untimed warm-up, every byte checked. A release without the
    MP mode leaves a note in ``notes`` instead of its samples."""

    def __init__(self, python: str, cfg: RedisTierConfig, plan: TierPlan) -> None:
        require_lmcache_python(python, cfg)
        self.python = python
        self.url = cfg.url
        self.plan = plan
        self.version = "?"
        self.notes: list[str] = []  # why a column is absent

    def run(self, size: int, samples: Samples, count_syscalls: bool = False) -> None:
        """One sample of each connector at ``size``; with ``count_syscalls`` (the counting
        run) its system calls, and its bytes copied where the copy counter is built."""
        for connector in self._connectors():
            args = [
                self.python, str(LMCACHE_PEER), "--url", self.url, "--connector", connector,
                "--size", str(size), "--count", str(self.plan.job_bytes // size),
                "--reps", "1", "--threads", "2",
            ]  # fmt: skip
            env = None
            library = copies.library_path()
            if count_syscalls:
                args.append("--count-syscalls")
                if library is not None:
                    env = copies.preload_env(dict(os.environ), library, copies.new_counters_file())
            try:
                proc = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
            finally:
                if env is not None and os.path.exists(env[copies.COUNTERS_ENV]):
                    os.unlink(env[copies.COUNTERS_ENV])
            lines = proc.stdout.strip().splitlines()
            why, absent = peer_outcome(connector, proc)
            if absent:
                self.notes.append(f"lmc-mp absent: {why}")
                continue
            if proc.returncode or not lines:
                raise BenchError(f"bench: LMCache {connector}:// peer failed: {why}")
            result = json.loads(lines[-1])
            self.version = result["lmcache_version"]
            costs = {op: result.get(f"{op}_cost") or [None] for op in ("put", "get", "reget")}
            put_cost, get_cost, reget_cost = (
                Cost.from_json(costs[op][0]) if costs[op][0] else None
                for op in ("put", "get", "reget")
            )
            samples.add(f"lmcache-{connector} store {size}", result["put_s"][0], None, put_cost)
            samples.add(f"lmcache-{connector} load {size}", result["get_s"][0], None, get_cost)
            samples.add(
                f"lmcache-{connector} reload {size}", result["reget_s"][0], None, reget_cost
            )

    def _connectors(self) -> tuple[str, ...]:
        """The connectors still to measure: the MP mode is dropped once found absent."""
        if self.notes:
            return tuple(c for c in LMCACHE_CONNECTORS if c != "mp")
        return LMCACHE_CONNECTORS


class MooncakePeer:
    """Mooncake Store over TCP on this host, what vLLM users pick through
    ``MooncakeStoreConnector``: ``benchmarks/mooncake_peer.py`` run by ``python``, the
    interpreter of a separate venv with ``mooncake-transfer-engine-non-cuda`` (optional; never
    in CI). Each sample is one ``batch_put_from`` and one ``batch_get_into`` of a job's worth of
    fresh values, after one untimed warm-up, every byte checked; each run starts its own
    master and segment-holding client (untimed) and stops them."""

    def __init__(self, python: str, plan: TierPlan) -> None:
        require_mooncake_python(python)
        self.python = python
        self.plan = plan
        self.version = "?"

    def run(self, size: int, samples: Samples) -> None:
        count = self.plan.job_bytes // size
        args = [
            self.python, str(MOONCAKE_PEER), "--size", str(size), "--count", str(count),
            "--reps", "1", "--segment-bytes", str(max(1 << 30, 4 * self.plan.job_bytes)),
        ]  # fmt: skip
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        proc = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode or not lines:
            why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise BenchError(f"bench: Mooncake peer failed: {why}")
        result = json.loads(lines[-1])
        self.version = result["mooncake_version"]
        samples.add(f"mooncake store {size}", result["put_s"][0])
        samples.add(f"mooncake load {size}", result["get_s"][0])


# ---------------------------------------------------------------------------------- (d)


class TierBench:
    """The real worker on CPU int8 KV-cache tensors; one worker per ``blocks_per_chunk``.

    Each job moves ``job_bytes`` of KV: its blocks are read from random ids in the first third
    of the cache and loaded back into random ids of the second third, then at once again (the
    ``reload`` sample: a load that follows a load, as in a burst of requests) into random ids of
    the last third; both are compared.
    """

    def __init__(
        self,
        target: str | RedisTierConfig,
        plan: TierPlan,
        namespace: str,
        native: bool | None = None,
        name: str = "hma_redis",
        check_values: bool = False,
    ) -> None:

        from hma_redis.core.redis.store import RedisBlockStore

        self.plan = plan
        self.name = name
        self.check_values = check_values
        cfg = RedisTierConfig(url=target) if isinstance(target, str) else target
        self.cfg = dataclasses.replace(cfg, read_timeout_s=60.0)
        self.store = RedisBlockStore(self.cfg, native=native)
        self.keyspace = KeySpace(self.cfg.key_prefix, namespace)
        self.blocks = plan.job_bytes // (LAYERS * PAGE_BYTES)
        num_blocks = 3 * self.blocks
        kv = bench_kv_cache(self.cfg, self.store, self.keyspace, num_blocks, plan.sizes)
        self.tensors, self.arrays, self.workers = kv.tensors, kv.arrays, kv.workers
        self.data_path = next(iter(self.workers.values())).data_path
        self.rng = random.Random(2)
        self._keys = OffloadKeys()
        self._job_id = 0
        self._meter_client = redis_py_client(self.cfg)
        self.meter = Meter(self._meter_client)

    @staticmethod
    def blocks_per_chunk(size: int) -> int:
        return size // (LAYERS * PAGE_BYTES)

    def value_bytes(self, size: int) -> int:
        """Bytes of one stored value (envelope included) of this size."""
        from hma_redis.core import codec

        return codec.value_size(self._header(self.keyspace.block_key(0, bytes(32)), size))

    def _header(self, key: str, size: int) -> Any:
        from hma_redis.core import codec

        keyring = self.cfg.keyring()
        return codec.BlockHeader(
            key=key,
            group=0,
            first_block=0,
            num_blocks=self.blocks_per_chunk(size),
            page_bytes=(PAGE_BYTES,) * LAYERS,
            kv_dtype=KV_DTYPE,
            key_id=keyring.write.key_id if keyring is not None else "",
        )

    def _check_stored(self, keys: Sequence[bytes], src_ids: Sequence[int], size: int) -> None:
        """Every value the store job wrote is, byte for byte, the codec's encoding of its
        pages (with the auth_key's MAC where there is one); a sealed value (encryption_key)
        is, once opened with the tier's keys, those pages under the header they would have."""
        from hma_redis.core import codec

        mac_key = codec.MacKey.derive(self.cfg.auth_key) if self.cfg.auth_key else None
        keyring = self.cfg.keyring()
        bpc = self.blocks_per_chunk(size)
        for idx, offload_key in enumerate(keys):
            key = self.keyspace.block_key(0, offload_key[:-4])
            ids = src_ids[idx * bpc : (idx + 1) * bpc]
            body = b"".join(array[ids].tobytes() for array in self.arrays)
            got = self.store.get([key])[0]
            if keyring is not None and got is not None:
                block = codec.decode(got, key, 0, keyring=keyring)
                same = block.header == self._header(key, size) and bytes(block.body) == body
            else:
                same = got == bytes(codec.encode(self._header(key, size), body, mac_key))
            check(
                same,
                f"{self.name}: the value stored under {key} is not the codec's encoding of its "
                f"pages ({size} B values)",
            )

    def _wait(self, worker: Any, job_id: int) -> Any:
        """Asleep until the job has finished, as LMCache's peer waits on its adapter's event
        fd and redis-py's on its socket: a thread polling ``get_finished`` would take CPU from
        the job on a small host (docs/performance.md, "The bench's own wait")."""
        while True:
            worker.wait_for_any_job(WAIT_SLICE_S)
            for result in worker.get_finished():
                if result.job_id == job_id:
                    return result

    def run(self, size: int, samples: Samples) -> None:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        from hma_redis.adapter.types import RedisLoadStoreSpec

        worker = self.workers[size]
        chunks = self.blocks // self.blocks_per_chunk(size)
        keys = self._keys.take(chunks)
        src_ids = self.rng.sample(range(self.blocks), self.blocks)
        dst_ids = self.rng.sample(range(self.blocks, 2 * self.blocks), self.blocks)
        again_ids = self.rng.sample(range(2 * self.blocks, 3 * self.blocks), self.blocks)
        for array in self.arrays:
            array[dst_ids] = 0
            array[again_ids] = 0
        expected = chunks * self.value_bytes(size)

        self._job_id += 1
        trips = self.store.round_trips
        started = self.meter.start()
        t0 = time.perf_counter()
        worker.submit_store(
            self._job_id,
            GPULoadStoreSpec(src_ids, [self.blocks], [0]),
            # Fresh keys, as after the manager's lookup answered MISS: no EXISTS pre-check.
            RedisLoadStoreSpec(keys, known_absent=keys),  # type: ignore[arg-type]
        )
        result = self._wait(worker, self._job_id)
        store_s = time.perf_counter() - t0
        store_cost = self.meter.stop(started)
        store_trips = self.store.round_trips - trips
        check(
            result.transfer_size == expected,
            f"store job stored {result.transfer_size} of {expected} bytes ({size} B values)",
        )
        if self.check_values:
            self._check_stored(keys, src_ids, size)

        loads = [self._load(worker, keys, ids, size) for ids in (dst_ids, again_ids)]
        for layer, array in enumerate(self.arrays):
            for ids in (dst_ids, again_ids):
                check(
                    np.array_equal(array[src_ids], array[ids]),
                    f"loaded blocks differ from stored ones (layer {layer}, {size} B values)",
                )
        self.store.delete([self.keyspace.block_key(0, k[:-4]) for k in keys])
        samples.add(f"{self.name} store {size}", store_s, store_trips, store_cost)
        for op, (load_s, load_trips, load_cost) in zip(("load", "reload"), loads, strict=True):
            samples.add(f"{self.name} {op} {size}", load_s, load_trips, load_cost)

    def _load(
        self, worker: Any, keys: Sequence[bytes], dst_ids: Sequence[int], size: int
    ) -> tuple[float, int, Cost]:
        """One timed, metered load job of ``keys`` into the blocks ``dst_ids``: its seconds,
        round trips and cost (compared by the caller)."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        from hma_redis.adapter.types import RedisLoadStoreSpec

        self._job_id += 1
        trips = self.store.round_trips
        started = self.meter.start()
        t0 = time.perf_counter()
        worker.submit_load(
            self._job_id,
            RedisLoadStoreSpec(keys),  # type: ignore[arg-type]
            GPULoadStoreSpec(list(dst_ids), [self.blocks], [0]),
        )
        result = self._wait(worker, self._job_id)
        load_s = time.perf_counter() - t0
        cost = self.meter.stop(started)
        load_trips = self.store.round_trips - trips
        check(
            self._job_id not in worker.take_failed_load_jobs(),
            f"load job failed ({size} B values)",
        )
        expected = (len(dst_ids) // self.blocks_per_chunk(size)) * self.value_bytes(size)
        check(result.transfer_size == expected, f"load job moved {result.transfer_size} bytes")
        return load_s, load_trips, cost

    def fresh_connections(self) -> None:
        """The next jobs run on new value connections (see :func:`_warm_then_timed`)."""
        self.store.drop_value_connections()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.shutdown()
        self.store.close()
        self._meter_client.close()


# ---------------------------------------------------------------------------------- (e)


class LookupBench:
    """PING, ``exists`` and one manager step for a 32k-token prompt over 3 groups."""

    def __init__(self, store: Any, keyspace: KeySpace) -> None:
        from vllm.v1.kv_offload.base import make_offload_key

        self.store = store
        self.keyspace = keyspace
        chunks = PROMPT_TOKENS // CHUNK_TOKENS
        rng = random.Random(3)
        hashes = [rng.randbytes(32) for _ in range(chunks)]
        self.offload_keys = [make_offload_key(h, g) for g in range(GROUPS) for h in hashes]
        self.redis_keys = [keyspace.block_key(g, h) for g in range(GROUPS) for h in hashes]
        # The first half of the prompt's chunks were stored before, in every group.
        self.expected = [i % chunks < chunks // 2 for i in range(len(self.redis_keys))]
        present = [
            (k, b"x") for k, there in zip(self.redis_keys, self.expected, strict=True) if there
        ]
        stored = store.put_if_absent(present)
        check(len(stored) == len(present), "could not store the lookup keys")

    def run(self, samples: Samples) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

        from hma_redis.adapter.manager import RedisOffloadingManager

        store = self.store
        ping_s, _ = timed(store.ping)
        samples.add("ping", ping_s, 1)

        trips = store.round_trips
        exists_s, flags = timed(lambda: store.exists(self.redis_keys))
        check(flags == self.expected, "exists() answered wrong")
        check(store.round_trips - trips == 1, "exists() took more than one round trip")
        samples.add("exists", exists_s, store.round_trips - trips)

        manager = RedisOffloadingManager(store, self.keyspace)
        ctx = ReqContext(req_id="bench")
        end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        trips = store.round_trips
        t0 = time.perf_counter()
        first = [manager.lookup(k, ctx) for k in self.offload_keys]
        manager.on_schedule_end(end)
        while manager.has_pending_work():
            manager.on_schedule_end(end)
        second = [manager.lookup(k, ctx) for k in self.offload_keys]
        step_s = time.perf_counter() - t0
        manager.shutdown()
        check(all(r is LookupResult.RETRY for r in first), "unknown keys were not answered RETRY")
        want = [LookupResult.HIT if e else LookupResult.MISS for e in self.expected]
        check(second == want, "the manager answered wrong after its batch")
        check(store.round_trips - trips == 1, "a scheduler step took more than one round trip")
        samples.add("manager", step_s, store.round_trips - trips)

    def close(self) -> None:
        self.store.delete(
            [k for k, there in zip(self.redis_keys, self.expected, strict=True) if there]
        )


# ---------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class Report:
    plan: TierPlan
    samples: Samples
    value_bytes: dict[int, int]
    rb_args: dict[int, list[str]]
    redis_version: str
    where: str
    load_before: float
    load_after: float = 0.0
    seconds: float = 0.0
    lmcache_version: str | None = None
    mooncake_version: str | None = None
    notes: tuple[str, ...] = ()
    data_path: str = ""
    # name -> calls per system call of one job, from the counting run (--syscalls).
    syscalls: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # name -> bytes copied and through the kernel in one job (the counting run, the copy
    # counter preloaded), and why there are none where the counting run had no counter.
    copies: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    copies_note: str = ""

    @property
    def clients(self) -> list[str]:
        """The clients measured in this run, in table order."""
        return [
            c for c in CLIENTS if any(self.samples.has(f"{c} load {s}") for s in self.plan.sizes)
        ]

    def gbps(self, client: str, op: str, size: int) -> float | None:
        """GB/s of one client and operation, or None when not measured."""
        name = f"{client} {op} {size}"
        if not self.samples.has(name):
            return None
        if client == "redis-benchmark":
            return size / self.samples.median(name) / GB
        return self.plan.job_bytes / self.samples.median(name) / GB

    def to_json(self) -> dict[str, Any]:
        return {
            "redis_version": self.redis_version,
            "data_path": self.data_path,
            "lmcache_version": self.lmcache_version,
            "mooncake_version": self.mooncake_version,
            "load_average": [self.load_before, self.load_after],
            "plan": dataclasses.asdict(self.plan),
            "gbps": {
                f"{client} {op} {size}": self.gbps(client, op, size)
                for client in self.clients
                for op in TABLE_OPS
                for size in self.plan.sizes
            },
            "median_s": {name: self.samples.median(name) for name in self.samples.values},
            "round_trips": self.samples.round_trips,
            "syscalls": self.syscalls,
            "copies": self.copies,
            "median_cost": {
                name: dataclasses.asdict(cost)
                for name in self.samples.costs
                if (cost := self.samples.median_cost(name)) is not None
            },
        }


def _warm_then_timed(bench: Any, size: int, samples: Samples) -> None:
    """One untimed job of ``size`` right before the timed one, as LMCache's peer runs its
    untimed repetition right before its timed one. Without it a client's timed job would land
    after the other clients' (seconds later): Redis has returned the memory its last job freed to
    the system by then (jemalloc's decay), so every stored value page-faults in the server
    (~9000 faults per 32 MiB, about half the store's time here), while a job right after a
    warm-up reuses the pages its warm-up freed. Both on new connections where the bench can
    open them (``fresh_connections``), as LMCache's peer starts a process per repetition: on
    this host a connection's speed is a draw that lasts its life (docs/performance.md)."""
    fresh = getattr(bench, "fresh_connections", None)
    if fresh is not None:
        fresh()
    bench.run(size, Samples())
    bench.run(size, samples)


def measure(
    cfg: RedisTierConfig,
    plan: TierPlan,
    where: str,
    lmcache_python: str | None = None,
    python_path: bool = False,
    smoke: bool = False,
    tiering: bool = True,
    mooncake_python: str | None = None,
    count_syscalls: bool = False,
    encrypted: bool = False,
    copy_counter: copies.CopyCounter | None = None,
) -> Report:
    """Every measurement, interleaved, against the Redis ``cfg`` names. The worker runs on the
    data path its transfer engine picks; with ``python_path`` (always with ``smoke``) also
    on the Python path, with ``encrypted`` (always with ``smoke``) also with a random
    encryption key (column hma-aead: the cost of sealing), and ``smoke`` checks every stored
    value byte for byte (sealed ones once opened). ``count_syscalls``: a counting run after
    the timed ones, which counts bytes copied too where ``copy_counter`` is this process's."""
    namespace = f"bench-{os.getpid()}"
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    require_single_server(cfg)
    rb_args, notes = redis_benchmark_plan(cfg, plan)
    peer = LMCachePeer(lmcache_python, cfg, plan) if lmcache_python else None
    mooncake = MooncakePeer(mooncake_python, plan) if mooncake_python else None
    tier = TierBench(cfg, plan, namespace, check_values=smoke)
    tiers: list[TierBench | TieringBench] = [tier]
    if (python_path or smoke) and tier.data_path.startswith("native"):
        tiers.append(
            TierBench(cfg, plan, f"{namespace}-py", False, "hma-python", check_values=smoke)
        )
    if encrypted or smoke:
        sealed = dataclasses.replace(cfg, auth_key=None, encryption_key=os.urandom(32))
        tiers.append(TierBench(sealed, plan, f"{namespace}-aead", None, "hma-aead", smoke))
    if tiering:
        tiers.append(TieringBench(cfg, plan.job_bytes, plan.sizes, LAYERS * PAGE_BYTES))
    plain = RedisPyBench(cfg, plan, f"{tier.cfg.key_prefix}:{namespace}")
    lookups = LookupBench(tier.store, tier.keyspace)
    try:
        tier.store.ping()
        version = server_version(tier.store.client)
        warmup = Samples()
        for size in plan.sizes:  # first touch of every buffer and connection
            for bench in tiers:
                bench.run(size, warmup)
            plain.run(size, warmup)
        lookups.run(warmup)
        samples = Samples()
        for rep in range(plan.reps):
            for size in plan.sizes:
                # Alternate who goes first so neither always runs right after redis-benchmark.
                runners: list[Callable[[], None]] = [
                    partial(_warm_then_timed, bench, size, samples) for bench in tiers
                ]
                runners.append(partial(_warm_then_timed, plain, size, samples))
                if peer is not None:
                    runners.insert(1, partial(peer.run, size, samples))
                if mooncake is not None:
                    runners.insert(1, partial(mooncake.run, size, samples))
                if rep % 2:
                    runners.reverse()
                if rb_args:
                    for name, per_request in run_redis_benchmark(rb_args[size]).items():
                        op = "store" if name == "SET" else "load"
                        samples.add(f"redis-benchmark {op} {size}", per_request, 1)
                for runner in runners:
                    runner()
            for _ in range(plan.lookup_samples):
                lookups.run(samples)
        counted = _counting_run(plan, tiers, plain, peer, copy_counter) if count_syscalls else {}
        syscalls = {name: cost.syscalls for name, cost in counted.items() if cost.syscalls}
        copied = {name: cost.copies for name, cost in counted.items() if cost.copies}
        return Report(
            plan=plan,
            samples=samples,
            value_bytes={size: tier.value_bytes(size) for size in plan.sizes},
            rb_args=rb_args,
            redis_version=version,
            where=where,
            load_before=load_before,
            load_after=os.getloadavg()[0],
            seconds=time.perf_counter() - started,
            lmcache_version=peer.version if peer is not None else None,
            mooncake_version=mooncake.version if mooncake is not None else None,
            notes=(*notes, *(peer.notes if peer is not None else ())),
            data_path=tier.data_path,
            syscalls=syscalls,
            copies=copied,
            copies_note=_copies_note(count_syscalls, copy_counter),
        )
    finally:
        lookups.close()
        plain.close()
        for bench in tiers:
            bench.close()


def _counting_run(
    plan: TierPlan,
    tiers: Sequence[TierBench | TieringBench],
    plain: RedisPyBench,
    peer: LMCachePeer | None,
    copy_counter: copies.CopyCounter | None,
) -> dict[str, Cost]:
    """The counting run: one more job per client, size and operation, with ``strace -c -f``
    attached for the span its meter times (never timed: a traced process is many times
    slower) and the copy counter on where this process has one; each job's :class:`Cost`."""
    from hma_redis.tools.bench.syscalls import SyscallCounter

    counter = SyscallCounter()
    meters = [bench.meter for bench in (*tiers, plain)]
    counted = Samples()
    for meter in meters:
        meter.counter = counter
        meter.copies = copy_counter
    try:
        for size in plan.sizes:
            for bench in tiers:
                bench.run(size, counted)
            plain.run(size, counted)
            if peer is not None:
                peer.run(size, counted, count_syscalls=True)
    finally:
        for meter in meters:
            meter.counter = None
            meter.copies = None
    return {name: costs[-1] for name, costs in counted.costs.items() if costs}


def _copies_note(count_syscalls: bool, copy_counter: copies.CopyCounter | None) -> str:
    """Why a counting run has no bytes copied ("" when it has them or there was none)."""
    if not count_syscalls or copy_counter is not None:
        return ""
    if copies.library_path() is None:
        return "bytes copied: not counted (the copy counter was not built: no C compiler)"
    return (
        "bytes copied: not counted (the copy counter is preloaded by `hma-redis bench "
        "--syscalls` run as a command, and was not here)"
    )


# ---------------------------------------------------------------------------------- report


def size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def format_report(report: Report) -> str:
    plan, samples = report.plan, report.samples
    lines = [
        f"hma_redis tier benchmark: {report.redis_version}, {report.where}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads)",
        f"{plan.reps} interleaved repetitions, medians; load average {report.load_before:.2f} at "
        f"start, {report.load_after:.2f} at end; run took {report.seconds:.0f} s",
        f"KV cache: {LAYERS} layers x (num_blocks, {PAGE_BYTES // KIB} KiB) int8 on CPU; one value "
        f"= blocks_per_chunk x {LAYERS} x {PAGE_BYTES // KIB} KiB + a ~"
        f"{report.value_bytes[plan.sizes[0]] - plan.sizes[0]} B header",
        f"each hma_redis job and each redis-py batch moves {plan.job_bytes // MIB} MiB; redis-py "
        f"and redis-benchmark pipeline {plan.depth} deep; GB/s = 10^9 payload bytes per second",
        f"hma_redis data path: {report.data_path}",
    ]
    lines += report_lines(report.rb_args, report.notes)
    if report.lmcache_version is not None:
        lines.append(
            f"  LMCache {report.lmcache_version}: benchmarks/lmcache_peer.py, batched_put, then "
            "batched_get (resp://, 2 threads) or a get per key (redis://); lmc-mp: the MP "
            "mode's RESP L2 adapter (2 workers), submit_store_task / submit_load_task on L1 "
            "buffers"
        )
    if report.mooncake_version is not None:
        lines.append(
            f"  Mooncake Store {report.mooncake_version}: benchmarks/mooncake_peer.py, TCP on "
            "loopback, its own master and a mooncake_client holding the values, "
            "batch_put_from, then batch_get_into (registered buffers)"
        )
    lmcache = report.lmcache_version is not None
    mooncake = report.mooncake_version is not None
    short = {
        "hma-python": "hma-py",
        "hma-aead": "hma-aead",
        "redis-benchmark": "redis-bench",
        "lmcache-redis": "lmc-redis",
        "lmcache-resp": "lmc-resp",
        "lmcache-mp": "lmc-mp",
        "hma-tiering": "hma-tier",
    }
    columns = [short.get(c, c) for c in report.clients] + [
        "ms/job",
        "RT/job",
        "hma/r-py",
        "hma/r-bench",
    ]
    columns += ["hma/lmc-resp"] if lmcache else []
    columns += ["hma/mooncake"] if mooncake else []
    row = "{:<8}{:<7}{:>5}" + "{:>13}" * len(columns)
    lines += ["", row.format("value", "op", "bpc", *columns)]
    for size in plan.sizes:
        for op in TABLE_OPS:
            gbps = {c: report.gbps(c, op, size) for c in report.clients}
            hma = gbps["hma_redis"]
            name = f"hma_redis {op} {size}"
            cells = [_fmt(gbps[c]) for c in report.clients] + [
                f"{samples.median(name) * 1e3:.1f}",
                samples.round_trips[name],
                _ratio(hma, gbps["redis-py"]),
                _ratio(hma, gbps.get("redis-benchmark")),
            ]
            if lmcache:
                cells.append(_ratio(hma, gbps["lmcache-resp"]))
            if mooncake:
                cells.append(_ratio(hma, gbps["mooncake"]))
            lines.append(row.format(size_label(size), op, TierBench.blocks_per_chunk(size), *cells))
    lines += cost_lines(report, [short.get(c, c) for c in report.clients])
    lines += syscall_lines(report, [short.get(c, c) for c in report.clients])
    lines += copy_lines(report, [short.get(c, c) for c in report.clients])
    chunks = PROMPT_TOKENS // CHUNK_TOKENS
    keys = chunks * GROUPS
    lines += [
        "",
        f"lookups: {PROMPT_TOKENS}-token prompt, {GROUPS} groups x {chunks} chunks of "
        f"{CHUNK_TOKENS} tokens = {keys} keys, half present        median µs  round trips",
    ]
    for name, label in (
        ("ping", "PING"),
        ("exists", f"RedisBlockStore.exists({keys} keys)"),
        ("manager", f"manager step: {keys} lookup() + on_schedule_end + {keys} lookup()"),
    ):
        lines.append(
            f"  {label:<75}{samples.median(name) * 1e6:>10.0f}{samples.round_trips[name]:>13}"
        )
    lines += [
        "",
        "load = GETs -> values received into the KV cache at the job's block ids, CRC32C as they "
        "arrive, checked (C job or its",
        "pure-Python twin); reload = the same job again at once into other blocks (a load "
        "after a load; LMCache: a second get);",
        "store (fresh keys, as after a lookup MISS: no EXISTS) = CRC32C "
        "over the pages in place -> SET NX sent from the KV cache;",
        "timed from submit_* until get_finished reports the job. hma-tier: promotion (load) and "
        "cascade (store) of vLLM's primary-tier rows",
        "by the Redis secondary tier of TieringOffloadingSpec, on the same engine.",
    ]
    return "\n".join(lines)


# The cost tables: (title, the figure of one client's median cost for a job of ``nbytes`` that
# took ``seconds``).
_COST_TABLES: tuple[tuple[str, Callable[[Cost, int, float], str]], ...] = (
    ("client CPU s per GB (user + system, every thread of the client's process)",
     lambda c, n, s: f"{c.client_cpu_s / (n / GB):.3f}"),
    ("redis-server CPU s per GB (INFO cpu: used_cpu_user + used_cpu_sys)",
     lambda c, n, s: f"{c.server_cpu_s / (n / GB):.3f}"),
    ("redis-server busy: its CPU s / the job's wall s (1.00: the server bounds the job)",
     lambda c, n, s: f"{c.server_cpu_s / s:.2f}"),
    ("Redis commands per job (INFO commandstats calls)", lambda c, n, s: f"{c.commands}"),
)  # fmt: skip


def cost_lines(report: Report, labels: Sequence[str]) -> list[str]:
    """The cost tables, one row per value size and operation, one column per metered client
    (``-`` where a client was not metered); nothing when no client was."""
    plan, samples = report.plan, report.samples
    metered = [
        (client, label)
        for client, label in zip(report.clients, labels, strict=True)
        if any(samples.costs.get(f"{client} {op} {s}") for op in TABLE_OPS for s in plan.sizes)
    ]
    if not metered:
        return []
    row = "{:<8}{:<7}" + "{:>13}" * len(metered)
    lines: list[str] = []
    for title, figure in _COST_TABLES:
        lines += ["", title, row.format("value", "op", *(label for _, label in metered))]
        for size in plan.sizes:
            for op in TABLE_OPS:
                cells = []
                for client, _ in metered:
                    name = f"{client} {op} {size}"
                    cost = samples.median_cost(name)
                    cells.append("-" if cost is None else figure(cost, plan.job_bytes,
                                                                 samples.median(name)))  # fmt: skip
                lines.append(row.format(size_label(size), op, *cells))
    return lines


# The system calls of a job, in four groups and the rest.
_SYSCALL_GROUPS = (
    ("send", ("sendmsg", "sendto", "write", "writev")),
    ("recv", ("recvmsg", "recvfrom", "read", "readv")),
    ("wait", ("poll", "ppoll", "epoll_wait", "epoll_pwait", "select", "pselect6")),
    ("futex", ("futex",)),
    ("other", ("other",)),
)


def syscall_lines(report: Report, labels: Sequence[str]) -> list[str]:
    """System calls per job from the counting run, ``send/recv/wait/futex/other`` per client
    (nothing without ``--syscalls``)."""

    def cell(calls: dict[str, int]) -> str:
        return "/".join(str(sum(calls.get(n, 0) for n in names)) for _, names in _SYSCALL_GROUPS)

    title = (
        "system calls per job (strace -c -f, a counting run): send / recv / wait / futex / other"
    )
    return _counted_lines(report, labels, report.syscalls, title, cell, 22)


def copy_lines(report: Report, labels: Sequence[str]) -> list[str]:
    """Bytes per payload byte from the counting run with the copy counter: copied in user
    space / through the kernel (nothing without ``--syscalls``; a note where it had no
    counter)."""
    payload = report.plan.job_bytes

    def cell(counted: dict[str, int]) -> str:
        kernel = counted["kernel_in"] + counted["kernel_out"]
        return f"{counted['copied'] / payload:.2f} / {kernel / payload:.2f}"

    title = (
        "bytes per payload byte (the counting run, copy counter preloaded): copied in user "
        "space (memcpy, memmove) / through the kernel (read, write, send, recv)"
    )
    lines = _counted_lines(report, labels, report.copies, title, cell, 14)
    return lines or ([f"\n{report.copies_note}"] if report.copies_note else [])


def _counted_lines(
    report: Report,
    labels: Sequence[str],
    counts: dict[str, dict[str, int]],
    title: str,
    cell: Callable[[dict[str, int]], str],
    width: int,
) -> list[str]:
    """A table of the counting run's ``counts`` (by sample name) for the clients it counted,
    one ``cell`` per client, size and operation."""
    if not counts:
        return []
    counted = [
        (client, label)
        for client, label in zip(report.clients, labels, strict=True)
        if any(f"{client} {op} {s}" in counts for op in TABLE_OPS for s in report.plan.sizes)
    ]
    row = "{:<8}{:<7}" + f"{{:>{width}}}" * len(counted)
    lines = ["", title, row.format("value", "op", *(label for _, label in counted))]
    for size in report.plan.sizes:
        for op in TABLE_OPS:
            cells = [
                "-" if (found := counts.get(f"{client} {op} {size}")) is None else cell(found)
                for client, _ in counted
            ]
            lines.append(row.format(size_label(size), op, *cells))
    return lines


def draw_plot(report: Report, path: str) -> bool:
    """GB/s by value size, one line per client, load and store panels (PNG, drawn with PIL)."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        print("(no plot: Pillow is not installed)")
        return False
    width, height, pad, top_pad = 1200, 560, 70, 110
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    try:
        font: Any = ImageFont.load_default(size=16)
        small: Any = ImageFont.load_default(size=13)
    except TypeError:  # Pillow < 10.1: one bitmap font
        font = small = ImageFont.load_default()
    colors = {
        "redis-benchmark": (120, 120, 120),
        "redis-py": (31, 119, 180),
        "lmcache-redis": (148, 103, 189),
        "lmcache-resp": (44, 160, 44),
        "lmcache-mp": (23, 190, 207),
        "mooncake": (140, 86, 75),
        "hma-python": (255, 127, 14),
        "hma_redis": (214, 39, 40),
        "hma-aead": (227, 119, 194),
    }
    sizes = report.plan.sizes
    clients = report.clients
    values = [
        v for c in clients for op in OPS for s in sizes if (v := report.gbps(c, op, s)) is not None
    ]
    top = max(0.5, float(np.ceil(max(values, default=0.5) / 0.5) * 0.5))
    panel_w = (width - 3 * pad) // 2
    for idx, op in enumerate(OPS):
        left = pad + idx * (panel_w + pad)
        box = (left, top_pad, left + panel_w, height - pad)
        draw.rectangle(box, outline="black")
        title = f"{op} (GB/s)"
        draw.text((left + panel_w // 2, top_pad - 20), title, fill="black", font=font, anchor="mm")
        step = 0.25 if top <= 1.5 else 0.5
        ticks = round(top / step)
        for t in range(ticks + 1):
            y = box[3] - (box[3] - box[1]) * t / ticks
            draw.line((box[0], y, box[2], y), fill=(225, 225, 225))
            draw.text((box[0] - 8, y), f"{t * step:.2f}", fill="black", font=small, anchor="rm")

        def x_of(i: int, box: tuple[int, int, int, int] = box) -> float:
            return box[0] + (box[2] - box[0]) * (i + 0.5) / len(sizes)

        for i, size in enumerate(sizes):
            label = size_label(size)
            draw.text((x_of(i), box[3] + 16), label, fill="black", font=small, anchor="mm")
        at = (left + panel_w // 2, box[3] + 38)
        draw.text(at, "value size", fill="black", font=small, anchor="mm")
        for client in clients:
            points = [
                (x_of(i), box[3] - (box[3] - box[1]) * v / top)
                for i, s in enumerate(sizes)
                if (v := report.gbps(client, op, s)) is not None
            ]
            if len(points) > 1:
                draw.line(points, fill=colors[client], width=3)
            for x, y in points:
                draw.ellipse((x - 5, y - 5, x + 5, y + 5), fill=colors[client])
    for n, client in enumerate(clients):  # one legend row above both panels
        x = width // 2 - 95 * len(clients) + 190 * n
        draw.line((x, 30, x + 28, 30), fill=colors[client], width=3)
        draw.text((x + 36, 30), client, fill="black", font=small, anchor="lm")
    draw.text(
        (width // 2, height - 14),
        f"one run, {report.plan.reps} interleaved repetitions (medians), "
        f"{report.redis_version}, {os.cpu_count()} CPUs, loopback",
        fill=(90, 90, 90),
        font=small,
        anchor="mm",
    )
    image.save(path)
    return True


# ---------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's own options (``hma-redis bench`` adds the CLI's connection options)."""
    parser = argparse.ArgumentParser(
        prog="hma-redis bench",
        description="hma_redis' worker and lookups vs redis-benchmark and redis-py, in one run.",
        epilog="hma-redis bench also takes the CLI's connection options (--password, "
        "--username, --db, --tls-ca-file, ...; see hma-redis --help); they reach the "
        "benchmark's clients, never a command line (redis-benchmark is skipped for a server "
        "that needs a password).",
    )
    add_plan_options(parser, quick_s=40, reps=FULL.reps)
    parser.add_argument("--plot", metavar="PNG", help="draw GB/s by value size into this file")
    parser.add_argument(
        "--json",
        metavar="FILE",
        nargs="?",
        const="-",
        help="write the medians as JSON to FILE; without FILE (or -) to stdout, the tables to "
        "stderr",
    )
    parser.add_argument(
        "--connections",
        type=int,
        metavar="N",
        help="connections_per_job of the worker (default: the config's, 1)",
    )
    parser.add_argument(
        "--connections-per-thread",
        type=int,
        metavar="N",
        help="connections_per_thread of the worker (default: the config's, 2)",
    )
    parser.add_argument(
        "--python-path",
        action="store_true",
        help="also measure the worker on the Python data path (column hma-py)",
    )
    parser.add_argument(
        "--encrypted",
        action="store_true",
        help="also measure the worker with a random encryption_key (column hma-aead: the "
        "cost of AES-256-GCM sealing, beside hma_redis without it)",
    )
    parser.add_argument(
        "--concurrency",
        metavar="N,N,...",
        help="instead of the tables above: N jobs in flight at once on one transfer engine, "
        "loads and stores mixed, for each N (e.g. 1,4,16); with --lmcache-python LMCache's "
        "resp:// client and its MP mode's Redis adapter do the same in the same run "
        "(hma_redis.tools.bench.concurrency)",
    )
    parser.add_argument(
        "--syscalls",
        action="store_true",
        help="after the timed runs, one counting job per client, size and operation with "
        "strace -c -f attached: system calls per job (needs strace), and bytes copied per "
        "payload byte (the bench starts itself again with its copy counter preloaded)",
    )
    parser.add_argument(
        "--lmcache-python",
        metavar="PYTHON",
        help="also measure LMCache's redis:// and resp:// connectors and its MP mode's Redis "
        "adapter with this interpreter (a separate venv with lmcache==0.5.6; see "
        "docs/performance.md)",
    )
    parser.add_argument(
        "--mooncake-python",
        metavar="PYTHON",
        help="also measure Mooncake Store over TCP on this host with this interpreter (a "
        "separate venv with mooncake-transfer-engine-non-cuda; see docs/performance.md)",
    )
    return parser


def main(argv: Sequence[str] | None = None, cfg: RedisTierConfig | None = None) -> int:
    """Run the benchmark and print its table; 0, or ``SystemExit`` if what it measured is wrong.

    ``cfg`` (from ``hma-redis bench``'s connection options) is the Redis to measure; without it,
    ``--url``, else a throwaway local ``redis-server``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if cfg is None and args.url is not None:
        cfg = RedisTierConfig(url=args.url)
    plan = chosen_plan(parser, args, FULL, QUICK, SMOKE)
    if args.connections is not None and args.connections < 1:
        parser.error("--connections must be at least 1")
    levels = None
    if args.concurrency is not None:
        try:
            levels = parse_levels(args.concurrency)
        except ValueError as exc:
            parser.error(str(exc))
        if args.plot or args.python_path or args.mooncake_python or args.syscalls:
            parser.error(
                "--concurrency takes neither --plot, --python-path, --mooncake-python nor "
                "--syscalls"
            )
    if args.mooncake_python is not None:
        require_mooncake_python(args.mooncake_python)  # before any server starts
    # Before any server starts: the counter's preload is not handed to what this process runs.
    copy_counter = copies.CopyCounter.attached() if args.syscalls else None
    to_stdout = args.json == "-"
    # With the JSON on stdout, everything else goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext():
        if levels is not None:
            report: Report | ConcurrencyReport = _concurrency_and_print(cfg, args, levels)
        else:
            report = _measure_and_print(cfg, args, plan, copy_counter)
    if to_stdout:
        json.dump(report.to_json(), sys.stdout, indent=2)
        print()
    elif args.json:
        with open(args.json, "w") as fh:
            json.dump(report.to_json(), fh, indent=2)
    return 0


def _connections(target: RedisTierConfig, args: argparse.Namespace) -> RedisTierConfig:
    """``target`` with the ``--connections`` / ``--connections-per-thread`` asked for."""
    if args.connections is not None:
        target = dataclasses.replace(target, connections_per_job=args.connections)
    if args.connections_per_thread is not None:
        target = dataclasses.replace(target, connections_per_thread=args.connections_per_thread)
    return target


def _concurrency_and_print(
    cfg: RedisTierConfig | None, args: argparse.Namespace, levels: tuple[int, ...]
) -> ConcurrencyReport:
    """The concurrent mode (:mod:`~hma_redis.tools.bench.concurrency`) against ``cfg`` (or a
    local server); print its table; the report."""
    plan = concurrency_plan(levels, smoke=args.smoke, quick=args.quick, reps=args.reps)
    with server_config(cfg) as (target, where):
        report = measure_concurrency(_connections(target, args), plan, where, args.lmcache_python)
    print(format_concurrency(report))
    if args.smoke:
        print(
            "\nsmoke: every concurrent job moved its bytes; every load's blocks and every "
            "stored value read back equal the stored pages"
        )
    return report


def _measure_and_print(
    cfg: RedisTierConfig | None,
    args: argparse.Namespace,
    plan: TierPlan,
    copy_counter: copies.CopyCounter | None,
) -> Report:
    """Measure ``plan`` against ``cfg`` (or a local server); print the tables and the plot's
    path; the report."""
    with server_config(cfg) as (target, where):
        report = measure(
            _connections(target, args),
            plan,
            where,
            args.lmcache_python,
            args.python_path,
            smoke=args.smoke,
            mooncake_python=args.mooncake_python,
            count_syscalls=args.syscalls,
            encrypted=args.encrypted,
            copy_counter=copy_counter,
        )
    print(format_report(report))
    if args.smoke:
        paths = "native and Python data paths" if "hma-python" in report.clients else "data path"
        print(
            "\nsmoke: every measured path round-tripped its bytes and answered right "
            f"(worker on the {paths}; every stored value equals the codec's encoding)"
        )
    if args.plot and draw_plot(report, args.plot):
        print(f"plot written to {args.plot}")
    return report


if __name__ == "__main__":
    if "--syscalls" in sys.argv:
        copies.reexec_preloaded()
    raise SystemExit(main())
