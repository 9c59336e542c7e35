"""Corruption the way the world makes it, on both data paths: exact or nothing.

Engine A stores three groups of prompts (two of them share a 300-token prefix), each group's
values are then damaged in its own way: random bytes over the middle half of the value, a body
of NaN and Inf in the KV dtype, or another key's perfectly valid value. A fresh engine B then
serves every prompt, on the native path and on the Python path (``HMA_REDIS_NATIVE=0``), each
also reading values in pieces of 1000 bytes (``HMA_REDIS_PIECE_BYTES``, as values over 1 MiB
are read). Its greedy tokens must equal a run without the tier; nothing damaged may count as
cached.

Runs on a hybrid model (Gemma-3-shaped: sliding-window and full-attention layers, two KV-cache
groups) in float32 and bfloat16, and on a one-group (Llama-shaped) model.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from hma_redis.core.redis.wire import NATIVE_ENV, PIECES_ENV
from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_gemma3, build_llama
from tests.support.engine_runner import EngineRun, make_prompts, run_engine, shared_prefix_prompts
from tests.support.tier import tier_config

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
TIER_OPTIONS = {"read_timeout_s": 1.0, "connect_timeout_s": 0.5, "retry_interval_s": 1.0}
# The data paths' environments: the C job, its twin, and the C job reading values in pieces of
# 1000 bytes (as values over 1 MiB are read).
PATHS = {
    "native": {NATIVE_ENV: "1"},
    "python": {NATIVE_ENV: "0"},
    "native-pieces": {NATIVE_ENV: "1", PIECES_ENV: "1000"},
    "python-pieces": {NATIVE_ENV: "0", PIECES_ENV: "1000"},
}


def random_middle_half(values: dict[bytes, bytes], rng: random.Random) -> dict[bytes, bytes]:
    """The middle half of every value replaced by random bytes (prefix and tail kept)."""
    out = {}
    for key, value in values.items():
        quarter = len(value) // 4
        out[key] = value[:quarter] + rng.randbytes(2 * quarter) + value[3 * quarter :]
    return out


def nan_payload(values: dict[bytes, bytes], rng: random.Random) -> dict[bytes, bytes]:
    """Every value's body after its first 256 bytes as NaN / Inf in float32 and bfloat16 words
    (a bfloat16 NaN is the high half of a float32 NaN, so the pattern decodes to non-finite
    numbers in either dtype)."""
    out = {}
    for key, value in values.items():
        words = (len(value) - 256) // 4
        specials = rng.choices([math.nan, math.inf, -math.inf], k=words)
        out[key] = value[:256] + struct.pack(f"<{words}f", *specials) + value[256 + 4 * words :]
    return out


def other_keys_value(values: dict[bytes, bytes], rng: random.Random) -> dict[bytes, bytes]:
    """Every key holds another key's valid value (of the same KV group where there is one)."""
    keys = sorted(values)
    rng.shuffle(keys)
    return {key: values[keys[(i + 1) % len(keys)]] for i, key in enumerate(keys)}


def damage_in_turn(values: dict[bytes, bytes], rng: random.Random) -> dict[bytes, bytes]:
    """Every value damaged, the fault chosen by key in turn (in key order): random bytes over
    the middle half, a NaN/Inf body, another key's valid value."""
    keys = sorted(values)
    assert len(keys) > 2, "too few values to damage each way"
    damaged: dict[bytes, bytes] = {}
    for idx, key in enumerate(keys):
        if idx % 3 == 2:
            damaged[key] = values[keys[(idx + 1) % len(keys)]]
        else:
            damaged |= (random_middle_half, nan_payload)[idx % 3]({key: values[key]}, rng)
    return damaged


FAULTS: list[Callable[[dict[bytes, bytes], random.Random], dict[bytes, bytes]]] = [
    random_middle_half,
    nan_payload,
    other_keys_value,
]


def _prompt_groups() -> list[list[list[int]]]:
    """One group of prompts per fault; the first two share a 300-token prefix."""
    return [
        shared_prefix_prompts(31, 2, 300, 180, VOCAB_SIZE),
        make_prompts(32, 1, 420, VOCAB_SIZE),
        make_prompts(33, 1, 350, VOCAB_SIZE),
    ]


def _block_values(client: redis.Redis) -> dict[bytes, bytes]:
    out = {}
    for key in client.scan_iter(match="hma:*:g*", count=1000):
        value = client.get(key)
        if value is not None:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        "hybrid": build_gemma3(
            tmp_path_factory.mktemp("gemma3"), sliding_window=48, num_hidden_layers=6
        ),
        "one-group": build_llama(tmp_path_factory.mktemp("llama")),
    }


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    srv = LocalRedis().start()
    yield srv
    srv.stop()


def _damaged_store(
    model: str, dtype: str, srv: LocalRedis
) -> tuple[list[list[int]], dict[bytes, bytes]]:
    """Engine A stores each group of prompts; each group's new values get its fault. Returns
    every prompt, in group order, and the damaged values."""
    client = redis.Redis(port=srv.port, socket_timeout=5)
    config = tier_config(srv.url, **TIER_OPTIONS)
    rng = random.Random(5)
    seen: set[bytes] = set()
    prompts: list[list[int]] = []
    damaged: dict[bytes, bytes] = {}
    for group, fault in zip(_prompt_groups(), FAULTS, strict=True):
        run_engine(model, group, MAX_TOKENS, config, dtype=dtype)
        fresh = {k: v for k, v in _block_values(client).items() if k not in seen}
        assert fresh, f"engine A stored nothing for {fault.__name__}"
        damaged |= fault(fresh, rng)
        seen |= set(fresh)
        prompts += group
    return prompts, damaged


def _plant(srv: LocalRedis, values: dict[bytes, bytes]) -> None:
    """Only ``values`` under the tier's block keys (a recompute's good values are removed)."""
    client = redis.Redis(port=srv.port, socket_timeout=5)
    stale = list(client.scan_iter(match="hma:*:g*", count=1000))
    if stale:
        client.delete(*stale)
    client.mset(values)


@pytest.mark.parametrize(
    ("model_name", "dtype"),
    [("hybrid", "float32"), ("hybrid", "bfloat16"), ("one-group", "float32")],
)
def test_damaged_values_are_never_served_on_either_data_path(
    models: dict[str, str], server: LocalRedis, model_name: str, dtype: str, tmp_path: Path
) -> None:
    model = models[model_name]
    prompts, damaged = _damaged_store(model, dtype, server)
    baseline: EngineRun = run_engine(model, prompts, MAX_TOKENS, None, dtype=dtype)
    config = tier_config(server.url, **TIER_OPTIONS)
    for path, env in PATHS.items():
        _plant(server, damaged)
        run = run_engine(model, prompts, MAX_TOKENS, config, extra_env=env, dtype=dtype)
        if model_name == "hybrid":
            assert run.num_kv_cache_groups == 2, run.stderr_tail
        assert run.token_ids == baseline.token_ids, (path, run.stderr_tail)
        assert run.num_cached_tokens == [0] * len(prompts), (path, run.stderr_tail)
        assert "will be recomputed" in run.stderr, (path, run.stderr_tail)
