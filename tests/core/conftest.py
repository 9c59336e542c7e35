"""Fixtures the transfer engine's tests share: the data path, and a rig of CPU KV pages on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.redis.store import RedisBlockStore
from hma_redis.core.redis.wire import NATIVE_ENV, PIECES_ENV
from tests.support.kv_pages import Pages, make_pages


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The data path the engines of the test run (``HMA_REDIS_NATIVE=0``: the twin)."""
    if request.param == "python":
        monkeypatch.setenv(NATIVE_ENV, "0")
    return str(request.param)


@pytest.fixture(params=["gets", "pieces"])
def pieces(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How load jobs ask for their values: GETs (the small values of these tests), or in
    pieces of 1000 bytes (``HMA_REDIS_PIECE_BYTES``, as values over 1 MiB are read)."""
    monkeypatch.setenv(PIECES_ENV, "0" if request.param == "gets" else "1000")
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["in-place", "buffered"])
def pages(
    request: pytest.FixtureRequest, path: str, redis_client, redis_url: str
) -> Iterator[Pages]:
    """A transfer engine on ``path`` over fresh CPU KV pages, host memory (in place) or strided
    (through buffers, as a GPU KV cache), on a flushed session Redis."""
    store = RedisBlockStore(RedisTierConfig.from_extra_config({"redis_url": redis_url}, env={}))
    rig = make_pages(store, strided=request.param)
    assert rig.store.native == (path == "native")
    yield rig
    rig.close()
    store.close()
