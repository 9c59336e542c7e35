"""docs/architecture.md's tree is the package as it is: every module of ``core/`` and
``adapter/`` is listed in the folder it lives in, every file and folder the tree names exists,
and every folder of ``tools/`` is listed. A module added, moved or removed without the tree
changing fails here, so a newcomer can trust the tree to find the code."""

from __future__ import annotations

import re
from pathlib import Path

import hma_redis

PACKAGE = Path(hma_redis.__file__).parent
TREE_DOC = PACKAGE.parent / "docs" / "architecture.md"
# Folders whose every Python module the tree must list (tools/ is listed by folder).
LISTED_IN_FULL = ("core", "adapter")


def _tree_block(text: str) -> list[str]:
    """The lines of the first code block that starts with the package's folder."""
    match = re.search(r"```\n(hma_redis/\n.*?)```", text, re.S)
    assert match, "docs/architecture.md has no tree of hma_redis/"
    return match.group(1).splitlines()


def _listed(lines: list[str]) -> set[str]:
    """Paths (relative to hma_redis/) of the tree's entries: a line's first word at an indent
    of two spaces per level; a word ending in "/" is a folder. Lines that continue the
    description of the entry above (deeper, not a file or folder name) are skipped."""
    paths: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in lines[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        word = line.split()[0]
        if not re.fullmatch(r"[\w.]+/|[\w.]+\.(py|c)", word):
            continue  # a description's continuation line
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        path = parent + word
        paths.add(path.rstrip("/"))
        if word.endswith("/"):
            stack.append((indent, path))
    return paths


def _on_disk(root: Path = PACKAGE) -> tuple[set[str], set[str]]:
    """(modules of the folders listed in full, folders of tools/), relative to ``root``."""
    modules = {
        str(path.relative_to(root))
        for folder in LISTED_IN_FULL
        for path in (root / folder).rglob("*.py")
        if path.name != "__init__.py"
    }
    tools = {
        str(path.relative_to(root))
        for path in (root / "tools").iterdir()
        if path.is_dir() and (path / "__init__.py").exists()
    }
    return modules, tools


def _mismatches(tree: set[str], root: Path = PACKAGE) -> list[str]:
    modules, tools = _on_disk(root)
    found = [f"not in the tree: {m}" for m in sorted((modules | tools) - tree)]
    found += [f"in the tree, not on disk: {p}" for p in sorted(tree) if not (root / p).exists()]
    return found


def test_the_architecture_tree_is_the_package_as_it_is() -> None:
    assert not _mismatches(_listed(_tree_block(TREE_DOC.read_text())))


def test_the_check_finds_a_module_left_out_and_one_that_is_gone(tmp_path: Path) -> None:
    """A module on disk the tree does not list, and an entry with no file, are each found; a
    description's continuation line is not taken for an entry."""
    root = tmp_path / "hma_redis"
    for folder in ("core/redis", "adapter", "tools/cli"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    for module in ("core/codec.py", "core/redis/store.py", "adapter/spec.py"):
        (root / module).write_text("")
    doc = (
        "```\nhma_redis/\n"
        "  core/          engine-agnostic\n"
        "    codec.py     the envelope\n"
        "    redis/       the medium\n"
        "      wire.py    gone from disk\n"
        "                 a continuation of wire.py's description\n"
        "  adapter/\n"
        "    spec.py      the spec\n"
        "  tools/\n"
        "    cli/         hma-redis\n"
        "```\n"
    )
    assert _mismatches(_listed(_tree_block(doc)), root) == [
        "not in the tree: core/redis/store.py",
        "in the tree, not on disk: core/redis/wire.py",
    ]
