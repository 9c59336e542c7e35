"""docker/: the compose file and the Dockerfile agree with the package and with each other.

No Docker engine is needed: the files are parsed, and every module and class they name is
imported from the package as installed here.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.tier import tier_config

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"

VLLM_SERVICES = ("vllm-a", "vllm-b")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def option(command: list[str], name: str) -> str:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in an exec-form command."""
    for i, arg in enumerate(command):
        if arg == name:
            return command[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} missing from {command}")


def kv_config(service: dict[str, Any]) -> dict[str, Any]:
    return dict(json.loads(option(service["command"], "--kv-transfer-config")))


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (DOCKER / "Dockerfile").read_text()
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    out = []
    for line in logical:
        instruction, _, args = line.strip().partition(" ")
        out.append((instruction.upper(), args.strip()))
    return out


def test_compose_has_redis_and_two_vllm_servers(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", *VLLM_SERVICES, "events", "prometheus", "grafana"}
    redis = services["redis"]
    assert redis["image"] == "redis:7"
    args = redis["command"]
    assert args[0] == "redis-server"
    assert option(args, "--maxmemory") == "8gb"
    assert option(args, "--maxmemory-policy") == "allkeys-lru"
    assert option(args, "--save") == ""  # persistence off
    assert option(args, "--appendonly") == "no"
    assert redis["healthcheck"]["test"][-1] == "ping"


def test_the_events_service_publishes_the_shared_redis(compose: dict[str, Any]) -> None:
    """``hma-redis events`` (docs/events.md) from the servers' image, on the redis service,
    its PUB and replay ports published; Redis announces stores (``$``, escaped ``$$`` from
    compose's interpolation) as well as removals."""
    services = compose["services"]
    events = services["events"]
    assert events["image"] == services["vllm-a"]["image"]
    assert events["entrypoint"] == ["hma-redis"]
    command = events["command"]
    assert command[0] == "events"
    assert (
        option(command, "--url")
        == kv_config(services["vllm-a"])["kv_connector_extra_config"]["redis_url"]
    )
    pub = option(command, "--endpoint").rsplit(":", 1)[1]
    replay = option(command, "--replay-endpoint").rsplit(":", 1)[1]
    assert {p.rsplit(":", 1)[1] for p in events["ports"]} == {pub, replay}
    assert events["depends_on"]["redis"]["condition"] == "service_healthy"
    redis_args = [str(arg) for arg in services["redis"]["command"]]
    assert "$$" in redis_args[redis_args.index("--notify-keyspace-events") + 1]


@pytest.mark.parametrize("name", VLLM_SERVICES)
def test_vllm_services_run_the_tier(compose: dict[str, Any], name: str) -> None:
    service = compose["services"][name]
    # vLLM's default sha256 prefix hash needs no seed; a fixed public one must not be shipped.
    assert "PYTHONHASHSEED" not in (service.get("environment") or {})
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    assert service["entrypoint"] == ["vllm", "serve"]
    command = service["command"]
    assert not command[0].startswith("-"), "the model comes first"
    # SIGTERM drains (and flushes the tier's stores) only with a shutdown timeout; the
    # container must be given longer than that before SIGKILL.
    shutdown_s = int(option(command, "--shutdown-timeout"))
    assert shutdown_s > 0
    grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"])
    assert grace is not None and int(grace.group(1)) > shutdown_s
    port = option(command, "--port")
    assert any(p.endswith(f":{port}") for p in service["ports"])
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices and all("gpu" in d["capabilities"] for d in devices)
    assert all(d["driver"] == "nvidia" for d in devices)


def test_servers_are_consistent(compose: dict[str, Any]) -> None:
    a, b = (compose["services"][n] for n in VLLM_SERVICES)
    assert a["command"][0] == b["command"][0], "both servers must serve the same model"
    assert kv_config(a) == kv_config(b)
    assert a["environment"] == b["environment"]
    assert a["image"] == b["image"]
    host_ports = [p.split(":")[-2] for s in (a, b) for p in s["ports"]]
    assert len(set(host_ports)) == len(host_ports)
    gpus = [d["device_ids"] for s in (a, b) for d in s["deploy"]["resources"]["reservations"][
        "devices"
    ]]  # fmt: skip
    assert gpus[0] != gpus[1], "by default each server gets its own GPU"


def test_kv_transfer_config_is_the_readmes_and_names_real_classes(
    compose: dict[str, Any],
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.kv_offload.base import OffloadingSpec

    from hma_redis.core.config import RedisTierConfig

    config = kv_config(compose["services"]["vllm-a"])
    extra = config["kv_connector_extra_config"]
    # The redis_url names the compose service.
    assert re.fullmatch(r"redis://redis:6379/\d+", extra["redis_url"])
    assert "redis" in compose["services"]
    # Everything else is the configuration the README documents.
    assert config == tier_config(extra["redis_url"])
    assert readme_kv_config() == tier_config(readme_kv_config()["kv_connector_extra_config"][
        "redis_url"
    ])  # fmt: skip
    assert config["kv_load_failure_policy"] == "recompute"

    connector = getattr(
        importlib.import_module(config["kv_connector_module_path"]), config["kv_connector"]
    )
    assert issubclass(connector, KVConnectorBase_V1)
    spec = getattr(importlib.import_module(extra["spec_module_path"]), extra["spec_name"])
    assert issubclass(spec, OffloadingSpec)
    # The extra config is valid for hma_redis itself (it fails at start-up otherwise).
    RedisTierConfig.from_extra_config(extra)


def readme_kv_config() -> dict[str, Any]:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"--kv-transfer-config '(\{.*?\})'", text, re.DOTALL)
    assert match, "README.md no longer shows a --kv-transfer-config"
    return dict(json.loads(match.group(1)))


def test_dockerfile_uses_the_pinned_vllm_image(pyproject: dict[str, Any]) -> None:
    froms = [args for instr, args in dockerfile_instructions() if instr == "FROM"]
    assert len(froms) == 1
    match = re.fullmatch(r"vllm/vllm-openai:v(\d+)\.(\d+)\.(\d+)", froms[0])
    assert match, f"not an official vLLM OpenAI image tag: {froms[0]}"
    pins = [
        dep
        for deps in pyproject["project"]["optional-dependencies"].values()
        for dep in deps
        if re.match(r"vllm(-cpu)?\s*==", dep)
    ]
    assert pins, "pyproject.toml pins no vLLM version"
    for pin in pins:
        pinned = re.search(r"==\s*(\d+)\.(\d+)", pin)
        assert pinned is not None
        assert pinned.groups() == match.groups()[:2], f"{froms[0]} vs {pin}"


def test_dockerfile_installs_the_package_from_the_repo(pyproject: dict[str, Any]) -> None:
    instructions = dockerfile_instructions()
    copied = [args.split()[:-1] for instr, args in instructions if instr == "COPY"]
    sources = {src for srcs in copied for src in srcs}
    assert {"pyproject.toml", "hma_redis"} <= sources
    assert all((ROOT / src).exists() for src in sources)
    runs = " && ".join(args for instr, args in instructions if instr == "RUN")
    assert re.search(r"pip install [^&]*--no-deps [^&]*\.(\s|$)", runs)
    # --no-deps keeps the image's vLLM and torch; hma_redis' other dependencies are installed.
    installed = {
        re.split(r"[\[<>=]", shlex.split(word)[0])[0].lower()
        for word in re.findall(r"\"[^\"]+\"|'[^']+'", runs)
    }
    for dep in pyproject["project"]["dependencies"]:
        name = re.split(r"[\[<>=\s]", dep)[0].lower()
        if name != "torch":
            assert name in installed, f"the Dockerfile does not install {dep}"
    assert not any(instr == "ENV" and "PYTHONHASHSEED" in args for instr, args in instructions), (
        "a fixed, public PYTHONHASHSEED lets a tenant craft colliding xxhash prefixes"
    )


def test_build_context_keeps_what_the_dockerfile_copies() -> None:
    """docker/Dockerfile.dockerignore: the context is the repo root, minus everything else."""
    patterns = [
        line.strip()
        for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    kept = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = {
        src
        for instr, args in dockerfile_instructions()
        if instr == "COPY"
        for src in args.split()[:-1]
    }
    assert copied <= kept


def test_docker_readme_explains_running_it() -> None:
    text = (DOCKER / "README.md").read_text()
    for needle in ("docker compose up", "docker compose down", "8000", "8001", "PYTHONHASHSEED"):
        assert needle in text


@pytest.mark.parametrize("file", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_publishes_on_loopback_and_sets_the_tiers_keyspace_events(file: str) -> None:
    """Every published port binds to the host's loopback unless the operator says otherwise
    (vLLM's server has no access control), and Redis sends the keyspace events the removal
    watcher needs (doctor would warn otherwise)."""
    data = yaml.safe_load((DOCKER / file).read_text())
    for name, service in data["services"].items():
        for port in service.get("ports", []):
            published = str(port)
            assert published.startswith(("127.0.0.1:", "${VLLM_BIND:-127.0.0.1}:")), (
                file,
                name,
                published,
            )
    command = [str(arg) for arg in data["services"]["redis"]["command"]]
    flags = command[command.index("--notify-keyspace-events") + 1]
    assert set("Kgxe") <= set(flags), flags
