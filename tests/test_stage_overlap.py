"""Overlapped head stages: stage s+1's all-to-alls start before stage s's attention and are waited
for after it, in forward and in backward (and not at all with ``overlap_stages=False``).

The order is read from the op itself on one process over PyTorch's fake process group (the
exchanges are posted and waited as on a real group, no data moves): every ``Exchange`` records
how many attention kernels had run when it started and when it was waited for, and every
attention call names the exchanges its inputs came from. That outputs and gradients are exact
with overlap on is the parity grid's job (``test_equivalence``, which runs UPipe overlapped and
once synchronous).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from upipe_dtensor.parallel import all_to_all, staged_attention
from upipe_dtensor.parallel.attention_op import AttentionParams, AttentionWeights
from upipe_dtensor.parallel.head_schedule import make_head_schedule

pytestmark = pytest.mark.unit

HEADS, KV_HEADS, HEAD_DIM, DEGREE, TOKENS = 8, 2, 8, 2, 6


class _Probe:
    """Attention calls so far, and each exchange's start and wait in units of them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.attention_calls = 0
        self.started: dict[int, int] = {}  # id(exchange) -> attention calls before its start
        self.waited: dict[int, int] = {}  # id(exchange) -> attention calls before its wait
        self.source: dict[int, int] = {}  # id(result tensor) -> id(exchange)
        self.inputs: list[list[int]] = []  # per attention call: the exchanges of its inputs
        self.alive: list[all_to_all.Exchange] = []  # so that no id is reused
        init, result = all_to_all.Exchange.__init__, all_to_all.Exchange.result

        def start(exchange, *args) -> None:
            init(exchange, *args)
            self.alive.append(exchange)
            self.started[id(exchange)] = self.attention_calls

        def wait(exchange) -> torch.Tensor:
            out = result(exchange)
            self.alive.append(out)
            self.waited.setdefault(id(exchange), self.attention_calls)
            self.source[id(out)] = id(exchange)
            return out

        monkeypatch.setattr(all_to_all.Exchange, "__init__", start)
        monkeypatch.setattr(all_to_all.Exchange, "result", wait)
        for name, tensor_args in (
            ("attention_forward", (0,)),  # q_h (K/V open a block: checked through q)
            ("attention_backward", (0, 1, 4)),  # dO_h, q_h, o_h
        ):
            kernel = getattr(staged_attention, name)
            monkeypatch.setattr(staged_attention, name, self._attention(kernel, tensor_args))

    def _attention(self, kernel, tensor_args: tuple[int, ...]):
        def probe(*args, **kwargs):
            self.inputs.append([self.source[id(args[i])] for i in tensor_args])
            out = kernel(*args, **kwargs)
            self.attention_calls += 1
            return out

        return probe


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", rank=0, world_size=DEGREE, store=FakeStore())
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _run(group_name: str, heads_per_stage: int, overlap: bool) -> None:
    torch.manual_seed(0)
    dim = HEADS * HEAD_DIM
    x = torch.randn(1, TOKENS, dim, requires_grad=True)
    weights = [
        torch.randn(rows * HEAD_DIM, dim, requires_grad=True)
        for rows in (HEADS, KV_HEADS, KV_HEADS)
    ]
    wo = torch.randn(dim, dim, requires_grad=True)
    rope = torch.zeros(TOKENS, HEAD_DIM // 2, 2)
    rope[..., 0] = 1.0
    params = AttentionParams(
        head_group=group_name,
        head_degree=DEGREE,
        head_dim=HEAD_DIM,
        heads_per_stage=heads_per_stage,
        scale=HEAD_DIM**-0.5,
        backend="sdpa",
        overlap_stages=overlap,
    )
    y = staged_attention.staged_attention(x, AttentionWeights(*weights, wo), rope, None, params)
    y.sum().backward()


@pytest.mark.parametrize("overlap", [True, False])
def test_next_stage_exchanges_fly_during_this_stage_attention(
    fake_group: str, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    heads_per_stage = DEGREE  # U = C: four stages of one head per rank
    stages = len(make_head_schedule(HEADS, KV_HEADS, DEGREE, heads_per_stage).stages)
    probe = _Probe(monkeypatch)
    _run(fake_group, heads_per_stage, overlap)

    assert len(probe.inputs) == 2 * stages  # forward's attention calls, then backward's
    for call, exchanges in enumerate(probe.inputs):
        stage = call % stages  # the stage's index within its pass
        for exchange in exchanges:
            started, waited = probe.started[exchange], probe.waited[exchange]
            if overlap and stage > 0:
                # started before the previous stage's attention, waited after it
                assert (started, waited) == (call - 1, call), (call, exchange)
            else:
                assert started == waited == call, (call, exchange)

    consumed = {exchange for exchanges in probe.inputs for exchange in exchanges}
    returned = [e for e in probe.started if e not in consumed and probe.waited.get(e) is not None]
    in_flight = [probe.waited[e] - probe.started[e] for e in returned]
    # forward's outputs and backward's dQ go back to the sequence layout; overlapped, each but a
    # pass's last waits until the next stage's attention has run (the K/V gradients, once per
    # KV block, and a pass's last stage are waited for at once)
    assert in_flight.count(1) == (2 * (stages - 1) if overlap else 0)
    assert set(in_flight) <= ({0, 1} if overlap else {0})
