"""A throwaway ``redis-server`` on a loopback port (persistence off), for the demo, benchmarks
and tests: started from PATH, stopped by its pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import redis

INSTALL_HINT = (
    "redis-server not found on PATH (Debian: apt-get install -y redis-server redis-tools); "
    "or point hma_redis at a running Redis with a URL"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A ``redis-server`` process on a loopback port, persistence off, stopped by its pid."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``binary``: the server to run (default: ``redis-server`` on PATH; a
        ``valkey-server`` takes the same arguments); ``env``: variables set for it on top of
        this process's environment (e.g. its allocator's ``MALLOC_CONF``)."""
        binary = binary or shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary = binary
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
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
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
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

    def cpu_ms(self) -> float:
        """CPU ms the server's threads have run so far: the scheduler's nanosecond counts
        (``/proc/PID/task/*/schedstat``), not the clock ticks of ``stat``. For benchmarks."""
        assert self.proc is not None
        total = 0
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                with open(f"/proc/{self.proc.pid}/task/{tid}/schedstat") as schedstat:
                    total += int(schedstat.read().split()[0])
            except OSError:  # the thread ended meanwhile
                continue
        return total / 1e6

    def minor_faults(self) -> int:
        """The server's minor page faults so far (memory it touched for the first time since
        its allocator got it from the system). For benchmarks."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[7])

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
        if self.proc is not None:
            terminate(self.proc)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server process we started: resumed if paused, SIGTERM, SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextmanager
def redis_or_local(url: str | None) -> Iterator[str]:
    """Yield ``url``, or start a private ``redis-server`` for the block when it is None."""
    if url is not None:
        yield url
        return
    try:
        server = LocalRedis().start()
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    try:
        yield server.url
    finally:
        server.stop()


def cluster_node_args(bus_port: int, node_timeout_ms: int) -> list[str]:
    """The ``redis-server`` arguments of a Cluster node whose bus listens on ``bus_port``."""
    return [
        "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf",
        "--cluster-port", str(bus_port),
        "--cluster-node-timeout", str(node_timeout_ms),
    ]  # fmt: skip
