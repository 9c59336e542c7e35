"""What the auth_key MAC costs: the candidate MACs, the codec, and the worker against Redis.

    .venv/bin/python benchmarks/mac_cost.py [--reps 7] [--url redis://...]

Three tables, all over 2 MiB values (the middle of the 1-4 MiB the design aims for):

1. the primitives over one 2 MiB buffer, and over it as 128 pieces of 16 KiB (the in-place
   store path feeds the MAC page by page): CRC32C, keyed BLAKE3 (``blake3`` package, the
   choice) and HMAC-SHA256 (``hashlib``, the alternative);
2. the codec: ``encode_parts`` (pages in place, CRC32C + MAC piece by piece) and ``decode``
   (CRC32C + MAC), without and with an auth_key;
3. the real worker (CPU KV cache, 8 layers of 16 KiB pages, 32 MiB jobs of 16 values) storing
   to and loading from a private ``redis-server`` (or ``--url``), without and with an auth_key.

Best of ``--reps`` for the primitives and the codec, median for the worker jobs.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import blake3
import crc32c
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    make_offload_key,
)

from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.adapter.worker import RedisOffloadingWorker
from hma_redis.core import codec
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis

VALUE = 2 << 20
PIECE = 16 << 10
LAYERS = 8
JOB_VALUES = 16
SECRET = os.urandom(32)


def best_of(fn: Callable[[], object], reps: int, inner: int = 20) -> float:
    """Seconds per call, best of ``reps`` rounds of ``inner`` calls."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def row(name: str, seconds: float, nbytes: int = VALUE) -> str:
    return f"  {name:<44} {seconds * 1e3:8.3f} ms {nbytes / seconds / 1e9:8.2f} GB/s"


def primitives(reps: int) -> list[str]:
    data = memoryview(os.urandom(VALUE))
    pieces = [data[i : i + PIECE] for i in range(0, VALUE, PIECE)]
    key = blake3.blake3(SECRET, derive_key_context="mac_cost").digest()

    def blake3_pieces() -> bytes:
        hasher = blake3.blake3(key=key)
        for piece in pieces:
            hasher.update(piece)
        return hasher.digest()

    def hmac_pieces() -> bytes:
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for piece in pieces:
            mac.update(piece)
        return mac.digest()

    cases: list[tuple[str, Callable[[], object]]] = [
        ("CRC32C (always computed)", lambda: crc32c.crc32c(data)),
        ("keyed BLAKE3, one buffer", lambda: blake3.blake3(data, key=key).digest()),
        ("keyed BLAKE3, 128 pieces of 16 KiB", blake3_pieces),
        ("HMAC-SHA256, one buffer", lambda: hmac.new(key, data, hashlib.sha256).digest()),
        ("HMAC-SHA256, 128 pieces of 16 KiB", hmac_pieces),
    ]
    return [row(name, best_of(fn, reps)) for name, fn in cases]


def codec_rows(reps: int) -> list[str]:
    blocks = VALUE // (LAYERS * PIECE)
    header = codec.BlockHeader("hma:bench:g0:00", 0, 0, blocks, (PIECE,) * LAYERS, "bfloat16")
    body = memoryview(os.urandom(header.body_bytes))
    pieces = [body[i : i + PIECE] for i in range(0, header.body_bytes, PIECE)]
    out = []
    for label, mac_key in (("no auth_key", None), ("auth_key", codec.MacKey.derive(SECRET))):
        value = b"".join(codec.encode_parts(header, pieces, mac_key))
        encode = best_of(lambda k=mac_key: codec.encode_parts(header, pieces, k), reps)
        decode = best_of(lambda k=mac_key, v=value: codec.decode(v, mac_key=k), reps)
        out += [row(f"encode_parts, {label}", encode), row(f"decode, {label}", decode)]
    return out


