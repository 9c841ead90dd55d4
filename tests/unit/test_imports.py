"""The package's import structure: no import cycles, and a light ``meshtrain.config``.

The graph is built statically (AST) from every module's ``import`` and ``from ... import``
statements. An import inside a function counts: deferring it changes when the imported module
loads, not that the importing one depends on it, so a cycle through it is still a cycle. Only
imports under ``if TYPE_CHECKING:`` (for annotations) are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import meshtrain

PACKAGE_DIR = Path(meshtrain.__file__).resolve().parent


def _module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (packages by their ``__init__``)."""
    names = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module that can run: at module level or inside a function
    or class, but not under ``if TYPE_CHECKING:`` (annotations only)."""
    found: list[ast.Import | ast.ImportFrom] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):
                for child in node.orelse:
                    self.visit(child)
            else:
                self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.append(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            found.append(node)

    Visitor().visit(tree)
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of this package it imports}`` (see :func:`_runtime_imports`)."""
    modules = _module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _runtime_imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                           else source for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path of modules) per strongly connected component with more than
    one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(graph, set(component)) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A closed path through the first module of ``component`` (breadth-first, shortest)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    return paths[node] + [start]
                if succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def test_the_graph_holds_deferred_imports_too():
    graph = import_graph()
    assert "meshtrain.config" in graph["meshtrain.validation"]
    # validate_pipeline imports the schedules inside the function
    assert "meshtrain.parallel.pipeline" in graph["meshtrain.validation"]
    # the config depends on the layout and the model section only, and they on nothing of
    # meshtrain's
    assert graph["meshtrain.config"] == {"meshtrain.layout", "meshtrain.model_config"}
    assert graph["meshtrain.layout"] == set()
    assert graph["meshtrain.model_config"] == set()


def test_runtime_imports_leave_out_type_checking_blocks():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
                     "else:\n    import b\ndef f():\n    import c\nclass K:\n    import d\n")
    names = [alias.name for node in _runtime_imports(tree) for alias in node.names]
    assert names == ["TYPE_CHECKING", "b", "c", "d"]


def test_find_cycles_names_each_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(
        " -> ".join(cycle) for cycle in cycles)


def test_importing_config_loads_no_validation_or_pipeline_code():
    code = "import sys, meshtrain.config; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    assert "meshtrain.config" in loaded
    unwanted = ("meshtrain.validation", "meshtrain.parallel", "torch.distributed.pipelining")
    assert not [m for m in loaded if m.startswith(unwanted)]
