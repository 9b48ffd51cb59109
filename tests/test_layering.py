"""The package's import graph: no cycles between modules, and the layers import downwards only.

The graph is static (``ast`` over ``upipe_dtensor/**/*.py``): module-level, function-level and
type-only (``if TYPE_CHECKING:``) imports all count as edges, so neither a function-level import
nor an annotation can hide a cycle (config/schema <-> parallel/registry hid behind one of each).
``LAYERS`` is the order, lowest first; a module may import its own layer and those below it, never
one above, not even for annotations. ``modes`` (every mode a plan or a stand-in run turns on) sits
just above ``errors``, so that the runtime layers ask it, never ``planning``. ``checkpointing`` sits
above ``config``: its records and snapshot choices read the job's config, and the config's checks
ask the folders' files (``models.hf_config``), not ``checkpointing``. The training job (``train``:
``setup``, ``build``, ``parallelize``, the trainer's ``preflight``, ``resume``, ``optimizer``,
``export`` and its loop ``trainer``) sits below ``planning``, which rehearses it on fake ranks; the
GPU verification tools (``verify``: ``gpu_check``, ``stand_in``, ``kernel_rates``, ``evidence``) and
the user commands (``commands``: evaluate, retrieval, convert, and the ``python -m`` modules at the
package top) sit above it, since they may ask the planner (``gpu_check`` prints the plan beside the
measured step). ``integrations`` (other trainers running the styles: torchtitan's) sits above them
all.

Cycles are refused twice: between modules, and between packages (each module mapped to its
top-level sub-package of ``upipe_dtensor``; the modules at the package top are each their own),
so two packages never import each other, even through a chain of modules that is no module
cycle.

The design notes' "Layout" section (``docs/design.md``) must name every module file, one line
each; the last test compares it with the tree.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "upipe_dtensor"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("errors", ("errors",)),
    ("modes", ("modes",)),
    ("runtime", ("runtime",)),
    ("kernels", ("kernels",)),
    ("memory", ("memory",)),
    ("parallel", ("parallel",)),
    ("models", ("models",)),
    ("config", ("config",)),
    ("checkpointing", ("checkpointing",)),
    ("data", ("data",)),
    ("training job", ("train",)),
    ("planning", ("planning",)),
    ("verification tools", ("verify",)),
    (
        "commands",
        ("commands", "plan", "evaluate", "convert", "gpu_check", "data_report", "tokenize"),
    ),
    ("integrations", ("integrations",)),
    ("package exports", ("",)),
)
"""Lowest first. Each entry names modules relative to ``upipe_dtensor`` ("" is the package's
``__init__``); a module belongs to the entry naming it or its nearest enclosing package."""


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(module: str, source: str, *, package: bool) -> list[tuple[str, int, bool]]:
    """(dotted name, line, only for annotations) of every import in ``source`` (of ``module``, a
    ``package``'s ``__init__`` or not), at any depth: module level, inside functions, and under
    ``if TYPE_CHECKING:`` (the third value True); ``from a import b`` gives ``a.b`` (a module, or
    a name in ``a``)."""
    names: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            names.extend((alias.name, node.lineno, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level - 1 packages
                parts = module.split(".") if package else module.split(".")[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""])
            else:
                base = node.module or ""
            names.extend(
                (f"{base.rstrip('.')}.{alias.name}", node.lineno, type_only) for alias in node.names
            )
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(source), False)
    return names


def import_graph(*, with_type_only: bool = True) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: first line importing it}; imports only for
    annotations count unless ``with_type_only`` is False."""
    modules = module_files()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        source = path.read_text()
        imported = _imported_names(module, source, package=path.name == "__init__.py")
        for name, line, type_only in imported:
            if type_only and not with_type_only:
                continue
            while name and name not in modules:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def layer_of(module: str) -> int:
    """The position in ``LAYERS`` of the entry naming ``module`` or its nearest package."""
    relative = module.removeprefix("upipe_dtensor").removeprefix(".")
    owners = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
    name = relative
    while name not in owners:
        if not name:
            raise KeyError(module)
        name = name.rpartition(".")[0]
    return owners[name]


def test_graph_sees_imports() -> None:
    """The parser finds what it must: a function-level import, a relative one, and one under
    TYPE_CHECKING, marked as such (checked on a snippet, so a parser bug cannot pass the tests
    below vacuously)."""
    graph = import_graph()
    assert "upipe_dtensor.train.build" in graph["upipe_dtensor.commands.eval_common"]
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import schema\n"
        "if TYPE_CHECKING:\n"
        "    from upipe_dtensor.train import build\n"
        "def f():\n"
        "    from upipe_dtensor.kernels import probe\n"
    )
    imported = _imported_names("upipe_dtensor.config.loader", source, package=False)
    assert ("upipe_dtensor.config.schema", 2, False) in imported
    assert ("upipe_dtensor.kernels.probe", 6, False) in imported
    assert ("upipe_dtensor.train.build", 4, True) in imported


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    described = [
        " -> ".join(component)
        + ": "
        + "; ".join(
            f"{source} imports {target} (line {graph[source][target]})"
            for source in component
            for target in component
            if target in graph[source]
        )
        for component in found
    ]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_every_module_has_a_layer() -> None:
    unplaced = []
    for module in module_files():
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"modules in no entry of LAYERS (tests/test_layering.py): {unplaced}"


