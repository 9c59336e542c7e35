"""A real vLLM ``Scheduler`` wired to hma_redis through ``RedisOffloadingConnector``.

Mirrors the pattern of vLLM's unit tests (``tests/v1/kv_connector/unit/offloading_connector``):
a real scheduler on the CPU, no model, no worker process. Where vLLM's tests plug in a mock
offloading spec, this harness plugs in the real ``hma_redis.spec.RedisOffloadingSpec`` against a
real Redis. The worker side is simulated only as far as the scheduler needs it: every transfer job
the scheduler issues is reported finished in the same step (loads as ``finished_recving``, all jobs
in ``OffloadingWorkerMetadata.completed_jobs``), as vLLM's tests do with ``complete_transfers``;
``step(complete_stores=False)`` holds store jobs back (a store still in flight).
Nothing is ever written to or read from the KV cache.

KV cache layout used by default (three groups, one block = one chunk unless ``blocks_per_chunk``):

- group 0: full attention (``FullAttentionSpec``)
- group 1: sliding window of ``sliding_window_blocks`` blocks (``SlidingWindowSpec``)
- group 2: full attention again, other layers (or a second sliding window, ``third_group``)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any, Literal

import redis
import torch
from transformers import LlamaConfig
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hma_redis.adapter.manager import RedisOffloadingManager
from hma_redis.adapter.spec import RedisOffloadingSpec, failure_reporting_connector
from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.core.keys import KeySpace
from tests.support.redis_server import command_calls, command_delta

EOS_TOKEN_ID = 1
HEAD_SIZE = 64
# Time between scheduler steps (stands in for the model forward): the manager waits at most 5 ms
# for a lookup batch inside a step; this lets a batch that missed that wait land before the next.
STEP_PAUSE_S = 0.02

_request_ids = count()


def write_tiny_model_config(path: str | Path) -> str:
    """A config-only Llama checkpoint dir: enough for ``ModelConfig`` (no weights needed)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_SIZE,
        max_position_embeddings=2048,
    ).save_pretrained(out)
    return str(out)


def _full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float32
    )


def _sliding(block_size: int, window_tokens: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=HEAD_SIZE,
        dtype=torch.float32,
        sliding_window=window_tokens,
    )


def three_group_kv_cache_config(
    block_size: int,
    num_blocks: int,
    sliding_window_blocks: int,
    third_group: Literal["full", "sliding"] = "full",
    third_window_blocks: int = 2,
) -> KVCacheConfig:
    third: KVCacheSpec = (
        _full(block_size)
        if third_group == "full"
        else _sliding(block_size, third_window_blocks * block_size)
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], _full(block_size)),
            KVCacheGroupSpec(
                ["model.layers.1.self_attn.attn"],
                _sliding(block_size, sliding_window_blocks * block_size),
            ),
            KVCacheGroupSpec(["model.layers.2.self_attn.attn"], third),
        ],
    )


def make_vllm_config(
    model_dir: str,
    redis_url: str,
    *,
    block_size: int = 16,
    blocks_per_chunk: int = 1,
    num_blocks: int = 1000,
    max_num_batched_tokens: int = 4096,
    extra_config: dict[str, object] | None = None,
    hash_algo: str = "sha256",
    kv_connector: str = "RedisOffloadingConnector",
    kv_connector_module_path: str | None = "hma_redis.connector",
    kv_load_failure_policy: str = "recompute",
    model_kwargs: dict[str, object] | None = None,
) -> VllmConfig:
    """The harness' VllmConfig: the tiny model on the CPU, the tier as the KV connector.
    ``model_kwargs`` go to ``ModelConfig`` (e.g. ``revision``, ``quantization``)."""
    extra: dict[str, object] = {
        "spec_name": "RedisOffloadingSpec",
        "spec_module_path": "hma_redis.spec",
        "redis_url": redis_url,
        "blocks_per_chunk": blocks_per_chunk,
    }
    extra.update(extra_config or {})
    model: dict[str, object] = {"dtype": "float32", **(model_kwargs or {})}
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            seed=0,
            **model,  # type: ignore[arg-type]
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=2048,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=True,
            prefix_caching_hash_algo=hash_algo,  # type: ignore[arg-type]
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=kv_connector,
            kv_connector_module_path=kv_connector_module_path,
            kv_role="kv_both",
            kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )
    # Building the VllmConfig with the hybrid manager enabled raises on a CPU-only host;
    # the scheduler itself is fine with it (and needs it for several KV cache groups).
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return vllm_config


