"""The planner's and the stand-in's modes live in ``upipe_dtensor.modes`` (issue 48): no module
reads or sets another module's private module-level variable (a mode kept as a global), and the
modes package imports nothing else of the package, so every runtime layer may ask it.

The scan is static (``ast``), like ``test_layering``'s: ``from m import _x`` and ``m._x`` (``m``
bound to a module of the package) where ``_x`` is assigned at ``m``'s module level.
"""

from __future__ import annotations

import ast
import contextlib

import pytest
import torch
from test_layering import layer_of, module_files

pytestmark = pytest.mark.unit


def _private_variables(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for target in targets:
            if isinstance(target, ast.Name) and target.id.startswith("_"):
                if not target.id.endswith("__"):
                    names.add(target.id)
    return names


def test_no_module_reaches_another_modules_private_variables():
    modules = module_files()
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    private = {name: _private_variables(tree) for name, tree in trees.items()}
    offenders = []
    for module, tree in trees.items():
        bound: dict[str, str] = {}  # local name -> module of the package it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in private:
                for alias in node.names:
                    if alias.name in private[node.module] and node.module != module:
                        offenders.append(f"{module}:{node.lineno}: {node.module}.{alias.name}")
                    full = f"{node.module}.{alias.name}"
                    if full in private:
                        bound[alias.asname or alias.name] = full
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in private and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr in private[bound[node.value.id]]
                and bound[node.value.id] != module
            ):
                offenders.append(f"{module}:{node.lineno}: {bound[node.value.id]}.{node.attr}")
    assert not offenders, "another module's private variable (a mode belongs in modes/):\n" + (
        "\n".join(offenders)
    )


def test_the_modes_import_nothing_else_of_the_package():
    for name, path in module_files().items():
        if name.split(".")[:2] != ["upipe_dtensor", "modes"]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("upipe_dtensor"):
                assert node.module.startswith("upipe_dtensor.modes"), (name, node.module)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("upipe_dtensor"), (name, alias.name)


FAKE_TENSOR_BRANCHES = {
    "upipe_dtensor.kernels.attention._uses_flash_attn": "flash-attn's compiled module cannot run "
    "fake tensors: its aten twin is traced",
    "upipe_dtensor.kernels.traced_workspace.backward_workspace_held": "the planner's count of a "
    "CUDA backward's workspace, the one place it enters the kernels",
    "upipe_dtensor.kernels.backends.op_kernel": "a traced kernel choice: no GPU to probe",
    "upipe_dtensor.kernels.tiling.visited": "the loop shortcut (modes.loops)",
    "upipe_dtensor.kernels.document_blocks._segments": "fake document ids have no values",
    "upipe_dtensor.kernels.document_blocks.shared_document.compute": "fake document ids have no "
    "values",
    "upipe_dtensor.runtime.host_store.is_pinned": "a rehearsal's stand-ins have no pinned storage",
    "upipe_dtensor.models.long_context.init_sharded_weights": "fake parameters have no values",
    "upipe_dtensor.memory.grouped_swiglu.grouped_mm": "torch's meta grouped GEMM takes bf16 only "
    "while its CPU kernel computes float32: fake float32 tokens get the output's shape",
}
"""Every function below ``planning`` that asks whether a tensor is fake, and why: a branch the
fake tensors need to run at all, or the planner's accounting through its one named entry."""


def _fake_tensor_tests(module: str, tree: ast.Module) -> set[str]:
    """``module.function`` (nested functions by their path) of every reference to
    ``runtime.torch_private.is_fake`` in ``tree``, imported by name or reached on the module."""
    names, modules = set(), set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "upipe_dtensor.runtime.torch_private"
        ):
            names |= {alias.asname or alias.name for alias in node.names if alias.name == "is_fake"}
        if isinstance(node, ast.ImportFrom) and node.module == "upipe_dtensor.runtime":
            modules |= {a.asname or a.name for a in node.names if a.name == "torch_private"}
    found: set[str] = set()

    def visit(node: ast.AST, path: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            path = f"{path}.{node.name}"
        if (isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load)) or (
            isinstance(node, ast.Attribute)
            and node.attr == "is_fake"
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.add(path)
        for child in ast.iter_child_nodes(node):
            visit(child, path)

    visit(tree, module)
    return found


def test_fake_tensor_branches_below_the_planner_are_named():
    """A new fake-tensor branch in the runtime layers fails here: the planner's accounting belongs
    behind a seam (``modes``, ``kernels.traced_workspace``), not in another ``is_fake`` test."""
    planning = layer_of("upipe_dtensor.planning")
    found = set()
    for name, path in module_files().items():
        if layer_of(name) < planning and name != "upipe_dtensor.runtime.torch_private":
            found |= _fake_tensor_tests(name, ast.parse(path.read_text()))
    assert found == set(FAKE_TENSOR_BRANCHES), (
        f"new: {sorted(found - set(FAKE_TENSOR_BRANCHES))}; "
        f"gone: {sorted(set(FAKE_TENSOR_BRANCHES) - found)}"
    )


def test_the_fake_tensor_scan_sees_a_branch():
    source = (
        "from upipe_dtensor.runtime.torch_private import is_fake as fake\n"
        "from upipe_dtensor.runtime import torch_private\n"
        "def f(x):\n"
        "    def g():\n"
        "        return fake(x)\n"
        "    return torch_private.is_fake(x)\n"
        "def is_fake(group):\n"  # another module's own is_fake (fake process groups): not one
        "    return group\n"
    )
    found = _fake_tensor_tests("m", ast.parse(source))
    assert found == {"m.f", "m.f.g"}


def test_compiled_fused_calls_run_inside_the_rehearsals_context():
    from upipe_dtensor.kernels import fused
    from upipe_dtensor.modes.rehearsal import compiled_calls_inside

    entered = []

    @contextlib.contextmanager
    def context():
        entered.append(1)
        yield

    @fused.fused
    def double(x):
        return x * 2

    with fused.restored_backend():
        fused.use_backend("eager")
        with compiled_calls_inside(context):
            assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
        assert entered == [1]
        double(torch.ones(2))  # outside: the default context
        assert entered == [1]


def test_the_planner_empties_the_head_index_cache_through_the_modes():
    from upipe_dtensor.modes.traces import forget_per_trace_caches
    from upipe_dtensor.parallel.head_stages import head_index

    head_index((0, 1), torch.device("cpu"))
    assert head_index.cache_info().currsize
    forget_per_trace_caches()
    assert not head_index.cache_info().currsize