def package_of(module: str) -> str:
    """The top-level sub-package of ``upipe_dtensor`` holding ``module`` (a module at the package
    top is its own; "" is the package's ``__init__``)."""
    return module.removeprefix("upipe_dtensor").removeprefix(".").partition(".")[0]


def package_graph() -> tuple[dict[str, dict[str, int]], dict[tuple[str, str], list[str]]]:
    """package -> {imported package: number of imports}, and for each such edge the imports
    that make it ("path:line imports module")."""
    modules = module_files()
    graph: dict[str, dict[str, int]] = {package_of(module): {} for module in modules}
    imports: dict[tuple[str, str], list[str]] = {}
    for source, edges in import_graph().items():
        for target, line in edges.items():
            edge = package_of(source), package_of(target)
            if edge[0] == edge[1]:
                continue
            graph[edge[0]][edge[1]] = graph[edge[0]].get(edge[1], 0) + 1
            where = modules[source].relative_to(ROOT)
            imports.setdefault(edge, []).append(f"{where}:{line} imports {target}")
    return graph, imports


def shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the first node of ``component`` (a strongly connected one),
    as its nodes in order (breadth first)."""
    start, members = component[0], set(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target not in members:
                    continue
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1]
                if target not in parents:
                    parents[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def test_no_package_cycles() -> None:
    """No two packages import each other, directly or through others; a failure prints one
    shortest cycle of each knot, with every import of each of its edges (file:line)."""
    graph, imports = package_graph()
    found = cycles(graph)
    described = []
    for component in found:
        cycle = shortest_cycle(graph, component)
        names = [name or "upipe_dtensor" for name in cycle]
        knot = sorted(name or "upipe_dtensor" for name in component)
        lines = [f"packages {knot}; one cycle: {' -> '.join([*names, names[0]])}"]
        for source, target in zip(cycle, [*cycle[1:], cycle[0]]):
            lines.append(f"  {source or 'upipe_dtensor'} -> {target or 'upipe_dtensor'}:")
            lines.extend(f"    {where}" for where in imports[source, target])
        described.append("\n".join(lines))
    assert not found, "package import cycles:\n" + "\n".join(described)


def test_package_cycles_are_found() -> None:
    """The package cycle test fails on a cycle of packages that no module cycle shows (a.x ->
    b.y, b.z -> a.w), naming both edges' imports (checked on a made-up graph)."""
    graph = {"a": {"b": 1}, "b": {"a": 1, "c": 1}, "c": {}}
    assert cycles(graph) == [["a", "b"]]
    assert shortest_cycle(graph, ["a", "b"]) == ["a", "b"]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == [["a", "b", "c"]]
    assert shortest_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}, ["a", "b", "c"]) == [
        "a",
        "b",
        "c",
    ]


