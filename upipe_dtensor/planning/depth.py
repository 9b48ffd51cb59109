"""A plan whose cost does not grow with the model's depth: the step traced on a shallower model
that shows every distinct block, standing for the full one.

Every block of a flavor has the same shapes, saved tensors, kernels and collectives. What differs
along the depth is decided by a few settings, each one rule of the job's assembly: which blocks
keep their attention (``train.parallelize.keeps_attention``), which checkpoints park their input
in host memory (``memory.offload.offloads_group``), which blocks FSDP2 reshards after forward
(``train.parallelize.reshards_after_forward``), and the checkpoint groups blocks run in. A
*unit* is one checkpoint group (one block without groups); consecutive units alike under those
rules form a *run*.

What a unit does in the step depends on itself and its neighbours: its forward packs its own
input and gathers its own parameters; its backward fetches its input back unless the next unit's
backward prefetched it (``cpu_offload_prefetch``), and prefetches the previous unit's parameters,
block input and kept attention, and the parameters of the one before. Cut at the planner's phase
marks (``tracker.when``: a unit's forward, a unit's backward), the stretch of the step from one
unit's mark to the next, a *period*, depends on at most the unit and the next one (forward), or
the unit, the one before, whether there is one before that, and with the prefetch the next one
(backward). So in a run of n units f_0 .. f_{n-1} the forward periods of f_1 to f_{n-2} are
alike, and so are the backward periods of f_{n-1} down to f_2 (without the prefetch; with it, of
f_{n-2} down to f_2). The traced model keeps f_0, f_1 and the run's last unit (last two, with the
prefetch), whose neighbourhoods are the full model's; the full step is the traced one with copies
of f_1's forward period inserted after it and as many of the first traced backward period of the
run's end inserted after that (``planning.timeline``), one for each unit not traced. Runs of
fewer than 4 units (5 with the prefetch) are traced whole.

The parts of the step that loop over every parameter are not periods. FSDP2's set-up and
AdamW's states are counted for the blocks not traced from a traced twin's storages; the gradient
clipping, whose work and temporaries grow with the parameter count, runs over stand-in
parameters for them (``ElidedBlocks``); the optimizer step, one parameter at a time, needs only
the traced ones. The tests compare the result with the full trace (``plan --full-trace``) for the
shipped recipes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from upipe_dtensor.config import JobConfig
from upipe_dtensor.memory.offload import offloads_group
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.planning.tracker import LiveMemoryTracker
from upipe_dtensor.runtime.torch_private import queue_backward_callback
from upipe_dtensor.train.parallelize import keeps_attention, reshards_after_forward

ELIDED = "elided_layers"
"""The traced model's child module holding the stand-ins of the blocks it does not trace."""
_PHASE = re.compile(r"^(forward|backward \(recompute\)), block (\d+)$")
_BLOCK = re.compile(r"block (\d+)$")


def unit_signatures(config: JobConfig, n_layers: int) -> list[tuple]:
    """What sets each unit (checkpoint group) of an ``n_layers``-block model apart from the
    others: its size, which of its blocks keep their attention or reshard after forward, and
    whether its input is parked in host memory."""
    ac = config.activation_checkpoint
    size = ac.blocks_per_checkpoint if ac.mode == "full" else 1
    skip_last = ac.cpu_offload_skip_last
    signatures = []
    for first in range(0, n_layers, size):
        blocks = range(first, min(first + size, n_layers))
        signatures.append(
            (
                len(blocks),
                tuple(keeps_attention(config, block) for block in blocks),
                tuple(reshards_after_forward(config, block, n_layers) for block in blocks),
                ac.cpu_offload and offloads_group(first, len(blocks), n_layers, skip_last),
            )
        )
    return signatures


def _runs(signatures: list[tuple]) -> list[tuple[int, int]]:
    """(first unit, units) of each run of equal signatures."""
    runs: list[tuple[int, int]] = []
    for unit, signature in enumerate(signatures):
        if runs and signatures[runs[-1][0]] == signature:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((unit, 1))
    return runs


