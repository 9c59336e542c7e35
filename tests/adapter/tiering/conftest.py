"""Fixtures of the secondary-tier tests: vLLM tiering managers with the Redis tier."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from tests.support.scheduler_harness import write_tiny_model_config
from tests.support.tiering import TieringInstance, make_instance


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model_config(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def instance(
    redis_url: str, redis_client: redis.Redis, model_dir: str
) -> Iterator[Callable[..., TieringInstance]]:
    """Build tiering instances sharing the session Redis (flushed per test); closed at
    teardown."""
    made: list[TieringInstance] = []

    def make(url: str | None = None, **options: object) -> TieringInstance:
        """``url`` None: the session Redis; "": none in the config (``HMA_REDIS_URL``)."""
        made.append(make_instance(model_dir, redis_url if url is None else url, **options))
        return made[-1]

    yield make
    for inst in made:
        inst.close()
