"""Where the suite's shared Redis comes from, and scripts/container_engine.sh's "nothing to do".

CI (``HMA_REDIS_EXPECT_CONTAINERS=1``, set by scripts/test.sh when ``CI=true``) must get its
Redis from testcontainers and fail otherwise; elsewhere a local redis-server stands in.
"""

from __future__ import annotations

import http.server
import os
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
import redis

from tests.support.containers import EXPECT_ENV, containers_expected, docker_host, engine_problem
from tests.support.redis_server import SessionRedis

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "container_engine.sh"


@pytest.fixture
def no_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DOCKER_HOST names a socket nobody listens on; no URL overrides the choice."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    monkeypatch.delenv("HMA_REDIS_TEST_URL", raising=False)


def test_ci_fails_instead_of_falling_back_when_no_engine_answers(
    no_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EXPECT_ENV, "1")
    with pytest.raises(RuntimeError, match=f"{EXPECT_ENV}=1 but no container engine answers"):
        SessionRedis()


def test_without_an_engine_the_session_redis_is_a_local_redis_server(
    no_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(EXPECT_ENV, raising=False)
    server = SessionRedis()
    try:
        assert server.source.startswith("local ") and "no-engine.sock" in server.source
        assert redis.Redis.from_url(server.url, socket_timeout=2).ping()
    finally:
        server.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_timeout=2).ping()


def test_session_redis_is_a_container_exactly_when_an_engine_answers(
    session_redis: SessionRedis,
) -> None:
    """In CI the engine answers (scripts/container_engine.sh): the suite's Redis is the
    container the engine lists, published on the URL's port."""
    if os.environ.get("HMA_REDIS_TEST_URL"):
        assert session_redis.source == "HMA_REDIS_TEST_URL"
        return
    if engine_problem() is not None:
        assert not containers_expected()
        assert session_redis.source.startswith("local ")
        return
    assert session_redis.source.startswith("testcontainers"), session_redis.source
    port = session_redis.url.rsplit(":", 1)[1].split("/")[0]
    client = docker.DockerClient(base_url=docker_host())
    try:
        published = {
            binding["HostPort"]
            for container in client.containers.list()
            for binding in (container.ports.get("6379/tcp") or [])
        }
    finally:
        client.close()
    assert port in published, (port, published)


class _PingHandler(http.server.BaseHTTPRequestHandler):
    """Answers the Docker API's /_ping like an engine does (enough for the script's probe)."""

    def do_GET(self) -> None:
        body = b"OK" if self.path == "/_ping" else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):  # type: ignore[no-untyped-def]
        request, _ = super().get_request()
        return request, ("local", 0)  # BaseHTTPRequestHandler wants a (host, port) address


@pytest.fixture
def other_engine(tmp_path: Path) -> Iterator[str]:
    """A Docker API endpoint that is not the script's own (a real Docker, as far as /_ping)."""
    path = tmp_path / "docker.sock"
    server = _UnixHTTPServer(str(path), _PingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"unix://{path}"
    server.shutdown()
    server.server_close()


def test_container_engine_script_does_nothing_when_docker_answers(
    other_engine: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    env = {**os.environ, "DOCKER_HOST": other_engine, "HMA_CE_DIR": str(state)}
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # no exports: testcontainers keeps the engine it has
    assert "nothing to do" in proc.stderr
    assert not state.exists()  # no API service started
