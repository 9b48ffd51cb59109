"""Which torchtitan generation runs (``models.generation``): the installed one is chosen, and
one this project does not run on, or 0.3.0 on a torch it does not import on, is refused in one
line naming what to install."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from upipe_dtensor.models import generation

pytestmark = pytest.mark.unit


def test_the_installed_generation_is_the_one_chosen() -> None:
    installed = importlib.metadata.version("torchtitan")
    assert generation.GENERATION == {"0.2": "tt022", "0.3": "tt030"}[installed[:3]]
    family = generation.family_module("llama3")
    assert family.__name__ == f"upipe_dtensor.models.{generation.GENERATION}.llama3"


@pytest.mark.parametrize(
    ("torchtitan", "torch_version", "message"),
    [
        ("0.3.0", "2.11.0+cu128", "torchtitan 0.3.0 needs torch >= 2.13, and torch 2.11.0+cu128"),
        ("0.4.0", "2.13.0", "torchtitan 0.4.0 is installed; upipe-dtensor runs on torchtitan"),
        ("0.1.0", "2.13.0", "pip install 'torchtitan>=0.2.2,<0.4'"),
    ],
)
def test_a_generation_that_cannot_run_is_refused_with_the_fix(
    monkeypatch, torchtitan: str, torch_version: str, message: str
) -> None:
    monkeypatch.setattr(generation, "TORCHTITAN_VERSION", torchtitan)
    monkeypatch.setattr(torch, "__version__", torch_version)
    with pytest.raises(ImportError) as refused:
        generation._generation()
    assert "\n" not in str(refused.value) and message in str(refused.value)


def test_torchtitan_0_2_2_runs_on_torch_2_11(monkeypatch) -> None:
    monkeypatch.setattr(generation, "TORCHTITAN_VERSION", "0.2.2")
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    assert generation._generation() == "tt022"
