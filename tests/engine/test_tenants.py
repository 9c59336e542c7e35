"""Tenants kept apart across real vLLM engines (separate processes) sharing one Redis:
``cache_salt`` keeps tenants with different salts apart and still shares within a tenant, and
only instances with the same ``auth_key`` share KV; a tenant over its byte budget stores
nothing while the other's prefixes stay and load; tokens are identical to a run without the
tier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from hma_redis.core import codec
from hma_redis.core.keys import KeySpace, parse_block_key
from hma_redis.core.redis import quotas
from hma_redis.core.tenants import tenant_id
from hma_redis.tools.devkit.engine import RESULT_PREFIX
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_llama
from tests.support.engine_runner import child_env, make_prompts, run_engine, run_forked_job
from tests.support.salt_child import SALT_ENV
from tests.support.tier import chunk_aligned_prefix, tier_config

pytestmark = pytest.mark.engine

# --------------------------------------------------------------------------------- cache_salt

SALT_PROMPT_LEN = 700
SALT_MAX_TOKENS = 8
SALT_TIMEOUT_S = 900.0


def _salted_runs(runs: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """Run each ``{"salt": str | None, "tier": dict | None, "prompts": ..., "env": {...}}``
    (``env`` optional) as its own vLLM instance (forked process), in order; return each run's
    result payload."""
    payloads: list[dict[str, Any]] = []
    for i, run in enumerate(runs):
        salt_env = {SALT_ENV: run["salt"]} if run["salt"] else {}
        env = child_env({**salt_env, **run.get("env", {})})
        if not run["salt"]:
            env.pop(SALT_ENV, None)
        if "HMA_REDIS_AUTH_KEY" not in run.get("env", {}):
            env.pop("HMA_REDIS_AUTH_KEY", None)
        job = {
            "model": model,
            "prompts": run["prompts"],
            "max_tokens": SALT_MAX_TOKENS,
            "kv_transfer_config": run["tier"],
            "block_size": None,
            "reset_prefix_cache_between": True,
            "dtype": "float32",
            "max_model_len": 2048,
            "llm_kwargs": {},
        }
        _, out = run_forked_job(job, env, SALT_TIMEOUT_S, salted=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
        assert out.returncode == 0 and len(lines) == 1, (
            f"salted engine run {i} failed (exit {out.returncode}); stderr:\n{out.stderr[-3000:]}"
        )
        payload = json.loads(lines[0][len(RESULT_PREFIX) :])
        payload["stderr_tail"] = out.stderr[-3000:]
        payloads.append(payload)
    return payloads


def test_cache_salt_keeps_tenants_apart_across_engines(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    model = build_llama(tmp_path / "llama")
    prompts = make_prompts(seed=77, n=1, length=SALT_PROMPT_LEN, vocab=VOCAB_SIZE)
    tier = tier_config(redis_url)
    baseline, a, b, c, unsalted = _salted_runs(
        [
            {"salt": None, "tier": None, "prompts": prompts},  # no tier at all
            {"salt": "tenant-a", "tier": tier, "prompts": prompts},  # computes and stores
            {"salt": "tenant-b", "tier": tier, "prompts": prompts},  # other tenant: no hits
            {"salt": "tenant-a", "tier": tier, "prompts": prompts},  # same tenant: loads
            {"salt": None, "tier": tier, "prompts": prompts},  # no salt: no hits either
        ],
        model,
    )

    def cached(run: dict[str, Any]) -> int:
        return int(run["results"][0]["num_cached_tokens"])

    def tokens(run: dict[str, Any]) -> list[int]:
        return list(run["results"][0]["token_ids"])

    assert cached(a) == 0, a["stderr_tail"]
    assert cached(b) == 0, f"tenant-b hit tenant-a's blocks\n{b['stderr_tail']}"
    assert cached(unsalted) == 0, (
        f"an unsalted request hit salted blocks\n{unsalted['stderr_tail']}"
    )
    aligned = chunk_aligned_prefix(SALT_PROMPT_LEN, int(c["block_size"]))
    assert aligned > 0
    assert cached(c) == aligned, f"tenant-a did not load its own blocks\n{c['stderr_tail']}"
    for name, run in (("A", a), ("B", b), ("C", c), ("unsalted", unsalted)):
        assert tokens(run) == tokens(baseline), f"engine {name}: tokens differ from baseline"
    # Each tenant stored its own copy of the prefix (A, B and the unsalted run; C stored
    # nothing new): three sets of distinct keys, one per whole chunk of the prompt.
    keys = [k.decode() for k in redis_client.scan_iter(match="hma:*", count=1000)]
    block_keys = [k for k in keys if parse_block_key(k) is not None]
    assert len(block_keys) == 3 * (aligned // int(c["block_size"])), sorted(keys)


# ------------------------------------------------------------------------------------ quotas


def test_a_tenant_over_its_budget_stores_nothing_and_the_other_keeps_and_loads_its_prefix(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Tenant B stores its prompt; the operator gives tenant A a budget of 0 bytes
    (``hma-redis quota set``, here its function); A's engine then stores nothing (refused,
    counted), B's next engine loads its whole prefix, and the account holds exactly B's
    bytes. Every engine's tokens are the baseline's."""
    model = build_llama(tmp_path / "llama")
    prompts = make_prompts(seed=80, n=1, length=SALT_PROMPT_LEN, vocab=VOCAB_SIZE)
    tier = tier_config(redis_url, tenant_quotas=True, quota_refresh_interval_s=0.05)
    baseline, b = _salted_runs(
        [
            {"salt": None, "tier": None, "prompts": prompts},
            {"salt": "tenant-b", "tier": tier, "prompts": prompts},
        ],
        model,
    )
    infos = [k.decode() for k in redis_client.scan_iter(match="hma:*:info")]
    assert len(infos) == 1, infos
    space = KeySpace("hma", infos[0].split(":")[1])
    tenant_a, tenant_b = tenant_id("tenant-a", "hma"), tenant_id("tenant-b", "hma")
    quotas.set_budget(redis_client, space.quotas_key(), tenant_a, 0)
    b_keys = sorted(k for k in redis_client.scan_iter(match=space.block_pattern()))
    a, b_again = _salted_runs(
        [
            {"salt": "tenant-a", "tier": tier, "prompts": prompts},
            {"salt": "tenant-b", "tier": tier, "prompts": prompts},
        ],
        model,
    )

    def cached(run: dict[str, Any]) -> int:
        return int(run["results"][0]["num_cached_tokens"])

    aligned = chunk_aligned_prefix(SALT_PROMPT_LEN, int(b["block_size"]))
    assert cached(b) == 0 and cached(a) == 0, a["stderr_tail"]
    assert cached(b_again) == aligned, f"B's prefix did not survive\n{b_again['stderr_tail']}"
    for name, run in (("B", b), ("A", a), ("B again", b_again)):
        assert run["results"][0]["token_ids"] == baseline["results"][0]["token_ids"], name
    # A stored nothing: the only chunks are B's, and the account holds exactly their bytes.
    assert sorted(redis_client.scan_iter(match=space.block_pattern())) == b_keys
    held = sum(int(redis_client.strlen(k)) for k in b_keys)
    assert quotas.usage(redis_client, space.tenants_key()) == {tenant_b: held}
    refused = int(redis_client.hget(space.stats_key(), "quota_refused_chunks") or 0)
    assert refused == len(b_keys), a["stderr_tail"]
    assert "tenant-a" not in str(redis_client.hgetall(space.tenants_key()))


