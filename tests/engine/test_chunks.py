"""Chunks of several blocks (``blocks_per_chunk`` > 1, as docs/configuration.md's example sets)
on a hybrid model, exact or nothing.

A Gemma-3-shaped model (sliding-window and full-attention layers, two KV-cache groups; window
48 tokens) on 32-token blocks, 3 blocks to a chunk: a chunk (96 tokens) is longer than the
window, so the sliding-window group's blocks before the window are null when vLLM stores and
loads. Engine A stores the prompts; a fresh engine B must load their chunk-aligned prefixes
from Redis and answer exactly as a run without the tier. Then every value is damaged (random
bytes over the middle half, a NaN/Inf body, or another key's valid value, in turn by key) and
another fresh engine must recompute everything, with the same tokens. Unkeyed, and with an
``auth_key`` (values MAC'd, loads checked in buffers before any byte reaches a page).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from hma_redis.core import codec
from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_gemma3
from tests.engine.test_corruption import _block_values, damage_in_turn
from tests.support.engine_runner import make_prompts, run_engine
from tests.support.tier import tier_config

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
BLOCK_TOKENS = 32
BLOCKS_PER_CHUNK = 3
CHUNK_TOKENS = BLOCK_TOKENS * BLOCKS_PER_CHUNK
TIER_OPTIONS = {
    "read_timeout_s": 1.0,
    "connect_timeout_s": 0.5,
    "retry_interval_s": 1.0,
    "blocks_per_chunk": BLOCKS_PER_CHUNK,
}


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    srv = LocalRedis().start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "auth_key"])
def test_chunks_of_several_blocks_load_exactly_or_are_recomputed(
    server: LocalRedis, tmp_path: Path, keyed: bool
) -> None:
    env = {"HMA_REDIS_AUTH_KEY": "chunks-key-" + "0123456789" * 3} if keyed else {}
    model = build_gemma3(tmp_path / "gemma3", sliding_window=48, num_hidden_layers=6)
    # Lengths that end inside a chunk, a block past one, and just after one.
    prompts = make_prompts(41, 3, 420, VOCAB_SIZE)
    prompts[1] = prompts[1][: CHUNK_TOKENS * 3 + BLOCK_TOKENS + 5]
    prompts[2] = prompts[2][: CHUNK_TOKENS * 2 + 1]
    config = tier_config(server.url, **TIER_OPTIONS)
    baseline = run_engine(model, prompts, MAX_TOKENS, None, block_size=BLOCK_TOKENS)
    assert baseline.block_size == BLOCK_TOKENS and baseline.num_kv_cache_groups == 2

    stored = run_engine(model, prompts, MAX_TOKENS, config, env, block_size=BLOCK_TOKENS)
    assert stored.token_ids == baseline.token_ids, stored.stderr_tail
    client = redis.Redis(port=server.port, socket_timeout=5)
    values = _block_values(client)
    assert values, stored.stderr_tail
    assert all(codec.has_mac(v) == keyed for v in values.values())

    loaded = run_engine(model, prompts, MAX_TOKENS, config, env, block_size=BLOCK_TOKENS)
    assert loaded.token_ids == baseline.token_ids, loaded.stderr_tail
    for result, prompt in zip(loaded.results, prompts, strict=True):
        # Whole chunks, at least one token left to compute; the sliding-window group hits
        # only where vLLM retained its blocks (the prompt's end), so at the last chunk.
        assert result.num_cached_tokens == (len(prompt) - 1) // CHUNK_TOKENS * CHUNK_TOKENS, (
            result.num_cached_tokens,
            len(prompt),
            loaded.stderr_tail,
        )

    client.mset(damage_in_turn(values, random.Random(43)))
    recomputed = run_engine(model, prompts, MAX_TOKENS, config, env, block_size=BLOCK_TOKENS)
    assert recomputed.token_ids == baseline.token_ids, recomputed.stderr_tail
    assert recomputed.num_cached_tokens == [0] * len(prompts), recomputed.stderr_tail
    assert "will be recomputed" in recomputed.stderr, recomputed.stderr_tail
    for secret in env.values():  # the key never reaches a log line
        assert all(secret not in run.stderr for run in (stored, loaded, recomputed))
