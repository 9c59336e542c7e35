"""Shared fixtures: a real Redis for the whole session (never a mock, never a skip)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.redis_server import LocalRedis, SessionRedis

ENGINE_TESTS = Path(__file__).parent / "engine"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/engine/ holds exactly the tests that start a vLLM engine (marker ``engine``), so
    ``-m "not engine"`` and the directory name say the same thing."""
    misplaced = [
        item.nodeid
        for item in items
        if (ENGINE_TESTS in item.path.parents) != (item.get_closest_marker("engine") is not None)
    ]
    if misplaced:
        raise pytest.UsageError(
            "engine tests (marker 'engine') belong in tests/engine/, and only they: "
            + ", ".join(misplaced)
        )


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis shared by the session; fails the tests if none can be had."""
    try:
        server = SessionRedis()
    except Exception as exc:
        pytest.fail(f"no Redis for the tests: {exc}", pytrace=False)
    yield server.url
    server.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on a freshly flushed session Redis."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    client.config_resetstat()
    yield client
    client.close()


@pytest.fixture
def local_redis() -> Iterator[LocalRedis]:
    """A private redis-server the test may kill, pause and restart."""
    try:
        server = LocalRedis().start()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield server
    server.stop()
