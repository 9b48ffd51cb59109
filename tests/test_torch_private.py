"""torch's private names only through ``upipe_dtensor/runtime/torch_private.py`` (issue 48).

A private torch name is a ``torch`` module path or name with a part that starts with ``_``
(``torch._dynamo``, ``torch.utils._python_dispatch``, ``torch._C._current_graph_task_id``,
``torch.overrides._pop_mode``): imported (``import``/``from ... import``, at any depth) or reached
as an attribute of ``torch`` or of a name bound to a torch module (``import torch.distributed as
dist``; ``dist._x``). ``torch.ops.<namespace>._op`` is not one: an op's name in the dispatcher
(``torch.ops.aten._flash_attention_forward``), which no Python module defines. The scan is static
(``ast``), like ``test_layering``'s; the compatibility module itself is the one file allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "upipe_dtensor"
COMPAT = PACKAGE / "runtime" / "torch_private.py"


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "torch":
        return False
    if parts[1:2] == ["ops"]:  # dispatcher op names, not Python modules
        return False
    return any(part.startswith("_") and not part.endswith("__") for part in parts[1:])


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for an attribute chain rooted at a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every private torch name ``source`` imports or reaches."""
    tree = ast.parse(source)
    torch_names: dict[str, str] = {}  # local name -> the torch module or name it is bound to
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if _private(alias.name):
                        found.append((node.lineno, alias.name))
                    local = alias.asname or alias.name.split(".")[0]
                    torch_names[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if _private(name):
                    found.append((node.lineno, name))
                torch_names[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            if head in torch_names and rest:
                name = f"{torch_names[head]}.{rest}"
                if _private(name):
                    found.append((node.lineno, name))
    return sorted(set(found))


def test_the_scan_sees_every_form():
    source = (
        "import torch\nimport torch._dynamo\nimport torch.distributed as dist\n"
        "from torch._subclasses.fake_tensor import is_fake\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import x\n"
        "from torch.overrides import _pop_mode\n"
        "def f():\n"
        "    from torch._inductor.lowering import lowerings\n"
        "    torch._C._current_graph_task_id()\n"
        "    dist._functional_collectives\n"
        "    torch.ops.aten._flash_attention_forward\n"
        "    torch.nn.functional.scaled_dot_product_attention\n"
    )
    names = [name for _, name in private_torch_uses(source)]
    assert "torch._dynamo" in names
    assert "torch._subclasses.fake_tensor.is_fake" in names
    assert "torch.utils._python_dispatch.TorchDispatchMode" in names
    assert "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.x" in names
    assert "torch.overrides._pop_mode" in names
    assert "torch._inductor.lowering.lowerings" in names
    assert "torch._C._current_graph_task_id" in names
    assert "torch.distributed._functional_collectives" in names
    assert not any(name.startswith("torch.ops") for name in names)
    assert not any("scaled_dot_product_attention" in name for name in names)


def test_private_torch_names_only_in_the_compatibility_module():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != COMPAT
        for line, name in private_torch_uses(path.read_text())
    ]
    assert not offenders, (
        "private torch names outside upipe_dtensor/runtime/torch_private.py (re-export them "
        "there, with what they are for and the torch versions checked):\n" + "\n".join(offenders)
    )


def test_the_compatibility_module_names_what_it_exports():
    import upipe_dtensor.runtime.torch_private as torch_private

    assert len(set(torch_private.__all__)) == len(torch_private.__all__)
    for name in torch_private.__all__:
        assert hasattr(torch_private, name), name
    assert private_torch_uses(COMPAT.read_text()), "the compat module imports torch's private names"
