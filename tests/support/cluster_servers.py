"""A started Redis Cluster or Sentinel set-up for a test, or the test fails (never skips); the
deployments themselves are :mod:`hma_redis.tools.devkit.cluster`'s."""

from __future__ import annotations

import pytest

from hma_redis.tools.devkit.cluster import LocalCluster, LocalSentinel


def started_cluster(username: str, password: str) -> LocalCluster:
    """A started 3-master :class:`LocalCluster`; the test fails (never skips) if none starts."""
    try:
        return LocalCluster(masters=3, username=username, password=password).start()
    except RuntimeError as exc:
        pytest.fail(f"no Redis Cluster for the tests: {exc}", pytrace=False)


def started_sentinel(username: str, password: str, down_after_ms: int = 1000) -> LocalSentinel:
    """A started :class:`LocalSentinel` (its sentinel calls a silent master down after
    ``down_after_ms``); the test fails (never skips) if none starts."""
    try:
        return LocalSentinel(
            username=username, password=password, down_after_ms=down_after_ms
        ).start()
    except RuntimeError as exc:
        pytest.fail(f"no Redis Sentinel setup for the tests: {exc}", pytrace=False)
