"""Shared test helpers: run a function on N gloo ranks, build tiny Llama3 models, compare."""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

VOCAB = 64


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn: Callable, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raise failures."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _worker,
            args=(world_size, os.path.join(tmp, "store"), fn, args),
            nprocs=world_size,
            join=True,
        )


def tiny_llama(
    n_heads: int, n_kv_heads: int, seq_len: int, head_dim: int = 8, n_layers: int = 2, seed: int = 0
) -> Transformer:
    """A small torchtitan Llama3 with deterministic weights (identical on every rank)."""
    args = TransformerModelArgs(
        dim=n_heads * head_dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=VOCAB,
        max_seq_len=seq_len,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of the sequence dimension (dim 1)."""
    local = t.shape[1] // world_size
    return t[:, rank * local : (rank + 1) * local]


def summed_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients summed over all ranks (each rank's are partial: its shard's tokens)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grad = grad.detach().float().clone()
        dist.all_reduce(grad)
        grads[name] = grad
    return grads


def gather_sequence(local: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's sequence shard (dim 1) in rank order."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=1)


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only: ``model.to(dtype)`` would also cast the complex RoPE buffer to real."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