@contextmanager
def redis_url(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    server = LocalRedis().start()
    try:
        yield server.url
    finally:
        server.stop()


def _worker(url: str, auth_key: bytes | None) -> tuple[RedisOffloadingWorker, RedisBlockStore]:
    blocks = JOB_VALUES * VALUE // (LAYERS * PIECE)
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(-128, 128, (2 * blocks, PIECE), dtype=torch.int8, generator=gen)
        for _ in range(LAYERS)
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PIECE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, PIECE) for i in range(LAYERS)]],
    )
    store = RedisBlockStore(RedisTierConfig(url=url, read_timeout_s=60.0))
    worker = RedisOffloadingWorker(
        store=store,
        keyspace=KeySpace("hma", "mac-cost-" + ("keyed" if auth_key else "plain")),
        rank=0,
        kv_caches=caches,
        group_ids=[0],
        blocks_per_chunk=VALUE // (LAYERS * PIECE),
        kv_dtype="bfloat16",
        io_threads=4,
        max_inflight_bytes=256 << 20,
        shutdown_timeout_s=1.0,
        auth_key=auth_key,
    )
    return worker, store


def _run(worker: RedisOffloadingWorker, job_id: int, submit: Callable[[], Any]) -> float:
    start = time.perf_counter()
    submit()
    while True:
        for result in worker.get_finished():
            if result.job_id == job_id:
                if not result.success or job_id in worker.take_failed_load_jobs():
                    raise SystemExit(f"mac_cost: job {job_id} failed")
                return time.perf_counter() - start
        time.sleep(0.0002)


def worker_rows(url: str, reps: int) -> list[str]:
    """Store and load jobs, the two configurations interleaved round by round (the machine's
    load drifts; interleaving spreads the drift over both)."""
    blocks = JOB_VALUES * VALUE // (LAYERS * PIECE)
    src = GPULoadStoreSpec(list(range(blocks)), [blocks], [0])
    dst = GPULoadStoreSpec(list(range(blocks, 2 * blocks)), [blocks], [0])
    setups = {"no auth_key": _worker(url, None), "auth_key": _worker(url, SECRET)}
    times: dict[str, list[float]] = {
        f"{op} {label}": [] for op in ("store", "load") for label in setups
    }
    job_id = 0
    try:
        for rep in range(reps + 1):  # the first round warms up
            keys = RedisLoadStoreSpec(
                [
                    make_offload_key(rep.to_bytes(4, "big") + i.to_bytes(28, "big"), 0)
                    for i in range(JOB_VALUES)
                ]
            )
            for label, (worker, _store) in setups.items():
                job_id += 2
                stored = _run(
                    worker, job_id, lambda w=worker, j=job_id, k=keys: w.submit_store(j, src, k)
                )
                loaded = _run(
                    worker,
                    job_id + 1,
                    lambda w=worker, j=job_id + 1, k=keys: w.submit_load(j, k, dst),
                )
                if rep:
                    times[f"store {label}"].append(stored)
                    times[f"load {label}"].append(loaded)
    finally:
        for worker, store in setups.values():
            worker.shutdown()
            store.close()
    job_bytes = JOB_VALUES * VALUE
    return [
        row(
            f"{name.split()[0]} job (32 MiB), {name.split(' ', 1)[1]}",
            statistics.median(t),
            job_bytes,
        )
        for name, t in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--url", help="Redis for the worker rows (default: a private one)")
    args = parser.parse_args()
    print(f"MAC cost over {VALUE >> 20} MiB values ({os.cpu_count()} CPUs)")
    print("primitives, per 2 MiB:")
    print("\n".join(primitives(args.reps)))
    print("codec, per 2 MiB value:")
    print("\n".join(codec_rows(args.reps)))
    with redis_url(args.url) as url:
        print(f"worker against Redis, {JOB_VALUES} values per job (median):")
        print("\n".join(worker_rows(url, args.reps)))


if __name__ == "__main__":
    main()
