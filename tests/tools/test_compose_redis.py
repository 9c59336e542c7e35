"""The ``redis`` service of docker/compose.yaml, run for real by a compose tool.

``podman-compose`` when it is installed (``scripts/container_engine.sh`` installs it beside
podman and tags its locally built Redis image ``docker.io/library/redis:7``, the name the file
uses), else ``docker compose``. The service must become healthy through its own health check and
``hma-redis doctor`` must judge it the way docker/README.md says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest
import redis
from docker.models.containers import Container

from hma_redis.tools.devkit.local_redis import free_port
from tests.support.cli_run import run_script
from tests.support.containers import IMAGE_ENV, engine_problem

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
HEALTHY_WITHIN_S = 60.0
# The service's settings the doctor must find OK (docker/README.md, "Run the redis service").
SERVICE_CHECKS = (
    "connectivity",
    "version",
    "scripts",
    "cluster",
    "maxmemory",
    "maxmemory-policy",
    "evictions",
    "persistence",
    "notifications",
)


@dataclass
class ComposeRedis:
    """The compose project's running ``redis`` service."""

    tool: list[str]
    project: str
    port: int
    container: Container

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _compose_tool() -> list[str]:
    if shutil.which("podman-compose"):
        return ["podman-compose"]
    if shutil.which("docker"):
        return ["docker", "compose"]
    pytest.fail(
        "no compose tool: install podman-compose (source scripts/container_engine.sh) "
        "or Docker's compose plugin",
        pytrace=False,
    )


def _compose(tool: list[str], project: str, port: int, *args: str) -> str:
    """``<tool> -p project -f docker/compose.yaml ARGS`` with the redis service on ``port``."""
    env = {**os.environ, "REDIS_HOST_PORT": str(port)}
    proc = subprocess.run(
        [*tool, "-p", project, "-f", str(COMPOSE_FILE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"{' '.join(tool)} {' '.join(args)}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def _service_container(client: docker.DockerClient, project: str) -> Container:
    labels = [f"com.docker.compose.project={project}", "com.docker.compose.service=redis"]
    found = client.containers.list(all=True, filters={"label": labels})
    assert len(found) == 1, f"compose project {project}: redis containers {found}"
    return found[0]


def _wait_healthy(redis_: ComposeRedis) -> str:
    """Poll the container's health; returns the last status.

    podman runs health checks from systemd timers, and these machines have no systemd: run the
    service's check ourselves (``podman healthcheck run``); Docker runs it by itself."""
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    status = "?"
    while time.monotonic() < deadline:
        if redis_.tool == ["podman-compose"]:
            subprocess.run(
                ["podman", "healthcheck", "run", redis_.container.id],
                capture_output=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
            )
        redis_.container.reload()
        status = redis_.container.attrs["State"].get("Health", {}).get("Status", "none")
        if status == "healthy":
            return status
        time.sleep(0.5)
    return status


@pytest.fixture(scope="module")
def compose_redis() -> Iterator[ComposeRedis]:
    """``compose up -d redis`` on a free host port, in a project of its own; down afterwards."""
    problem = engine_problem()
    if problem:
        pytest.fail(f"{problem}: source scripts/container_engine.sh first", pytrace=False)
    tool = _compose_tool()
    project = f"hma-redis-test-{os.getpid()}"
    port = free_port()
    client = docker.from_env()
    try:
        _compose(tool, project, port, "up", "-d", "redis")
        yield ComposeRedis(tool, project, port, _service_container(client, project))
    finally:
        _compose(tool, project, port, "down")
        if tool == ["podman-compose"]:  # podman-compose 1.0 leaves the project's network
            subprocess.run(["podman", "network", "rm", "-f", f"{project}_default"], check=False)
        client.close()


def test_compose_redis_runs_the_image_the_file_names(compose_redis: ComposeRedis) -> None:
    """`image: redis:7` resolves without a registry to the image the tests' containers run."""
    image = compose_redis.container.image
    assert image is not None
    assert {"redis:7", "docker.io/library/redis:7"} & set(image.tags), image.tags
    local = os.environ.get(IMAGE_ENV)
    if local:  # scripts/container_engine.sh built it: the same image under both names
        assert local in image.tags, image.tags


def test_compose_redis_passes_its_health_check(compose_redis: ComposeRedis) -> None:
    assert _wait_healthy(compose_redis) == "healthy"
    with redis.Redis.from_url(compose_redis.url, socket_timeout=5) as client:
        assert client.ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}


def test_doctor_finds_the_compose_redis_set_up_for_a_cache(compose_redis: ComposeRedis) -> None:
    run = run_script("--url", compose_redis.url, "doctor")
    assert run.code == 0, run.out + run.err
    verdicts = {line.split()[1]: line.split()[0] for line in run.out.splitlines()}
    assert set(verdicts.values()) <= {"OK", "WARN"}, run.out
    assert {name: verdicts.get(name) for name in SERVICE_CHECKS} == dict.fromkeys(
        SERVICE_CHECKS, "OK"
    ), run.out