# ---------------------------------------------------------------------------------- auth_key


def test_auth_key_shares_kv_only_between_instances_with_the_same_key(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    model = build_llama(tmp_path / "llama")
    prompts = make_prompts(seed=78, n=1, length=SALT_PROMPT_LEN, vocab=VOCAB_SIZE)
    tier = tier_config(redis_url)
    key_a = {"HMA_REDIS_AUTH_KEY": "key-a-" + "0123456789" * 3}
    key_b = {"HMA_REDIS_AUTH_KEY": "key-b-" + "0123456789" * 3}
    baseline, a, a2, b, unkeyed = _salted_runs(
        [
            {"salt": None, "tier": None, "prompts": prompts},  # no tier at all
            {"salt": None, "tier": tier, "prompts": prompts, "env": key_a},  # stores, MAC'd
            {"salt": None, "tier": tier, "prompts": prompts, "env": key_a},  # same key: loads
            {"salt": None, "tier": tier, "prompts": prompts, "env": key_b},  # other key: no hits
            {"salt": None, "tier": tier, "prompts": prompts},  # no key: no hits either
        ],
        model,
    )

    def cached(run: dict[str, Any]) -> int:
        return int(run["results"][0]["num_cached_tokens"])

    aligned = chunk_aligned_prefix(SALT_PROMPT_LEN, int(a2["block_size"]))
    assert aligned > 0
    assert cached(a) == 0, a["stderr_tail"]
    assert cached(a2) == aligned, f"same auth_key did not load\n{a2['stderr_tail']}"
    assert cached(b) == 0, f"another auth_key hit key-a's values\n{b['stderr_tail']}"
    assert cached(unkeyed) == 0, f"an unkeyed instance hit MAC'd values\n{unkeyed['stderr_tail']}"
    for name, run in (("A", a), ("A2", a2), ("B", b), ("unkeyed", unkeyed)):
        assert run["results"][0]["token_ids"] == baseline["results"][0]["token_ids"], name
    for run in (a, a2, b, unkeyed):
        assert key_a["HMA_REDIS_AUTH_KEY"] not in run["stderr_tail"]
    # Keyed instances wrote MAC'd values (A; B its own), the unkeyed one plain values.
    keys = [k for k in redis_client.scan_iter(match="hma:*", count=1000)]
    values = [redis_client.get(k) for k in keys if parse_block_key(k.decode()) is not None]
    per_set = aligned // int(a2["block_size"])
    assert sorted(codec.has_mac(v) for v in values) == [False] * per_set + [True] * 2 * per_set


# ---------------------------------------------------------------------------------- namespace


def test_one_namespace_name_on_two_models_of_one_shape_never_mixes_their_kv(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two models of the same shape but other weights (as two fine-tunes of one base model),
    both configured with the same ``namespace`` name: their KV bytes differ while their
    values' headers would match, so a name alone would let one serve the other's KV. Each
    answers with its own tokens; the second model loads nothing of the first's, and a second
    instance of the first still loads its own."""
    first = build_llama(tmp_path / "first", seed=1)
    second = build_llama(tmp_path / "second", seed=2)
    prompts = make_prompts(seed=79, n=2, length=SALT_PROMPT_LEN, vocab=VOCAB_SIZE)
    tier = tier_config(redis_url, namespace="team-models")
    base_first = run_engine(first, prompts, 8, None)
    base_second = run_engine(second, prompts, 8, None)
    assert base_first.token_ids != base_second.token_ids  # the weights differ where it shows

    stored = run_engine(first, prompts, 8, tier)
    other = run_engine(second, prompts, 8, tier)
    again = run_engine(first, prompts, 8, tier)
    assert stored.token_ids == base_first.token_ids, stored.stderr_tail
    assert other.token_ids == base_second.token_ids, other.stderr_tail
    assert other.num_cached_tokens == [0, 0], other.stderr_tail
    assert again.token_ids == base_first.token_ids, again.stderr_tail
    aligned = chunk_aligned_prefix(SALT_PROMPT_LEN, again.block_size)
    assert again.num_cached_tokens == [aligned, aligned], again.stderr_tail
    # Both namespaces carry the operator's name.
    infos = {k.decode() for k in redis_client.scan_iter(match="hma:team-models.*:info")}
    assert len(infos) == 2, infos