@dataclass(frozen=True)
class DepthReduction:
    """A job's model at reduced depth standing for the full one (module docstring)."""

    config: JobConfig
    """The traced job: the settings that count blocks from either end, for the traced depth."""
    n_layers: int
    """Blocks of the model planned."""
    traced_layers: int
    """Blocks of the model traced."""
    unit_blocks: int
    """Blocks per unit (the checkpoint groups' size)."""
    full_units: tuple[int, ...]
    """The planned model's unit each traced unit is."""
    copies: dict[tuple[str, int], int]
    """(phase, traced unit) -> copies of its period inserted right after it; phase "forward" or
    "backward"."""
    stand_ins: tuple[tuple[int, int], ...]
    """(planned block, traced block whose parameters and gradients it copies) for each block
    not traced."""

    def full_block(self, block: int) -> int:
        unit, offset = divmod(block, self.unit_blocks)
        return self.full_units[unit] * self.unit_blocks + offset

    def copy_block(self, phase: str, block: int, copy: int) -> int:
        """The planned block that copy ``copy`` (0: the first inserted) of traced ``block``'s
        period of ``phase`` stands for: the run's next units in forward, its previous ones in
        backward, which runs the blocks in reverse."""
        unit, offset = divmod(block, self.unit_blocks)
        step = 1 if phase == "forward" else -1
        return (self.full_units[unit] + step * (copy + 1)) * self.unit_blocks + offset

    def period_of(self, when: str) -> tuple[str, int] | None:
        """(phase, traced unit) a phase mark names, or None outside the blocks."""
        match = _PHASE.match(when)
        if match is None:
            return None
        phase = "forward" if match.group(1) == "forward" else "backward"
        return phase, int(match.group(2)) // self.unit_blocks

    def rename(self, when: str, phase: str | None = None, copy: int = 0) -> str:
        """``when`` of the traced step as the planned step says it: its block renumbered (as
        copy ``copy`` of a period of ``phase`` when one is given)."""
        match = _BLOCK.search(when)
        if match is None:
            return when
        block = int(match.group(1))
        full = self.full_block(block) if phase is None else self.copy_block(phase, block, copy)
        return f"{when[: match.start(1)]}{full}"


def reduce_depth(config: JobConfig) -> DepthReduction | None:
    """The reduced-depth model that stands for ``config``'s, or None where tracing every block is
    needed or costs no more: without full activation checkpointing (backward has no per-block
    phases to cut at) and when no run is long enough to shorten."""
    ac = config.activation_checkpoint
    if ac.mode != "full":
        return None
    n_layers = model_args(config.model, config.training.seq_len).n_layers
    size = ac.blocks_per_checkpoint
    signatures = unit_signatures(config, n_layers)
    # A unit's backward fetches its own input unless the next one's prefetched it: with the
    # prefetch the backward template needs its next unit in the run too (module docstring).
    tail = 2 if ac.cpu_offload and ac.cpu_offload_prefetch else 1
    shortest = 3 + tail
    traced: list[int] = []
    copies: dict[tuple[str, int], int] = {}
    stand_ins: list[tuple[int, int]] = []
    for first, units in _runs(signatures):
        if units < shortest:
            traced += range(first, first + units)
            continue
        base = len(traced)
        traced += [first, first + 1, *range(first + units - tail, first + units)]
        copies[("forward", base + 1)] = copies[("backward", base + 2)] = units - 2 - tail
        for unit in range(first + 2, first + units - tail):
            stand_ins += [
                (unit * size + offset, (base + 1) * size + offset)
                for offset in range(signatures[unit][0])
            ]
    if not copies:
        return None
    blocks = [
        block for unit in traced for block in range(unit * size, min((unit + 1) * size, n_layers))
    ]
    keeping = [keeps_attention(config, block) for block in blocks]
    parks = [signatures[unit][3] for unit in traced for _ in range(signatures[unit][0])]
    changes = {}
    if any(keeping):
        changes["keep_attention_skip_first"] = keeping.index(True)
    if ac.cpu_offload:
        changes["cpu_offload_skip_last"] = len(blocks) - sum(parks)
    reduced = dataclasses.replace(config, activation_checkpoint=dataclasses.replace(ac, **changes))
    expected = [signatures[unit] for unit in traced]
    if unit_signatures(reduced, len(blocks)) != expected:
        raise AssertionError(
            f"the reduced-depth model of {len(blocks)} blocks does not lay out its blocks as "
            f"the planned {n_layers} blocks' units {traced}: plan with --full-trace"
        )
    return DepthReduction(
        config=reduced,
        n_layers=n_layers,
        traced_layers=len(blocks),
        unit_blocks=size,
        full_units=tuple(traced),
        copies=copies,
        stand_ins=tuple(stand_ins),
    )


