"""The time model counts a collective in whatever form torch dispatches it, or refuses the step:
an all-to-all as a list (c10d ``alltoall_``), one tensor (``alltoall_base_``) or a functional op
costs the same bytes, and an op without a rule is named, never silently left out.

In-process on PyTorch's fake process group: the collectives dispatch but move nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore

from upipe_dtensor.config import ConfigError
from upipe_dtensor.planning import step_work
from upipe_dtensor.planning.step_work import StepWorkCounter

pytestmark = pytest.mark.unit

WORLD = 4


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    yield
    dist.destroy_process_group()


def _counted(exchange) -> StepWorkCounter:
    counter = StepWorkCounter(torch.device("cpu"), torch.device("cpu"), gpus_per_node=WORLD)
    counter.counting = True
    with counter:
        exchange(torch.ones(WORLD * 6, 8))
    return counter


def _all_to_all_bytes(counter: StepWorkCounter) -> tuple[float, float]:
    traffic = counter.work.communication[("all_to_all", False)]
    return traffic.bytes, traffic.calls


def test_every_form_of_all_to_all_costs_the_same(fake_world) -> None:
    sent = WORLD * 6 * 8 * 4 * (WORLD - 1) / WORLD  # float32, all but this rank's own part

    def as_list(x):
        dist.all_to_all(list(torch.empty_like(x).chunk(WORLD)), list(x.chunk(WORLD)))

    def as_one_tensor(x):
        dist.all_to_all_single(torch.empty_like(x), x)

    def functional(x):
        funcol.all_to_all_single(x, None, None, dist.group.WORLD).wait()

    for exchange in (as_list, as_one_tensor, functional):
        counter = _counted(exchange)
        assert _all_to_all_bytes(counter) == (sent, 1), exchange.__name__
        counter.refuse_unpriced()  # priced: no refusal


def test_a_collective_without_a_rule_is_refused_by_name(fake_world, monkeypatch) -> None:
    rules = dict(step_work._COLLECTIVES)
    del rules[("c10d", "alltoall_")]
    monkeypatch.setattr(step_work, "_COLLECTIVES", rules)
    counter = _counted(
        lambda x: dist.all_to_all(list(torch.empty_like(x).chunk(WORLD)), list(x.chunk(WORLD)))
    )
    assert ("all_to_all", False) not in counter.work.communication
    with pytest.raises(ConfigError, match=r"runs c10d::alltoall_, a collective the step-time"):
        counter.refuse_unpriced()
