"""Fixtures of the adapter tests: a tiny model's config and the fast connector harness."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from tests.support.connector_harness import ConnectorHarness
from tests.support.scheduler_harness import write_tiny_model_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama config (no weights: the harnesses run no model)."""
    return write_tiny_model_config(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def instance(
    redis_url: str, redis_client: redis.Redis, model_dir: str
) -> Iterator[Callable[..., ConnectorHarness]]:
    """Build connector harnesses (vLLM instances without a model) sharing the session Redis
    (flushed per test); closed at teardown."""
    made: list[ConnectorHarness] = []

    def make(**kwargs: object) -> ConnectorHarness:
        harness = ConnectorHarness(redis_url, model_dir, **kwargs)  # type: ignore[arg-type]
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()
