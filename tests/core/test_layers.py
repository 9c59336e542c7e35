"""The package's layers, read from its source: core imports nothing above it (nor vLLM, at any
depth of its code), the adapter nothing of the tools, the runtime (core, adapter, the entry
points) never the tools, no module imports itself back through others (no import circles), only
core/redis speaks Redis (nothing else in core imports it or redis-py), and the transfer engine
(core/transfer) sees a medium only through core.medium (the medium seam). Relative imports
are resolved, not skipped; a self-test plants violations in a temporary package
and checks that every check finds them."""

from __future__ import annotations

import ast
from pathlib import Path

import hma_redis

PACKAGE = Path(hma_redis.__file__).parent

ALLOWED = {
    "package": set(),
    "core": {"package", "core"},
    "adapter": {"package", "core", "adapter"},
    "spec": {"adapter"},  # hma_redis.spec / hma_redis.connector: the documented entry points
    "connector": {"adapter"},
    "tiering": {"adapter"},  # hma_redis.tiering: the secondary tier's entry point
    "tools": {"package", "core", "adapter", "tools"},
}

# The medium seam (docs/architecture.md), as a rule by folder. Only core/redis speaks Redis:
# nothing else in core imports it or redis-py. The transfer engine (core/transfer) reaches a
# medium only through core.medium and stands, like the protocol, on engine-agnostic modules.
REDIS_MEDIUM = "core.redis"
MAY_IMPORT = {
    "core.transfer": {
        "core",
        "core.transfer",
        "core.codec",
        "core.sealing",
        "core.counters",
        "core.deadline",
        "core.latency",
        "core.medium",
    },
    "core.medium": {"core", "core.counters", "core.deadline", "core.latency"},
}


def _module_name(package: Path, path: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names, relative ones resolved from ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def _all_imports(package: Path) -> dict[str, set[str]]:
    """Every module of ``package`` -> every module it imports, at any depth of its code."""
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        name = _module_name(package, path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(name, path.name == "__init__.py", node)
                found.update(f"{source}.{alias.name}" for alias in node.names)
                found.add(source)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = found
    return graph


def _imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module of ``package`` -> the modules of ``package`` it imports."""
    graph = _all_imports(package)
    return {name: {m for m in found if m in graph and m != name} for name, found in graph.items()}


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else "package"


def _layer_violations(package: Path = PACKAGE) -> list[str]:
    return [
        f"{module} -> {target}"
        for module, targets in _imports(package).items()
        for target in targets
        if _layer(target) not in ALLOWED[_layer(module)]
    ]


def _vllm_in_core(package: Path = PACKAGE) -> list[str]:
    return [
        f"{module} -> {target}"
        for module, targets in _all_imports(package).items()
        if _layer(module) == "core"
        for target in targets
        if target == "vllm" or target.startswith("vllm.")
    ]


def _folder(module: str, top: str) -> str:
    """The rule's name for a module: ``core.transfer`` for every module under core/transfer."""
    inner = module.removeprefix(f"{top}.")
    for folder in (*MAY_IMPORT, REDIS_MEDIUM):
        if inner == folder or inner.startswith(f"{folder}."):
            return folder
    return inner


def _seam_violations(package: Path = PACKAGE) -> list[str]:
    top, inner = package.name, _imports(package)

    def breaks_seam(folder: str, target: str) -> bool:
        if target == "redis" or target.startswith("redis."):
            return True  # redis-py outside core/redis
        if target not in inner or target == top:
            return False  # not a module of the package (a name imported from one)
        if _folder(target, top) == REDIS_MEDIUM:
            return True
        return folder in MAY_IMPORT and _folder(target, top) not in MAY_IMPORT[folder]

    return [
        f"{module} -> {target}"
        for module, targets in sorted(_all_imports(package).items())
        if _layer(module) == "core" and _folder(module, top) != REDIS_MEDIUM
        for target in sorted(targets)
        if breaks_seam(_folder(module, top), target)
    ]


def _circles(package: Path = PACKAGE) -> list[str]:
    graph = _imports(package)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module == goal:
                return True
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        return False

    return [m for m in graph if reaches(m, m)]


def test_lower_layers_never_import_higher_ones() -> None:
    assert not _layer_violations()


def test_core_never_imports_vllm_even_inside_a_function() -> None:
    assert not _vllm_in_core()


def test_no_import_circles() -> None:
    assert not _circles()


def test_only_core_redis_speaks_redis_and_the_engine_sees_only_core_medium() -> None:
    assert not _seam_violations()


def test_the_checks_find_violations_planted_in_a_package(tmp_path: Path) -> None:
    """A relative import upwards, ``import vllm`` inside a core function, and a circle through
    relative imports are each found."""
    package = tmp_path / "planted"
    for sub in ("core", "adapter"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "core" / "low.py").write_text("from ..adapter import high\n")
    (package / "core" / "lazy.py").write_text("def f():\n    import vllm.config\n")
    (package / "adapter" / "high.py").write_text("from . import other\n")
    (package / "adapter" / "other.py").write_text("from .high import name\n")

    assert sorted(_layer_violations(package)) == [
        "planted.core.low -> planted.adapter",
        "planted.core.low -> planted.adapter.high",
    ]
    assert _vllm_in_core(package) == ["planted.core.lazy -> vllm.config"]
    assert sorted(_circles(package)) == ["planted.adapter.high", "planted.adapter.other"]
    assert not _layer_violations() and not _vllm_in_core() and not _circles()


def test_the_seam_check_finds_an_engine_that_reaches_past_the_medium(tmp_path: Path) -> None:
    """A transfer module that imports the Redis store (relatively) or the wire code (inside a
    function), a medium module that imports the store, a transfer module that imports redis-py,
    and a core module outside core/redis that imports redis-py or core.redis, are each found."""
    package = tmp_path / "planted"
    for folder in ("core", "core/redis", "core/transfer"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for name in ("codec", "redis/store", "redis/wire", "redis/client"):
        (package / "core" / f"{name}.py").write_text("")
    (package / "core" / "redis" / "client.py").write_text("import redis\n")  # allowed here
    (package / "core" / "medium.py").write_text("from planted.core.redis.store import PutResult\n")
    (package / "core" / "transfer" / "engine.py").write_text(
        "from .. import codec, medium\n"
        "from ..redis.store import RedisBlockStore\n"
        "def f():\n    from planted.core.redis import wire\n"
    )
    (package / "core" / "transfer" / "jobs.py").write_text("import redis\n")
    (package / "core" / "keys.py").write_text("from redis.exceptions import RedisError\n")
    (package / "core" / "codec.py").write_text("from planted.core.redis import client\n")

    assert sorted(_seam_violations(package)) == [
        "planted.core.codec -> planted.core.redis",
        "planted.core.codec -> planted.core.redis.client",
        "planted.core.keys -> redis.exceptions",
        "planted.core.keys -> redis.exceptions.RedisError",
        "planted.core.medium -> planted.core.redis.store",
        "planted.core.transfer.engine -> planted.core.redis",
        "planted.core.transfer.engine -> planted.core.redis.store",
        "planted.core.transfer.engine -> planted.core.redis.wire",
        "planted.core.transfer.jobs -> redis",
    ]
