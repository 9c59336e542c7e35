"""The package's layers, read from its source: core imports nothing above it, the adapter
nothing of the tools, the runtime (core, adapter, the entry points) never the tools, and no
module imports itself back through others (no import circles)."""

from __future__ import annotations

import ast
from pathlib import Path

import hma_redis

PACKAGE = Path(hma_redis.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every hma_redis module -> the hma_redis modules it imports (at any depth of its code)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else "package"


def test_lower_layers_never_import_higher_ones() -> None:
    allowed = {
        "package": set(),
        "core": {"package", "core"},
        "adapter": {"package", "core", "adapter"},
        "spec": {"adapter"},  # hma_redis.spec / hma_redis.connector: the documented entry points
        "connector": {"adapter"},
        "tiering": {"adapter"},  # hma_redis.tiering: the secondary tier's entry point
        "tools": {"package", "core", "adapter", "tools"},
    }
    wrong = [
        f"{module} -> {target}"
        for module, targets in _imports().items()
        for target in targets
        if _layer(target) not in allowed[_layer(module)]
    ]
    assert not wrong


def test_no_import_circles() -> None:
    graph = _imports()

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

    assert not [m for m in graph if reaches(m, m)]
