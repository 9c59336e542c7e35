"""``read_timeout_s`` is accepted exactly where the data paths take what it makes of it.

The C job and its Python twin wait in whole milliseconds at most a day, and take a job's budget
of at most a day (:data:`hma_redis.core.deadline.MAX_WAIT_S`). A read timeout the config accepts
must give jobs they run: at the longest one, a real store and load job succeed on both paths
against a real Redis; below a millisecond, or past half a day (a call's budget is two read
timeouts and its bytes), the config refuses it naming the field."""

from __future__ import annotations

import math

import pytest

from hma_redis.core.config import RedisTierConfig
from hma_redis.core.deadline import MAX_READ_TIMEOUT_S, MAX_WAIT_S, MIN_WAIT_S, budget_s
from hma_redis.core.redis.wire import NATIVE_ENV
from tests.support.kv_pages import DST, SRC, chunks, make_pages, store_at

PATHS = ["native", "python"]


def test_the_longest_read_timeout_is_half_of_what_the_data_paths_wait_at_most() -> None:
    assert MAX_READ_TIMEOUT_S == MAX_WAIT_S / 2 == 43200.0
    assert MIN_WAIT_S == 0.001


@pytest.mark.parametrize(
    "value",
    [
        1e-320,
        math.nextafter(MIN_WAIT_S, 0),
        math.nextafter(MAX_READ_TIMEOUT_S, math.inf),
        43200.5,
        MAX_WAIT_S,
    ],
)
def test_a_read_timeout_the_data_paths_cannot_run_jobs_with_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match=r"^hma_redis: read_timeout_s must be >= 0.001 and <= "):
        RedisTierConfig.from_extra_config({"read_timeout_s": value}, env={})


@pytest.mark.parametrize("value", [MIN_WAIT_S, 2.0, MAX_READ_TIMEOUT_S])
def test_a_read_timeout_within_what_the_data_paths_take_is_accepted(value: float) -> None:
    assert RedisTierConfig.from_extra_config({"read_timeout_s": value}, env={}).read_timeout_s == (
        value
    )


def test_a_budget_never_exceeds_what_the_data_paths_take() -> None:
    """The per-byte allowance of a huge job stops at a day instead of failing the job."""
    assert budget_s(MAX_READ_TIMEOUT_S, 1 << 20) == MAX_WAIT_S
    assert budget_s(2.0, 1 << 50) == MAX_WAIT_S
    assert budget_s(2.0, 16 << 20) == pytest.approx(5.0)


@pytest.mark.parametrize("path", PATHS)
def test_a_job_at_the_longest_read_timeout_stores_and_loads_on_both_paths(
    redis_url: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "python":
        monkeypatch.setenv(NATIVE_ENV, "0")
    store = store_at(redis_url, read_timeout_s=MAX_READ_TIMEOUT_S)
    rig = make_pages(store)
    try:
        assert rig.store.native == (path == "native"), rig.engine.data_path
        assert rig.store_job(1, chunks(SRC)).ok
        assert rig.load_job(2, chunks(DST)).ok
        assert rig.moved(SRC, DST)
    finally:
        rig.close()
        store.close()
