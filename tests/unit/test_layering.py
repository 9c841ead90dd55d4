"""The package's layering (docs/architecture.md): no import cycle between modules or between
top-level packages, every package importing only those below it, a model free of parallel code,
and a torch-free configuration and planner.

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

import pytest

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


LAYERS = ("cli", "commands", "run", "training", "replan", "checkpoint", "planner", "validation",
          "parallel", "data", "model", "host", "config")
"""Top-level packages (and ``cli``), each importing only those after it (docs/architecture.md)."""

BESIDE = ("errors", "faults")
"""Loose modules every layer may import: they import nothing of meshtrain's."""


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``{top-level package: top-level packages its modules import}``."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(_top(module), set()).update(
            _top(t) for t in targets if _top(t) != _top(module))
    return packages


def test_the_graph_holds_deferred_imports_too():
    graph = import_graph()
    assert "meshtrain.config" in graph["meshtrain.validation.run_config"]
    # validate_pipeline imports the schedules inside the function
    assert "meshtrain.parallel.pipeline" in graph["meshtrain.validation.run_config"]
    # the config's sections depend on the layout and the model section only, and they on
    # nothing of meshtrain's
    assert graph["meshtrain.config.sections"] == {"meshtrain.config.layout",
                                                  "meshtrain.config.model"}
    assert graph["meshtrain.config.layout"] == set()
    assert graph["meshtrain.config.model"] == set()


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


def test_no_import_cycle_between_top_level_packages():
    cycles = find_cycles(package_graph(import_graph()))
    assert not cycles, "package cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_package_imports_only_the_layers_below_it():
    graph = import_graph()
    tops = {_top(m) for m in graph} - {"", "__main__"}
    assert tops == set(LAYERS) | set(BESIDE), f"update LAYERS and docs/architecture.md: {tops}"
    upward = []
    for module, targets in sorted(graph.items()):
        source = _top(module)
        if source not in LAYERS:
            continue
        for target in sorted(targets):
            layer = _top(target)
            if layer in LAYERS and layer != source and LAYERS.index(layer) < LAYERS.index(source):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the layering: " + "; ".join(upward)


def test_beside_modules_import_nothing_of_meshtrain():
    graph = import_graph()
    assert all(not graph[f"meshtrain.{name}"] for name in BESIDE)


def test_at_most_four_loose_modules_at_the_top():
    loose = sorted(p.name for p in PACKAGE_DIR.glob("*.py")
                   if p.name not in ("__init__.py", "__main__.py"))
    assert len(loose) <= 4, loose


def test_no_data_module_left_under_training():
    names = {p.stem for p in (PACKAGE_DIR / "training").rglob("*.py")}
    for word in ("data", "tokenizer", "mixture", "corpus", "prefetch"):
        assert not [n for n in names if word in n], (word, names)


def test_the_model_imports_no_parallel_training_checkpoint_or_planner_code():
    """Not even for annotations: the model is plain single-device PyTorch."""
    forbidden = ("meshtrain.parallel", "meshtrain.training", "meshtrain.checkpoint",
                 "meshtrain.planner", "meshtrain.replan", "meshtrain.run", "meshtrain.commands",
                 "torch.distributed")
    found = []
    for path in sorted((PACKAGE_DIR / "model").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.name}: {n}" for n in names if n.startswith(forbidden)]
    assert not found


BLOCK_TORCH = ("import sys\n"
               "for name in ('torch', 'numpy'):\n"
               "    sys.modules[name] = None  # any import of them raises ImportError\n")


def test_config_and_planner_import_with_torch_blocked():
    modules = sorted(m for m in import_graph()
                     if m.startswith(("meshtrain.config", "meshtrain.planner")))
    code = BLOCK_TORCH + "import importlib\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in modules)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("args", [
    ["estimate", "--model", "llama3.1-8b", "--gpus", "64", "--hardware", "h100-80g"],
    ["plan", "--model", "llama3.1-8b", "--gpus", "64", "--hardware", "h100-80g"],
    ["plan", "--model", "llama3.1-8b", "--gpus", "64", "--hardware", "h100-80g", "--sites", "2",
     "--wan-gbps", "10", "--json"],
], ids=["estimate", "plan", "plan-across-sites"])
def test_estimate_and_plan_run_where_torch_is_not_installed(args):
    code = BLOCK_TORCH + f"from meshtrain.cli import main\nsys.exit(main({args!r}))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()


def test_importing_config_loads_no_validation_or_pipeline_code():
    code = "import sys, meshtrain.config; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    assert "meshtrain.config" in loaded
    unwanted = ("meshtrain.validation", "meshtrain.parallel", "torch")
    assert not [m for m in loaded if m.startswith(unwanted)]
