"""The bench's ``hma-tiering`` column: hma_redis as a secondary tier of vLLM's
``TieringOffloadingSpec``, cascading chunks from the primary buffer to Redis and promoting
them back.

One ``TieringOffloadingSpec`` per value size, built from a hand-made ``OffloadingConfig`` of the
bench's KV layout (``LAYERS`` x ``PAGE_BYTES`` per block, ``blocks_per_chunk`` blocks per
chunk): ``spec.get_manager()`` creates vLLM's primary tier in ``/dev/shm`` and the Redis tier
from the ``secondary_tiers`` entry, as vLLM does. Each run fills a job's worth of primary rows
with random bytes, submits one cascade (``submit_store``) of them and one promotion
(``submit_load``) into other rows, each timed from submit until ``get_finished_jobs`` reports
it, and compares the rows byte for byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from hma_redis.core.config import PASSWORD_ENV, RedisTierConfig, strip_userinfo
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.tools.bench.common import MIB, WAIT_SLICE_S, Meter, OffloadKeys, Samples, check

NAME = "hma-tiering"


class TieringBench:
    """The Redis secondary tier of one ``TieringOffloadingSpec`` per value size."""

    def __init__(
        self, cfg: RedisTierConfig, job_bytes: int, sizes: tuple[int, ...], layer_bytes: int
    ) -> None:
        """``layer_bytes``: KV bytes per block (all layers), so a chunk of ``size`` bytes is
        ``size // layer_bytes`` blocks."""
        self.cfg = dataclasses.replace(cfg, read_timeout_s=60.0)
        self.job_bytes = job_bytes
        self.name = NAME
        self._job_id = 0
        self._keys = OffloadKeys()
        self._rng = np.random.default_rng(3)
        self.tiers = {size: SpecTier(self.cfg, job_bytes, size, layer_bytes) for size in sizes}
        self.meter = Meter(next(iter(self.tiers.values())).store.client)

    def run(self, size: int, samples: Samples) -> None:
        tier = self.tiers[size]
        chunks = self.job_bytes // size
        keys = self._keys.take(chunks)
        src, dst = list(range(chunks)), list(range(chunks, 2 * chunks))
        tier.rows[src, :size] = self._rng.integers(0, 256, (chunks, size), dtype=np.uint8)
        tier.rows[dst] = 0

        started = self.meter.start()
        store_s, stored = tier.transfer(self._next_id(), keys, src, promotion=False)
        store_cost = self.meter.stop(started)
        started = self.meter.start()
        load_s, loaded = tier.transfer(self._next_id(), keys, dst, promotion=True)
        load_cost = self.meter.stop(started)
        check(stored.success, f"{NAME}: cascade failed ({size} B values)")
        check(loaded.success, f"{NAME}: promotion failed ({size} B values)")
        check(
            np.array_equal(tier.rows[src, :size], tier.rows[dst, :size]),
            f"{NAME}: promoted rows differ from cascaded ones ({size} B values)",
        )
        tier.delete(keys)
        samples.add(f"{NAME} store {size}", store_s, 0, store_cost)
        samples.add(f"{NAME} load {size}", load_s, 0, load_cost)

    def _next_id(self) -> int:
        self._job_id += 1
        return self._job_id

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()


