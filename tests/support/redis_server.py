"""Start and stop real Redis servers for tests (no mocks).

Order of preference for the shared session server: ``HMA_REDIS_TEST_URL``; a testcontainers Redis
when a Docker engine answers; ``redis-server`` from PATH on a free loopback port. Tests that kill
and restart the server always use a local ``redis-server`` of their own.
"""

from __future__ import annotations

import os
import socket
import warnings

import redis

from hma_redis.tools.demo.local_redis import LocalRedis

INSTALL_HINT = (
    "hma_redis tests need a real Redis: set HMA_REDIS_TEST_URL, or run a Docker engine, "
    "or install redis-server (Debian: apt-get install -y redis-server redis-tools)"
)


class SessionRedis:
    """The session's Redis: a URL, and a way to release it."""

    def __init__(self) -> None:
        self._local: LocalRedis | None = None
        self._container: object | None = None
        self.url = self._acquire()

    def _acquire(self) -> str:
        url = os.environ.get("HMA_REDIS_TEST_URL")
        if url:
            redis.Redis.from_url(url, socket_timeout=2).ping()
            return url
        container_url = self._try_container()
        if container_url:
            return container_url
        try:
            self._local = LocalRedis().start()
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{INSTALL_HINT}") from None
        return self._local.url

    def _try_container(self) -> str | None:
        if not _docker_reachable():
            return None
        try:
            from testcontainers.redis import RedisContainer
        except ImportError:
            return None
        try:
            container = RedisContainer("redis:7").start()
        except Exception as exc:  # Docker answers but cannot run the image: use redis-server.
            warnings.warn(f"testcontainers Redis failed ({exc}); using redis-server", stacklevel=2)
            return None
        self._container = container
        host = container.get_container_host_ip()
        port = container.get_exposed_port(6379)
        return f"redis://{host}:{port}/0"

    def close(self) -> None:
        if self._local is not None:
            self._local.stop()
        if self._container is not None:
            self._container.stop()  # type: ignore[attr-defined]


def _docker_reachable() -> bool:
    """True when a Docker engine answers on its socket (cheap check before testcontainers)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return True
    path = host.removeprefix("unix://")
    if not os.path.exists(path):
        return False
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1)
            s.connect(path)
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b"OK" in s.recv(256)
    except OSError:
        return False


def command_calls(client: redis.Redis) -> dict[str, int]:
    """``INFO commandstats`` as {command: calls}."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def command_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    names = set(before) | set(after)
    delta = {n: after.get(n, 0) - before.get(n, 0) for n in names}
    return {n: d for n, d in delta.items() if d and n != "info"}
