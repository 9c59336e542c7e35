"""Two vLLM instances (separate processes) share KV through Redis: real engines, real Redis.

Engine A computes and stores; engine B, a fresh process, must produce exactly the tokens of a
run without the tier while loading >= 90 % of each prompt's chunk-aligned prefix from Redis.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from hma_redis.core.keys import parse_block_key
from hma_redis.core.redis.wire import NATIVE_ENV, PIECES_ENV
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_gemma3, build_llama
from tests.support.engine_runner import EngineRun, make_prompts, run_engine
from tests.support.tier import chunk_aligned_prefix, tier_config

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
LENGTHS = (300, 700, 1100)  # several chunks of 128 tokens, window 32 well inside


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp(request.param)
    return build_llama(path) if request.param == "llama" else build_gemma3(path, sliding_window=32)


def _prompts(seed: int) -> list[list[int]]:
    return [make_prompts(seed + i, 1, n, VOCAB_SIZE)[0] for i, n in enumerate(LENGTHS)]


def _assert_mostly_from_redis(run: EngineRun, prompts: list[list[int]]) -> None:
    for result, prompt in zip(run.results, prompts, strict=True):
        aligned = chunk_aligned_prefix(len(prompt), run.block_size)
        assert result.num_cached_tokens >= 0.9 * aligned, (
            f"{result.num_cached_tokens} of {len(prompt)} tokens came from Redis; "
            f"expected >= 90% of the chunk-aligned prefix {aligned}\n{run.stderr_tail}"
        )


def _getrange_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0))


def test_second_engine_loads_prefix_from_redis_with_identical_tokens(
    model: str, redis_url: str, redis_client: redis.Redis
) -> None:
    prompts = _prompts(seed=10)
    baseline = run_engine(model, prompts, MAX_TOKENS, kv_transfer_config=None)
    engine_a = run_engine(model, prompts, MAX_TOKENS, tier_config(redis_url))
    engine_b = run_engine(model, prompts, MAX_TOKENS, tier_config(redis_url))
    ranges = _getrange_calls(redis_client)
    # Engines C and D read the values in pieces of 1000 bytes, as values over 1 MiB are read:
    # C on the native data path, D on its Python twin.
    pieced = {PIECES_ENV: "1000"}
    engine_c = run_engine(model, prompts, MAX_TOKENS, tier_config(redis_url), extra_env=pieced)
    after_c = _getrange_calls(redis_client)
    python_pieced = {**pieced, NATIVE_ENV: "0"}
    engine_d = run_engine(
        model, prompts, MAX_TOKENS, tier_config(redis_url), extra_env=python_pieced
    )

    assert engine_a.token_ids == baseline.token_ids
    assert engine_a.num_cached_tokens == [0] * len(prompts)  # nothing in Redis yet
    for engine in (engine_b, engine_c, engine_d):
        assert engine.token_ids == baseline.token_ids, engine.stderr_tail
        _assert_mostly_from_redis(engine, prompts)
    assert after_c > ranges, "engine C read no value in pieces"
    assert _getrange_calls(redis_client) > after_c, "engine D read no value in pieces"
    assert "transfer data path: pure Python" in engine_d.stderr, engine_d.stderr_tail
    # vllm.LLM's in-process engine core: nothing arrives during a step, so an idle step
    # sleeps until the load ends (hma_redis.adapter.arrivals), as the worker says once.
    in_process = "idle engine steps: in-process engine core"
    assert in_process in engine_b.stderr, engine_b.stderr_tail


def test_prompts_sharing_only_a_prefix_get_partial_hits(
    model: str, redis_url: str, redis_client: redis.Redis
) -> None:
    # Sliding-window layers keep no KV outside their window, so vLLM can only store (and later
    # hit) sliding-window chunks at the boundaries it retains: the end of each prompt, and every
    # prefix_cache_retention_interval tokens when that is set. Full attention hits anywhere.
    kwargs = {"prefix_cache_retention_interval": 128} if "gemma" in model else {}
    stored = _prompts(seed=50)
    run_engine(model, stored, MAX_TOKENS, tier_config(redis_url), llm_kwargs=kwargs)

    prefix_lens = [200, 520]
    partial = [
        stored[1][:plen] + make_prompts(60 + i, 1, 150, VOCAB_SIZE)[0]
        for i, plen in enumerate(prefix_lens)
    ]
    partial_base = run_engine(model, partial, MAX_TOKENS, kv_transfer_config=None)
    engine_c = run_engine(model, partial, MAX_TOKENS, tier_config(redis_url), llm_kwargs=kwargs)
    assert engine_c.token_ids == partial_base.token_ids, engine_c.stderr_tail
    for result, plen in zip(engine_c.results, prefix_lens, strict=True):
        assert result.num_cached_tokens == plen // engine_c.block_size * engine_c.block_size


def test_engine_that_exits_at_once_leaves_its_chunks_for_the_next(
    model: str, redis_url: str, redis_client: redis.Redis
) -> None:
    prompt = make_prompts(seed=40, n=1, length=1500, vocab=VOCAB_SIZE)
    baseline = run_engine(model, prompt, 4, kv_transfer_config=None)
    # One long prompt, one token, then the process exits: stores must be flushed on the way out.
    run_engine(model, prompt, 1, tier_config(redis_url))
    nxt = run_engine(model, prompt, 4, tier_config(redis_url))
    aligned = chunk_aligned_prefix(len(prompt[0]), nxt.block_size)
    assert nxt.num_cached_tokens == [aligned], nxt.stderr_tail
    assert nxt.token_ids == baseline.token_ids

    # What an operator sees with redis-cli --scan: block keys of every group and the info hash.
    keys = [k.decode() for k in redis_client.scan_iter(match="hma:*", count=1000)]
    info_keys = [k for k in keys if k.endswith(":info")]
    assert len(info_keys) == 1
    namespace = info_keys[0].split(":")[1]
    groups = {p.group for k in keys if (p := parse_block_key(k)) and p.namespace == namespace}
    expected_groups = {0} if nxt.num_kv_cache_groups == 1 else {0, 1}
    assert groups == expected_groups
    info = {k.decode(): v.decode() for k, v in redis_client.hgetall(info_keys[0]).items()}
    assert info["model"] == str(Path(model))
    assert info["num_groups"] == str(nxt.num_kv_cache_groups)