def _storages(tensors) -> dict[int, torch.Tensor]:
    """One tensor per distinct storage among ``tensors`` (DTensors by their local shards)."""
    found: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        found.setdefault(local.untyped_storage()._cdata, local)
    return found


def _alias(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A DTensor (``tensor`` is one) on ``tensor``'s own shard: no new storage, no op."""
    return DTensor(tensor._local_tensor, tensor._spec, requires_grad=requires_grad)


class ElidedBlocks:
    """Stand-ins for the blocks a reduced-depth plan does not trace (module docstring), made
    right before the step (``tracked_step``'s ``set_up``). Each is a traced block's twin: its
    parameters, a child of the traced model, share the template's shards, and at the end of each
    backward that gives the template gradients they get the template's gradients, so the gradient
    clipping reads the planned model's gradients. What the planned model holds beside is counted
    without being made: its parameters' and optimizer states' storage now, its gradients in the
    inserted periods, freed with the template's (``LiveMemoryTracker.stand_for``).

    The optimizer steps the traced parameters only: the planner's AdamW (on CPU stand-ins,
    neither fused nor foreach) updates one parameter at a time in place and holds one
    parameter's temporaries beside the previous one's; the traced blocks show every such pair of
    neighbours the planned model has, so the step's peak is the planned model's."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        reduction: DepthReduction,
        tracker: LiveMemoryTracker,
    ) -> None:
        (group,) = optimizer.param_groups  # the trainer's one group
        if group.get("fused") or group.get("foreach"):
            raise AssertionError(
                "a reduced-depth plan needs the single-tensor AdamW of the planner's CPU "
                "stand-ins (not fused, not foreach): plan with --full-trace"
            )
        self.tracker = tracker
        layers = list(model.layers.values())
        self.pairs: list[list[tuple[nn.Parameter, nn.Parameter]]] = []
        holder = nn.ModuleList()
        for _block, template in reduction.stand_ins:
            templates = list(layers[template].parameters())
            params = nn.ParameterList(nn.Parameter(_alias(p, False)) for p in templates)
            held = [*templates, *(t for p in templates for t in optimizer.state[p].values())]
            for local in _storages(t for t in held if isinstance(t, torch.Tensor)).values():
                device, label, _ = tracker.record_of(local)
                tracker.count(device, label, local.untyped_storage().nbytes())
            for template_param, param in zip(templates, params, strict=True):
                optimizer.state[param] = optimizer.state[template_param]  # bytes counted above
            holder.append(params)
            self.pairs.append(list(zip(templates, params, strict=True)))
        model.add_module(ELIDED, holder)
        model.norm.register_full_backward_pre_hook(self._at_end_of_backward)
        optimizer.register_step_post_hook(self._after_step)

    def _at_end_of_backward(self, _module, _grad_output) -> None:
        queue_backward_callback(self._gradients)

    def _gradients(self) -> None:
        """Each stand-in's gradient, once its template has one (as FSDP2 assigns them: the
        post-accumulate-grad hooks run after)."""
        for block in self.pairs:
            given = [(t, p) for t, p in block if t.grad is not None and p.grad is None]
            for local in _storages(t.grad for t, _ in given).values():
                self.tracker.stand_for(local, 1)
            for template, param in given:
                param.grad = _alias(template.grad, False)
                for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
                    hook(param)

    def _after_step(self, *_) -> None:
        """The stand-ins' gradients go: their storage, the templates', goes with
        ``zero_grad``."""
        for block in self.pairs:
            for _, param in block:
                param.grad = None
