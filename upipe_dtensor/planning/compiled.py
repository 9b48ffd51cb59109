"""Compiled blocks in a plan: the graphs inductor compiles, run on fake tensors the way its
generated code runs them.

A planned job with ``[compile] enable`` compiles its blocks as a real one does, through dynamo and
AOTAutograd set up as inductor sets them up (inductor's decompositions, joint-graph passes and
min-cut partitioner, then its post-grad passes). The forward and backward graphs are therefore the
ones inductor lowers, and the plan holds what the compiled step holds: the compiled forward's saved
tensors (produced again by the checkpoint's recompute) and what the compiled backward keeps
alive, not what the eager step would. Dynamo compiles under the planner's dispatch modes because
they step aside while it compiles (``ignore_compile_internals``). Instead of generating kernels,
this backend then replays each graph on the planner's fake tensors as inductor's generated code
runs it:

- what inductor calls rather than generates (the project's custom ops, matmuls, every op it has no
  lowering for) runs as itself; the project's ops run their Python bodies, whose buffers the
  tracker sees, as in an eager plan;
- the other ops fuse along their data, unless a call would then sit both before and after the
  kernel, and groups that become ready at the same point and read the same input fuse too; a
  kernel runs as soon as its inputs are ready, reads them and writes the values used after it
  once; only those are allocated, and ``StepWorkCounter.count_fused_kernel`` counts one launch
  and those bytes;
- a kernel writes a value into the buffer of an input that dies there with the same shape,
  strides and dtype, and that only the ops computing that value read (inductor's in-place reuse;
  a backward may so reuse the saved tensors AOTAutograd donates), and every buffer is freed after
  its last use, inputs included.

This is a model of inductor's scheduler (which is not run): tests/test_planner.py checks the
planned peak against real compiled steps on CPU, where inductor's own code runs.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import fx

from upipe_dtensor.kernels.fused import restored_backend
from upipe_dtensor.kernels.op_mode import project_ops
from upipe_dtensor.modes.compiles import compiles_shared, sharing_compiles
from upipe_dtensor.planning.tracker import untracked
from upipe_dtensor.runtime.torch_private import (
    OpOverload,
    current_dispatch_mode_stack,
    dynamo_config,
    dynamo_reset,
)

PLANNER_BACKEND = "upipe_planned_inductor"
"""The dynamo backend name the planner compiles blocks with (registered by ``register``)."""

aten = torch.ops.aten
_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution}
"""Ops inductor lowers to library calls (cuBLAS, oneDNN), not to generated kernels."""


@dataclass
class _Kernel:
    """Ops inductor fuses into one kernel, and the values it stores (used after it)."""

    nodes: list[fx.Node]
    stored: list[fx.Node] = field(default_factory=list)
    """Values the kernel writes to memory: compute nodes used after it, in graph order."""
    aliases: list[fx.Node] = field(default_factory=list)
    """Views of stored values used after it, re-taken on the stored buffers."""
    others: bool = False
    """Whether a value used after it is neither stored nor a view (a scalar, a tuple): then its
    ops run on the fake tensors; otherwise the stored values' layouts are the graph's own."""


def _is_extern(node: fx.Node) -> bool:
    """An op inductor calls rather than generates code for."""
    from upipe_dtensor.runtime.torch_private import fallbacks, lowerings

    target = node.target
    if not isinstance(target, OpOverload):
        return False
    if target.namespace not in ("aten", "prims"):
        return True
    return target.overloadpacket in _MATMULS or target not in lowerings or target in fallbacks


def _is_alias(node: fx.Node) -> bool:
    """A view or an element of a tuple: no kernel, no memory."""
    target = node.target
    return target is operator.getitem or (isinstance(target, OpOverload) and target.is_view)


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return list(dict.fromkeys(node.all_input_nodes))


def _schedule(graph: fx.Graph) -> list[fx.Node | _Kernel]:
    """The graph as inductor's code runs it: inputs, the calls it makes, views of values in
    memory, and fused kernels. Ops fuse along their data unless that would put a call both before
    and after the kernel (a cycle through the call); a kernel runs as soon as its inputs are
    ready, and is split where a call needs one of its values before another of its ops can run."""
    nodes = list(graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    extern = {node for node in nodes if _is_extern(node)}
    needs: dict[fx.Node, frozenset[fx.Node]] = {}  # the calls each node depends on
    for node in nodes:
        upstream = set()
        for source in _tensor_inputs(node):
            upstream |= needs[source] | ({source} if source in extern else set())
        needs[node] = frozenset(upstream)
    feeds: dict[fx.Node, frozenset[fx.Node]] = {}  # the calls that depend on each node
    for node in reversed(nodes):
        downstream = set()
        for user in node.users:
            downstream |= feeds[user] | ({user} if user in extern else set())
        feeds[node] = frozenset(downstream)
    parent: dict[fx.Node, fx.Node] = {}
    group_needs: dict[fx.Node, set[fx.Node]] = {}
    group_feeds: dict[fx.Node, set[fx.Node]] = {}
    for node in nodes:
        if node.op != "call_function" or node in extern:
            continue
        sources = [s for s in _tensor_inputs(node) if s in parent]
        if _is_alias(node) and not sources:
            continue  # a view of a value in memory: a step of its own
        parent[node] = node
        group_needs[node], group_feeds[node] = set(needs[node]), set(feeds[node])
        for source in sources:
            a, b = _root(parent, source), _root(parent, node)
            if a is b or group_feeds[a] & group_needs[b] or group_feeds[b] & group_needs[a]:
                continue
            parent[a] = b
            group_needs[b] |= group_needs.pop(a)
            group_feeds[b] |= group_feeds.pop(a)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in parent:
        groups.setdefault(_root(parent, node), []).append(node)
    # When each value is in memory: a call's result at the call, a view with what it views.
    ready: dict[fx.Node, float] = {}
    placed: list[tuple[float, fx.Node | _Kernel]] = []
    for node in nodes:
        if node in parent:
            continue
        if _is_alias(node) and node.op == "call_function":
            ready[node] = ready[node.args[0]] + 0.25
        else:
            ready[node] = order[node]
        placed.append((ready[node], node))
    # Kernels that become ready together and read the same input fuse too (horizontally).
    kernels: list[tuple[float, set[fx.Node], list[fx.Node]]] = []  # (ready at, inputs, ops)
    for members in groups.values():
        for part in _in_time(members, order):
            inside = set(part)
            inputs = {s for n in part for s in _tensor_inputs(n) if s not in inside}
            at = max((ready.get(s, order[s]) for s in inputs), default=-1.0)
            same = next((k for k in kernels if k[0] == at and k[1] & inputs), None)
            if same is None:
                kernels.append((at, inputs, part))
            else:
                same[1].update(inputs)
                same[2].extend(part)
    for at, _, members in kernels:
        members.sort(key=order.__getitem__)
        placed.append((at + 0.5, _kernel(members)))
    return [step for _, step in sorted(placed, key=lambda item: item[0])]


def _root(parent: dict[fx.Node, fx.Node], node: fx.Node) -> fx.Node:
    while parent[node] is not node:
        parent[node] = parent[parent[node]]
        node = parent[node]
    return node


def _in_time(members: list[fx.Node], order: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """``members`` (graph order) as kernels that each run before anything outside needs them:
    cut before the first member that comes after an outside user of an earlier member."""
    inside = set(members)
    parts: list[list[fx.Node]] = [[]]
    needed_by = len(order)
    for node in members:
        if order[node] > needed_by:
            parts.append([])
            needed_by = len(order)
        parts[-1].append(node)
        outside = [order[user] for user in node.users if user not in inside]
        needed_by = min([needed_by, *outside])
    return parts


def _kernel(nodes: list[fx.Node]) -> _Kernel:
    """The kernel of ``nodes``: which of their values it stores, which views it re-takes."""
    members = set(nodes)
    kernel = _Kernel(nodes)
    needed: set[fx.Node] = set()
    for node in reversed(nodes):
        if node in needed or any(user not in members for user in node.users):
            if _is_alias(node) and node.target is not operator.getitem and node.args[0] in members:
                kernel.aliases.append(node)
                needed.add(node.args[0])
            elif isinstance(node.meta.get("val"), torch.Tensor):
                kernel.stored.append(node)
            else:
                kernel.others = True
    kernel.stored.reverse()
    kernel.aliases.reverse()
    return kernel


def _cone(node: fx.Node, members: set[fx.Node]) -> set[fx.Node]:
    """The ops of a kernel that ``node`` is computed from, itself included."""
    cone, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in members and current not in cone:
            cone.add(current)
            stack.extend(current.all_input_nodes)
    return cone


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _owns_storage(tensor: torch.Tensor) -> bool:
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == _nbytes(tensor)


class Replay:
    """One forward or backward graph, run on fake tensors as inductor's code would run it."""

    def __init__(self, gm: fx.GraphModule, donated: frozenset[int] = frozenset()) -> None:
        """``donated``: the inputs (by position) whose buffers the graph may write to: the
        saved tensors a backward uses last (AOTAutograd's ``bw_donated_idxs``)."""
        self._boxed_call = True  # called with a list it empties, so inputs can die early
        self.module = gm
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        self.donated = {placeholders[index] for index in donated}
        self.steps = _schedule(gm.graph)
        self.ops = project_ops()
        at: dict[fx.Node, int] = {}
        for index, step in enumerate(self.steps):
            for node in step.nodes if isinstance(step, _Kernel) else [step]:
                at[node] = index
        self.release: dict[int, list[fx.Node]] = {}
        for node, index in at.items():
            last = max((at[user] for user in node.users), default=index)
            self.release.setdefault(last, []).append(node)
        self.last_step = {node: max((at[u] for u in node.users), default=-1) for node in at}

    def __call__(self, args: list) -> list:
        env: dict[fx.Node, object] = {}
        inputs = list(reversed(args))  # popped one by one: no reference outlives its last use
        args.clear()
        result = None
        for index, step in enumerate(self.steps):
            if isinstance(step, _Kernel):
                self.launch(step, env, index)
            elif step.op == "placeholder":
                env[step] = inputs.pop()
            elif step.op == "output":
                result = list(fx.node.map_arg(step.args[0], env.__getitem__))
            else:
                env[step] = self.call(step, env)
            for node in self.release.get(index, ()):
                env.pop(node, None)
        return result

    def call(self, node: fx.Node, env: dict) -> object:
        """A call inductor makes as it is (the project's ops run their bodies)."""
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "get_attr":
            return getattr(self.module, node.target)
        spec = self.ops.get(node.target)
        if spec is not None:
            return spec.body(*args, **kwargs)
        return node.target(*args, **kwargs)

    def launch(self, kernel: _Kernel, env: dict, index: int) -> None:
        """One fused kernel: a buffer for each value it stores (an input's, when that input dies
        here), laid out as the graph's fake values recorded when it was compiled (static shapes:
        the same layouts the ops give now), and one launch counted. A kernel whose later users
        need other values (scalars, tuples) works its values out first, without memory."""
        members = set(kernel.nodes)
        if kernel.others:
            with untracked():
                for node in kernel.nodes:
                    env[node] = self.call(node, env)
        sources = [
            source
            for source in dict.fromkeys(s for n in kernel.nodes for s in _tensor_inputs(n))
            if source not in members and isinstance(env.get(source), torch.Tensor)
        ]
        needed_later = {
            value.untyped_storage()._cdata
            for node, value in env.items()
            if isinstance(value, torch.Tensor) and self.last_step.get(node, -1) > index
        }
        readers = {  # inputs whose buffer dies here -> the ops of the kernel that read them
            source: {n for n in kernel.nodes if source in n.all_input_nodes and not _is_alias(n)}
            for source in sources
            if (source.op != "placeholder" or source in self.donated)
            and _owns_storage(env[source])
            and env[source].untyped_storage()._cdata not in needed_later
        }
        nbytes = sum(_nbytes(env[source]) for source in sources)
        for node in kernel.stored:
            value = env[node] if kernel.others else node.meta["val"]
            cone = _cone(node, members)
            reuse = next(
                (  # an input only the ops computing this value read, of its layout (inductor)
                    source
                    for source, ops in readers.items()
                    if ops
                    and ops <= cone
                    and (env[source].shape, env[source].stride(), env[source].dtype)
                    == (value.shape, value.stride(), value.dtype)
                ),
                None,
            )
            if reuse is not None:
                env[node] = env[reuse]
                del readers[reuse]
            else:
                env[node] = torch.empty_strided(
                    value.shape, value.stride(), dtype=value.dtype, device=value.device
                )
            nbytes += _nbytes(value)
        for node in kernel.aliases:
            env[node] = self.call(node, env)
        for mode in current_dispatch_mode_stack():
            count = getattr(mode, "count_fused_kernel", None)
            if count is not None:
                count(nbytes)


