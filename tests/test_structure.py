"""The package's shape, as docs/DESIGN.md ("Module map") states it: five layers as subpackages, imports that only run
down (or within a layer) and never in a circle, front ends that do not import each other, and no class over 300
lines."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "safebits_hvd"
MAX_CLASS_LINES = 300
LAYERS = ("codec", "comm", "policy", "step", "frontends")
"""Bottom to top: a module may import its own layer and those below it."""
ROOT_LAYERS = {"errors": -1, "__init__": len(LAYERS), "ddp": len(LAYERS), "fsdp": len(LAYERS)}
"""The package's root modules: the exceptions under every layer; the public API (``__init__``) and the front ends'
public modules (``safebits_hvd.ddp``, ``safebits_hvd.fsdp``) above them all."""
FRONT_ENDS = {"frontends.horovod", "frontends.elastic", "frontends.ddp", "frontends.ddp_nodes", "frontends.fsdp"}
"""Each imports what the front ends share (``frontends.shared``), never another front end (``frontends.elastic``
holds Horovod's elastic state: it may import ``frontends.horovod``)."""
ALLOWED_BETWEEN_FRONT_ENDS = {("frontends.elastic", "frontends.horovod"), ("frontends.ddp", "frontends.ddp_nodes")}
NEVER = {"step.closing": {"step.core"}}
"""Within a layer, the direction that keeps a step's life one way: the core drives closing, never the reverse."""


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    """``safebits_hvd/step/core.py`` -> ``step.core``; a package's ``__init__.py`` -> the package (``codec.kernels``),
    the root's -> ``__init__``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported_modules(tree: ast.AST, name: str, package: bool = False) -> set[str]:
    """The package modules a module ``name`` imports, as package-relative dotted names, from relative imports
    (``from .x import y``, ``from .. import x``) and absolute ones (``from safebits_hvd.x import y``), at module level
    or inside a function alike. ``from p import x`` names module ``p.x`` when ``x`` is one, else ``p``."""
    here = [] if name == "__init__" else name.split(".")
    if not package:
        here = here[:-1]
    known = {module_name(p) for p in modules()}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == PACKAGE.name:
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                target = ".".join([*base, alias.name])
                found.add(target if target in known else ".".join(base) or "__init__")
        elif isinstance(node, ast.Import):
            found.update(".".join(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == PACKAGE.name)
    return found - {""}


def layer(module: str) -> int:
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else ROOT_LAYERS[head]


def import_graph() -> dict[str, set[str]]:
    """Each package module to the package modules it imports."""
    return {module_name(p): imported_modules(ast.parse(p.read_text()), module_name(p), is_package(p)) - {module_name(p)}
            for p in modules()}


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports that run up a layer, or between front ends, or against :data:`NEVER`."""
    bad = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            between_front_ends = (module in FRONT_ENDS and target in FRONT_ENDS
                                  and (module, target) not in ALLOWED_BETWEEN_FRONT_ENDS)
            if layer(target) > layer(module) or target in NEVER.get(module, ()) or between_front_ends:
                bad.append((module, target))
    return bad


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


def test_the_package_is_its_layers() -> None:
    """Every module sits in one of the layers, or is one of the root's few."""
    graph = import_graph()
    assert len(graph) > 30
    assert {m.split(".")[0] for m in graph} == set(LAYERS) | set(ROOT_LAYERS)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_class_is_over_300_lines(path: Path) -> None:
    tree = ast.parse(path.read_text())
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not long, f"{path.name}: classes over {MAX_CLASS_LINES} lines: {long}"


def test_imports_run_down_the_layers() -> None:
    bad = upward(import_graph())
    assert not bad, f"imports against docs/DESIGN.md's layers: {bad}"


def test_no_module_imports_itself_through_others() -> None:
    """No import circle, not even through a function-level import (``auto`` and ``schedules`` once made one)."""
    found = circles(import_graph())
    assert not found, found


def test_the_import_checker_sees_every_form() -> None:
    """The checker itself: it must resolve each form, or the tests above pass vacuously."""
    source = ("from ..codec.kernels import cpu\nfrom .. import errors\nfrom ..comm import exchange\n"
              "from .budget import BudgetPolicy\nfrom safebits_hvd.step.core import SafeBitsCore\nimport numpy\n")
    assert imported_modules(ast.parse(source), "policy.screen") == {
        "codec.kernels.cpu", "errors", "comm.exchange", "policy.budget", "step.core"}
    assert imported_modules(ast.parse("from .cpu import build\n"), "codec.kernels", package=True) == {
        "codec.kernels.cpu"}


def test_the_layer_checker_catches_an_upward_import() -> None:
    """The mutation the layer test must catch: the wire format importing the step engine, a front end importing
    another, closing importing the core."""
    graph = import_graph()
    graph["codec.wire"] = {*graph["codec.wire"], "step.core"}
    graph["frontends.fsdp"] = {*graph["frontends.fsdp"], "frontends.ddp"}
    graph["step.closing"] = {*graph["step.closing"], "step.core"}
    assert upward(graph) == [("codec.wire", "step.core"), ("frontends.fsdp", "frontends.ddp"),
                             ("step.closing", "step.core")]


def test_the_circle_checker_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"], ["b", "c", "a", "b"],
                                                                          ["c", "a", "b", "c"]]
    assert not circles({"a": {"b"}, "b": {"c"}, "c": set()})


def test_every_name_a_module_exports_exists() -> None:
    """``__all__`` lists only names the module has (a rename that misses the list breaks ``import *``)."""
    missing = []
    for path in modules():
        name = module_name(path)
        dotted = PACKAGE.name if name == "__init__" else f"{PACKAGE.name}.{name}"
        module = importlib.import_module(dotted)
        missing += [f"{dotted}.{n}" for n in getattr(module, "__all__", []) if not hasattr(module, n)]
    assert not missing, missing