def worker_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> RedisOffloadingSpec:
    """The spec a worker process builds: vLLM's WorkerWrapperBase.initialize_from_config creates
    the worker connector inside set_current_vllm_config, and RedisOffloadingConnector builds
    its spec inside ``failure_reporting_connector``."""
    with (
        set_current_vllm_config(vllm_config),
        failure_reporting_connector(vllm_config, kv_cache_config),
    ):
        return RedisOffloadingSpec(build_offloading_config(vllm_config, kv_cache_config))


@dataclass
class StepResult:
    output: SchedulerOutput
    # req_id -> tokens scheduled this step
    scheduled: dict[str, int]
    load_jobs: dict[int, TransferJob]
    store_jobs: dict[int, TransferJob]
    # Redis commands the server ran during this step (INFO excluded), when counted.
    redis_calls: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def load_keys(self, req_id: str) -> list[bytes]:
        """Offload keys of the load job issued for ``req_id`` this step (in vLLM's order)."""
        keys: list[bytes] = []
        for job in self.load_jobs.values():
            if job.req_id == req_id:
                assert isinstance(job.src_spec, RedisLoadStoreSpec), job.src_spec
                keys.extend(job.src_spec.keys)
        return keys


class SchedulerHarness:
    """One real vLLM Scheduler + OffloadingConnector + hma_redis spec, driven step by step."""

    def __init__(
        self,
        redis_url: str,
        model_dir: str,
        *,
        block_size: int = 16,
        blocks_per_chunk: int = 1,
        sliding_window_blocks: int = 3,
        third_group: Literal["full", "sliding"] = "full",
        num_blocks: int = 1000,
        max_num_batched_tokens: int = 4096,
        extra_config: dict[str, object] | None = None,
        counter: redis.Redis | None = None,
        hash_algo: str = "sha256",
        kv_connector: str = "RedisOffloadingConnector",
        kv_connector_module_path: str | None = "hma_redis.connector",
        kv_load_failure_policy: str = "recompute",
    ) -> None:
        self.block_size = block_size
        self.counter = counter
        self.tiering: TieringOffloadingManager | None = None
        self.vllm_config = make_vllm_config(
            model_dir,
            redis_url,
            block_size=block_size,
            blocks_per_chunk=blocks_per_chunk,
            num_blocks=num_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            extra_config=extra_config,
            hash_algo=hash_algo,
            kv_connector=kv_connector,
            kv_connector_module_path=kv_connector_module_path,
            kv_load_failure_policy=kv_load_failure_policy,
        )
        self.kv_cache_config = three_group_kv_cache_config(
            block_size, num_blocks, sliding_window_blocks, third_group
        )
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            log_stats=True,
        )
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector), type(connector)
        connector_scheduler = connector.connector_scheduler
        assert isinstance(connector_scheduler, OffloadingConnectorScheduler)
        self.connector_scheduler = connector_scheduler
        manager = connector_scheduler.manager
        if isinstance(manager, TieringOffloadingManager):
            # vLLM's tiering with hma_redis' secondary tier: its key space is the tier's.
            self.tiering = manager
            (tier,) = manager.secondary_tiers
            self.keyspace: KeySpace = tier.keyspace  # type: ignore[attr-defined]
        else:
            assert isinstance(manager, RedisOffloadingManager), type(manager)
            self.manager = manager
            # The scheduler-side connector keeps only the manager, not the spec. Build the spec
            # the way each worker process does to learn the Redis key space the workers write:
            # a scheduler that finds these keys finds what the workers stored.
            self.spec = worker_spec(self.vllm_config, self.kv_cache_config)
            self.keyspace = self.spec.keyspace

        # What EngineCore does before it builds the scheduler.
        hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(block_size, hash_fn)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        # Store jobs issued but not reported completed yet (step(complete_stores=False)).
        self.held_store_jobs: list[int] = []

    # ------------------------------------------------------------------ requests

    def add_request(
        self, token_ids: Sequence[int], max_tokens: int = 4, cache_salt: str | None = None
    ) -> Request:
        req = make_request(token_ids, max_tokens, self._block_hasher, cache_salt)
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req
        return req

    def offload_key(self, req: Request, group: int, chunk: int) -> bytes:
        """vLLM's offload key of ``chunk`` of ``group``: the hash of the chunk's last block."""
        bpc = self.connector_scheduler.config.blocks_per_chunk
        return bytes(make_offload_key(req.block_hashes[(chunk + 1) * bpc - 1], group))

    def redis_key(self, req: Request, group: int, chunk: int) -> str:
        bpc = self.connector_scheduler.config.blocks_per_chunk
        return self.keyspace.block_key(group, req.block_hashes[(chunk + 1) * bpc - 1])

    def put_chunks(
        self, client: redis.Redis, req: Request, group: int, chunks: Iterable[int]
    ) -> None:
        """Make chunks of ``group`` present in Redis (lookups only check that a key exists)."""
        for chunk in chunks:
            client.set(self.redis_key(req, group, chunk), b"x")

    # ------------------------------------------------------------------ driving

    def step(
        self,
        settle_s: float = STEP_PAUSE_S,
        complete_stores: bool = True,
        expect_calls: bool = False,
    ) -> StepResult:
        """One engine step: schedule, report the (simulated) worker's output, then wait
        ``settle_s`` (the engine's model forward) so the step's lookup batch lands at Redis and is
        counted with this step. With ``complete_stores=False`` the step's store jobs stay in
        flight (``held_store_jobs``) until a step that completes stores. ``expect_calls``: the
        step sends a batch; wait (up to 10 s, on a loaded machine) until Redis has counted it."""
        before = command_calls(self.counter) if self.counter is not None else {}
        start = time.monotonic()
        output = self.scheduler.schedule()
        elapsed = time.monotonic() - start
        meta = output.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata), type(meta)
        load_jobs = dict(meta.load_jobs)
        store_jobs = dict(meta.store_jobs)

        # Every job finishes at once (nothing is actually transferred), stores unless held.
        completed = OffloadingWorkerMetadata()
        self.held_store_jobs.extend(store_jobs)
        finished_stores = self.held_store_jobs if complete_stores else []
        for job_id in (*load_jobs, *finished_stores):
            completed.mark_completed(job_id)
        if complete_stores:
            self.held_store_jobs = []
        finished_recving = {job.req_id for job in load_jobs.values()}
        scheduled = dict(output.num_scheduled_tokens)
        req_ids = list(scheduled)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=finished_recving or None,
                kv_connector_worker_meta=completed,
            ),
        )
        self.scheduler.update_from_output(output, runner_output)
        if self.tiering is not None:
            # Promotions and cascades run on the tier's threads: give them the step's time.
            time.sleep(settle_s)
        self.num_steps += 1
        time.sleep(settle_s)
        calls = {}
        if self.counter is not None:
            calls = command_delta(before, command_calls(self.counter))
            deadline = time.monotonic() + 10
            while expect_calls and not calls and time.monotonic() < deadline:
                time.sleep(0.01)
                calls = command_delta(before, command_calls(self.counter))
        return StepResult(output, scheduled, load_jobs, store_jobs, calls, elapsed)

    def run_until(
        self,
        done: Callable[[StepResult], bool],
        max_steps: int = 50,
        complete_stores: bool = True,
    ) -> list[StepResult]:
        """Step until ``done(step)``; return every step run (the last one satisfied ``done``)."""
        steps: list[StepResult] = []
        for _ in range(max_steps):
            result = self.step(complete_stores=complete_stores)
            steps.append(result)
            if done(result):
                return steps
        raise AssertionError(
            f"condition not reached after {max_steps} steps (requests: "
            f"{ {rid: r.status.name for rid, r in self.requests.items()} }, "
            f"manager stats {self.manager.stats})"
        )

    def run_until_scheduled(self, req: Request, max_steps: int = 50) -> list[StepResult]:
        """Step until ``req`` gets tokens scheduled; the last step returned is that one."""
        return self.run_until(lambda step: req.request_id in step.scheduled, max_steps)

    def close(self) -> None:
        self.scheduler.shutdown()


def make_request(
    token_ids: Sequence[int], max_tokens: int, block_hasher: Any, cache_salt: str | None = None
) -> Request:
    """A greedy request with a fresh id (and vLLM's ``cache_salt``, which enters its first
    block's hash), hashed the way the harness's scheduler hashes."""
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=f"req-{next(_request_ids)}",
        prompt_token_ids=list(token_ids),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher,
        cache_salt=cache_salt,
    )