def _replay(
    gm: fx.GraphModule, example_inputs, is_inference: bool = False, is_backward: bool = False
) -> Replay:
    """A "compiler" for AOTAutograd: inductor's post-grad passes, then ``Replay``."""
    from upipe_dtensor.runtime.torch_private import (
        V,
        detect_fake_mode,
        get_donated_idxs,
        recursive_post_grad_passes,
    )

    with V.set_fake_mode(detect_fake_mode(example_inputs)):
        recursive_post_grad_passes(gm, is_inference)
    gm.recompile()
    return Replay(gm, frozenset(get_donated_idxs() or ()) if is_backward else frozenset())


def planned_inductor(gm: fx.GraphModule, example_inputs: list) -> object:
    """The dynamo backend: inductor's AOTAutograd set-up, graphs replayed (module docstring)."""
    import functools

    from upipe_dtensor.runtime.torch_private import aot_autograd, partition_fn, select_decomp_table

    return aot_autograd(
        fw_compiler=_replay,
        bw_compiler=functools.partial(_replay, is_backward=True),
        inference_compiler=functools.partial(_replay, is_inference=True),
        decompositions=select_decomp_table(),
        partition_fn=partition_fn,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def register() -> None:
    """Make ``PLANNER_BACKEND`` a dynamo backend name (once)."""
    from upipe_dtensor.runtime.torch_private import COMPILER_FNS, register_backend

    if PLANNER_BACKEND not in COMPILER_FNS:
        register_backend(planned_inductor, name=PLANNER_BACKEND)


RECOMPILE_LIMIT = 1024
"""Graphs dynamo may hold per function while planning (its default is 8): plans sharing their
graphs (``shared_compiles``) add a few each, for new lengths, tile sizes and head stages."""


@contextlib.contextmanager
def shared_compiles() -> Iterator[None]:
    """Around the plans of a search: a plan keeps the graphs the plans before it compiled and
    compiles only those whose guards fail (dynamo checks every shape, stride, dtype and setting a
    graph depends on, so a kept graph is the one the plan would compile), instead of compiling
    every block and tile kernel again: plans at the same length compile about a third of a plan's
    time less, at another length the full-size tiles' kernels are still kept. Dynamo's caches are
    empty when the outermost scope begins and ends, as around a single plan."""
    previous = compiles_shared()
    try:
        with sharing_compiles():
            if not previous:
                dynamo_reset()
            yield
    finally:
        if not previous:
            dynamo_reset()


@contextlib.contextmanager
def fresh_compiles(enabled: bool) -> Iterator[None]:
    """Around a planned step: with compiled blocks, the planner's backend registered and dynamo's
    caches empty before and after (each plan compiles its own graphs, for its own shapes, which
    stay static: a sweep's other lengths do not make them dynamic), except inside
    ``shared_compiles``; the tile kernels' backend as it was before, either way. A function
    compiled more than ``RECOMPILE_LIMIT`` times fails the plan, where dynamo would run it eagerly
    and the plan would hold the eager step's memory."""
    with restored_backend():  # the planned job sets the tile kernels' backend: not ours
        if not enabled:
            yield
            return
        register()
        if not compiles_shared():
            dynamo_reset()
        try:
            with dynamo_config.patch(
                automatic_dynamic_shapes=False,
                recompile_limit=RECOMPILE_LIMIT,
                accumulated_recompile_limit=RECOMPILE_LIMIT,
                fail_on_recompile_limit_hit=True,
            ):
                yield
        finally:
            if not compiles_shared():
                dynamo_reset()
