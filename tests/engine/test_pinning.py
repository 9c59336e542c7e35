"""A pinned system prompt survives memory pressure (issue 27, item 14): real vLLM CPU engines,
a Redis with a small ``maxmemory`` and ``volatile-lru``, the tier with ``ttl_s``.

Engine A serves a system prompt with ``kv_transfer_params {"hma_redis_pin_s": 600}``, a
control prompt without a pin, then a flood of other prompts several times larger than Redis'
memory. Engine B, a fresh process, then finds the pinned prompt in Redis (a hit in the tier's
counters, its tokens identical to an engine without the tier), while the control prompt was
evicted and is recomputed. On a hybrid (Gemma-3-shaped) model a pinned request, stored at vLLM's
request level, is exact and loads in a fresh engine. Without the operator's ``pinning`` a pin
asked for is served unpinned and counted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from hma_redis.core.keys import parse_block_key
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_gemma3, build_llama
from tests.support.engine_runner import make_prompts, run_engine
from tests.support.redis_server import LocalRedis
from tests.support.tier import chunk_aligned_prefix, tier_config

pytestmark = pytest.mark.engine

PROMPT_LEN = 512
FLOOD = 24
MAX_TOKENS = 4
MAXMEMORY = 3 * 1024 * 1024


@pytest.fixture
def small_redis() -> Iterator[LocalRedis]:
    server = LocalRedis(
        extra_args=["--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "volatile-lru"]
    ).start()
    yield server
    server.stop()


def _chunks_of(client: redis.Redis) -> dict[str, int]:
    """Every chunk key in Redis and its TTL (-1: none)."""
    keys = [k.decode() for k in client.scan_iter("hma:*", count=1000)]
    return {k: client.ttl(k) for k in keys if parse_block_key(k) is not None}


def _hit_chunks(client: redis.Redis) -> int:
    total = 0
    for key in client.scan_iter("hma:*:stats"):
        total += int(client.hget(key, "hit_chunks") or 0)
    return total


def test_a_pinned_system_prompt_survives_a_flood_that_evicts_everything_else(
    small_redis: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_llama(tmp_path_factory.mktemp("llama"))
    system, control, *flood = make_prompts(
        seed=27, n=2 + FLOOD, length=PROMPT_LEN, vocab=VOCAB_SIZE
    )
    tier = tier_config(small_redis.url, ttl_s=3600, pinning=True)
    client = redis.Redis.from_url(small_redis.url)

    run_a = run_engine(
        model,
        [system, control, *flood],
        MAX_TOKENS,
        tier,
        kv_transfer_params=[{"hma_redis_pin_s": 600}, *([None] * (1 + FLOOD))],
    )
    chunk = run_a.block_size
    stats = client.info("stats")
    memory = client.info("memory")
    stored_bytes = sum(
        int(client.hget(k, "stored_bytes") or 0) for k in client.scan_iter("hma:*:stats")
    )
    # The flood stored several times what Redis holds, and Redis evicted.
    assert stored_bytes > 3 * memory["maxmemory"], (stored_bytes, memory["maxmemory"])
    assert stats["evicted_keys"] > 0
    chunks = _chunks_of(client)
    pinned = [k for k, ttl in chunks.items() if ttl == -1]
    aligned = chunk_aligned_prefix(PROMPT_LEN, chunk) // chunk
    assert len(pinned) >= aligned, (len(pinned), aligned, run_a.stderr_tail)
    assert client.zcard(next(client.scan_iter("hma:*:pins"))) >= aligned

    hits_before = _hit_chunks(client)
    run_b = run_engine(model, [system, control], MAX_TOKENS, tier)
    baseline = run_engine(model, [system], MAX_TOKENS, None)

    pinned_result, control_result = run_b.results
    assert pinned_result.num_cached_tokens >= 0.9 * chunk_aligned_prefix(PROMPT_LEN, chunk), (
        pinned_result.num_cached_tokens,
        run_b.stderr_tail,
    )
    assert _hit_chunks(client) - hits_before >= aligned
    assert pinned_result.token_ids == baseline.results[0].token_ids
    # The control prompt, same age and size but unpinned, was evicted: recomputed.
    assert control_result.num_cached_tokens == 0
    assert control_result.token_ids == run_a.results[1].token_ids


def test_a_pinned_prompt_on_a_hybrid_model_is_exact_and_loads_in_a_fresh_engine(
    redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A pinned request is stored at vLLM's request level; on a model with sliding-window and
    full-attention groups its output, and a fresh engine's that loads it, equal an engine's
    without the tier, and its chunks are pinned."""
    model = build_gemma3(tmp_path_factory.mktemp("gemma3"))
    system, other = make_prompts(seed=31, n=2, length=PROMPT_LEN, vocab=VOCAB_SIZE)
    tier = tier_config(redis_url, ttl_s=3600, pinning=True)
    baseline = run_engine(model, [system, other], MAX_TOKENS, None)
    run_a = run_engine(
        model,
        [system, other],
        MAX_TOKENS,
        tier,
        kv_transfer_params=[{"hma_redis_pin_s": 600}, None],
    )
    assert [r.token_ids for r in run_a.results] == [r.token_ids for r in baseline.results]
    chunks = _chunks_of(redis_client)
    assert any(ttl == -1 for ttl in chunks.values()), run_a.stderr_tail
    assert any(ttl > 0 for ttl in chunks.values())  # the unpinned prompt's chunks keep ttl_s

    run_b = run_engine(model, [system], MAX_TOKENS, tier)
    assert run_b.results[0].num_cached_tokens > 0, run_b.stderr_tail
    assert run_b.results[0].token_ids == baseline.results[0].token_ids


def test_an_engine_without_pinning_serves_a_pin_asked_for_unpinned_and_counts_it(
    redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_llama(tmp_path_factory.mktemp("llama"))
    (prompt,) = make_prompts(seed=41, n=1, length=PROMPT_LEN, vocab=VOCAB_SIZE)
    run = run_engine(
        model,
        [prompt],
        MAX_TOKENS,
        tier_config(redis_url, ttl_s=3600),
        kv_transfer_params=[{"hma_redis_pin_s": 3153600000}],
    )
    chunks = _chunks_of(redis_client)
    assert chunks and all(ttl > 0 for ttl in chunks.values()), run.stderr_tail
    assert not list(redis_client.scan_iter("hma:*:pins"))
    counted = sum(
        int(redis_client.hget(k, "pin_off_requests") or 0)
        for k in redis_client.scan_iter("hma:*:stats")
    )
    assert counted == 1, run.stderr_tail
