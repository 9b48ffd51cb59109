"""Compiled blocks keep the same tensors on torch 2.11 and 2.13 (``memory.compiled_regions``).

A compiled block's backward is handed the gradient of the block's output; torch 2.13's engine
hands it boxed, so the graph frees it after its last use (the MLP's backward and the residual
sum), while torch 2.11's engine holds it until the node returns. There the block compiles as two
regions, whose MLP half returns, and frees that gradient, before the attention's backward.
Checked here on tiny models with a backend that partitions as inductor does and, as inductor's
code, takes its inputs boxed and frees every value after its last use (without inductor's code
generation, which takes minutes on CPU): on this torch the block's output gradient is freed
before the attention's backward, compiled as this torch compiles it or as regions; and the
regions compute the block.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from harness import rel_err, tiny_llama, tiny_qwen3
from torch import fx

from upipe_dtensor.memory.compiled_regions import compile_block, engine_holds_gradients
from upipe_dtensor.runtime.torch_private import (
    TorchDispatchMode,
    aot_autograd,
    counters,
    dynamo_reset,
    partition_fn,
)

pytestmark = pytest.mark.unit

SEQ = 64
MODELS = {"llama3": tiny_llama, "qwen3": tiny_qwen3}


def _freeing(gm: fx.GraphModule, example_inputs) -> object:
    """A graph "compiled" to run as inductor's code frees memory: its boxed inputs cleared, each
    value dropped after its last use (``fx.Interpreter``)."""

    def run(args: list) -> object:
        return fx.Interpreter(gm).boxed_run(args)

    run._boxed_call = True
    return run


FREEING = aot_autograd(fw_compiler=_freeing, bw_compiler=_freeing, partition_fn=partition_fn)
"""Inductor's partition, inductor's memory lifetimes, eager kernels."""


class _AttentionBackward(TorchDispatchMode):
    """Whether a watched gradient was alive when the first attention backward op ran."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.alive = False
        self.alive_at_attention: bool | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.alive_at_attention is None and "attention" in name and "backward" in name:
            self.alive_at_attention = self.alive
        return func(*args, **(kwargs or {}))


def _last_block_gradient_at_attention_backward(regions: bool | None) -> bool:
    """Whether the last block's output gradient is alive when its attention's backward starts,
    its blocks compiled with ``FREEING``."""
    dynamo_reset()
    model = tiny_llama(4, 2, SEQ, n_layers=1)
    for block in model.layers.values():
        compile_block(block, FREEING, regions=regions)
    watch = _AttentionBackward()

    def capture(grad: torch.Tensor) -> None:  # no reference kept: the engine's only
        watch.alive = True
        weakref.finalize(grad.untyped_storage(), setattr, watch, "alive", False)

    # the final norm's input is the last block's output (a hook outside the compiled code)
    model.norm.register_forward_pre_hook(
        lambda _, inputs: inputs[0].register_hook(capture) and None
    )
    tokens = torch.randint(0, 64, (1, SEQ))
    model(tokens).sum().backward()  # compiles forward and backward
    loss = model(tokens).sum()
    with watch:
        loss.backward()
    dynamo_reset()
    assert watch.alive_at_attention is not None, "no attention backward op seen"
    return watch.alive_at_attention


@pytest.mark.parametrize("regions", [None, True], ids=["as this torch compiles", "regions"])
def test_the_block_output_gradient_is_freed_before_the_attention_backward(regions) -> None:
    """The block's output gradient (N x D) is not held through its attention's backward, on
    torch 2.11 (regions) as on 2.13 (boxed gradients)."""
    assert not _last_block_gradient_at_attention_backward(regions)


def test_a_whole_compiled_block_holds_it_where_the_engine_holds_gradients() -> None:
    """The cause: compiled whole, the block keeps its output gradient through the attention's
    backward exactly where the engine holds a node's gradients (torch 2.11), not on 2.13."""
    assert _last_block_gradient_at_attention_backward(False) == engine_holds_gradients()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_regions_compute_the_block(family: str) -> None:
    """Compiled as regions, every block gives the uncompiled model's loss and gradients, under
    the same parameter names; the two regions compile once for all blocks (past dynamo's
    recompile limit, 8, a job's blocks would otherwise run eagerly)."""
    dynamo_reset()
    plain, regions = (MODELS[family](4, 2, SEQ, n_layers=3) for _ in range(2))
    for block in regions.layers.values():
        compile_block(block, "aot_eager", regions=True)
    tokens = torch.randint(0, 64, (2, SEQ))
    losses = []
    for model in (plain, regions):
        graphs = counters["stats"]["unique_graphs"]
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
    assert counters["stats"]["unique_graphs"] - graphs == 2
    assert rel_err(losses[1], losses[0]) < 1e-6
    for (name, a), b in zip(plain.named_parameters(), regions.parameters()):
        assert rel_err(b.grad, a.grad) < 1e-5, name
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in regions.named_parameters()]
    dynamo_reset()
