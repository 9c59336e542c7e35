"""Redis through testcontainers, for the session's shared server.

Which engine: ``DOCKER_HOST`` (``scripts/container_engine.sh`` points it at a podman API service
on machines without Docker), else ``/var/run/docker.sock``. Which image: ``HMA_REDIS_TEST_IMAGE``
(the script exports its locally built ``localhost/hma-redis-test:<version>``), else ``redis:7``
as pulled by a real Docker. ``HMA_REDIS_EXPECT_CONTAINERS=1`` (``scripts/test.sh`` sets it when
``CI=true``) turns "no engine" from a fallback into an error.
"""

from __future__ import annotations

import http.client
import os
import socket
from dataclasses import dataclass

EXPECT_ENV = "HMA_REDIS_EXPECT_CONTAINERS"
IMAGE_ENV = "HMA_REDIS_TEST_IMAGE"
DEFAULT_IMAGE = "redis:7"
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
REDIS_PORT = 6379


class NoContainerEngine(RuntimeError):
    """No container engine answers, or it answers but cannot run the Redis image."""


def containers_expected() -> bool:
    """True when the run must get its Redis from testcontainers (CI), never from a fallback."""
    return os.environ.get(EXPECT_ENV, "") not in ("", "0")


def docker_host() -> str:
    """The Docker API endpoint testcontainers will use."""
    return os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


def image_name() -> str:
    """The Redis image the session container runs."""
    return os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE


def engine_problem(host: str | None = None, timeout_s: float = 2.0) -> str | None:
    """None when a Docker API answers ``GET /_ping`` at ``host``; else why not, in a few words."""
    host = host or docker_host()
    try:
        conn = _api_connection(host, timeout_s)
        conn.request("GET", "/_ping")
        reply = conn.getresponse()
        body = reply.read(64)
        conn.close()
    except OSError as exc:
        return f"no container engine answers at {host} ({exc.strerror or exc})"
    except http.client.HTTPException as exc:
        return f"{host} does not speak the Docker API ({type(exc).__name__})"
    if reply.status != 200 or body.strip() != b"OK":
        return f"{host} answered /_ping with HTTP {reply.status}"
    return None


def _api_connection(host: str, timeout_s: float) -> http.client.HTTPConnection:
    if host.startswith("unix://"):
        return _UnixHTTPConnection(host.removeprefix("unix://"), timeout_s)
    address = host.removeprefix("tcp://").removeprefix("http://").rstrip("/")
    return http.client.HTTPConnection(address, timeout=timeout_s)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


@dataclass
class RedisTestContainer:
    """A Redis container started through testcontainers; ``url`` is valid once started."""

    image: str
    url: str = ""
    _container: object | None = None

    def start(self) -> RedisTestContainer:
        """Start the container and wait until it answers PING.

        Raises :class:`NoContainerEngine` when no engine answers or the start fails."""
        problem = engine_problem()
        if problem:
            raise NoContainerEngine(problem)
        container_cls = _redis_container_class()
        try:
            container = container_cls(self.image).start()
        except Exception as exc:  # docker-py, testcontainers and redis-py errors alike
            raise NoContainerEngine(
                f"testcontainers could not start {self.image} at {docker_host()}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._container = container
        host = container.get_container_host_ip()
        # "localhost" may resolve to ::1 first; the engine publishes the port on IPv4.
        host = "127.0.0.1" if host == "localhost" else host
        self.url = f"redis://{host}:{container.get_exposed_port(REDIS_PORT)}/0"
        return self

    def stop(self) -> None:
        """Stop and remove the container (Ryuk is off under podman: nobody else will)."""
        if self._container is not None:
            self._container.stop()  # type: ignore[attr-defined]
            self._container = None


def _redis_container_class() -> type:
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:
        try:  # testcontainers < 4.10 has no community package
            from testcontainers.redis import RedisContainer
        except ImportError as exc:
            raise NoContainerEngine(
                "testcontainers is not installed (pip install -e '.[test]')"
            ) from exc
    return RedisContainer