class SpecTier:
    """One spec, its primary buffer and its Redis tier (chunks of ``size`` bytes)."""

    def __init__(self, cfg: RedisTierConfig, job_bytes: int, size: int, layer_bytes: int) -> None:
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        from hma_redis.adapter.tiering.tier import RedisSecondaryTier

        self.size = size
        entry = _tier_entry(cfg)
        spec = TieringOffloadingSpec(_offloading_config(job_bytes, size, layer_bytes, entry))
        self.spec = spec  # its create_worker: vLLM's worker on this primary (the GPU check)
        with _password_in_env(cfg), _connector_context():
            self.manager = spec.get_manager()
        (tier,) = self.manager.secondary_tiers  # type: ignore[attr-defined]
        assert isinstance(tier, RedisSecondaryTier)
        self.tier = tier
        view = self.manager.primary_tier.get_kv_memoryview()  # type: ignore[attr-defined]
        self.rows = np.asarray(view).view(np.uint8)
        self.store = RedisBlockStore(cfg)

    def transfer(
        self, job_id: int, keys: list[bytes], rows: list[int], promotion: bool
    ) -> tuple[float, Any]:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob

        job = TransferJob(job_id, keys, np.array(rows), promotion, ReqContext(req_id="bench"))  # type: ignore[arg-type]
        t0 = time.perf_counter()
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        while True:
            self.tier.wait_for_any_job(WAIT_SLICE_S)
            for result in self.tier.get_finished_jobs():
                if result.job_id == job_id:
                    return time.perf_counter() - t0, result

    def delete(self, keys: list[bytes]) -> None:
        """Remove the job's values (fresh keys each run: the tier never saw them before)."""
        from vllm.v1.kv_offload.base import get_offload_block_hash

        ks = self.tier.keyspace
        self.store.delete([ks.block_key(0, get_offload_block_hash(k)) for k in keys])  # type: ignore[arg-type]

    def close(self) -> None:
        self.rows = np.empty((0, 0), dtype=np.uint8)
        self.manager.shutdown()
        self.store.close()


# Connection options the bench's config carries over to the tier entry (the password apart).
_CARRIED = (
    "username",
    "db",
    "connect_timeout_s",
    "pool_size",
    "connections_per_job",
    "connections_per_thread",
    "tcp_congestion",
    "io_threads",
    "max_inflight_bytes",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_verify",
)


def _tier_entry(cfg: RedisTierConfig) -> dict[str, Any]:
    """The ``secondary_tiers`` entry for ``cfg``, without its password (see
    :func:`_password_in_env`)."""
    entry: dict[str, Any] = {
        "type": "RedisSecondaryTier",
        "module_path": "hma_redis.tiering",
        "redis_url": strip_userinfo(cfg.url),
        "read_timeout_s": cfg.read_timeout_s,
        "namespace": f"bench-tiering-{os.getpid()}",
    }
    entry.update({name: getattr(cfg, name) for name in _CARRIED if getattr(cfg, name) is not None})
    return entry


@contextlib.contextmanager
def _password_in_env(cfg: RedisTierConfig) -> Iterator[None]:
    """``HMA_REDIS_PASSWORD`` while vLLM builds the tier, as a deployment gives it (never in
    the entry), then the environment as it was."""
    before = os.environ.get(PASSWORD_ENV)
    if cfg.password is not None:
        os.environ[PASSWORD_ENV] = cfg.password
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PASSWORD_ENV, None)
        else:
            os.environ[PASSWORD_ENV] = before


@contextlib.contextmanager
def _connector_context() -> Iterator[None]:
    """What ``RedisOffloadingConnector`` gives the tier in an engine (vLLM's config, the
    namespace's inputs), here for a config-only tiny model of one full-attention group."""
    import tempfile

    import torch
    from transformers import LlamaConfig
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from hma_redis.adapter.spec import failure_reporting_connector

    with tempfile.TemporaryDirectory(prefix="hma-bench-model-") as model_dir:
        LlamaConfig(
            vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=1
        ).save_pretrained(model_dir)
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True),
            device_config=DeviceConfig("cpu"),
        )
        group = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.int8)
        kv_cache_config = KVCacheConfig(0, [], [KVCacheGroupSpec(["layers"], group)])
        with failure_reporting_connector(vllm_config, kv_cache_config):
            yield


def _offloading_config(job_bytes: int, size: int, layer_bytes: int, entry: dict[str, Any]) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers",), 0),),
        worker_kv_bytes_per_block=layer_bytes,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": 2 * job_bytes + MIB,
            "blocks_per_chunk": size // layer_bytes,
            "secondary_tiers": [entry],
        },
        engine_id=f"hma-bench-{os.getpid()}-{size}",
        model=OffloadingModelConfig(name="hma-bench", dtype="bench-int8"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=size // layer_bytes),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
