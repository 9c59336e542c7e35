"""Start and stop real Redis servers for tests (no mocks).

Order of preference for the shared session server: ``HMA_REDIS_TEST_URL``; a testcontainers Redis
when a Docker engine answers; ``redis-server`` from PATH on a free loopback port. Tests that kill
and restart the server always use a local ``redis-server`` of their own.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import redis

INSTALL_HINT = (
    "hma_redis tests need a real Redis: set HMA_REDIS_TEST_URL, or run a Docker engine, "
    "or install redis-server (Debian: apt-get install -y redis-server redis-tools)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A ``redis-server`` process on a loopback port, persistence off, stopped by its pid."""

    def __init__(self, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary = binary
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.dir = tempfile.mkdtemp(prefix="hma-redis-test-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--protected-mode", "no",
            *self.extra_args,
        ]  # fmt: skip
        log = open(Path(self.dir) / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = (Path(self.dir) / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited at start-up:\n{log}")
            try:
                if client.ping():
                    client.close()
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL the server (an outage, not a clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


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
