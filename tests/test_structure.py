"""The package's shape, as docs/DESIGN.md ("Module map") states it: no class over 300 lines, and imports that run in
one direction (the wire format does not import the kernels; the DDP front end does not import the Horovod one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "safebits_hvd"
MAX_CLASS_LINES = 300
FORBIDDEN_IMPORTS = {
    "wire.py": {"kernels"},                     # the kernels import the wire format, not the reverse
    "ddp.py": {"compressor", "fsdp"},           # the front ends import frontend.py, not each other
    "compressor.py": {"ddp", "fsdp"},
    "fsdp.py": {"compressor", "ddp"},
    "ddp_nodes.py": {"compressor", "ddp", "fsdp"},
    "closing.py": {"core", "compressor", "ddp", "fsdp"},
    "auto.py": {"core", "compressor", "ddp", "fsdp"},
}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def imported_modules(tree: ast.AST) -> set[str]:
    """The package-relative modules a file imports (``from .x import`` and ``from . import x``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            if node.module:
                names.add(node.module.split(".")[0])
            else:
                names.update(alias.name for alias in node.names)
    return names


def test_the_package_has_modules() -> None:
    assert len(modules()) > 20


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_class_is_over_300_lines(path: Path) -> None:
    tree = ast.parse(path.read_text())
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not long, f"{path.name}: classes over {MAX_CLASS_LINES} lines: {long}"


@pytest.mark.parametrize("name", sorted(FORBIDDEN_IMPORTS))
def test_imports_run_one_way(name: str) -> None:
    imported = imported_modules(ast.parse((PACKAGE / name).read_text()))
    assert not imported & FORBIDDEN_IMPORTS[name], f"{name} imports {sorted(imported & FORBIDDEN_IMPORTS[name])}"


def test_the_import_checker_sees_relative_imports() -> None:
    """The checker itself: it must see both forms, or the tests above pass vacuously."""
    tree = ast.parse("from .kernels import cpu\nfrom . import wire\nfrom ..actions import Menu\nimport numpy\n")
    assert imported_modules(tree) == {"kernels", "wire", "actions"}


def import_graph() -> dict[str, set[str]]:
    """Each top-level module (the ``kernels`` subpackage as one) to the package modules it imports, at module level
    or inside a function alike."""
    graph: dict[str, set[str]] = {}
    for path in modules():
        relative = path.relative_to(PACKAGE)
        node = relative.parts[0].removesuffix(".py")
        imported = imported_modules(ast.parse(path.read_text())) - {node, "__init__"}
        graph.setdefault(node, set()).update(imported)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each as the path from a module back to it (one per module on one)."""
    found = []
    for start in sorted(graph):
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    found.append([*path, start])
                elif nxt not in seen and nxt in graph:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def test_no_module_imports_itself_through_others() -> None:
    """docs/DESIGN.md's layers run one way: no import circle, not even through a function-level import (``auto.py``
    and ``schedules.py`` made one, broken by ``frontend.as_schedule``)."""
    found = circles(import_graph())
    assert not found, found


def test_the_circle_checker_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"], ["b", "c", "a", "b"],
                                                                          ["c", "a", "b", "c"]]
    assert not circles({"a": {"b"}, "b": {"c"}, "c": set()})
