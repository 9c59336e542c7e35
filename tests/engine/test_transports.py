"""Real vLLM engines share KV over the README's other transports: TLS (``rediss://``, the
Python data path: TLS stays in Python's ``ssl``) and a Unix socket (``unix://``, the native
path), token-identical to an engine without the tier (the store's own behaviour there:
tests/core/redis/test_security.py, tests/core/transfer/test_data_paths.py; faults over both:
tests/engine/test_faults.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hma_redis.tools.devkit.local_redis import LocalRedis
from hma_redis.tools.devkit.tiny_models import VOCAB_SIZE, build_llama
from tests.support.engine_runner import EngineRun, make_prompts, run_engine
from tests.support.tier import assert_loaded_from_the_tier, tier_config
from tests.support.tls_certs import TlsLocalRedis, make_tls_files

pytestmark = pytest.mark.engine

PROMPTS = [make_prompts(130 + i, 1, n, VOCAB_SIZE)[0] for i, n in enumerate((600, 900))]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_llama(tmp_path_factory.mktemp("llama-transports"))


@pytest.fixture(scope="module")
def baseline(model: str) -> EngineRun:
    return run_engine(model, PROMPTS, 8, kv_transfer_config=None)


@pytest.fixture
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsLocalRedis]:
    try:
        server = TlsLocalRedis(make_tls_files(tmp_path_factory.mktemp("tls"))).start()
    except RuntimeError as exc:
        pytest.fail(
            f"cannot start a TLS redis-server (needs redis-server built with TLS): {exc}",
            pytrace=False,
        )
    yield server
    server.stop()


@pytest.fixture
def unix_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRedis, str]]:
    path = os.path.join(tmp_path_factory.mktemp("sock"), "redis.sock")
    server = LocalRedis(extra_args=["--unixsocket", path, "--unixsocketperm", "700"]).start()
    yield server, path
    server.stop()


def _share(model: str, baseline: EngineRun, config: dict[str, object]) -> EngineRun:
    """Engine A stores, engine B loads; both give the baseline's tokens and B's prompts came
    from Redis. Returns B's run."""
    engine_a = run_engine(model, PROMPTS, 8, config)
    engine_b = run_engine(model, PROMPTS, 8, config)
    assert engine_a.token_ids == baseline.token_ids, engine_a.stderr_tail
    assert engine_a.num_cached_tokens == [0] * len(PROMPTS)
    assert engine_b.token_ids == baseline.token_ids, engine_b.stderr_tail
    assert_loaded_from_the_tier(engine_b, PROMPTS)
    return engine_b


def test_two_engines_share_kv_over_tls(
    model: str, baseline: EngineRun, tls_redis: TlsLocalRedis
) -> None:
    files = tls_redis.files
    run = _share(
        model,
        baseline,
        tier_config(
            tls_redis.url,
            tls_ca_file=files.ca_cert,
            tls_cert_file=files.client_cert,
            tls_key_file=files.client_key,
        ),
    )
    assert "transfer data path: pure Python (TLS" in run.stderr, run.stderr_tail


def test_two_engines_share_kv_over_a_unix_socket(
    model: str, baseline: EngineRun, unix_redis: tuple[LocalRedis, str]
) -> None:
    _, path = unix_redis
    run = _share(model, baseline, tier_config(f"unix://{path}?db=0"))
    assert "transfer data path: native" in run.stderr, run.stderr_tail
