"""Encrypted values (``encryption_key``) in real engines, on a hybrid (Gemma-3-shaped) model.

An engine with the key stores its prompts' chunks: every value in Redis is sealed. An engine in
the middle of a key rotation (a new key, the old one as previous), on the pure-Python data path,
loads them and answers exactly as a run without the tier. Then every value is damaged (random
bytes over the middle half, a NaN/Inf body, another key's valid value) and a fresh engine with the
key recomputes everything with the same tokens, on the C job, then (its stores damaged again) on
the Python path. No key ever reaches a log line.
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
KEY = "encryption-engine-key-" + "0123456789" * 3
NEW_KEY = "encryption-engine-new-key-" + "9876543210" * 3
TIER_OPTIONS = {"read_timeout_s": 1.0, "connect_timeout_s": 0.5, "retry_interval_s": 1.0}


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    srv = LocalRedis().start()
    yield srv
    srv.stop()


def test_encrypted_values_are_shared_across_a_rotation_and_recomputed_when_damaged(
    server: LocalRedis, tmp_path: Path
) -> None:
    model = build_gemma3(tmp_path / "gemma3", sliding_window=48, num_hidden_layers=4)
    prompts = make_prompts(47, 3, 300, VOCAB_SIZE)
    config = tier_config(server.url, **TIER_OPTIONS)
    keyed = {"HMA_REDIS_ENCRYPTION_KEY": KEY}
    rotating = {
        "HMA_REDIS_ENCRYPTION_KEY": NEW_KEY,
        "HMA_REDIS_ENCRYPTION_KEY_PREVIOUS": KEY,
        "HMA_REDIS_NATIVE": "0",
    }
    baseline = run_engine(model, prompts, MAX_TOKENS, None)
    assert baseline.num_kv_cache_groups == 2

    stored = run_engine(model, prompts, MAX_TOKENS, config, keyed)
    assert stored.token_ids == baseline.token_ids, stored.stderr_tail
    assert "values sealed (AES-256-GCM)" in stored.stderr, stored.stderr_tail
    client = redis.Redis(port=server.port, socket_timeout=5)
    values = _block_values(client)
    assert values, stored.stderr_tail
    assert all(codec.is_sealed(v) and not codec.has_mac(v) for v in values.values())

    loaded = run_engine(model, prompts, MAX_TOKENS, config, rotating)
    assert loaded.token_ids == baseline.token_ids, loaded.stderr_tail
    assert all(n > 0 for n in loaded.num_cached_tokens), loaded.stderr_tail
    assert "transfer data path: pure Python" in loaded.stderr, loaded.stderr_tail

    rng = random.Random(47)
    runs = [stored, loaded]
    # Damage every value, recompute on the C job; that run stores good values again: damage
    # them the same way and recompute on the Python path.
    for path_env in ({}, {"HMA_REDIS_NATIVE": "0"}):
        client.mset(damage_in_turn(_block_values(client), rng))
        recomputed = run_engine(model, prompts, MAX_TOKENS, config, keyed | path_env)
        assert recomputed.token_ids == baseline.token_ids, recomputed.stderr_tail
        assert recomputed.num_cached_tokens == [0] * len(prompts), recomputed.stderr_tail
        assert "will be recomputed" in recomputed.stderr, recomputed.stderr_tail
        runs.append(recomputed)
    for run in runs:
        assert KEY not in run.stderr and NEW_KEY not in run.stderr
