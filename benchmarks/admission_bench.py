"""Second-sighting admission on a synthetic trace: bytes written, Redis memory, hit rate.

Two scheduler-side managers (two "instances") share one Redis and take turns serving a trace of
requests: some reuse one of a few shared documents (a system prompt, a popular context), the rest
are one-off prompts never seen again. Each request is looked up as vLLM's scheduler does (every
chunk of every KV group, one batched round trip), its usable hit is the intersection over
groups, and the chunks it computed are offered to ``prepare_store``; the chunks the manager
admits are written to Redis as values of ``--value-kib`` (the worker's job, done here with the
store directly). The same trace runs with ``admission: always`` and ``second_sighting``.

    python benchmarks/admission_bench.py [--requests 600] [--redis-url redis://...]

Prints a markdown table (docs/performance.md, "Admission").
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import random
import time
from dataclasses import dataclass

import redis
from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.core.config import RedisTierConfig
from hma_redis.core.keys import KeySpace
from hma_redis.core.medium import PutResult
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.devkit.local_redis import LocalRedis

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
GROUPS = 2
CHUNK_TOKENS = 256


@dataclass
class Outcome:
    policy: str
    written_bytes: int = 0
    written_values: int = 0
    used_memory: int = 0
    keys: int = 0
    markers: int = 0
    usable_chunks: int = 0
    total_chunks: int = 0
    shared_usable: int = 0
    shared_total: int = 0
    seconds: float = 0.0


def trace(
    requests: int, shared_docs: int, shared_share: float, seed: int
) -> list[tuple[str, bool]]:
    """(document id, shared?) per request: shared documents drawn with a Zipf-like skew."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(shared_docs)]
    out = []
    for i in range(requests):
        if rng.random() < shared_share:
            doc = rng.choices(range(shared_docs), weights)[0]
            out.append((f"shared-{doc}", True))
        else:
            out.append((f"once-{i}", False))
    return out


def chunk_hashes(doc: str, chunks: int) -> list[bytes]:
    """A prefix-hash chain, as vLLM's block hashes are (each covers all before it)."""
    out, parent = [], b""
    for idx in range(chunks):
        parent = hashlib.sha256(parent + f"{doc}:{idx}".encode()).digest()
        out.append(parent)
    return out


def serve(
    manager: RedisOffloadingManager,
    store: RedisBlockStore,
    keyspace: KeySpace,
    req_id: str,
    hashes: list[bytes],
    value: bytes,
    outcome: Outcome,
) -> int:
    """One request: look every chunk up, use the intersection's hit, store what was computed.
    Returns the usable hit in chunks."""
    ctx = ReqContext(req_id=req_id)
    keys = []
    for group in range(GROUPS):
        for idx, block_hash in enumerate(hashes):
            key = make_offload_key(block_hash, group)
            ctx.set_offload_key_position(key, (idx + 1) * CHUNK_TOKENS)
            keys.append(key)
    for key in keys:
        manager.lookup(key, ctx)
    manager.on_schedule_end(END_OF_STEP)
    answers = [manager.lookup(key, ctx).name for key in keys]
    per_group = []
    for group in range(GROUPS):
        mine = answers[group * len(hashes) : (group + 1) * len(hashes)]
        run = next((i for i, a in enumerate(mine) if a != "HIT"), len(mine))
        per_group.append(run)
    usable = min(per_group)
    computed = [make_offload_key(h, g) for g in range(GROUPS) for h in hashes[usable:]]
    out = manager.prepare_store(computed, ctx)
    if out is not None and out.keys_to_store:
        items = [
            (
                keyspace.block_key(key[-1], key[:-4]),
                value,
            )
            for key in out.keys_to_store
        ]
        for result in store.put_if_absent(items):
            if result is PutResult.STORED:
                outcome.written_values += 1
                outcome.written_bytes += len(value)
        manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return usable


def run_policy(url: str, policy: str, args: argparse.Namespace) -> Outcome:
    client = redis.Redis.from_url(url)
    client.flushall()
    keyspace = KeySpace("hma", "admission-bench")
    managers, stores = [], []
    for _ in range(2):
        cfg = RedisTierConfig.from_extra_config({"redis_url": url, "admission": policy}, env={})
        store = RedisBlockStore(cfg, stats_key=keyspace.stats_key())
        stores.append(store)
        managers.append(
            RedisOffloadingManager(
                store,
                keyspace,
                lookup_wait_s=1.0,
                admission=policy,
                admission_window_s=3600,
                group_chunk_tokens=(CHUNK_TOKENS,) * GROUPS,
            )
        )
    value = bytes(args.value_kib * 1024)
    outcome = Outcome(policy)
    start = time.perf_counter()
    for i, (doc, shared) in enumerate(trace(args.requests, args.shared_docs, args.shared, 7)):
        which = i % 2
        usable = serve(
            managers[which],
            stores[which],
            keyspace,
            f"r{i}",
            chunk_hashes(doc, args.chunks),
            value,
            outcome,
        )
        outcome.usable_chunks += usable
        outcome.total_chunks += args.chunks
        if shared:
            outcome.shared_usable += usable
            outcome.shared_total += args.chunks
    outcome.seconds = time.perf_counter() - start
    outcome.used_memory = int(client.info("memory")["used_memory"])
    outcome.keys = int(client.dbsize())
    outcome.markers = sum(1 for _ in client.scan_iter(match="hma:admission-bench:seen:*"))
    for manager in managers:
        manager.shutdown()
    client.close()
    return outcome


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--redis-url", help="an existing Redis (it is FLUSHALLed); default: a local one"
    )
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--chunks", type=int, default=8, help="chunks per prompt (per group)")
    parser.add_argument("--shared-docs", type=int, default=20)
    parser.add_argument(
        "--shared", type=float, default=0.5, help="share of requests on shared docs"
    )
    parser.add_argument("--value-kib", type=int, default=16)
    args = parser.parse_args()

    local = None
    url = args.redis_url
    if url is None:
        local = LocalRedis().start()
        url = local.url
    try:
        results = [run_policy(url, p, args) for p in ("always", "second_sighting")]
    finally:
        if local is not None:
            local.stop()

    print(
        f"{args.requests} requests on 2 instances, {args.chunks} chunks x {GROUPS} groups of "
        f"{args.value_kib} KiB each, {args.shared:.0%} on {args.shared_docs} shared documents "
        f"(Zipf), the rest one-off; {platform.processor() or platform.machine()}, "
        f"redis-server local\n"
    )
    print(
        "| admission | values written | MiB written | Redis used_memory MiB | keys "
        "(of them markers) | usable hit rate | on shared docs | s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r.policy} | {r.written_values} | {mib(r.written_bytes)} | "
            f"{mib(r.used_memory)} | {r.keys} ({r.markers}) | "
            f"{r.usable_chunks / r.total_chunks:.1%} | "
            f"{r.shared_usable / max(1, r.shared_total):.1%} | {r.seconds:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
