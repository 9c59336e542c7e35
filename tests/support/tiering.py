"""vLLM's real ``TieringOffloadingManager`` with hma_redis' Redis tier, without a model.

Built the way vLLM builds it: the scheduler side of the documented connector
(``RedisOffloadingConnector``) creates a ``TieringOffloadingSpec`` from the scheduler harness'
config and asks it for its manager. The GPU half is simulated at the primary tier's edge: a
"GPU store" writes known bytes into the primary rows vLLM's ``prepare_store`` hands out and
completes the store (which cascades to Redis); a "GPU load" reads the rows ``prepare_load``
names. Each instance has its own engine id, hence its own primary buffer in ``/dev/shm``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.config import KVEventsConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from hma_redis.adapter.connector import RedisOffloadingConnector
from hma_redis.adapter.tiering.tier import RedisSecondaryTier
from tests.support.scheduler_harness import make_vllm_config, three_group_kv_cache_config

TIER_TYPE = "RedisSecondaryTier"
TIER_MODULE = "hma_redis.tiering"
# Rows in the primary tier (its cpu_bytes_to_use is this many chunks of the tiny model).
PRIMARY_CHUNKS = 32


def tier_entry(redis_url: str, **options: Any) -> dict[str, Any]:
    """One ``secondary_tiers`` entry for the Redis tier (without ``redis_url`` when it is "":
    the tier then takes ``HMA_REDIS_URL``)."""
    url = {"redis_url": redis_url} if redis_url else {}
    return {"type": TIER_TYPE, "module_path": TIER_MODULE, **url, **options}


def tiering_extra_config(
    redis_url: str, cpu_chunks: int = PRIMARY_CHUNKS, **options: Any
) -> dict[str, Any]:
    """``kv_connector_extra_config`` of TieringOffloadingSpec with the Redis tier."""
    return {
        "spec_name": "TieringOffloadingSpec",
        "spec_module_path": None,
        # 24576 bytes per chunk for the tiny model's three groups (rounded to 4 KiB pages).
        "cpu_bytes_to_use": cpu_chunks * 24576,
        "secondary_tiers": [tier_entry(redis_url, **options)],
    }


@dataclass
class TieringInstance:
    """One vLLM instance's tiering manager (scheduler side) with its Redis tier."""

    manager: TieringOffloadingManager
    tier: RedisSecondaryTier
    rows: np.ndarray  # the primary buffer, (num_chunks, row_bytes) uint8, shared with vLLM
    payload_bytes: int
    _next_req: int = 0
    closed: bool = False

    def context(self) -> ReqContext:
        self._next_req += 1
        ctx = ReqContext(req_id=f"req-{self._next_req}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self, pause_s: float = 0.005) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(pause_s)

    def gpu_store(self, keys: list[OffloadKey], payloads: list[bytes], ctx: ReqContext) -> None:
        """Store chunks into the primary (as vLLM's worker does from the GPU), which cascades
        them to Redis."""
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys, out
        for row, payload in zip(out.store_spec.block_ids, payloads, strict=True):
            self.rows[int(row), : len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        self.manager.complete_store(keys, ctx)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Step until no tier job or lookup batch is in flight."""
        deadline = time.monotonic() + timeout_s
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier work did not settle"
            self.step()

    def lookup_until_settled(
        self, keys: list[OffloadKey], ctx: ReqContext, timeout_s: float = 10.0
    ) -> list[LookupResult]:
        """vLLM's scheduler loop for one request: look every key up each step until no
        answer is RETRY or HIT_PENDING; the final answers."""
        deadline = time.monotonic() + timeout_s
        while True:
            answers = [self.manager.lookup(k, ctx) for k in keys]
            waiting = {LookupResult.RETRY, LookupResult.HIT_PENDING}
            if not waiting & set(answers):
                return answers
            assert time.monotonic() < deadline, answers
            self.step()

    def gpu_load(self, keys: list[OffloadKey], ctx: ReqContext) -> list[bytes]:
        """The primary rows a GPU load of ``keys`` reads (payload bytes of each)."""
        spec = self.manager.prepare_load(keys, ctx)
        rows = [bytes(self.rows[int(r), : self.payload_bytes]) for r in spec.block_ids]
        self.manager.complete_load(keys, ctx)
        return rows

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            # vLLM closes the primary's mmap at shutdown: no view of it may be left.
            self.rows = np.empty((0, 0), dtype=np.uint8)
            self.manager.shutdown()


def make_instance(
    model_dir: str,
    redis_url: str,
    *,
    cpu_chunks: int = PRIMARY_CHUNKS,
    kv_events: bool = False,
    model_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> TieringInstance:
    """A fresh instance (own engine id, own primary buffer) with the Redis tier; ``kv_events``
    turns vLLM's KV cache events on; ``model_kwargs`` go to vLLM's ``ModelConfig``
    (``revision``, ``hf_overrides``, ...)."""
    vllm_config = make_vllm_config(
        model_dir,
        redis_url,
        extra_config=tiering_extra_config(redis_url, cpu_chunks, **options),
        model_kwargs=model_kwargs,
    )
    if kv_events:
        vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True)
    vllm_config.kv_transfer_config.engine_id = f"hma-tier-test-{uuid.uuid4().hex[:12]}"
    manager = tiering_manager(vllm_config, three_group_kv_cache_config(16, 1000, 3))
    assert isinstance(manager, TieringOffloadingManager), type(manager)
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, RedisSecondaryTier), type(tier)
    view = manager.primary_tier.get_kv_memoryview()
    rows = np.asarray(view).view(np.uint8)
    return TieringInstance(manager, tier, rows, tier.row.payload_bytes)


def tiering_manager(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Any:
    """The scheduler side's manager as vLLM builds it in an engine: the connector
    (RedisOffloadingConnector, as documented for this mode) builds ``TieringOffloadingSpec``
    from ``build_offloading_config`` and asks it for its manager."""
    connector = RedisOffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert connector.connector_scheduler is not None
    return connector.connector_scheduler.manager


def chunk_keys(seed: int, count: int, group: int = 0) -> list[OffloadKey]:
    """``count`` distinct offload keys of ``group`` (random-looking block hashes)."""
    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(32), group) for _ in range(count)]


def payloads(seed: int, count: int, nbytes: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(nbytes) for _ in range(count)]
