"""Start and stop real Redis servers for tests (no mocks).

The session's shared server (fixtures ``redis_url`` / ``redis_client``), in order of preference:
``HMA_REDIS_TEST_URL``; a testcontainers Redis when a container engine answers
(:mod:`tests.support.containers`; ``scripts/container_engine.sh`` provides one); ``redis-server``
from PATH on a free loopback port. With ``HMA_REDIS_EXPECT_CONTAINERS=1`` (CI) the fallback is an
error instead.

Servers a test kills, pauses, restarts or starts with its own arguments stay local
``redis-server`` processes (``local_redis``, tests/engine/test_faults.py, the ACL and TLS
servers, hma_redis/tools/devkit/cluster.py): SIGSTOP/SIGKILL on a pid and a restart on the same
port are what those tests exercise, and Cluster/Sentinel nodes announce addresses that must be
reachable from the host as they are.
"""

from __future__ import annotations

import os
import shutil
import time

import redis

from hma_redis.tools.devkit.local_redis import LocalRedis
from tests.support.containers import (
    EXPECT_ENV,
    NoContainerEngine,
    RedisTestContainer,
    containers_expected,
    docker_host,
    image_name,
)

INSTALL_HINT = (
    "hma_redis tests need a real Redis: set HMA_REDIS_TEST_URL, or provide a container engine "
    "(source scripts/container_engine.sh), or install redis-server "
    "(Debian: apt-get install -y redis-server redis-tools)"
)


class SessionRedis:
    """The session's Redis: ``url``, ``source`` (one line saying where it comes from), close()."""

    def __init__(self) -> None:
        self._local: LocalRedis | None = None
        self._container: RedisTestContainer | None = None
        self.source = ""
        self.url = self._acquire()

    def _acquire(self) -> str:
        url = os.environ.get("HMA_REDIS_TEST_URL")
        if url:
            redis.Redis.from_url(url, socket_timeout=2).ping()
            self.source = "HMA_REDIS_TEST_URL"
            return url
        try:
            return self._start_container()
        except NoContainerEngine as exc:
            if containers_expected():
                raise RuntimeError(f"{EXPECT_ENV}=1 but {exc}") from None
            return self._start_local(str(exc))

    def _start_container(self) -> str:
        self._container = RedisTestContainer(image_name()).start()
        self.source = f"testcontainers, image {image_name()} via {docker_host()}"
        return self._container.url

    def _start_local(self, why_not_container: str) -> str:
        try:
            self._local = LocalRedis().start()
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{INSTALL_HINT}") from None
        self.source = f"local {shutil.which('redis-server')} ({why_not_container})"
        return self._local.url

    def close(self) -> None:
        if self._local is not None:
            self._local.stop()
        if self._container is not None:
            self._container.stop()


def command_calls(client: redis.Redis) -> dict[str, int]:
    """``INFO commandstats`` as {command: calls}."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


# Not the tier's traffic: the test's own INFO, and the name every new connection of a store
# gets (CLIENT SETNAME, once per connection).
_UNCOUNTED = frozenset({"info", "client|setname"})


def command_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    names = set(before) | set(after)
    delta = {n: after.get(n, 0) - before.get(n, 0) for n in names}
    return {n: d for n, d in delta.items() if d and n not in _UNCOUNTED}


def store_connections(admin: redis.Redis, name: str | None) -> int:
    """How many connections named ``name`` (a store's ``client_name``) the server holds: the
    store's own, whatever other clients of a shared server come and go meanwhile."""
    return sum(1 for client in admin.client_list() if client.get("name") == name)


def wait_for_store_connections(
    admin: redis.Redis, name: str | None, count: int, timeout_s: float = 10.0
) -> int:
    """:func:`store_connections` once it is ``count``, or when ``timeout_s`` ran out.

    Redis drops a closed connection from its list only once it has read the EOF, and a
    connection opened on a background thread appears when that thread gets to it."""
    deadline = time.monotonic() + timeout_s
    while (held := store_connections(admin, name)) != count and time.monotonic() < deadline:
        time.sleep(0.02)
    return held