def test_layers_import_downwards() -> None:
    graph = import_graph()
    upward = [
        f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} "
        f"({LAYERS[layer_of(target)][0]}) at line {line}"
        for source, edges in sorted(graph.items())
        for target, line in sorted(edges.items())
        if layer_of(target) > layer_of(source)
    ]
    order = " < ".join(name for name, _ in LAYERS)
    assert not upward, f"upward imports (order: {order}):\n" + "\n".join(upward)


LAYOUT_LINE = re.compile(r"^(upipe_dtensor/\S+\.py)\s+\S")


def documented_layout() -> list[str]:
    """The module files the "Layout" section of docs/design.md names, one per line, in order."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, 'docs/design.md has no "## Layout" section'
    return [m.group(1) for line in section.group(1).splitlines() if (m := LAYOUT_LINE.match(line))]


def test_design_layout_names_every_module() -> None:
    named = documented_layout()
    tree = sorted(str(path.relative_to(ROOT)) for path in module_files().values())
    repeated = sorted({name for name in named if named.count(name) > 1})
    missing = sorted(set(tree) - set(named))
    extra = sorted(set(named) - set(tree))
    assert not (missing or extra or repeated), (
        f'docs/design.md "Layout": missing {missing}, naming files that do not exist {extra}, '
        f"named twice {repeated}"
    )


def test_console_scripts_are_the_commands() -> None:
    """Each ``[project.scripts]`` entry point names the ``main`` of a ``python -m`` module at the
    package top, a callable taking the arguments and returning the exit code (None: the
    process's arguments, and the process ends with the code, as under ``python -m``); and every
    such module has its entry point."""
    import importlib
    import inspect

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    commands = {"plan", "evaluate", "convert", "gpu_check", "data_report", "tokenize"}
    assert {f"upipe-{name.replace('_', '-')}" for name in commands} == set(scripts)
    for script, target in scripts.items():
        module_name, _, attribute = target.partition(":")
        assert module_name.removeprefix("upipe_dtensor.") in commands, (script, target)
        main = getattr(importlib.import_module(module_name), attribute)
        signature = inspect.signature(main)
        assert list(signature.parameters) == ["argv"], (script, signature)
        assert signature.parameters["argv"].default is None, (script, signature)
        assert signature.return_annotation in (int, "int"), (script, signature)


TORCHTITAN_LAYOUT = re.compile(
    r"\b(qkv_linear|wqkv|heads_per_kv|freqs_cis|rope_cache|inner_attention|attn_type|"
    r"TORCHTITAN_VERSION|GENERATION|tt022|tt030)\b"
)
"""Names of torchtitan's attention layouts and of its generations, which only the adapters
(``models``) may read."""


def test_the_styles_know_no_model_layout_and_import_without_torchtitan() -> None:
    """``parallel/`` meets attention modules only through their adapters
    (``parallel.attention_interface``): no module there reads an attribute of a torchtitan
    layout or asks which torchtitan runs (code, not docstrings, is searched), imports torchtitan,
    or fails to import when torchtitan cannot be imported (a subprocess blocks it)."""
    found = []
    for path in sorted((PACKAGE / "parallel").glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = [owner.body[0].value for owner in _docstring_owners(tree)]
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node not in docstrings:
                    names = [node.value]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            for name in names:
                if TORCHTITAN_LAYOUT.search(name) or name.split(".")[0] == "torchtitan":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name!r}")
    assert not found, "\n".join(found)
    blocked = "import sys; sys.modules['torchtitan'] = None; import upipe_dtensor.parallel"
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def _docstring_owners(tree: ast.Module) -> list[ast.AST]:
    """The module, classes and functions whose first statement may be a docstring."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    ]
