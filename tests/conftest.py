"""Shared fixtures: a real Redis for the whole session (never a mock, never a skip)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.redis_server import LocalRedis, SessionRedis

ENGINE_TESTS = Path(__file__).parent / "engine"


class _SessionServer:
    """The session Redis, started once before the first test that needs it (see
    :func:`pytest_collection_finish`), or the error that prevented it."""

    server: SessionRedis | None = None
    error: str | None = None

    @classmethod
    def start(cls) -> str:
        """Start it; return the one line that says where the suite's Redis comes from."""
        try:
            cls.server = SessionRedis()
        except Exception as exc:  # any failure fails the tests that need Redis, not the run
            cls.error = f"no Redis for the tests: {exc}"
            return f"hma_redis tests: {cls.error}"
        return f"hma_redis tests: Redis from {cls.server.source} at {cls.server.url}"

    @classmethod
    def close(cls) -> None:
        if cls.server is not None:
            cls.server.close()
            cls.server = None


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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared Redis at session start when a collected test needs it, and say in one
    line (also under ``-q``) whether it comes from testcontainers or a local redis-server."""
    needs = {"redis_url", "session_redis"}
    if not any(needs & set(getattr(item, "fixturenames", ())) for item in session.items):
        return
    line = _SessionServer.start()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _SessionServer.close()


@pytest.fixture(scope="session")
def session_redis() -> SessionRedis:
    """The real Redis shared by the session (``url``, ``source``); fails the tests that need it
    if none could be had (with HMA_REDIS_EXPECT_CONTAINERS=1: if it is not a container)."""
    if _SessionServer.server is None and _SessionServer.error is None:
        _SessionServer.start()  # collected without this fixture in sight (e.g. a plugin's item)
    if _SessionServer.server is None:
        pytest.fail(str(_SessionServer.error), pytrace=False)
    return _SessionServer.server


@pytest.fixture(scope="session")
def redis_url(session_redis: SessionRedis) -> str:
    """URL of the real Redis shared by the session."""
    return session_redis.url


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


# ---------------------------------------------------------------- the vLLM 0.33 stage's selection

ONLY_TORCH_USERS_ENV = "HMA_TEST_TORCH_USERS_ONLY"
# Folders whose code under test imports neither vLLM nor torch: the Redis client
# (tests/core/test_no_vllm.py) and the CLI (tests/tools/test_cli_imports.py).
_VLLM_FREE_FOLDERS = (Path(__file__).parent / "core" / "redis", Path(__file__).parent / "tools")
_USES_VLLM_OR_TORCH = re.compile(
    r"^\s*(import|from)\s+(torch|vllm|hma_redis\.(adapter|spec|connector|tiering)|"
    r"hma_redis\.tools\.(devkit\.(tiny_models|engine|cpu_tiering)|bench|gpu)|"
    r"tests\.support\.(engine_runner|kv_pages|tiering))\b",
    re.MULTILINE,
)


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """In the vLLM 0.33 stage (scripts/test.sh sets HMA_TEST_TORCH_USERS_ONLY=1 once it found
    the same redis-py, hiredis and msgpack in both venvs) the test files of those folders that
    import neither vLLM, torch nor code that does are left out: everything they run is the same
    in both venvs, and they ran in the 0.32 stage."""
    if os.environ.get(ONLY_TORCH_USERS_ENV) != "1" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    if not any(folder in collection_path.parents for folder in _VLLM_FREE_FOLDERS):
        return None
    return _USES_VLLM_OR_TORCH.search(collection_path.read_text()) is None or None
